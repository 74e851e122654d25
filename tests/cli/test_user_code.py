"""The user's code fails as the user's code: a resharder or splitter that raises, has the
wrong signature, fails at import, returns meta tensors or non-string keys gets a framed
error (exit 4) with the user's frames of the traceback, not the harness's. ``wsb check`` and
``wsb fuzz`` call a converter the same way, the geometry given as ``config=``."""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

from tests.documentation import documentation
from weight_sync_bench.check.checker import check_reshard, check_split
from weight_sync_bench.cli import main
from weight_sync_bench.errors import InvalidShards, InvalidUserShards, UserCodeError
from weight_sync_bench.fuzz.user import real_geometries
from weight_sync_bench.layout.reshard import reshard, split
from weight_sync_bench.model.config import TOY
from weight_sync_bench.model.plan import layout_for

LAYOUT = layout_for(TOY)
README = Path(__file__).resolve().parents[2] / "README.md"

SOURCE = """
    import torch
    from weight_sync_bench import TOY, layout_for, reshard

    def good(shards, dst):
        return reshard(shards, layout_for(TOY), dst)

    def _inner(x):
        raise ValueError(f"bad rows in {x}")

    def boom(shards, dst):
        return _inner("layers.0.qkv.weight")

    def one_arg(shards):
        return shards

    def meta(shards, dst):
        out = good(shards, dst)
        out[0]["norm.weight"] = torch.empty(out[0]["norm.weight"].shape, device="meta")
        return out

    def int_keys(shards, dst):
        return [dict(enumerate(s.values())) for s in good(shards, dst)]
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text(textwrap.dedent(SOURCE))
    (tmp_path / "broken_at_import.py").write_text("import os\nVALUE = undefined_name + 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _check(name, capsys):
    code = main(["check", "--config", "toy", "--src", "1", "--dst", "2", "--resharder", name])
    return code, capsys.readouterr()


def test_a_resharder_that_raises_is_framed_with_its_own_frames(user_module, capsys):
    code, out = _check("mine:boom", capsys)
    assert code == 4
    assert ("your resharder `mine:boom` raised ValueError while resharding toy 1 -> 2: bad rows "
            "in layers.0.qkv.weight") in out.err
    assert 'mine.py", line 12, in boom' in out.err and "in _inner" in out.err
    assert "weight_sync_bench" not in out.err.split("bad rows in layers.0.qkv.weight", 1)[1]
    assert "Traceback (most recent call last)" not in out.err


def test_the_same_resharder_done_right_passes(user_module, capsys):
    code, out = _check("mine:good", capsys)
    assert code == 0 and "1 passed, 0 failed" in out.out


@pytest.mark.parametrize(("name", "message"), [
    ("mine:one_arg", "your resharder `mine:one_arg` has the wrong signature: it is "
                     "one_arg(shards), the harness calls it as fn(shards, dst)"),
    ("mine:meta", "your resharder `mine:meta` returned rank 0 norm.weight on the meta device"),
    ("mine:int_keys", "your resharder `mine:int_keys` returned a dict with non-string keys at "
                      "rank 0 (0, 1, 2, ...)"),
    ("broken_at_import:f", "your resharder `broken_at_import:f` raised NameError at import: "
                           "name 'undefined_name' is not defined"),
])
def test_user_code_that_cannot_be_called_or_returns_no_shards_is_exit_4(user_module, capsys,
                                                                       name, message):
    code, out = _check(name, capsys)
    assert code == 4 and message in out.err, out.err


def test_a_module_that_does_not_exist_is_bad_input_not_user_code(user_module, capsys):
    code, out = _check("no_such_module_anywhere:f", capsys)
    assert code == 2 and "cannot import 'no_such_module_anywhere'" in out.err
    (user_module / "imports_missing.py").write_text("import no_such_dependency\n")
    code, out = _check("imports_missing:f", capsys)  # the module is there; its import is not
    assert code == 4 and "raised ModuleNotFoundError at import" in out.err
    assert 'imports_missing.py", line 1' in out.err


def _meanings(rows: list[tuple[str, str]]) -> dict[int, str]:
    """Exit code -> what it means, in one line, without markup."""
    return {int(code): " ".join(text.replace("`", "").split()) for code, text in rows}


# Each outcome of a user's function, as both the help and the README name it, and a command
# that ends in it. The phrase must name one code in each: the one the command exits with.
OUTCOMES = [
    ("a MODULE:FUNCTION that does not exist", "no_such_module_anywhere:f"),
    ("no function of that name in it", "mine:no_such_function"),
    ("raised while its module was imported", "broken_at_import:f"),
    ("has a signature the harness cannot call", "mine:one_arg"),
    ("returned something that is not shards of the layout", "mine:meta"),
    ("your code failed", "mine:boom"),
]


@pytest.mark.parametrize(("phrase", "name"), OUTCOMES, ids=[p for p, _ in OUTCOMES])
def test_help_readme_and_code_give_each_user_code_outcome_one_exit_code(user_module, capsys,
                                                                         phrase, name):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    help_codes = _meanings(re.findall(r"^    (\d+) +(.*(?:\n {9}.*)*)", text, re.M))
    section = documentation().split("## Exit codes and machine-readable output")[1]
    readme_codes = _meanings(re.findall(r"^\| `(\d+)` \| (.*) \|$", section, re.M))
    assert set(help_codes) >= {0, 1, 2, 3, 4} and set(readme_codes) >= {0, 1, 2, 3, 4}
    in_help = [code for code, meaning in help_codes.items() if phrase in meaning]
    in_readme = [code for code, meaning in readme_codes.items() if phrase in meaning]
    code, _ = _check(name, capsys)
    assert in_help == in_readme == [code], (phrase, in_help, in_readme, code)


def test_the_api_frames_the_users_split_and_keeps_the_original_as_cause():
    def naive(full, degree):
        raise KeyError("lm_head.weight")

    with pytest.raises(UserCodeError, match=r"your splitter `.*naive` raised KeyError while "
                                            r"splitting toy for t=2: 'lm_head.weight'") as err:
        check_split(naive, TOY, 2)
    assert isinstance(err.value.__cause__, KeyError) and err.value.role == "splitter"
    assert "in naive" in err.value.user_traceback

    def meta(shards, dst):
        out = reshard(shards, LAYOUT, dst)
        out[1]["lm_head.weight"] = out[1]["lm_head.weight"].to("meta")
        return out

    with pytest.raises(InvalidUserShards, match="rank 1 lm_head.weight on the meta device"):
        check_reshard(meta, TOY, 1, 2)
    # still an InvalidShards for callers that catch that, with the layout's own words
    with pytest.raises(InvalidShards, match=r"returned shards that do not fit the layout: rank "
                                            r"1: missing norm\.weight"):
        check_split(lambda full, t: [s if r == 0 else {k: v for k, v in s.items()
                                                        if k != "norm.weight"}
                                     for r, s in enumerate(split(full, LAYOUT, t))], TOY, 2)


def test_a_keyboard_interrupt_in_user_code_is_not_framed_as_theirs():
    def interrupted(full, degree):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        check_split(interrupted, TOY, 2)


CONVERTER = """
    from weight_sync_bench import convert

    SEEN = []  # (command, the geometry, whether hf_config is that geometry's config.json)

    def megatron_to_vllm(shards, degree, *, config, hf_config):
        # a converter that knows no geometry of its own: it reads config, as the issue's
        # Llama-3-8B converter should have; called without it, it cannot run
        SEEN.append((config, hf_config == config.to_hf_config()))
        return convert(shards, "megatron", f"vllm:{degree}", config)
