"""``wsb verify-state`` (issue 30, the mutation pass over ``cli/state.py``): what the command
hands the readers and the verifier, and what it prints, records and returns.

The contract (``cli/state.py``'s docstring, ``docs/reference/exit-codes.md``): exit 0 when
every tensor of every rank checked is equal, 1 when one is not, 2 for an input that cannot
be read or a rank the endpoint does not have. Without model options the geometry is what a
``config.json`` states: the weights' for an HF directory, else the dumps' (a Megatron
checkpoint's args state sizes, not the model). ``--rank`` checks those ranks, each once, in
the order given.

The readers and the verifier are stood in (``checkpoint_geometry``,
``is_megatron_checkpoint``, ``read_weights``, ``init_params``, ``read_rank_dumps``,
``verify_ranks``): each records what it was handed and returns a marker, so each test checks
every argument, line, record and exit code of one outcome in milliseconds. The real readers
run in ``tests/cli/test_verify_state.py``.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from weight_sync_bench.cli.main import build_parser, main
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.model.config import TOY, TOY_KV4

S = importlib.import_module("weight_sync_bench.cli.state")


class Report:
    """One rank's report from ``verify_ranks``, each field distinct."""

    def __init__(self, rank, passed):
        self.rank, self.passed = rank, passed
        self.outcomes = (SimpleNamespace(name=f"a{rank}", outcome="equal", detail="d0"),
                         SimpleNamespace(name=f"b{rank}", outcome="stale", detail=f"d{rank}"))

    def counts(self):
        return {"equal": 1, "stale": self.rank}

    def coverage(self):
        return [f"layer {self.rank}"]

    def summary(self):
        return f"summary of rank {self.rank}"


@pytest.fixture
def calls(monkeypatch):
    """Stand-ins of every reader and of the verifier; ``calls.log`` is what each was handed,
    ``calls.passing`` the ranks whose report passes (all by default)."""
    log = []
    state = SimpleNamespace(log=log, passing=None, megatron=False, geometry=TOY_KV4)

    def checkpoint_geometry(directory, where, *, roots):
        log.append(("geometry", directory, where, roots))
        return state.geometry

    def is_megatron_checkpoint(directory):
        log.append(("is_megatron", directory))
        return state.megatron

    def read_weights(directory, config, *, where, roots):
        log.append(("read_weights", directory, config.name, where, roots))
        return {"weights of": str(directory)}

    def init_params(config, seed):
        log.append(("init_params", config.name, seed))
        return {"seed": seed}

    def read_rank_dumps(directory, where, *, roots, ranks):
        log.append(("dumps", directory, where, roots, ranks))
        return "the dumps"

    def verify_ranks(dumps, where, weights, **kw):
        log.append(("verify", dumps, where, weights, kw))
        for r in kw["ranks"]:
            yield Report(r, state.passing is None or r in state.passing)

    for name, fake in (("checkpoint_geometry", checkpoint_geometry),
                       ("is_megatron_checkpoint", is_megatron_checkpoint),
                       ("read_weights", read_weights), ("init_params", init_params),
                       ("read_rank_dumps", read_rank_dumps), ("verify_ranks", verify_ranks)):
        monkeypatch.setattr(S, name, fake)
    return state


def run(*argv):
    return main(["verify-state", *argv])


def entries(calls, kind):
    return [c[1:] for c in calls.log if c[0] == kind]


def test_seed_weights_every_rank_passes_text(calls, capsys):
    assert run("--endpoint", "vllm:tp=2", "--config", "toy", "--seed", "5", "state") == 0
    out = capsys.readouterr().out
    assert out == ("summary of rank 0\nsummary of rank 1\n\n2 passed, 0 failed\n")
    vllm2 = endpoint("vllm:tp=2")
    assert calls.log == [
        ("init_params", "toy", 5),
        ("dumps", Path("state"), vllm2, [], [0, 1]),
        ("verify", "the dumps", vllm2, {"seed": 5},
         {"config": TOY, "ranks": [0, 1], "previous": None, "sentinel": None, "dtype": None})]


