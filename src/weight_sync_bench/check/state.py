"""``verify_state``: is what an engine rank holds after a sync exactly what it must hold?

Given the trainer's weights (canonical parameters, or anything that maps a canonical name to
its full tensor, read one at a time) and the endpoint the engine stores them in
(``vllm:tp=4``, ``vllm:tp=2,ep=2``, ``megatron:tp=2,pp=2``), each stored tensor of a rank is
declared (``Piece.take``, cast to the engine's dtype by ``Tensor.to``, torch's
round-to-nearest-even) and the tensor the engine holds is compared with it bit for bit.
Every tensor gets one outcome (``OUTCOMES``):

- ``equal``: the declared bytes;
- ``stale``: the bytes the *previous* weights declare for it (``previous=``): a sync that
  never reached it (a chunk restored, a tied ``lm_head`` left behind);
- ``never written``: the sentinel a recipe filled in before the sync (``sentinel=``), in
  every element, or ``partly never written`` with the count;
- ``misplaced``: another tensor's declared bytes, said whose: another layer's same
  parameter (two pipeline stages publishing the same local names), another rank's cut of
  it, another stored tensor of this rank;
- ``wrong``: anything else, with the diagnosis every check gives (``check.diagnosis``, in
  the convention's vocabulary: heads, experts, vocabulary rows), and where it is one, the
  declared values cast to bfloat16 by truncation instead of rounding;
- ``missing`` / ``unexpected``: a declared name the engine lacks, or a name it holds that
  the endpoint does not declare on that rank.

Nothing is gathered: one declared tensor (and one canonical parameter, for a diagnosis) at a
time. ``StateReport.coverage`` closes the report per layer (and per expert where a stored
tensor holds experts). The comparison is of bytes only: no forward runs, so no threshold is
involved.

The stand-in for an engine in the tests is a dict per rank of the ``vllm`` convention's
tensors, synced by a recipe with planted faults (``tests/check/test_state.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from weight_sync_bench.check.diagnosis import bit_equal, diagnose_rank, format_indices
from weight_sync_bench.conventions import endpoint
from weight_sync_bench.errors import InvalidShards

if TYPE_CHECKING:
    from weight_sync_bench.conventions import Endpoint
    from weight_sync_bench.conventions.maps import Piece
    from weight_sync_bench.model.config import ModelConfig

OUTCOMES = ("equal", "stale", "never written", "partly never written", "misplaced", "wrong",
            "missing", "unexpected")


@dataclass(frozen=True)
class TensorOutcome:
    """One stored tensor of one rank: its ``outcome`` (``OUTCOMES``), a line saying why
    (empty for ``equal``), and the canonical parameter it is declared to hold (None for an
    ``unexpected`` name)."""

    name: str
    outcome: str
    detail: str = ""
    source: str | None = None
    experts: tuple[int, ...] = ()  # the global experts it is declared to hold, if any

    @property
    def layer(self) -> int | None:
        parts = (self.source or "").split(".")
        return int(parts[1]) if parts[0] == "layers" and len(parts) > 2 else None


@dataclass(frozen=True)
class StateReport:
    """``verify_state``'s report on one engine rank: every tensor's outcome, in the
    endpoint's order (unexpected names last)."""

    where: str
    rank: int
    outcomes: tuple[TensorOutcome, ...]

    @property
    def passed(self) -> bool:
        return all(o.outcome == "equal" for o in self.outcomes)

    def counts(self) -> dict[str, int]:
        found = Counter(o.outcome for o in self.outcomes)
        return {k: found[k] for k in OUTCOMES if found[k]}

    def coverage(self) -> list[str]:
        """Per layer (``embedding and output`` for the rest), and per expert where stored
        tensors hold experts: how many of its tensors had each outcome."""
        rows: dict[str, Counter[str]] = defaultdict(Counter)
        for o in self.outcomes:
            if o.source is None:
                continue
            rows["layer " + str(o.layer) if o.layer is not None else "embedding and output"][
                o.outcome] += 1
            if o.experts:
                rows[f"layer {o.layer} expert{'s' if len(o.experts) > 1 else ''} "
                     f"{format_indices(list(o.experts))}"][o.outcome] += 1

        def key(label: str) -> tuple[int, int, str]:
            found = re.match(r"layer (\d+)", label)
            return (0, int(found.group(1)), label) if found else (1, 0, label)

        return [f"{label}: " + ", ".join(f"{n} {k}" for k, n in sorted(
            counts.items(), key=lambda kv: OUTCOMES.index(kv[0])))
                for label, counts in sorted(rows.items(), key=lambda kv: key(kv[0]))]

    def summary(self) -> str:
        head = (f"{'PASS' if self.passed else 'FAIL'} {self.where} rank {self.rank}: "
                + ", ".join(f"{n} {k}" for k, n in self.counts().items()))
        lines = [head]
        lines += [f"  {o.outcome}: {o.name}" + (f": {o.detail}" if o.detail else "")
                  for o in self.outcomes if o.outcome != "equal"]
        lines += ["  coverage:"] + [f"    {line}" for line in self.coverage()]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def verify_state(tensors: Mapping[str, torch.Tensor], where: str | Endpoint, rank: int,
                 weights: Mapping[str, torch.Tensor], *, config: ModelConfig,
                 previous: Mapping[str, torch.Tensor] | None = None,
                 sentinel: float | None = None,
                 dtype: torch.dtype | None = None) -> StateReport:
    """Compare what engine rank ``rank`` of ``where`` holds (``tensors``: its stored names,
    as the engine's ``named_parameters()`` of that rank, dumped) with what the endpoint
    declares for it given ``weights`` (canonical parameters of ``config``, read one at a
    time), bit for bit, and say for each tensor what it holds (the module docstring).

    ``dtype``: the engine's dtype (default: each canonical parameter's own); the declared
    tensor is ``Piece.take(weights[source]).to(dtype)``. ``previous``: the weights before
    this sync (names ``stale``); ``sentinel``: the value a recipe filled every tensor with
    before the sync (names ``never written``). ``InvalidShards`` when ``tensors`` is not a
    mapping of names to tensors or ``rank`` is outside the endpoint's world."""
    at = endpoint(where) if isinstance(where, str) else where
    dumps = [tensors if r == rank else {} for r in range(len(at.pieces(config)))]
    (report,) = verify_ranks(dumps, at, weights, config=config, ranks=[rank],
                             previous=previous, sentinel=sentinel, dtype=dtype)
    return report


