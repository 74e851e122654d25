"""Phase 2's parent side, in process (issue 30, the mutation pass over ``sync/session.py``'s
``collect``, ``judge``, ``SyncResult.summary`` and ``bound``, ``raise_user_errors``,
``_named``, ``_stored_bytes``, ``no_forward``, ``stale_values``, ``existing_task``,
``drop_existing_task`` and ``InPlace``).

These turn every rank's record into the result a user reads: the figures per rank (bytes
summed over peers, the RSS growth given back the destination tensors that existed before
the run), the element checks of the destination ranks only, the verdict (the forward's
largest logit error, the first tensor that differs on any rank, the two sides named as a
user named them), the text, and the refusal of a resharder that raised or returned the
wrong structure on any rank (the last one too). Into existing storage, the destination
tensors are allocated once per session and destination layout, hold values that differ
from the right ones in every element before each run, and are what the run returns.

Records are built by hand (each figure distinct per rank) over real plans
(``plan_for(sync_layout(...))``), so no rank pool runs; the session's runs over gloo are
``tests/sync/test_cli.py``'s, ``test_existing.py``'s and ``test_weights.py``'s.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.sync.conftest import tiny
from weight_sync_bench.errors import InvalidUserShards, UserCodeError
from weight_sync_bench.sync import plan_for, sync_layout
from weight_sync_bench.sync import session as S
from weight_sync_bench.sync.minimum import minimum_bytes, naive_bytes
from weight_sync_bench.sync.planner import Plan
from weight_sync_bench.sync.verify import ElementCheck, generated

CONFIG = tiny(2)


def plan(src="megatron:4", dst="vllm:2", mutation=None, build_seconds=None):
    p = plan_for(sync_layout(CONFIG, src), sync_layout(CONFIG, dst))
    if mutation is None and build_seconds is None:
        return p
    return Plan(p.src, p.dst, p.transfers,
                p.build_seconds if build_seconds is None else build_seconds, mutation)


def element(rank, checked=10, total=10, differ=(), lines=()):
    return ElementCheck(rank, checked, total, tuple(differ), tuple(lines))


def record(rank, **changes):
    """Rank ``rank``'s record, each figure distinct from every other rank's."""
    r = {"rank": rank, "sent": {0: 100 * rank, 1: rank + 1}, "received": {2: 7 * rank + 3},
         "messages": 5 + rank, "seconds": 0.25 * (rank + 1), "staging_peak": 11 * rank,
         "largest_buffer": 13 * rank + 1, "rss_extra": 1000 * rank + 17,
         "elements": element(rank), "bandwidth": 2.5e9 + rank, "error": None}
    r.update(changes)
    return r


def stored_bytes(layout, rank):
    return sum(x.numel() * x.element_size() for x in generated(layout, rank, 0).values())


# ---- collect ---------------------------------------------------------------------------------

def test_collect_sums_each_ranks_figures_and_keeps_the_destination_ranks_checks():
    p = plan()  # 4 source ranks, 2 destination ranks
    records = [record(r, elements=element(r) if r < 2 else None) for r in range(4)]
    records[2]["elements"] = element(2)  # past the destination's world: not its check
    records[3]["elements"] = element(3)
    records[1]["elements"] = None
    verdict = SimpleNamespace(passed=True, notes=())
    result = S.collect(p, "fn name", records, verdict, ("n1",))
    assert result.plan is p and result.fn == "fn name" and result.verdict is verdict
    assert (result.notes, result.into, result.writes) == (("n1",), "fresh", ())
    assert [(f.rank, f.sent, f.received, f.messages, f.seconds, f.staging_peak,
             f.largest_buffer, f.rss_extra) for f in result.ranks] == [
        (r, 101 * r + 1, 7 * r + 3, 5 + r, 0.25 * (r + 1), 11 * r, 13 * r + 1, 1000 * r + 17)
        for r in range(4)]
    assert result.elements == (element(0),)
    assert (result.b_min, result.naive) == (minimum_bytes(p.src, p.dst),
                                            naive_bytes(p.src, p.dst))
    assert result.bandwidth == 2.5e9  # rank 0's calibration
    shapes = CONFIG.param_shapes()
    assert result.largest_param == 4 * max(torch.Size(s).numel() for s in shapes.values())
    assert result.largest_param == 4 * CONFIG.vocab * CONFIG.d_model  # the embedding


def test_collect_into_existing_storage_gives_the_rss_back_its_destination_tensors():
    p = plan()
    records = [record(r) for r in range(4)]
    records[2]["rss_extra"] = None
    result = S.collect(p, "f", records, None, (), into="existing")
    held = [stored_bytes(p.dst, r) for r in range(2)]
    assert all(h > 0 for h in held)
    assert [f.rss_extra for f in result.ranks] == [17 + held[0], 1017 + held[1], None, 3017]
    assert result.into == "existing"


def test_stored_bytes_is_what_a_rank_stores_and_nothing_past_the_world():
    p = plan()
    assert [S._stored_bytes(p, r) for r in range(4)] == [
        stored_bytes(p.dst, 0), stored_bytes(p.dst, 1), 0, 0]
    q = plan("vllm:2", "megatron:4")
    assert [S._stored_bytes(q, r) for r in range(4)] == [stored_bytes(q.dst, r)
                                                        for r in range(4)]


# ---- judge -----------------------------------------------------------------------------------

def test_judge_the_largest_logit_error_and_the_first_tensor_that_differs():
    p = plan(mutation="kv_swapped")
    order = list(dict.fromkeys(n for rank in p.dst.pieces for n in rank))
    late, early = order[-1], order[0]
    records = [record(0, elements=element(0, differ=(late,), lines=("r0 late",))),
               record(1, elements=element(1, differ=(early, late), lines=("r1 early",))),
               record(2, elements=element(2, differ=(early,), lines=("past world",))),
               record(3, elements=None)]
    logits = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    reference = torch.tensor([[1.25, -2.0], [0.5, 3.0]])  # largest |difference| 1.0, not 0.25
    v = S.judge(p, logits, reference, 0.5, records, ("note a",))
    assert v.max_abs_error == 1.0 and v.threshold == 0.5 and not v.passed
    assert (v.config, v.src, v.dst, v.phase, v.mutation) == ("tiny_kv2", 4, 2, "2",
                                                             "kv_swapped")
    assert v.first_mismatch == early and v.mismatches == (early, late)
    assert v.diagnosis == ("r1 early",)  # rank 2 is past the destination's world
    assert v.own_forward is True and v.notes == ("note a",)
    assert v.conventions == ("megatron", "vllm")


def test_judge_a_clean_sync_passes_and_a_negative_error_counts_by_its_size():
    p = plan()
    records = [record(r, elements=element(r) if r < 2 else None) for r in range(4)]
    v = S.judge(p, torch.tensor([0.0, -3.0]), torch.tensor([0.0, -2.5]), 0.75, records, ())
    assert v.passed and v.max_abs_error == 0.5
    assert v.first_mismatch is None and v.mismatches == () and v.diagnosis == ()
    assert v.mutation is None


def test_a_side_is_named_by_its_whole_endpoint_else_its_convention():
    staged = sync_layout(CONFIG, "megatron:tp=2,pp=1")
    assert staged.endpoint is not None
    assert S._named(staged) == str(staged.endpoint)
    assert S._named(sync_layout(CONFIG, "vllm:2")) == "vllm"
    assert S._named(sync_layout(CONFIG, "megatron:4", dp=2)) == "megatron"


# ---- a resharder that raised, or returned the wrong structure ---------------------------------

def test_a_resharder_raising_on_the_last_rank_is_named_with_its_rank():
    p = plan()
    records = [record(r) for r in range(3)] + [record(3, error="Traceback: boom")]
    with pytest.raises(UserCodeError) as info:
        S.raise_user_errors(records, "mod:fn", p)
    e = info.value
    assert str(e).startswith(f"your resharder mod:fn raised on rank 3 during {p.label}: "
                             "Traceback: boom")
    assert (e.role, e.function, e.user_traceback) == ("resharder", "mod:fn",
                                                      "Traceback: boom")


def test_the_first_rank_with_a_problem_is_the_one_named():
    p = plan()
    records = [record(0), record(1, structure="rank 1: missing x"),
               record(2, error="later error")]
    with pytest.raises(InvalidUserShards) as info:
        S.raise_user_errors(records, "m:f", p)
    assert str(info.value) == ("your resharder m:f returned what is not the destination's "
                               "tensors: rank 1: missing x")
    assert (info.value.role, info.value.function) == ("resharder", "m:f")


def test_an_error_is_named_before_a_structure_on_the_same_rank():
    with pytest.raises(UserCodeError):
        S.raise_user_errors([record(0, error="e", structure="s")], "m:f", plan())


def test_a_forward_error_is_a_wrong_structure_and_the_structure_is_named_first():
    p = plan()
    with pytest.raises(InvalidUserShards, match="tensors: the forward failed$"):
        S.raise_user_errors([record(0), record(1, forward_error="the forward failed")],
                            "m:f", p)
    with pytest.raises(InvalidUserShards, match="tensors: the structure$"):
        S.raise_user_errors([record(0, structure="the structure", forward_error="fwd")],
                            "m:f", p)


def test_clean_records_raise_nothing():
    assert S.raise_user_errors([record(r, structure=None, forward_error=None)
                                for r in range(4)], "m:f", plan()) is None


# ---- existing destination storage ---------------------------------------------------------------

def test_no_forward_names_the_destination():
    layout = sync_layout(CONFIG, "fsdp:2")
    assert S.no_forward(layout) == (
        f"no forward: {layout} is not a TP inference layout (FSDP, pipeline stages or experts "
        "over more ranks than TP): its elements are checked")


def test_stale_values_differ_from_the_right_ones_in_every_element_by_the_lowest_bit():
    p = plan()
    for rank in (0, 1):
        right = generated(p.dst, rank, 3)
        stale = S.stale_values(p, rank, 3)
        assert list(stale) == list(right)
        for name, x in stale.items():
            assert x.dtype == torch.float32
            assert torch.equal(x.view(torch.int32) ^ right[name].view(torch.int32),
                               torch.ones_like(x, dtype=torch.int32))
    assert S.stale_values(p, 2, 3) == {}


class Tracer:
    def __init__(self):
        self.marks = []

    def mark(self, what):
        self.marks.append(what)


def ctx(rank):
    return SimpleNamespace(rank=rank, tracer=Tracer())


@pytest.fixture
def existing(monkeypatch):
    """An empty per-process table of existing storage, restored afterwards."""
    monkeypatch.setattr(S, "_EXISTING", {})
    return S._EXISTING


def test_existing_storage_is_made_once_per_layout_and_refilled_before_every_run(existing):
    p, c = plan(), ctx(1)
    size = S.existing_task(c, key="k", plan=p, seed=5)
    assert c.tracer.marks == ["sync: existing storage"]
    held = existing["k"]
    assert held["layout"] == p.dst.key
    assert size == stored_bytes(p.dst, 1)
    stale = S.stale_values(p, 1, 5)
    storage = held["storage"]
    assert list(storage) == list(stale)
    assert all(torch.equal(storage[n].view(torch.int32), stale[n].view(torch.int32))
               for n in stale)
    for x in storage.values():  # a run writes the right values
        x.fill_(0.5)
    assert S.existing_task(ctx(1), key="k", plan=p, seed=5) == size
    assert existing["k"]["storage"] is storage  # the same tensors, refilled
    assert all(torch.equal(storage[n], stale[n]) for n in stale)
    assert all(storage[n].data_ptr() != stale[n].data_ptr() for n in stale)


def test_another_destination_layout_makes_new_storage(existing):
    S.existing_task(ctx(0), key="k", plan=plan(), seed=1)
    first = existing["k"]["storage"]
    q = plan("megatron:4", "vllm:1")
    size = S.existing_task(ctx(0), key="k", plan=q, seed=1)
    assert existing["k"]["layout"] == q.dst.key and existing["k"]["storage"] is not first
    assert size == stored_bytes(q.dst, 0)
    S.existing_task(ctx(0), key="other", plan=plan(), seed=1)
    S.drop_existing_task(ctx(0), key="k")
    assert list(existing) == ["other"]
    S.drop_existing_task(ctx(0), key="k")  # dropping twice is no error


def in_place(existing, fn):
    p = plan()
    S.existing_task(ctx(0), key="k", plan=p, seed=2)
    storage = existing["k"]["storage"]
    sync = SimpleNamespace(destination=None)
    out = S.InPlace(fn, "k")(sync, 0, {"local": 1}, p)
    return p, storage, sync, out


def test_in_place_hands_the_storage_and_returns_it(existing):
    seen = []

    def fn(sync, rank, local, p):
        seen.append((sync.destination, rank, local, p))
        for x in sync.destination.values():
            x.fill_(2.0)
        return sync.destination
    p, storage, sync, out = in_place(existing, fn)
    assert sync.destination is storage and seen == [(storage, 0, {"local": 1}, p)]
    assert out == storage and out is not storage
    assert all(out[n] is storage[n] for n in storage)


def test_tensors_returned_in_the_storages_stead_are_copied_into_it(existing):
    def fn(sync, rank, local, p):
        return {n: torch.full_like(x, 3.0) for n, x in sync.destination.items()}
    _, storage, _, out = in_place(existing, fn)
    assert all(out[n] is storage[n] for n in storage)
    assert all(bool((x == 3.0).all()) for x in storage.values())


def test_a_view_of_the_storage_with_other_strides_is_copied(existing):
    def fn(sync, rank, local, p):
        out = dict(sync.destination)
        name = next(n for n, x in out.items() if x.dim() == 2 and x.shape[0] == x.shape[1])
        x = out[name]
        x.copy_(torch.arange(x.numel(), dtype=x.dtype).reshape(x.shape))
        out[name] = x.t()  # same first address, same shape, other strides
        fn.name, fn.want = name, x.t().clone()
        return out
    _, storage, _, _out = in_place(existing, fn)
    assert torch.equal(storage[fn.name], fn.want)


@pytest.mark.parametrize("wrong", ["not a dict", "a key missing", "a key more", "not a tensor",
                                   "another shape", "another dtype"])
def test_a_result_of_another_structure_is_returned_as_it_is(existing, wrong):
    def fn(sync, rank, local, p):
        out = dict(sync.destination)
        name = next(iter(out))
        if wrong == "not a dict":
            fn.out = list(out.values())
            return fn.out
        if wrong == "a key missing":
            del out[name]
        elif wrong == "a key more":
            out["extra"] = out[name]
        elif wrong == "not a tensor":
            out[name] = 1.0
        elif wrong == "another shape":
            out[name] = torch.zeros(1)
        else:
            out[name] = out[name].double()
        fn.out = out
        return out
    _, _storage, _, out = in_place(existing, fn)
    assert out is fn.out


def test_in_place_without_storage_says_the_ranks_restarted(existing):
    with pytest.raises(LookupError) as info:
        S.InPlace(lambda *a: {}, "gone")(SimpleNamespace(), 3, {}, plan())
    assert str(info.value) == ("rank 3: no existing destination storage for session 'gone' "
                               "(the rank processes restarted since it was made)")


# ---- the text of a result ----------------------------------------------------------------------

GB = 1_000_000_000


def result(p=None, **changes):
    """A result whose figures print distinctly at the precision of the text: seconds and
    bytes large enough that a unit off by 0.1% changes the digits shown."""
    p = p or plan(build_seconds=1.25)
    ranks = (S.RankFigures(0, 3 * GB, 1 * GB, 3, 0.5, 64, 8, 5000),
             S.RankFigures(1, 1 * GB, 3 * GB, 2, 2.5, 0, 8, None))
    fields = {"plan": p, "fn": "fname", "b_min": 2 * GB, "naive": 8 * GB, "ranks": ranks,
              "elements": (element(0, 6, 8), element(1, 2, 8)), "bandwidth": 2.375e9,
              "largest_param": 4096}
    return S.SyncResult(**{**fields, **changes})


def head(p, passed=True):
    return (f"{'PASS' if passed else 'FAIL'} tiny_kv2 {p.src} -> {p.dst} (phase 2, fname")


RANK_TABLE = ["  rank  sent      received  messages  staging peak  RSS extra",
              "  0     3000000000  1000000000  3         64            5000",
              "  1     1000000000  3000000000  2         0             -"]


def test_the_text_of_a_passing_calibrated_run():
    r = result(elements=(element(0, 8, 8), element(1, 8, 8)))
    p = r.plan
    assert r.bound(2e9) == 1.5 and r.t_min == 3 * GB / 2.375e9
    assert r.summary().split("\n") == [
        head(p) + ")",
        ("  bytes between ranks 4000000000 (counted at the transport), B_min 2000000000: "
         "2.000x; naive gather-then-scatter 8000000000 (4.00x B_min)"),
        "  time 2500.0 ms, T_min 1263.2 ms (1.98x) at 2.38 GB/s calibrated gloo p2p",
        "  plan built in 1250.00 ms; bytes sent max/mean 1.500",
        "  largest full parameter 4096 bytes", *RANK_TABLE,
        "  element check: 16 elements on 2 destination ranks, 100% coverage, bit-exact"]
    assert str(r) == r.summary()


def test_the_text_of_a_failing_uncalibrated_run_into_existing_storage():
    p = plan(mutation="kv_swapped", build_seconds=0.5)
    name = next(iter(p.dst.pieces[0]))
    verdict = S.judge(p, torch.zeros(2), torch.ones(2), 0.5,
                      [record(0, elements=element(0, 8, 8, (name,), ("why 1", "why 2")))],
                      ("shown note",))
    r = result(p, bandwidth=None, into="existing", b_min=0, verdict=verdict,
               elements=(element(0, 8, 8, (name,), ("why 1", "why 2")), element(1, 2, 8)),
               notes=("shown note", "own note"), writes=("w0 twice", "w1", "w2"))
    lines = r.summary().split("\n")
    assert lines[:8] == [
        head(p, passed=False) + ", mutation kv_swapped)",
        ("  bytes between ranks 4000000000 (counted at the transport), B_min 0: 0.000x; "
         "naive gather-then-scatter 8000000000 (0.00x B_min)"),
        "  time 2500.0 ms, into existing destination storage",
        "  plan built in 500.00 ms; bytes sent max/mean 1.500",
        "  largest full parameter 4096 bytes", *RANK_TABLE]
    assert lines[8:14] == [
        "  element check: 10 elements on 2 destination ranks, 62% coverage, DIFFERENT",
        "    why 1", "    why 2", "  coverage: the plan writes w0 twice", "    w1", "    w2"]
    assert lines[14:] == ["  " + line for line in str(verdict).splitlines()] + [
        "  note: own note"]


def test_the_text_when_nothing_is_sent_and_no_element_was_checked():
    ranks = (S.RankFigures(0, 0, 0, 0, 0.001, 0, 0, None),)
    r = result(ranks=ranks, elements=(), bandwidth=5e8, notes=("n",))
    lines = r.summary().split("\n")
    assert lines[2] == "  time 1.0 ms"  # T_min 0: nothing to time against
    assert lines[3] == "  plan built in 1250.00 ms; nothing to send"
    assert lines[-2:] == ["  element check: not run (the forward alone)", "  note: n"]
    assert lines[0].startswith("FAIL")  # nothing was checked


def test_storage_tensors_returned_under_each_others_names_are_read_before_any_is_written(
        existing):
    """A resharder returning two of the storage's own same-shaped tensors swapped: the result
    is each holding the other's values. Copying one into the other first would leave both
    holding one of them, and the element check would name one wrong tensor, not two."""
    def fn(sync, rank, local, p):
        out = dict(sync.destination)
        by_shape = {}
        for n, x in out.items():
            by_shape.setdefault(tuple(x.shape), []).append(n)
        a, b = next(names for names in by_shape.values() if len(names) >= 2)[:2]
        out[a].fill_(1.0)
        out[b].fill_(2.0)
        out[a], out[b] = out[b], out[a]
        fn.pair = a, b
        return out
    _, storage, _, out = in_place(existing, fn)
    a, b = fn.pair
    assert bool((storage[a] == 2.0).all()) and bool((storage[b] == 1.0).all())
    assert out[a] is storage[a] and out[b] is storage[b]
