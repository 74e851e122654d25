"""One geometry guard for every command that builds a model (``cli.checkpoint.guard``,
``model.footprint.require_fits``): an absurd geometry is refused with exit 2 before
anything is allocated, naming what drives the estimate and what raises the limit. The
twin: a small geometry is not refused by the same commands.
"""

from __future__ import annotations

import json

import pytest

from weight_sync_bench import memory
from weight_sync_bench.cli.main import _models, build_parser, main
from weight_sync_bench.cli.train import TRAIN_CONFIGS
from weight_sync_bench.errors import GeometryTooLarge
from weight_sync_bench.fuzz.domain import DOMAIN, MOE_DOMAIN
from weight_sync_bench.fuzz.user import real_geometries
from weight_sync_bench.model.footprint import GIB, Limits, footprint

SMALL = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
         "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
         "num_hidden_layers": 2, "vocab_size": 256}
HUGE = {**SMALL, "hidden_size": 10**9}

# Every command that builds a geometry a user names, with what it needs besides; and what
# each does with a small geometry past the guard (its exit status and a line it prints).
NEXT = {"check": (2, "no measured floor covers this check"), "emit": (0, "wrote 7 files"),
        "verify": (2, "no such checkpoint directory"), "sync": (0, "elements"),
        "floor geometry": (0, "wrote ")}
COMMANDS = {
    "check": lambda tmp: ["check", "--layers", "1"],
    "emit": lambda tmp: ["emit", "--convention", "hf", "--layers", "1", str(tmp / "emitted")],
    "verify": lambda tmp: ["verify", "--convention", "hf", "--layers", "1", str(tmp / "none")],
    "sync": lambda tmp: ["sync", "--layers", "1", "--no-forward", "--from", "megatron:2",
                         "--to", "vllm:2"],
    "floor geometry": lambda tmp: ["floor", "geometry", "--layers", "1", "--kernel-sets",
                                   "current", "--out", str(tmp / "floor.json")],
}


def write(tmp_path, data, name):
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data))
    return str(path)


def refusal(capsys, command):
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith(f"wsb {command.split()[0]}: "), err
    return err


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_hidden_size_of_a_billion_is_refused_before_anything_is_allocated(
        tmp_path, capsys, command):
    path = write(tmp_path, HUGE, "huge")
    peak = memory.Peak()
    assert main([*COMMANDS[command](tmp_path), "--hf-config", path]) == 2
    assert peak.high() - peak.began < 256 * 2**20  # nothing of the 14,700 GiB was touched
    err = refusal(capsys, command)
    assert "huge: field 'hidden_size' (d_model) is 1000000000: checking this geometry" in err
    assert "GiB; raise it with --max-gib)" in err and "refused before allocating" in err
    assert "see model.footprint)" in err


@pytest.mark.parametrize("command", list(COMMANDS))
def test_the_same_command_at_a_small_geometry_is_not_refused_and_its_limit_is_the_flag(
        tmp_path, capsys, command):
    """The twin: a small geometry gets past the guard (whatever the command does next:
    emit writes, check and verify want a floor or a checkpoint), and ``--max-gib`` is what
    the guard reads (a limit below the small geometry's estimate refuses it)."""
    path = write(tmp_path, SMALL, "small")
    argv = [*COMMANDS[command](tmp_path), "--hf-config", path]
    code, says = NEXT[command]
    assert main(argv) == code
    out, err = capsys.readouterr()
    assert says in out + err and "refused before allocating" not in err, out + err
    assert main([*argv, "--max-gib", "1e-6"]) == 2
    err = refusal(capsys, command)
    assert "(limit 9.99e-07 GiB; raise it with --max-gib)" in err and "GFLOP" not in err


def test_a_streamed_check_is_estimated_per_unit(tmp_path):
    """``--stream`` holds one parameter (or layer) at a time: Llama-3-8B's full width at one
    layer fits 8 GiB streamed, not whole (the refusal says how it would fit)."""
    common = ["check", "--hf-config", "llama3_8b", "--layers", "1", "--max-gib", "8"]
    args = build_parser().parse_args([*common, "--stream", "parameter"])
    (config,) = _models(args)
    assert config.d_model == 4096 and footprint(config, "parameter").bytes < 8 * GIB
    with pytest.raises(GeometryTooLarge, match=r"; --stream parameter holds one parameter "
                                               r"at a time, refused before allocating"):
        _models(build_parser().parse_args(common))


def test_the_harness_own_geometries_fit_far_inside_the_default_limits():
    """fuzz, floor random and train-check build only the harness's geometries (a fuzz domain
    can be narrowed, never widened; train-check's configs are named): each of them, at its
    largest, is inside the replay's limits, far below those a command defaults to, so they need no guard of their
    own; ``wsb replay`` guards each entry (``fuzz.corpus.ReplayLimits``)."""
    limits = Limits(max_bytes=2 * GIB, max_flops=50e9)  # replay's, far below a command's
    for config in (DOMAIN.largest(), MOE_DOMAIN.largest(), *real_geometries(),
                   *TRAIN_CONFIGS.values()):
        cost = footprint(config)
        assert cost.bytes < limits.max_bytes and cost.flops < limits.max_flops, config

