"""Fixtures of the CLI tests: a user's Hugging Face ``config.json`` on disk."""

from __future__ import annotations

import json

import pytest

# a small Llama, four layers deep (``--layers`` reduces it)
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 8, "num_key_value_heads": 2,
              "num_hidden_layers": 4, "vocab_size": 512, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": False}


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
