"""Full-width `wsb check` of every shipped geometry, one process per check, in sequence:
wall time and peak RSS of each, against the model's size. Prints a table; asserts nothing.

    python bench/bench_full_width.py [--layers 1] [--only NAME ...] [--routes split,reshard,convert]
                                     [--degrees all|split-all|max] [--dtype fp32] [--out DIR]

For each geometry (the shipped config.json files, and Llama-3-70B's width: d_model 8192,
64 heads, 8 KV heads, ffn 28672, vocab 128256, built as ``bench_width.geometry`` builds it and
written as a config.json under ``--out``) at ``--layers`` layers and its real vocabulary:

- ``split``: ``wsb check --hf-config X --layers N --dst T --splitter MOD:split --stream
  parameter``, the harness's own split written per parameter (``stream.stage_split``), at
  every degree the geometry allows up to 8 (``--degrees max``: the largest only);
- ``reshard``: the default invariant path streamed, ``--src Tmax --dst T`` for every other
  allowed T (the declared split at the largest degree resharded per parameter;
  ``--degrees split-all`` and ``max``: T = Tmax / 2 only);
- ``convert``: ``--converter MOD:convert --from megatron:Tmax --to vllm:T --stream
  parameter`` for every allowed T (``--degrees split-all`` and ``max``: T = Tmax / 2 only),
  the harness's own converter written per stage (``convert.stage_convert``).

Each check reads the geometry's floor from ``tolerance/geometry/`` (measured once with
``python -m weight_sync_bench.tolerance geometry --hf-config PATH --layers N``); a geometry
without one is reported as refused (exit 2), never measured here. Peak RSS is the child's
``ru_maxrss`` (``os.wait4``), against 3x the largest parameter plus the baseline of a
process that imported the harness. The JSON of every row goes to ``--out``/results.json
(default a fresh temporary directory, never the checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from weight_sync_bench.check.stream import largest_param_bytes, model_bytes
from weight_sync_bench.model.config import HF_CONFIGS, ModelConfig, hf_config_path
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.tolerance.rules import cached_floor_path

ROOT = Path(__file__).resolve().parents[1]
WIDTH_70B = {"hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
             "intermediate_size": 28672, "head_dim": 128}
GEOMETRIES = (*HF_CONFIGS, "llama3_70b_width")


def config_json(name: str, out: Path) -> Path:
    """The config.json a check of ``name`` reads: the shipped one, or Llama-3-70B's width
    over Llama-3-8B's file (the vocabulary, RoPE and norm of the Llama-3 family)."""
    if name != "llama3_70b_width":
        return hf_config_path(name)
    data = json.loads(hf_config_path("llama3_8b").read_text())
    data.update(WIDTH_70B)
    path = out / name / "config.json"  # the geometry is named by its directory
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    return path


def functions(path: Path, layers: int, src: str, dst: str, out: Path, tag: str) -> str:
    """A user's module beside the checks: the harness's own split and converter, per stage."""
    module = f"wsb_full_width_{tag}"
    (out / f"{module}.py").write_text(textwrap.dedent(f"""
        from weight_sync_bench import ModelConfig, layout_for
        from weight_sync_bench.check.convert import stage_convert
        from weight_sync_bench.check.stream import stage_split
        CONFIG = ModelConfig.from_hf_config({str(path)!r}, n_layers={layers})
        split = stage_split(layout_for(CONFIG))
        convert = stage_convert({src!r}, {dst!r}, CONFIG)
    """))
    return module


def baseline_rss(out: Path) -> int:
    """The peak RSS of a process that imported the harness and did nothing else."""
    return run_child([sys.executable, "-c", "import weight_sync_bench.cli.main"], out)[1]


def run_child(argv: list[str], cwd: Path) -> tuple[int, int, float, str]:
    """(exit code, peak RSS bytes, wall seconds, stdout) of one child process."""
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        child = subprocess.Popen(argv, cwd=cwd, stdout=stdout, stderr=stderr,
                                 env={**os.environ, "OMP_NUM_THREADS": "1",
                                      "PYTHONPATH": str(cwd)})
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - started
        stdout.seek(0)
        stderr.seek(0)
        text, err = stdout.read(), stderr.read()
    code = os.waitstatus_to_exitcode(status)
    return code, usage.ru_maxrss * 1024, wall, text + ("" if code in (0, 1) else err[-1500:])


