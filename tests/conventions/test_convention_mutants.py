"""``conventions.convention`` (issue 30, the mutation pass over ``conventions/convention.py``):
what a storage convention is, and how an endpoint is written, parsed and printed.

``Convention`` bundles a framework's index maps, its forward layout and its options. It
checks the rules before anything is cut, and it remembers a refusal so that
``supported_degrees`` can probe cheaply. An ``Endpoint`` is a convention at its parallel
degrees, parsed from text such as ``"megatron:tp=2,pp=2,vpp=2"`` and printed back as written.
The helpers ``need``, ``relaid``, ``renamed`` and ``replicated`` are how the conventions
write their rules and layouts. These tests pin each endpoint's text both ways and each parse
refusal's text. They also pin the defaults, the refusal cache (kept, bounded, least recently
used first out), the probe's range, and what the layout helpers keep and replace."""

from __future__ import annotations

import pytest
import torch

from weight_sync_bench.conventions import CONVENTIONS, endpoint, materialize, shards_for
from weight_sync_bench.conventions import convention as C
from weight_sync_bench.conventions.convention import (
    Convention,
    Endpoint,
    ForwardLayout,
    need,
    parse_endpoint,
    relaid,
    renamed,
    replicated,
)
from weight_sync_bench.conventions.maps import rows
from weight_sync_bench.errors import UnknownConvention, UnsupportedConvention
from weight_sync_bench.layout.placements import DataParallel, Experts, Replicate, Shard
from weight_sync_bench.model.config import TOY, ModelConfig, init_params
from weight_sync_bench.model.plan import layout_for

G = ModelConfig(name="g", vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                head_dim=8, ffn=48, seq_len=8)
MOE = TOY.replace(name="moe", vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  head_dim=8, ffn=48, n_experts=4, top_k=2, expert_ffn=16, shared_ffn=16,
                  dense_layers=1)


@pytest.mark.parametrize("text, printed, fields", [
    ("megatron:4", "megatron:4", {"degree": 4}),
    ("megatron:tp=1", "megatron:1", {"degree": 1}),
    ("megatron:tp=3,ep=1", "megatron:3", {"degree": 3}),
    ("hf", "hf:1", {"degree": 1}),
    # tp is written once anything else is: ep, etp or a stage
    ("vllm:tp=1,ep=2", "vllm:tp=1,ep=2", {"ep": 2}),
    ("megatron:tp=1,etp=1", "megatron:tp=1,etp=1", {"etp": 1}),
    ("megatron:pp=2", "megatron:tp=1,pp=2", {"pp": 2}),
    ("megatron:vpp=2", "megatron:tp=1,vpp=2", {"vpp": 2}),
    ("megatron:pp_first=1", "megatron:tp=1,pp_first=1", {"pp_first": 1}),
    ("megatron:pp_last=3", "megatron:tp=1,pp_last=3", {"pp_last": 3}),
    # options alone need no tp; they print sorted, after the degrees
    ("hf:experts=fused", "hf:experts=fused", {"options": (("experts", "fused"),)}),
    ("vllm:tp=2,kernel=flashinfer_cutlass,fp8=block128",
     "vllm:tp=2,fp8=block128,kernel=flashinfer_cutlass",
     {"degree": 2, "options": (("fp8", "block128"), ("kernel", "flashinfer_cutlass"))}),
    ("megatron:pp_account=both", "megatron:pp_account=both",
     {"options": (("pp_account", "both"),)}),
    ("megatron:experts=sequential,pp_last=1,etp=1,ep=2,pp_first=1,vpp=2,pp=4,tp=2",
     "megatron:tp=2,pp=4,vpp=2,pp_first=1,pp_last=1,ep=2,etp=1,experts=sequential",
     {"degree": 2, "ep": 2, "etp": 1, "options": (("experts", "sequential"),), "pp": 4,
      "vpp": 2, "pp_first": 1, "pp_last": 1}),
])
def test_an_endpoint_parses_to_its_fields_and_prints_as_written(text, printed, fields):
    at = endpoint(text)
    defaults = {"degree": 1, "ep": 1, "etp": 0, "options": (), "pp": 1, "vpp": 1, "pp_first": 0,
                "pp_last": 0}
    assert {k: getattr(at, k) for k in defaults} == {**defaults, **fields}
    assert at.convention is CONVENTIONS[text.partition(":")[0]]
    assert str(at) == printed
    assert endpoint(printed) == at and parse_endpoint(at, CONVENTIONS) is at


