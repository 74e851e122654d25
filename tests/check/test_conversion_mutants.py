"""``check.conversion`` read whole (issue 30, the mutation pass over ``check/conversion.py``).

- One ``ConversionChecker`` judges several destinations in turn, as the fuzz and ``wsb
  check`` over several pairs do, so what it caches per destination (the declared shards,
  their forward's error) must be keyed by the destination. A cache keyed by nothing hands
  the second destination the first's shards.
- ``require_cell``'s refusals, each branch, read whole, on floors built here.
- A failing verdict's every field, the staged lines of only the ranks that differ, what the
  checker keeps (one slice index), what the destination forward is given (the routing
  guard, the phase), and which catalogue names a conversion (the plain layout's only for
  the plain layout; round trips by the synced dtype)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.check.narrow import THRESHOLD, narrowed
from weight_sync_bench import TOY, TOY_KV4, ModelConfig
from weight_sync_bench.check.conversion import (
    conversion_checker,
    endpoint_name,
    require_cell,
)
from weight_sync_bench.check.diagnosis import bit_equal
from weight_sync_bench.conventions import convert, endpoint
from weight_sync_bench.errors import FloorNotMeasured, Uncovered
from weight_sync_bench.model.config import TOY_MOE, init_params
from weight_sync_bench.tolerance.rules import Floor

# TOY over a 512-word vocabulary, where what is checked does not read TOY's committed floor:
# a fifth of the weights to draw and convert (the embedding and head are most of TOY's),
# judged by an explicit threshold, 100x what its declared shards deviate by (1e-6).
NARROW = narrowed(TOY)


def test_one_checker_judges_each_destination_by_its_own_declared_shards_and_error():
    checker = conversion_checker(NARROW, threshold=THRESHOLD)
    source = checker.source("megatron:2")
    errors = {}
    for dst in ("vllm:2", "vllm:4", "hf", "vllm:2"):
        verdict = checker.verdict(convert(source, "megatron:2", dst, NARROW), src="megatron:2",
                                  dst=dst)
        assert verdict.passed and verdict.first_mismatch is None, (dst, verdict)
        assert len(checker.declared(dst)) == (1 if dst == "hf" else int(dst[-1]))
        fresh = checker.error(dst, checker.declared(dst))  # not cached
        assert verdict.max_abs_error == fresh, dst
        errors[dst] = fresh
    assert len(set(errors.values())) > 1  # the destinations' errors differ: keys matter


def test_the_checker_is_built_from_every_option_it_is_given():
    default = conversion_checker(TOY).checker
    assert (default.seed, default.phase, default.dtype, default.mixed) == (0, "1a",
                                                                         torch.float32, False)
    assert all(bit_equal(default.full[n], x) for n, x in init_params(TOY, 0).items())
    seeded = conversion_checker(TOY, seed=3, threshold=0.25, mixed=True).checker
    assert (seeded.seed, seeded.threshold, seeded.mixed) == (3, 0.25, True)
    assert all(bit_equal(seeded.full[n], x) for n, x in init_params(TOY, 3).items())
    mine = {n: x * 0.5 for n, x in init_params(TOY, 1).items()}
    given = conversion_checker(TOY, params=mine).checker
    assert all(bit_equal(given.full[n], x) for n, x in mine.items())


def test_a_verdict_names_an_endpoint_by_its_convention_where_the_degree_says_the_rest():
    assert endpoint_name(endpoint("vllm:2")) == "vllm"
    assert endpoint_name(endpoint("hf")) == "hf"
    assert endpoint_name(endpoint("megatron:tp=2,pp=2")) == "megatron:tp=2,pp=2"
    assert endpoint_name(endpoint("vllm:tp=2,ep=2")) == "vllm:tp=2,ep=2"


# ---- require_cell: what a refusal says, read whole (floors built here, no file read) ----

SMALL16 = ModelConfig(name="small16", vocab=100, d_model=32, n_layers=1, n_heads=16,
                      n_kv_heads=2, head_dim=4, ffn=48)
# vocab 100: the plain layout cannot store t=8 (100 % 8), vLLM and Megatron pad it and can
ODD_VOCAB = ModelConfig(name="odd_vocab", vocab=100, d_model=32, n_layers=1, n_heads=8,
                        n_kv_heads=8, head_dim=4, ffn=48)


def a_floor(config, degrees, source="committed", forward=None, **fields):
    """A floor of ``config`` measured at ``degrees`` (plain cells, or ``forward``'s)."""
    cells = [{"config": config.name, "degree": t, **({"forward": forward} if forward else {})}
             for t in degrees]
    return Floor(threshold=1.0, artifact={"cells": cells, **fields},
                 path=Path("/floors/phase1x.json"), source=source)


def refusal(floor, config, where):
    with pytest.raises(FloorNotMeasured) as info:
        require_cell(floor, config, endpoint(where))
    return str(info.value), info.value.command


def test_a_committed_floor_past_the_commands_bound_is_remeasured_from_python():
    floor = a_floor(SMALL16, (1, 2), phase="1b", weights_dtype="bf16")
    message, command = refusal(floor, SMALL16, "vllm:16")
    assert command == ("weight_sync_bench.check.floor.measure(configs=[small16], "
                       "replicated=True, phase='1b', dtype='bf16', max_degree=16)")
    assert message == (
        "small16: no measured floor covers the forward of vllm:16 (phase 1b, bf16 weights, "
        "d_model 32, n_heads 16, n_kv_heads 2): vllm at t=16 runs the vllm-replicated-kv "
        "forward, and phase1x.json never measured it (its plain cells: t=1, 2); a threshold "
        f"measured on another forward or degree does not judge it. Measure it with `{command}`")
    # the twin: a per-geometry floor's own measuring call, at the same degree
    _, command = refusal(a_floor(SMALL16, (1, 2), "geometry", phase="1b",
                                 weights_dtype="bf16"), SMALL16, "vllm:16")
    assert command == ("weight_sync_bench.check.floor.measure_geometry(config, phase='1b', "
                       "dtype='bf16', max_degree=16)")


def test_a_per_geometry_floor_of_a_built_in_geometry_is_remeasured_by_its_command_forced():
    floor = a_floor(TOY_KV4, (1, 2, 4), "geometry", phase="1b", weights_dtype="bf16")
    message, command = refusal(floor, TOY_KV4, "vllm:8")
    assert command == ("python -m weight_sync_bench.tolerance geometry --config toy_kv4 "
                       "--phase 1b --dtype bf16 --force")  # cached already: --force
    assert message.endswith(f"Measure it with `{command}`")
    # the twin: a geometry with no command line is measured by the Python call, unforced
    _, command = refusal(a_floor(SMALL16, (1, 2), "geometry"), SMALL16, "vllm:4")
    assert command == ("weight_sync_bench.check.floor.measure_geometry(config, phase='1a', "
                       "dtype='fp32')")


def test_a_floor_that_names_no_phase_and_no_plain_cell_is_phase_1a_with_none():
    message, command = refusal(a_floor(SMALL16, (), "committed"), SMALL16, "vllm:4")
    assert "(phase 1a, fp32 weights, " in message and "(its plain cells: t=none)" in message
    assert command == "python -m weight_sync_bench.tolerance --write"
    # the twin: a replicated cell measured elsewhere is said, and the plain ones still none
    message, _ = refusal(a_floor(SMALL16, (8,), forward="vllm-replicated-kv"), SMALL16,
                         "vllm:4")
    assert "phase1x.json measured it at t=8 (its plain cells: t=none)" in message


def test_a_degree_the_plain_layout_cannot_store_is_refused_without_a_command():
    floor = a_floor(ODD_VOCAB, (1, 2, 4))
    require_cell(floor, ODD_VOCAB, endpoint("vllm:4"))  # the twin: measured, judged
    # and one the plain layout can store but the floor never measured: its command
    assert refusal(a_floor(ODD_VOCAB, (1, 2)), ODD_VOCAB, "vllm:4")[1] == (
        "python -m weight_sync_bench.tolerance --write")
    message, command = refusal(floor, ODD_VOCAB, "vllm:8")
    assert command is None
    assert message == (
        "odd_vocab: no measured floor covers the forward of vllm:8 (phase 1a, fp32 weights, "
        "d_model 32, n_heads 8, n_kv_heads 8): vllm at t=8 runs the plain forward, and "
        "phase1x.json measured it at t=1, 2, 4 (its plain cells: t=1, 2, 4); a threshold "
        "measured on another forward or degree does not judge "
        "it. The plain layout cannot store t=8, so no floor measurement has this cell; pass "
        "threshold= explicitly (e.g. check.convert.measure_threshold)")


def test_a_staged_destination_needs_the_cell_of_its_stages_degree_not_of_its_world():
    floor = a_floor(TOY, (2,))
    require_cell(floor, TOY, endpoint("megatron:tp=2,pp=2"))  # world 4, each stage t=2
    message, _ = refusal(floor, TOY, "megatron:tp=1,pp=2")  # the twin: t=1, unmeasured
    assert "megatron at t=1 runs the plain forward" in message


def test_a_conversion_checker_does_not_measure_an_unmeasured_geometry_unless_asked(tolerance):
    with pytest.raises(FloorNotMeasured, match="odd_vocab"):
        conversion_checker(ODD_VOCAB)


# ---- verdict: every field of a failing one, the staged lines, what it keeps ----

def test_a_wrong_conversion_runs_its_own_forward_and_says_so():
    checker = conversion_checker(NARROW, threshold=THRESHOLD)
    right = convert(checker.source("megatron:2"), "megatron:2", "vllm:2", NARROW)
    assert checker.verdict(right, src="megatron:2", dst="vllm:2").own_forward is False
    wrong = [dict(r) for r in right]
    wrong[1]["lm_head.weight"] = wrong[1]["lm_head.weight"] * 2  # the fault on the last rank
    verdict = checker.verdict(wrong, src="megatron:2", dst="vllm:2")
    assert verdict.own_forward is True and not verdict.passed
    assert verdict.first_mismatch == "lm_head.weight" and verdict.mismatches == (
        "lm_head.weight",)
    assert verdict.max_abs_error == checker.error("vllm:2", wrong) > verdict.threshold


def test_a_staged_verdict_places_only_the_ranks_that_differ_in_the_pipeline():
    checker = conversion_checker(NARROW, threshold=THRESHOLD)
    dst = "megatron:tp=2,pp=2"
    wrong = convert(checker.source("hf"), "hf", dst, NARROW)
    wrong[3]["output_layer.weight"] = wrong[3]["output_layer.weight"] * 2  # the last rank
    verdict = checker.verdict(wrong, src="hf", dst=dst)
    staged = [line for line in verdict.diagnosis if "is pipeline stage" in line]
    assert staged == ["rank 3 is pipeline stage 1 of 2: global layers 2-3 as local 0-1"]
    # the twin: the same fault on the first stage's rank 2 names rank 2 instead
    wrong = convert(checker.source("hf"), "hf", dst, NARROW)
    wrong[2]["output_layer.weight"] = wrong[2]["output_layer.weight"] * 2
    lines = checker.verdict(wrong, src="hf", dst=dst).diagnosis
    assert [x[:7] for x in lines if "is pipeline stage" in x] == ["rank 2 "]


def test_a_diagnosis_reads_each_canonical_parameters_slice_index_once(monkeypatch):
    """``ConversionChecker.slice_index`` keeps one index per (parameter, dim) for every
    diagnosis and verdict of the checker; without it each rank's diagnosis builds its own."""
    from weight_sync_bench.check import conversion, diagnosis
    built, original = [], diagnosis.slice_index

    def counted(full, dim):
        built.append(dim)
        return original(full, dim)
    monkeypatch.setattr(diagnosis, "slice_index", counted)
    monkeypatch.setattr(conversion, "slice_index", counted)
    checker = conversion_checker(NARROW, threshold=THRESHOLD)
    right = convert(checker.source("megatron:2"), "megatron:2", "vllm:2", NARROW)
    wrong = [dict(r) for r in right]  # each rank holds the other's rows: both are diagnosed
    wrong[0]["lm_head.weight"], wrong[1]["lm_head.weight"] = (right[1]["lm_head.weight"],
                                                              right[0]["lm_head.weight"])
    for _ in range(2):
        verdict = checker.verdict(wrong, src="megatron:2", dst="vllm:2")
        assert not verdict.passed and "rank 1" in "\n".join(verdict.diagnosis)
    assert built == [0]


def test_an_moe_destinations_forward_keeps_the_references_near_tied_routing(guarded_layers):
    """The destination forward gets the checker's routing guard (``Checker.guard``): a
    token near-tied in the reference takes the reference's experts on every rank, as in the
    floor's measurement. Seen as the guard's ``choice`` being asked at every MoE layer."""
    asked = guarded_layers
    checker = conversion_checker(TOY_MOE)
    assert checker.checker.guard is not None
    asked.clear()
    checker.error("vllm:2", checker.declared("vllm:2"))
    assert sorted(set(asked)) == list(range(TOY_MOE.n_layers))


def test_a_coverage_failure_says_once_per_rank_and_layer_whose_weights_it_holds(tolerance):
    from tests.conventions.test_pipeline import local_as_global
    checker = conversion_checker(TOY)
    with pytest.raises(Uncovered) as caught:
        checker.verdict(local_as_global(checker.source("megatron:tp=1,pp=2"), 1),
                        src="megatron:tp=1,pp=2", dst="hf")
    assert str(caught.value).endswith(
        "; written layers holding another layer's weights byte for byte: rank 0 layer 0 "
        "holds layer 2's, rank 0 layer 1 holds layer 3's (two stages publishing the same "
        "local indices, or a stage's offset wrong)")
    # the twin: layers never written and none misplaced: nothing said of what they hold
    dropped = convert(checker.source("hf"), "hf", "hf", TOY)
    dropped = [{n: x for n, x in dropped[0].items() if ".layers.3." not in n}]
    with pytest.raises(Uncovered) as caught:
        checker.verdict(dropped, src="hf", dst="hf")
    assert "holding another layer's" not in str(caught.value)


def test_a_phase_1b_checkers_destination_forward_runs_over_gloo(monkeypatch):
    """Where the checker's phase is 1b the destination forward is ``gloo_logits``' (seen by
    standing in for it: no process is started), and in process where it is 1a."""
    from weight_sync_bench.check import floor
    ran = []

    def stand_in(forward, inputs, tokens, guard=None):
        ran.append(len(inputs))
        return torch.zeros(())
    monkeypatch.setattr(floor, "gloo_logits", stand_in)
    checker = conversion_checker(TOY, backend="gloo")
    assert checker.checker.phase == "1b"
    assert checker.error("vllm:2", checker.declared("vllm:2")) == float(
        checker.checker.reference.abs().max())
    assert ran == [2]
    conversion_checker(TOY).error("vllm:2", checker.declared("vllm:2"))  # the twin: 1a
    assert ran == [2]


def test_a_conversion_to_meta_is_named_from_the_conversion_catalogue_only():
    """The plain layout's mutations name only conversions to the plain layout. Meta stores
    ``tok_embeddings.weight`` under the plain layout's name but cut by columns: its ranks'
    cuts exchanged is not the plain layout's ``embedding_reversed`` (vocabulary shards)."""
    def ranks_exchanged(checker, dst):
        out = [dict(r) for r in convert(checker.source("hf"), "hf", dst, NARROW)]
        name = "tok_embeddings.weight"
        out[0][name], out[1][name] = out[1][name], out[0][name]
        return out
    checker = conversion_checker(NARROW, threshold=THRESHOLD)
    verdict = checker.verdict(ranks_exchanged(checker, "meta:2"), src="hf", dst="meta:2")
    assert not verdict.passed and verdict.first_mismatch == "tok_embeddings.weight"
    assert verdict.named_mutation is None
    # the twin: on a conversion to the plain layout, the same exchange is that mutation
    verdict = checker.verdict(ranks_exchanged(checker, "plain:2"), src="hf", dst="plain:2")
    assert verdict.named_mutation == "embedding_reversed"


def test_the_synced_dtype_decides_which_round_trips_are_named():
    """An fp16 round trip of bf16 weights is not declared a bug (``mutations._exact_for``):
    not named for a bf16 check; for fp32 weights it is, as itself."""
    def fp16_round_trip(checker, dst):
        out = convert(checker.source("megatron:2"), "megatron:2", dst, NARROW)
        return [{n: x.to(torch.float16).to(x.dtype) for n, x in r.items()} for r in out]
    bf16 = conversion_checker(NARROW, dtype="bf16", threshold=1e-3)
    verdict = bf16.verdict(fp16_round_trip(bf16, "vllm:2"), src="megatron:2", dst="vllm:2")
    assert not verdict.passed and verdict.named_mutation is None
    fp32 = conversion_checker(NARROW, threshold=THRESHOLD)
    verdict = fp32.verdict(fp16_round_trip(fp32, "vllm:2"), src="megatron:2", dst="vllm:2")
    assert not verdict.passed and verdict.named_mutation == "fp16_round_trip"
