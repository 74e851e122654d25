"""``check.floor`` (issue 30, the mutation pass over ``check/floor.py``): the loops that
measure the phase floors every threshold is derived from.

A floor measured on the wrong forward, the wrong seeds, the wrong tokens or the wrong weights
is still a number, and every verdict after it trusts it; so is a cell filed under the wrong
degree or forward. These tests check which forward each destination is measured on
(``forward_of``), that the streamed and held-whole deviations are the same logits bit for bit,
and, with the forwards stood in, exactly what each loop runs, in which order, with which seeds,
and what it files where. Tiny geometries only: every real forward here takes milliseconds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.sync.conftest import BASE, MOE_FEW
from weight_sync_bench.check import floor as F
from weight_sync_bench.check.forwards import inprocess_forward
from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.conventions import (
    CONVENTIONS,
    endpoint,
    forward_inputs,
    forward_model,
    materialize,
    reading_plan,
)
from weight_sync_bench.conventions.fp8 import dequantize_canonical, quantize_canonical
from weight_sync_bench.errors import ToleranceMismatch
from weight_sync_bench.layout.reshard import split
from weight_sync_bench.model.config import (
    TOY,
    TOY_KV4,
    ModelConfig,
    init_params,
    make_tokens,
)
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.routing import score_deviation
from weight_sync_bench.model.sharded import RoutingGuard, ShardedModel
from weight_sync_bench.model.stepwise import computing, stages
from weight_sync_bench.tolerance import phase as record
from weight_sync_bench.tolerance.phase import (
    EXPERT_PARALLEL,
    PLAIN_FORWARD,
    REPLICATED_KV,
)
from weight_sync_bench.tolerance.rules import TOKEN_SEED_OFFSET, cached_floor_path

# 8 query heads over 2 KV heads: plain cells at t = 1, 2; vLLM replicates KV at t = 4, 8
DENSE = BASE.replace(name="dense", vocab=64, d_model=16, head_dim=2, ffn=16, batch=1, seq_len=4)
MOE = MOE_FEW


def reference(config, seed, dtype=torch.float32):
    params = init_params(config, seed, dtype=dtype)
    model = ReferenceModel(config, computing(params))
    return params, model, model(make_tokens(config, TOKEN_SEED_OFFSET + seed))


# ---- which forward a destination runs -------------------------------------------------------

def test_each_dense_destination_names_the_forward_its_cells_were_measured_on():
    assert [F.forward_of(c, DENSE, t) for c in ("plain", "vllm", "megatron", "meta")
            for t in (1, 2)] == [PLAIN_FORWARD] * 8
    assert [F.forward_of(c, DENSE, t) for c in ("vllm", "megatron") for t in (4, 8)] == [
        REPLICATED_KV] * 4
    assert F.forward_of(CONVENTIONS["vllm"], DENSE, endpoint("vllm:4")) == REPLICATED_KV
    assert F.forward_of("hf", DENSE, 1) == PLAIN_FORWARD


def test_a_staged_endpoint_runs_its_unstaged_forward():
    one_kv = DENSE.replace(n_kv_heads=1, n_layers=2)
    assert F.forward_of("megatron", one_kv, endpoint("megatron:tp=2,pp=2")) == REPLICATED_KV
    assert F.forward_of("megatron", DENSE.replace(n_layers=2),
                        endpoint("megatron:tp=2,pp=2")) == PLAIN_FORWARD
    moe = MOE.replace(n_layers=2)  # staged MoE: experts over its 2-rank TP group, not 4
    assert F.forward_of("megatron", moe, endpoint("megatron:tp=2,pp=2")) == PLAIN_FORWARD
    assert F.forward_of("megatron", moe, endpoint("megatron:tp=1,ep=2,pp=2")) == EXPERT_PARALLEL


class Renamed:
    """vLLM's layouts under another convention's name: a replicated-KV forward nobody
    measured."""

    name = "mine"

    def at(self, degree):
        return CONVENTIONS["vllm"].at(degree)

    def forward_layout(self, config, at):
        return CONVENTIONS["vllm"].forward_layout(config, at)


def test_a_replicated_forward_of_another_convention_is_its_own_forward():
    assert F.forward_of(Renamed(), DENSE, 4) == "mine-replicated-kv"
    assert F.forward_of(Renamed(), DENSE, 2) == PLAIN_FORWARD


@pytest.mark.parametrize("at, forward", [
    ("plain:1", PLAIN_FORWARD), ("vllm:2", PLAIN_FORWARD), ("megatron:2", PLAIN_FORWARD),
    ("vllm:tp=2,ep=2", EXPERT_PARALLEL),         # experts whole on EP ranks
    ("megatron:tp=2,etp=1", EXPERT_PARALLEL),    # ep 1, but experts' TP narrower than TP
    ("megatron:tp=1,etp=2", EXPERT_PARALLEL),    # ep 1, experts over all, attention TP 1
    ("megatron:tp=2,ep=2", EXPERT_PARALLEL),     # data-parallel replicas of attention
    ("plain:tp=2,ep=2", EXPERT_PARALLEL),
    ("vllm:4", REPLICATED_KV),
])
def test_each_moe_destination_names_its_forward(at, forward):
    where = endpoint(at)
    assert F.forward_of(where.convention, MOE, where) == forward


def test_replicated_cells_are_vllms_degrees_past_the_kv_heads():
    assert F.replicated_degrees(DENSE) == [4, 8]
    assert F.replicated_degrees(DENSE, 4) == [4]
    assert F.replicated_degrees(DENSE.replace(n_kv_heads=1)) == [2, 4, 8]
    assert F.replicated_degrees(DENSE.replace(n_kv_heads=8)) == []
    assert F.REPLICATED_MAX_DEGREE == 8


def test_the_expert_parallel_endpoints_are_vllms_and_megatrons_per_world():
    got = {t: [str(w) for w in ends] for t, ends in F.expert_parallel_endpoints(MOE).items()}
    assert got == {
        2: ["megatron:tp=1,ep=2", "megatron:tp=1,ep=2,etp=1",
            "megatron:tp=1,ep=2,experts=sequential", "megatron:tp=2,ep=2,etp=1",
            "vllm:tp=2,ep=2"],
        4: ["megatron:tp=1,ep=4", "megatron:tp=1,ep=4,etp=1",
            "megatron:tp=1,ep=4,experts=sequential", "megatron:tp=2,ep=2",
            "megatron:tp=2,ep=2,experts=sequential", "megatron:tp=2,ep=4,etp=1"],
        8: ["megatron:tp=2,ep=4", "megatron:tp=2,ep=4,experts=sequential",
            "megatron:tp=4,ep=2", "megatron:tp=4,ep=2,experts=sequential"]}
    assert sorted(F.expert_parallel_endpoints(MOE, 4)) == [2, 4]
    assert F.expert_parallel_endpoints(DENSE) == {}


# ---- the forwards a cell measures: held whole and streamed, the same logits -----------------

def test_the_inprocess_runner_is_rank_zeros_logits_of_the_declared_split():
    params, _, _ = reference(DENSE, 3)
    tokens = make_tokens(DENSE, 5)
    shards = split(params, layout_for(DENSE), 2)
    expected = ShardedModel(DENSE, shards, InProcessCollective(2))(tokens)[0]
    assert torch.equal(F.inprocess_runner(DENSE, 2, 3, 5), expected)
    other = init_params(DENSE, 7)  # given parameters are used, not the seed's
    got = F.inprocess_runner(DENSE, 2, 3, 5, params=other)
    assert torch.equal(got, ShardedModel(DENSE, split(other, layout_for(DENSE), 2),
                                         InProcessCollective(2))(tokens)[0])
    assert not torch.equal(got, expected)


def held(where, config, params, tokens, guard=None):
    plan = reading_plan(where.convention, config, where)
    inputs = [computing(x) for x in forward_inputs(materialize(where.pieces(config), params),
                                                   where.convention, config, where)]
    return forward_model(plan.forward, inputs, guard=guard)(tokens), plan


def test_convention_logits_are_rank_zeros_or_each_replicas_first_ranks():
    params, model, _ = reference(MOE, 0)
    tokens = make_tokens(MOE, 9)
    guard = RoutingGuard(model.routings, math.inf)
    where = endpoint("vllm:tp=2,ep=2")
    logits, _ = held(where, MOE, params, tokens, guard)
    got = F.convention_logits(where, MOE, materialize(where.pieces(MOE), params), tokens,
                              guard=guard)
    assert torch.equal(got, logits[0])
    replicas = endpoint("megatron:tp=2,ep=4")  # 8 ranks: 4 replicas of attention TP 2
    logits, plan = held(replicas, MOE, params, tokens, guard)
    got = F.convention_logits(replicas, MOE, materialize(replicas.pieces(MOE), params),
                              tokens, "1a", guard)
    assert plan.forward.tp == 2 and got.shape == (4, *logits[0].shape)
    assert torch.equal(got, torch.stack([logits[0], logits[2], logits[4], logits[6]]))


def test_convention_logits_in_phase_1b_run_over_gloo(monkeypatch):
    seen = []

    def gloo(forward, inputs, tokens, guard=None):
        seen.append((forward, inputs, tokens, guard))
        return torch.zeros(1)

    monkeypatch.setattr(F, "gloo_logits", gloo)
    params = init_params(DENSE, 0, dtype=torch.bfloat16)
    where = endpoint("vllm:2")
    shards = materialize(where.pieces(DENSE), params)
    tokens = make_tokens(DENSE, 1)
    marker = object()
    assert torch.equal(F.convention_logits(where, DENSE, shards, tokens, "1b", marker),
                       torch.zeros(1))
    [(forward, inputs, got_tokens, guard)] = seen
    assert forward == reading_plan(where.convention, DENSE, where).forward
    assert guard is marker and got_tokens is tokens
    expected = forward_inputs(shards, where.convention, DENSE, where)
    assert [sorted(x) for x in inputs] == [sorted(x) for x in expected]
    assert all(x[n].dtype == torch.float32 and torch.equal(x[n], e[n].float())
               for x, e in zip(inputs, expected) for n in x)  # upcast as read


def test_replicated_logits_read_the_declared_vllm_shards(monkeypatch):
    params, _, _ = reference(DENSE, 1)
    tokens = make_tokens(DENSE, 2)
    target = endpoint("vllm:4")
    expected = F.convention_logits(target, DENSE, materialize(target.pieces(DENSE), params),
                                   tokens)
    assert torch.equal(F.replicated_logits(DENSE, params, 4, tokens), expected)
    seen = []
    monkeypatch.setattr(F, "convention_logits",
                        lambda where, *a, **k: seen.append((str(where), a, k)))
    F.replicated_logits(DENSE, params, 8, tokens, "1b", guard="g")
    [(where, (config, shards, got_tokens, phase), kwargs)] = seen
    assert (where, config, got_tokens, phase, kwargs) == ("vllm:8", DENSE, tokens, "1b",
                                                         {"guard": "g"})
    declared = materialize(endpoint("vllm:8").pieces(DENSE), params)
    assert len(shards) == 8 and all(torch.equal(s[n], d[n]) for s, d in zip(shards, declared)
                                    for n in d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_streamed_replicated_cell_is_the_held_one_bit_for_bit(dtype):
    params, _, expected = reference(DENSE, 2, dtype)
    tokens = make_tokens(DENSE, TOKEN_SEED_OFFSET + 2)
    logits = F.replicated_logits(DENSE, params, 4, tokens)
    got = F.stream_replicated_deviation(DENSE, 4, seed=2, dtype=dtype)
    assert torch.equal(got, (logits - expected).abs().flatten())
    assert not torch.equal(got, F.stream_replicated_deviation(DENSE, 4, seed=3, dtype=dtype))


def test_the_streamed_convention_cell_reports_each_stage_and_the_route():
    where = endpoint("vllm:tp=2,ep=2")
    params, model, expected = reference(MOE, 1)
    tokens = make_tokens(MOE, TOKEN_SEED_OFFSET + 1)
    logits, _ = held(where, MOE, params, tokens, RoutingGuard(model.routings, math.inf))
    told, route = [], []
    got = F.stream_convention_deviation(MOE, where, seed=1, progress=told.append, route=route)
    assert torch.equal(got, (logits[0] - expected).abs().flatten())
    steps = stages(MOE)
    assert [(p.stage, p.stages, p.label) for p in told] == [
        (k + 1, len(steps), label) for k, (label, _) in enumerate(steps)]
    assert [p.bytes for p in told] == [sum(params[n].numel() * 4 for n in names)
                                       for _, names in steps]
    assert all(0 <= a.elapsed <= b.elapsed for a, b in zip(told, told[1:]))
    held_route = []
    F.convention_deviation(MOE, where, seed=1, route=held_route)
    assert len(route) == 1 and route == held_route
    assert F.stream_convention_deviation(DENSE, endpoint("vllm:2"), seed=0).shape == (
        DENSE.batch * DENSE.seq_len * DENSE.vocab,)


def test_the_streamed_replicated_cell_passes_progress_and_route_on(monkeypatch):
    seen = []
    monkeypatch.setattr(F, "stream_convention_deviation",
                        lambda config, where, **k: seen.append((config, str(where), k)))
    F.stream_replicated_deviation(DENSE, 8, seed=4, dtype="bf16", progress=print, route=[1.0])
    assert seen == [(DENSE, "vllm:8", {"seed": 4, "dtype": "bf16", "progress": print,
                                        "route": [1.0]})]


def test_the_held_convention_cell_counts_every_replica():
    where = endpoint("megatron:tp=2,ep=4")
    params, model, expected = reference(MOE, 0)
    tokens = make_tokens(MOE, TOKEN_SEED_OFFSET)
    logits, _ = held(where, MOE, params, tokens, RoutingGuard(model.routings, math.inf))
    route = []
    got = F.convention_deviation(MOE, where, seed=0, route=route)
    assert torch.equal(got, torch.cat([(x - expected).abs().flatten() for x in logits[::2]]))
    with torch.no_grad():
        model2 = forward_model(reading_plan(where.convention, MOE, where).forward,
                               forward_inputs(materialize(where.pieces(MOE), params),
                                              where.convention, MOE, where),
                               guard=RoutingGuard(model.routings, math.inf))
        model2(tokens)
    assert route == [score_deviation(model2.routings, model.routings)]
    assert torch.equal(F.convention_deviation(MOE, where, seed=0), got)


# ---- measure: what each repetition runs, and what it files ---------------------------------

class Spy:
    """Stands in for a forward: records what it was asked and returns the logits ``answer``
    gives, so the test knows every deviation the loop must file."""

    def __init__(self, answer):
        self.calls, self.answer = [], answer

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.answer(*args, **kwargs)


@pytest.fixture
def cells(monkeypatch):
    """Every cell ``measure`` files: (config, degree, forward, deviations, route)."""
    filed = []
    real = record.cell

    def cell(name, degree, deviations, forward=PLAIN_FORWARD, route=None):
        filed.append((name, degree, forward, [d.copy() for d in deviations], route))
        return real(name, degree, deviations, forward=forward, route=route)

    monkeypatch.setattr(record, "cell", cell)
    return filed


def offset(t, rep):
    return 2.0 ** -(t + 4 * rep)


def test_measure_runs_every_degree_of_every_seed_with_the_seeds_tokens(cells):
    def answer(config, t, rep, token_seed):
        _, _, expected = reference(config, rep)
        assert token_seed == TOKEN_SEED_OFFSET + rep
        return expected + offset(t, rep)

    runner = Spy(answer)
    told = []
    artifact = F.measure(configs=[DENSE, DENSE.replace(name="other")], repetitions=2,
                         runner=runner, progress=lambda *a: told.append(a))
    assert [a for a, _ in runner.calls] == [
        (c, t, rep, TOKEN_SEED_OFFSET + rep) for c in (DENSE, DENSE.replace(name="other"))
        for rep in (0, 1) for t in (1, 2)]
    assert [(n, t, f, r) for n, t, f, _, r in cells] == [
        ("dense", 1, PLAIN_FORWARD, None), ("dense", 2, PLAIN_FORWARD, None),
        ("other", 1, PLAIN_FORWARD, None), ("other", 2, PLAIN_FORWARD, None)]
    for _, t, _, deviations, _ in cells:
        assert len(deviations) == 2
        for rep, d in enumerate(deviations):
            _, _, expected = reference(DENSE, rep)
            assert np.array_equal(d, ((expected + offset(t, rep)) - expected).abs().flatten()
                                  .numpy())
    assert told == [(1, 4, "dense seed 1/2"), (2, 4, "dense seed 2/2"),
                    (3, 4, "other seed 1/2"), (4, 4, "other seed 2/2")]
    assert artifact["phase"] == "1a" and artifact["repetitions"] == 2
    assert list(artifact["configs"]) == ["dense", "other"] and "weights_dtype" not in artifact
    assert [c["degree"] for c in artifact["cells"]] == [1, 2, 1, 2]


def test_measure_by_default_runs_the_inprocess_forward_on_the_seeds_parameters(cells):
    artifact = F.measure(configs=[DENSE], repetitions=2)
    for _, t, _, deviations, _ in cells:
        for rep, d in enumerate(deviations):
            _, _, expected = reference(DENSE, rep)
            logits = F.inprocess_runner(DENSE, t, rep, TOKEN_SEED_OFFSET + rep)
            assert np.array_equal(d, (logits - expected).abs().flatten().numpy())
    assert [(n, t) for n, t, *_ in cells] == [("dense", 1), ("dense", 2)]
    assert artifact["worst_abs"] == max(c["worst_abs"] for c in artifact["cells"])


@pytest.mark.parametrize("dtype, weights", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_measure_in_a_synced_dtype_hands_the_forward_the_declared_shards_upcast(
        cells, dtype, weights):
    def answer(config, shards, tokens):
        return ReferenceModel(config, computing(init_params(config, 0, dtype=weights)))(tokens)

    forward = Spy(answer)
    artifact = F.measure(configs=[DENSE], repetitions=2, dtype=dtype, forward=forward)
    assert len(forward.calls) == 4
    for k, ((config, shards, tokens), kwargs) in enumerate(forward.calls):
        rep, t = divmod(k, 2)
        t += 1
        params = init_params(DENSE, rep, dtype=weights)
        assert config is DENSE and kwargs == {}
        assert torch.equal(tokens, make_tokens(DENSE, TOKEN_SEED_OFFSET + rep))
        declared = [computing(p) for p in split(params, layout_for(DENSE), t)]
        assert len(shards) == t and all(
            sorted(s) == sorted(d) and all(
                torch.equal(s[n], d[n]) and s[n].dtype == torch.float32 for n in d)
            for s, d in zip(shards, declared))
    assert artifact["weights_dtype"] == dtype and artifact["compute_dtype"] == "fp32"
    # the stand-in answers the first repetition's reference: its deviations are 0, not the
    # second's
    assert [float(ds[0].max()) for *_, ds, _ in cells] == [0.0, 0.0]
    assert all(ds[1].max() > 0 for *_, ds, _ in cells)


def test_measure_in_a_synced_dtype_defaults_to_the_inprocess_forward(monkeypatch, cells):
    seen = []
    monkeypatch.setattr(F, "inprocess_forward",
                        lambda *a, **k: seen.append(a) or inprocess_forward(*a, **k))
    F.measure(configs=[DENSE], repetitions=1, dtype="bf16")
    assert [len(a[1]) for a in seen] == [1, 2]
    assert F.measure(configs=[DENSE], repetitions=1)["cells"][0]["degree"] == 1
    assert len(seen) == 2  # fp32 weights: the runner, not the forward


def test_measure_of_fp8_weights_computes_from_the_dequantized_bf16_draws(cells):
    def answer(config, shards, tokens):
        return torch.zeros(1)

    forward = Spy(answer)
    artifact = F.measure(configs=[DENSE], repetitions=1, dtype="fp8_tensor", forward=forward)
    params = init_params(DENSE, 0, dtype=torch.bfloat16)
    fp8 = dequantize_canonical(DENSE, *quantize_canonical(DENSE, params, "tensor"), params,
                               "tensor")
    (_, shards, _), _ = forward.calls[0]
    assert all(torch.equal(shards[0][n], computing(fp8)[n]) for n in fp8)
    assert not all(torch.equal(shards[0][n], params[n].float()) for n in params)
    assert artifact["weights_dtype"] == "fp8_tensor"
    assert artifact["quantized_from"] == "bf16"


def test_measure_refuses_a_phase_it_cannot_run_by_name():
    def refusal(**kw):
        with pytest.raises(ToleranceMismatch) as exc:
            F.measure(configs=[DENSE], repetitions=1, **kw)
        return str(exc.value)

    assert refusal(phase="2") == "unknown phase '2'; known: 1a, 1b"
    assert refusal(phase="1b") == "phase 1b needs its own runner (the gloo launcher)"
    assert refusal(phase="1b", dtype="bf16") == "phase 1b needs its own forward (the gloo one)"
    assert refusal(phase="1b", dtype="fp8_block128") == (
        "phase 1b needs its own forward (the gloo one)")


def test_measure_in_phase_1b_with_a_forward_needs_no_runner(cells, monkeypatch):
    seen = []
    monkeypatch.setattr(F, "replicated_logits",
                        lambda config, params, t, tokens, phase, **k: seen.append((t, phase))
                        or torch.zeros(1))
    forward = Spy(lambda config, shards, tokens: torch.zeros(1))
    artifact = F.measure("1b", configs=[DENSE], repetitions=1, forward=forward,
                         replicated=True, max_degree=4)
    assert len(forward.calls) == 2 and seen == [(4, "1b")]
    assert artifact["phase"] == "1b"
    assert [(t, f) for _, t, f, _, _ in cells] == [
        (1, PLAIN_FORWARD), (2, PLAIN_FORWARD), (4, REPLICATED_KV)]


def test_measure_adds_replicated_and_expert_cells_after_the_plain_ones(cells, monkeypatch):
    replicated, experts = [], []

    def fake_replicated(config, params, t, tokens, phase, **guard):
        replicated.append((config.name, t, phase, sorted(guard)))
        return torch.full((1,), float(t))

    def fake_convention(where, config, shards, tokens, phase, **guard):
        experts.append((str(where), phase, sorted(guard)))
        return torch.full((1,), float(where.world) + 0.5)

    monkeypatch.setattr(F, "replicated_logits", fake_replicated)
    monkeypatch.setattr(F, "convention_logits", fake_convention)
    runner = Spy(lambda config, t, rep, tok: torch.zeros(1))
    F.measure(configs=[MOE], repetitions=1, runner=runner, replicated=True, max_degree=4)
    # world 4's expert-parallel endpoints all hold replicas of attention TP: no cell there
    assert [(t, f) for _, t, f, _, _ in cells] == [
        (1, PLAIN_FORWARD), (2, PLAIN_FORWARD), (4, REPLICATED_KV), (2, EXPERT_PARALLEL)]
    assert replicated == [("moe_few", 4, "1a", ["guard"])]
    # only endpoints whose world is one TP group (a forward over gloo runs one)
    assert experts == [("megatron:tp=2,ep=2,etp=1", "1a", ["guard"]),
                       ("vllm:tp=2,ep=2", "1a", ["guard"])]
    _, _, expected = reference(MOE, 0)
    assert len(cells[3][3]) == 2 and all(
        np.array_equal(d, (2.5 - expected).abs().flatten().numpy()) for d in cells[3][3])


def test_measure_runs_no_replicated_cells_unless_asked(cells, monkeypatch):
    monkeypatch.setattr(F, "replicated_logits", lambda *a, **k: pytest.fail("not asked"))
    monkeypatch.setattr(F, "convention_logits", lambda *a, **k: pytest.fail("not asked"))
    runner = Spy(lambda config, t, rep, tok: torch.zeros(1))
    F.measure(configs=[MOE], repetitions=1, runner=runner)
    F.measure(configs=[DENSE], repetitions=1, runner=runner, replicated=False)
    assert [(n, t, f) for n, t, f, _, _ in cells] == [
        ("moe_few", 1, PLAIN_FORWARD), ("moe_few", 2, PLAIN_FORWARD),
        ("dense", 1, PLAIN_FORWARD), ("dense", 2, PLAIN_FORWARD)]


def test_the_committed_configs_measure_their_replicated_cells_by_default(cells, monkeypatch):
    seen = []
    monkeypatch.setattr(F, "replicated_logits",
                        lambda config, params, t, *a, **k: seen.append((config.name, t))
                        or torch.zeros(1))
    runner = Spy(lambda config, t, rep, tok: torch.zeros(1))
    F.measure(repetitions=1, runner=runner)
    assert seen == [("toy", t) for t in F.replicated_degrees(TOY)] + [
        ("toy_kv4", t) for t in F.replicated_degrees(TOY_KV4)]
    assert seen and {n for n, *_ in cells} == {"toy", "toy_kv4"}


def test_an_moe_measurement_keeps_the_references_choice_on_every_token(cells):
    guards = []

    def forward(config, shards, tokens, guard=None):
        guards.append(guard)
        return torch.zeros(1)

    F.measure(configs=[MOE], repetitions=1, dtype="bf16", forward=forward)
    _, model, _ = reference(MOE, 0, torch.bfloat16)
    assert len(guards) == 2 and all(g.bound == math.inf for g in guards)
    assert all(torch.equal(g.routings[k].margin, model.routings[k].margin)
               for g in guards for k in model.routings)
    dense = []
    F.measure(configs=[DENSE], repetitions=1, dtype="bf16",
              forward=lambda c, s, t, **k: dense.append(k) or torch.zeros(1))
    assert dense == [{}, {}]


# ---- measure_geometry: the streamed cells of one geometry, and where they are kept -----------

@pytest.fixture
def streamed(monkeypatch):
    """Stands in the streamed deviations: each returns [world + which, seed] and records its
    call; the held-whole one likewise."""
    calls = []

    def stand_in(which, value):
        def run(config, t, *, seed, dtype=None, progress=None, route=None):
            assert isinstance(config, ModelConfig)
            calls.append((which, str(t), seed, dtype))
            if progress is not None:
                from weight_sync_bench.check.streaming import Progress
                progress(Progress(1, 2, "embedding", 0, 0.0))
                progress(Progress(2, 2, "head", 0, 0.0))
            if route is not None:
                route.append(0.25 * (seed + 1))
            world = t if isinstance(t, int) else t.world
            return torch.tensor([world + value, float(seed)])
        return run

    monkeypatch.setattr(F, "stream_deviation", stand_in("plain", 0.0))
    monkeypatch.setattr(F, "stream_replicated_deviation", stand_in("replicated", 0.1))
    monkeypatch.setattr(F, "stream_convention_deviation", stand_in("convention", 0.2))

    def whole(config, where, *, seed, route=None):
        assert isinstance(config, ModelConfig)
        calls.append(("whole", str(where), seed, None))
        if route is not None:
            route.append(0.0)
        return torch.tensor([where.world + 0.3, float(seed)])

    monkeypatch.setattr(F, "convention_deviation", whole)
    return calls


@pytest.fixture
def floors(tmp_path, monkeypatch):
    monkeypatch.setenv("WSB_TOLERANCE_DIR", str(tmp_path / "tol"))
    return tmp_path


def test_a_dense_geometrys_floor_streams_every_cell_and_is_kept_under_its_key(
        streamed, cells, floors):
    told = []
    artifact, path = F.measure_geometry(DENSE, repetitions=2, dtype="bf16",
                                        progress=lambda *a: told.append(a))
    assert path == cached_floor_path(DENSE, "1a", "bf16")
    assert streamed == [
        ("plain", "1", 0, "bf16"), ("plain", "1", 1, "bf16"),
        ("plain", "2", 0, "bf16"), ("plain", "2", 1, "bf16"),
        ("replicated", "4", 0, "bf16"), ("replicated", "4", 1, "bf16"),
        ("replicated", "8", 0, "bf16"), ("replicated", "8", 1, "bf16")]
    assert [(t, f, r) for _, t, f, _, r in cells] == [
        (1, PLAIN_FORWARD, None), (2, PLAIN_FORWARD, None), (4, REPLICATED_KV, None),
        (8, REPLICATED_KV, None)]
    assert [[list(d) for d in ds] for *_, ds, _ in cells] == [
        [[t + v, 0.0], [t + v, 1.0]] for t, v in ((1, 0.0), (2, 0.0), (4, 0.1), (8, 0.1))]
    # each stage of each (unit, seed): done of 4 cells x 2 seeds x 2 stages
    assert [a[:2] for a in told] == [(k, 16) for k in range(1, 17)]
    assert told[0][2] == "seed 1/2, t=1, embedding"
    assert told[3][2] == "seed 2/2, t=1, head"
    assert told[8][2] == f"seed 1/2, t=4 ({REPLICATED_KV}), embedding"
    assert artifact["kind"] == "geometry" and artifact["weights_dtype"] == "bf16"
    assert artifact["repetitions"] == 2 and list(artifact["configs"]) == ["dense"]
    import json
    assert json.loads(path.read_text()) == json.loads(json.dumps(artifact))


def test_an_moe_geometrys_floor_has_its_expert_cells_each_the_worst_of_its_endpoints(
        streamed, cells, floors, monkeypatch):
    out = floors / "mine.json"
    artifact, path = F.measure_geometry(MOE, repetitions=1, max_degree=4, out=out)
    assert path == out and out.is_file()
    assert [(t, f) for _, t, f, _, _ in cells] == [
        (1, PLAIN_FORWARD), (2, PLAIN_FORWARD), (4, REPLICATED_KV),
        (2, EXPERT_PARALLEL), (4, EXPERT_PARALLEL)]
    assert all(r == [0.25] for *_, r in cells[:3])
    by_world = [(w, which) for which, w, _, _ in streamed if which in ("convention", "whole")]
    # a forward of one TP group streams; one over replicas of attention TP is held whole
    assert by_world == [
        ("megatron:tp=1,ep=2", "whole"), ("megatron:tp=1,ep=2,etp=1", "whole"),
        ("megatron:tp=1,ep=2,experts=sequential", "whole"),
        ("megatron:tp=2,ep=2,etp=1", "convention"), ("vllm:tp=2,ep=2", "convention"),
        ("megatron:tp=1,ep=4", "whole"), ("megatron:tp=1,ep=4,etp=1", "whole"),
        ("megatron:tp=1,ep=4,experts=sequential", "whole"),
        ("megatron:tp=2,ep=2", "whole"), ("megatron:tp=2,ep=2,experts=sequential", "whole"),
        ("megatron:tp=2,ep=4,etp=1", "whole")]
    assert [[list(d) for d in ds] for *_, ds, _ in cells[3:]] == [
        [[2.3, 0.0]] * 3 + [[2.2, 0.0]] * 2, [[4.3, 0.0]] * 6]
    assert cells[3][4] == [0.0] * 3 + [0.25] * 2 and cells[4][4] == [0.0] * 6
    # too large to hold whole: the replica endpoints are left out, not streamed wrongly
    cells.clear()
    streamed.clear()
    monkeypatch.setattr(F, "HELD_WHOLE", MOE.n_params - 1)
    F.measure_geometry(MOE, repetitions=1, max_degree=4, out=out)
    assert [(t, f, len(ds)) for _, t, f, ds, _ in cells[3:]] == [(2, EXPERT_PARALLEL, 2)]
    assert not [c for c in streamed if c[0] == "whole"]
    monkeypatch.setattr(F, "HELD_WHOLE", MOE.n_params)
    streamed.clear()
    F.measure_geometry(MOE, repetitions=1, max_degree=4, out=out)
    assert len([c for c in streamed if c[0] == "whole"]) == 9


def test_a_world_of_only_replica_endpoints_too_large_to_hold_files_no_cell(
        streamed, cells, floors, monkeypatch):
    monkeypatch.setattr(F, "expert_parallel_endpoints",
                        lambda config, max_degree: {4: [endpoint("megatron:tp=2,ep=2")]})
    monkeypatch.setattr(F, "HELD_WHOLE", 0)
    F.measure_geometry(MOE, repetitions=1, max_degree=4, out=floors / "f.json")
    assert [(t, f) for _, t, f, _, _ in cells] == [
        (1, PLAIN_FORWARD), (2, PLAIN_FORWARD), (4, REPLICATED_KV)]


def test_a_geometry_floor_in_phase_1b_is_measure_held_whole(monkeypatch, floors):
    with pytest.raises(ToleranceMismatch, match=r"^phase 1b needs its own forward \(the gloo"):
        F.measure_geometry(DENSE, phase="1b")
    seen = []

    def fake(phase, **kwargs):
        seen.append((phase, kwargs))
        return {"schema": 1, "phase": phase, "cells": []}

    monkeypatch.setattr(F, "measure", fake)
    artifact, path = F.measure_geometry(DENSE, phase="1b", dtype="bf16", repetitions=3,
                                        forward="fw", progress=print, max_degree=4)
    assert seen == [("1b", {"configs": [DENSE], "repetitions": 3, "dtype": "bf16",
                            "forward": "fw", "replicated": True, "max_degree": 4,
                            "progress": print})]
    assert path == cached_floor_path(DENSE, "1b", "bf16") and path.is_file()
    assert artifact["kind"] == "geometry" and artifact["weights_dtype"] == "bf16"


def test_the_real_streamed_geometry_floor_is_the_held_measurement_cell_for_cell(floors):
    artifact, _ = F.measure_geometry(DENSE, repetitions=2, max_degree=4)
    held_whole = F.measure(configs=[DENSE], repetitions=2, replicated=True, max_degree=4)
    assert [(c["degree"], c.get("forward"), c["worst_abs"], c["elements"])
            for c in artifact["cells"]] == [
        (c["degree"], c.get("forward"), c["worst_abs"], c["elements"])
        for c in held_whole["cells"]]
    assert F.GEOMETRY_REPETITIONS == 4 and F.REPETITIONS == 20


# ---- what the first pass left: defaults, a one-rank world, the guard, the embedding --------

def test_a_one_rank_destinations_logits_are_its_only_ranks():
    params, _, _ = reference(DENSE, 0)
    tokens = make_tokens(DENSE, 1)
    where = endpoint("vllm:1")
    logits, _ = held(where, DENSE, params, tokens)
    got = F.convention_logits(where, DENSE, materialize(where.pieces(DENSE), params), tokens)
    assert torch.equal(got, logits[0])


def test_the_streamed_cells_default_to_the_first_seed():
    assert torch.equal(F.stream_replicated_deviation(DENSE, 4),
                       F.stream_replicated_deviation(DENSE, 4, seed=0))
    where = endpoint("vllm:2")
    assert torch.equal(F.stream_convention_deviation(DENSE, where),
                       F.stream_convention_deviation(DENSE, where, seed=0))
    assert not torch.equal(F.stream_convention_deviation(DENSE, where),
                           F.stream_convention_deviation(DENSE, where, seed=1))


def test_a_streamed_moe_cell_keeps_the_references_choice_and_a_dense_one_has_no_guard(
        sharded_guards):
    F.stream_convention_deviation(MOE, endpoint("vllm:tp=2,ep=2"), seed=0)
    F.stream_convention_deviation(DENSE, endpoint("vllm:2"), seed=0)
    moe, dense = sharded_guards
    _, model, _ = reference(MOE, 0)
    assert isinstance(moe, RoutingGuard) and moe.bound == math.inf
    assert sorted(moe.routings) == sorted(model.routings) and all(
        torch.equal(moe.routings[k].margin, model.routings[k].margin) for k in model.routings)
    assert dense is None


def test_a_streamed_cell_of_an_embedding_split_on_the_hidden_dimension_reads_it_so():
    """Meta's ParallelEmbedding holds columns, not vocabulary rows (``Shard(1)``)."""
    where = endpoint("meta:2")
    params, _, expected = reference(DENSE, 0)
    tokens = make_tokens(DENSE, TOKEN_SEED_OFFSET)
    logits = F.convention_logits(where, DENSE, materialize(where.pieces(DENSE), params), tokens)
    assert torch.equal(F.stream_convention_deviation(DENSE, where, seed=0),
                       (logits - expected).abs().flatten())


