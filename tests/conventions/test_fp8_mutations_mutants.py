"""``conventions.fp8_mutations`` read byte by byte (issue 30, the mutation pass over
``conventions/fp8_mutations.py``).

Each FP8 mutation is one of the field's sync bugs planted in what a correct quantizing
converter writes (``fp8.fp8_shards``). The kill-matrix tests (``tests/check/
test_fp8_convert.py``) show each one fails the check, named; these pin what each one
writes: exactly which tensors of which rank differ from the correct destination, and how,
computed here on their own terms (the bug's rule, not the module's code). A mutation that
drifted into another bug, or into a smaller one, would still fail the check and pass the
kill matrix; here it does not. Also each one's public report, diagnosis words and the
reasons it cannot occur."""

from __future__ import annotations

import pytest
import torch

from tests.check.test_fp8_convert import MOE_FP8, TOY_FP8
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.conventions.fp8 import (
    E4M3_MAX,
    FP8,
    SCALE_SUFFIXES,
    expand,
    fp8_shards,
    quantize_tensor,
    shard_quantized,
)
from weight_sync_bench.conventions.fp8_mutations import FP8_MUTATIONS, mutated
from weight_sync_bench.model.config import init_params

# TOY_FP8's heads are 128 wide: o_proj at TP 2 is a 2 x 2 grid of blocks (square, and not
# its own transpose), its MLP whole blocks; MOE_FP8 is it with experts over EP
O0 = "model.layers.0.self_attn.o_proj.weight"


def params(config):
    return init_params(config, 0, dtype=torch.bfloat16)


def changed(before, after):
    """``{(rank, name)}`` of every tensor whose bytes, dtype or shape differ (names must
    be the same on each rank: a mutation keeps them)."""
    assert len(before) == len(after)
    out = set()
    for r, (a, b) in enumerate(zip(before, after)):
        assert list(a) == list(b), r
        for n in a:
            x, y = a[n], b[n]
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(
                    x.view(torch.uint8), y.view(torch.uint8)):
                out.add((r, n))
    return out


def run(name, config, dst):
    at = endpoint(dst)
    p = params(config)
    return fp8_shards(config, at, p), mutated(FP8_MUTATIONS[name], config, at, p), at, p


def test_the_mutations_their_reports_and_their_diagnosis_words():
    assert [(m.name, m.report, m.named) for m in FP8_MUTATIONS.values()] == [
        ("scale_zero", "THUDM/slime PR #2256", "scale is 0 in"),
        ("scale_unsent", "vllm PR #45835, vime PR #248", "never written"),
        ("scale_transposed", "vllm PR #23280", "transposed"),
        ("scale_other_rank", "a scale of another rank", "rank 0's scale"),
        ("scale_ue8m0", "sglang PR #30761, vime PR #133", "powers of two"),
        ("scale_reciprocal", "dequantizing by the inverse of the scale", "reciprocal"),
        ("scale_per_shard", "quantized after the TP cut",
         "own shard quantized after the TP cut"),
        ("router_quantized", "vLLM builds mlp.gate with quant_config=None",
         "dtype torch.float8_e4m3fn, declared")]


@pytest.mark.parametrize(("dst", "scale"), [("vllm:tp=2,fp8=block128", "_scale_inv"),
                                            ("vllm:tp=2,fp8=tensor", "_scale"),
                                            ("hf:fp8=block128", "_scale_inv")])
def test_scale_zero_zeroes_rank_0s_first_o_proj_scale_and_nans_its_first_block(dst, scale):
    good, bad, _, _ = run("scale_zero", TOY_FP8, dst)
    assert changed(good, bad) == {(0, O0), (0, O0 + scale)}
    s, t = good[0][O0 + scale].reshape(-1), bad[0][O0 + scale].reshape(-1)
    assert t[0].item() == 0.0 and torch.equal(t[1:], s[1:])
    w, v = good[0][O0].view(torch.uint8), bad[0][O0].view(torch.uint8)
    assert bool((v[:128, :128] == 0x7F).all())  # e4m3fn's NaN
    keep = torch.ones_like(v, dtype=torch.bool)
    keep[:128, :128] = False
    assert torch.equal(v[keep], w[keep])