def test_a_failing_last_rank_after_passing_ones_is_exit_1_and_counted(calls, capsys):
    calls.passing = {0, 1, 2}
    assert run("--endpoint", "vllm:tp=4", "--config", "toy", "--seed", "0", "--json",
               "state") == 1
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["kind"] for r in records] == ["state"] * 4 + ["summary"]
    assert records[3] == {
        "kind": "state", "endpoint": "vllm:4", "rank": 3, "passed": False,
        "counts": {"equal": 1, "stale": 3}, "coverage": ["layer 3"],
        "outcomes": [{"name": "b3", "outcome": "stale", "detail": "d3"}]}
    assert [r["passed"] for r in records[:4]] == [True, True, True, False]
    assert records[4] == {"kind": "summary", "command": "verify-state", "exit_code": 1,
                          "checks": 4, "ran": 4, "passed": 3, "failed": 1,
                          "interrupted": False, "skipped": []}


def test_every_rank_failing_text_tally(calls, capsys):
    calls.passing = set()
    assert run("--endpoint", "vllm:tp=2", "--config", "toy", "--seed", "0", "-q",
               "state") == 1
    assert capsys.readouterr().out.endswith("\n\n0 passed, 2 failed\n")


def test_the_first_rank_failing_alone_is_exit_1(calls, capsys):
    calls.passing = {1}
    assert run("--endpoint", "vllm:tp=2", "--config", "toy", "--seed", "0", "state") == 1
    assert capsys.readouterr().out.endswith("\n1 passed, 1 failed\n")


def test_ranks_are_checked_once_each_in_the_order_given(calls, capsys):
    assert run("--endpoint", "vllm:tp=4", "--config", "toy", "--seed", "0", "--rank", "3",
               "--rank", "1", "--rank", "3", "--json", "state") == 0
    (dumps,) = entries(calls, "dumps")
    assert dumps[3] == [3, 1]
    (verify,) = entries(calls, "verify")
    assert verify[3]["ranks"] == [3, 1]
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (summary["checks"], summary["ran"], summary["passed"]) == (2, 2, 2)


def test_the_last_rank_of_the_endpoint_is_allowed_and_the_next_refused(calls, capsys):
    assert run("--endpoint", "vllm:tp=4", "--config", "toy", "--seed", "0", "--rank", "3",
               "state") == 0
    capsys.readouterr()
    calls.log.clear()
    assert run("--endpoint", "vllm:tp=4", "--config", "toy", "--seed", "0", "--rank", "1",
               "--rank", "4", "--rank", "5", "state") == 2
    err = capsys.readouterr().err
    assert "--rank 4: vllm:4 has ranks 0..3" in err
    assert calls.log == []  # refused before anything is read


def test_the_weights_and_previous_directories_are_read_at_the_saved_layout(calls, capsys):
    assert run("--endpoint", "vllm:tp=2", "--config", "toy", "--weights", "w",
               "--previous", "p", "--weights-from", "megatron:tp=2,pp=2", "--allow-root",
               "r1", "--allow-root", "r2", "--sentinel", "7.5", "--dtype", "bf16",
               "state") == 0
    saved, roots = endpoint("megatron:tp=2,pp=2"), [Path("r1"), Path("r2")]
    assert entries(calls, "read_weights") == [(Path("w"), "toy", saved, roots),
                                              (Path("p"), "toy", saved, roots)]
    assert entries(calls, "init_params") == []
    (dumps,) = entries(calls, "dumps")
    assert dumps == (Path("state"), endpoint("vllm:tp=2"), roots, [0, 1])
    (verify,) = entries(calls, "verify")
    assert verify[2] == {"weights of": "w"}
    assert verify[3] == {"config": TOY, "ranks": [0, 1], "previous": {"weights of": "p"},
                         "sentinel": 7.5, "dtype": torch.bfloat16}


def test_a_directory_without_weights_from_is_read_at_the_layout_it_states(calls, capsys):
    assert run("--endpoint", "vllm:tp=2", "--config", "toy", "--weights", "w",
               "--previous-seed", "9", "state") == 0
    assert entries(calls, "read_weights") == [(Path("w"), "toy", None, [])]
    assert entries(calls, "init_params") == [("toy", 9)]
    (verify,) = entries(calls, "verify")
    assert verify[3]["previous"] == {"seed": 9}


