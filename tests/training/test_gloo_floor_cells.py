"""A training check over gloo reads the phase 1b floor only where that floor measured its
(config, mesh): gloo's ring all-reduce sums in an order of its own, so a mesh the artifact
has no cell for is refused (``FloorNotMeasured``, exit 2, naming the mesh and the command
that measures it), never judged by the nearest measured mesh. Each refusal beside its twin:
a measured mesh passes the same lookup. No rank trains here: the lookup comes first."""

import argparse
import copy
from types import SimpleNamespace

import pytest

from weight_sync_bench.cli.main import main
from weight_sync_bench.cli.train import TRAIN_CONFIGS, _cases, register
from weight_sync_bench.errors import FloorNotMeasured, InvalidMesh
from weight_sync_bench.tolerance.training import load, measured_meshes, thresholds_from
from weight_sync_bench.training import floor
from weight_sync_bench.training.floor import SMALL_VARIANTS, require_mesh
from weight_sync_bench.training.mesh import Mesh
from weight_sync_bench.training.sequence_floor import load_sequence, thresholds_for

CONFIG = SMALL_VARIANTS[1]  # small_tied_bias: padded vocab, tied embeddings, biases
TRAINING = "python -m weight_sync_bench.tolerance training --phase 1b --write"
SEQUENCE = "python -m weight_sync_bench.tolerance sequence --phase 1b --write"


def test_cells_name_their_config_and_mesh_whatever_the_label():
    artifact = {"cells": [
        {"regime": "plain", "case": "small_tied_bias packed seed=0 dp=2 tp=2"},
        {"regime": "plain", "case": "small_tied_bias max_elsewhere t=2 seed=1 dp=1 tp=2"},
        {"regime": "plain", "case": "small_tied_bias unpacked seed=0 dp=2 tp=2 sp cp=2"},
        {"regime": "plain", "case": "small unpacked seed=0 dp=4 tp=1"},  # another config
        {"regime": "cancelling", "case": "small_tied_bias cancelling t=4 seed=0 dp=1 tp=4"},
    ]}
    assert measured_meshes(artifact, "small_tied_bias") == ["dp=2 tp=2", "dp=1 tp=2",
                                                            "dp=2 tp=2 sp cp=2"]
    assert measured_meshes(artifact, "small_tied_bias", "cancelling") == ["dp=1 tp=4"]
    assert measured_meshes(artifact, "small") == ["dp=4 tp=1"]


def test_a_cp_mesh_outside_the_1b_domain_is_refused_naming_the_mesh_and_the_domain():
    with pytest.raises(FloorNotMeasured, match=r"small_tied_bias: no measured sequence floor "
                       r"covers mesh dp=1 tp=1 cp=4 \(4 ranks, phase 1b") as refused:
        thresholds_for(CONFIG, Mesh(1, 1, cp=4), phase="1b")
    message = str(refused.value)
    assert "sequence_1b.json measured small_tied_bias at" in message and "dp=1 tp=1 cp=2" in message
    assert f"stops at {floor.GLOO_WORLD} ranks and cp <= {floor.GLOO_MAX_CP}" in message
    assert refused.value.command == SEQUENCE and f"`{SEQUENCE}`" in message


def test_a_measured_cp_mesh_reads_the_1b_sequence_floor():  # the twin
    for mesh in (Mesh(1, 1, cp=2), Mesh(1, 2, cp=2), Mesh(2, 2, sp=True, cp=2), Mesh(1, 2, sp=True)):
        assert thresholds_for(CONFIG, mesh, phase="1b") == thresholds_from(load_sequence(phase="1b"))