def verify_ranks(dumps: Sequence[Mapping[str, torch.Tensor]], where: str | Endpoint,
                 weights: Mapping[str, torch.Tensor], *, config: ModelConfig,
                 ranks: Sequence[int] | None = None,
                 previous: Mapping[str, torch.Tensor] | None = None,
                 sentinel: float | None = None,
                 dtype: torch.dtype | None = None) -> list[StateReport]:
    """``verify_state`` of every rank in ``ranks`` (default all) of ``dumps`` (each rank's
    tensors, ``dumps[rank]``), the same reports, with each canonical parameter of
    ``weights`` (and ``previous``) read once for all the ranks that hold it: the tensors
    are judged parameter by parameter, every rank's cut of one before the next. What
    ``wsb verify-state`` runs, so a lazily read checkpoint is read once, not once a rank."""
    at = endpoint(where) if isinstance(where, str) else where
    pieces = at.pieces(config)
    ranks = list(range(len(pieces))) if ranks is None else list(ranks)
    for rank in ranks:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < len(pieces):
            raise InvalidShards(f"{at}: rank {rank!r} is outside its {len(pieces)} ranks")
        if not isinstance(dumps[rank], Mapping):
            raise InvalidShards(f"{at} rank {rank}: the engine's tensors must be a mapping of "
                                f"names to tensors, got {type(dumps[rank]).__name__}")
    judge = _Judge(config, at, pieces, _Recent(weights),
                   _Recent(previous) if previous is not None else None, sentinel, dtype)
    found: dict[tuple[int, str], list[TensorOutcome]] = {}
    for source in config.param_shapes():
        for rank in ranks:
            for name, piece in pieces[rank].items():
                if piece.source == source:
                    found[rank, name] = judge.judged(rank, name, piece, dumps[rank].get(name))
    return [StateReport(str(at), rank, tuple(
        [o for name in pieces[rank] for o in found[rank, name]]
        + [TensorOutcome(name, "unexpected", f"{at} declares no {name} on rank {rank}")
           for name in dumps[rank] if name not in pieces[rank]])) for rank in ranks]


