"""Exact pins on ``check/checker.py``: the verdict's fields and text, the table, the checker's
caches and the dispatch of the public checks, each written against a mutant that survived
the behavioural tests (mutation/report.md). Every test is fast: TOY-sized or no model."""

import math

import pytest
import torch

from weight_sync_bench import (
    TOY,
    Checker,
    check_reshard,
    check_split,
    gather,
    layout_for,
    split,
)
from weight_sync_bench.check.checker import Verdict, format_verdicts
from weight_sync_bench.check.verdict import ROUTING_LEGEND

LAYOUT = layout_for(TOY)


def verdict(**fields):
    base = {"config": "toy", "src": 2, "dst": 4, "max_abs_error": 2.5e-6, "threshold": 1e-3,
                "first_mismatch": None}
    return Verdict(**(base | fields))


def test_format_verdicts_is_this_exact_table():
    rows = [verdict(),
            verdict(src=None, dst=2, max_abs_error=0.125, first_mismatch="embed.weight",
                    mismatches=("embed.weight",), own_forward=True, mutation="swap", phase="1b",
                    notes=("torch differs",)),
            verdict(conventions=("hf", "vllm"), src=1, dst=8, notes=("torch differs",
                                                                     "numpy differs"))]
    header = "config  src -> dst      phase  mutation  max |error|  threshold  ratio    forward"
    assert format_verdicts(rows).splitlines() == [
        header + "   result",
        "toy     2 -> 4          1a     -         2.5e-06      0.001      0.0025x  declared  PASS",
        "toy     split -> 2      1b     swap      0.125        0.001      125x     own       FAIL",
        "toy     hf:1 -> vllm:8  1a     -         2.5e-06      0.001      0.0025x  declared  PASS",
        "note: torch differs",  # once, though two verdicts carry it
        "note: numpy differs",
    ]


def test_format_verdicts_of_nothing_is_the_header_alone():
    assert format_verdicts([]) == ("config  src -> dst  phase  mutation  max |error|  "
                                   "threshold  ratio  forward  result")


def test_a_verdict_passes_only_finite_within_the_threshold_and_byte_equal():
    assert verdict().passed
    assert verdict(max_abs_error=1e-3).passed  # at the threshold: passes
    assert not verdict(max_abs_error=math.nextafter(1e-3, 1.0)).passed
    assert not verdict(max_abs_error=float("nan")).passed
    assert not verdict(max_abs_error=float("inf"), threshold=float("inf")).passed
    assert not verdict(first_mismatch="embed.weight").passed
    assert verdict(max_abs_error=5e-4).ratio == 0.5
    assert verdict().finite and not verdict(max_abs_error=float("-inf")).finite


def test_a_verdicts_text_names_every_field_a_reader_needs():
    assert str(verdict()).splitlines() == [
        "PASS toy 2 -> 4 (phase 1a)",
        "  max |logit error| 2.5e-06 <= threshold 0.001 (0.0025x)",
        "  shards equal the declared layout byte for byte"]
    failing = verdict(src=None, dst=2, max_abs_error=0.25, first_mismatch="embed.weight",
                      mismatches=("embed.weight", "lm_head.weight"), mutation="swap",
                      diagnosis=("rank 0 holds 0-3", "rank 1 holds 4-7"), dtype="bf16",
                      notes=("torch 2.12 measured",))
    assert str(failing).splitlines() == [
        "FAIL toy split -> 2 (phase 1a, bf16 weights, mutation swap)",
        "  max |logit error| 0.25 > threshold 0.001 (250x)",
        "  first parameter that differs from the declared layout: embed.weight (2 differ in all)",
        "    rank 0 holds 0-3",
        "    rank 1 holds 4-7",
        "  note: torch 2.12 measured"]
    assert str(verdict(max_abs_error=float("nan"))).splitlines()[1] == (
        "  logits are not finite (max |error| nan)")
    assert verdict(conventions=("meta", "megatron"), src=1, dst=2).route == "meta:1 -> megatron:2"
    # a whole endpoint keeps its own degrees; a name alone takes the verdict's
    assert verdict(conventions=("megatron:tp=2,ep=4", "vllm"), src=8, dst=2).route == (
        "megatron:tp=2,ep=4 -> vllm:2")