def test_the_streamed_cells_elapsed_time_is_since_it_began():
    import time
    began = time.perf_counter()
    told = []
    F.stream_convention_deviation(DENSE, endpoint("vllm:2"), seed=0, progress=told.append)
    took = time.perf_counter() - began
    assert told and all(0 <= p.elapsed <= took for p in told)


def test_the_held_convention_cell_keeps_the_references_choice(monkeypatch):
    guards = []
    real = F.forward_model

    def spy(forward, inputs, guard=None):
        guards.append(guard)
        return real(forward, inputs, guard=guard)

    monkeypatch.setattr(F, "forward_model", spy)
    F.convention_deviation(MOE, endpoint("megatron:tp=2,ep=4"), seed=1)
    _, model, _ = reference(MOE, 1)
    [guard] = guards
    assert isinstance(guard, RoutingGuard) and guard.bound == math.inf
    assert all(torch.equal(guard.routings[k].margin, model.routings[k].margin)
               for k in model.routings)


@pytest.mark.parametrize("scheme", ["block128", "tensor"])
def test_measure_of_fp8_weights_quantizes_in_its_own_scheme(cells, scheme):
    wide = DENSE.replace(name="wide", ffn=256)  # gate_up's 512 rows: four 128-row blocks
    forward = Spy(lambda config, shards, tokens: torch.zeros(1))
    F.measure(configs=[wide], repetitions=1, dtype=f"fp8_{scheme}", forward=forward)
    params = init_params(wide, 0, dtype=torch.bfloat16)
    other = "tensor" if scheme == "block128" else "block128"
    mine, theirs = (dequantize_canonical(wide, *quantize_canonical(wide, params, s), params, s)
                    for s in (scheme, other))
    (_, shards, _), _ = forward.calls[0]
    assert all(torch.equal(shards[0][n], computing(mine)[n]) for n in mine)
    assert not all(torch.equal(shards[0][n], computing(theirs)[n]) for n in mine)


