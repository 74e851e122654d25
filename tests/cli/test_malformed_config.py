"""A malformed ``--hf-config`` is bad input, whichever command reads it: exit 2, one line on
stderr naming the problem, never a traceback (exit 3 is the harness's own fault).

A table of malformed files (``CASES``: what is wrong with the file as a file, as JSON, or
in one of the fields ``ModelConfig.from_hf_config`` reads) is walked through every command
that takes ``--hf-config`` (``COMMANDS``), in process. A FIFO runs under a SIGALRM
deadline, so that a read that blocks fails the test rather than hangs it. The twin: the
well-formed file the cases are edits of gets past the same parse in every command.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from weight_sync_bench.cli.main import main
from weight_sync_bench.errors import WsbError
from weight_sync_bench.model.config import ModelConfig
from weight_sync_bench.model.hf_file import MAX_HF_CONFIG_BYTES

# Hidden 64, 8 heads of 8, 2 KV heads: a small Llama that every command below accepts.
GOOD = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
        "num_hidden_layers": 2, "vocab_size": 256, "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5}
MOE = {**GOOD, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
       "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "norm_topk_prob": True}


def edit(base=GOOD, **changes):
    """``base`` with ``changes`` (a value of ``...`` removes the field), as JSON text."""
    data = {k: v for k, v in {**base, **changes}.items() if v is not ...}
    return json.dumps(data)


# (id, file contents (text, bytes, or a callable that makes the path), what the message says)
CASES = [
    # -- the file as a file
    ("directory", lambda path: path.mkdir(), "case/config.json: a directory, not a regular file"),
    ("missing", lambda path: None, "no such HF config.json"),
    ("too-large", lambda path: path.open("wb").truncate(MAX_HF_CONFIG_BYTES + 1),
     "config.json: larger than 16,777,216 bytes (16 MiB)"),  # a sparse file: nothing is written or read
    ("not-utf8", b'{"hidden_size": 64, "name": "\xff\xfe"}', "config.json: not UTF-8 (byte 29: b'\\xff')"),
    ("binary", bytes(range(256)), "not UTF-8"),
    ("empty", "", "config.json: empty, not an HF config.json"),
    ("blank", " \n\t", "config.json: empty, not an HF config.json"),
    # -- the file as JSON
    ("not-json", "hidden_size: 64", "not valid JSON"),
    ("truncated", edit()[:-20], "not valid JSON"),
    ("json-list", "[1, 2, 3]", "an HF config is a JSON object, got list"),
    ("json-string", '"config"', "an HF config is a JSON object, got str"),
    ("nan", edit().replace("500000.0", "NaN"), "NaN is not JSON"),
    ("nested", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("5000-digit-int", edit(hidden_size=10**40).replace(str(10**40), "9" * 5000),
     "not valid JSON"),
    # -- the fields (each an edit of GOOD)
    ("no-hidden-size", edit(hidden_size=...), "HF config has no 'hidden_size'"),
    ("zero-heads", edit(num_attention_heads=0, head_dim=...),
     "'num_attention_heads' is 0, expected an int in 1..2147483647"),
    ("negative-ffn", edit(intermediate_size=-96), "'intermediate_size' is -96"),
    ("huge-hidden", edit(hidden_size=10**12), "'hidden_size' is 1000000000000, expected an "
                                              "int in 1..2147483647 (2^31-1)"),
    ("float-layers", edit(num_hidden_layers=4.5), "'num_hidden_layers' is 4.5, expected int"),
    ("float-integral", edit(vocab_size=256.0), "'vocab_size' is 256.0, expected int"),
    ("string-vocab", edit(vocab_size="256"), "'vocab_size' is '256', expected int"),
    ("bool-kv-heads", edit(num_key_value_heads=True), "'num_key_value_heads' is True"),
    ("bool-head-dim", edit(head_dim=False), "'head_dim' is False"),
    ("heads-not-grouped", edit(num_key_value_heads=3),
     "num_attention_heads % num_key_value_heads == 0 (num_attention_heads=8, "
     "num_key_value_heads=3)"),
    ("more-kv-than-heads", edit(num_key_value_heads=16),
     "(num_attention_heads=8, num_key_value_heads=16)"),
    ("odd-head-dim", edit(head_dim=7), "'head_dim' is 7: RoPE rotates pairs"),
    ("hidden-not-heads", edit(hidden_size=65, head_dim=...),
     "hidden_size % num_attention_heads != 0 (hidden_size=65, num_attention_heads=8)"),
    ("negative-rope", edit(rope_theta=-1.0), "'rope_theta' is -1.0, expected a finite"),
    ("infinite-eps", edit().replace("1e-05", "1e999"), "'rms_norm_eps' is inf"),
    ("top-k-past-experts", edit(MOE, num_experts_per_tok=8),
     "'num_experts_per_tok' is 8: a token chooses at most every expert (num_experts=4)"),
    ("zero-experts", edit(MOE, num_experts=0), "'num_experts' is 0"),
    ("text-dense-layers", edit(MOE, mlp_only_layers=["0"]), "'mlp_only_layers' is ['0']"),
]

# Every command that takes --hf-config, with what else it needs to get as far as reading it.
COMMANDS = {
    "check": lambda tmp: ["check", "--layers", "1"],
    "layout": lambda tmp: ["layout"],
    "emit": lambda tmp: ["emit", "--convention", "hf", "--layers", "1", str(tmp / "emitted")],
    "verify": lambda tmp: ["verify", "--convention", "hf", "--layers", "1", str(tmp / "none")],
    "sync": lambda tmp: ["sync", "--layers", "1", "--no-forward"],
    "floor geometry": lambda tmp: ["floor", "geometry", "--layers", "1", "--kernel-sets",
                                   "current", "--out", str(tmp / "floor.json")],
}


def make(tmp_path: Path, contents) -> Path:
    """The config file of one case, under ``tmp_path/case/``."""
    path = tmp_path / "case" / "config.json"
    path.parent.mkdir()
    if callable(contents):
        contents(path)
    elif isinstance(contents, bytes):
        path.write_bytes(contents)
    else:
        path.write_text(contents)
    return path


def one_line_refusal(err: str, command: str) -> str:
    """The message of a refusal: one line ``wsb <command>: ...``, no traceback."""
    assert "Traceback" not in err and "internal error" not in err, err
    assert err.endswith("\n") and err.count("\n") == 1, err
    prefix = f"wsb {command.split()[0]}: "
    assert err.startswith(prefix), err
    return err[len(prefix):]


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize(("contents", "says"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_malformed_hf_config_is_exit_2_naming_the_problem(tmp_path, capsys, command,
                                                            contents, says):
    path = make(tmp_path, contents)
    assert main([*COMMANDS[command](tmp_path), "--hf-config", str(path)]) == 2
    message = one_line_refusal(capsys.readouterr().err, command)
    assert says in message, message
    assert "case" in message  # the file, or the label made of its directory, is named


def test_a_well_formed_hf_config_gets_past_the_same_parse_in_every_command(
        tmp_path, capsys, monkeypatch):
    """The twin: the file every case edits is parsed by every command (stopped right after
    the parse, so nothing is built or measured), so the refusals above are the cases'."""
    parsed: list[ModelConfig] = []
    real = ModelConfig.from_hf_config.__func__

    def parse_then_stop(cls, *args, **kwargs):
        parsed.append(real(cls, *args, **kwargs))
        raise WsbError("parsed")

    monkeypatch.setattr(ModelConfig, "from_hf_config", classmethod(parse_then_stop))
    for base in (GOOD, MOE):
        for command, argv in COMMANDS.items():
            path = tmp_path / command / base["architectures"][0] / "config.json"
            path.parent.mkdir(parents=True)
            path.write_text(edit(base))
            assert main([*argv(tmp_path), "--hf-config", str(path)]) == 2
            assert one_line_refusal(capsys.readouterr().err, command) == "parsed\n"
    assert len(parsed) == 2 * len(COMMANDS)
    assert {(c.d_model, c.n_heads, c.n_kv_heads, c.n_experts) for c in parsed} == {
        (64, 8, 2, 0), (64, 8, 2, 4)}