def test_an_moe_table_has_a_near_ties_column_and_its_legend_and_a_dense_one_neither():
    """The routing column appears when any verdict checked routing: its own figure for an
    MoE verdict, "-" for a dense one beside it; the legend once, after the rows and before
    the notes. Its twin: the same dense rows alone have neither."""
    dense = verdict(notes=("torch differs",))
    moe = verdict(config="toy_moe", max_abs_error=5e-4, near_ties=(3, 64), route_bound=1e-3)
    assert format_verdicts([dense, moe]).splitlines() == [
        "config   src -> dst  phase  mutation  max |error|  threshold  ratio    forward   "
        "near ties  result",
        "toy      2 -> 4      1a     -         2.5e-06      0.001      0.0025x  declared  -"
        "          PASS",
        "toy_moe  2 -> 4      1a     -         0.0005       0.001      0.5x     declared  3/64"
        "       PASS",
        ROUTING_LEGEND,
        "note: torch differs"]
    assert "near ties" not in format_verdicts([dense])
    assert ROUTING_LEGEND not in format_verdicts([dense])


def test_a_verdicts_text_names_the_mutation_its_shards_are_and_the_routing_it_kept():
    """The lines a failing conversion and an MoE check add: the catalogued mutation the
    shards are bit for bit (one name, or several giving the same bytes), and how many
    near-tied expert choices took the reference's experts. Their twin is the plain text
    above, which has neither."""
    one = verdict(first_mismatch="w", mismatches=("w",), named_mutation="qk_swapped",
                  named_meaning="q and k trade places")
    assert str(one).splitlines()[-1] == "  this is exactly `qk_swapped`: q and k trade places"
    two = verdict(first_mismatch="w", mismatches=("w",), named_mutation="a, b",
                  named_meaning="the same bytes")
    assert str(two).splitlines()[-1] == (
        "  this is exactly `a`, and exactly `b` (the same bytes here): the same bytes")
    # a name is only read where the shards differ from the declared ones
    assert "this is exactly" not in str(verdict(named_mutation="qk_swapped",
                                                named_meaning="q and k trade places"))
    routed = verdict(near_ties=(2, 48), route_bound=0.001, notes=("n",))
    assert str(routed).splitlines()[-2:] == [
        "  routing: 2 of 48 token choices within 0.001 of flipping took the reference's "
        "experts; every other is the sharded forward's own",
        "  note: n"]


# ---- the Checker: its caches, its floor, its forwards ----

@pytest.fixture(scope="module")
def checker():
    return Checker(TOY)


def test_the_checker_reads_the_committed_floor_and_draws_the_seeds_tokens(checker):
    from weight_sync_bench.model.config import init_params, make_tokens
    from weight_sync_bench.tolerance.rules import TOKEN_SEED_OFFSET, floor_for

    assert checker.floor == floor_for(TOY, "1a", "fp32") and checker.floor.source == "committed"
    assert checker.threshold == checker.floor.threshold
    assert torch.equal(checker.tokens, make_tokens(TOY, TOKEN_SEED_OFFSET + 0))
    params = init_params(TOY, 0)
    assert checker.full.keys() == params.keys()
    assert all(torch.equal(checker.full[n], params[n]) for n in params)
    assert checker.dtype == torch.float32 and checker.dtype_name == "fp32"
    seeded = Checker(TOY, seed=3, threshold=0.5)
    assert torch.equal(seeded.tokens, make_tokens(TOY, TOKEN_SEED_OFFSET + 3))
    assert seeded.floor is None and seeded.threshold == 0.5 and seeded.notes == ()


def test_a_threshold_rule_gets_the_config_and_the_reference_logits():
    seen = []

    def rule(config, reference):
        seen.append((config, reference.shape))
        return 0.25

    checker = Checker(TOY, threshold_rule=rule)
    assert checker.threshold == 0.25 and checker.floor is None
    assert seen == [(TOY, checker.reference.shape)]
    assert Checker(TOY, threshold=0.5, threshold_rule=rule).threshold == 0.5


def test_params_of_another_dtype_are_refused_naming_the_first_and_the_count():
    from weight_sync_bench import InvalidShards
    from weight_sync_bench.model.config import init_params

    params = init_params(TOY, 0)
    params["tok_embeddings.weight"] = params["tok_embeddings.weight"].half()
    params["layers.1.ffn_norm.weight"] = params["layers.1.ffn_norm.weight"].double()
    with pytest.raises(InvalidShards) as err:
        Checker(TOY, threshold=1.0, params=params)
    assert str(err.value) == ("params tok_embeddings.weight: dtype torch.float16, the check syncs "
                              "torch.float32 (2 parameters differ)")


