"""``check.forwards`` at what is decided in this process (issue 30, the mutation pass over
``check/forwards.py``): the forward's fingerprint, which says whether two processes run the
same forward code (a floor measured under other code is not this forward's), and which
forward a phase runs. The rank side over gloo is ``test_forwards_gloo.py``'s."""

from __future__ import annotations

import sys
import textwrap
import types

import pytest
import torch

from weight_sync_bench.check import forwards

NAME = "wsb_fingerprint_probe"


@pytest.fixture
def probe(monkeypatch):
    """A module of the given source, registered as ``NAME``: its fingerprint."""
    def fingerprint(source: str, filename: str = "probe.py") -> str:
        module = types.ModuleType(NAME)
        exec(compile(textwrap.dedent(source), filename, "exec"), module.__dict__)
        monkeypatch.setitem(sys.modules, NAME, module)
        return forwards.forward_fingerprint((NAME,))
    return fingerprint


BASE = """
def f(x):
    return x + 1

class C:
    def m(self, y):
        return {"a", "b", 1.5, (2, b"xy")}
"""


def test_the_same_code_gives_the_same_fingerprint_and_any_change_another(probe):
    base = probe(BASE)
    assert base == probe(BASE) and len(base) == 16
    changed = [
        BASE.replace("x + 1", "x + 2"),              # a constant
        BASE.replace("x + 1", "x - 1"),              # the bytecode
        BASE.replace("return {", "return {'c', "),   # a member of a frozenset constant
        BASE.replace('b"xy"', 'b"xz"'),              # bytes
        BASE.replace("(2, b", "(3, b"),              # inside a nested tuple
        BASE.replace("def m(self, y)", "def m(self, z)").replace("y):", "z):"),  # a name
        BASE.replace("def f(x):", "\ndef f(x):"),     # where it starts (tracebacks differ)
        BASE.replace("def m(", "def n("),              # a method's name
        BASE + "\ndef g():\n    return None\n",       # one more function
        BASE.replace("return x + 1", "return (lambda: x + 1)()"),  # nested code
    ]
    assert len({base, *(probe(s) for s in changed)}) == len(changed) + 1
    assert probe(BASE, filename="other.py") != base  # the file a frame names


def test_what_the_module_only_imports_is_not_its_code(probe):
    base = probe(BASE)
    imported = BASE + "\nfrom textwrap import dedent\nfrom collections import OrderedDict\n"
    assert probe(imported) == base


def test_a_frozensets_order_does_not_move_the_fingerprint():
    digest = []
    for members in (frozenset({"a", "b", "c"}), frozenset({"c", "b", "a"})):
        d = forwards.hashlib.sha256()
        forwards._feed(d, members)
        digest.append(d.hexdigest())
    assert digest[0] == digest[1]


@pytest.mark.parametrize("a,b", [
    ((1, 2), ((1,), 2)),          # a tuple's nesting
    (b"ab", "ab"),                # bytes against str
    (1, 1.0),                     # the type of a constant
    (b"a", b"ab"),                # bytes of other length
    ((b"ab", b"c"), (b"a", b"bc")),  # where bytes end
])
def test_values_that_print_alike_feed_differently(a, b):
    digests = []
    for value in (a, b):
        d = forwards.hashlib.sha256()
        forwards._feed(d, value)
        digests.append(d.hexdigest())
    assert digests[0] != digests[1]


def test_the_forwards_own_modules_are_fingerprinted_by_default():
    assert forwards.forward_fingerprint() == forwards.forward_fingerprint(
        forwards.FORWARD_MODULES)
    assert forwards.forward_fingerprint() != forwards.forward_fingerprint(
        forwards.FORWARD_MODULES[:1])


def test_functions_lists_a_modules_functions_and_methods_sorted():
    module = types.ModuleType("m")
    exec(compile("def b(): pass\ndef a(): pass\nclass K:\n    def z(self): pass\n"
                 "    def y(self): pass\n    w = 3\n", "m.py", "exec"), module.__dict__)
    module.imported = textwrap.dedent  # defined elsewhere: not this module's
    assert [q for q, _ in forwards._functions(module)] == ["K.y", "K.z", "a", "b"]