def cells(config: ModelConfig, routes: list[str], degrees: str
          ) -> list[tuple[str, list[str], str]]:
    """(route label, wsb check arguments, conversion endpoints) of each check to run."""
    allowed = [t for t in layout_for(config).supported_degrees() if t <= 8]
    top = max(allowed)
    chosen = [top] if degrees == "max" else allowed  # split-all: every degree split
    out: list[tuple[str, list[str], str]] = []
    if "split" in routes:
        out += [(f"split -> {t}", ["--dst", str(t), "--splitter", "{module}:split"], "")
                for t in chosen]
    if "reshard" in routes:
        pairs = [t for t in allowed if t != top] if degrees == "all" else [max(1, top // 2)]
        out += [(f"{top} -> {t}", ["--src", str(top), "--dst", str(t)], "") for t in pairs]
    if "convert" in routes:  # all: to vLLM at every allowed degree; else to Tmax / 2 only
        for dst in (allowed if degrees == "all" else [max(1, top // 2)]):
            out.append((f"megatron:{top} -> vllm:{dst}",
                        ["--from", f"megatron:{top}", "--to", f"vllm:{dst}", "--converter",
                         "{module}:convert"], f"megatron:{top} vllm:{dst}"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/bench_full_width.py")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--only", action="append", choices=GEOMETRIES)
    parser.add_argument("--routes", default="split,reshard,convert")
    parser.add_argument("--degrees", choices=["all", "split-all", "max"], default="all",
                        help="all: split at every allowed degree, reshard the largest to "
                             "each other; split-all: split at every degree, reshard the "
                             "largest to its half; max: the largest degree only")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--stream", default="parameter", choices=["layer", "parameter"])
    parser.add_argument("--out", type=Path, default=None,
                        help="where results.json and the helper files go (default: a new "
                             "temporary directory)")
    args = parser.parse_args(argv)
    out = (args.out or Path(tempfile.mkdtemp(prefix="wsb-full-width-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    routes = args.routes.split(",")
    base = baseline_rss(out)
    print(f"baseline (imports only): {base / 2**30:.2f} GiB peak RSS; results in {out}",
          flush=True)
    rows = []
    for name in args.only or GEOMETRIES:
        path = config_json(name, out)
        config = ModelConfig.from_hf_config(path, n_layers=args.layers)
        floor = cached_floor_path(config, "1a", args.dtype)
        for label, extra, ends in cells(config, routes, args.degrees):
            src, dst = ends.split() if ends else ("plain", "plain")
            tag = f"{name}_{src}_{dst}".replace(":", "_")
            module = functions(path, args.layers, src, dst, out, tag)
            check = ["check", "--hf-config", str(path), "--layers", str(args.layers),
                     "--dtype", args.dtype, "--stream", args.stream, "--json",
                     *[a.format(module=module) for a in extra]]
            print(f"{name} {label} ...", flush=True)
            code, peak, wall, text = run_child(
                [sys.executable, "-m", "weight_sync_bench", *check], out)
            records = [json.loads(line) for line in text.splitlines()
                       if line.startswith("{")]
            verdict = next((r for r in records if r.get("kind") == "check"), {})
            rows.append({
                "geometry": name, "layers": args.layers, "dtype": args.dtype, "route": label,
                "exit": code, "wall_s": wall, "peak_rss": peak, "baseline_rss": base,
                "largest_param": largest_param_bytes(config, args.dtype),
                "model": model_bytes(config, args.dtype), "n_params": config.n_params,
                "max_abs_error": verdict.get("max_abs_error"),
                "threshold": verdict.get("threshold"), "passed": verdict.get("passed"),
                "floor": floor.name if floor.is_file() else None,
                "argv": ["wsb", *check], "error": None if code in (0, 1) else text})
            print(format_row(rows[-1]), flush=True)
            (out / "results.json").write_text(json.dumps(rows, indent=1))
    print()
    print(format_table(rows))
    print(f"\nresults: {out / 'results.json'}")
    return 0


HEADER = ["geometry", "L", "dtype", "route", "exit", "result", "max |error|", "threshold",
          "wall s", "peak GiB", "peak - base GiB", "largest GiB", "x largest", "model GiB",
          "x model"]


def format_row(r: dict) -> str:
    gib = 2.0 ** 30
    used = r["peak_rss"] - r["baseline_rss"]
    result = {True: "PASS", False: "FAIL", None: "refused" if r["exit"] == 2 else "error"}
    error = "-" if r["max_abs_error"] is None else f"{r['max_abs_error']:.3g}"
    threshold = "-" if r["threshold"] is None else f"{r['threshold']:g}"
    return "  ".join([r["geometry"], str(r["layers"]), r["dtype"], r["route"], str(r["exit"]),
                      result[r["passed"]], error, threshold, f"{r['wall_s']:.1f}",
                      f"{r['peak_rss'] / gib:.2f}", f"{used / gib:.2f}",
                      f"{r['largest_param'] / gib:.2f}", f"{used / r['largest_param']:.2f}",
                      f"{r['model'] / gib:.2f}", f"{used / r['model']:.2f}"])


def format_table(rows: list[dict]) -> str:
    table = [HEADER] + [format_row(r).split("  ") for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in table)


if __name__ == "__main__":
    sys.exit(main())
