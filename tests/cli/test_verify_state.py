"""``wsb verify-state``: an engine's rank dumps against the synced weights, from the command
line. The stand-in engine is ``wsb emit``'s per-rank files of the destination layout (what a
correct sync leaves); one tensor replaced by the previous weights' is named stale, exit 1;
the same dumps pass with the weights given as an HF directory; an unreadable input is exit
2 naming it."""

from __future__ import annotations

import json

from safetensors.torch import load_file, save_file

from weight_sync_bench.cli import main

RANK1 = "model-rank-1-part-0.safetensors"
QKV = "model.layers.1.self_attn.qkv_proj.weight"


def _emit(directory, convention, seed):
    assert main(["emit", "--config", "toy_kv4", "--convention", convention, "--seed", str(seed),
                 "-q", str(directory)]) == 0


def test_a_synced_engine_passes_and_a_stale_tensor_is_named(tmp_path, capsys):
    state, old = tmp_path / "state", tmp_path / "old"
    _emit(state, "vllm:2", 0)
    _emit(old, "vllm:2", 1)
    capsys.readouterr()
    base = ["verify-state", "--endpoint", "vllm:2", "--config", "toy_kv4", "--seed", "0",
            "--previous-seed", "1"]
    assert main([*base, str(state)]) == 0
    out = capsys.readouterr().out
    assert "PASS vllm:2 rank 0: 27 equal" in out and "2 passed, 0 failed" in out
    # the twin: rank 1's layer-1 qkv restored from the previous weights
    held = load_file(str(state / RANK1))
    held[QKV] = load_file(str(old / RANK1))[QKV]
    save_file(held, str(state / RANK1))
    assert main([*base, "--json", str(state)]) == 1
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    (failed,) = [r for r in records if r.get("passed") is False]
    assert failed["rank"] == 1 and failed["counts"] == {"equal": 26, "stale": 1}
    assert failed["outcomes"][0]["name"] == QKV and failed["outcomes"][0]["outcome"] == "stale"
    assert "layer 1: 5 equal, 1 stale" in failed["coverage"]


