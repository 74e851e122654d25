"""The FP8 kill matrix with its ratios: for each destination of ``tests/check/test_fp8_convert.py``
(a toy with 128-wide heads, Qwen3-8B's widths reduced, MoE over EP, TOY_KV4; per block and
per tensor), each FP8 mutation (``conventions.fp8_mutations``): its ratio (max |logit error|
/ threshold; ``inf`` where NaN reaches the logits), or why it cannot occur there, is the
identity, or is refused by name; beside it the threshold and where it came from, and the
quantization error (the dequantized model against the unquantized one: information, never
a threshold). The same rows the test asserts; this prints them.

    .venv/bin/python bench/fp8_kill_matrix.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from weight_sync_bench.check.fp8 import fp8_kill_matrix
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.conventions.fp8_mutations import FP8_MUTATIONS
from weight_sync_bench.model.config import TOY_KV4, init_params

# tests/check/test_fp8_convert.py's geometries, imported from it: one definition
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.check.test_fp8_convert import MOE_FP8, QWEN3_8B_REDUCED, TOY_FP8  # noqa: E402

CELLS = [(TOY_FP8, "vllm:tp=2,fp8=block128"), (QWEN3_8B_REDUCED, "vllm:tp=2,fp8=block128"),
         (MOE_FP8, "vllm:tp=2,ep=2,fp8=block128"), (TOY_KV4, "hf:fp8=block128"),
         (TOY_FP8, "vllm:tp=2,fp8=tensor"), (QWEN3_8B_REDUCED, "vllm:tp=2,fp8=tensor"),
         (MOE_FP8, "vllm:tp=2,ep=2,fp8=tensor"), (TOY_KV4, "vllm:tp=2,fp8=tensor")]


def _cell(row) -> str:
    if row.outcome == "killed":
        if math.isinf(row.ratio):
            return "inf"
        return f"{row.ratio:,.0f}x" if row.ratio >= 10 else f"{row.ratio:.2g}x"
    return {"not applicable": "n/a", "identity": "identity", "refused": "refused (dtype)",
            "survived": "SURVIVED"}[row.outcome]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    started, cpu = time.perf_counter(), time.process_time()
    columns, table, notes, rows_json = [], {}, [], []
    for config, dst in CELLS:
        label = f"{config.name} {dst}"
        columns.append(label)
        params = init_params(config, 0, dtype=torch.bfloat16)
        for row in fp8_kill_matrix(config, endpoint("megatron:2"), endpoint(dst), params):
            table.setdefault(row.mutation, {})[label] = _cell(row)
            verdict = row.verdict
            rows_json.append({"geometry": config.name, "destination": dst,
                              "mutation": row.mutation, "outcome": row.outcome,
                              "ratio": row.ratio, "reason": row.reason})
            if verdict is not None and label not in {n[0] for n in notes}:
                quant = next(n for n in verdict.notes if n.startswith("fp8 quantization"))
                notes.append((label, verdict.threshold, quant.rsplit(" ", 1)[1]))
    width = max(len(m) for m in FP8_MUTATIONS) + 2
    print("mutation".ljust(width) + " | ".join(f"[{i + 1}]" for i in range(len(columns))))
    for mutation in FP8_MUTATIONS:
        print(mutation.ljust(width) + " | ".join(table[mutation][c] for c in columns))
    print()
    for i, label in enumerate(columns):
        found = next((n for n in notes if n[0] == label), None)
        extra = (f": threshold {found[1]:g}, quantization error {found[2]}" if found
                 else "")
        print(f"[{i + 1}] {label}{extra}")
    print(f"\nwall {time.perf_counter() - started:.1f} s, CPU {time.process_time() - cpu:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows_json, f, indent=1)


if __name__ == "__main__":
    main()
