"""``wsb emit`` and ``wsb verify`` (issue 30, the mutation pass over ``cli/checkpoint.py``),
and the model options every command that takes a geometry shares (``--config`` |
``--hf-config PATH --layers N [--vocab V]``).

The contract (``docs/reference/exit-codes.md``, ``cli/main.py``'s ``EXIT_CODES``): ``emit``
writes the seed's model as the convention stores it (``conventions.shards_for``; FP8 through
the reference quantizer) and lists each file with its size; ``verify`` judges a directory by
``check.convert.verify_checkpoint``'s verdict and exits 0 on a pass, 1 on a failure, 2 for
bad input (a geometry option refused, a geometry too large, a floor not measured). Without a
model option, the geometry is the one the directory's ``config.json`` (``params.json`` for
Meta) states, and it says so.

Here ``verify_checkpoint`` is stood in where the verdict, not the reading, is what is pinned:
the stand-in records what the command hands it (directory, geometry, the two conventions as
text, seed, backend, ``--measure-floor``, ``--allow-root``) and returns a prepared verdict,
so each test checks every line, record and exit code of one outcome. ``emit``'s shards are
compared with ``shards_for``'s byte for byte; the geometry options' refusals word for word.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import pytest
import torch

from weight_sync_bench.check.verdict import Verdict
from weight_sync_bench.cli.main import build_parser, main
from weight_sync_bench.cli.records import verdict_record
from weight_sync_bench.conventions import endpoint, shards_for
from weight_sync_bench.errors import FloorNotMeasured, GeometryTooLarge, WsbError
from weight_sync_bench.model.config import (
    HF_NAMES,
    TOY,
    TOY_KV4,
    ModelConfig,
    config_by_name,
    hf_config_file,
)
from weight_sync_bench.model.footprint import GIB, Limits

C = importlib.import_module("weight_sync_bench.cli.checkpoint")

PASS = Verdict(config="tiny", src=1, dst=1, max_abs_error=1e-7, threshold=1e-3,
               first_mismatch=None, conventions=("hf", "vllm"))
FAIL = Verdict(config="tiny", src=1, dst=2, max_abs_error=0.5, threshold=1e-3,
               first_mismatch="lm_head.weight", mismatches=("lm_head.weight",),
               conventions=("hf", "vllm"))


def spy(monkeypatch, name, result=None, *, through=True):
    """Stand in ``cli.checkpoint.<name>``: record each call; call the real one (``through``)
    or return ``result`` (raise it when it is an exception)."""
    real, calls = getattr(C, name), []

    def fake(*args, **kwargs):
        calls.append((args, kwargs))
        if through:
            return real(*args, **kwargs)
        if isinstance(result, BaseException):
            raise result
        return result

    monkeypatch.setattr(C, name, fake)
    return calls


def parse(*argv):
    return build_parser().parse_args(list(argv))


# ---- the model options ----------------------------------------------------------------------

def test_the_model_options_parse_to_their_types_defaults_and_choices():
    p = argparse.ArgumentParser(exit_on_error=False)
    C.add_model_options(p)
    a = p.parse_args([])
    assert (a.config, a.hf_config, a.layers, a.vocab, a.config_default) == (
        None, None, None, None, "toy")
    a = p.parse_args(["--hf-config", "x.json", "--layers", "3", "--vocab", "256"])
    assert (a.hf_config, a.layers, a.vocab) == ("x.json", 3, 256)
    config = next(x for x in p._actions if x.dest == "config")
    assert "all" not in config.choices and {"toy", "toy_kv4"} <= set(config.choices)
    assert next(x for x in p._actions if x.dest == "hf_config").metavar == "PATH"
    for flag in ("--layers", "--vocab"):  # count: an int >= 1
        with pytest.raises(argparse.ArgumentError, match="must be > 0, got 0"):
            p.parse_args([flag, "0"])
    with pytest.raises(argparse.ArgumentError, match="not allowed with argument"):
        p.parse_args(["--config", "toy", "--hf-config", "x.json"])
    q = argparse.ArgumentParser()
    C.add_model_options(q, default="all", allow_all=True)
    assert q.parse_args(["--config", "all"]).config == "all"
    assert q.parse_args([]).config_default == "all"
    assert "(default all)" in q.format_help()
    r = argparse.ArgumentParser()
    C.add_model_options(r, default=None, default_help="what DIR states")
    assert r.parse_args([]).config_default is None
    assert "(default what DIR states)" in r.format_help()


def test_hf_model_refuses_reductions_without_a_file_and_a_file_without_its_depth(tiny):
    assert C.hf_model(parse("emit", "--convention", "hf", "d")) is None
    for extra in (["--layers", "2"], ["--vocab", "64"], ["--layers", "2", "--vocab", "64"]):
        with pytest.raises(WsbError) as e:
            C.hf_model(parse("emit", "--convention", "hf", *extra, "d"))
        assert str(e.value) == ("--layers and --vocab reduce an --hf-config geometry; a "
                                "committed --config is checked as it is")
    bare = parse("emit", "--convention", "hf", "--hf-config", str(tiny), "d")
    with pytest.raises(WsbError) as e:
        C.hf_model(bare)
    assert str(e.value) == (f"--hf-config {tiny} needs --layers N: the file's full depth "
                            "would build every layer of the real model")
    whole = C.hf_model(bare, need_layers=False)  # the file's own depth and vocabulary
    assert (whole.n_layers, whole.vocab, whole.d_model) == (4, 512, 64)
    reduced = C.model_of(parse("emit", "--convention", "hf", "--hf-config", str(tiny),
                               "--layers", "2", "--vocab", "256", "d"))
    assert reduced == ModelConfig.from_hf_config(tiny, n_layers=2, vocab=256)
    assert (reduced.name, reduced.n_layers, reduced.vocab) == ("tiny_llama", 2, 256)
    with pytest.raises(WsbError, match="needs --layers N"):
        C.model_of(bare)
    assert C.model_of(bare, need_layers=False).n_layers == 4


def test_model_of_is_the_named_config_else_the_commands_default():
    assert C.model_of(parse("emit", "--convention", "hf", "--config", "toy_kv4", "d")) is TOY_KV4
    assert C.model_of(parse("emit", "--convention", "hf", "d")) is TOY  # emit's default
    assert C.model_of(parse("sync")) is config_by_name("toy_kv4")  # sync's


def test_weights_geometry_is_the_given_else_the_hf_directorys_and_a_megatron_one_is_refused(
        tmp_path, tiny):
    assert C.weights_geometry(tmp_path / "nowhere", TOY, "--config NAME") is TOY
    assert main(["emit", "--convention", "hf", "--hf-config", str(tiny), "--layers", "1",
                 "-q", str(tmp_path / "hf")]) == 0
    stated = C.weights_geometry(tmp_path / "hf", None, "--config NAME")
    assert stated == ModelConfig.from_hf_config(tiny, n_layers=1)
    assert stated.name == "tiny_llama"
    (tmp_path / "mg" / "mp_rank_00").mkdir(parents=True)  # a legacy Megatron checkpoint
    with pytest.raises(WsbError) as e:
        C.weights_geometry(tmp_path / "mg", None, "--config NAME or --hf-config PATH")
    assert str(e.value) == (
        f"{tmp_path / 'mg'}: a Megatron checkpoint's args state sizes, not the whole model "
        "(vocabulary, norms, rope): give --config NAME or --hf-config PATH (as "
        "Megatron-Bridge's export takes its Hugging Face config); the args are checked "
        "against it")


def test_guard_names_the_fields_as_the_user_wrote_them(monkeypatch, tiny):
    calls = spy(monkeypatch, "require_fits")
    args = parse("emit", "--convention", "hf", "--hf-config", str(tiny), "--layers", "1", "d")
    C.guard(args, TOY)
    (config, limits), kw = calls[-1]
    assert config is TOY and limits == Limits(max_flops=1e13)
    assert kw == {"unit": "model", "hint": "",
                  "names": {**HF_NAMES, "n_layers": "--layers", "vocab": "vocab_size"}}
    args = parse("emit", "--convention", "hf", "--hf-config", str(tiny), "--layers", "1",
                 "--vocab", "64", "--max-gib", "2", "d")
    C.guard(args, TOY, unit="layer", hint="or stream it")
    (config, limits), kw = calls[-1]
    assert limits == Limits(max_bytes=2 * GIB, max_flops=1e13)
    assert kw == {"unit": "layer", "hint": "or stream it",
                  "names": {**HF_NAMES, "n_layers": "--layers", "vocab": "--vocab"}}
    # the file's own depth (no --layers): named as config.json names it
    ns = argparse.Namespace(hf_config="x", layers=None, vocab=None, max_gib=None,
                            max_gflop=1e4, batch=4, seq_len=0)
    C.guard(ns, TOY)
    assert calls[-1][1]["names"] == {**HF_NAMES, "batch": "--batch"}
    ns = argparse.Namespace(max_gib=None, max_gflop=1e4, seq_len=64)
    C.guard(ns, TOY)
    assert calls[-1][1]["names"] == {"seq_len": "--seq-len"}
    assert calls[-1][0][1] == Limits(max_flops=1e13)


def test_a_geometry_over_the_budget_is_refused_in_the_files_words(write_config, capsys):
    wide = write_config("wide", vocab_size=4_000_000)  # past every shipped config's
    model = ["--hf-config", str(wide), "--layers", "1"]
    assert main(["verify", "--convention", "hf", *model, "--max-gib", "0.01", "d"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("wsb verify: wide: field 'vocab_size' (vocab) is 4000000: checking "
                          "this geometry would need about 10 GiB (limit 0.01 GiB; "), err
    assert main(["emit", "--convention", "hf", *model, "--vocab", "3000000", "--max-gib",
                 "0.01", "d"]) == 2
    assert "wide: field '--vocab' (vocab) is 3000000: " in capsys.readouterr().err
    with pytest.raises(GeometryTooLarge):
        C.guard(parse("emit", "--convention", "hf", "--max-gflop", "0.001", "d"), TOY)


def test_the_floor_command_names_the_file_and_each_option_the_user_gave(tiny):
    def ns(**kw):
        return argparse.Namespace(**{"hf_config": str(tiny), "vocab": None, "backend":
                                     "inprocess", "dtype": "fp32", **kw})
    config = ModelConfig.from_hf_config(tiny, n_layers=3)
    base = f"python -m weight_sync_bench.tolerance geometry --hf-config {tiny} --layers 3"
    assert C.floor_command(ns(), config) == base
    assert C.floor_command(ns(vocab=256, backend="gloo", dtype="bf16"), config) == (
        base + " --vocab 256 --phase 1b --dtype bf16")
    assert C.floor_command(ns(dtype="bf16"), config) == base + " --dtype bf16"
    assert C.floor_command(ns(backend="gloo"), config) == base + " --phase 1b"
    shipped = C.floor_command(ns(hf_config="llama3_8b"), config)  # a shipped one, by name
    assert shipped == (f"python -m weight_sync_bench.tolerance geometry --hf-config "
                       f"{hf_config_file('llama3_8b')} --layers 3")
    assert shipped.split()[5].endswith(".json")
    assert C.phase_of(ns(backend="gloo")) == "1b"
    assert C.phase_of(ns(backend="inprocess")) == "1a"


# ---- wsb emit ---------------------------------------------------------------------------

def same_shards(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert sorted(g) == sorted(w)
        for name in w:
            assert g[name].dtype == w[name].dtype and torch.equal(g[name], w[name]), name


@pytest.mark.parametrize("where", ["hf", "vllm:2"])
def test_emit_writes_the_seeds_shards_and_lists_every_file(where, tmp_path, tiny, capsys,
                                                            monkeypatch):
    writes = spy(monkeypatch, "write_checkpoint")
    out = tmp_path / "out"
    assert main(["emit", "--convention", where, "--hf-config", str(tiny), "--layers", "1",
                 "--seed", "5", "--max-shard-size", "100000", str(out)]) == 0
    config, at = ModelConfig.from_hf_config(tiny, n_layers=1), endpoint(where)
    (directory, shards, got_at, got_config), kw = writes[0]
    assert (directory, got_at, got_config, kw) == (out, at, config, {"max_shard_size": 100000})
    same_shards(shards, shards_for(config, at, seed=5))
    files = sorted(p for p in out.iterdir())
    text = capsys.readouterr().out
    lines = text.splitlines()
    total = sum(p.stat().st_size for p in files)
    assert lines[-1] == (f"wrote {len(files)} files ({total:,} bytes): tiny_llama seed 5 as "
                         f"{at} in {out}")
    assert sorted(lines[:-1]) == sorted(f"{p.stat().st_size:>12,}  {p}" for p in files)
    assert main(["emit", "--convention", where, "--hf-config", str(tiny), "--layers", "1",
                 "-q", str(tmp_path / "quiet")]) == 0
    quiet = capsys.readouterr().out.splitlines()
    assert len(quiet) == 1 and quiet[0].startswith("wrote ") and " seed 0 as " in quiet[0]
    same_shards(writes[-1][0][1], shards_for(config, at, seed=0))
    assert writes[-1][1] == {"max_shard_size": None}


def test_emit_of_fp8_writes_the_reference_quantizers_shards(tmp_path, tiny, monkeypatch):
    from weight_sync_bench.conventions.fp8 import fp8_shards
    from weight_sync_bench.model.config import init_params

    writes = spy(monkeypatch, "write_checkpoint")
    where = "vllm:tp=2,fp8=tensor"
    assert main(["emit", "--convention", where, "--hf-config", str(tiny), "--layers", "1",
                 "--seed", "7", "-q", str(tmp_path / "fp8")]) == 0
    config, at = ModelConfig.from_hf_config(tiny, n_layers=1), endpoint(where)
    assert writes[0][0][2] == at and writes[0][0][3] == config
    same_shards(writes[0][0][1], fp8_shards(config, at, init_params(config, 7)))
    assert any(x.dtype == torch.float8_e4m3fn for x in writes[0][0][1][0].values())


# ---- wsb verify -------------------------------------------------------------------------

@pytest.fixture
def emitted(tmp_path, tiny):
    """The tiny model emitted as HF (seed 3) and as Meta at TP 2."""
    for where, name in (("hf", "hf"), ("meta:2", "meta")):
        assert main(["emit", "--convention", where, "--hf-config", str(tiny), "--layers", "1",
                     "--seed", "3", "-q", str(tmp_path / name)]) == 0
    return tmp_path


def test_verify_reads_the_geometry_the_directory_states_and_says_so(emitted, tiny, capsys,
                                                                     monkeypatch):
    judged = spy(monkeypatch, "verify_checkpoint", PASS, through=False)
    stated = spy(monkeypatch, "checkpoint_geometry")
    config = ModelConfig.from_hf_config(tiny, n_layers=1)
    capsys.readouterr()
    hf = emitted / "hf"
    assert main(["verify", "--convention", "hf", "--seed", "3", str(hf)]) == 0
    out = capsys.readouterr().out
    assert out == (f"geometry: tiny_llama (d_model 64, 1 layers), as {hf / 'config.json'} "
                   "states it; --config or --hf-config checks the directory against another\n"
                   f"{PASS}\n\n1 passed, 0 failed\n")
    assert stated[-1] == ((hf, endpoint("hf")), {"roots": []})
    (directory, got, where), kw = judged[-1]
    assert (directory, got, where) == (hf, config, "hf:1")
    assert kw == {"src": "hf:1", "seed": 3, "backend": "inprocess", "measure_floor": False,
                  "roots": []}
    meta = emitted / "meta"
    assert main(["verify", "--convention", "meta:2", "--from", "megatron:2", "--backend",
                 "gloo", "--measure-floor", "--allow-root", str(emitted), str(meta)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"geometry: meta (d_model 64, 1 layers), as {meta / 'params.json'} "
                          "states it; ")
    assert stated[-1] == ((meta, endpoint("meta:2")), {"roots": [emitted]})
    (directory, got, where), kw = judged[-1]
    assert (directory, got.d_model, got.n_layers, where) == (meta, 64, 1, "meta:2")
    assert kw == {"src": str(endpoint("megatron:2")), "seed": 0, "backend": "gloo",
                  "measure_floor": True, "roots": [emitted]}
    assert main(["verify", "--convention", "hf", "-q", str(hf)]) == 0  # -q: no geometry line
    assert capsys.readouterr().out == f"{PASS}\n\n1 passed, 0 failed\n"


def test_verify_checks_the_directory_against_the_geometry_named(emitted, tiny, capsys,
                                                                monkeypatch):
    judged = spy(monkeypatch, "verify_checkpoint", FAIL, through=False)
    stated = spy(monkeypatch, "checkpoint_geometry")
    capsys.readouterr()
    hf = str(emitted / "hf")
    assert main(["verify", "--convention", "hf", "--config", "toy", hf]) == 1
    assert capsys.readouterr().out == f"{FAIL}\n\n0 passed, 1 failed\n"
    assert judged[-1][0][1] is TOY and not stated
    model = ["--hf-config", str(tiny), "--layers", "1", "--vocab", "256"]
    assert main(["verify", "--convention", "hf", *model, hf]) == 1
    assert judged[-1][0][1] == ModelConfig.from_hf_config(tiny, n_layers=1, vocab=256)
    for alone in (["--layers", "1"], ["--vocab", "256"]):  # not the directory's geometry
        assert main(["verify", "--convention", "hf", *alone, hf]) == 2
        assert capsys.readouterr().err == ("wsb verify: --layers and --vocab reduce an "
                                           "--hf-config geometry; a committed --config is "
                                           "checked as it is\n")
    assert not stated
    assert main(["verify", "--convention", "hf", "--hf-config", str(tiny), hf]) == 2
    assert "needs --layers N" in capsys.readouterr().err


def test_verify_under_json_prints_the_check_and_the_summary_records(emitted, capsys,
                                                                    monkeypatch):
    spy(monkeypatch, "verify_checkpoint", FAIL, through=False)
    capsys.readouterr()
    hf = emitted / "hf"
    assert main(["verify", "--convention", "hf", "--json", str(hf)]) == 1
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert records == [
        {"kind": "check", **json.loads(json.dumps(verdict_record(FAIL, directory=str(hf))))},
        {"kind": "summary", "command": "verify", "exit_code": 1, "checks": 1, "ran": 1,
         "passed": 0, "failed": 1, "interrupted": False, "skipped": []}]
    assert records[0]["directory"] == str(hf) and records[0]["passed"] is False
    spy(monkeypatch, "verify_checkpoint", PASS, through=False)
    assert main(["verify", "--convention", "hf", "--json", str(hf)]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (summary["exit_code"], summary["passed"], summary["failed"]) == (0, 1, 0)


def test_verify_bounds_the_users_code_with_the_deadline(emitted, monkeypatch):
    spy(monkeypatch, "verify_checkpoint", PASS, through=False)
    deadlines = spy(monkeypatch, "apply_deadline", through=False)
    hf = str(emitted / "hf")
    assert main(["verify", "--convention", "hf", "-q", "--deadline", "5", hf]) == 0
    assert main(["verify", "--convention", "hf", "-q", "--backend", "gloo", hf]) == 0
    assert [c[0] for c in deadlines] == [(5.0, False), (None, True)]


def test_a_floor_not_measured_names_the_command_for_the_users_file(emitted, tiny, monkeypatch):
    hf = str(emitted / "hf")
    error = FloorNotMeasured("no floor covers tiny_llama", command="measure_geometry(...)")
    spy(monkeypatch, "verify_checkpoint", error, through=False)
    with pytest.raises(FloorNotMeasured) as e:  # a committed geometry: as it was raised
        C.cmd_verify(parse("verify", "--convention", "hf", "--config", "toy", hf))
    assert e.value is error
    args = parse("verify", "--convention", "hf", "--hf-config", str(tiny), "--layers", "1",
                 "--vocab", "256", "--backend", "gloo", hf)
    with pytest.raises(FloorNotMeasured) as e:
        C.cmd_verify(args)
    command = (f"python -m weight_sync_bench.tolerance geometry --hf-config {tiny} --layers 1"
               " --vocab 256 --phase 1b")
    assert str(e.value) == (f"no floor covers tiny_llama.\nFrom the command line: `{command}` "
                            "(once), or rerun this verify with --measure-floor")
    assert e.value.command == command and e.value.__cause__ is None
    assert args.dtype == "fp32"


# ---- the parsers ------------------------------------------------------------------------

def test_emit_and_verify_parse_to_their_commands_with_their_defaults(tmp_path):
    a = parse("emit", "--convention", "vllm:2", str(tmp_path))
    assert (a.func, a.convention, a.seed, a.max_shard_size, a.directory, a.config_default) == (
        C.cmd_emit, "vllm:2", 0, None, tmp_path, "toy")
    assert isinstance(a.directory, Path)
    a = parse("emit", "--convention", "hf", "--seed", "9", "--max-shard-size", "4096", "d")
    assert (a.seed, a.max_shard_size) == (9, 4096)
    with pytest.raises(SystemExit):
        parse("emit", "d")  # --convention is required
    with pytest.raises(SystemExit):
        parse("emit", "--convention", "hf", "--max-shard-size", "0", "d")
    v = parse("verify", "--convention", "vllm:2", str(tmp_path))
    assert (v.func, v.convention, v.src, v.seed, v.backend, v.measure_floor, v.allow_root,
            v.directory, v.config_default, v.deadline) == (
        C.cmd_verify, "vllm:2", None, 0, "inprocess", False, [], tmp_path, None, None)
    v = parse("verify", "--convention", "hf", "--from", "meta:2", "--seed", "4",
              "--allow-root", "a", "--allow-root", "b", "--measure-floor", "d")
    assert (v.src, v.seed, v.allow_root, v.measure_floor) == (
        "meta:2", 4, [Path("a"), Path("b")], True)
    with pytest.raises(SystemExit):
        parse("verify", "d")
    with pytest.raises(SystemExit):
        parse("verify", "--convention", "hf", "--seed", "-1", "d")