@pytest.mark.parametrize(("config", "dst"), [(MOE_FP8, "vllm:tp=2,ep=2,fp8=block128"),
                                             (TOY_FP8, "vllm:tp=4,fp8=block128")])
def test_scale_unsent_fills_the_last_ranks_first_o_proj_scale_with_the_engines_fill(config,
                                                                                    dst):
    good, bad, _, _ = run("scale_unsent", config, dst)
    last = len(good) - 1
    assert changed(good, bad) == {(last, O0 + "_scale_inv")}
    x = bad[last][O0 + "_scale_inv"]
    assert x.shape == good[last][O0 + "_scale_inv"].shape and x.dtype == torch.float32
    assert bool((x == torch.finfo(torch.float32).min).all())


def test_scale_transposed_transposes_rank_0s_first_square_asymmetric_grid():
    good, bad, _, _ = run("scale_transposed", TOY_FP8, "vllm:tp=2,fp8=block128")
    square = [n for n, x in good[0].items() if n.endswith("_scale_inv") and x.dim() == 2
              and x.shape[0] == x.shape[1] and not torch.equal(x, x.t())]
    assert square[0] == O0 + "_scale_inv"
    assert changed(good, bad) == {(0, square[0])}
    assert torch.equal(bad[0][square[0]], good[0][square[0]].t())
    assert bad[0][square[0]].is_contiguous()


def test_scale_transposed_reads_the_grids_of_rank_0_only():
    """On shards of two ranks where rank 1's first square grid is its own transpose and
    rank 0's is not, rank 0's is the one transposed."""
    asym = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    sym = torch.tensor([[1.0, 2.0], [2.0, 1.0]])
    shards = [{"a.weight_scale_inv": asym.clone(), "b.weight_scale_inv": asym + 1},
              {"a.weight_scale_inv": sym.clone(), "b.weight_scale_inv": asym + 1}]
    out = FP8_MUTATIONS["scale_transposed"].apply(shards, TOY_FP8,
                                                  endpoint("vllm:tp=2,fp8=block128"), {})
    assert torch.equal(out[0]["a.weight_scale_inv"], asym.t())
    assert torch.equal(out[0]["b.weight_scale_inv"], asym + 1)
    assert torch.equal(out[1]["a.weight_scale_inv"], sym)


def test_scale_other_rank_takes_rank_0s_first_scale_the_last_rank_holds_otherwise():
    """On three ranks: the first scale of rank 0 that the last rank holds too and holds
    otherwise is the one copied, whatever a middle rank holds."""
    one, two = torch.ones(2, 2), 2 * torch.ones(2, 2)
    shards = [{"a.weight_scale_inv": one.clone(), "b.weight_scale_inv": one.clone(),
               "c.weight_scale_inv": one.clone()},
              {"b.weight_scale_inv": two.clone(), "c.weight_scale_inv": one.clone()},
              {"a.weight_scale_inv": two.clone(), "b.weight_scale_inv": one.clone(),
               "c.weight_scale_inv": two.clone()}]
    out = FP8_MUTATIONS["scale_other_rank"].apply(shards, TOY_FP8,
                                                  endpoint("vllm:tp=2,fp8=block128"), {})
    assert [torch.equal(out[2][n], one) for n in out[2]] == [True, True, False]
    assert torch.equal(out[1]["b.weight_scale_inv"], two)


@pytest.mark.parametrize(("config", "dst"), [(MOE_FP8, "vllm:tp=2,ep=2,fp8=tensor"),
                                             (TOY_FP8, "vllm:tp=4,fp8=block128")])
def test_scale_other_rank_gives_the_last_rank_rank_0s_first_differing_scale(config, dst):
    good, bad, _, _ = run("scale_other_rank", config, dst)
    differing = [n for n in good[0] if n.endswith(("_scale", "_scale_inv")) and n in good[-1]
                 and not torch.equal(good[0][n], good[-1][n])]
    assert differing, "the per-tensor scales of EP ranks' experts differ"
    assert changed(good, bad) == {(len(good) - 1, differing[0])}
    assert torch.equal(bad[-1][differing[0]], good[0][differing[0]])
    assert bad[-1][differing[0]].data_ptr() != bad[0][differing[0]].data_ptr()  # a copy


