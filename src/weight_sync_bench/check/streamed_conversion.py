"""``check_convert`` streamed: memory bounded by the largest parameter, not by the model.

``stream_convert`` takes ``check.streaming``'s steps for conventions: per stage the
canonical parameters are drawn, the reference steps, the converter gets that stage's (or
one canonical parameter's) source stored tensors, its output is validated and compared bit
for bit with the declared destination tensors of those parameters, read by the
destination's forward plan, upcast, and the destination forward steps; then everything is
dropped. ``stage_convert`` is the harness's own converter in that shape.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from weight_sync_bench.check.checker import Verdict
from weight_sync_bench.check.conversion import endpoint_name, require_cell
from weight_sync_bench.check.diagnosis import bit_equal, diagnose
from weight_sync_bench.check.shards import validate_convention_shards
from weight_sync_bench.check.streaming import PER, Progress, drawn_units
from weight_sync_bench.check.threshold import environment_notes, resolve_floor
from weight_sync_bench.check.user_code import call
from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.conventions import endpoint, reading_plan
from weight_sync_bench.conventions.maps import Owners, gather_canonical, runs, translate
from weight_sync_bench.errors import InvalidNumber, UnsupportedLayout
from weight_sync_bench.model.config import dtype_name, make_tokens, parse_dtype
from weight_sync_bench.model.sharded import RoutingGuard
from weight_sync_bench.model.stepwise import ReferenceSteps, ShardedSteps
from weight_sync_bench.tolerance.rules import TOKEN_SEED_OFFSET

if TYPE_CHECKING:
    from weight_sync_bench.conventions import Endpoint
    from weight_sync_bench.conventions.maps import Piece, Pieces
    from weight_sync_bench.model.config import ModelConfig


Params = dict[str, torch.Tensor]
# (source convention's shards, destination degree) -> destination convention's shards
ConvertFn = Callable[[list[dict[str, torch.Tensor]], int], list[dict[str, torch.Tensor]]]


def stage_convert(src: str | Endpoint, dst: str | Endpoint, config: ModelConfig) -> ConvertFn:
    """The harness's own converter (``conventions.convert``) written per stage, the shape of
    a streamed ``fn``: it works on any subset of the source's stored tensors holding whole
    canonical parameters (one parameter, one layer, or all), and returns the destination's
    stored tensors of those parameters, written straight from views of the source tensors
    (``maps.translate``, bit for bit gather-then-cut without the canonical tensor)."""
    source, target = endpoint(src), endpoint(dst)

    def fn(shards: list[Params], degree: int) -> list[Params]:
        names = set(shards[0])
        sub = [{n: p for n, p in rank.items() if n in names} for rank in source.pieces(config)]
        sources = {p.source for rank in sub for p in rank.values()}
        at = target if degree == target.world else type(target)(target.convention, degree)
        want = [{n: p for n, p in rank.items() if p.source in sources}
                for rank in at.pieces(config)]  # an MoE endpoint's EP and options kept
        return translate(shards, sub, want, config.param_shapes())  # no canonical tensor
    return fn


def _matches(mine: torch.Tensor, piece: Piece, given: Sequence[Mapping[str, torch.Tensor]],
             src: Pieces, shapes: Mapping[str, tuple[int, ...]],
             owners: dict[tuple[str, int], Owners | None]) -> bool:
    """Whether ``mine`` is, bit for bit, the stored tensor ``piece`` of the canonical
    parameters the source tensors ``given`` (stored as ``src``) hold: compared run by run
    against views of them (``maps.runs``, ``owners`` its cache), so no canonical tensor is
    made; a piece cut along another dim than its source's is compared through the canonical
    tensor."""
    found = runs(src, piece, shapes[piece.source][piece.dim], owners)
    if found is None:
        canon = gather_canonical(given, src, shapes, [piece.source])
        return bit_equal(mine, piece.take(canon[piece.source]))
    if tuple(mine.shape) != piece.local_shape(shapes[piece.source]):
        return False
    mine = piece.flat(mine)  # a stacked tensor (vLLM's w13) as the selection it stacks
    for run in found:
        part = mine.narrow(piece.dim, run.at, run.length)
        if run.rank is None:
            if not bit_equal(part, torch.zeros_like(part)):
                return False
        else:
            assert run.name is not None
            source = src[run.rank][run.name].flat(given[run.rank][run.name])
            held = source.narrow(piece.dim, run.start, run.length)
            if not bit_equal(part, held):
                return False
    return True


def _cut(pieces: Pieces, full: Params) -> list[Params]:
    """The source's stored tensors of ``full``: each cut once, a data-parallel replica's the
    same tensor as the first rank's that holds it (``Piece.same_cut``; ``fn`` may not write
    into what it is given, so sharing is invisible to it). Megatron's ``tp=2,ep=4`` holds
    four replicas of its TP-2 embedding: one copy of its bytes here, not four."""
    out: list[Params] = []
    cut: dict[str, list[tuple[Piece, torch.Tensor]]] = {}
    for rank in pieces:
        mine: Params = {}
        for name, piece in rank.items():
            held = cut.setdefault(name, [])
            mine[name] = next((x for p, x in held if p.same_cut(piece)), None)
            if mine[name] is None:
                mine[name] = piece.take(full[piece.source])
                held.append((piece, mine[name]))
        out.append(mine)
    return out


def stream_convert(fn: ConvertFn, config: ModelConfig, src: str | Endpoint,
                   dst: str | Endpoint, *, per: str = "layer", seed: int = 0,
                   dtype: torch.dtype | str = torch.float32, threshold: float | None = None,
                   measure_floor: bool = False,
                   progress: Callable[[Progress], None] | None = None) -> Verdict:
    """``check_convert`` streamed (``check.stream``'s steps, for conventions): per stage the
    canonical parameters are drawn, the reference steps, ``fn`` gets that stage's (or one
    canonical parameter's, ``per="parameter"``) source stored tensors and the destination
    degree, its output is validated and compared bit for bit with the declared destination
    tensors of those parameters (the first that differs diagnosed while the canonical tensor
    is here), read by the destination's forward plan, upcast, and the destination forward
    steps; then everything is dropped. The verdict's numbers are the whole-model check's
    (the same draws, steps and comparison); ``first_mismatch`` is the first in stage order.

    Memory: once the reference has stepped, a parameter's canonical tensor is dropped as its
    source slices are cut (they hold every row: the comparison reads them after ``fn``
    returns, so ``fn`` must not write into them: ``UserCodeError``). While ``fn`` runs the
    harness holds the source slices, the stage's parameters not yet converted and the forward
    inputs converted so far; ``fn`` adds its own (``stage_convert``: the destination tensors
    only, written from views of the source's, ``maps.translate``). The comparison reads each
    destination tensor run by run against views of the source slices (``maps.runs``), never
    a canonical tensor, except to diagnose the first mismatch. So a parameter costs its
    source slices plus ``fn``'s output: about 2x its bytes, and 3x where ``fn`` gathers a
    canonical tensor first."""
    InvalidNumber.seed("seed", seed)
    if per not in PER:
        raise ValueError(f"per={per!r}: a streamed check calls fn per {' or per '.join(PER)}")
    source, target = endpoint(src), endpoint(dst)
    src_pieces, dst_pieces = source.pieces(config), target.pieces(config)
    weights = parse_dtype(dtype)
    name = dtype_name(weights)
    notes: tuple[str, ...] = ()
    if threshold is None:  # refused before anything is drawn
        floor = resolve_floor(config, "1a", name, measure=measure_floor)
        threshold = floor.threshold
        notes = environment_notes(floor, config, "1a", name)
        require_cell(floor, config, target)  # a forward its floor never measured: refused
    t = target.world
    shapes = config.param_shapes()
    plan = reading_plan(target.convention, config, target)
    if plan.forward.tp and plan.forward.tp != t:
        raise UnsupportedLayout(f"{target}: a streamed conversion runs the destination's "
                                f"forward over one TP group; {t} ranks hold "
                                f"{t // plan.forward.tp} replicas of TP {plan.forward.tp}: "
                                "check it whole (stream=None)")
    tokens = make_tokens(config, TOKEN_SEED_OFFSET + seed)
    reference = ReferenceSteps(config, tokens)
    guard = RoutingGuard(reference.model.routings, threshold) if config.n_experts else None
    sharded = ShardedSteps.over(plan.forward.config, InProcessCollective(t), tokens,
                                embedding=plan.forward.embedding,
                                experts=plan.forward.experts, guard=guard)
    differ: list[str] = []
    diagnosis: list[str] = []
    with torch.no_grad():
        for group, full in drawn_units(config, seed, weights, per, reference, progress):
            sources = set(group)
            mine_src = [{n: p for n, p in rank.items() if p.source in sources}
                        for rank in src_pieces]
            given = _cut(mine_src, full)
            for n in group:  # the reference has stepped; the source shards hold every row
                del full[n]  # so the peak is 3x the parameter, not 4x (fn's own copies)
            want = [{n: p for n, p in rank.items() if p.source in sources}
                    for rank in dst_pieces]
            # a converter that writes into ``given`` (the harness's own slices, not copies)
            # fails in ``call`` (ModifiedInput), before anything is compared against them
            out = call(fn, (given, t), role="converter", config=config,
                       during=f"while converting {config.name} {source} -> {target} "
                              f"({', '.join(group)})", ends=(source, target))
            validate_convention_shards(out, target, config,
                                       {n: weights for n in config.param_shapes()},
                                       pieces=want)
            assert isinstance(out, Sequence)
            # each destination tensor against views of the harness's own source slices
            owners: dict[tuple[str, int], Owners | None] = {}  # per group: its sources
            for stored in want[0]:
                if not all(_matches(r[stored], w[stored], given, mine_src, shapes, owners)
                           for r, w in zip(out, want)):
                    differ.append(stored)
                    if len(differ) == 1:  # the canonical tensor, for the diagnosis only
                        canon = gather_canonical(given, mine_src, shapes, sources)
                        diagnosis.extend(diagnose(canon, config, stored,
                                                  [w[stored] for w in want],
                                                  [r[stored] for r in out]))
                        del canon
            del given
            inputs = [{c: selections[c].apply(out[rank]) for c in group}
                      for rank, selections in enumerate(plan.ranks)]  # upcast as read
            del out
            sharded.take(group, inputs)
            del inputs
    assert sharded.logits is not None and reference.expected is not None
    error = float((sharded.logits - reference.expected).abs().max())
    return Verdict(config=config.name, src=source.degree, dst=t, max_abs_error=error,
                   threshold=threshold, first_mismatch=differ[0] if differ else None,
                   mismatches=tuple(differ), diagnosis=tuple(diagnosis),
                   own_forward=bool(differ), conventions=(endpoint_name(source),
                                                          endpoint_name(target)),
                   notes=(*notes, *config.notes), dtype=name,
                   near_ties=None if guard is None else guard.near_ties(),
                   route_bound=threshold if guard is not None else None)
