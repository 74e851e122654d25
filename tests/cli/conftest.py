"""Fixtures of the CLI tests: a user's Hugging Face ``config.json`` on disk."""

from __future__ import annotations

import json

import pytest

from tests.hf_configs import TINY_LLAMA


@pytest.fixture
def write_config(tmp_path):
    """``write_config(name, **fields)``: ``TINY_LLAMA`` with ``fields`` changed, written to
    ``<tmp>/<name>/config.json`` (a geometry is named by its directory); its path."""
    def write(name: str = "tiny_llama", **fields: object):
        path = tmp_path / name / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps({**TINY_LLAMA, **fields}))
        return path
    return write


@pytest.fixture
def tiny(write_config):
    """A user's config.json: ``TINY_LLAMA`` as it is."""
    return write_config()