def test_the_declared_split_and_its_error_are_computed_once_per_degree(checker, monkeypatch):
    assert checker.declared(2) is checker.declared(2)
    assert checker.declared(2) is not checker.declared(1)
    expected = split(checker.full, LAYOUT, 2)
    assert all(torch.equal(a[n], b[n]) for a, b in zip(checker.declared(2), expected) for n in a)
    fresh = Checker(TOY, threshold=1.0)
    calls = []
    real = fresh.forward
    fresh.forward = lambda *a: calls.append(1) or real(*a)
    first = fresh.declared_error(2)
    assert fresh.declared_error(2) == first and calls == [1]
    assert 0 < first < fresh.threshold


def test_error_is_the_max_absolute_logit_difference_and_keeps_nan(checker):
    shards = checker.declared(2)
    logits = checker.forward(TOY, shards, checker.tokens)
    assert checker.error(shards) == float((logits - checker.reference).abs().max())
    shifted = checker.reference.clone()
    shifted[0, 1, 2] -= 0.75
    assert checker.deviation(shifted) == 0.75
    shifted[0, 0, 0] = float("nan")
    assert math.isnan(checker.deviation(shifted))


def test_a_byte_equal_shard_set_reuses_the_declared_forward_and_a_different_one_runs_its_own(
        checker):
    same = [{n: t.clone() for n, t in p.items()} for p in checker.declared(2)]
    v = checker.verdict(same, dst=2, src=1, mutation="none")
    assert (v.src, v.dst, v.mutation, v.own_forward, v.first_mismatch) == (1, 2, "none", False,
                                                                          None)
    assert v.max_abs_error == checker.declared_error(2) and v.passed
    assert (v.threshold, v.phase, v.dtype, v.config, v.notes) == (checker.threshold, "1a",
                                                                  "fp32", "toy", checker.notes)
    other = [{n: t.clone() for n, t in p.items()} for p in checker.declared(2)]
    other[1]["layers.0.o_proj.weight"][0, 0] += 1.0
    other[0]["lm_head.weight"][3, 1] += 1.0
    v = checker.verdict(other, dst=2)
    assert v.own_forward and not v.passed and v.src is None
    assert v.mismatches == ("layers.0.o_proj.weight", "lm_head.weight")
    assert v.first_mismatch == "layers.0.o_proj.weight"
    assert v.max_abs_error == checker.error(other) > checker.threshold
    assert v.diagnosis and all("o_proj" in line for line in v.diagnosis)


def test_a_reshard_verdict_that_differs_is_checked_whole(checker, monkeypatch):
    import weight_sync_bench.check.checker as module

    good = checker.reshard_verdict(1, 2)
    assert (good.src, good.dst, good.first_mismatch, good.own_forward) == (1, 2, None, False)
    assert good.max_abs_error == checker.declared_error(2)
    assert (good.threshold, good.phase, good.config, good.dtype) == (checker.threshold, "1a",
                                                                     "toy", "fp32")
    real = module.reshard_tensor

    def off_by_one(pieces, spec, dst):
        out = real(pieces, spec, dst)
        if spec.name == "lm_head.weight":
            out[-1] = out[-1].clone()
            out[-1][0, 0] += 1.0
        return out

    monkeypatch.setattr(module, "reshard_tensor", off_by_one)
    monkeypatch.setattr(module, "reshard", lambda source, layout, dst: [
        {n: off_by_one([s[n] for s in source], layout[n], dst)[r] for n in source[0]}
        for r in range(dst)])
    bad = checker.reshard_verdict(1, 2)
    assert (bad.src, bad.dst, bad.first_mismatch, bad.own_forward) == (1, 2, "lm_head.weight",
                                                                      True)


def test_the_sweep_checks_the_pairs_it_is_given_and_applies_a_mutation(checker):
    from weight_sync_bench.check.checker import degree_pairs, sweep
    from weight_sync_bench.check.mutations import MUTATIONS
    from weight_sync_bench.errors import InvalidNumber

    assert degree_pairs(LAYOUT) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    verdicts = sweep(TOY, pairs=[(2, 1), (1, 1)], checker=checker)
    assert [(v.src, v.dst) for v in verdicts] == [(2, 1), (1, 1)]
    assert all(v.passed and v.mutation is None for v in verdicts)
    mutation = MUTATIONS["contiguous_qkv"]
    bad = sweep(TOY, pairs=[(1, 2)], mutation=mutation, checker=checker)
    assert [(v.src, v.dst, v.mutation, v.passed) for v in bad] == [(1, 2, mutation.name, False)]
    with pytest.raises(InvalidNumber) as err:
        sweep(TOY, seed=-1, checker=checker)
    assert str(err.value) == "seed must be an int in 0..2^63-1, got -1"


