"""``--strict-env`` (and ``WSB_STRICT_ENV=1``, which CI sets): a floor measured under another
torch, numpy, Python, machine class or kernel set is refused with exit 2 naming every
difference; without it the run goes on and says so in a note. Both the TP check's floor and
the fuzz's random-geometry floor."""

import json
import os

import pytest

from weight_sync_bench.cli import main


def _foreign(path, **environment):
    artifact = json.loads(path.read_text())
    artifact["environment"].update(environment)
    path.write_text(json.dumps(artifact))


@pytest.fixture(autouse=True)
def _not_strict(monkeypatch):
    monkeypatch.delenv("WSB_STRICT_ENV", raising=False)  # CI sets it; these tests choose


def test_the_fuzz_notes_a_foreign_random_floor_and_strict_env_refuses_it(tolerance, capsys):
    _foreign(tolerance / "random_floor_1a.json", torch="1.0.0")
    assert main(["fuzz", "--examples", "1", "-q", "--mutation", "kv_swapped"]) == 0
    assert ("note: the phase 1a random-geometry floor measured elsewhere: torch recorded "
            "1.0.0 running ") in capsys.readouterr().out
    assert main(["fuzz", "--examples", "1", "-q", "--mutation", "kv_swapped",
                 "--strict-env"]) == 2
    err = capsys.readouterr().err
    assert "measured in another environment (WSB_STRICT_ENV is set): torch recorded 1.0.0" in err
    assert "Re-measure it here with wsb floor --random N --phase 1a --write" in err  # new samples
    assert "WSB_STRICT_ENV" not in os.environ  # put back after the command


def _measured_on(vendor, suffix=""):
    """A change to an artifact: every kernel set it names measured on ``vendor`` instead."""
    def change(artifact):
        artifact["kernel_sets"] = [f"{vendor}/{k.split('/')[-1]}{suffix}"
                                   for k in artifact["kernel_sets"]]
    return change


def test_a_random_floor_of_another_cpu_vendor_is_noted_not_refused(edit_artifact, capsys):
    """Another vendor's kernels sum in another order, within the rule's safety: a floor
    measured under this kernel set on another vendor only is noted, strict or not, naming
    the command that measures it here too (``tolerance.rules.vendor_only``)."""
    edit_artifact("random_floor_1a.json", _measured_on("OtherVendor"))
    assert main(["fuzz", "--examples", "1", "-q", "--mutation", "kv_swapped",
                 "--strict-env"]) == 0
    out = capsys.readouterr().out
    assert "is not among the kernel sets the floor was measured under (OtherVendor/" in out


def test_the_twin_a_kernel_set_no_vendor_measured_is_refused(edit_artifact, capsys):
    edit_artifact("random_floor_1a.json", _measured_on("OtherVendor", "_X"))
    assert main(["fuzz", "--examples", "1", "-q", "--mutation", "kv_swapped",
                 "--strict-env"]) == 2
    err = capsys.readouterr().err
    assert "is not among the kernel sets the floor was measured under (OtherVendor/" in err
    assert "Re-measure it here with wsb floor --kernel-sets all --phase 1a --write" in err


def test_the_twin_a_random_floor_of_this_environment_passes_strict(tolerance, capsys):
    assert main(["fuzz", "--examples", "1", "-q", "--mutation", "kv_swapped",
                 "--strict-env"]) == 0
    assert "note:" not in capsys.readouterr().out


def test_check_strict_env_refuses_a_foreign_phase_floor_and_notes_it_without(tolerance, capsys):
    _foreign(tolerance / "phase1a.json", numpy="0.1")
    assert main(["check", "--config", "toy", "--src", "2", "--dst", "1"]) == 0
    assert "phase 1a floor measured elsewhere: numpy recorded 0.1" in capsys.readouterr().out
    assert main(["check", "--config", "toy", "--src", "2", "--dst", "1", "--strict-env"]) == 2
    assert "numpy recorded 0.1" in capsys.readouterr().err


def test_train_check_notes_a_foreign_training_floor_and_strict_env_refuses_it(tolerance,
                                                                             capsys):
    _foreign(tolerance / "training.json", python="2.7.18")
    argv = ["train-check", "--config", "small", "--dp", "1", "--tp", "2", "-q"]
    assert main(argv) == 0
    assert ("note: the phase 1a training floor measured elsewhere: python recorded 2.7.18"
            in capsys.readouterr().out)
    assert main([*argv, "--strict-env"]) == 2
    err = capsys.readouterr().err
    assert "python recorded 2.7.18" in err
    assert "Re-measure it here with python -m weight_sync_bench.tolerance training --phase 1a" in err
