"""``conventions.table`` (issue 30, the mutation pass over ``conventions/table.py``): ``wsb
layout --convention NAME``'s table (each stored name, its canonical source, its shape and the
placement its forward reads, per degree or endpoint, with a legend) and ``--ranks``' table
(each rank's coordinates and experts).

People read these tables to write converters. A shape taken from the wrong rank, a placement
from the wrong degree, a legend dropped or a rank's experts misnamed would send them the wrong
way. Each table here is pinned cell by cell, and so is its alignment."""

from __future__ import annotations

import re

import pytest

from weight_sync_bench.conventions import CONVENTIONS, endpoint
from weight_sync_bench.conventions.table import render, render_ranks
from weight_sync_bench.errors import UnsupportedConvention, UnsupportedLayout
from weight_sync_bench.model.config import ModelConfig

C = ModelConfig(name="t", vocab=64, d_model=16, n_layers=1, n_heads=4, n_kv_heads=2,
                head_dim=4, ffn=16, batch=1, seq_len=4)
MOE = C.replace(name="moe", n_layers=2, n_experts=4, top_k=2, expert_ffn=8)
HR = "HR(4,2,4): Q heads split; rank r holds replicated KV head r*2/t"


def cells(text: str) -> list[list[str]]:
    """The table's rows as cells (columns are two or more spaces apart)."""
    return [re.split(r" {2,}", line) for line in text.splitlines()]


def aligned(lines: list[str]) -> bool:
    """Every column of the rows starts at the same offset, and no row ends in a space."""
    starts = [[m.start() for m in re.finditer(r"(?:^|(?<=  ))\S", line)] for line in lines]
    width = max(len(s) for s in starts)
    full = [s for s in starts if len(s) == width]
    return all(s == full[0] for s in full) and all(line == line.rstrip() for line in lines)


def test_vllms_table_has_a_column_per_degree_a_dash_where_refused_and_the_legend():
    text = render(C, CONVENTIONS["vllm"], [1, 2, 3, 4])
    assert cells(text) == [
        ["stored name", "source", "t=1", "t=2", "t=3", "t=4"],
        ["model.embed_tokens.weight", "tok_embeddings.weight", "[64, 16] S(0)",
         "[32, 16] S(0)", "-", "[16, 16] S(0)"],
        ["model.layers.0.input_layernorm.weight", "layers.0.attn_norm.weight", "[16] R",
         "[16] R", "-", "[16] R"],
        ["model.layers.0.self_attn.qkv_proj.weight", "layers.0.qkv.weight",
         "[32, 16] HP(4,2,4)", "[16, 16] HP(4,2,4)", "-", "[12, 16] HR(4,2,4)"],
        ["model.layers.0.self_attn.o_proj.weight", "layers.0.o_proj.weight", "[16, 16] S(1)",
         "[16, 8] S(1)", "-", "[16, 4] S(1)"],
        ["model.layers.0.post_attention_layernorm.weight", "layers.0.ffn_norm.weight",
         "[16] R", "[16] R", "-", "[16] R"],
        ["model.layers.0.mlp.gate_up_proj.weight", "layers.0.gate_up.weight",
         "[32, 16] FP(16,16)", "[16, 16] FP(16,16)", "-", "[8, 16] FP(16,16)"],
        ["model.layers.0.mlp.down_proj.weight", "layers.0.down.weight", "[16, 16] S(1)",
         "[16, 8] S(1)", "-", "[16, 4] S(1)"],
        ["model.norm.weight", "norm.weight", "[16] R", "[16] R", "-", "[16] R"],
        ["lm_head.weight", "lm_head.weight", "[64, 16] S(0)", "[32, 16] S(0)", "-",
         "[16, 16] S(0)"],
        [HR]]
    assert aligned(text.splitlines()[:-1])


def test_an_endpoints_column_is_named_by_it_and_megatrons_gathered_rows_are_explained():
    text = render(C, CONVENTIONS["megatron"], [endpoint("megatron:4")])
    rows = cells(text)
    assert rows[0] == ["stored name", "source", "megatron:4"]
    assert rows[1] == ["embedding.word_embeddings.weight", "tok_embeddings.weight",
                       "[128, 16] S(0)"]
    assert rows[3] == ["decoder.layers.0.self_attention.linear_qkv.weight",
                       "layers.0.qkv.weight", "[8, 16] HR(4,2,4)"]
    assert rows[-2:] == [[HR], [
        "gathered: the forward all-gathers these stored rows (raw row slices of the grouped "
        "linear_qkv) over TP, then reads them as the placement says"]]
    assert len(rows) == 1 + 9 + 2 and aligned(text.splitlines()[:-2])