def test_measure_hands_the_expert_forward_the_declared_shards_and_the_seeds_tokens(
        cells, monkeypatch):
    seen = []

    def fake_convention(where, config, shards, tokens, phase, **guard):
        seen.append((str(where), config, shards, tokens))
        return torch.zeros(1)

    monkeypatch.setattr(F, "convention_logits", fake_convention)
    monkeypatch.setattr(F, "replicated_logits", lambda *a, **k: torch.zeros(1))
    F.measure(configs=[MOE], repetitions=2, runner=Spy(lambda *a: torch.zeros(1)),
              replicated=True, max_degree=2)
    assert [w for w, *_ in seen] == ["megatron:tp=2,ep=2,etp=1", "vllm:tp=2,ep=2"] * 2
    for k, (w, config, shards, tokens) in enumerate(seen):
        rep = k // 2
        assert config is MOE
        assert torch.equal(tokens, make_tokens(MOE, TOKEN_SEED_OFFSET + rep))
        declared = materialize(endpoint(w).pieces(MOE), init_params(MOE, rep))
        assert len(shards) == len(declared) and all(
            torch.equal(s[n], d[n]) for s, d in zip(shards, declared) for n in d)
    assert {n for n, *_ in cells} == {"moe_few"}


def test_measure_asks_for_expert_cells_up_to_its_largest_degree_only(cells, monkeypatch):
    mha = MOE.replace(name="mha", n_heads=8, n_kv_heads=8, head_dim=2)  # EP cells at 8 too
    worlds = []
    monkeypatch.setattr(F, "convention_logits",
                        lambda where, *a, **k: worlds.append(where.world) or torch.zeros(1))
    monkeypatch.setattr(F, "replicated_logits", lambda *a, **k: torch.zeros(1))
    runner = Spy(lambda *a: torch.zeros(1))
    F.measure(configs=[mha], repetitions=1, runner=runner, replicated=True, max_degree=4)
    assert sorted(set(worlds)) == [2, 4]
    worlds.clear()
    F.measure(configs=[mha], repetitions=1, runner=runner, replicated=True)
    assert sorted(set(worlds)) == [2, 4, 8]


