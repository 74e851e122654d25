"""The outcome of one check, and a table of many.

A ``Verdict`` is data: the deviation of the sharded logits from the reference against the
threshold, and the data movement (the first parameter whose bytes differ from the declared
ones, and what each rank really holds of it). ``str(verdict)`` is the report a person
reads; ``format_verdicts`` the table ``wsb check`` prints.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    """The outcome of one check. ``passed`` needs finite logits within the threshold *and*
    shards equal to the declared split byte for byte (data movement has no tolerance)."""

    config: str
    src: int | None  # None when the shards came from a split of the full model
    dst: int
    max_abs_error: float
    threshold: float
    first_mismatch: str | None
    mismatches: tuple[str, ...] = ()
    diagnosis: tuple[str, ...] = ()
    phase: str = "1a"
    mutation: str | None = None
    own_forward: bool = False  # False: the shards equal the declared split and reused its forward
    # (source, destination) convention names when the check is of a conversion
    # (``check_convert``): src and dst are then the degrees of those conventions.
    conventions: tuple[str, str] | None = None
    # How the running environment differs from the one the threshold was measured in
    # (``tolerance.rules.check_environment``); empty when it is the same.
    notes: tuple[str, ...] = ()
    dtype: str = "fp32"  # the synced weights' dtype, in which the shards were compared
    # Where the shards are, bit for bit, what a catalogued mutation makes of the declared ones
    # (``check.naming``): its name (the names of all that give the same bytes here, comma
    # separated), and what it means for the code that made the shards (one line). None where
    # no mutation is, and always where the shards equal the declared ones.
    named_mutation: str | None = None
    named_meaning: str | None = None
    # An MoE model's routing check (``check.checker``): how many of the reference's (layer,
    # token) expert choices were within ``route_bound`` of flipping, and of how many. Those
    # took the reference's choice in the sharded forward; every other choice is its own.
    near_ties: tuple[int, int] | None = None
    route_bound: float | None = None

    @property
    def finite(self) -> bool:
        return math.isfinite(self.max_abs_error)

    @property
    def ratio(self) -> float:
        """Deviation over threshold: below 1 passes the tolerance, a layout bug is >> 1."""
        return self.max_abs_error / self.threshold

    @property
    def passed(self) -> bool:
        return self.finite and self.max_abs_error <= self.threshold and self.first_mismatch is None

    @property
    def route(self) -> str:
        if self.conventions is not None:  # a name, or a whole endpoint (megatron:tp=2,ep=4)
            a, b = (c if ":" in c else f"{c}:{t}" for c, t in zip(self.conventions,
                                                                  (self.src, self.dst)))
            return f"{a} -> {b}"
        return f"{self.src} -> {self.dst}" if self.src is not None else f"split -> {self.dst}"

    def __str__(self) -> str:
        head = f"{'PASS' if self.passed else 'FAIL'} {self.config} {self.route} (phase {self.phase}"
        head += f", {self.dtype} weights" if self.dtype != "fp32" else ""
        head += f", mutation {self.mutation})" if self.mutation else ")"
        if not self.finite:
            numbers = f"logits are not finite (max |error| {self.max_abs_error})"
        else:
            relation = "<=" if self.max_abs_error <= self.threshold else ">"
            numbers = (f"max |logit error| {self.max_abs_error:.4g} {relation} threshold "
                       f"{self.threshold:g} ({self.ratio:.3g}x)")
        lines = [head, f"  {numbers}"]
        if self.first_mismatch is None:
            lines.append("  shards equal the declared layout byte for byte")
        else:
            lines.append(f"  first parameter that differs from the declared layout: "
                         f"{self.first_mismatch} ({len(self.mismatches)} differ in all)")
            lines.extend(f"    {line}" for line in self.diagnosis)
            if self.named_mutation is not None:
                names = self.named_mutation.split(", ")
                which = (f"`{names[0]}`" if len(names) == 1 else
                         ", and exactly ".join(f"`{n}`" for n in names) + " (the same bytes here)")
                lines.append(f"  this is exactly {which}: {self.named_meaning}")
        if self.near_ties is not None:
            near, total = self.near_ties
            lines.append(f"  routing: {near} of {total} token choices within "
                         f"{self.route_bound:g} of flipping took the reference's experts; "
                         "every other is the sharded forward's own")
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)


def format_verdicts(verdicts: Sequence[Verdict]) -> str:
    """A table: one row per verdict (config, route, error, threshold, ratio, forward, result;
    for an MoE model the near-tied expert choices too, ``ROUTING_LEGEND``)."""
    routed = any(v.near_ties is not None for v in verdicts)
    rows = [["config", "src -> dst", "phase", "mutation", "max |error|", "threshold", "ratio",
             "forward", *(["near ties"] if routed else []), "result"]]
    for v in verdicts:
        ties = ["-" if v.near_ties is None else "{}/{}".format(*v.near_ties)] if routed else []
        rows.append([v.config, v.route, v.phase, v.mutation or "-", f"{v.max_abs_error:.4g}",
                     f"{v.threshold:g}", f"{v.ratio:.3g}x",
                     "own" if v.own_forward else "declared", *ties,
                     "PASS" if v.passed else "FAIL"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    notes = dict.fromkeys(note for v in verdicts for note in v.notes)
    legend = [ROUTING_LEGEND] if routed else []
    return "\n".join(lines + legend + [f"note: {note}" for note in notes])


ROUTING_LEGEND = ("near ties: the (layer, token) expert choices of the reference within the "
                  "threshold of flipping, which took the reference's experts; every other choice "
                  "is the sharded forward's own, so a wrong router or selection bias shows")
