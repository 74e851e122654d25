"""Real widths on one machine: the streamed check's peak memory against the model's size, and
its wall time against the bare forwards it runs. Prints; asserts nothing.

    python bench/bench_width.py            # both, as make bench runs it (about 10 minutes)
    python bench/bench_width.py memory [--layers 2] [--dtype fp32] [--only NAME ...]
    python bench/bench_width.py memory --backend gloo [--layers 1] [--only NAME ...]
    python bench/bench_width.py overhead [--layers 2] [--degree 8] [--tokens 128]

``memory``: for each shipped geometry at full width (Llama-3-8B, Qwen2.5-7B, Mistral-7B,
Mistral-Nemo (head_dim 128 != 5120 / 32), and Llama-3-70B's width, d_model 8192, 64 heads,
8 KV heads, ffn 28672, vocab 128256) a streamed check of a user's split (written per parameter,
``per="parameter"``) at the largest degree the geometry allows up to 8, and of a user's
reshard from that degree to its half, each in a fresh process of its own: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (the process's
RSS high-water mark) after the check, less the RSS after the imports, against the largest
parameter's bytes and the whole model's. The claim is peak - baseline <= 3 x the largest
parameter + activations (``check.stream``). ``--backend gloo``: the same checks with one
process per rank (``stream_run``, the declared split or reshard on rank 0: a user's function
must be importable by the rank processes, and a closure is not), each rank's high-water mark
since its task began (``VmHWM``, reset at the start) against the same bound.

The threshold: at these widths no floor is committed, and a per-geometry one
(``python -m weight_sync_bench.tolerance geometry --hf-config PATH --layers N``) costs four
more streamed passes per degree; the memory rows pass ``threshold=inf`` and report the
byte comparison and the deviation. The deviation of a correct layout is the floor sample.

``overhead``: Llama-3-8B's width, 2 layers, t=8, one batch of 128 tokens. The streamed
check's wall time against the time spent inside the reference and sharded forward steps it
runs (``ReferenceModel.begin / step / finish`` and ``ShardedModel``'s, timed by wrapping them
here), with the rest broken down: drawing the parameters, the user's split (a per-parameter
one, ``per="parameter"``; its time is the user's code, reported apart), comparing bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from weight_sync_bench.check import streaming as streaming_module
from weight_sync_bench.check.stream import (
    largest_param_bytes,
    model_bytes,
    stage_reshard,
    stage_split,
    stream_check,
    stream_run,
)
from weight_sync_bench.collectives.gloo.pool import RankPool
from weight_sync_bench.model import config as config_module
from weight_sync_bench.model import stepwise as stepwise_module
from weight_sync_bench.model.config import ModelConfig, hf_config_path, parse_dtype
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.sharded import ShardedModel

GEOMETRIES = ("llama3_8b", "qwen2_5_7b", "mistral_7b", "mistral_nemo", "llama3_70b_width")


def geometry(name: str, layers: int) -> ModelConfig:
    """A shipped geometry at full width, ``layers`` deep, with its real vocabulary."""
    if name == "llama3_70b_width":  # no config.json shipped; Llama-3-70B's published widths
        base = ModelConfig.from_hf_config(hf_config_path("llama3_8b"), n_layers=layers)
        return base.replace(name=name, d_model=8192, n_heads=64, n_kv_heads=8, head_dim=128,
                            ffn=28672)
    return ModelConfig.from_hf_config(hf_config_path(name), n_layers=layers)


def largest_degree(config: ModelConfig) -> int:
    return max(t for t in layout_for(config).supported_degrees() if t <= 8)


def rss_bytes() -> int:
    """This process's RSS high-water mark (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one(args: argparse.Namespace) -> int:
    """In a fresh process: one streamed check, its figures as one JSON line."""
    torch.set_num_threads(1)
    config = geometry(args.geometry, args.layers)
    layout = layout_for(config)  # a user's split and reshard, written per parameter
    split_fn, reshard_fn = stage_split(layout), stage_reshard(layout)

    baseline = current_rss()
    started = time.perf_counter()
    ranks: tuple[tuple[int, int], ...] = ()
    if args.backend == "gloo":  # the declared split on rank 0 (a closure cannot reach it)
        with RankPool(args.dst, deadline=1800.0, pg_timeout=3600.0) as pool:  # a full width, loaded
            verdict, ranks = stream_run(config, args.dst, src=args.src, dtype=args.dtype,
                                        per="parameter", threshold=math.inf,
                                        backend="gloo", pool=pool)
    else:
        verdict = stream_check(config, args.dst, src=args.src, dtype=args.dtype,
                               fn=split_fn if args.src is None else reshard_fn,
                               per="parameter", threshold=math.inf)
    wall = time.perf_counter() - started
    print(json.dumps({
        "geometry": config.name, "layers": config.n_layers, "dtype": args.dtype,
        "src": args.src, "dst": args.dst, "wall_s": wall, "peak": rss_bytes(),
        "baseline": baseline, "largest": largest_param_bytes(config, args.dtype),
        "model": model_bytes(config, args.dtype), "n_params": config.n_params,
        "max_abs_error": verdict.max_abs_error, "bytes_equal": verdict.first_mismatch is None,
        "activations": activation_bytes(config, args.dst), "backend": args.backend,
        "ranks": [list(r) for r in ranks]}))
    return 0