@pytest.fixture
def pool_runs(monkeypatch):
    """The process's shared pool and ``run_phase1b`` standing in: what each was asked."""
    asked = []
    monkeypatch.setattr(forwards, "shared_pool", lambda size: asked.append(("pool", size))
                        or f"<pool of {size}>")

    def run_phase1b(config, degree, **kwargs):
        asked.append(("run", config, degree, kwargs))
        return forwards.Phase1bResult(torch.ones(1), None, (), ())
    monkeypatch.setattr(forwards, "run_phase1b", run_phase1b)
    return asked


def test_phase_1a_runs_in_this_process_and_phase_1b_over_the_shared_pool(pool_runs):
    assert forwards.phase_forward("1a") is forwards.inprocess_forward
    config, shards, tokens = object(), [{}, {}], torch.zeros(1, 2, dtype=torch.long)
    assert torch.equal(forwards.phase_forward("1b")(config, shards, tokens), torch.ones(1))
    assert pool_runs == [("pool", 4), ("run", config, 2, dict(
        param_seed=0, token_seed=0, shards=shards, tokens=tokens, pool="<pool of 4>",
        guard=None))]


def test_the_checkers_gloo_forward_ships_its_shards_and_guard_to_the_pool(pool_runs):
    guard, tokens = object(), torch.zeros(1, 2, dtype=torch.long)
    shards = [{}] * 6
    forwards.gloo_forward("<mine>")("config", shards, tokens, guard=guard)
    assert pool_runs == [("run", "config", 6, dict(
        param_seed=0, token_seed=0, shards=shards, tokens=tokens, pool="<mine>",
        guard=guard))]
    forwards.gloo_forward()("config", shards, tokens)
    assert pool_runs[1] == ("pool", 6) and pool_runs[2][3]["pool"] == "<pool of 6>"


def test_the_in_process_forward_is_the_sharded_models_rank_0_logits():
    from tests.sync.conftest import tiny
    from weight_sync_bench import layout_for
    from weight_sync_bench.collectives.inprocess import InProcessCollective
    from weight_sync_bench.layout.reshard import split
    from weight_sync_bench.model.config import init_params, make_tokens
    from weight_sync_bench.model.sharded import ShardedModel

    config = tiny(2, n_layers=1)
    shards = split(init_params(config, 0), layout_for(config), 2)
    tokens = make_tokens(config, 1000)
    got = forwards.inprocess_forward(config, shards, tokens)
    expected = ShardedModel(config, shards, InProcessCollective(2))(tokens)
    assert torch.equal(got, expected[0])


class Pool:
    """A rank pool standing in: records what it is asked to run; each rank's outcome."""

    def __init__(self, degree=2):
        self.asked = []
        self.size = degree

    def run(self, task, degree, *, kwargs, rank_kwargs, deadline, fault):
        self.asked.append((task, degree, kwargs, rank_kwargs, deadline, fault))
        return [{"logits": torch.full((1,), float(r)) if r == 0 else None,
                 "reference": torch.zeros(1) if r == 0 else None, "record": f"<sync {r}>",
                 "forward_code": f"<code {r}>", "shards": {"rank": r}}
                for r in range(degree)]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.closed = True


def split_module_level(full, degree):
    return [full] * degree