def test_the_geometry_an_hf_weights_directory_states(calls, capsys):
    assert run("--endpoint", "vllm:tp=2", "--weights", "w", "--allow-root", "r",
               "state") == 0
    assert calls.log[:2] == [("is_megatron", Path("w")),
                             ("geometry", Path("w"), endpoint("hf"), [Path("r")])]
    (verify,) = entries(calls, "verify")
    assert verify[3]["config"] is TOY_KV4
    out = capsys.readouterr().out
    assert out.startswith(f"geometry: toy_kv4 (d_model {TOY_KV4.d_model}, "
                          f"{TOY_KV4.n_layers} layers), as w/config.json states it\n")


def test_the_geometry_the_dumps_state_beside_a_megatron_checkpoint(calls, capsys):
    calls.megatron = True
    assert run("--endpoint", "vllm:tp=2", "--weights", "w", "-q", "state") == 0
    assert entries(calls, "geometry") == [(Path("state"), endpoint("vllm:tp=2"), [])]
    assert "geometry:" not in capsys.readouterr().out  # -q


def test_the_geometry_the_dumps_state_for_a_seed(calls, capsys):
    assert run("--endpoint", "vllm:tp=2", "--seed", "3", "state") == 0
    assert entries(calls, "is_megatron") == []
    assert entries(calls, "geometry") == [(Path("state"), endpoint("vllm:tp=2"), [])]
    assert entries(calls, "init_params") == [("toy_kv4", 3)]
    assert "as state/config.json states it" in capsys.readouterr().out


def test_the_geometry_line_is_text_only(calls, capsys):
    assert run("--endpoint", "vllm:tp=2", "--seed", "3", "--json", "state") == 0
    out = capsys.readouterr().out
    assert "geometry" not in out and all(json.loads(line) for line in out.splitlines())


@pytest.mark.parametrize("options", [["--config", "toy"], ["--layers", "2"], ["--vocab", "64"]])
def test_any_model_option_names_the_geometry_instead(calls, capsys, options):
    code = run("--endpoint", "vllm:tp=2", "--seed", "3", *options, "state")
    assert entries(calls, "geometry") == []
    if options[0] == "--config":
        assert code == 0
    else:  # --layers or --vocab without --hf-config: refused by the model options
        assert code == 2 and "--layers and --vocab reduce an --hf-config geometry" in (
            capsys.readouterr().err)


def test_the_geometry_guard_refuses_before_anything_is_read(calls, capsys):
    assert run("--endpoint", "vllm:tp=2", "--config", "toy", "--seed", "0", "--max-gib",
               "1e-6", "state") == 2
    assert calls.log == []
    assert "GiB" in capsys.readouterr().err


def test_the_parser(calls):
    parser = build_parser()
    args = parser.parse_args(["verify-state", "--endpoint", "vllm:tp=2", "--seed", "1", "s"])
    assert args.func is S.cmd_verify_state
    assert (args.weights, args.previous, args.previous_seed, args.weights_from, args.sentinel,
            args.dtype, args.rank, args.allow_root, args.state) == (
        None, None, None, None, None, None, None, [], Path("s"))
    assert (args.config, args.hf_config, args.layers, args.vocab, args.config_default) == (
        None, None, None, None, None)
    assert args.max_gib is None and args.max_gflop > 0
    args = parser.parse_args(["verify-state", "--endpoint", "e", "--weights", "w",
                              "--previous-seed", "4", "--rank", "2", "s"])
    assert (args.weights, args.seed, args.previous_seed, args.rank) == (Path("w"), None, 4, [2])
    for bad in (["--seed", "1", "s"],  # no --endpoint
                ["--endpoint", "e", "s"],  # neither --weights nor --seed
                ["--endpoint", "e", "--seed", "1", "--weights", "w", "s"],
                ["--endpoint", "e", "--seed", "1", "--previous", "p", "--previous-seed", "2",
                 "s"],
                ["--endpoint", "e", "--seed", "1", "--dtype", "fp64x", "s"],
                ["--endpoint", "e", "--seed", "1", "--sentinel", "x", "s"],
                ["--endpoint", "e", "--seed", "1", "--rank", "-1", "s"],
                ["--endpoint", "e", "--seed", "1"]):  # no STATE_DIR
        with pytest.raises(SystemExit) as info:
            parser.parse_args(["verify-state", *bad])
        assert info.value.code == 2, bad