class _Blocked(BaseException):
    """Raised by the SIGALRM handler: a read that blocks fails the test."""


def test_a_fifo_is_refused_without_opening_it(tmp_path, capsys):
    """A FIFO nobody writes to would block a plain ``open`` for ever: it is opened
    non-blocking and refused by the ``fstat`` of what was opened, in every command. Under a
    SIGALRM deadline, so a regression fails here rather than hangs the suite: a blocked
    ``open`` or ``read`` returns EINTR and the handler's exception ends it. (It ran in a
    subprocess with a timeout: an interpreter start, 3 s, for the same guard.)"""
    fifo = tmp_path / "case" / "config.json"
    fifo.parent.mkdir()
    os.mkfifo(fifo)

    def blocked(signum, frame):
        raise _Blocked("a command blocked on the FIFO for 30 s")

    results = {}
    previous = signal.signal(signal.SIGALRM, blocked)
    try:
        for command, argv in COMMANDS.items():
            # per command, so a command that swallows the exception cannot leave the next
            # one unguarded; only a hang detector: ~0.1 s a command when idle
            signal.setitimer(signal.ITIMER_REAL, 30.0)
            code = main([*argv(tmp_path), "--hf-config", str(fifo)])
            results[command] = (code, capsys.readouterr().err)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert list(results) == list(COMMANDS)
    for command, (code, err) in results.items():
        assert code == 2, (command, err)
        message = one_line_refusal(err, command)
        assert message == (f"{fifo}: a FIFO (named pipe), not a regular file (an HF "
                           "config.json)\n"), message