@pytest.mark.parametrize("text, message", [
    (None, "a conversion endpoint is a 'name:degree' string, got NoneType None"),
    ("foo:2", "unknown convention 'foo' in 'foo:2'; known: plain, megatron, vllm, hf, meta"),
    ("vllm:-1", "'vllm:-1': the degree after ':' must be a positive integer"),
    ("vllm:1.5", "'vllm:1.5': the degree after ':' must be a positive integer"),
    ("vllm:=2", ("'vllm:=2': after ':' a TP degree alone or key=value items (e.g. "
                 "vllm:tp=4,ep=2), got '=2'")),
    ("vllm:tp=", ("'vllm:tp=': after ':' a TP degree alone or key=value items (e.g. "
                  "vllm:tp=4,ep=2), got 'tp='")),
    ("megatron:tp=2,,ep=2", ("'megatron:tp=2,,ep=2': after ':' a TP degree alone or key=value "
                             "items (e.g. megatron:tp=4,ep=2), got ''")),
    ("vllm:tp=2,tp=4", "'vllm:tp=2,tp=4': tp given twice"),
    # the stage keys are megatron's only
    ("vllm:pp=2", ("'vllm:pp=2': vllm has no option 'pp'; known: tp, ep, etp, placement, "
                   "kernel, fp8")),
    ("megatron:foo=1", ("'megatron:foo=1': megatron has no option 'foo'; known: tp, ep, etp, pp, "
                        "vpp, pp_first, pp_last, experts, vocab, pp_account")),
    ("hf:experts=grouped", ("'hf:experts=grouped': hf option experts='grouped'; known: "
                            "per_expert, fused")),
    ("megatron:pp=x", "'megatron:pp=x': pp must be a positive integer, got 'x'"),
    ("megatron:etp=0", "'megatron:etp=0': etp must be a positive integer, got '0'"),
    ("megatron:pp_last=0", "'megatron:pp_last=0': pp_last must be a positive integer, got '0'"),
    # an item splits at its first '=': the rest is the value
    ("hf:experts=fused=x", ("'hf:experts=fused=x': hf option experts='fused=x'; known: "
                            "per_expert, fused")),
    ("megatron:tp=2=3", "'megatron:tp=2=3': tp must be a positive integer, got '2=3'"),
])
def test_an_endpoint_that_does_not_parse_says_exactly_why(text, message):
    with pytest.raises(UnknownConvention) as info:
        endpoint(text)
    assert str(info.value) == message


def test_unstaged_keeps_everything_but_the_stages_and_unquantized_everything_but_fp8():
    at = endpoint("megatron:tp=2,pp=2,vpp=2,ep=2,etp=1,experts=sequential,pp_account=both")
    assert at.staged and at.unstaged() == endpoint("megatron:tp=2,ep=2,etp=1,experts=sequential")
    assert not at.unstaged().staged
    fp8 = endpoint("vllm:tp=2,ep=2,fp8=block128,kernel=flashinfer_cutlass")
    assert fp8.quantized and not fp8.unquantized().quantized
    assert fp8.unquantized() == endpoint("vllm:tp=2,ep=2,kernel=flashinfer_cutlass")


def test_an_option_not_given_is_the_conventions_default_its_first_value():
    assert endpoint("megatron:2").option("experts") == "grouped"
    assert endpoint("megatron:2").option("vocab") == "padded"
    assert endpoint("megatron:tp=2,vocab=unpadded").option("vocab") == "unpadded"
    assert endpoint("vllm:2").option("placement") == "linear"


def test_an_endpoint_and_its_convention_answer_the_same_pieces_names_and_shapes():
    at = endpoint("megatron:tp=2,pp=2")
    conv = at.convention
    assert conv.at(at) is at and conv.at(2) == endpoint("megatron:2")
    assert at.pieces(G) is conv.pieces(G, at)
    params = init_params(G, 0)
    shards = materialize(at.pieces(G), params)
    assert conv.local_shapes(G, at) == [{n: tuple(x.shape) for n, x in s.items()}
                                        for s in shards]
    # every rank's names once, in forward order: stage 0's ranks then stage 1's
    names = conv.names(G, at)
    assert names == list(dict.fromkeys(n for s in shards for n in s))
    assert names[0] == "embedding.word_embeddings.weight" and names[-1] == "output_layer.weight"
    assert conv.names(G, 2) == conv.names(G, at.unstaged())


def test_a_staged_forward_layout_is_its_unstaged_ones_and_the_rules_come_first():
    conv = CONVENTIONS["megatron"]
    at = endpoint("megatron:tp=2,pp=2")
    assert conv.forward_layout(G, at) == conv.forward_layout(G, at.unstaged())
    assert conv.forward_layout(G, at).tp == 2
    # 2 layers over 3 stages: the stage rule's refusal, before any layout is read
    with pytest.raises(UnsupportedConvention, match="pp=3"):
        conv.forward_layout(G, endpoint("megatron:tp=2,pp=3"))
    # hf at t=2: the rule names the stored parameter
    with pytest.raises(UnsupportedConvention, match=r"^hf: model.embed_tokens.weight needs t == 1"):
        CONVENTIONS["hf"].forward_layout(G, 2)


