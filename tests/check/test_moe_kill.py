"""The kill matrix of the MoE conversion mutations: each public MoE bug injected into the
harness's own conversion is detected wherever it is not the identity, by >= KILL_MARGIN x
the threshold, over every ordered pair of MoE endpoints (``conventions.moe_endpoints``: each
convention at each TP degree, EP 2, 4 or TP, expert-TP 1 or the default, Megatron's
SequentialMLP, vLLM's round-robin map and FlashInfer's ``[w3; w1]``, HF v5's fused experts);
where it is declared the identity its bytes really are unchanged; it changes only what its
``changes`` names.

The default run takes the matrix on ``EVERY`` (a small geometry where every MoE mutation
is live: square experts, an uneven expert count, a sigmoid router with a selection bias and
groups, a gated shared expert, q/k norms) between ten of its endpoints that meet every
outcome all of them meet (``EVERY_ENDPOINTS``), the README's pair and one other on TOY_MOE,
and the bytes of declared identities on the reduced Qwen3 between endpoints that meet each
of its identity reasons; the long run (``WSB_PROFILE=wsb-nightly``) takes the whole matrix
on EVERY, on a reduced Qwen3-30B-A3B (128 experts of 48, top 8, one layer: its threshold
measured here) and on TOY_MOE and TOY_MOE_DS (judged by their committed floors).
``bench/moe_kill_matrix.py`` prints the ratios.
``test_the_default_run_reaches_every_outcome_of_the_whole_matrix`` checks the long run adds
no live outcome the default run does not reach, and that the default run's pairs on EVERY
meet every outcome (not applicable, identity, live: each with its reason) all its pairs
meet."""

from __future__ import annotations

import functools
import math

import pytest

from tests.breadth import breadth
from weight_sync_bench.check.convert import conversion_checker, measure_threshold
from weight_sync_bench.check.floor import convention_logits
from weight_sync_bench.check.kill_matrix import KILL_MARGIN, kill_matrix
from weight_sync_bench.conventions import endpoint, moe_endpoints
from weight_sync_bench.conventions.mutations import MOE_MUTATIONS, Conversion
from weight_sync_bench.fuzz.profiles import profile_name
from weight_sync_bench.model.config import TOY, TOY_MOE, TOY_MOE_DS, shipped_hf_config
from weight_sync_bench.model.sharded import RoutingGuard

# Every MoE mutation is live here: experts as wide as the model (a transposed expert keeps
# its shape), 6 experts (uneven over 4 EP ranks), a sigmoid router with a selection bias
# over 2 groups, a gated shared expert, q/k norms; 32 tokens a sequence (a selection bias
# shows only where a choice flips: ConversionMutation.min_seq_len).
EVERY = TOY.replace(name="every_moe", vocab=256, d_model=64, n_heads=4, n_kv_heads=2,
                    head_dim=16, ffn=96, n_layers=2, seq_len=32, qk_norm=True, n_experts=6,
                    top_k=2, expert_ffn=64, router="sigmoid", router_bias=True,
                    norm_topk=True, n_groups=2, topk_groups=1, shared_ffn=32,
                    shared_gate=True)
QWEN3_30B = shipped_hf_config("qwen3_30b_a3b", shrink=16, n_layers=1, vocab=512)
LONG_RUN = [QWEN3_30B, TOY_MOE, TOY_MOE_DS]
NIGHTLY = pytest.mark.skipif(profile_name() != "wsb-nightly",
                             reason="the long run: WSB_PROFILE=wsb-nightly (make nightly)")
# The README's worked example and its neighbours, on TOY_MOE in the default run.
README_PAIRS = [("megatron:tp=2,ep=4", "vllm:4"), ("megatron:tp=2,ep=2,etp=1", "vllm:tp=2,ep=2")]


@functools.cache
def checker(config):
    if config in (TOY_MOE, TOY_MOE_DS):
        return conversion_checker(config)  # the committed floor (tolerance/geometry/)
    # No committed floor: measured here over every endpoint's forward, as a floor is.
    return conversion_checker(config, threshold=measure_threshold(config, moe_endpoints(config)))


def _assert_rows(rows):
    killed = 0
    for row in rows:
        if row.outcome in ("not applicable", "live"):  # live: not run (kill_matrix live=False)
            continue
        assert not row.stray, (row.mutation, str(row.conversion), row.stray)
        if row.outcome == "identity":
            # a declared identity is one: not a byte moves (the verdict is the pass the
            # unmutated destination gets, test_the_harness_conversion_passes)
            assert not row.changed, (row.mutation, str(row.conversion), row.reason)
            continue
        assert row.changed, (row.mutation, str(row.conversion))
        assert row.verdict is not None and row.verdict.first_mismatch is not None
        if row.outcome == "unchanged":  # selection-only, no choice moved: the bytes show it
            continue
        assert row.outcome == "killed", str(row.verdict)
        killed += 1
    return killed