def test_run_phase1b_hands_every_rank_the_task_and_builds_the_result_from_rank_0():
    from tests.sync.conftest import tiny

    config, pool = tiny(2, n_layers=1), Pool()
    got = forwards.run_phase1b(config, 2, param_seed=3, token_seed=4, pool=pool,
                               split_fn=split_module_level, deadline=9.0, fault="<fault>")
    (task, degree, kwargs, rank_kwargs, deadline, fault), = pool.asked
    assert (task, degree, deadline, fault) == (forwards.phase1b_task, 2, 9.0, "<fault>")
    assert kwargs == {"config": config, "param_seed": 3, "token_seed": 4, "tokens": None,
                      "split_fn": split_module_level, "reference": False, "guard": None,
                      "return_shards": False}
    assert rank_kwargs == [{"shards": None}, {"shards": None}]
    assert torch.equal(got.logits, torch.zeros(1)) and torch.equal(got.reference, torch.zeros(1))
    assert got.records == ("<sync 0>", "<sync 1>")
    assert got.forward_codes == ("<code 0>", "<code 1>") and got.shards is None
    back = forwards.run_phase1b(config, 2, param_seed=0, token_seed=0, pool=pool,
                                return_shards=True, reference=True)
    assert pool.asked[-1][2]["reference"] and pool.asked[-1][2]["return_shards"]
    assert back.shards == ({"rank": 0}, {"rank": 1})


def test_run_phase1b_ships_given_shards_to_rank_0_only_checked_and_copied():
    from tests.sync.conftest import tiny
    from weight_sync_bench import layout_for
    from weight_sync_bench.errors import InvalidShards
    from weight_sync_bench.layout.reshard import split
    from weight_sync_bench.model.config import init_params

    config, pool = tiny(2, n_layers=1), Pool()
    shards = split(init_params(config, 0), layout_for(config), 2)
    forwards.run_phase1b(config, 2, param_seed=0, token_seed=0, pool=pool, shards=shards)
    (_, _, _, rank_kwargs, _, _), = pool.asked
    assert rank_kwargs[1] == {"shards": None}
    sent = rank_kwargs[0]["shards"]
    assert sent == shards and all(a is not b for a, b in zip(sent, shards))  # copies
    with pytest.raises(InvalidShards):
        forwards.run_phase1b(config, 2, param_seed=0, token_seed=0, pool=pool,
                             shards=shards[:1])
    assert len(pool.asked) == 1  # refused before any rank ran


def test_run_phase1b_refuses_what_no_rank_could_run_before_any_starts():
    from tests.sync.conftest import tiny

    config, pool = tiny(2, n_layers=1), Pool()
    with pytest.raises(ValueError, match=r"^run_phase1b: pass shards or split_fn, not both$"):
        forwards.run_phase1b(config, 2, param_seed=0, token_seed=0, pool=pool, shards=[],
                             split_fn=split_module_level)
    with pytest.raises(TypeError, match=r"^run_phase1b: split_fn <function .*<lambda>.*> must "
                                        r"be picklable by reference \(a module-level "
                                        r"function\) to run on rank 0: "):
        forwards.run_phase1b(config, 2, param_seed=0, token_seed=0, pool=pool,
                             split_fn=lambda full, degree: [full] * degree)
    assert not pool.asked


def test_run_phase1b_without_a_pool_runs_on_a_one_off_pool_of_its_degree(monkeypatch):
    from tests.sync.conftest import tiny

    made = []
    monkeypatch.setattr(forwards, "RankPool", lambda degree: made.append(Pool(degree))
                        or made[-1])
    forwards.run_phase1b(tiny(2, n_layers=1), 2, param_seed=0, token_seed=0, deadline=5.0,
                         fault="<fault>")
    assert made[0].size == 2 and made[0].closed
    assert made[0].asked[0][4:] == (5.0, "<fault>")  # the deadline and the fault hook too


