"""``fuzz.floor.moe`` (issue 30, the mutation pass over ``fuzz/floor/moe.py``): the loop that
measures the MoE validation, ``random_floor_1a_moe.json``.

Every MoE verdict the fuzz gives trusts this artifact: ``require_moe`` admits a (world,
forward) only where it has samples, and the rule's headroom is read from them. A sample filed
under the wrong world or forward, a floor that is not its group's worst endpoint, a kill
judged at a conversion the mutation does not apply to, or a coverage geometry outside the
grid the docstrings state is still a plausible artifact. These tests check, with the
forwards and the conversions stood in (a stand-in returns figures chosen so that each
statistic has one right answer), every field of a sample and of the artifact: which
endpoints are grouped together, which of them is the worst (the first to reach the largest
floor), which conversion each mutation is judged at (the first into the group where it
applies and is not the identity, destination first), where a mutation the tokens hid is
filed, the lengths a geometry is sampled again at, the coverage grid point by point, and
the refusals' text. Tiny geometries only: every real forward here takes milliseconds; the
real forwards' figures are ``test_moe_floor.py``'s."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from weight_sync_bench.check.conversion import ConversionChecker
from weight_sync_bench.check.floor import forward_of
from weight_sync_bench.conventions import Endpoint, endpoint, moe_endpoints
from weight_sync_bench.conventions.mutations import MOE_MUTATIONS, ROUTER_BIAS
from weight_sync_bench.errors import ToleranceMismatch
from weight_sync_bench.fuzz.case import ConversionCase, make_checker
from weight_sync_bench.fuzz.domain import DOMAIN, MOE_DOMAIN, IntRange
from weight_sync_bench.fuzz.floor import moe as M
from weight_sync_bench.model.config import ModelConfig
from weight_sync_bench.tolerance import sampled
from weight_sync_bench.tolerance.sampled import SampledRule

# 2 KV heads, 4 experts of which 2 are chosen by a sigmoid router with a selection bias, over
# 2 layers: at up to 2 ranks, a plain forward over 1 and 2 ranks and an expert-parallel one
GEOMETRY = DOMAIN.config(n_kv_heads=2, group=2, head_dim=4, d_model=16, ffn_per_kv_head=4,
                         vocab_per_kv_head=16, n_layers=2, batch=1, seq_len=8).replace(
    name="fuzz_moe", n_experts=4, top_k=2, expert_ffn=8, router="sigmoid", router_bias=True)
RULE = SampledRule("stand-in", "relative", 0.25)  # not the rule in force: it is passed on
SELECTION_ONLY = ["router_bias_not_synced", "router_bias_negated"]  # 32 tokens


def _texts(members):
    return [str(e) for e in members]


def test_forward_groups_are_the_moe_endpoints_by_world_and_forward_in_their_order():
    groups = M.forward_groups(GEOMETRY, 2)
    want: dict[tuple[int, str], list[Endpoint]] = {}
    for e in moe_endpoints(GEOMETRY, 2):
        want.setdefault((e.world, forward_of(e.convention, GEOMETRY, e)), []).append(e)
    assert groups == want and list(groups) == list(want)
    assert list(groups) == [(1, "plain"), (2, "expert-parallel"), (2, "plain")]
    assert all(type(members) is list for members in groups.values())
    assert _texts(groups[(2, "plain")]) == ["plain:2", "megatron:2", "vllm:2",
                                            "vllm:tp=2,kernel=flashinfer_cutlass"]
    # a copy each call: the cached groups are not the caller's to change
    groups[(1, "plain")].clear()
    assert len(M.forward_groups(GEOMETRY, 2)[(1, "plain")]) == 6


class Shifted:
    """A forward model whose rank ``i`` returns its logits plus ``i + 1``: which ranks' logits
    a deviation reads shows in its value."""

    def __init__(self, model):
        self.model = model

    def __call__(self, tokens):
        return [x + (i + 1) for i, x in enumerate(self.model(tokens))]

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.parametrize("where, ranks_read", [
    ("megatron:tp=2,ep=2", 3),  # 2 replicas of TP 2 over 4 ranks: ranks 0 and 2, the worst +3
    ("megatron:tp=1,ep=4", 4),  # 4 replicas of TP 1: every rank
    ("megatron:2", 1),  # TP 2, one replica: rank 0's (every rank holds the gathered logits)
    ("vllm:tp=4,ep=4", 1),  # vLLM's forward states no TP: the world's, one replica
])
def test_an_endpoints_deviation_reads_every_replicas_logits_under_the_routing_guard(
        monkeypatch, where, ranks_read):
    checker = make_checker(GEOMETRY, 0, threshold_rule=lambda c, r: math.inf)
    floor, route = M.endpoint_deviation(checker, endpoint(where))
    assert 0 <= floor < 1e-3 and 0 <= route < 1e-3
    guards = []
    real = M.forward_model

    def shifted(forward, inputs, *, guard=None):
        guards.append(guard)
        return Shifted(real(forward, inputs, guard=guard))

    monkeypatch.setattr(M, "forward_model", shifted)
    shifted_floor, shifted_route = M.endpoint_deviation(checker, endpoint(where))
    assert abs(shifted_floor - ranks_read) < 1e-3 and shifted_route == route
    assert guards == [checker.guard] and checker.guard is not None


# --- one geometry's samples, with the forwards and the conversions stood in -------------

@dataclasses.dataclass(frozen=True)
class Planted:
    """A stand-in conversion mutation: it applies where ``applies(src, dst)`` holds (the
    endpoints' texts) and is the identity where ``identity(src, dst)`` holds."""

    name: str
    changes: str = r"layers\.\d+\.experts"
    applies: Callable[[str, str], bool] = lambda s, d: True
    identity: Callable[[str, str], bool] = lambda s, d: False

    def not_applicable(self, conversion):
        assert conversion.config == GEOMETRY, conversion.config
        return None if self.applies(str(conversion.src), str(conversion.dst)) else "no"

    def identity_reason(self, conversion):
        assert conversion.config == GEOMETRY, conversion.config
        return "same" if self.identity(str(conversion.src), str(conversion.dst)) else None


LATER = {("megatron:1", "hf:1"), ("hf:1", "vllm:1"), ("megatron:1", "vllm:1")}
PLANTED = [
    Planted("nowhere", applies=lambda s, d: False),  # in no group; the next ones still run
    Planted("everywhere"),
    # into vllm:1 (before hf:1 among the destinations) from hf:1: megatron:1 comes first
    # among the sources, but megatron:1 -> vllm:1 is the identity
    Planted("later", applies=lambda s, d: (s, d) in LATER,
            identity=lambda s, d: (s, d) == ("megatron:1", "vllm:1")),
    Planted("bias_hidden", changes=ROUTER_BIAS),  # the tokens hide it: selection_unchanged
    Planted("experts_hidden"),  # the tokens hide it: unrouted
]
@dataclasses.dataclass(frozen=True)
class Case(ConversionCase):
    """``ConversionCase`` without its check that the mutation is a real one."""

    def __post_init__(self) -> None:
        pass


# the floors: in the 1-rank plain group three endpoints tie at the worst; the first of them
# (megatron:1) is the worst endpoint, though a later one has the larger routing deviation
FLOORS = {"megatron:1": 3e-6, "vllm:kernel=flashinfer_cutlass": 3e-6, "hf:1": 3e-6,
          "plain:1": 2e-6, "megatron:tp=1,ep=2,experts=sequential": 5e-6, "vllm:2": 4e-6}


def _floor(text: str) -> float:
    return FLOORS.get(text, 1e-6)


def _route(group: list[str], text: str) -> float:
    return 1e-3 * (1 + group.index(text))  # the last member's is the group's largest


@pytest.fixture
def stood_in(monkeypatch):
    """``endpoint_deviation`` and ``run_conversion_case`` stood in; their calls recorded."""
    groups = {k: _texts(v) for k, v in M.forward_groups(GEOMETRY, 2).items()}
    group_of = {e: g for g in groups.values() for e in g}
    calls = SimpleNamespace(measured=[], judged=[])

    def deviation(checker, where):
        calls.measured.append((checker, str(where)))
        return _floor(str(where)), _route(group_of[str(where)], str(where))

    def convert(case, checker=None, *, threshold_rule=None):
        calls.judged.append((case, checker, threshold_rule))
        hidden = case.mutation.endswith("_hidden")
        return SimpleNamespace(unchanged="no token moved" if hidden else None,
                               deviation=1.0 + 0.1 * len(case.dst_convention))

    monkeypatch.setattr(M, "endpoint_deviation", deviation)
    monkeypatch.setattr(M, "run_conversion_case", convert)
    monkeypatch.setattr(M, "ConversionCase", Case)  # the real one knows only real mutations
    return groups, calls


def test_a_sample_is_its_groups_worst_endpoint_and_each_mutation_where_it_first_applies(
        stood_in):
    groups, calls = stood_in
    records = M.sample_moe(GEOMETRY, 5, rule=RULE, mutations=PLANTED, max_world=2,
                           purpose="router_bias_negated")
    free = make_checker(GEOMETRY, 5, threshold_rule=lambda c, r: math.inf)
    scale = float(free.reference.abs().max())
    guard = make_checker(GEOMETRY, 5, threshold_rule=RULE).guard
    margin = min(float(r.margin.min()) for r in guard.routings.values())
    assert len(guard.routings) == 2 and margin > 0
    sources = [e for g in groups.values() for e in g]
    assert [(r["degree"], r["forward"]) for r in records] == list(groups)
    for r, ((world, forward), members) in zip(records, groups.items(), strict=True):
        worst = max(_floor(e) for e in members)
        first = members[0]
        kills = {"everywhere": 1.0 + 0.1 * len(first)}
        kill_at = {"everywhere": f"{sources[0]} -> {first}"}
        if forward == "plain" and world == 1:
            kills["later"] = 1.0 + 0.1 * len("vllm:1")
            kill_at["later"] = "hf:1 -> vllm:1"
        assert r == {"geometry": GEOMETRY.geometry(), "seed": 5,
                     "purpose": "router_bias_negated", "degree": world, "forward": forward,
                     "endpoints": members,
                     "worst_endpoint": next(e for e in members if _floor(e) == worst),
                     "scale": scale, "floor": worst, "route": _route(members, members[-1]),
                     "bound": RULE.threshold(scale), "near_ties": list(guard.near_ties()),
                     "min_margin": margin, "kills": kills, "kill_at": kill_at,
                     "selection_unchanged": ["bias_hidden"], "unrouted": ["experts_hidden"]}
    assert records[0]["worst_endpoint"] == "megatron:1"
    # every endpoint measured once, on the unbounded checker of the same weights
    assert [e for _, e in calls.measured] == sources
    for checker, _ in calls.measured:
        assert checker.threshold == math.inf and checker.seed == 5
        assert checker.config == GEOMETRY and torch.equal(checker.reference, free.reference)
    # each kill judged as the fuzz judges it: the case, the rule's threshold, the same checker
    cases = [c for c, _, _ in calls.judged]
    assert cases[:4] == [Case(GEOMETRY, "plain:1", 1, "plain:1", 1, 5, m.name)
                         for m in PLANTED[1:2]] + [
        Case(GEOMETRY, "hf:1", 1, "vllm:1", 1, 5, "later"),
        Case(GEOMETRY, "plain:1", 1, "plain:1", 1, 5, "bias_hidden"),
        Case(GEOMETRY, "plain:1", 1, "plain:1", 1, 5, "experts_hidden")]
    assert Case(GEOMETRY, "plain:1", 1, "megatron:tp=1,ep=2", 2, 5, "everywhere") in cases
    assert len(cases) == 3 * 3 + 1
    judged = calls.judged[0][1]
    assert isinstance(judged, ConversionChecker)
    assert judged.checker.threshold == RULE.threshold(scale) and judged.checker.seed == 5
    assert all(c is judged for _, c, _ in calls.judged)
    assert all(rule(GEOMETRY, free.reference) == RULE.threshold(scale)
               for _, _, rule in calls.judged)


def test_sample_moe_defaults_to_the_endpoints_up_to_8_ranks(monkeypatch):
    seen = {}

    def groups(config, max_world=None):
        seen["max_world"] = max_world
        return {}

    monkeypatch.setattr(M, "forward_groups", groups)
    assert M.sample_moe(GEOMETRY, 0, rule=RULE) == []
    assert seen["max_world"] == M.MOE_MAX_WORLD == 8


# --- the lengths a geometry is sampled at ----------------------------------------------

@pytest.fixture
def sampled_at(monkeypatch):
    calls = []

    def sample(config, seed, **kwargs):
        calls.append(dict(kwargs, config=config, seed=seed,
                          mutations=[m.name for m in kwargs["mutations"]]))
        return [("sample", config.seq_len)]

    monkeypatch.setattr(M, "sample_moe", sample)
    return calls


def test_a_selection_bias_is_sampled_again_at_32_tokens_with_its_two_mutations(sampled_at):
    records = M.sample_moe_geometry(GEOMETRY, 7, rule=RULE, max_world=3, purpose="p")
    assert records == [("sample", 8), ("sample", 32)]
    at_8 = [m.name for m in MOE_MUTATIONS if m.name not in SELECTION_ONLY]
    assert sampled_at == [
        dict(config=GEOMETRY, seed=7, rule=RULE, max_world=3, purpose="p", mutations=at_8),
        dict(config=GEOMETRY.replace(seq_len=32), seed=7, rule=RULE, max_world=3,
             purpose="p", mutations=SELECTION_ONLY)]
    assert [m.min_seq_len for m in MOE_MUTATIONS if m.name in SELECTION_ONLY] == [32, 32]


def test_sample_moe_geometry_defaults_to_8_ranks_no_purpose_and_the_fuzz_domain(sampled_at):
    M.sample_moe_geometry(GEOMETRY, 0, rule=RULE)
    assert [(c["config"].seq_len, c["max_world"], c["purpose"]) for c in sampled_at] == [
        (8, 8, None), (32, 8, None)]


@pytest.mark.parametrize("config, domain", [
    # no selection bias: both of its mutations are inapplicable
    (GEOMETRY.replace(router="softmax", router_bias=False), DOMAIN),
    # every expert chosen: a bias moves no choice, the identity
    (GEOMETRY.replace(top_k=4), DOMAIN),
    # a domain whose own lengths reach 32 tokens: no length past it
    (GEOMETRY, dataclasses.replace(DOMAIN, seq_len=IntRange(4, 32))),
])
def test_twin_no_second_length_where_no_selection_only_mutation_is_live(sampled_at, config,
                                                                          domain):
    M.sample_moe_geometry(config, 0, rule=RULE, domain=domain)
    assert [c["config"].seq_len for c in sampled_at] == [8]


# --- the artifact's measuring loop -------------------------------------------------------

DRAWN = [(GEOMETRY, 0, "router_bias_negated"), (GEOMETRY.replace(n_experts=2, top_k=1), 3, None)]
EXTRA = GEOMETRY.replace(d_model=24, n_experts=3, top_k=1)


@pytest.fixture
def loop(monkeypatch):
    """``sample_moe_geometry``, ``coverage_cases`` and ``moe_artifact`` stood in."""
    calls = SimpleNamespace(sampled=[], covered=[], extra=[(EXTRA, 0, "coverage")])

    def sample(config, seed, **kwargs):
        calls.sampled.append(dict(kwargs, config=config, seed=seed))
        return [{"degree": config.n_experts, "forward": f"f{seed}", "d_model": config.d_model}]

    def cases(covered, *args):
        calls.covered.append((covered, *args))
        return calls.extra

    monkeypatch.setattr(M, "sample_moe_geometry", sample)
    monkeypatch.setattr(M, "coverage_cases", cases)
    monkeypatch.setattr(M, "moe_artifact", lambda samples, **kw: dict(kw, samples=samples))
    return calls


def test_measure_moe_samples_the_drawn_cases_then_the_coverage_and_records_how(loop):
    domain = dataclasses.replace(DOMAIN, d_model=IntRange(8, 256, 8))
    moe = dataclasses.replace(MOE_DOMAIN, n_experts=IntRange(2, 16))
    seen = []
    artifact = M.measure_moe(iter(DRAWN), domain=domain, moe=moe, hypothesis_seed=11,
                             max_world=4, rule=RULE, draw="draw_moe_cases(2)",
                             progress=lambda *a: seen.append(a))
    assert artifact == {
        "phase": "1a", "domain": domain.to_json(), "moe_domain": moe.to_json(),
        "geometries": 2, "coverage": 1, "hypothesis_seed": 11, "max_world": 4, "rule": RULE,
        "draw": "draw_moe_cases(2)",
        "samples": [{"degree": 4, "forward": "f0", "d_model": 16},
                    {"degree": 2, "forward": "f3", "d_model": 16},
                    {"degree": 3, "forward": "f0", "d_model": 24}]}
    assert loop.sampled == [dict(config=c, seed=s, purpose=p, rule=RULE, domain=domain,
                                 max_world=4) for c, s, p in [*DRAWN, *loop.extra]]
    # the coverage asked for what the drawn samples did not reach
    assert loop.covered == [({(4, "f0"), (2, "f3")}, domain, moe, 4)]
    assert seen == [(1, 2, "geometry d_model=16 experts=4 top_k=2"),
                    (2, 2, "geometry d_model=16 experts=2 top_k=1"),
                    (3, 3, "geometry d_model=24 experts=3 top_k=1")]


def test_measure_moe_defaults_to_the_rule_in_force_over_the_fuzz_domains(loop):
    artifact = M.measure_moe(DRAWN[:1])
    rule = sampled.rule_from(sampled.load_random_floor("1a"))
    assert artifact["rule"] == rule and artifact["max_world"] == 8
    assert artifact["domain"] == DOMAIN.to_json()
    assert artifact["moe_domain"] == MOE_DOMAIN.to_json()
    assert artifact["hypothesis_seed"] is None and artifact["draw"] is None
    assert loop.sampled[0]["rule"] == rule and loop.sampled[0]["domain"] == DOMAIN
    assert loop.covered == [({(4, "f0")}, DOMAIN, MOE_DOMAIN, 8)]


def test_without_cover_no_coverage_geometry_is_sampled(loop):
    artifact = M.measure_moe(DRAWN, rule=RULE, cover=False)
    assert loop.covered == [] and artifact["coverage"] == 0
    assert len(artifact["samples"]) == 2 and artifact["geometries"] == 2


def test_measure_moe_refuses_another_phase_naming_it(loop):
    with pytest.raises(ToleranceMismatch) as info:
        M.measure_moe(DRAWN, phase="1b", rule=RULE)
    assert str(info.value) == "conversions are fuzzed in process (phase 1a), got '1b'"
    assert loop.sampled == []


def test_the_cases_are_checked_against_the_dense_domain_given(loop):
    wide = dataclasses.replace(DOMAIN, d_model=IntRange(8, 256, 8))
    case = (GEOMETRY.replace(d_model=136), 0, None)
    artifact = M.measure_moe([case], domain=wide, rule=RULE, cover=False)
    assert [s["d_model"] for s in artifact["samples"]] == [136]
    # twin: the fuzz's domain stops at 128
    with pytest.raises(ToleranceMismatch, match="d_model=136 not in 8..128 step 8"):
        M.measure_moe([case], rule=RULE, cover=False)


@pytest.mark.parametrize("drawn, extra, message", [
    ([DRAWN[0], (GEOMETRY.replace(n_experts=9, top_k=2), 0, None)], [],
     "MoE sample 1 lies outside the fuzz domain: n_experts=9 not in 2..8"),
    # the coverage geometries are numbered after the drawn ones
    (DRAWN, [(GEOMETRY.replace(d_model=136, n_experts=9), 0, "coverage")],
     ("MoE sample 2 lies outside the fuzz domain: d_model=136 not in 8..128 step 8; "
      "n_experts=9 not in 2..8")),
])
def test_a_case_outside_the_domains_is_refused_naming_its_number_and_fields(
        loop, drawn, extra, message):
    loop.extra = extra
    with pytest.raises(ToleranceMismatch) as info:
        M.measure_moe(drawn, rule=RULE)
    assert str(info.value) == message


# --- the coverage grid -------------------------------------------------------------------

def _grid_point(kv, group, e):
    # a vocabulary of 192 (190 at 5 KV heads: 38 a head), d_model 48, 24 per KV head of ffn
    # and of expert width, one layer, 4 tokens, top-1
    return ModelConfig(name="fuzz_moe", vocab=kv * (192 // kv), d_model=48, n_layers=1,
                       n_heads=kv * group, n_kv_heads=kv, head_dim=4, ffn=kv * 24, batch=1,
                       seq_len=4, n_experts=e, top_k=1, expert_ffn=kv * 24)


def test_the_coverage_grid_is_every_kv_head_count_group_and_expert_count():
    grid = M.coverage_grid()
    assert grid == [_grid_point(kv, g, e) for kv in (1, 2, 3, 4) for g in (1, 2, 3, 4)
                    for e in range(2, 9)]
    assert len(grid) == 112  # the docstring's figure in test_moe_floor.py
    # each size divisible by every degree the heads and experts allow
    assert all(c.vocab % c.n_kv_heads == 0 and c.ffn % c.n_kv_heads == 0 for c in grid)


def test_the_coverage_grid_walks_each_ranges_step_inside_the_domains_given():
    domain = dataclasses.replace(DOMAIN, n_kv_heads=IntRange(1, 4, 2), group=IntRange(1, 4, 3))
    moe = dataclasses.replace(MOE_DOMAIN, n_experts=IntRange(2, 8, 3))
    assert M.coverage_grid(domain, moe) == [_grid_point(kv, g, e) for kv in (1, 3)
                                            for g in (1, 4) for e in (2, 5, 8)]
    # a wider dense domain than the fuzz's: its 5 and 6 KV heads are in the grid
    wide = dataclasses.replace(DOMAIN, n_kv_heads=IntRange(5, 6))
    assert M.coverage_grid(wide, dataclasses.replace(MOE_DOMAIN, n_experts=IntRange(2, 2))) == [
        _grid_point(kv, g, 2) for kv in (5, 6) for g in (1, 2, 3, 4)]
    # twin: a domain without d_model 48 has no grid point
    assert M.coverage_grid(dataclasses.replace(DOMAIN, d_model=IntRange(8, 40, 8))) == []


@pytest.fixture
def reached(monkeypatch):
    """``forward_groups`` stood in: a grid point reaches its KV-head count and expert count."""
    calls = []

    def groups(config, max_world=None):
        calls.append(max_world)
        return {("kv", config.n_kv_heads): [], ("e", config.n_experts): []}

    monkeypatch.setattr(M, "forward_groups", groups)
    return calls


SMALL = (dataclasses.replace(DOMAIN, n_kv_heads=IntRange(1, 2), group=IntRange(1, 1)),
         dataclasses.replace(MOE_DOMAIN, n_experts=IntRange(2, 3)))


def test_coverage_reach_is_every_pair_the_grid_runs_at_the_world_given(reached):
    assert M.coverage_reach(*SMALL, max_world=3) == {("kv", 1), ("kv", 2), ("e", 2), ("e", 3)}
    assert reached == [3] * 4
    reached.clear()
    M.coverage_reach()
    assert reached == [8] * 112


def test_coverage_cases_add_the_first_grid_point_to_reach_each_missing_pair(reached):
    covered = [("kv", 2)]
    # grid order (kv, experts): (1, 2) reaches kv 1 and 2 experts, (1, 3) 3 experts; (2, 2)
    # and (2, 3) nothing new
    assert M.coverage_cases(covered, *SMALL, max_world=3) == [
        (_grid_point(1, 1, 2), 0, "coverage"), (_grid_point(1, 1, 3), 0, "coverage")]
    assert reached == [3] * 4 and covered == [("kv", 2)]
    assert M.coverage_cases({("kv", 1), ("kv", 2), ("e", 2), ("e", 3)}, *SMALL) == []
    reached.clear()
    # the MoE domain given, not the fuzz's: 2 and 3 experts only
    assert len(M.coverage_cases(set(), SMALL[0], SMALL[1])) == 3
    assert reached == [8] * 4


# --- the floors measured again ------------------------------------------------------------

def test_remeasured_floors_are_each_samples_worst_endpoint_one_checker_a_geometry(monkeypatch):
    other = GEOMETRY.replace(d_model=24)
    g, h = GEOMETRY.geometry(), other.geometry()
    reordered = dict(reversed(list(g.items())))  # the same geometry, keys in another order
    samples = [dict(geometry=g, seed=0, endpoints=["plain:1", "hf:1"], degree=1,
                    forward="plain"),
               dict(geometry=reordered, seed=0, endpoints=["plain:2"], degree=2,
                    forward="plain"),
               dict(geometry=g, seed=1, endpoints=["vllm:2", "plain:2"], degree=2,
                    forward="plain"),
               dict(geometry=h, seed=1, endpoints=["plain:tp=2,ep=2"], degree=2,
                    forward="expert-parallel"),
               dict(geometry=h, seed=1, endpoints=["plain:1"], degree=1, forward="plain")]
    built = []

    def checker(config, seed, *, threshold_rule):
        built.append((config, seed, threshold_rule(config, torch.ones(1))))
        return SimpleNamespace(n=len(built))

    floors = {"plain:1": 1.0, "hf:1": 4.0, "plain:2": 2.0, "vllm:2": 0.5,
              "plain:tp=2,ep=2": 3.0}

    def deviation(c, where):
        assert isinstance(where, Endpoint)
        return floors[str(where)] * 10 ** c.n, -1.0

    monkeypatch.setattr(M, "make_checker", checker)
    monkeypatch.setattr(M, "endpoint_deviation", deviation)
    seen = []
    assert M.remeasure_moe_floors({"samples": samples}, lambda *a: seen.append(a)) == [
        40.0, 20.0, 200.0, 3000.0, 1000.0]
    assert built == [(GEOMETRY.replace(name="moe-sample-0"), 0, math.inf),
                     (GEOMETRY.replace(name="moe-sample-2"), 1, math.inf),
                     (other.replace(name="moe-sample-3"), 1, math.inf)]
    assert seen == [(1, 5, "sample 1 ranks plain"), (2, 5, "sample 2 ranks plain"),
                    (3, 5, "sample 2 ranks plain"), (4, 5, "sample 2 ranks expert-parallel"),
                    (5, 5, "sample 1 ranks plain")]
    built.clear()
    assert M.remeasure_moe_floors({"samples": samples[:1]}) == [40.0]  # no progress: fine
