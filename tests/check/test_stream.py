"""Streamed checks (``check.stream``): the same verdict as the whole-model check, bit for
bit, with the user's function called one layer (or one parameter) at a time and nothing
held beyond the stage at hand. Peak memory at real widths is measured by
``bench/bench_width.py``, not here."""

import math
import weakref

import pytest
import torch

from tests.breadth import breadth
from tests.check.narrow import THRESHOLD, narrowed
from weight_sync_bench import TOY, TOY_KV4, check_reshard, check_split, layout_for
from weight_sync_bench.check import streaming
from weight_sync_bench.check.convert import stage_convert, stream_convert
from weight_sync_bench.check.stream import (
    stage_reshard,
    stage_split,
    stages,
    stream_check,
)
from weight_sync_bench.errors import WrongUserShard
from weight_sync_bench.layout.reshard import split_tensor
from weight_sync_bench.model import stepwise

# tied embeddings and q/k/v and o_proj biases: every stage the streamed forward special-cases
VARIANT = TOY.replace(name="variant", vocab=500, d_model=64, n_layers=2, ffn=96, head_dim=8,
                      tie_embeddings=True, qkv_bias=True, o_bias=True)
# TOY and TOY_KV4 over a 512-word vocabulary, for what does not read their committed floors
# (a fifth of the cost: their 32000-word embedding and head are most of their weights); an
# explicit threshold judges them, 100x what their declared shards deviate by (1e-6).
NARROW, NARROW_KV4 = narrowed(TOY), narrowed(TOY_KV4)


def per_stage_split(config):
    """A split written per parameter: works on any subset of the model's names."""
    return stage_split(layout_for(config))


def per_stage_reshard(config):
    return stage_reshard(layout_for(config))


def naive(config):
    """The fused qkv of every layer cut contiguously: the classic bug."""
    split = per_stage_split(config)

    def fn(full, degree):
        out = split(full, degree)
        for name, x in full.items():
            if name.endswith("qkv.weight"):
                for rank, chunk in enumerate(x.chunk(degree, dim=0)):
                    out[rank][name] = chunk.clone()
        return out
    return fn


# The passing split in fp32 and the failing one in bf16 by default, both in both dtypes in
# the long run: a moved case's equivalent is the kept one of the same split in the other dtype
# (the verdict's every field compared whole against streamed either way).
@pytest.mark.parametrize("make, dtype", breadth(
    [(per_stage_split, "fp32"), (naive, "fp32"), (per_stage_split, "bf16"), (naive, "bf16")],
    keep={"per_stage_split-fp32", "naive-bf16"}, name=lambda c: f"{c[0].__name__}-{c[1]}"))
def test_a_streamed_split_gives_the_whole_model_verdict_bit_for_bit(make, dtype):
    whole = check_split(make(TOY), TOY, 2, dtype=dtype)
    streamed = check_split(make(TOY), TOY, 2, dtype=dtype, stream="layer")
    assert streamed == whole  # every field: error, threshold, mismatches, diagnosis
    assert streamed.passed == (make is per_stage_split)  # and the bug is still caught


# 4 -> 2 by default (its verdict also the one of the bare streamed reshard, fn=None), 1 -> 4
# in the long run: the same comparison of every field, from the other side of the split.
@pytest.mark.parametrize("src, dst", breadth([(4, 2), (1, 4)], keep={"4-2"},
                                             name=lambda pair: "-".join(map(str, pair))))
def test_a_streamed_reshard_gives_the_whole_model_verdict_bit_for_bit(src, dst):
    fn = per_stage_reshard(TOY_KV4)
    whole = check_reshard(fn, TOY_KV4, src, dst)
    assert check_reshard(fn, TOY_KV4, src, dst, stream="parameter") == whole
    assert whole.passed
    if (src, dst) == (4, 2):
        assert stream_check(TOY_KV4, 2, src=4) == whole  # fn=None


@pytest.mark.parametrize("degree", [1, 2])
def test_tied_embeddings_and_biases_stream_to_the_same_verdict(degree):
    split, bug = per_stage_split(VARIANT), naive(VARIANT)
    for fn in (split, bug):
        whole = check_split(fn, VARIANT, degree, threshold=1e-3)
        assert check_split(fn, VARIANT, degree, threshold=1e-3, stream="layer") == whole
    assert check_split(split, VARIANT, degree, threshold=1e-3, stream="layer").passed
    # at t=1 a contiguous cut is the declared one; at t=2 it is the bug
    assert check_split(bug, VARIANT, degree, threshold=1e-3, stream="layer").passed == \
        (degree == 1)


