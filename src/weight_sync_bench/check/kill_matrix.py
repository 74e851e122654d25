"""The kill matrix of the conversion mutations over a set of endpoints: for each mutation and
each ordered pair of endpoints, where it does not apply (and why), where it is the identity
(and why), and where it is live, the verdict on the harness's own conversion with the
mutation applied. One conversion per mutation key (``ConversionMutation.key``: equal keys
give byte-identical mutated shards, so one verdict stands for them all).

The tests (``tests/conventions/test_mutations.py``, ``tests/check/test_moe_kill.py``) demand
what the rows show: each live row killed at ``KILL_MARGIN`` x the threshold, each declared
identity byte-identical, each mutation changing only what its ``changes`` names;
``bench/moe_kill_matrix.py`` prints the rows' ratios.

Where the checker's tokens hide a live mutation from the forward (``check.routing``: a
selection bias that moves no token's choice, or weights of experts no token takes), its row
says so (``outcome == "unchanged"``): only the bytes show it there, and the byte check does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from weight_sync_bench.check.conversion import ConversionChecker
from weight_sync_bench.check.diagnosis import bit_equal
from weight_sync_bench.check.mutations import KILL_MARGIN
from weight_sync_bench.check.routing import forward_unchanged
from weight_sync_bench.check.verdict import Verdict
from weight_sync_bench.conventions import Endpoint
from weight_sync_bench.conventions.mutations import (
    Conversion,
    ConversionMutation,
)

__all__ = ["KILL_MARGIN", "KillRow", "kill_matrix"]


@dataclass(frozen=True)
class KillRow:
    """One (mutation, conversion) of the matrix: ``outcome`` is ``"not applicable"`` or
    ``"identity"`` (``reason`` says why), ``"unchanged"`` (the forward cannot see it on these
    tokens: ``reason``), or ``"killed"`` / ``"survived"`` (the verdict's ratio
    against ``KILL_MARGIN``). ``changed`` names the canonical parameters whose stored bytes
    the mutation changed; ``stray`` those of them its ``changes`` does not name."""

    mutation: str
    conversion: Conversion
    outcome: str  # not applicable, identity, live (not run), unchanged, killed, survived
    reason: str | None = None
    verdict: Verdict | None = None
    changed: tuple[str, ...] = ()
    stray: tuple[str, ...] = ()

    @property
    def ratio(self) -> float | None:
        return self.verdict.ratio if self.verdict is not None else None


def kill_matrix(checker: ConversionChecker, endpoints: Sequence[Endpoint],
                mutations: Iterable[ConversionMutation], *, live: bool = True
                ) -> Iterator[KillRow]:
    """Each mutation over every ordered pair of ``endpoints`` (one verdict per mutation key),
    on ``checker``'s geometry, weights, tokens and threshold. ``live=False`` runs no forward:
    a live conversion's row is ``"live"`` with nothing computed (the declared identities'
    bytes are still compared)."""
    config = checker.config
    for mutation in mutations:
        seen: set[tuple[str, ...]] = set()
        for src in endpoints:
            for dst in endpoints:
                conversion = Conversion(config, src, dst)
                reason = mutation.not_applicable(conversion)
                if reason is not None:
                    yield KillRow(mutation.name, conversion, "not applicable", reason)
                    continue
                if mutation.key(conversion) in seen:
                    continue
                seen.add(mutation.key(conversion))
                if not live and mutation.identity_reason(conversion) is None:
                    yield KillRow(mutation.name, conversion, "live")
                    continue
                yield _row(checker, mutation, conversion)


def _row(checker: ConversionChecker, mutation: ConversionMutation,
         conversion: Conversion) -> KillRow:
    config, dst = checker.config, conversion.dst
    declared = checker.declared(dst)
    # The harness's converter is exact (tests/conventions/test_conversions.py): what it makes
    # of the source is the declared destination, byte for byte; fresh copies of that are
    # what the mutation gets, without gathering the source again for every row
    converted = checker.source(dst)
    mutated = mutation.apply(converted, conversion)
    sources = {n: piece.source for rank in dst.pieces(config) for n, piece in rank.items()}
    # bytes, not values: a -0.0 written over a +0.0 (padding) is a change (torch.equal: none)
    changed = sorted({sources[n] for new, old in zip(mutated, declared) for n in new
                      if not bit_equal(new[n], old[n])})
    stray = tuple(n for n in changed if not re.fullmatch(mutation.changes, n))
    reason = mutation.identity_reason(conversion)
    if reason is not None:
        return KillRow(mutation.name, conversion, "identity", reason, changed=tuple(changed),
                       stray=stray)
    verdict = checker.verdict(mutated, src=conversion.src, dst=dst, mutation=mutation.name)
    unchanged = forward_unchanged(checker, conversion, mutation, mutated)
    if unchanged is not None:
        return KillRow(mutation.name, conversion, "unchanged", unchanged, verdict,
                       tuple(changed), stray)
    outcome = "killed" if not verdict.passed and verdict.ratio >= KILL_MARGIN else "survived"
    return KillRow(mutation.name, conversion, outcome, None, verdict, tuple(changed), stray)
