"""One geometry guard for every command that builds a model (``cli.checkpoint.guard``,
``model.footprint.require_fits``), and one cap on the rank processes a pool starts
(``collectives.gloo.pool.check_ranks``): an absurd geometry or world is refused with exit 2
before anything is allocated or forked, naming what drives the estimate (or the count) and
what raises the limit. The twins: a small geometry is not refused by the same commands, and
a world under the cap starts.
"""

from __future__ import annotations

import json

import pytest

from weight_sync_bench import memory
from weight_sync_bench.cli.main import _models, build_parser, main
from weight_sync_bench.cli.train import TRAIN_CONFIGS
from weight_sync_bench.collectives.gloo import pool as pool_module
from weight_sync_bench.collectives.gloo.pool import (
    MAX_RANKS_ENV,
    RankPool,
    check_ranks,
    max_ranks,
)
from weight_sync_bench.errors import GeometryTooLarge, InvalidNumber, TooManyRanks
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
        _models(build_parser().parse_args([*common, "--memory-budget", "64"]))


def test_past_the_memory_budget_the_harness_streams_and_your_function_is_asked_to():
    """Held whole, Llama-3-8B's width at one layer needs ~19 GiB: past the memory budget
    (half of this machine's memory by default, ``--memory-budget``) the harness's own check
    streams per layer, said in a note; a check of your function, written for whole models,
    is refused naming --stream and the estimate. Within the budget, nothing changes (the
    twin)."""
    from weight_sync_bench.cli.main import memory_budget

    common = ["check", "--hf-config", "llama3_8b", "--layers", "1"]
    args = build_parser().parse_args([*common, "--memory-budget", "4"])
    _models(args)
    assert args.stream == "layer"
    assert args.auto_stream.startswith("streamed per layer: llama3_8b held whole would need "
                                       "about 19 GiB, over the memory budget of 4 GiB")
    with pytest.raises(GeometryTooLarge, match=r"over the memory budget of 4 GiB .*: pass "
                                               r"--stream layer"):
        _models(build_parser().parse_args([*common, "--memory-budget", "4", "--resharder",
                                           "mine:reshard"]))
    within = build_parser().parse_args([*common, "--memory-budget", "64"])
    _models(within)
    assert within.stream is None and not getattr(within, "auto_stream", None)
    assert memory_budget(build_parser().parse_args(common)) == int(Limits().max_bytes * 0.5)


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


# -- the rank cap


def test_a_world_over_the_rank_cap_is_refused_before_any_rank_starts(capsys, monkeypatch):
    monkeypatch.delenv(MAX_RANKS_ENV, raising=False)
    monkeypatch.setattr(RankPool, "start", lambda *a, **k: pytest.fail("a rank started"))
    cap, why = max_ranks()
    assert cap >= 16 and why.endswith(f"CPUs, 16) = {cap}")
    dp = cap // 4 + 1  # megatron:4 over dp replicas: 4 x dp ranks, past the cap
    assert main(["sync", "--config", "toy_kv4", "--from", "megatron:4", "--to", "vllm:2",
                 "--dp", str(dp), "--no-forward"]) == 2
    err = refusal(capsys, "sync")
    assert err == (f"wsb sync: {4 * dp} rank processes asked for (one per rank of the degree, "
                   f"world or mesh): at most {why} start on this machine; WSB_MAX_RANKS=N "
                   "raises the cap\n")
    with pytest.raises(TooManyRanks):
        RankPool(cap + 1)


def test_a_world_at_the_cap_passes_and_the_environment_raises_it(monkeypatch):
    """The twin: ``cap`` ranks pass the check (a pool of them may be made), and
    ``WSB_MAX_RANKS`` moves the cap; a value that is no count is a typed error."""
    monkeypatch.delenv(MAX_RANKS_ENV, raising=False)
    cap, _ = max_ranks()
    check_ranks(cap)
    RankPool(cap)  # made, not started
    monkeypatch.setenv(MAX_RANKS_ENV, str(cap + 8))
    check_ranks(cap + 8)
    assert max_ranks() == (cap + 8, f"WSB_MAX_RANKS={cap + 8}")
    with pytest.raises(TooManyRanks, match=rf"at most WSB_MAX_RANKS={cap + 8} start"):
        check_ranks(cap + 9)
    for bad in ("0", "many", "-3"):
        monkeypatch.setenv(MAX_RANKS_ENV, bad)
        with pytest.raises(InvalidNumber, match=f"^{MAX_RANKS_ENV} must be an int >= 1"):
            check_ranks(2)


def test_the_shared_pool_is_kept_when_a_larger_one_is_refused(monkeypatch):
    """``shared_pool`` checks the cap before it closes the pool it would replace."""
    monkeypatch.delenv(MAX_RANKS_ENV, raising=False)
    closed = []
    kept = RankPool(2)
    monkeypatch.setattr(kept, "close", lambda: closed.append(True))
    monkeypatch.setattr(pool_module, "_shared", kept)
    with pytest.raises(TooManyRanks):
        pool_module.shared_pool(max_ranks()[0] + 1)
    assert pool_module._shared is kept and not closed