def test_fn_sees_one_stage_or_one_parameter_at_a_time_in_the_forwards_order():
    seen = []
    split = per_stage_split(NARROW)

    def spy(full, degree):
        seen.append(list(full))
        return split(full, degree)

    check_split(spy, NARROW, 2, stream="layer", threshold=THRESHOLD)
    assert seen == [names for _, names in stages(NARROW)]
    assert seen[1] == ["layers.0.attn_norm.weight", "layers.0.qkv.weight",
                       "layers.0.o_proj.weight", "layers.0.ffn_norm.weight",
                       "layers.0.gate_up.weight", "layers.0.down.weight"]
    assert len(seen) == NARROW.n_layers + 2 == TOY.n_layers + 2  # TOY's stages, narrower
    seen.clear()
    check_split(spy, NARROW, 2, stream="parameter", threshold=THRESHOLD)
    assert seen == [[name] for name in NARROW.param_shapes()]


def _no_unit_outlives_itself(monkeypatch, kept=()):
    """Wrap the draws and the upcasts: each unit, when drawn, finds nothing made before it
    still alive (a full tensor, a shard cut from it or returned by ``fn``, an upcast), but
    the tensors of ``kept``. Returns the names drawn; ``held(x)`` registers ``fn``'s own."""
    made: list[tuple[str, weakref.ref]] = []
    drawn: list[str] = []
    real_draw, real_computing = streaming.draw, stepwise.computing

    def draw(draws, names):
        alive = sorted({n for n, ref in made if ref() is not None and n not in kept})
        assert not alive, f"drawing {names} while {alive} are still held"
        full = real_draw(draws, names)
        drawn.extend(full)
        made.extend((n, weakref.ref(x)) for n, x in full.items())
        return full

    def computing(params):
        out = real_computing(params)
        made.extend((n, weakref.ref(x)) for n, x in out.items())
        return out

    monkeypatch.setattr(streaming, "draw", draw)  # every streamed pass draws through it
    monkeypatch.setattr(stepwise, "computing", computing)
    return drawn, lambda shards: made.extend(
        (n, weakref.ref(x)) for rank in shards for n, x in rank.items())


def _recorded(fn, held):
    def wrapped(given, degree):
        out = fn(given, degree)
        held(out)
        return out
    return wrapped


@pytest.mark.parametrize("per, dtype, src", [("parameter", "bf16", None), ("parameter", "fp32", 1),
                                             ("layer", "bf16", 1)])
def test_a_streamed_check_drops_each_unit_before_it_draws_the_next(monkeypatch, per, dtype, src):
    """The memory bound, structurally: with ``per="parameter"`` one parameter's tensors are
    alive at a time (``bench/bench_width.py`` measures the resulting peak at real widths),
    with ``per="layer"`` one stage's. The tied embedding is kept for the head by design."""
    config = VARIANT
    drawn, held = _no_unit_outlives_itself(monkeypatch, kept=("tok_embeddings.weight",))
    fn = _recorded((per_stage_split if src is None else per_stage_reshard)(config), held)
    verdict = stream_check(config, 2, src=src, fn=fn, per=per, dtype=dtype, threshold=math.inf)
    assert verdict.first_mismatch is None
    assert drawn == list(config.param_shapes())


def test_a_streamed_conversion_drops_each_parameter_before_it_draws_the_next(monkeypatch):
    drawn, held = _no_unit_outlives_itself(monkeypatch)
    fn = _recorded(stage_convert("megatron:2", "vllm:4", NARROW), held)
    verdict = stream_convert(fn, NARROW, "megatron:2", "vllm:4", per="parameter", dtype="bf16",
                             threshold=math.inf)
    assert verdict.first_mismatch is None and drawn == list(NARROW.param_shapes())