class _Recent(Mapping[str, torch.Tensor]):
    """``weights`` with the parameter read last kept: a lazily read checkpoint's parameter
    is read once while every rank's tensors of it are judged."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.weights = weights
        self.last: tuple[str, torch.Tensor] | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        if self.last is None or self.last[0] != name:
            self.last = (name, self.weights[name])
        return self.last[1]

    def __contains__(self, name: object) -> bool:
        return name in self.weights

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


@dataclass
class _Judge:
    config: ModelConfig
    at: Endpoint
    pieces: list[dict[str, Piece]]
    weights: Mapping[str, torch.Tensor]
    previous: Mapping[str, torch.Tensor] | None
    sentinel: float | None
    dtype: torch.dtype | None
    _digests: _Digests | None = None

    def declared(self, piece: Piece, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``piece.take(full).to(dtype)``; a view of ``full`` where the piece is one run of
        it in the same dtype (the comparison reads it in place: no copy of the tensor)."""
        full = weights[piece.source]
        dtype = self.dtype or full.dtype
        if piece.span is not None and not piece.is_stacked and dtype == full.dtype:
            a, b = piece.span
            return full.narrow(piece.dim, a, b - a)
        return piece.take(full).to(dtype)

    def judged(self, rank: int, name: str, piece: Piece, held: torch.Tensor | None
               ) -> list[TensorOutcome]:
        """The outcome of a stored tensor; a stacked one that is not equal (vLLM's fused-MoE
        ``w13_weight``: a rank's experts stacked), member by member, each named
        ``{name}[{i}]`` with its experts: a bucket of experts never written is said expert
        by expert."""
        whole = self.outcome(rank, name, piece, held)
        if not piece.is_stacked or whole.outcome not in ("wrong", "partly never written") or \
                held is None or tuple(held.shape) != tuple(
                    self.declared(piece, self.weights).shape) or held.dtype != (
                    self.dtype or self.weights[piece.source].dtype):
            return [whole]  # equal, stale, never written or misplaced as a whole
        return [self.outcome(rank, f"{name}[{i}]", member, held[i])
                for i, member in enumerate(piece.members())]

    def outcome(self, rank: int, name: str, piece: Piece, held: torch.Tensor | None
                ) -> TensorOutcome:
        experts = _experts_of(self.config, piece)
        said = dict(source=piece.source, experts=experts)
        if held is None:
            return TensorOutcome(name, "missing", f"{self.at} declares it on rank {rank}",
                                 **said)
        if not isinstance(held, torch.Tensor):
            raise InvalidShards(f"{self.at} rank {rank} {name}: the engine's tensors must be a "
                                f"mapping of names to tensors, got a {type(held).__name__}")
        want = self.declared(piece, self.weights)
        if held.shape != want.shape or held.dtype != want.dtype:
            return TensorOutcome(name, "wrong", f"{held.dtype} {list(held.shape)}, declared "
                                 f"{want.dtype} {list(want.shape)}", **said)
        held = held.detach().cpu()
        if bit_equal(held, want):
            return TensorOutcome(name, "equal", **said)
        if self.previous is not None and bit_equal(held, self.declared(piece, self.previous)):
            return TensorOutcome(name, "stale", "holds the previous weights' declared bytes: "
                                 "this sync never wrote it", **said)
        if self.sentinel is not None:
            # every element the sentinel (and the declared bytes not all the sentinel), or
            # every element either its declared bytes or the sentinel where those differ
            mark = _bits(torch.full((), self.sentinel, dtype=held.dtype))
            sentinel, right = _bits(held) == mark, _bits(held) == _bits(want)
            left = int((sentinel & ~right).sum())
            if bool(sentinel.all()):
                return TensorOutcome(name, "never written", f"every element holds the "
                                     f"sentinel {self.sentinel:g} filled in before the sync",
                                     **said)
            if left and bool((sentinel | right).all()):
                return TensorOutcome(name, "partly never written", f"{left} of {held.numel()} "
                                     f"elements hold the sentinel {self.sentinel:g}, the "
                                     "others their declared bytes", **said)
        whose = self.misplaced(rank, name, piece, held)
        if whose is not None:
            return TensorOutcome(name, "misplaced", whose, **said)
        return TensorOutcome(name, "wrong", self.wrong(rank, name, piece, held), **said)

    def misplaced(self, rank: int, name: str, piece: Piece, held: torch.Tensor) -> str | None:
        """Whose declared bytes ``held`` is: another layer's same parameter, another rank's
        cut of this name, or another of this rank's stored tensors (None: nobody's). Told by
        slice digests first (``_Digests``: each parameter read once for them, whatever
        number of tensors differ), a candidate read again only to confirm it byte for byte."""
        digests = self.digests(held.dtype)
        shapes = self.config.param_shapes()
        mine: dict[int, list[bytes]] = {}

        def holds(theirs: Piece) -> bool:
            if theirs.idx.numel() == 0 or tuple(
                    theirs.local_shape(shapes[theirs.source])) != tuple(held.shape):
                return False
            if theirs.dim not in mine:
                mine[theirs.dim] = _slice_digests(theirs.flat(held) if theirs.is_stacked
                                                  else held, theirs.dim)
            want, zero = digests.of(theirs.source, theirs.dim)
            if mine[theirs.dim] != [want[i] if i >= 0 else zero for i in theirs.idx.tolist()]:
                return False  # (a padding slice, -1, is declared zeros)
            return bit_equal(held, self.declared(theirs, self.weights).to(held.dtype))

        parts = piece.source.split(".")
        if parts[0] == "layers" and len(parts) > 2:
            for k in range(self.config.n_layers):
                source = ".".join(["layers", str(k), *parts[2:]])
                if k != int(parts[1]) and shapes.get(source) == shapes[piece.source] and \
                        holds(dataclasses.replace(piece, source=source)):
                    return (f"holds layer {k}'s {'.'.join(parts[2:])}, cut as declared: a "
                            "layer stored under another layer's name (two pipeline stages "
                            "publishing the same local indices, or a stage's offset wrong)")
        for other, pieces in enumerate(self.pieces):
            theirs = pieces.get(name)
            if other != rank and theirs is not None and not theirs.equals(piece) and \
                    holds(theirs):
                return f"holds rank {other}'s declared {name}: another rank's cut"
        for other_name, theirs in self.pieces[rank].items():
            if other_name != name and holds(theirs):
                return f"holds this rank's declared {other_name}"
        return None

    def digests(self, dtype: torch.dtype) -> _Digests:
        if self._digests is None or self._digests.dtype != dtype:
            self._digests = _Digests(self.weights, dtype)
        return self._digests

    def wrong(self, rank: int, name: str, piece: Piece, held: torch.Tensor) -> str:
        full = self.weights[piece.source]
        if held.dtype == torch.bfloat16 and full.dtype == torch.float32 and \
                bit_equal(held, _truncated(piece.take(full))):
            return ("holds the declared values cast to bfloat16 by truncation (round toward "
                    "zero), not by torch's .to() (round to nearest even)")
        line = diagnose_rank(full.to(held.dtype), self.config, name, rank, piece, held)
        return line or "differs from its declared bytes"


