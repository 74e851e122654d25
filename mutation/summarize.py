"""Per-module mutation counts from mutmut's cache (``mutants/``), checked against the record.

    .venv/bin/python mutation/summarize.py [--json OUT]

Reads ``[tool.mutmut] only_mutate`` from pyproject.toml and each file's ``mutants/<path>.meta``,
prints tried / killed / survived / timeout / no tests per module, and exits 1 unless every
surviving (or untested) mutant is one ``mutation/results.json`` records as equivalent. A
survivor is matched on its module, function and changed lines, not on mutmut's number
(``x_f__mutmut_7`` is renumbered when the function changes), so an edit elsewhere in the
file does not orphan the record. Run it after ``mutmut run``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tomllib
from collections import Counter
from pathlib import Path

from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "mutation" / "results.json"


def changed_lines(diff: str) -> list[str]:
    """The removed and added lines of a mutant's diff, stripped: its identity across runs."""
    return [line[0] + line[1:].strip() for line in diff.splitlines()
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def function_of(mutant: str) -> str:
    """``weight_sync_bench.layout.table.xǁLayoutTableǁrender__mutmut_3`` -> ``LayoutTable.render``."""
    name = mutant.rsplit(".", 1)[1]
    name = re.sub(r"__mutmut_\d+$", "", name)
    return name.removeprefix("x_").replace("xǁ", "").replace("ǁ", ".")


def module_of(mutant: str) -> str:
    return mutant.rsplit(".", 1)[0]


def collect() -> dict[str, dict]:
    """module -> {"counts": {...}, "open": [(mutant, status, diff), ...]}."""
    files = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]["only_mutate"]
    out = {}
    for path in files:
        meta = ROOT / "mutants" / (path + ".meta")
        module = path.removeprefix("src/").removesuffix(".py").replace("/", ".")
        if not meta.exists():
            out[module] = {"counts": {"not run": 1}, "open": []}
            continue
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        statuses = {m: ("not run" if c is None else status_by_exit_code[c]) for m, c in codes.items()}
        counts = Counter(statuses.values())
        counts["tried"] = len(codes)
        open_ = [(m, s, get_diff_for_mutant(m, path=path)) for m, s in sorted(statuses.items())
                 if s not in ("killed", "timeout")]
        out[module] = {"counts": dict(counts), "open": open_}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the counts and open mutants here")
    args = parser.parse_args(argv)
    os.chdir(ROOT)  # mutmut reads its cache as the relative path mutants/
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {"modules": {}}
    known = {(module, e["function"], tuple(e["changed"]))
             for module, m in record["modules"].items()
             for e in m.get("survivors", []) if e["verdict"].startswith("equivalent")}
    result, unexplained = collect(), []
    print(f"{'module':42} {'tried':>5} {'killed':>6} {'surv.':>5} {'t/o':>4} {'no tests':>8}")
    for module, m in result.items():
        c = m["counts"]
        print(f"{module:42} {c.get('tried', 0):5} {c.get('killed', 0):6} "
              f"{c.get('survived', 0):5} {c.get('timeout', 0):4} {c.get('no tests', 0):8}")
        for mutant, status, diff in m["open"]:
            key = (module, function_of(mutant), tuple(changed_lines(diff)))
            if key not in known:
                unexplained.append((mutant, status, diff))
    for mutant, status, diff in unexplained:
        print(f"\n{status}, not recorded as equivalent: {mutant}\n{diff}")
    if args.json:
        args.json.write_text(json.dumps(
            {module: {"counts": m["counts"],
                      "open": [{"id": i, "status": s, "diff": d} for i, s, d in m["open"]]}
             for module, m in result.items()}, indent=1) + "\n")
    print(f"\n{len(unexplained)} surviving or untested mutants not recorded as equivalent")
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