@pytest.mark.parametrize("keep", ["given", "returned"])
def test_the_unit_check_sees_a_tensor_kept_past_its_unit(monkeypatch, keep):
    """The twin: a split that keeps what it was given, or what it returned, alive past its
    unit fails the check above."""
    _, held = _no_unit_outlives_itself(monkeypatch)
    hoard = []
    split = per_stage_split(NARROW)

    def keeps(full, degree):
        out = split(full, degree)
        if "layers.0.qkv.weight" in full:
            hoard.append(full if keep == "given" else out)
        return out

    with pytest.raises(AssertionError, match=r"drawing \['layers.0.o_proj.weight'\] while "
                                             r"\['layers.0.qkv.weight'\]"):
        stream_check(NARROW, 2, fn=_recorded(keeps, held), per="parameter",
                     threshold=math.inf)


def test_progress_reports_every_stage_with_its_bytes():
    reports = []
    stream_check(TOY, 2, progress=reports.append)
    assert [(r.stage, r.stages, r.label) for r in reports] == [
        (k + 1, TOY.n_layers + 2, label) for k, (label, _) in enumerate(stages(TOY))]
    assert reports[0].bytes == 32000 * 256 * 4  # the embedding table, fp32
    assert str(reports[0]).startswith("stage 1/6 embedding (31 MiB), ")


def test_a_stage_returned_in_the_wrong_dtype_names_rank_parameter_and_dtypes():
    split = per_stage_split(TOY)

    def upcasts(full, degree):
        out = split(full, degree)
        if "layers.1.down.weight" in full:
            out[0]["layers.1.down.weight"] = out[0]["layers.1.down.weight"].float()
        return out

    with pytest.raises(WrongUserShard) as caught:
        check_split(upcasts, TOY, 2, dtype="bf16", stream="layer")
    assert (caught.value.rank, caught.value.name) == (0, "layers.1.down.weight")
    assert (caught.value.expected_dtype, caught.value.actual_dtype) == (torch.bfloat16,
                                                                        torch.float32)
    assert "rank 0 layers.1.down.weight: dtype torch.float32, expected torch.bfloat16" in \
        str(caught.value)


def test_a_streamed_check_refuses_an_unknown_way_to_stream():
    with pytest.raises(ValueError, match="backend='threads': a streamed check runs"):
        check_split(per_stage_split(TOY), TOY, 2, stream="layer", backend="threads")
    with pytest.raises(ValueError, match="calls fn per layer or per parameter"):
        stream_check(TOY, 2, per="model")


def test_shard_of_is_split_tensor_byte_for_byte_at_every_degree_and_rank():
    from weight_sync_bench.check.diagnosis import bit_equal
    from weight_sync_bench.layout.reshard import shard_of
    from weight_sync_bench.model.config import init_params

    params = init_params(VARIANT.replace(tie_embeddings=False), 0)
    layout = layout_for(VARIANT.replace(tie_embeddings=False))
    for degree in layout.supported_degrees():
        for spec in layout:
            split = split_tensor(params[spec.name], spec, degree)
            assert all(bit_equal(shard_of(params[spec.name], spec, degree, r), split[r])
                       for r in range(degree))


def test_the_streamed_floor_measurement_is_the_whole_model_one_cell_for_cell():
    import numpy as np

    from weight_sync_bench.check import floor
    from weight_sync_bench.check.stream import stream_deviation
    from weight_sync_bench.tolerance import phase as record

    whole = floor.measure("1a", configs=[NARROW_KV4], repetitions=1)["cells"]
    streamed = [record.cell(NARROW_KV4.name, t,
                            [stream_deviation(NARROW_KV4, t, seed=0).numpy()])
                for t in (1, 2, 4)]
    assert streamed == whole
    assert np.isfinite([c["worst_abs"] for c in whole]).all()


def test_a_streamed_fn_that_writes_into_its_input_is_refused_not_compared_with_itself():
    split = per_stage_split(NARROW)

    def scales_in_place(full, degree):
        for x in full.values():
            x.mul_(2)  # the streamed input is the harness's own tensor: compared with it next
        return split(full, degree)

    from weight_sync_bench.errors import ModifiedInput
    for stream in ("parameter", None):  # streamed: the harness's own tensors; whole: copies
        with pytest.raises(ModifiedInput, match=r"your splitter `.*scales_in_place` modified "
                                                r"in place `tok_embeddings.weight`"):
            check_split(scales_in_place, NARROW, 2, stream=stream, threshold=THRESHOLD)
    assert check_split(split, NARROW, 2, stream="parameter",
                       threshold=THRESHOLD).passed  # the twin
