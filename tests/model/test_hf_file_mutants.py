"""``model.hf_file.read_hf_config``: an untrusted config.json's refusals read whole, each
naming the path as the user gave it, a symlink's included."""

from __future__ import annotations

import pytest

from weight_sync_bench.errors import InvalidConfig
from weight_sync_bench.model.hf_file import read_hf_config


def refusal(path) -> str:
    with pytest.raises(InvalidConfig) as err:
        read_hf_config(path)
    return str(err.value)


def test_a_symlink_is_named_as_given_not_as_resolved(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "config.json").symlink_to(tmp_path / "dir")
    assert refusal(tmp_path / "config.json") == (
        f"{tmp_path}/config.json: a directory, not a regular file (an HF config.json)")
    (tmp_path / "real.json").write_text('{"a": 1}')
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    assert read_hf_config(tmp_path / "link.json") == {"a": 1}  # the twin


def test_a_path_through_a_file_cannot_be_read_and_says_why(tmp_path):
    (tmp_path / "f").write_text("{}")
    assert refusal(tmp_path / "f" / "config.json") == (
        f"{tmp_path}/f/config.json: cannot read the HF config.json (Not a directory)")


def test_a_path_with_a_nul_byte_is_not_a_path():
    assert refusal("con\0fig.json") == (
        "'con\\x00fig.json': not a path (embedded null byte)")


def test_json_nested_too_deeply_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    assert refusal(tmp_path / "config.json") == (
        f"{tmp_path}/config.json: JSON nested too deeply to be an HF config.json")
    (tmp_path / "config.json").write_text("[" * 10 + "]" * 10)  # the twin: refused as a list
    assert refusal(tmp_path / "config.json") == (
        f"{tmp_path}/config.json: an HF config is a JSON object, got list")
