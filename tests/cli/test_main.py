import json
import textwrap

import pytest

from tests.breadth import breadth
from weight_sync_bench.cli.main import main
from weight_sync_bench.model.config import TOY_KV4
from weight_sync_bench.tolerance.rules import threshold_for


def test_wsb_check_prints_every_pair_with_deviation_and_threshold(capsys):
    assert main(["check", "--config", "toy"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:7] == ["config", "src", "->", "dst", "phase", "mutation", "max"]
    assert out.count("PASS") == 4 and "4 passed, 0 failed" in out


def test_wsb_check_rejects_an_unsupported_degree_with_the_config_and_the_rule(capsys):
    assert main(["check", "--config", "toy", "--src", "1", "--dst", "4"]) == 2
    assert ("toy: layers.0.qkv.weight: HeadPartitioned needs n_kv_heads % t == 0 "
            "(n_kv_heads=2, t=4)") in capsys.readouterr().err


def test_wsb_check_over_all_configs_checks_a_degree_where_it_applies_and_says_where_not(capsys):
    assert main(["check", "--src", "2", "--dst", "4"]) == 0
    out = capsys.readouterr().out
    assert "toy_kv4  2 -> 4" in out and "1 passed, 0 failed" in out
    assert "skipped toy: layers.0.qkv.weight: HeadPartitioned needs n_kv_heads % t == 0" in out
    assert main(["check", "--dst", "8"]) == 2
    assert "no config supports the requested degrees" in capsys.readouterr().err


def test_wsb_layout_prints_the_table(capsys):
    assert main(["layout", "--config", "toy_kv4"]) == 0
    out = capsys.readouterr().out
    assert "HP(8,4,32)" in out and "supported degrees: 1, 2, 4" in out


def _write_module(tmp_path, monkeypatch, source):
    (tmp_path / "my_resharders.py").write_text(textwrap.dedent(source))
    monkeypatch.chdir(tmp_path)


def test_wsb_check_runs_a_users_resharder_by_module_path(tmp_path, monkeypatch, capsys):
    _write_module(tmp_path, monkeypatch, """
        from weight_sync_bench import layout_for, reshard, TOY_KV4

        def good(shards, dst):
            return reshard(shards, layout_for(TOY_KV4), dst)

        def chunked(shards, dst):
            out = good(shards, dst)
            full = [s["layers.0.gate_up.weight"] for s in good(shards, 1)][0]
            for rank, piece in enumerate(full.chunk(dst)):
                out[rank]["layers.0.gate_up.weight"] = piece.clone()
            return out
    """)
    # the twin at the pair the bug is checked at; a correct resharder over a whole sweep is
    # test_a_sweep_whose_last_check_alone_fails_exits_1_counting_it's twin
    assert main(["check", "--config", "toy_kv4", "--src", "1", "--dst", "2",
                 "--resharder", "my_resharders:good"]) == 0
    assert "1 passed, 0 failed" in capsys.readouterr().out
    assert main(["check", "--config", "toy_kv4", "--src", "1", "--dst", "2",
                 "--resharder", "my_resharders:chunked"]) == 1
    out = capsys.readouterr().out
    assert ("rank 0 layers.0.gate_up.weight holds gate rows 0-703; declared gate rows 0-351, "
            "up rows 0-351") in out


# -q and --json share the exit path the plain run takes (cli.main's one tally); they run in
# the long run, the plain sweep by default.
@pytest.mark.parametrize("flags", breadth([[], ["-q"], ["--json"]], keep={"plain"},
                                          name=lambda f: " ".join(f) or "plain"))
def test_a_sweep_whose_last_check_alone_fails_exits_1_counting_it(tmp_path, monkeypatch,
                                                                  capsys, flags):
    """The exit code and the tally come from every check of the sweep, not the first: the
    resharder is wrong only at the sweep's last pair (2 -> 2). TOY's sweep, 4 pairs (each
    check of a user's resharder fingerprints its inputs and reshards twice: TOY_KV4's 9 pairs
    made the test 4.7 s)."""
    (tmp_path / "sweep_resharders.py").write_text(textwrap.dedent("""
        from weight_sync_bench import layout_for, reshard, TOY

        def good(shards, dst):
            return reshard(shards, layout_for(TOY), dst)

        def wrong_at_the_end(shards, dst):
            out = good(shards, dst)
            if len(shards) == 2 and dst == 2:
                x = out[1]["norm.weight"].clone()
                x.view(-1).view(__import__("torch").int32)[-1] ^= 1
                out[1]["norm.weight"] = x
            return out
    """))
    monkeypatch.chdir(tmp_path)
    argv = ["check", "--config", "toy", *flags, "--resharder"]
    assert main([*argv, "sweep_resharders:wrong_at_the_end"]) == 1
    out = capsys.readouterr().out
    if "--json" in flags:
        summary = json.loads(out.splitlines()[-1])
        assert (summary["kind"], summary["passed"], summary["failed"], summary["exit_code"]) == (
            "summary", 3, 1, 1)
    else:
        assert "3 passed, 1 failed" in out
    assert main([*argv, "sweep_resharders:good"]) == 0  # the twin
    assert "--json" in flags or "4 passed, 0 failed" in capsys.readouterr().out


def test_a_missing_resharder_is_a_clear_error(tmp_path, monkeypatch, capsys):
    _write_module(tmp_path, monkeypatch, "x = 1\n")
    assert main(["check", "--resharder", "my_resharders:nope"]) == 2
    assert "my_resharders has no callable 'nope'" in capsys.readouterr().err
    assert main(["check", "--resharder", "no_such_module_here:f"]) == 2
    assert "cannot import 'no_such_module_here'" in capsys.readouterr().err


def test_wsb_check_runs_over_gloo_with_the_phase_1b_threshold(capsys):
    assert main(["check", "--config", "toy_kv4", "--src", "2", "--dst", "4", "--backend", "gloo"]) == 0
    out = capsys.readouterr().out
    assert "1 passed, 0 failed" in out
    assert f"  {threshold_for(TOY_KV4, '1b'):g}  " in out  # phase 1b's own threshold


def test_wsb_version_imports_no_torch():
    """``wsb --version`` answers from the distributions' metadata: a fresh interpreter running
    the console script's entry never imports torch (the rest of the CLI does). One
    interpreter for both: the twin, ``wsb layout``, runs after it in the same process."""
    import subprocess
    import sys

    code = ("import sys; from weight_sync_bench.__main__ import main; "
            "sys.argv = ['wsb', '--version']; main(); "
            "print('torch' in sys.modules, flush=True); "
            "sys.argv = ['wsb', 'layout', '--config', 'toy']; main(); "
            "print('twin', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0].startswith("wsb ") and "(torch " in out[0] and out[1] == "False", out
    assert out[-1] == "twin True", out  # the twin