def _live(config):
    """The MoE mutations that can be live in ``config`` (each must be killed somewhere)."""
    return {m.name for m in MOE_MUTATIONS
            if not ((m.name.startswith("router_bias") and not config.router_bias)
                    or (m.name == "expert_transposed_twice" and config.expert_ffn != config.d_model)
                    or (m.name == "shared_gate_dropped" and not config.shared_gate)
                    or (m.name == "qk_norm_from_next_layer"
                        and (not config.qk_norm or config.n_layers == 1))
                    or (m.name == "ep_remainder_to_last"
                        and all(config.n_experts % ep == 0 for ep in (2, 4, config.n_heads))))}


# The default run's endpoints on EVERY: every convention with each of its options (HF's
# fused experts, FlashInfer's [w3; w1], Megatron's SequentialMLP, vLLM's round-robin map),
# TP 1, 2 and 4, EP 1, 2 and 4 (6 experts: even over 2, uneven over 4), expert-TP 1 and the
# default. Between them every mutation meets each outcome, with its reason, that it meets
# between all of EVERY's endpoints (not applicable, identity, live;
# test_the_default_run_reaches_every_outcome_of_the_whole_matrix): each mutation is killed by
# default, over 100 ordered pairs of the 729; the long run takes every pair.
EVERY_ENDPOINTS = ("plain:1", "hf:1", "hf:experts=fused", "megatron:2",
                   "megatron:tp=2,ep=2,etp=1", "megatron:tp=4,ep=2,experts=sequential",
                   "vllm:tp=2,kernel=flashinfer_cutlass", "vllm:tp=2,ep=2", "vllm:tp=4,ep=4",
                   "vllm:tp=4,ep=4,placement=round_robin")


@pytest.mark.parametrize("mutation", MOE_MUTATIONS, ids=lambda m: m.name)
@pytest.mark.parametrize("config, share", [
    pytest.param(EVERY, EVERY_ENDPOINTS, id="every_moe"),
    pytest.param(EVERY, None, id="every_moe_all_pairs", marks=NIGHTLY),
    *(pytest.param(c, None, id=c.name, marks=NIGHTLY) for c in LONG_RUN)])
def test_every_moe_mutation_is_killed_wherever_it_is_not_the_identity(config, share, mutation):
    eps = moe_endpoints(config) if share is None else [endpoint(e) for e in share]
    rows = list(kill_matrix(checker(config), eps, [mutation]))
    killed = _assert_rows(rows)
    # Non-vacuous: killed somewhere wherever the geometry can hold it, nowhere else.
    assert (killed > 0) == (mutation.name in _live(config)), (mutation.name, killed)


# Between these the reduced Qwen3 meets each identity (mutation and reason) of its whole
# matrix (test_the_default_run_reaches_every_outcome_of_the_whole_matrix): ep=1 (plain:1),
# an even expert count over EP 2, etp=1 at TP 2 (the etp=1 source), one layer (any pair).
QWEN3_IDENTITY_ENDPOINTS = ("plain:1", "vllm:tp=2,ep=2", "megatron:tp=2,ep=4,etp=1")


def test_the_reduced_qwen3_declared_identities_move_no_byte():
    """The default run's share of the long run's matrix on the reduced Qwen3-30B-A3B: no
    forward, but the conversions a mutation declares the identity on are converted, mutated
    and compared (one layer: q/k norms from the next layer are its own), between endpoints
    that meet every identity the whole matrix meets (the long run's matrix on it compares
    every pair's)."""
    eps = [endpoint(e) for e in QWEN3_IDENTITY_ENDPOINTS]
    bytes_only = conversion_checker(QWEN3_30B, threshold=math.inf)  # no forward runs
    rows = list(kill_matrix(bytes_only, eps, MOE_MUTATIONS, live=False))
    # every identity these endpoints meet has its row (one per mutation key)
    assert {(r.mutation, r.outcome, r.reason) for r in rows if r.outcome == "identity"} == {
        o for o in _outcomes(QWEN3_30B, eps) if o[1] == "identity"}
    assert {r.mutation for r in rows if r.outcome == "identity"} >= {
        "local_expert_id_as_global", "ep_remainder_to_last", "fc1_etp_rank_concat",
        "fc2_split_on_wrong_dim", "qk_norm_from_next_layer"}
    _assert_rows([r for r in rows if r.outcome != "live"])


def test_every_mutation_is_live_in_the_default_geometry():
    assert _live(EVERY) == {m.name for m in MOE_MUTATIONS}
    assert QWEN3_30B.n_experts == 128 and QWEN3_30B.top_k == 8 and QWEN3_30B.qk_norm


# The MoE guide's own pair (TP2 x EP4 -> vLLM TP4) runs by default in tests/test_readme.py
@pytest.mark.parametrize("src,dst", breadth(README_PAIRS, keep={"megatron:tp=2,ep=2,etp=1"},
                                            name=lambda pair: pair[0]))
def test_the_readme_pairs_on_toy_moe(src, dst):
    src, dst = endpoint(src), endpoint(dst)
    rows = list(kill_matrix(checker(TOY_MOE), [src, dst], MOE_MUTATIONS))
    rows = [r for r in rows if (r.conversion.src, r.conversion.dst) == (src, dst)]
    _assert_rows(rows)
    assert any(r.outcome == "killed" for r in rows), [(r.mutation, r.outcome) for r in rows]


