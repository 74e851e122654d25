"""The command line's start-up, side by side in one run: a bare interpreter, ``wsb
--version`` (no torch: the distributions' metadata), ``wsb --help`` and ``wsb check --help``
(no torch: the kept texts, ``weight_sync_bench.help``), ``import torch`` alone, and ``wsb
layout --help -q``, which the kept texts do not answer (the parsers, importing torch). Wall time of a fresh
process each, medians over ``rounds`` interleaved rounds, and each against the bare
interpreter. Prints; asserts nothing.

    python bench/bench_cli.py [rounds]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

WSB = str(Path(sys.executable).with_name("wsb"))
CASES = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "wsb --version": [WSB, "--version"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "wsb --help": [WSB, "--help"],
    "wsb check --help": [WSB, "check", "--help"],
    "wsb layout -q --help (the parsers)": [WSB, "layout", "-q", "--help"],
}


def main(rounds: int = 5) -> int:
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(rounds):
        for name, argv in CASES.items():
            started = time.perf_counter()
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
            times[name].append(time.perf_counter() - started)
    base = statistics.median(times["python -c pass"])
    print(f"start-up, {rounds} interleaved rounds, medians; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<28}{median:>8.3f} s{median / base:>8.1f}x python")
    return 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:2])))