def test_the_default_columns_are_the_degrees_the_convention_stores():
    text = render(C, CONVENTIONS["plain"])
    assert cells(text)[0] == ["stored name", "source", "t=1", "t=2"]
    assert cells(text)[3] == ["layers.0.qkv.weight", "layers.0.qkv.weight",
                              "[32, 16] HP(4,2,4)", "[16, 16] HP(4,2,4)"]
    assert "HR(" not in text and "gathered" not in text  # no legend without its placement


def test_a_geometry_stored_at_none_of_the_degrees_is_refused():
    with pytest.raises(UnsupportedLayout) as exc:
        render(C, CONVENTIONS["hf"], [2, 4])
    assert str(exc.value) == "hf: t is stored at none of the degrees ['2', '4']"
    with pytest.raises(UnsupportedConvention) as exc:  # one degree: the convention's own rule
        render(C, CONVENTIONS["hf"], [2])
    assert str(exc.value) == ("hf: model.embed_tokens.weight needs t == 1 (a Hugging Face "
                              "checkpoint is unsharded) (t=2)")
    assert cells(render(C, CONVENTIONS["hf"], [1, 2]))[0][2:] == ["t=1", "t=2"]


def test_an_moe_endpoints_ranks_name_their_experts_and_rows():
    text = render_ranks(MOE, endpoint("megatron:tp=2,ep=2"))
    assert cells(text) == [
        ["rank", "tp", "dp", "ep", "etp", "edp", "experts", "rows of each expert"],
        ["0", "0", "0", "0", "0", "0", "0-1", "gate 0-3, up 0-3"],
        ["1", "1", "0", "0", "1", "0", "0-1", "gate 4-7, up 4-7"],
        ["2", "0", "1", "1", "0", "0", "2-3", "gate 0-3, up 0-3"],
        ["3", "1", "1", "1", "1", "0", "2-3", "gate 4-7, up 4-7"]]
    assert aligned(text.splitlines())
    whole = cells(render_ranks(MOE, endpoint("vllm:tp=2,ep=2")))
    assert whole[1:] == [["0", "0", "0", "0", "0", "0", "0-1", "gate 0-7, up 0-7"],
                         ["1", "1", "0", "1", "0", "0", "2-3", "gate 0-7, up 0-7"]]


def test_a_staged_endpoints_ranks_name_their_stage_and_chunks():
    text = render_ranks(C.replace(n_layers=4), endpoint("megatron:tp=1,pp=2,vpp=2"))
    assert cells(text) == [
        ["rank", "pp", "layers (per chunk)", "tp", "dp", "ep", "etp", "edp", "experts",
         "rows of each expert"],
        ["0", "0", "0 | 2", "0", "0", "-", "-", "-", "-", "-"],
        ["1", "1", "1 | 3", "0", "0", "-", "-", "-", "-", "-"]]
    staged_moe = cells(render_ranks(MOE, endpoint("megatron:tp=2,ep=2,pp=2")))
    assert staged_moe[0][:3] == ["rank", "pp", "layers (per chunk)"]
    assert [r[1:3] for r in staged_moe[1:]] == [["0", "0"]] * 4 + [["1", "1"]] * 4
    assert [r[-2:] for r in staged_moe[1:5]] == [
        ["0-1", "gate 0-3, up 0-3"], ["0-1", "gate 4-7, up 4-7"],
        ["2-3", "gate 0-3, up 0-3"], ["2-3", "gate 4-7, up 4-7"]]


def test_a_dense_endpoints_ranks_have_no_experts():
    assert cells(render_ranks(C, endpoint("vllm:2"))) == [
        ["rank", "tp", "dp", "ep", "etp", "edp", "experts", "rows of each expert"],
        ["0", "0", "0", "-", "-", "-", "-", "-"],
        ["1", "1", "0", "-", "-", "-", "-", "-"]]


def test_the_default_columns_stop_at_eight_ranks():
    nine = C.replace(name="nine", n_heads=9, n_kv_heads=9, head_dim=2, d_model=18, ffn=18,
                     vocab=72)  # stored at t = 9 too, past the table's eight
    assert cells(render(nine, CONVENTIONS["plain"]))[0] == ["stored name", "source", "t=1",
                                                            "t=3"]


def test_experts_whose_tp_is_the_rest_of_the_degree_are_cut_by_the_endpoints_world():
    assert cells(render_ranks(MOE, endpoint("plain:tp=2,ep=2")))[1:] == [
        ["0", "0", "0", "0", "0", "0", "0-1", "gate 0-7, up 0-7"],
        ["1", "1", "0", "1", "0", "0", "2-3", "gate 0-7, up 0-7"]]


def test_a_stage_of_no_layers_says_none():
    assert cells(render_ranks(C, endpoint("megatron:tp=1,pp=2,pp_account=embedding")))[1:] == [
        ["0", "0", "none", "0", "0", "-", "-", "-", "-", "-"],
        ["1", "1", "0", "0", "0", "-", "-", "-", "-", "-"]]