def test_scale_ue8m0_requantizes_every_fp8_matrix_on_every_rank_to_power_of_two_scales():
    good, bad, _, _ = run("scale_ue8m0", TOY_FP8, "vllm:tp=2,fp8=block128")
    matrices = {(r, n) for r, rank in enumerate(good) for n, x in rank.items()
                if x.dtype == FP8 and x.dim() == 2}
    assert len(matrices) > 4 and {r for r, _ in matrices} == {0, 1}
    # nothing else changes (each of these is read exactly below)
    assert changed(good, bad) <= matrices | {(r, n + "_scale_inv") for r, n in matrices}
    for r, n in matrices:
        s = good[r][n + "_scale_inv"]
        want_scale = torch.exp2(torch.ceil(torch.log2(s)))
        assert torch.equal(bad[r][n + "_scale_inv"], want_scale), (r, n)
        w = good[r][n].float() * expand(s, *good[r][n].shape)
        want = (w / expand(want_scale, *w.shape)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
        assert bad[r][n].dtype == FP8
        assert torch.equal(bad[r][n].view(torch.uint8), want.view(torch.uint8)), (r, n)
    assert any((bad[r][n + "_scale_inv"] != good[r][n + "_scale_inv"]).any()
               for r, n in matrices)  # not already powers of two


@pytest.mark.parametrize(("dst", "scale"), [("vllm:tp=2,fp8=block128", "_scale_inv"),
                                            ("vllm:tp=2,fp8=tensor", "_scale")])
def test_scale_reciprocal_inverts_the_first_o_proj_scale_on_every_rank(dst, scale):
    good, bad, _, _ = run("scale_reciprocal", TOY_FP8, dst)
    assert changed(good, bad) == {(0, O0 + scale), (1, O0 + scale)}
    for r in (0, 1):
        assert torch.equal(bad[r][O0 + scale], 1 / good[r][O0 + scale])


def test_scale_per_shard_quantizes_o_proj_and_down_proj_after_the_tp_cut():
    good, bad, at, p = run("scale_per_shard", TOY_FP8, "vllm:tp=2,fp8=tensor")
    own = shard_quantized(TOY_FP8, at, p)
    rows = {(r, n) for r in (0, 1) for n in good[r]
            if n.endswith(("o_proj.weight", "down_proj.weight", "o_proj.weight_scale",
                           "down_proj.weight_scale"))}
    assert len(rows) == 16  # 2 layers x 2 tensors x (weight, scale) x 2 ranks
    for r, n in rows:
        assert torch.equal(bad[r][n].view(torch.uint8), own[r][n].view(torch.uint8))
    # the rank holding a tensor's largest |w| has its whole amax: the other one's own scale
    # differs; weight and scale change together, on one rank of each of the four tensors
    moved = changed(good, bad)
    assert moved <= rows and len(moved) == 8
    assert {n.removesuffix("_scale") for _, n in moved} == {
        f"model.layers.{i}.{m}.weight" for i in (0, 1)
        for m in ("self_attn.o_proj", "mlp.down_proj")}
    assert all((r, n + "_scale") in moved for r, n in moved if not n.endswith("_scale"))
    # per block, at a degree vLLM accepts, the cut is on block edges: the same bytes
    good, bad, _, _ = run("scale_per_shard", TOY_FP8, "vllm:tp=2,fp8=block128")
    assert changed(good, bad) == set()


def test_router_quantized_sends_every_ranks_router_per_tensor_fp8():
    good, bad, _, _ = run("router_quantized", MOE_FP8, "vllm:tp=2,ep=2,fp8=block128")
    routers = {(r, n) for r in range(len(good)) for n in good[r]
               if n.endswith("mlp.gate.weight")}
    assert len(routers) == 2 * len(good) and changed(good, bad) == routers
    for r, n in routers:
        want, _ = quantize_tensor(good[r][n])
        assert bad[r][n].dtype == FP8
        assert torch.equal(bad[r][n].view(torch.uint8), want.view(torch.uint8))


def test_where_each_mutation_cannot_occur_and_why():
    def why(name, config, dst):
        return FP8_MUTATIONS[name].not_applicable(config, endpoint(dst))

    everywhere = ["vllm:tp=1,fp8=block128", "vllm:tp=2,fp8=block128",
                  "vllm:tp=2,fp8=tensor", "vllm:tp=2,ep=2,fp8=tensor"]
    for dst in everywhere:
        for config in (TOY_FP8, MOE_FP8):
            for name in ("scale_zero", "scale_unsent", "scale_reciprocal"):
                assert why(name, config, dst) is None
    assert why("scale_transposed", TOY_FP8, "vllm:tp=2,fp8=tensor") == (
        "a per-tensor scale has no block grid to transpose")
    assert why("scale_transposed", TOY_FP8, "vllm:tp=1,fp8=block128") == (
        "no square block grid here (transposing any other changes its shape, which torch "
        "refuses before any check)")
    assert why("scale_transposed", TOY_FP8, "vllm:tp=2,fp8=block128") is None
    # a one-block grid ([1, 1]) is square but has nothing to transpose
    one = TOY_FP8.replace(name="one_block", d_model=128, n_heads=2, n_kv_heads=1, ffn=256)
    assert why("scale_transposed", one, "vllm:tp=2,fp8=block128") is not None
    assert why("scale_other_rank", TOY_FP8, "vllm:tp=1,fp8=block128") == (
        "one rank: no other rank's scale")
    assert why("scale_other_rank", TOY_FP8, "vllm:tp=2,fp8=tensor") == (
        "per-tensor scales are the same on every TP rank (only EP ranks' differ)")
    assert why("scale_other_rank", MOE_FP8, "vllm:tp=2,ep=2,fp8=tensor") is None
    assert why("scale_other_rank", TOY_FP8, "vllm:tp=2,fp8=block128") is None
    assert why("scale_ue8m0", TOY_FP8, "vllm:tp=2,fp8=tensor") == "UE8M0 packs block scales"
    assert why("scale_ue8m0", TOY_FP8, "vllm:tp=2,fp8=block128") is None
    assert why("scale_per_shard", TOY_FP8, "vllm:tp=1,fp8=block128") == (
        "one rank: its shard is the whole tensor")
    assert why("scale_per_shard", TOY_FP8, "vllm:tp=2,fp8=tensor") is None
    assert why("router_quantized", TOY_FP8, "vllm:tp=2,fp8=block128") == (
        "a dense model has no router")
    assert why("router_quantized", MOE_FP8, "vllm:tp=2,ep=2,fp8=block128") is None


def test_the_mutations_leave_the_correct_destination_they_were_given_alone():
    """``mutated`` plants the bug in shards of its own: the canonical weights it was
    handed are unchanged."""
    at = endpoint("vllm:tp=2,fp8=block128")
    p = params(TOY_FP8)
    before = {n: x.clone() for n, x in p.items()}
    for m in FP8_MUTATIONS.values():
        if m.not_applicable(TOY_FP8, at) is None:
            mutated(m, TOY_FP8, at, p)
    assert all(torch.equal(p[n], before[n]) for n in p)
    assert set(SCALE_SUFFIXES) == {"block128", "tensor"}


def test_a_scheme_that_is_neither_is_refused_not_read_as_per_tensor():
    from weight_sync_bench.conventions.fp8 import dequantize, quantize

    w = torch.ones(128, 128)
    for scheme in ("TENSOR", "none", None):
        with pytest.raises(ValueError, match="FP8 scheme"):
            quantize(w, scheme)
        with pytest.raises(ValueError, match="FP8 scheme"):
            dequantize(w.to(FP8), torch.ones(1), scheme)
    q, s = quantize(w, "tensor")  # the twin: both schemes are taken
    assert torch.equal(dequantize(q, s, "tensor"), w) and quantize(w, "block128")[1].shape == (1, 1)

