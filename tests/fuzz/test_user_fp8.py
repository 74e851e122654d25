"""A user's converter into an FP8 destination, fuzzed (``wsb fuzz --converter mod:fn --from
megatron --to vllm:fp8=block128``): the destination's options ride on every drawn degree;
the geometries come from ``FP8_DOMAIN``, whose widths cross the 128-row block boundary, so
vLLM's block rules hold some geometries at some degrees and refuse others, which are never
drawn; the verdict is ``check_convert``'s (weights and scales bit for bit). A correct
quantizing converter passes; a planted FP8 bug is found, shrunk, saved and replayed; a
converter that quantizes per shard is told apart from the full-tensor quantizer per
tensor, and passes per block, where vLLM accepts only degrees that cut on block edges."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

sys.path.insert(0, str(Path(__file__).parent))
import user_functions as uf

from tests.breadth import breadth
from weight_sync_bench.cli.main import main
from weight_sync_bench.fuzz.case import end_of, options_only
from weight_sync_bench.fuzz.corpus import load_entry
from weight_sync_bench.fuzz.domain import DOMAIN, FP8_DOMAIN
from weight_sync_bench.fuzz.replay import replay_entry
from weight_sync_bench.fuzz.runner import PropertyFailed
from weight_sync_bench.fuzz.strategies.user import convention_degrees, user_cases
from weight_sync_bench.fuzz.user import UserFunction, user_property

# A few examples per property: 6 by default, 25 in the long run (a planted FP8 bug is found
# within the 6: test_a_planted_fp8_bug_..., test_quantizing_per_shard_...)
FEW = settings(max_examples=max(6, settings().max_examples // 80), database=None,
               deadline=None)
# The draws the strategies' reach is judged over: 30 by default, 100 in the long run
DRAWS = max(30, settings().max_examples // 20)


def test_options_without_a_degree_ride_on_each_drawn_degree():
    assert options_only("vllm:fp8=block128") and options_only("hf:fp8=tensor")
    assert not options_only("vllm:tp=2,fp8=block128") and not options_only("vllm")
    assert not options_only("megatron:tp=2,pp=2") and not options_only("vllm:2")
    assert str(end_of("vllm:fp8=block128", 4)) == "vllm:tp=4,fp8=block128"
    function = UserFunction(uf.convert_to_fp8, "converter", "megatron", "vllm:fp8=tensor")
    assert function.quantized and function.domain(DOMAIN) == FP8_DOMAIN
    plain = UserFunction(uf.convert_megatron_to_vllm, "converter", "megatron", "vllm")
    assert not plain.quantized and plain.domain(DOMAIN) == DOMAIN  # the twin


def _drawn(dst, n=DRAWS):
    seen = []

    @settings(max_examples=n, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(user_cases("converter", domain=FP8_DOMAIN, conventions=("megatron", dst)))
    def collect(case):
        seen.append(case)

    collect()
    return seen


def test_the_draws_cross_the_block_boundary_and_vllm_refuses_the_degrees_it_refuses():
    """Over the FP8 domain, block128 destinations are drawn at TP > 1 too, never at a
    degree vLLM refuses; some drawn geometries are refused at a degree the unquantized
    convention stores (the degrees that do not align), while per tensor no degree is."""
    block = _drawn("vllm:fp8=block128")
    assert any(c.dst > 1 for c in block)
    refused_somewhere = 0
    for case in block:
        held = convention_degrees("vllm:fp8=block128", case.config)
        assert case.dst in held
        refused_somewhere += held != convention_degrees("vllm", case.config)
        assert convention_degrees("vllm:fp8=tensor", case.config) == \
            convention_degrees("vllm", case.config)
    assert refused_somewhere > 0
    # per tensor, the widths that no block rule would hold are drawn too, sharded
    tensor = _drawn("vllm:fp8=tensor")
    assert any(c.dst > 1 and (c.config.kv_rows % 128 or c.config.ffn % 128) for c in tensor)


# block on vLLM by default; per tensor is fuzzed by default through the per-shard twin
# (test_quantizing_per_shard_fails_per_tensor_and_passes_per_block)
@pytest.mark.parametrize("dst", breadth(["vllm:fp8=block128", "vllm:fp8=tensor", "hf:fp8=tensor"],
                                        keep={"vllm:fp8=block128"}))
def test_a_correct_quantizing_converter_passes_the_fp8_fuzz(dst):
    function = UserFunction(uf.convert_to_fp8, "converter", "megatron", dst)
    test = user_property(function, settings=FEW, corpus=False)
    test()
    assert test.stats.checked >= FEW.max_examples


def test_a_planted_fp8_bug_is_found_shrunk_saved_and_replayed(tmp_path):
    function = UserFunction(uf.convert_to_fp8_unclamped, "converter", "megatron",
                            "vllm:fp8=block128")
    with pytest.raises(PropertyFailed) as info:
        user_property(function, settings=FEW, corpus_path=tmp_path, real=False)()
    assert "NaN" in str(info.value) and "o_proj.weight" in str(info.value)
    (path,) = sorted(tmp_path.glob("*.json"))
    entry = load_entry(path)
    assert entry.case.dst_convention == "vllm:fp8=block128"

    def load(spec, role):
        return getattr(uf, spec.split(":")[1])

    assert replay_entry(entry, load=load).status == "still failing"
    fixed = replay_entry(entry, load=lambda spec, role: uf.convert_to_fp8)
    assert fixed.status == "fixed" and fixed.claim_holds


def test_quantizing_per_shard_fails_per_tensor_and_passes_per_block(tmp_path):
    """The told-apart pair: per tensor, the fuzz finds a degree where a shard's amax is not
    the tensor's; per block (degrees vLLM accepts) the same converter gives the same
    bytes."""
    per_tensor = UserFunction(uf.convert_to_fp8_per_shard, "converter", "megatron",
                              "vllm:fp8=tensor")
    with pytest.raises(PropertyFailed) as info:
        user_property(per_tensor, settings=FEW, corpus_path=tmp_path, real=False)()
    assert "own shard quantized after the TP cut" in str(info.value)
    per_block = UserFunction(uf.convert_to_fp8_per_shard, "converter", "megatron",
                             "vllm:fp8=block128")
    user_property(per_block, settings=FEW, corpus=False, real=False)()


def test_wsb_fuzz_takes_an_fp8_destination_and_says_its_domain(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    # 3 examples: the claim is what the command takes and says (the draws over the FP8
    # domain are test_the_draws_cross_the_block_boundary_...'s)
    rc = main(["fuzz", "--converter", "user_functions:convert_to_fp8", "--from", "megatron",
               "--to", "vllm:fp8=block128", "--examples", "3", "--no-real-geometries"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"domain: {FP8_DOMAIN}" in out


def test_where_every_sharded_forward_sums_exactly_the_committed_fp8_floor_judges_and_says_so(
        monkeypatch):
    """A small geometry (2 heads of 128, d_model 64, 4 tokens) whose sharded forwards sum
    exactly on its dequantized weights over every token seed: no floor to derive from, so
    the committed FP8 floor's threshold, named; a planted NaN still fails there (the
    twin). Which geometry sums exactly depends on the CPU's kernels (this one did on an AMD
    EPYC, not on an AVX-512 Intel Xeon), so the measurement stands in, saying 0."""
    from weight_sync_bench.check import fp8
    from weight_sync_bench.check.fp8 import check_fp8_convert
    from weight_sync_bench.conventions import endpoint
    from weight_sync_bench.fuzz.domain import fuzz_params

    config = FP8_DOMAIN.config(n_kv_heads=2, group=1, head_dim=128, d_model=64,
                               ffn_per_kv_head=128, vocab_per_kv_head=16, n_layers=1, batch=1,
                               seq_len=4)
    src, dst = endpoint("megatron:2"), endpoint("vllm:tp=2,fp8=tensor")

    def run(fn):
        return check_fp8_convert(lambda s, d, **kw: fn(s, d, config=config, source=src,
                                                        target=dst),
                                 config, src, dst, fuzz_params(config, 0))

    measured = []
    monkeypatch.setattr(fp8, "measure_worst", lambda *a, **k: measured.append(a) or 0.0)
    v = run(uf.convert_to_fp8)
    assert measured and v.passed and any("summed exactly" in n and "phase1a_fp8_tensor.json" in n
                            for n in v.notes), v.notes
    assert not run(uf.convert_to_fp8_unclamped).passed


def test_convert_property_takes_an_fp8_destination_as_wsb_fuzz_does():
    """``testing.convert_property`` reads its ends as ``wsb fuzz`` does
    (``fuzz.case.parse_end``): the options ride on each drawn degree."""
    from weight_sync_bench.fuzz.case import parse_end
    from weight_sync_bench.testing import convert_property

    assert parse_end("vllm:fp8=tensor") == ("vllm:fp8=tensor", None)
    assert parse_end("megatron:4") == ("megatron", 4) and parse_end("vllm") == ("vllm", None)
    assert parse_end("megatron:tp=2,pp=2") == ("megatron:tp=2,pp=2", 4)
    # drawn geometries only, as wsb fuzz runs above (--no-real-geometries): the shipped ones
    # into an FP8 destination are test_a_correct_quantizing_converter_passes_the_fp8_fuzz's
    test = convert_property(uf.convert_to_fp8, "megatron", "vllm:fp8=tensor", settings=FEW,
                            corpus=False, real=False)
    test()
    assert test.stats.checked >= FEW.max_examples
