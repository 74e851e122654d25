"""``wsb check`` at real widths: ``--dtype``, ``--stream``, ``--measure-floor`` and the
progress line. Every threshold of an ``--hf-config`` geometry comes from one place
(``floor_for``: the per-geometry floor cached under ``WSB_TOLERANCE_DIR``, a copy under
``tmp_path`` here, never the checkout), whichever check reads it: a split, a reshard, the
invariant or a conversion. The geometry is a small one so that measuring its floor is fast;
``bench/bench_full_width.py`` runs the shipped ones at full width."""

from __future__ import annotations

import importlib
import json
import sys
import textwrap

import pytest

from weight_sync_bench.check import threshold as threshold_module
from weight_sync_bench.cli.main import main

main_module = importlib.import_module("weight_sync_bench.cli.main")
MODULE = "wsb_real_width_fns"


@pytest.fixture
def model(tmp_path, monkeypatch):
    """A small Llama config.json (head_dim 8 given, 8 heads, 2 KV heads), and a user's module
    of functions for it: each works on the whole model or on one stage (a streamed check)."""
    data = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
            "num_hidden_layers": 32, "vocab_size": 32000, "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5}
    path = tmp_path / "small" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data))
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent(f"""
        from weight_sync_bench import ModelConfig, layout_for
        from weight_sync_bench.check.convert import stage_convert
        from weight_sync_bench.check.stream import stage_reshard, stage_split
        SMALL = ModelConfig.from_hf_config({str(path)!r}, n_layers=1, vocab=256)
        QKV, QKV_PROJ = "layers.0.qkv.weight", "model.layers.0.self_attn.qkv_proj.weight"

        def split(full, degree):
            return stage_split(layout_for(SMALL))(full, degree)

        def swapped(full, degree):  # the twin: ranks 0 and 1 exchange their qkv rows
            out = split(full, degree)
            if QKV in out[0]:
                out[0][QKV], out[1][QKV] = out[1][QKV], out[0][QKV]
            return out

        def upcast(full, degree):  # the twin of a bf16 sync: one shard handed back in fp32
            out = split(full, degree)
            if QKV in out[0]:
                out[1][QKV] = out[1][QKV].float()
            return out

        def reshard(shards, dst):
            return stage_reshard(layout_for(SMALL))(shards, dst)

        def hf_to_vllm(shards, degree):
            return stage_convert("hf", f"vllm:{{degree}}", SMALL)(shards, degree)

        def wrong(shards, degree):  # the twin: rank 0's KV replica left at rank 1's
            out = hf_to_vllm(shards, degree)
            if QKV_PROJ in out[0]:
                out[0][QKV_PROJ], out[1][QKV_PROJ] = out[1][QKV_PROJ], out[0][QKV_PROJ]
            return out

        def crashes(*args, **kwargs):  # written for another geometry, as found at its first call
            raise ValueError("shape mismatch: built for 4096 rows")
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return ["--hf-config", str(path), "--layers", "1", "--vocab", "256"]


def no_measuring(monkeypatch):
    """From here on, measuring a floor is a failure: a cached one must be read."""
    def refuse(*args, **kwargs):
        raise AssertionError("measured a floor that is cached")
    monkeypatch.setattr(main_module, "measure_geometry", refuse)
    monkeypatch.setattr(threshold_module, "measure_geometry", refuse)


def test_an_unmeasured_geometry_is_refused_naming_the_command_then_measured_once(
        model, tolerance, monkeypatch, capsys):
    split = ["check", *model, "--dst", "2", "--splitter"]
    assert main([*split, f"{MODULE}:split"]) == 2  # every kind of check: the same refusal
    err = capsys.readouterr().err
    command = (f"python -m weight_sync_bench.tolerance geometry --hf-config {model[1]} "
               "--layers 1 --vocab 256")
    assert f"`{command}`" in err and "--measure-floor" in err
    for argv in (["check", *model, "--src", "2", "--dst", "1", "--resharder", f"{MODULE}:reshard"],
                 ["check", *model, "--src", "1", "--dst", "2"],
                 ["check", *model, "--from", "hf", "--to", "vllm:4", "--converter",
                  f"{MODULE}:hf_to_vllm"],
                 ["check", *model, "--dtype", "bf16", "--dst", "2", "--splitter",
                  f"{MODULE}:split"]):
        assert main(argv) == 2
        assert "no measured floor covers this check" in capsys.readouterr().err
    assert not (tolerance / "geometry").exists()

    assert main([*split, f"{MODULE}:split", "--measure-floor", "--json"]) == 0
    (cached,) = (tolerance / "geometry").glob("small-1a-fp32-*.json")
    artifact = json.loads(cached.read_text())
    assert artifact["kind"] == "geometry" and artifact["record"]["geometry"]["d_model"] == 64
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert records[0]["threshold"] == artifact["threshold"]

    no_measuring(monkeypatch)  # the second run of each check reads the cache
    for argv, code in ((["check", *model, "--src", "2", "--dst", "1", "--resharder",
                         f"{MODULE}:reshard", "--json"], 0),
                       (["check", *model, "--src", "1", "--dst", "2", "--json"], 0),
                       (["check", *model, "--from", "hf", "--to", "vllm:4", "--converter",
                         f"{MODULE}:hf_to_vllm", "--json"], 0),
                       ([*split, f"{MODULE}:swapped", "--json"], 1)):  # the twin fails
        assert main(argv) == code
        records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert records[0]["threshold"] == artifact["threshold"]
    assert list((tolerance / "geometry").iterdir()) == [cached]


@pytest.mark.parametrize("argv", [
    ["--dst", "2", "--splitter"],
    ["--src", "2", "--dst", "1", "--resharder"],
    ["--src", "2", "--dst", "1", "--backend", "gloo", "--resharder"],  # phase 1b's floor
    ["--from", "hf", "--to", "vllm:4", "--converter"],
    ["--from", "hf", "--to", "vllm:4", "--stream", "layer", "--converter"],
], ids=lambda argv: " ".join(argv[:-1]))
def test_a_function_that_crashes_does_so_before_its_geometrys_floor_is_measured(
        model, tolerance, monkeypatch, capsys, argv):
    no_measuring(monkeypatch)  # the floor is not measured before the function's first call
    assert main(["check", *model, "--measure-floor", *argv, f"{MODULE}:crashes"]) == 4
    err = capsys.readouterr().err
    assert f"`{MODULE}:crashes` raised ValueError while " in err
    assert "shape mismatch: built for 4096 rows" in err
    assert not (tolerance / "geometry").exists()
    # the twin: a function that works is called, then the floor is measured (here refused
    # by the stand-in: a bug of the harness, exit 3), so the order above is not vacuous
    working = {"--splitter": "split", "--resharder": "reshard", "--converter": "hf_to_vllm"}
    assert main(["check", *model, "--measure-floor", *argv,
                 f"{MODULE}:{working[argv[-1]]}"]) == 3
    assert "measured a floor that is cached" in capsys.readouterr().err


@pytest.mark.parametrize("stream", ["layer", "parameter"])
def test_streamed_checks_pass_the_correct_functions_and_fail_their_twins(
        model, tolerance, stream, capsys):
    common = ["check", *model, "--stream", stream, "--measure-floor"]
    assert main([*common, "--dst", "2", "--splitter", f"{MODULE}:split"]) == 0
    assert main([*common, "--dst", "2", "--splitter", f"{MODULE}:swapped"]) == 1
    out = capsys.readouterr().out
    assert "first parameter that differs from the declared layout: layers.0.qkv.weight" in out
    assert main([*common, "--src", "2", "--dst", "1", "--resharder", f"{MODULE}:reshard"]) == 0
    assert main([*common, "--src", "2", "--dst", "1"]) == 0  # the invariant, streamed
    convert = [*common, "--from", "hf", "--to", "vllm:4", "--converter"]
    assert main([*convert, f"{MODULE}:hf_to_vllm"]) == 0
    assert main([*convert, f"{MODULE}:wrong"]) == 1
    assert ("rank 0 model.layers.0.self_attn.qkv_proj.weight holds Q heads 2-3, K head 0, "
            "V head 0; declared Q heads 0-1, K head 0, V head 0") in capsys.readouterr().out


def test_bf16_weights_from_the_command_line_and_a_shard_handed_back_in_fp32(
        model, tolerance, capsys):
    common = ["check", *model, "--dtype", "bf16", "--measure-floor", "--stream", "layer"]
    assert main([*common, "--dst", "2", "--splitter", f"{MODULE}:split"]) == 0
    out = capsys.readouterr().out
    assert "1 passed, 0 failed" in out
    assert len(list((tolerance / "geometry").glob("small-1a-bf16-*.json"))) == 1
    assert main([*common, "--dst", "2", "--splitter", f"{MODULE}:upcast"]) == 4
    err = capsys.readouterr().err
    assert "layers.0.qkv.weight" in err and "rank 1" in err and "float32" in err
    convert = ["check", *model, "--dtype", "bf16", "--from", "hf", "--to", "vllm:4",
               "--converter"]
    assert main([*convert, f"{MODULE}:hf_to_vllm"]) == 0  # whole-model, the cached bf16 floor
    assert main([*convert, f"{MODULE}:wrong"]) == 1


def test_the_stage_progress_shows_on_a_terminal_only_and_streams_over_gloo_too(
        model, tolerance, monkeypatch, capsys):
    argv = ["check", *model, "--stream", "layer", "--measure-floor", "--dst", "2",
            "--splitter", f"{MODULE}:split"]
    assert main(argv) == 0
    assert "stage " not in capsys.readouterr().err  # piped: no stage lines
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "check 1/1: small split -> 2 (inprocess): stage 3/3 head" in err
    assert main([*argv, "--backend", "gloo"]) == 0  # the phase 1b floor measured and cached
    err = capsys.readouterr().err
    assert "check 1/1: small split -> 2 (gloo)" in err and "stage " not in err  # ranks' own
    assert main(["check", *model, "--stream", "layer", "--backend", "gloo", "--from", "hf",
                 "--to", "vllm:2", "--converter", f"{MODULE}:split"]) == 2
    assert "a streamed --converter check over --backend gloo is not built" in \
        capsys.readouterr().err


def test_a_users_measured_floor_goes_to_their_cache_never_the_checkout(model, tmp_path,
                                                                       monkeypatch, capsys):
    """No WSB_TOLERANCE_DIR, no WSB_FLOOR_CACHE: the committed floors are the checkout's, and
    a floor the user measures lands under $XDG_CACHE_HOME/weight-sync-bench/geometry/, read
    from there by the next check; the checkout's tolerance/ is left as it was."""
    from weight_sync_bench.paths import checkout

    monkeypatch.delenv("WSB_TOLERANCE_DIR", raising=False)
    monkeypatch.delenv("WSB_FLOOR_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    committed = checkout() / "tolerance"
    before = {p: p.stat().st_mtime_ns for p in committed.rglob("*")}
    argv = ["check", *model, "--src", "1", "--dst", "2"]
    assert main(argv) == 2  # unmeasured: refused, naming both places looked in
    err = capsys.readouterr().err
    assert str(committed / "geometry") in err and str(tmp_path / "xdg") in err
    assert main([*argv, "--measure-floor"]) == 0
    (cached,) = (tmp_path / "xdg" / "weight-sync-bench" / "geometry").glob("small-1a-*.json")
    no_measuring(monkeypatch)
    assert main([*argv, "--json"]) == 0  # the twin: read back from the user's cache
    assert {p: p.stat().st_mtime_ns for p in committed.rglob("*")} == before
    assert cached.is_file()