def activation_bytes(config: ModelConfig, degree: int) -> int:
    """Logits dominate the activations: the reference's, each rank's vocab slice, the
    gathered copy per rank (fp32, ``(B, T, V)``), and the residual streams."""
    logits = config.batch * config.seq_len * config.padded_vocab * 4
    return logits * (2 + degree) + 8 * degree * config.batch * config.seq_len * config.ffn * 4


def memory(args: argparse.Namespace) -> int:
    rows = []
    for name in args.only or GEOMETRIES:
        layers = 1 if name == "llama3_70b_width" else args.layers
        config = geometry(name, layers)
        t = largest_degree(config)
        for src, dst in ((None, t), (t, max(1, t // 2))):
            argv = [sys.executable, __file__, "one", "--geometry", name, "--layers",
                    str(layers), "--dst", str(dst), "--dtype", args.dtype,
                    "--backend", args.backend]
            if src is not None:
                argv += ["--src", str(src)]
            print(f"{name} {'split' if src is None else src} -> {dst} ...", flush=True)
            run = subprocess.run(argv, check=False, capture_output=True, text=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
            if run.returncode != 0:
                print(run.stderr[-2000:])
                return 1
            rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
    print(format_memory(rows))
    if args.backend == "gloo":
        print()
        print(format_ranks(rows))
    return 0


def format_ranks(rows: list[dict]) -> str:
    """Under gloo: each rank's peak less its RSS when the task began, against the bound."""
    gib = 2.0 ** 30
    table = [["geometry", "route", "rank 0 GiB", "x largest", "other ranks GiB (max)",
              "x largest", "bound 3x+act", "caller peak - base GiB"]]
    for r in rows:
        used = [peak - began for began, peak in r["ranks"]]
        bound = 3 * r["largest"] + r["activations"]
        others = max(used[1:], default=0)
        table.append([r["geometry"], f"{'split' if r['src'] is None else r['src']} -> {r['dst']}",
                      f"{used[0] / gib:.2f}", f"{used[0] / r['largest']:.2f}",
                      f"{others / gib:.2f}", f"{others / r['largest']:.2f}",
                      "within" if max(used) <= bound else "OVER",
                      f"{(r['peak'] - r['baseline']) / gib:.2f}"])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in table)


def format_memory(rows: list[dict]) -> str:
    gib = 2.0 ** 30
    table = [["geometry", "L", "dtype", "route", "params", "model GiB", "largest GiB",
              "peak - base GiB", "x largest", "x model", "bound 3x+act", "bytes equal",
              "max |error|", "wall s"]]
    for r in rows:
        used = r["peak"] - r["baseline"]
        bound = 3 * r["largest"] + r["activations"]
        table.append([r["geometry"], str(r["layers"]), r["dtype"],
                      f"{'split' if r['src'] is None else r['src']} -> {r['dst']}",
                      f"{r['n_params'] / 1e9:.2f}e9", f"{r['model'] / gib:.2f}",
                      f"{r['largest'] / gib:.2f}", f"{used / gib:.2f}",
                      f"{used / r['largest']:.2f}", f"{used / r['model']:.2f}",
                      "within" if used <= bound else "OVER", str(r["bytes_equal"]),
                      f"{r['max_abs_error']:.3g}", f"{r['wall_s']:.1f}"])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in table)


def overhead(args: argparse.Namespace) -> int:
    """The streamed check against the forward steps inside it, timed by wrapping them."""
    torch.set_num_threads(1)
    config = geometry("llama3_8b", args.layers).replace(batch=1, seq_len=args.tokens)
    spent: dict[str, float] = defaultdict(float)

    def timed(cls: type, method: str, bucket: str) -> None:
        original = getattr(cls, method)

        def wrapper(*a: object, **k: object) -> object:
            t0 = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                spent[bucket] += time.perf_counter() - t0
        setattr(cls, method, wrapper)

    for method in ("begin", "step", "finish"):  # what a streamed check calls (block, end: steps)
        timed(ReferenceModel, method, "reference forward")
        timed(ShardedModel, method, "sharded forward")
    timed(config_module, "draw_param", "drawing parameters")
    timed(streaming_module, "bit_equal", "byte comparison")
    timed(stepwise_module, "computing", "upcast (bf16 / fp16)")
    for module in (streaming_module, stepwise_module):  # each hands the freed heap back
        timed(module, "trim", "freed heap handed back (malloc_trim)")
    split = stage_split(layout_for(config))

    def users_split(full: dict, degree: int) -> list:  # the user's code: its own bucket
        t0 = time.perf_counter()
        try:
            return split(full, degree)
        finally:
            spent["the user's split (its own code)"] += time.perf_counter() - t0

    started = time.perf_counter()
    verdict = stream_check(config, args.degree, fn=users_split, per="parameter",
                           dtype=args.dtype, threshold=math.inf)
    wall = time.perf_counter() - started
    forwards = spent["reference forward"] + spent["sharded forward"]
    print(f"{config.name}, {config.n_layers} layers, t={args.degree}, {config.batch}x"
          f"{config.seq_len} tokens, {args.dtype}: {config.n_params:,} parameters, "
          f"max |error| {verdict.max_abs_error:.3g}, bytes equal "
          f"{verdict.first_mismatch is None}")
    rows = [("check wall time", wall), ("bare forwards (reference + sharded)", forwards)]
    rows += sorted(spent.items(), key=lambda kv: -kv[1])
    rows.append(("other", wall - sum(spent.values())))
    for label, seconds in rows:
        print(f"  {label:<40} {seconds:8.2f} s  {seconds / forwards:6.2f}x the bare forwards")
    harness = wall - spent["the user's split (its own code)"]
    print(f"overhead ratio: {wall / forwards:.2f}x with the user's split, {harness / forwards:.2f}x "
          "without it (target <= 1.3x)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/bench_width.py")
    sub = parser.add_subparsers(dest="command")
    m = sub.add_parser("memory")
    m.add_argument("--layers", type=int, default=2)
    m.add_argument("--dtype", default="fp32")
    m.add_argument("--only", action="append", choices=GEOMETRIES)
    m.add_argument("--backend", choices=["inprocess", "gloo"], default="inprocess",
                   help="gloo: one process per rank; each rank's peak is reported")
    o = sub.add_parser("overhead")
    o.add_argument("--layers", type=int, default=2)
    o.add_argument("--degree", type=int, default=8)
    o.add_argument("--tokens", type=int, default=128)
    o.add_argument("--dtype", default="fp32")
    x = sub.add_parser("one")
    x.add_argument("--geometry", choices=GEOMETRIES, required=True)
    x.add_argument("--layers", type=int, required=True)
    x.add_argument("--src", type=int, default=None)
    x.add_argument("--dst", type=int, required=True)
    x.add_argument("--dtype", default="fp32")
    x.add_argument("--backend", choices=["inprocess", "gloo"], default="inprocess")
    args = parser.parse_args(argv)
    if args.command is None:  # make bench: both, with their defaults
        return memory(parser.parse_args(["memory"])) or overhead(parser.parse_args(["overhead"]))
    parse_dtype(args.dtype)
    return {"memory": memory, "overhead": overhead, "one": one}[args.command](args)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