def test_a_geometry_floor_records_its_phase_dtype_key_and_names(streamed, cells, floors):
    from weight_sync_bench.tolerance.rules import geometry_key, geometry_record

    artifact, path = F.measure_geometry(DENSE, repetitions=1)
    assert path == cached_floor_path(DENSE, "1a", "fp32")
    assert artifact["phase"] == "1a" and artifact["weights_dtype"] == "fp32"
    assert artifact["key"] == geometry_key(DENSE, "1a", "fp32")
    assert artifact["record"] == geometry_record(DENSE, "1a", "fp32")
    assert {n for n, *_ in cells} == {"dense"} and "weights_dtype" in artifact


def test_an_moe_geometrys_expert_cells_stream_in_its_dtype_with_progress(
        streamed, cells, floors):
    told = []
    F.measure_geometry(MOE, repetitions=1, dtype="bf16", max_degree=2, out=floors / "m.json",
                       progress=lambda *a: told.append(a[2]))
    convention = [c for c in streamed if c[0] == "convention"]
    assert convention == [("convention", "megatron:tp=2,ep=2,etp=1", 0, "bf16"),
                          ("convention", "vllm:tp=2,ep=2", 0, "bf16")]
    assert [w for w in told if "expert-parallel" in w] == [
        f"seed 1/1, t=2 ({EXPERT_PARALLEL}), {label}"
        for _ in range(2) for label in ("embedding", "head")]
    assert {n for n, *_ in cells} == {"moe_few"}


def test_a_one_expert_geometry_is_an_moe_floor_with_its_routes(streamed, cells, floors):
    one = MOE.replace(name="one", n_experts=1, top_k=1)
    F.measure_geometry(one, repetitions=1, max_degree=2, out=floors / "o.json")
    assert cells and all(r == [0.25] for *_, r in cells)
    cells.clear()
    F.measure_geometry(DENSE, repetitions=1, max_degree=2, out=floors / "d.json")
    assert all(r is None for *_, r in cells)