def test_the_weights_as_an_hf_directory_and_the_geometry_it_states(tmp_path, capsys,
                                                                   monkeypatch):
    from collections import Counter

    from weight_sync_bench.conventions.checkpoint import LazyTensors

    state, weights = tmp_path / "state", tmp_path / "weights"
    _emit(state, "vllm:2", 0)
    _emit(weights, "hf", 0)
    capsys.readouterr()
    code = main(["verify-state", "--endpoint", "vllm:2", "--weights", str(weights), "--rank",
                 "1", str(state)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "geometry: toy_kv4" in out and "PASS vllm:2 rank 1" in out and "rank 0" not in out
    # both ranks: every tensor of both directories read exactly once (a parameter's HF
    # tensors once for both ranks' cuts of it)
    reads: Counter = Counter()
    original = LazyTensors.__getitem__
    monkeypatch.setattr(LazyTensors, "__getitem__", lambda self, name: reads.update(
        [(self.where[name], name)]) or original(self, name))
    assert main(["verify-state", "--endpoint", "vllm:2", "--weights", str(weights), "-q",
                 str(state)]) == 0
    assert set(reads.values()) == {1}, [k for k, n in reads.items() if n > 1]
    assert len(reads) == 2 * 27 + 4 * 9 + 3  # the dumps; HF: 9 tensors a layer, and 3 more


def test_unreadable_input_is_exit_2_naming_it(tmp_path, capsys):
    code = main(["verify-state", "--endpoint", "vllm:2", "--config", "toy_kv4", "--seed", "0",
                 str(tmp_path / "nowhere")])
    assert code == 2 and "no such directory of rank dumps" in capsys.readouterr().err
    code = main(["verify-state", "--endpoint", "vllm:2", "--config", "toy_kv4", "--seed", "0",
                 "--rank", "2", str(tmp_path)])
    assert code == 2 and "--rank 2: vllm:2 has ranks 0..1" in capsys.readouterr().err


def test_rank_needs_only_its_own_dump_and_is_counted_once(tmp_path, capsys):
    state = tmp_path / "state"
    _emit(state, "vllm:2", 0)
    (state / "model-rank-0-part-0.safetensors").unlink()
    capsys.readouterr()
    base = ["verify-state", "--endpoint", "vllm:2", "--config", "toy_kv4", "--seed", "0"]
    assert main([*base, "--rank", "1", "--rank", "1", str(state)]) == 0
    assert "1 passed, 0 failed" in capsys.readouterr().out
    assert main([*base, str(state)]) == 2  # every rank: rank 0's dump is missing, named
    assert "model-rank-0-part-0.safetensors: missing" in capsys.readouterr().err


def test_the_weights_as_a_megatron_legacy_checkpoint(tmp_path, capsys):
    """The trainer's own checkpoint (Megatron TP 2 x PP 2, legacy torch format) against the
    engine's vllm:2 dumps of the same weights: passes, at the degrees its args state or
    given with --weights-from; given other degrees than it was saved at, the missing rank
    file is named (exit 2)."""
    from weight_sync_bench.conventions import endpoint, materialize
    from weight_sync_bench.conventions.checkpoint import write_megatron_legacy
    from weight_sync_bench.model.config import TOY_KV4, init_params

    state, trainer = tmp_path / "state", tmp_path / "trainer"
    _emit(state, "vllm:2", 0)
    at = endpoint("megatron:tp=2,pp=2")
    write_megatron_legacy(trainer, materialize(at.pieces(TOY_KV4), init_params(TOY_KV4, 0)),
                          at, TOY_KV4)
    capsys.readouterr()
    base = ["verify-state", "--endpoint", "vllm:2", "--config", "toy_kv4", "--weights",
            str(trainer)]
    assert main([*base, "--weights-from", "megatron:tp=2,pp=2", str(state)]) == 0
    assert "2 passed, 0 failed" in capsys.readouterr().out
    assert main([*base, str(state)]) == 0
    assert "2 passed, 0 failed" in capsys.readouterr().out
    assert main([*base, "--weights-from", "megatron:tp=2", str(state)]) == 2
    assert "mp_rank_00/model_optim_rng.pt: missing" in capsys.readouterr().err


def test_the_weights_as_a_megatron_torch_dist_checkpoint(tmp_path, capsys):
    """The trainer's torch_dist checkpoint against the engine's vllm:2 dumps, the geometry
    from the dumps' config.json (the checkpoint's args checked against it): passes; the
    dumps of another seed's weights fail (exit 1). TOY_KV4 with a vocabulary of 256, given
    to ``wsb emit`` as a config.json: writing TOY_KV4's 32000-row embedding and head in
    torch_dist took most of the test's time."""
    from weight_sync_bench.conventions import endpoint
    from weight_sync_bench.conventions.checkpoint import write_megatron_dist
    from weight_sync_bench.model.config import TOY_KV4, ModelConfig, init_params

    path = tmp_path / "toy_kv4_v256.json"
    path.write_text(json.dumps(TOY_KV4.replace(vocab=256).to_hf_config()))
    small = ModelConfig.from_hf_config(path, n_layers=TOY_KV4.n_layers, vocab=256)
    state, other, trainer = tmp_path / "state", tmp_path / "other", tmp_path / "trainer"
    for directory, seed in ((state, 0), (other, 1)):
        assert main(["emit", "--hf-config", str(path), "--layers", str(TOY_KV4.n_layers),
                     "--vocab", "256", "--convention", "vllm:2", "--seed", str(seed), "-q",
                     str(directory)]) == 0
    write_megatron_dist(trainer, init_params(small, 0), endpoint("megatron:2"), small)
    capsys.readouterr()
    base = ["verify-state", "--endpoint", "vllm:2", "--weights", str(trainer)]
    assert main([*base, str(state)]) == 0
    assert "2 passed, 0 failed" in capsys.readouterr().out
    assert main([*base, str(other)]) == 1
    assert "0 passed, 2 failed" in capsys.readouterr().out
