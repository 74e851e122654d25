"""``wsb floor <kind>``: every measurement is a kind of one command (phase, random, geometry,
replicated-kv, training, sequence), with a progress line and an ETA on stderr; the commands
a user called before stay what they were (``wsb floor --random N``, ``python -m
weight_sync_bench.tolerance [kind]``, ``python -m weight_sync_bench.fuzz.floor
replicated-kv``)."""

import json
import runpy
import sys

import pytest

from weight_sync_bench.cli.floor import KINDS, as_floor_argv
from weight_sync_bench.cli.main import build_parser, main
from weight_sync_bench.tolerance.artifacts import running_kernel_set, runtime
from weight_sync_bench.tolerance.sampled import load_replicated_kv, replicated_kv_path


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_is_a_subcommand_of_wsb_floor(kind):
    args = build_parser().parse_args(["floor", kind, "--out", "x.json"])
    assert args.command == "floor" and args.kind == kind


def test_without_a_kind_wsb_floor_is_the_random_floor_as_it_always_read():
    args = build_parser().parse_args(["floor", "--random", "3", "--out", "x.json"])
    assert args.kind is None and args.random == 3  # cli.floor.cmd_floor: the random kind
    assert as_floor_argv(["--phase", "1b"]) == ["floor", "phase", "--phase", "1b"]
    assert as_floor_argv(["training", "--write"]) == ["floor", "training", "--write"]
    assert as_floor_argv([]) == ["floor", "phase"]


@pytest.mark.parametrize("module, argv, message", [
    # each module once by default; --phase 1b in the long run
    pytest.param("weight_sync_bench.tolerance", ["--phase", "1b"], "would replace the committed",
                 marks=pytest.mark.slow),
    ("weight_sync_bench.tolerance", ["training"], "would replace the committed"),
    ("weight_sync_bench.fuzz.floor", ["replicated-kv"], "would replace the committed"),
])
def test_the_python_m_commands_are_wsb_floor(module, argv, message, tmp_path, tolerance,
                                             monkeypatch, capsys):
    """Refused before measuring (no --write, no --out): the same guard as wsb floor's.
    ``python -m`` in this process: ``runpy._run_module_as_main``, what the interpreter's
    ``-m`` calls, runs the package's ``__main__`` as ``runpy.run_module`` does here (a fresh
    interpreter cost 3-4 s a module and proved nothing more)."""
    monkeypatch.setattr(sys, "argv", [module, *argv])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err, err
    assert err.startswith("wsb floor: ")


def test_a_measurement_shows_its_progress_with_an_eta(tmp_path, capsys):
    out = tmp_path / "phase.json"
    assert main(["floor", "phase", "--repetitions", "1", "--kernel-sets", "current",
                 "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "toy seed 1/1: 1/2," in err and "elapsed, ETA" in err
    assert json.loads(out.read_text())["repetitions"] == 1


def test_a_validation_is_re_measured_under_every_kernel_set_keeping_the_others(
        tmp_path, capsys, monkeypatch):
    """``wsb floor replicated-kv --from PATH``: its samples measured again here, a process
    per kernel set (one here: the running one), merged beside the kernel sets and vendors
    it holds; the running set's figures reproduce the committed ones bit for bit where it
    was measured."""
    here = runtime()["cpu_capability"]
    monkeypatch.setattr("weight_sync_bench.tolerance.kernels.available", lambda: [here.lower()])
    committed = load_replicated_kv()
    small = {**committed, "samples": committed["samples"][:4]}
    source, out = tmp_path / "small.json", tmp_path / "merged.json"
    source.write_text(json.dumps(small))
    assert main(["floor", "replicated-kv", "--from", str(source), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    label = running_kernel_set()
    assert merged["kernel_sets"] == list(dict.fromkeys([*committed["kernel_sets"], label]))
    for before, after in zip(small["samples"], merged["samples"], strict=True):
        kept = {k: v for k, v in after["by_kernel_set"].items() if k != label}
        assert kept == {k: v for k, v in before["by_kernel_set"].items() if k != label}
        if label in before["by_kernel_set"]:
            assert after["by_kernel_set"][label] == before["by_kernel_set"][label]
    assert "kernel set 1/1" in capsys.readouterr().err
    assert json.loads(source.read_text()) == small  # the source is read, never rewritten


def test_new_samples_over_another_vendors_are_refused_before_anything_is_drawn(tmp_path,
                                                                              capsys):
    target = tmp_path / "validation.json"
    other = load_replicated_kv()
    other = {**other, "kernel_sets": ["OtherVendor/AVX2"], "machines": {"OtherVendor": {}}}
    target.write_text(json.dumps(other))
    assert main(["floor", "replicated-kv", "--geometries", "2", "--out", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"{target} holds measurements on OtherVendor, which new samples would drop" in err
    assert f"wsb floor replicated-kv --from {target} --kernel-sets all" in err
    assert json.loads(target.read_text()) == other
    assert replicated_kv_path().name == "random_floor_1a_replicated_kv.json"
