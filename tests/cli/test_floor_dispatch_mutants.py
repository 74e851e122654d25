"""``wsb floor``'s exit path (issue 30, the mutation pass over ``cli/floor.py``'s
``cmd_floor`` and ``as_floor_argv``): which measurement each kind runs, with what, on one
torch thread, and that its code is the command's and its progress line is closed whatever
happens.

The measurements are stood in (``floor_samples.measure_random``, ``measure_replicated``,
``measure_moe``, ``floor_measure.measure_geometry``, ``measure_kind``): each records the
arguments and the progress line it was handed and returns a code of its own. The real
measurements are ``tests/cli/test_floor.py``'s and ``tests/tolerance``'s.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from weight_sync_bench.cli import floor as F
from weight_sync_bench.cli import floor_measure, floor_samples

MEASURES = {(floor_samples, "measure_random"): 11, (floor_samples, "measure_replicated"): 12,
            (floor_samples, "measure_moe"): 13, (floor_measure, "measure_geometry"): 14,
            (floor_measure, "measure_kind"): 15}


@pytest.fixture
def measured(monkeypatch):
    """The measurements stood in; the list of (which, args, line, line enabled) they saw."""
    seen = []
    for (module, name), code in MEASURES.items():
        def measure(args, line, name=name, code=code):
            seen.append((name, args, line, line.enabled))
            return code
        monkeypatch.setattr(module, name, measure)
    closed = []
    original = F.ProgressLine.close
    monkeypatch.setattr(F.ProgressLine, "close",
                        lambda self: (closed.append(self), original(self))[1])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: seen.append(("threads", n)))
    return seen, closed


@pytest.mark.parametrize(("kind", "which", "code"), [
    (None, "measure_random", 11), ("random", "measure_random", 11),
    ("replicated-kv", "measure_replicated", 12), ("moe", "measure_moe", 13),
    ("geometry", "measure_geometry", 14), ("phase", "measure_kind", 15),
    ("training", "measure_kind", 15), ("sequence", "measure_kind", 15)])
def test_each_kind_runs_its_measurement_and_returns_its_code(measured, kind, which, code):
    seen, closed = measured
    args = argparse.Namespace(kind=kind, quiet=False)
    assert F.cmd_floor(args) == code
    assert seen[0] == ("threads", 1)
    ((name, got, line, enabled),) = seen[1:]
    assert (name, got, enabled) == (which, args, True)
    assert closed == [line]


def test_quiet_disables_the_progress_line_and_no_quiet_attribute_enables_it(measured):
    seen, _ = measured
    F.cmd_floor(argparse.Namespace(kind="moe", quiet=True))
    F.cmd_floor(argparse.Namespace(kind="moe"))
    assert [s[3] for s in seen if s[0] == "measure_moe"] == [False, True]


def test_the_line_is_closed_when_a_measurement_raises(measured, monkeypatch):
    _, closed = measured

    def refuse(args, line):
        raise RuntimeError("refused")
    monkeypatch.setattr(floor_measure, "measure_kind", refuse)
    with pytest.raises(RuntimeError, match="refused"):
        F.cmd_floor(argparse.Namespace(kind="phase", quiet=False))
    assert len(closed) == 1


def test_the_parser_sends_every_kind_to_cmd_floor():
    parser = argparse.ArgumentParser(prog="wsb")
    F.register(parser.add_subparsers(dest="command", required=True))
    assert parser.parse_args(["floor"]).kind is None
    for kind in F.KINDS:
        args = parser.parse_args(["floor", kind])
        assert (args.func, args.kind) == (F.cmd_floor, kind)


@pytest.mark.parametrize(("argv", "default", "want"), [
    ([], "phase", ["floor", "phase"]),
    (["--phase", "1b"], "phase", ["floor", "phase", "--phase", "1b"]),
    (["--phase", "1b"], "moe", ["floor", "moe", "--phase", "1b"]),
    (["geometry", "--config", "toy"], "phase", ["floor", "geometry", "--config", "toy"]),
    (["replicated-kv"], "phase", ["floor", "replicated-kv"]),
    (["sequence"], "phase", ["floor", "sequence"]),
    (["-h"], "phase", ["floor", "-h"]), (["--help"], "moe", ["floor", "--help"]),
    (["--out", "phase"], "moe", ["floor", "moe", "--out", "phase"]),
])
def test_a_module_command_line_as_wsb_floor(argv, default, want):
    assert F.as_floor_argv(argv, default) == want


def test_the_module_commands_default_kind_is_phase():
    assert F.as_floor_argv(["--repetitions", "2"]) == ["floor", "phase", "--repetitions", "2"]