def test_checker_for_names_the_backends_and_runs_gloo_as_phase_1b(monkeypatch):
    from weight_sync_bench.check import forwards
    from weight_sync_bench.check.checker import checker_for
    from weight_sync_bench.check.forwards import inprocess_forward
    from weight_sync_bench.tolerance.rules import floor_for

    with pytest.raises(ValueError) as err:
        checker_for(TOY, backend="nccl")
    assert str(err.value) == "unknown backend 'nccl'; known: inprocess, gloo"
    monkeypatch.setattr(forwards, "gloo_forward", lambda: inprocess_forward)
    gloo = checker_for(TOY, seed=2, backend="gloo")
    assert gloo.phase == "1b" and gloo.forward is inprocess_forward and gloo.seed == 2
    assert gloo.threshold == floor_for(TOY, "1b", "fp32").threshold
    local = checker_for(TOY, seed=1, threshold=0.5, dtype="bf16")
    assert (local.phase, local.seed, local.threshold, local.dtype) == ("1a", 1, 0.5,
                                                                       torch.bfloat16)


# ---- the public checks: what they pass on, and to whom ----

def recording(monkeypatch):
    from weight_sync_bench.check import stream

    calls = []

    def fake(config, dst, **kwargs):
        calls.append((config, dst, kwargs))
        return "streamed"

    monkeypatch.setattr(stream, "stream_check", fake)
    return calls


def test_a_streamed_split_passes_every_argument_to_the_stream(monkeypatch):
    calls = recording(monkeypatch)

    def fn(full, degree):
        return split(full, LAYOUT, degree)

    def progress(p):
        return None

    assert check_split(fn, TOY, 2, seed=3, threshold=0.5, dtype="bf16", measure_floor=True,
                       stream="parameter", progress=progress) == "streamed"
    assert calls == [(TOY, 2, {"fn": fn, "src": None, "per": "parameter", "seed": 3,
                               "dtype": "bf16", "threshold": 0.5, "measure_floor": True,
                               "progress": progress, "backend": "inprocess"})]


def test_a_streamed_reshard_passes_every_argument_to_the_stream(monkeypatch):
    calls = recording(monkeypatch)

    def fn(shards, dst):
        return shards

    def progress(p):
        return None

    assert check_reshard(fn, TOY, 1, 2, seed=4, stream="layer") == "streamed"
    assert check_reshard(fn, TOY, 2, 1, threshold=0.25, measure_floor=True, dtype="fp16",
                         stream="parameter", progress=progress) == "streamed"
    assert calls == [
        (TOY, 2, {"fn": fn, "src": 1, "per": "layer", "seed": 4, "dtype": torch.float32,
                  "threshold": None, "measure_floor": False, "progress": None,
                  "backend": "inprocess"}),
        (TOY, 1, {"fn": fn, "src": 2, "per": "parameter", "seed": 0, "dtype": "fp16",
                  "threshold": 0.25, "measure_floor": True, "progress": progress,
                  "backend": "inprocess"})]


@pytest.mark.parametrize("check, args", [(check_split, (2,)), (check_reshard, (1, 2))])
def test_a_streamed_check_over_gloo_passes_the_backend_to_the_stream(monkeypatch, check, args):
    calls = recording(monkeypatch)
    assert check(fn := lambda *a: None, TOY, *args, backend="gloo", stream="layer") == "streamed"
    assert [(c[0], c[1], c[2]["fn"], c[2]["backend"]) for c in calls] == [
        (TOY, args[-1], fn, "gloo")]


@pytest.mark.parametrize("check, args, bad", [
    (check_split, (3,), "t=3"), (check_reshard, (3, 2), "t=3"), (check_reshard, (1, 3), "t=3")])
def test_an_unsupported_degree_is_refused_before_any_check(monkeypatch, check, args, bad):
    from weight_sync_bench.errors import UnsupportedLayout

    calls = recording(monkeypatch)
    with pytest.raises(UnsupportedLayout, match=bad):
        check(lambda *a: None, TOY, *args, stream="layer")
    assert calls == []


@pytest.mark.parametrize("check, args", [(check_split, (2,)), (check_reshard, (1, 2))])
def test_a_negative_seed_is_refused(check, args):
    from weight_sync_bench.errors import InvalidNumber

    with pytest.raises(InvalidNumber) as err:
        check(lambda *a: None, TOY, *args, seed=-1)
    assert str(err.value) == "seed must be an int in 0..2^63-1, got -1"