class _Digests:
    """Per (canonical parameter, dim): a 16-byte digest of each of its slices along ``dim``,
    cast to ``dtype``, and that of a slice of zeros (what a padding index declares), each
    parameter read once for them (``misplaced``'s index)."""

    def __init__(self, weights: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.weights, self.dtype = weights, dtype
        self.made: dict[tuple[str, int], tuple[list[bytes], bytes]] = {}

    def of(self, source: str, dim: int) -> tuple[list[bytes], bytes]:
        if (source, dim) not in self.made:
            full = self.weights[source].to(self.dtype)
            zero = _slice_digests(torch.zeros_like(full.narrow(dim, 0, 1)), dim)[0]
            self.made[source, dim] = (_slice_digests(full, dim), zero)
        return self.made[source, dim]


def _slice_digests(x: torch.Tensor, dim: int) -> list[bytes]:
    """A 16-byte digest of the bytes of each slice of ``x`` along ``dim``."""
    rows = _bits(x.movedim(dim, 0).reshape(x.shape[dim], -1)).numpy()
    return [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in rows]


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of each element (so NaN sentinels compare, and -0.0 is not 0.0)."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return x.contiguous().view(view)


def _truncated(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) cast to bfloat16 by dropping its low 16 bits: round toward zero."""
    bits = x.contiguous().view(torch.int32) >> 16
    return bits.to(torch.int16).view(torch.bfloat16)


def _experts_of(config: ModelConfig, piece: Piece) -> tuple[int, ...]:
    """The global experts a stored piece of an experts' parameter holds (none otherwise)."""
    if ".experts." not in piece.source or not config.n_experts:
        return ()
    per = (2 if piece.source.endswith("gate_up.weight") else 1) * config.expert_ffn
    real = piece.idx[piece.idx >= 0]
    return tuple(sorted({int(i) // per for i in real.tolist()}))


__all__ = ["OUTCOMES", "StateReport", "TensorOutcome", "verify_ranks", "verify_state"]
