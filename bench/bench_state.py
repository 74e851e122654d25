"""``wsb verify-state`` at a real width against reading the same bytes with ``safe_open``
alone, side by side in one run.

The trainer's weights: Llama-3-8B's width (``--hf-config llama3_8b``: hidden 4096, 32 heads,
8 KV heads, intermediate 14336) at ``layers`` layers and a ``vocab``-row vocabulary, fp32,
written by ``write_checkpoint`` in the HF layout (``wsb emit --convention hf``); the
engine's state: the same weights as ``vllm:2`` rank dumps (a correct sync). Each round, in
turn: **read** every tensor of both directories with ``safe_open(...).get_tensor`` and
nothing else (the floor: the bytes have to come off the page cache anyway), then **verify**
both ranks (``hf_weights`` + ``read_rank_dumps`` + ``verify_ranks``, what the command runs).
Wall and CPU time (``time.process_time``) per phase, medians over the rounds, and the
ratio; peak memory of a verify: the kernel's resident-set high-water mark above what the
process held before (``memory.reset_peak``), against the largest single tensor. Prints;
asserts only that the correct sync passes.

    python bench/bench_state.py [rounds] [layers] [vocab]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

from weight_sync_bench.check.state import verify_ranks
from weight_sync_bench.conventions import endpoint, shards_for
from weight_sync_bench.conventions.checkpoint import (
    hf_weights,
    read_rank_dumps,
    write_checkpoint,
)
from weight_sync_bench.memory import reset_peak, rss, trim
from weight_sync_bench.model.config import ModelConfig, hf_config_file


def read_all(*directories: Path) -> int:
    """Every tensor of every safetensors file under ``directories``, read into memory (a
    copy out of the file's mapping: ``get_tensor`` alone maps the file and reads nothing)
    and dropped."""
    n = 0
    for directory in directories:
        for path in sorted(directory.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    n += f.get_tensor(name).clone().numel()
    return n


def verify(weights: Path, state: Path, config: ModelConfig) -> bool:
    where = endpoint("vllm:2")
    reports = verify_ranks(read_rank_dumps(state, where), where,
                           hf_weights(weights, endpoint("hf"), config), config=config)
    return all(r.passed for r in reports)


def timed(fn) -> tuple[float, float, object]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def main(rounds: int = 3, layers: int = 1, vocab: int = 32000) -> int:
    torch.set_num_threads(1)
    config = ModelConfig.from_hf_config(hf_config_file("llama3_8b"), n_layers=layers,
                                        vocab=vocab)
    largest = max(torch.Size(s).numel() for s in config.param_shapes().values()) * 4
    with tempfile.TemporaryDirectory(prefix="wsb-bench-state-") as scratch:
        weights, state = Path(scratch) / "weights", Path(scratch) / "state"
        started = time.perf_counter()
        write_checkpoint(weights, shards_for(config, "hf"), endpoint("hf"), config)
        write_checkpoint(state, shards_for(config, "vllm", 2), endpoint("vllm:2"), config)
        size = sum(p.stat().st_size for d in (weights, state) for p in d.iterdir())
        print(f"{config.name}: {layers} layer(s), vocab {vocab}, fp32; {size / 1e9:.2f} GB on "
              f"disk in both directories (written in {time.perf_counter() - started:.0f} s); "
              f"largest tensor {largest / 1e6:.0f} MB; load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        reads, checks, peaks = [], [], []
        for _ in range(rounds):  # interleaved
            reads.append(timed(lambda: read_all(weights, state))[:2])
            trim()
            reset_peak()
            before = rss()
            wall, cpu, passed = timed(lambda: verify(weights, state, config))
            after = rss()
            assert passed, "the correct sync must pass"
            checks.append((wall, cpu))
            if before and after:
                peaks.append(after[1] - before[0])
    read_wall, read_cpu = (statistics.median(x[i] for x in reads) for i in (0, 1))
    check_wall, check_cpu = (statistics.median(x[i] for x in checks) for i in (0, 1))
    print(f"{'':<28}{'wall s':>8}{'cpu s':>8}")
    print(f"{'safe_open, every tensor':<28}{read_wall:>8.2f}{read_cpu:>8.2f}")
    print(f"{'verify-state, both ranks':<28}{check_wall:>8.2f}{check_cpu:>8.2f}")
    print(f"ratio (verify / read): wall {check_wall / read_wall:.2f}x, cpu "
          f"{check_cpu / read_cpu:.2f}x ({rounds} interleaved rounds, medians)")
    if peaks:
        peak = max(peaks)
        print(f"peak memory of a verify above what the process held: {peak / 1e6:.0f} MB = "
              f"{peak / largest:.2f}x the largest tensor")
    return 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:4])))