@pytest.mark.parametrize("config, share", [
    pytest.param(EVERY, EVERY_ENDPOINTS, id="every_moe"),
    pytest.param(EVERY, None, id="every_moe_all_pairs", marks=NIGHTLY),
    *(pytest.param(c, None, id=c.name, marks=NIGHTLY) for c in LONG_RUN)])
def test_the_harness_conversion_passes(config, share):
    """The twin of every detection above: the unmutated conversion, same checker, passes
    (by default between the endpoints of the default run's matrix, each pair)."""
    check = checker(config)
    if share is None:
        eps = moe_endpoints(config)
        pairs = [(src, dst) for src in eps[::5] for dst in eps]
    else:
        pairs = [(endpoint(src), endpoint(dst)) for src in share for dst in share]
    for src, dst in pairs:
        verdict = check.verdict([dict(p) for p in _converted(check, src, dst)], src=src, dst=dst)
        assert verdict.passed and verdict.first_mismatch is None, str(verdict)


def _converted(check, src, dst):
    from weight_sync_bench.conventions import convert

    return convert(check.source(src), src, dst, check.config)


def _outcomes(config, eps=None):
    """What each MoE mutation meets over ``config``'s endpoints (or ``eps``) without running
    a forward: each not-applicable reason, each identity reason, and "live"."""
    seen = set()
    eps = moe_endpoints(config) if eps is None else eps
    for m in MOE_MUTATIONS:
        for src in eps:
            for dst in eps:
                conversion = Conversion(config, src, dst)
                why = m.not_applicable(conversion)
                if why is None:
                    why = m.identity_reason(conversion)
                    seen.add((m.name, "identity", why) if why else (m.name, "live", None))
                else:
                    seen.add((m.name, "not applicable", why))
    return seen


def test_the_default_run_reaches_every_outcome_of_the_whole_matrix():
    """Every live outcome of the long run's geometries (a mutation live with some reason it
    applies) is one the default run's forwards meet on EVERY; their not-applicable and
    identity outcomes the default run meets itself (the test above; the reduced Qwen3's
    between QWEN3_IDENTITY_ENDPOINTS, which meet all of its identities). And the default
    run's pairs on EVERY (between ``EVERY_ENDPOINTS``) meet each outcome, with its reason,
    that every pair of its endpoints meets."""
    every = _outcomes(EVERY)
    for config in LONG_RUN:
        whole = _outcomes(config)
        assert {o for o in whole if o[1] == "live"} <= every, config.name
        if config is QWEN3_30B:
            share = _outcomes(config, [endpoint(e) for e in QWEN3_IDENTITY_ENDPOINTS])
            assert {o for o in whole if o[1] == "identity"} == {
                o for o in share if o[1] == "identity"}
    assert {m.name for m in MOE_MUTATIONS} == {o[0] for o in every if o[1] == "live"}
    # The default run's pairs on EVERY meet every outcome all its pairs meet (each mutation is
    # killed wherever live there, test_every_moe_mutation_is_killed_wherever_it_is_not_...)
    share = [endpoint(e) for e in EVERY_ENDPOINTS]
    assert _outcomes(EVERY, share) == every
    # and every convention with each of its options, every TP, EP and expert-TP degree
    for what in (lambda e: (e.name, e.options), lambda e: e.degree, lambda e: e.ep,
                 lambda e: e.etp):
        assert {what(e) for e in share} == {what(e) for e in moe_endpoints(EVERY)}


def test_a_selection_bias_left_at_its_initial_value_flips_choices_and_is_killed():
    """The selection-only bug of Megatron-Bridge PR #4657 (Kimi-K2's router bias never
    converted): only which experts a token takes moves, so a forward teacher-forced onto the
    reference's routing would pass it. The routing check compares the sharded side's own
    choices wherever the reference's margin exceeds the bound: killed at >= 10x."""
    m = next(m for m in MOE_MUTATIONS if m.name == "router_bias_not_synced")
    src, dst = endpoint("megatron:tp=2,ep=2"), endpoint("vllm:tp=2,ep=2")
    (row,) = [r for r in kill_matrix(checker(EVERY), [src, dst], [m])
              if (r.conversion.src, r.conversion.dst) == (src, dst)]
    assert row.outcome == "killed" and row.ratio >= KILL_MARGIN, str(row.verdict)
    assert all(name.endswith("router.bias") for name in row.changed)
    # Its twin: the same bytes under a forward teacher-forced onto the reference's routing
    # (every choice near-tied: bound inf) pass; the routing check is what sees the bug.
    check = checker(EVERY).checker
    forced = RoutingGuard(check.guard.routings, math.inf)
    logits = convention_logits(dst, EVERY, _mutated(m, src, dst), check.tokens, check.phase,
                               guard=forced)
    assert check.deviation(logits) <= check.threshold < row.verdict.max_abs_error


def _mutated(mutation, src, dst):
    check = checker(EVERY)
    return mutation.apply(_converted(check, src, dst), Conversion(EVERY, src, dst))