def _every_degree(config, at):
    return [{} for _ in range(at.degree)]


def _no_forward(config, at):
    raise AssertionError("not read")


ANY = Convention("any", "stores nothing, at every degree", _every_degree, _no_forward)


def test_supported_degrees_probes_one_to_64_unless_told():
    assert ANY.supported_degrees(G) == list(range(1, 65))
    assert ANY.supported_degrees(G, 3) == [1, 2, 3]
    assert CONVENTIONS["hf"].supported_degrees(G, 4) == [1]
    assert CONVENTIONS["hf"].supports(G, 1) and not CONVENTIONS["hf"].supports(G, 2)
    assert str(ANY) == "any"


class _Counting:
    """A convention's build that refuses every degree but 1 and counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, config, at):
        self.calls += 1
        need(at.degree == 1, "counting", "w", at.degree, "t == 1", "")
        return [{}]


def test_a_refusal_is_built_once_then_remembered():
    build = _Counting()
    conv = Convention("counting", "refuses t > 1", build, _no_forward)
    for _ in range(3):
        with pytest.raises(UnsupportedConvention, match=r"^counting: w needs t == 1 \(t=2\)$"):
            conv.pieces(G, 2)
    assert build.calls == 1
    assert conv.supported_degrees(G, 4) == [1] and build.calls == 1 + 3  # t=1, 3, 4


def test_the_refusals_kept_are_bounded_and_the_least_recently_asked_goes_first(monkeypatch):
    C.clear_caches()
    build = _Counting()
    conv = Convention("counting", "refuses t > 1", build, _no_forward)
    kept = 6
    monkeypatch.setattr(C, "_REFUSALS_KEPT", kept)  # 8192 in use: the same rule, smaller
    try:
        for t in range(2, kept + 2):  # exactly as many refusals as are kept
            assert not conv.supports(G, t)
        assert len(C._refusals) == kept
        assert not conv.supports(G, 2)  # asked again: now the most recent
        assert not conv.supports(G, kept + 2)  # one more: the least recent (t=3) goes
        assert len(C._refusals) == kept
        keys = [at.degree for _, _, at in C._refusals]
        assert keys[0] == 4 and keys[-2:] == [2, kept + 2]
        calls = build.calls
        assert not conv.supports(G, 2) and build.calls == calls  # still remembered
        assert not conv.supports(G, 3) and build.calls == calls + 1  # forgotten: built again
    finally:
        C.clear_caches()


def test_need_says_the_rule_with_its_numbers_and_t():
    with pytest.raises(UnsupportedConvention) as info:
        need(False, "c", "w", 4, "x % t == 0", "x=6")
    assert str(info.value) == "c: w needs x % t == 0 (x=6, t=4)"
    with pytest.raises(UnsupportedConvention) as info:
        need(False, "c", "w", 4, "t == 1", "")
    assert str(info.value) == "c: w needs t == 1 (t=4)"
    need(True, "c", "w", 4, "never said", "")


def test_need_unpadded_refuses_a_canonical_vocabulary_with_padding_of_its_own():
    with pytest.raises(UnsupportedConvention) as info:
        C.need_unpadded("c", "emb", G.replace(vocab_multiple=8), 2)
    assert str(info.value) == ("c: emb needs an unpadded canonical vocabulary (vocab_multiple "
                               "== 1: the convention pads by its own rule) (vocab_multiple=8, "
                               "t=2)")
    C.need_unpadded("c", "emb", G, 2)


def test_relaid_replaces_only_the_named_placements_and_keeps_names_shapes_and_order():
    layout = layout_for(G)
    out = relaid(layout, {"tok_embeddings.weight": Shard(1), "norm.weight": Replicate()})
    assert [s.name for s in out] == [s.name for s in layout]
    assert [s.shape for s in out] == [s.shape for s in layout]
    for s, o in zip(layout, out):
        assert o.placement == {"tok_embeddings.weight": Shard(1)}.get(s.name, s.placement)


def test_replicated_wraps_the_dense_placements_and_keeps_the_experts():
    layout = layout_for(MOE)
    out = replicated(layout, 2)
    assert [(s.name, s.shape) for s in out] == [(s.name, s.shape) for s in layout]
    experts = [s.name for s in layout if isinstance(s.placement, Experts)]
    assert experts
    for s, o in zip(layout, out):
        assert o.placement == (s.placement if s.name in experts
                               else DataParallel(s.placement, 2))


def test_renamed_stores_each_parameter_under_its_template_moe_layers_first_and_cuts_as_cut():
    layout = layout_for(MOE)
    names = {n: "x." + n for n in (
        "tok_embeddings.weight", "norm.weight", "lm_head.weight",
        "layers.{i}.attn_norm.weight", "layers.{i}.o_proj.weight", "layers.{i}.ffn_norm.weight",
        "layers.{i}.gate_up.weight", "layers.{i}.down.weight", "layers.{i}.router.weight",
        "layers.{i}.experts.gate_up.weight", "layers.{i}.experts.down.weight",
        "layers.{i}.shared.gate_up.weight", "layers.{i}.shared.down.weight")}
    names["moe:layers.{i}.ffn_norm.weight"] = "moe.{i}.ffn_norm"  # the MoE layer's own name
    cols = MOE.param_shapes()["layers.0.o_proj.weight"][1]
    cuts = {"layers.{i}.qkv.weight": [("x.{i}.q", lambda r: rows(r * 16, r * 16 + 16)),
                                      ("x.{i}.kv", lambda r: (0, rows(32 + r * 8, 40 + r * 8)))],
            "moe:layers.{i}.o_proj.weight": [("moe.{i}.o", lambda r: (1, rows(0, cols)))]}
    assert MOE.is_moe_layer(1) and not MOE.is_moe_layer(0)
    pieces = renamed(MOE, 2, layout, names, cuts)
    assert len(pieces) == 2
    r1 = pieces[1]
    assert r1["x.tok_embeddings.weight"].source == "tok_embeddings.weight"
    assert r1["x.layers.0.ffn_norm.weight"].source == "layers.0.ffn_norm.weight"  # dense layer
    assert "x.layers.1.ffn_norm.weight" not in r1
    assert r1["moe.1.ffn_norm"].source == "layers.1.ffn_norm.weight"
    assert torch.equal(r1["x.1.q"].idx, rows(16, 32)) and r1["x.1.q"].dim == 0
    assert r1["x.0.kv"].source == "layers.0.qkv.weight" and torch.equal(r1["x.0.kv"].idx,
                                                                        rows(40, 48))
    assert r1["moe.1.o"].dim == 1 and r1["moe.1.o"].source == "layers.1.o_proj.weight"
    assert "x.layers.0.o_proj.weight" in r1 and "x.layers.1.o_proj.weight" not in r1
    assert list(r1)[-1] == "x.lm_head.weight"  # every parameter after a cut one still stored
    spec = layout["layers.0.o_proj.weight"]
    dim, ranges = spec.ranges(2, 1)
    assert r1["x.layers.0.o_proj.weight"].dim == dim
    assert torch.equal(r1["x.layers.0.o_proj.weight"].idx, rows(*ranges[0]))


def test_renamed_marks_the_rows_past_the_canonical_ones_as_padding():
    padded = layout_for(G.replace(vocab_multiple=48))  # 64 -> 96 rows, 48 a rank
    names = {n: n for n in G.param_shapes() if not n.startswith("layers.")}
    names.update({".".join(["layers", "{i}", *n.split(".")[2:]]): "L" + n.split(".", 2)[2]
                  for n in G.param_shapes() if n.startswith("layers.")})
    pieces = renamed(G, 2, padded, names)
    assert pieces[0]["tok_embeddings.weight"].idx.tolist() == list(range(48))
    assert pieces[1]["tok_embeddings.weight"].idx.tolist() == list(range(48, 64)) + [-1] * 32
    shards = materialize(pieces, init_params(G, 0))
    assert not shards[1]["lm_head.weight"][16:].any()


def test_a_forward_layout_reads_its_embedding_and_experts_placements():
    fw = CONVENTIONS["megatron"].forward_layout(MOE, endpoint("megatron:tp=2,ep=4"))
    assert fw.tp == 2 and fw.embedding == Shard(0)  # the DataParallel replica's inner one
    assert isinstance(fw.experts, Experts)
    assert ForwardLayout(G, layout_for(G)).experts is None
    assert CONVENTIONS["meta"].forward_layout(G, 2).embedding == Shard(1)


def test_shards_for_an_endpoint_text_and_a_degree_agree():
    a = shards_for(G, "megatron:2")
    b = shards_for(G, "megatron", 2)
    assert all(list(x) == list(y) and all(torch.equal(x[n], y[n]) for n in x)
               for x, y in zip(a, b))
    assert Endpoint(CONVENTIONS["megatron"], 2) == endpoint("megatron:2")
