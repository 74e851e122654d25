"""MoE endpoints from the command line: ``wsb check --converter`` between Megatron TP x EP
and vLLM, ``wsb emit`` / ``wsb verify`` of MoE checkpoints (HF per-expert and fused, per-rank
safetensors with EP), and ``wsb layout --convention`` naming each rank's experts, under the
exit-code contract (0 pass, 1 a counterexample, 2 bad input, 4 the user's code)."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.breadth import breadth
from weight_sync_bench.cli.main import main

MODULE = "wsb_moe_converters"
W13 = "model.layers.{i}.mlp.experts.routed_experts.w13_weight"


@pytest.fixture
def converters(tmp_path, monkeypatch):
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent("""
        import torch
        from weight_sync_bench import convert

        def megatron_to_vllm(shards, degree, *, config):
            return convert(shards, "megatron:tp=2,ep=4", f"vllm:tp={degree},ep={degree}",
                           config)

        def local_ids(shards, degree, *, config):  # the twin: slime PR #1799's local ids
            out = megatron_to_vllm(shards, degree, config=config)
            name = "model.layers.2.mlp.experts.routed_experts.w13_weight"
            out[1][name] = out[0][name].clone()  # EP rank 1 loads experts 0-1, not 2-3
            return out
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return MODULE


def test_an_moe_converter_from_the_command_line_passes_and_its_twin_fails_naming_experts(
        converters, capsys):
    argv = ["check", "--config", "toy_moe", "--from", "megatron:tp=2,ep=4", "--to",
            "vllm:tp=4,ep=4"]
    assert main([*argv, "--converter", f"{converters}:megatron_to_vllm"]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.startswith("toy_moe "))
    assert row[1:4] == ["megatron:tp=2,ep=4", "->", "vllm:tp=4,ep=4"]
    assert row[-2:] == ["0/128", "PASS"]  # no near-tied choice at this seed; passed
    assert "near ties: the (layer, token) expert choices" in out
    assert main([*argv, "--converter", f"{converters}:local_ids", "--json"]) == 1
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    record = records[0]
    assert record["passed"] is False and record["first_mismatch"] == W13.format(i=2)
    assert "rank 1" in record["diagnosis"][0] and "experts 0-1" in record["diagnosis"][0]
    assert record["near_ties"] == [0, 128] and record["route_bound"] == 0.001
    assert records[-1]["exit_code"] == 1


def test_an_endpoint_a_framework_cannot_hold_is_bad_input_naming_the_rule(converters, capsys):
    argv = ["check", "--config", "toy_moe", "--converter", f"{converters}:megatron_to_vllm",
            "--from", "megatron:tp=2,ep=3", "--to", "vllm:4"]
    assert main(argv) == 2
    assert "n_experts % ep" in capsys.readouterr().err


# Megatron's TP x EP x ETP by default, the endpoint with the most to cut; the others in the
# long run. By default each MoE convention's files round-trip through the API
# (tests/conventions/test_moe_conventions.py's test_moe_checkpoints_round_trip_through_their
# _files), and vLLM's are emitted and verified here too by
# test_a_verified_moe_file_with_one_expert_s_halves_swapped_fails_naming_it
@pytest.mark.parametrize("where", breadth(["hf", "hf:experts=fused", "megatron:tp=2,ep=2,etp=1",
                                           "vllm:tp=2,ep=2"], keep={"megatron:tp=2,ep=2,etp=1"}))
def test_emit_then_verify_round_trips_an_moe_checkpoint(tmp_path, where, capsys):
    directory = tmp_path / "ckpt"
    assert main(["emit", "--convention", where, "--config", "toy_moe", "-q",
                 str(directory)]) == 0
    assert main(["verify", "--convention", where, "--config", "toy_moe", str(directory)]) == 0
    assert "1 passed, 0 failed" in capsys.readouterr().out


def test_a_verified_moe_file_with_one_expert_s_halves_swapped_fails_naming_it(tmp_path, capsys):
    directory = tmp_path / "vllm"
    assert main(["emit", "--convention", "vllm:tp=2,ep=2", "--config", "toy_moe", "-q",
                 str(directory)]) == 0
    capsys.readouterr()
    r1 = directory / "model-rank-1-part-0.safetensors"
    params = load_file(str(r1))
    w = params[W13.format(i=0)]  # rank 1: experts 4-7, [gate | up] of 128 rows each
    w[1] = torch.cat([w[1][128:], w[1][:128]])  # expert 5: up before gate (vLLM #42821)
    save_file(params, str(r1))
    assert main(["verify", "--convention", "vllm:tp=2,ep=2", "--config", "toy_moe",
                 str(directory)]) == 1
    out = capsys.readouterr().out
    assert f"first parameter that differs from the declared layout: {W13.format(i=0)}" in out
    assert "expert 5 up rows 0-127, gate rows 0-127" in out


def test_layout_names_each_rank_s_experts_and_rows(capsys):
    """vLLM's round-robin expert map (DeepSeek-V3's grouped top-k: vLLM falls back to linear
    without groups, and the endpoint is refused naming that rule)."""
    assert main(["layout", "--config", "toy_moe_ds", "--convention",
                 "vllm:tp=4,ep=4,placement=round_robin"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.1.mlp.experts.routed_experts.w13_weight" in out
    table = out[out.index("rank  tp"):].splitlines()
    assert table[1].split(None, 6)[6] == "0, 4, 8, 12   gate 0-63, up 0-63"
    assert table[4].split(None, 6)[6] == "3, 7, 11, 15  gate 0-63, up 0-63"
    assert main(["layout", "--config", "toy_moe", "--convention",
                 "vllm:tp=4,ep=4,placement=round_robin"]) == 2
    assert "grouped top-k (n_groups > 1)" in capsys.readouterr().err


def test_every_command_taking_hf_config_takes_a_shipped_name(tmp_path):
    """``--hf-config qwen3_30b_a3b`` names the shipped file for ``wsb check`` and ``wsb floor``
    alike (``model.config.hf_config_file``); a path that exists is read as given."""
    import argparse

    from weight_sync_bench.cli.checkpoint import model_of
    from weight_sync_bench.cli.floor_measure import geometry_config
    from weight_sync_bench.model.config import hf_config_file, hf_config_path

    assert hf_config_file("qwen3_30b_a3b") == hf_config_path("qwen3_30b_a3b")
    own = tmp_path / "qwen3_30b_a3b"
    own.write_text("{}")
    assert hf_config_file(own) == own  # a file of that name where it is given wins
    common = dict(hf_config="qwen3_30b_a3b", layers=1, vocab=None)
    floor = geometry_config(argparse.Namespace(config=None, batch=None, seq_len=None, **common))
    check = model_of(argparse.Namespace(config=None, config_default="toy", **common))
    assert floor == check and floor.n_experts == 128 and floor.n_layers == 1
