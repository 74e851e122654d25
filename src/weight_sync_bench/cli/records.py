"""The ``--json`` records that carry a check's verdict: one builder per kind, shared by every
subcommand that emits it (``wsb check`` and ``wsb verify`` write the same ``check`` record)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weight_sync_bench.check.checker import Verdict


def verdict_record(v: Verdict) -> dict[str, Any]:
    """A ``check`` record: the verdict's facts, as its text says them."""
    return {"config": v.config, "phase": v.phase, "src": v.src, "dst": v.dst,
            "mutation": v.mutation, "max_abs_error": v.max_abs_error, "threshold": v.threshold,
            "ratio": v.ratio, "forward": "own" if v.own_forward else "declared",
            "passed": v.passed, "first_mismatch": v.first_mismatch,
            "mismatches": list(v.mismatches)}