def test_the_users_function_gets_copies_at_the_seed_and_dtype_and_is_named_when_it_fails():
    from weight_sync_bench.errors import UserCodeError
    from weight_sync_bench.model.config import init_params

    # TOY over a 512-word vocabulary: a fifth of the weights to draw (the thresholds are given)
    narrow = TOY.replace(name="narrow", vocab=512)
    layout = layout_for(narrow)
    seen = {}

    def splitter(full, degree):
        seen["full"], seen["degree"] = full, degree
        return split(full, layout, degree)

    v = check_split(splitter, narrow, 2, seed=5, threshold=1.0, dtype="bf16")
    expected = init_params(narrow, 5, dtype=torch.bfloat16)
    assert seen["degree"] == 2 and v.passed and v.dtype == "bf16" and v.threshold == 1.0
    assert all(torch.equal(seen["full"][n], expected[n]) for n in expected)

    def resharder(shards, dst):
        seen["shards"], seen["dst"] = shards, dst
        raise RuntimeError("boom")

    with pytest.raises(UserCodeError) as err:
        check_reshard(resharder, narrow, 2, 1, seed=5, threshold=1.0)
    text = str(err.value)
    assert "resharder" in text and "while resharding narrow 2 -> 1" in text and "boom" in text
    declared = split(init_params(narrow, 5), layout, 2)
    assert seen["dst"] == 1 and len(seen["shards"]) == 2
    assert all(torch.equal(seen["shards"][r][n], declared[r][n]) for r in range(2)
               for n in declared[r])
    assert all(seen["shards"][r][n] is not declared[r][n] for r in range(2) for n in declared[r])

    with pytest.raises(UserCodeError) as err:
        check_split(lambda full, degree: 1 / 0, narrow, 2, threshold=1.0)
    assert "while splitting narrow for t=2" in str(err.value)


def test_environment_notes_name_the_floor_as_a_reader_asks(monkeypatch):
    import weight_sync_bench.check.threshold as module
    from weight_sync_bench.check.threshold import environment_notes
    from weight_sync_bench.tolerance.rules import Floor

    seen = []
    monkeypatch.setattr(module, "check_environment",
                        lambda artifact, what: seen.append((artifact, what)) or ("n",))
    art = {"x": 1}
    committed = Floor(1e-3, art, None, "committed")
    geometry = Floor(1e-3, art, None, "geometry")
    assert environment_notes(committed, TOY, "1a", "fp32") == ("n",)
    environment_notes(committed, TOY, "1b", "bf16")
    environment_notes(geometry, TOY, "1a", "fp32")
    environment_notes(geometry, TOY, "1b", "fp16")
    assert seen == [(art, "the phase 1a floor"), (art, "the phase 1b bf16 floor"),
                    (art, "the phase 1a floor of toy"), (art, "the phase 1b fp16 floor of toy")]


def test_resolve_floor_measures_only_when_asked_and_then_reads_the_cache(monkeypatch):
    import weight_sync_bench.check.threshold as module
    from weight_sync_bench.check.threshold import resolve_floor
    from weight_sync_bench.check.forwards import inprocess_forward
    from weight_sync_bench.errors import FloorNotMeasured

    state = {"measured": []}

    def floor_for(config, phase, dtype):
        if not state["measured"]:
            raise FloorNotMeasured(f"{config.name} {phase} {dtype}")
        return ("floor", config.name, phase, dtype)

    def measure(config, *, phase, dtype, forward):
        state["measured"].append((config.name, phase, dtype, forward))

    monkeypatch.setattr(module, "floor_for", floor_for)
    monkeypatch.setattr(module, "measure_geometry", measure)
    with pytest.raises(FloorNotMeasured, match="toy 1a fp32"):
        resolve_floor(TOY, "1a", "fp32")
    assert state["measured"] == []
    assert resolve_floor(TOY, "1a", "bf16", measure=True) == ("floor", "toy", "1a", "bf16")
    assert state["measured"] == [("toy", "1a", "bf16", None)]
    state["measured"].clear()
    fwd = object()
    assert resolve_floor(TOY, "1b", "fp32", measure=True, forward=fwd) == ("floor", "toy", "1b",
                                                                           "fp32")
    assert state["measured"] == [("toy", "1b", "fp32", fwd)]
    state["measured"].clear()
    resolve_floor(TOY, "1b", "fp32", measure=True)  # phase 1b's default: the in-process forward
    assert state["measured"] == [("toy", "1b", "fp32", inprocess_forward)]
    assert resolve_floor(TOY, "1a", "fp32", measure=False) == ("floor", "toy", "1a", "fp32")