def test_a_dp_x_tp_mesh_of_more_ranks_than_the_domain_is_refused_and_a_measured_one_is_not():
    with pytest.raises(FloorNotMeasured, match=r"covers mesh dp=4 tp=4 \(16 ranks, phase 1b"
                       ) as refused:
        thresholds_for(CONFIG, Mesh(4, 4), phase="1b")
    assert refused.value.command == TRAINING and "stops at" in str(refused.value)
    expected = thresholds_from(load(phase="1b"))
    for mesh in (Mesh(1, 4), Mesh(2, 1), Mesh(2, 2), Mesh(2, 4), Mesh(4, 1), Mesh(4, 2)):
        assert thresholds_for(CONFIG, mesh, phase="1b") == expected


def test_a_mesh_inside_the_domain_that_the_artifact_lacks_is_refused_with_the_command():
    artifact = load(phase="1b")
    require_mesh(artifact, CONFIG, Mesh(2, 2))  # the twin: the committed artifact has it
    stale = copy.deepcopy(artifact)  # as measured before the DP x TP meshes joined the domain
    stale["cells"] = [c for c in stale["cells"] if " dp=1 " in c["case"] + " "]
    with pytest.raises(FloorNotMeasured, match=r"training_1b.json measured small_tied_bias at "
                       r"dp=1 tp=1; dp=1 tp=2; dp=1 tp=4; a threshold measured on another "
                       rf"mesh .* does not judge it. Measure it with `{TRAINING}`$"):
        require_mesh(stale, CONFIG, Mesh(2, 2))
    require_mesh(stale, CONFIG, Mesh(1, 2))


def test_the_1a_floors_keep_reading_by_domain():  # the refusal is the gloo one
    assert thresholds_for(CONFIG, Mesh(4, 4)) == thresholds_from(load())


def _parse(config, argv):
    parser = argparse.ArgumentParser(prog="wsb")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["train-check", "--gloo", "--config", config, *argv])


@pytest.mark.parametrize("argv", [[], ["--dp", "2"], ["--dp", "4", "--tp", "1"],
                                  ["--dp", "4", "--tp", "2"], ["--cp", "2"], ["--sp"],
                                  ["--sp", "--cp", "2"], ["--dp", "2", "--cp", "2", "--tp", "2"],
                                  ["--dp", "2", "--sp", "--cp", "2", "--tp", "2"]])
def test_every_mesh_the_gloo_train_check_runs_up_to_8_ranks_reads_a_covering_cell(argv,
                                                                                monkeypatch):
    def case(config, mesh, seed, steps, spec, params=None):  # the meshes only: none drawn
        mesh.validate(config, spec.rows, spec.seq_len)  # as TrainingCase does
        return SimpleNamespace(config=config, mesh=mesh)

    monkeypatch.setattr("weight_sync_bench.cli.train.TrainingCase", case)
    training, sequence = load(phase="1b"), load_sequence(phase="1b")
    checked = 0
    for config in TRAIN_CONFIGS:
        try:
            cases = _cases(_parse(config, argv))
        except InvalidMesh:  # e.g. --dp 4 on TOY's 2 rows: refused before any floor is read
            continue
        for case in cases:
            mesh = case.mesh
            require_mesh(sequence if mesh.sp or mesh.cp > 1 else training, case.config, mesh)
            checked += 1
    assert checked


def test_wsb_train_check_gloo_refuses_an_unmeasured_mesh_before_any_rank_trains(
        monkeypatch, capsys):
    def no_training(cases):
        raise AssertionError("trained a mesh the floor never measured")

    monkeypatch.setattr("weight_sync_bench.cli.train._gloo_trainer", no_training)
    monkeypatch.setattr("weight_sync_bench.cli.train._gloo_matrix", no_training)
    common = ["train-check", "--gloo", "--config", "small_tied_bias", "--steps", "1"]
    for extra, mesh, command in ((["--cp", "4", "--tp", "1"], "dp=1 tp=1 cp=4", SEQUENCE),
                                 (["--dp", "4", "--tp", "4", "--mutations"], "dp=4 tp=4",
                                  TRAINING)):
        assert main([*common, *extra]) == 2
        err = capsys.readouterr().err
        assert f"covers mesh {mesh} (" in err and f"`{command}`" in err, err