"""


def test_check_and_fuzz_call_a_converter_that_needs_its_config_the_same_way(
        tmp_path, monkeypatch, tolerance, capsys):
    (tmp_path / "needs_config.py").write_text(textwrap.dedent(CONVERTER))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "needs_config", raising=False)
    monkeypatch.setenv("WSB_CORPUS_DIR", str(tmp_path / "corpus"))
    # the shipped Llama-3-8B geometry as the fuzz runs it (sizes / 16, 1 layer, vocab 520),
    # given to wsb check as a config.json: the same geometry through both commands
    (llama,) = (g for g in real_geometries() if g.name == "llama3_8b")
    path = tmp_path / "llama3_8b" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(llama.to_hf_config()))
    ends = ["--from", "megatron:2", "--to", "vllm:2", "--converter",
            "needs_config:megatron_to_vllm"]
    assert main(["check", "--hf-config", str(path), "--layers", "1", "--vocab", "520",
                 "--measure-floor", *ends]) == 0
    assert "llama3_8b  megatron:2 -> vllm:2" in capsys.readouterr().out
    seen = sys.modules["needs_config"].SEEN
    assert seen == [(llama, True)] * 2  # once before the floor is measured, once checked
    seen.clear()
    assert main(["fuzz", "--examples", "3", "--seed", "1", *ends]) == 0
    out = capsys.readouterr().out
    assert "llama3_8b megatron:2 -> vllm:2 PASS" in out
    assert (llama, True) in seen  # the same geometry, handed over the same way
    assert all(ok for _, ok in seen) and len({c for c, _ in seen}) > 1  # and the drawn ones