def _planted(module, monkeypatch, change, name="lm_head.weight"):
    """The streamed reshard under test with ``change(rank, tensor)`` applied to the shards of
    ``name`` (a tensor, or None to leave that rank out)."""
    real = module.reshard_tensor

    def reshard_tensor(pieces, spec, dst):
        out = real(pieces, spec, dst)
        if spec.name != name:
            return out
        return [t for t in (change(rank, x.clone()) for rank, x in enumerate(out))
                if t is not None]

    monkeypatch.setattr(module, "reshard_tensor", reshard_tensor)


# (the declared element, what the planted reshard writes in its place), as int32 bytes:
# equal values with other bytes, and one low bit
VALUE_EQUAL = {"+0.0 / -0.0": (0x00000000, -0x80000000),  # -0.0: the sign bit alone
               "NaN payloads": (0x7FC00000, 0x7FC00001),
               "one low bit": (None, None)}


@pytest.mark.parametrize("name", ["lm_head.weight", "norm.weight"])  # 64 Ki elements; 256
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("what", list(VALUE_EQUAL))
def test_the_streamed_reshard_comparison_sees_a_value_equal_byte_difference_on_any_rank(
        monkeypatch, what, rank, name):
    """``reshard_matches`` compares bytes, not values: where the declared shard holds +0.0
    or a NaN, a reshard that writes -0.0 or another NaN payload there, or flips a low bit,
    on either rank, of a vocab-split lm_head or a replicated norm (both sizes of
    ``bit_equal``: numpy's slab and one ``torch.equal``), does not match (the twin: the
    untouched reshard does). A False sends ``reshard_verdict`` and the fuzz to the whole
    check, its own forward and its diagnosis."""
    import weight_sync_bench.check.checker as module
    from tests.check.narrow import THRESHOLD, narrowed
    from weight_sync_bench.model.config import init_params

    config = narrowed(TOY)
    params = init_params(config, 0)
    declared, written = VALUE_EQUAL[what]
    rows = params[name].shape[0]
    for first_row in {0, rows // 2 if name == "lm_head.weight" else 0}:  # each rank's first
        if declared is not None:
            params[name][first_row].view(-1).view(torch.int32)[0] = declared
    checker = Checker(config, threshold=THRESHOLD, params=params)
    assert checker.reshard_matches(1, 2) and checker.reshard_matches(2, 2)  # the twin

    def change(at, x):
        if at == rank:
            flat = x.view(-1).view(torch.int32)
            assert declared is None or flat[0] == declared
            flat[0] = written if written is not None else flat[0] ^ 1
        return x

    _planted(module, monkeypatch, change, name)
    assert not checker.reshard_matches(1, 2) and not checker.reshard_matches(2, 2)


def test_a_reshard_that_drops_or_adds_a_rank_of_one_parameter_never_matches(checker,
                                                                           monkeypatch):
    """The ranks are compared pairwise: a reshard that leaves out the last rank's lm_head
    (or makes one too many) must not pass on the ranks both have (the twin: all ranks)."""
    import weight_sync_bench.check.checker as module

    _planted(module, monkeypatch, lambda rank, x: x)
    assert checker.reshard_matches(1, 2)  # the twin: the plant itself changes nothing
    _planted(module, monkeypatch, lambda rank, x: None if rank == 1 else x)
    assert not checker.reshard_matches(1, 2)
    monkeypatch.undo()
    real = module.reshard_tensor

    def one_too_many(pieces, spec, dst):
        out = real(pieces, spec, dst)
        return [*out, out[-1]] if spec.name == "lm_head.weight" else out

    monkeypatch.setattr(module, "reshard_tensor", one_too_many)
    assert not checker.reshard_matches(1, 2)


def test_a_checkers_bytes_are_its_parameters_reference_scratch_and_each_declared_split():
    """What ``fuzz.case.KeptCheckers`` budgets: every tensor the checker keeps, counted once,
    a split's replicated norms once per rank."""
    from tests.check.narrow import THRESHOLD, narrowed

    checker = Checker(narrowed(TOY), threshold=THRESHOLD)
    params = sum(x.nbytes for x in checker.full.values())
    logits = checker.reference.nbytes
    assert checker.nbytes == params + 2 * logits  # the reference and its scratch
    shards = checker.declared(2)
    assert checker.nbytes == params + 2 * logits + sum(
        x.nbytes for p in shards for x in p.values())
    replicated = sum(checker.full[s.name].nbytes for s in checker.layout
                     if str(s.placement) == "R")
    assert replicated and sum(x.nbytes for p in shards for x in p.values()) == params + replicated


def test_a_passing_reshard_verdict_never_reshards_the_whole_model(checker, monkeypatch):
    import weight_sync_bench.check.checker as module

    def whole(*args):
        raise AssertionError("the streamed comparison fell back to a whole-model reshard")

    monkeypatch.setattr(module, "reshard", whole)
    assert checker.reshard_verdict(2, 1).passed and checker.reshard_verdict(1, 2).passed


@pytest.mark.parametrize("which", ["split", "reshard"])
def test_the_public_checks_pass_their_options_to_the_checker_and_the_users_call(
        monkeypatch, which):
    import weight_sync_bench.check.checker as module

    made, called = [], []
    real_checker_for, real_call_user = module.checker_for, module.call_user

    def checker_for(config, **kwargs):
        made.append(kwargs)
        return real_checker_for(config, **kwargs)

    def call_user(fn, args, **kwargs):
        called.append(kwargs)
        return real_call_user(fn, args, **kwargs)

    monkeypatch.setattr(module, "checker_for", checker_for)
    monkeypatch.setattr(module, "call_user", call_user)
    if which == "split":
        v = check_split(lambda full, t: split(full, LAYOUT, t), TOY, 2, seed=6, threshold=0.5,
                        dtype="fp16", measure_floor=True)
        role, src, during = "splitter", None, "while splitting toy for t=2"
    else:
        v = check_reshard(lambda shards, t: split(gather(shards, LAYOUT), LAYOUT, t), TOY, 2,
                          1, seed=6, threshold=0.5, dtype="fp16", measure_floor=True)
        role, during, src = "resharder", "while resharding toy 2 -> 1", 2
    assert made == [{"seed": 6, "threshold": 0.5, "backend": "inprocess", "dtype": "fp16",
                         "measure_floor": True}]
    layout = called[0].pop("layout")
    assert called == [{"role": role, "config": TOY, "during": during, "degree": v.dst,
                           "dtypes": dict.fromkeys(LAYOUT.names, torch.float16)}]
    assert layout.names == LAYOUT.names
    assert v.passed and (v.src, v.threshold, v.dtype) == (src, 0.5, "fp16")


def test_a_verdict_at_its_threshold_reads_as_within_it():
    assert "max |logit error| 0.001 <= threshold 0.001 (1x)" in str(verdict(max_abs_error=1e-3))


def test_the_checker_asks_for_the_notes_of_its_own_floor_config_phase_and_dtype(monkeypatch):
    import weight_sync_bench.check.checker as module

    seen = []
    monkeypatch.setattr(module, "environment_notes",
                        lambda *args: seen.append(args) or ("a note",))
    checker = Checker(TOY, dtype="bf16")
    assert seen == [(checker.floor, TOY, "1a", "bf16")] and checker.notes == ("a note",)


def test_the_checker_resolves_its_floor_with_its_own_measure_flag_and_forward(monkeypatch):
    import weight_sync_bench.check.checker as module
    from weight_sync_bench.tolerance.rules import floor_for

    seen = []

    def resolve(config, phase, dtype, *, measure=False, forward=None):
        seen.append((config, phase, dtype, measure, forward))
        return floor_for(config, phase, dtype)

    def forward(config, shards, tokens):
        return module.inprocess_forward(config, shards, tokens)

    monkeypatch.setattr(module, "resolve_floor", resolve)
    Checker(TOY, measure_floor=True, forward=forward, phase="1b")
    Checker(TOY)
    assert seen == [(TOY, "1b", "fp32", True, forward),
                    (TOY, "1a", "fp32", False, module.inprocess_forward)]


def test_every_verdict_carries_the_checkers_phase_notes_and_dtype():
    checker = Checker(TOY, threshold=1.0, phase="1b", dtype="bf16")
    checker.notes = ("a note",)
    same = [dict(p) for p in checker.declared(2)]
    other = [{n: t.clone() for n, t in p.items()} for p in checker.declared(2)]
    other[0]["norm.weight"][0] += 1.0
    for v in (checker.verdict(same, dst=2), checker.verdict(other, dst=2),
              checker.reshard_verdict(1, 2)):
        assert (v.phase, v.notes, v.dtype, v.threshold) == ("1b", ("a note",), "bf16", 1.0)


def test_checker_for_builds_each_backends_checker_with_every_option(monkeypatch):
    import weight_sync_bench.check.checker as module
    from weight_sync_bench.check import forwards
    from weight_sync_bench.check.checker import checker_for

    made = []
    monkeypatch.setattr(module, "Checker", lambda config, **kw: made.append((config, kw)) or kw)
    gloo = object()
    monkeypatch.setattr(forwards, "gloo_forward", lambda: gloo)
    checker_for(TOY)
    checker_for(TOY, seed=7, threshold=0.5, dtype="bf16", measure_floor=True)
    checker_for(TOY, backend="gloo")
    checker_for(TOY, seed=7, backend="gloo", threshold=0.5, dtype="bf16", measure_floor=True,
                params={"w": 1}, mixed=True)
    checker_for(TOY, params={"w": 2}, mixed=True)
    assert made == [
        (TOY, {"seed": 0, "threshold": None, "dtype": torch.float32, "measure_floor": False,
               "params": None, "mixed": False}),
        (TOY, {"seed": 7, "threshold": 0.5, "dtype": "bf16", "measure_floor": True,
               "params": None, "mixed": False}),
        (TOY, {"seed": 0, "threshold": None, "phase": "1b", "forward": gloo, "dtype": torch.float32,
                   "measure_floor": False, "params": None, "mixed": False}),
        (TOY, {"seed": 7, "threshold": 0.5, "phase": "1b", "forward": gloo, "dtype": "bf16",
                   "measure_floor": True, "params": {"w": 1}, "mixed": True}),
        (TOY, {"seed": 0, "threshold": None, "dtype": torch.float32, "measure_floor": False,
               "params": {"w": 2}, "mixed": True})]


def test_the_sweep_makes_its_checker_from_its_options_and_mutates_with_the_config(monkeypatch):
    import weight_sync_bench.check.checker as module
    from weight_sync_bench.check.checker import sweep
    from weight_sync_bench.check.mutations import MUTATIONS

    narrow = TOY.replace(name="narrow", vocab=512)  # a fifth of TOY's weights to draw
    made, real = [], module.checker_for
    monkeypatch.setattr(module, "checker_for",
                        lambda config, **kw: made.append(kw) or real(config, threshold=1.0))
    sweep(narrow, pairs=[(1, 1)])
    sweep(narrow, seed=3, pairs=[(1, 1)], dtype="bf16")
    assert made == [{"seed": 0, "backend": "inprocess", "dtype": torch.float32},
                    {"seed": 3, "backend": "inprocess", "dtype": "bf16"}]
    seen = []

    class Spy:
        name = "spy"

        def apply(self, shards, layout, config):
            seen.append((len(shards), layout.names == LAYOUT.names, config))
            return MUTATIONS["contiguous_qkv"].apply(shards, layout, config)

    (v,) = sweep(narrow, pairs=[(1, 2)], mutation=Spy())
    assert seen == [(2, True, narrow)] and v.mutation == "spy" and not v.passed


@pytest.mark.parametrize("which", ["split", "reshard"])
def test_the_public_checks_defaults_are_seed_0_fp32_in_process_and_no_measuring(monkeypatch,
                                                                               which):
    import weight_sync_bench.check.checker as module

    made, real = [], module.checker_for
    monkeypatch.setattr(module, "checker_for",
                        lambda config, **kw: made.append(kw) or real(config, **kw))
    if which == "split":
        check_split(lambda full, t: split(full, LAYOUT, t), TOY, 2)
    else:
        check_reshard(lambda shards, t: split(gather(shards, LAYOUT), LAYOUT, t), TOY, 2, 1)
    assert made == [{"seed": 0, "threshold": None, "backend": "inprocess", "dtype": torch.float32,
                         "measure_floor": False}]


def test_a_matching_reshard_verdict_of_an_moe_model_carries_its_routing_figures():
    """The streamed path's verdict (bytes matched, no forward of its own) says what the
    whole check's does about routing: the near ties and the bound, as for the declared
    split; the twin, a dense model's, has none."""
    from tests.check.narrow import THRESHOLD, narrowed
    from weight_sync_bench.model.config import TOY_MOE

    checker = Checker(narrowed(TOY_MOE), threshold=THRESHOLD)
    streamed = checker.reshard_verdict(1, 2)
    whole = checker.verdict(checker.declared(2), src=1, dst=2)
    assert streamed.first_mismatch is None and streamed.route_bound is not None
    assert (streamed.near_ties, streamed.route_bound) == (whole.near_ties, whole.route_bound)
    dense = Checker(narrowed(TOY), threshold=THRESHOLD).reshard_verdict(1, 2)
    assert dense.route_bound is None