def test_a_conventions_forward_over_gloo_ships_every_ranks_inputs_from_rank_0(monkeypatch):
    from types import SimpleNamespace

    asked = []

    class Shared:
        def run(self, task, degree, *, kwargs, rank_kwargs):
            asked.append((task, degree, kwargs, rank_kwargs))
            return ["<rank 0 logits>", None]
    monkeypatch.setattr(forwards, "shared_pool", lambda size: asked.append(size) or Shared())
    layout = SimpleNamespace(tp=2, config=SimpleNamespace(name="c"))
    inputs = [{"a": torch.zeros(2, dtype=torch.bfloat16)}, {"a": torch.ones(2)}]
    tokens, guard = torch.zeros(1, 2, dtype=torch.long), object()
    assert forwards.gloo_logits(layout, inputs, tokens, guard) == "<rank 0 logits>"
    size, (task, degree, kwargs, rank_kwargs) = asked
    assert (size, task, degree) == (4, forwards.conversion_forward_task, 2)
    assert kwargs == {"forward": layout, "tokens": tokens, "dtype": torch.bfloat16,
                      "guard": guard}  # rank 0's first tensor's dtype
    assert rank_kwargs[1] == {"inputs": None} and rank_kwargs[0]["inputs"] == inputs
    assert rank_kwargs[0]["inputs"][0] is not inputs[0]  # copies
    forwards.gloo_logits(SimpleNamespace(tp=0, config=layout.config), inputs * 3, tokens)
    assert asked[2] == 6 and asked[3][2]["guard"] is None  # no TP group: every rank one


def test_a_conventions_forward_over_replicas_of_its_tp_group_is_refused_saying_so(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(forwards, "shared_pool", lambda size: pytest.fail("a rank ran"))
    layout = SimpleNamespace(tp=2, config=SimpleNamespace(name="moe_few"))
    with pytest.raises(forwards.UnsupportedLayout, match=(
            r"^moe_few: over gloo the forward runs one TP group; this layout holds 4 "
            r"data-parallel replicas of TP 2 \(experts over 8 ranks\): check it in process "
            r"\(phase 1a\)$")):
        forwards.gloo_logits(layout, [{"a": torch.zeros(1)}] * 8, torch.zeros(1, 1))


def test_phase1b_logits_hands_run_phase1b_what_it_was_given(pool_runs):
    forwards.phase1b_logits("config", 2, param_seed=1, token_seed=2, pool="<p>",
                            shards="<shards>", split_fn="<fn>")
    assert pool_runs == [("run", "config", 2, dict(param_seed=1, token_seed=2, pool="<p>",
                                                   shards="<shards>", split_fn="<fn>"))]
    forwards.phase1b_logits("config", 4, param_seed=0, token_seed=0)
    assert pool_runs[-1][3] == dict(param_seed=0, token_seed=0, pool=None, shards=None,
                                    split_fn=None)


def test_the_floor_measurements_runner_asks_for_the_declared_split_on_the_shared_pool(
        monkeypatch):
    asked = []
    monkeypatch.setattr(forwards, "phase1b_logits",
                        lambda *a, **k: asked.append((a, k)) or "<logits>")
    monkeypatch.setattr(forwards, "shared_pool", lambda size: f"<pool of {size}>")
    assert forwards.phase1b_runner()("config", 2, 3, 4) == "<logits>"
    assert asked == [(("config", 2), dict(param_seed=3, token_seed=4, pool="<pool of 4>"))]
    forwards.phase1b_runner()("config", 8, 0, 0)
    assert asked[-1][1]["pool"] == "<pool of 8>"
    forwards.phase1b_runner("<mine>")("config", 8, 0, 0)
    assert asked[-1][1]["pool"] == "<mine>"


def test_the_in_process_forward_follows_its_routing_guard():
    """A guard that keeps every choice (bound infinite) and holds other choices than the
    reference's: the forward follows it, so the logits move."""
    from tests.sync.conftest import MOE_FEW as moe
    from tests.sync.conftest import forced_guard
    from weight_sync_bench import layout_for
    from weight_sync_bench.layout.reshard import split
    from weight_sync_bench.model.config import init_params, make_tokens

    shards = split(init_params(moe, 1), layout_for(moe), 2)
    tokens, guard = make_tokens(moe, 2), forced_guard(moe)
    assert not torch.equal(forwards.inprocess_forward(moe, shards, tokens),
                           forwards.inprocess_forward(moe, shards, tokens, guard=guard))
