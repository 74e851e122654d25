"""``check_convert``: the verdict on a user's converter between two frameworks' conventions.

``fn(shards, degree)`` gets the source convention's rank-local tensors (``shards_for``) and
returns the destination's. The verdict is ``check_split``'s, for conventions:

- the output's structure first: a list of ``degree`` dicts of exactly the destination's
  names, shapes and dtypes, else ``InvalidShards`` naming the convention, rank and name;
- data movement, bit-exactly, against ``shards_for(config, dst)``; the first parameter that
  differs is diagnosed in CANONICAL terms, each rank's rows matched by their bytes to the
  rows of the full canonical tensor, in heads for the fused qkv
  (``rank 1 model.layers.0.self_attn.qkv_proj.weight holds Q heads 0-3, K head 0, V head 0;
  declared Q heads 4-7, K head 1, V head 1``);
- computation: the destination's forward, reading the tensors as that framework does
  (``conventions.reading``), against the dense reference within the threshold
  ``check_split`` uses for the config. Non-finite logits never pass; a byte mismatch fails
  even when the logits stay within tolerance.

Which floor judges a conversion: the geometry's phase floor (``tolerance.rules.floor_for``:
the committed artifact that records it, else the per-geometry one cached under
``tolerance_dir()/geometry/``, else ``FloorNotMeasured``), the same one ``check_split``
reads. It covers the conversion's forward because, once ``reading_plan`` has put each rank's
stored rows in forward order, that forward IS the plain layout's sharded forward at the
destination degree: the same ``ShardedModel`` steps over ``layout_for``'s placements, so the
same row-parallel partial sums (o_proj and down over t contiguous chunks of their input
dimension, the all-reduced vocab-parallel embedding), which are the only source of rounding
a layout adds; the two departures add none (Meta's hidden-split embedding is an all-gather,
a concatenation; vLLM's replicated KV heads are copies, each Q head's attention computed on
one rank as under the plain layout). The one degree the plain floor cannot have measured is
vLLM's t > n_kv_heads (``HeadPartitioned`` rejects it): its o_proj sums t partials where the
floor's largest degree summed fewer. So a floor measures that forward too, in cells of its own
(``check.floor``: ``"forward": "vllm-replicated-kv"``), and a conversion whose destination
forward has no cell at its degree in the floor that judges it is refused before the
converter runs (``require_cell``: ``FloorNotMeasured`` naming the geometry, the degree, the
convention and the command that measures it), never judged by the plain cells' threshold.

``dtype`` (``"bf16"``, ``"fp16"``): the synced weights' dtype, as for ``check_split``: the
source shards are in it, the output is compared bit for bit in it (an fp32 tensor where
bf16 is declared is ``WrongShardShape`` naming rank, name and both dtypes), both forwards
compute in fp32 from those values, judged by that dtype's floor. ``stream="layer"`` (or
``"parameter"``) streams the check as ``check.stream`` does a split: ``fn`` called once per
stage (or canonical parameter) with that stage's stored tensors only, memory bounded by
the largest parameter (``stream_convert``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from weight_sync_bench.check.checker import (
    Checker,
    Verdict,
    checker_for,
    environment_notes,
    resolve_floor,
)
from weight_sync_bench.check.diagnosis import (
    _bit_equal,
    format_indices,
    locate,
    mismatching,
    slice_index,
)
from weight_sync_bench.check.floor import (
    REPLICATED_MAX_DEGREE,
    convention_logits,
    forward_of,
)
from weight_sync_bench.check.user_code import check_signature, frame_error
from weight_sync_bench.check.user_code import describe as describe_fn
from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.conventions import (
    endpoint,
    forward_inputs,
    materialize,
    reading_plan,
)
from weight_sync_bench.conventions.maps import (
    Owners,
    Piece,
    Pieces,
    gather_canonical,
    runs,
    translate,
)
from weight_sync_bench.conventions.meta import permute_index
from weight_sync_bench.errors import (
    CheckpointError,
    FloorNotMeasured,
    InvalidNumber,
    InvalidShards,
    UserCodeError,
    WrongShardShape,
)
from weight_sync_bench.model.config import (
    dtype_name,
    init_params,
    iter_params,
    make_tokens,
    parse_dtype,
)
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.sharded import ShardedModel
from weight_sync_bench.tolerance.phase import PLAIN_FORWARD, measured_degrees
from weight_sync_bench.tolerance.rules import (
    TOKEN_SEED_OFFSET,
    derive_threshold,
    measure_command,
    weights_dtype,
)

if TYPE_CHECKING:
    from weight_sync_bench.check.stream import Progress
    from weight_sync_bench.collectives.gloo.rank import RankContext
    from weight_sync_bench.conventions import Endpoint, ForwardLayout, Piece
    from weight_sync_bench.conventions.maps import Pieces
    from weight_sync_bench.model.config import ModelConfig
    from weight_sync_bench.tolerance.rules import Floor


Params = dict[str, torch.Tensor]
# (source convention's shards, destination degree) -> destination convention's shards
ConvertFn = Callable[[list[dict[str, torch.Tensor]], int], list[dict[str, torch.Tensor]]]


@dataclass
class ConversionChecker:
    """Checks conversions of one (config, seed): the reference and threshold are the
    ``Checker``'s (computed once), each destination's declared shards and their forward
    once; a shard set byte-identical to the declared one reuses that forward."""

    config: ModelConfig
    seed: int = 0
    backend: str = "inprocess"
    threshold: float | None = None
    dtype: torch.dtype | str = torch.float32  # the synced weights' (``Checker.dtype``)
    measure_floor: bool = False  # measure (and cache) an unmeasured geometry's floor
    checker: Checker = field(init=False)
    _declared: dict[str, list[Params]] = field(init=False, default_factory=dict)
    _declared_error: dict[str, float] = field(init=False, default_factory=dict)
    _slices: dict[tuple[str, int], dict[bytes, int]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.checker = checker_for(self.config, seed=self.seed, backend=self.backend,
                                   threshold=self.threshold, dtype=self.dtype,
                                   measure_floor=self.measure_floor)

    def source(self, where: str | Endpoint) -> list[Params]:
        """Fresh copies of a convention's declared shards (what ``fn`` receives)."""
        return materialize(endpoint(where).pieces(self.config), self.checker.full)

    def declared(self, where: str | Endpoint) -> list[Params]:
        """``shards_for(config, where)`` at the checker's seed (cached; do not mutate)."""
        key = str(endpoint(where))
        if key not in self._declared:
            self._declared[key] = self.source(where)
        return self._declared[key]

    def error(self, where: str | Endpoint, shards: Sequence[Mapping[str, torch.Tensor]]) -> float:
        """Max |logits - reference| of ``where``'s forward reading ``shards``."""
        tokens = self.checker.tokens
        assert tokens is not None
        return self.checker.deviation(convention_logits(
            endpoint(where), self.config, shards, tokens,
            "1a" if self.backend == "inprocess" else "1b"))

    def require(self, where: str | Endpoint) -> None:
        """``require_cell`` of the floor this checker's threshold came from (none where the
        threshold was given: the caller's choice)."""
        require_cell(self.checker.floor, self.config, endpoint(where))

    def slice_index(self, source: str, dim: int) -> dict[bytes, int]:
        """``diagnosis.slice_index`` of a canonical parameter (cached: a diagnosis matches
        every shard's slices against it)."""
        if (source, dim) not in self._slices:
            self._slices[source, dim] = slice_index(self.checker.full[source], dim)
        return self._slices[source, dim]

    def declared_error(self, where: str | Endpoint) -> float:
        key = str(endpoint(where))
        if key not in self._declared_error:
            self._declared_error[key] = self.error(where, self.declared(where))
        return self._declared_error[key]

    def verdict(self, shards: object, *, src: str | Endpoint, dst: str | Endpoint,
                mutation: str | None = None) -> Verdict:
        """Validate, compare bytes with the declared destination, run a forward only if
        they differ (with a diagnosis of the first parameter that does)."""
        source, target = endpoint(src), endpoint(dst)
        self.require(target)  # a destination forward its floor never measured: refused
        validate_convention_shards(shards, target, self.config,
                                   {n: x.dtype for n, x in self.checker.full.items()})
        assert isinstance(shards, Sequence)
        checked = [dict(params) for params in shards]
        declared = self.declared(target)
        pieces = target.pieces(self.config)
        differ = mismatching(checked, declared, list(pieces[0]))
        assert self.checker.threshold is not None
        common: dict[str, Any] = {
            "config": self.config.name, "src": source.degree, "dst": target.degree,
            "threshold": self.checker.threshold, "phase": self.checker.phase,
            "mutation": mutation, "conventions": (source.name, target.name),
            "notes": self.checker.notes,
            "dtype": self.checker.dtype_name}
        if not differ:
            return Verdict(max_abs_error=self.declared_error(target), first_mismatch=None,
                           **common)
        first = differ[0]
        lines = diagnose_piece(self.checker.full, self.config, first,
                               [p[first] for p in pieces], [s[first] for s in checked],
                               index=self.slice_index)
        return Verdict(max_abs_error=self.error(target, checked), first_mismatch=first,
                       mismatches=tuple(differ), own_forward=True, diagnosis=tuple(lines),
                       **common)


def check_convert(fn: ConvertFn, config: ModelConfig, src: str, dst: str, *, seed: int = 0,
                  backend: str = "inprocess", threshold: float | None = None,
                  dtype: torch.dtype | str = torch.float32, measure_floor: bool = False,
                  stream: str | None = None,
                  progress: Callable[[Progress], None] | None = None) -> Verdict:
    """Check a user's converter ``fn(shards, degree)`` from ``src`` to ``dst`` (``"megatron:4"``,
    ``"vllm:2"``, ``"hf"`` for degree 1): it gets fresh copies of ``shards_for(config, src)``
    and the destination degree, and must return ``shards_for(config, dst)`` byte for byte.

    The threshold is the one ``check_split`` uses for ``config`` (the floor that covers its
    geometry, ``tolerance.rules.floor_for``; ``FloorNotMeasured`` naming the command where
    none does, unless ``measure_floor`` measures and caches it), or ``threshold`` when given;
    a floor without a cell of the destination's forward at its degree (vLLM past
    ``n_kv_heads``) refuses the check before ``fn`` runs (``require_cell``).
    ``dtype``, ``stream`` and ``progress``: see the module docstring. ``backend="gloo"``
    runs the destination forward one process per rank (phase 1b), its forward inputs
    scattered by ``GlooTransport`` under the destination's forward layout (Meta's
    hidden-split embedding and vLLM's replicated KV heads included)."""
    InvalidNumber.seed("seed", seed)
    source, target = endpoint(src), endpoint(dst)
    source.pieces(config)  # both conventions' rules, before the user's code runs
    target.pieces(config)
    if stream is not None:
        if backend != "inprocess":
            raise ValueError(f"stream={stream!r} runs in process (phase 1a); backend "
                             f"{backend!r} holds the whole model on rank 0")
        return stream_convert(fn, config, source, target, per=stream, seed=seed, dtype=dtype,
                              threshold=threshold, measure_floor=measure_floor,
                              progress=progress)
    checker = ConversionChecker(config, seed=seed, backend=backend, threshold=threshold,
                                dtype=dtype, measure_floor=measure_floor)
    checker.require(target)  # refused before the user's code runs
    args = (checker.source(source), target.degree)
    check_signature(fn, args, role="converter", call="fn(shards, degree)")
    try:
        out = fn(*args)
    except Exception as exc:
        raise frame_error(exc, role="converter", function=describe_fn(fn),
                          during=f"while converting {config.name} {source} -> {target}") from exc
    return checker.verdict(out, src=source, dst=target)


def require_cell(floor: Floor | None, config: ModelConfig, target: Endpoint) -> None:
    """Raise ``FloorNotMeasured`` unless ``floor`` (the one judging a conversion to
    ``target``; None for a threshold given explicitly) measured the destination's forward
    (``check.floor.forward_of``: vLLM's replicated KV heads at t > n_kv_heads, else the plain
    layout's) at its degree. The error names the geometry, the degree, the convention, what
    the floor measured and the command that measures the missing cell."""
    if floor is None:
        return
    degree = target.degree
    forward = forward_of(target.convention, config, degree)
    measured = measured_degrees(floor.artifact, config.name, forward)
    if degree in measured:
        return
    phase, dtype = str(floor.artifact.get("phase", "1a")), weights_dtype(floor.artifact)
    plain = measured_degrees(floor.artifact, config.name, PLAIN_FORWARD)
    had = (f"measured it at t={', '.join(map(str, measured))}" if measured
           else "never measured it")
    why = (f"{config.name}: no measured floor covers the forward of {target} (phase {phase}, "
           f"{dtype} weights, d_model {config.d_model}, n_heads {config.n_heads}, n_kv_heads "
           f"{config.n_kv_heads}): {target.convention.name} at t={degree} runs the {forward} "
           f"forward, and {floor.path.name} {had} (its plain cells: t="
           f"{', '.join(map(str, plain)) or 'none'}); a threshold measured on another forward "
           "or degree does not judge it")
    if forward == PLAIN_FORWARD and not layout_for(config).supports(degree):
        raise FloorNotMeasured(  # the plain layout cannot store t: no floor measurement can
            f"{why}. The plain layout cannot store t={degree}, so no floor measurement has "
            "this cell; pass threshold= explicitly (e.g. check.convert.measure_threshold)")
    command = _cell_command(floor, config, phase, dtype, degree)
    raise FloorNotMeasured(f"{why}. Measure it with `{command}`", command=command)


def _cell_command(floor: Floor, config: ModelConfig, phase: str, dtype: str,
                  degree: int) -> str:
    """What measures ``floor`` again with the cell at ``degree``: the committed floor's
    measuring command, or the per-geometry floor's (``--force``: it is cached already); a
    Python call where the degree is past ``REPLICATED_MAX_DEGREE`` (the command's bound)."""
    tail = (f" --phase {phase}" if phase != "1a" else "") + (
        f" --dtype {dtype}" if dtype != "fp32" else "")
    if degree > REPLICATED_MAX_DEGREE:
        what = "measure" if floor.source == "committed" else "measure_geometry"
        configs = f"configs=[{config.name}], replicated=True, " if what == "measure" else (
            "config, ")
        return (f"weight_sync_bench.check.floor.{what}({configs}phase={phase!r}, "
                f"dtype={dtype!r}, max_degree={degree})")
    if floor.source == "committed":
        return f"python -m weight_sync_bench.tolerance{tail} --write"
    command = measure_command(config, phase, dtype)
    return f"{command} --force" if command.startswith("python -m") else command


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
        want = [{n: p for n, p in rank.items() if p.source in sources}
                for rank in type(target)(target.convention, degree).pieces(config)]
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
        return _bit_equal(mine, piece.take(canon[piece.source]))
    for run in found:
        part = mine.narrow(piece.dim, run.at, run.length)
        if run.rank is None:
            if not _bit_equal(part, torch.zeros_like(part)):
                return False
        else:
            assert run.name is not None
            held = given[run.rank][run.name].narrow(piece.dim, run.start, run.length)
            if not _bit_equal(part, held):
                return False
    return True


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
    from weight_sync_bench.check.stream import (
        PER,
        _draw,
        _Reference,
        _Sharded,
        stages,
        units,
    )
    from weight_sync_bench.check.stream import Progress as Step

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
    t = target.degree
    shapes = config.param_shapes()
    plan = reading_plan(target.convention, config, t)
    tokens = make_tokens(config, TOKEN_SEED_OFFSET + seed)
    reference = _Reference(config, tokens)
    sharded = _Sharded.reading(plan, t, tokens)
    draws = iter_params(config, seed, dtype=weights)
    differ: list[str] = []
    diagnosis: list[str] = []
    signed = False
    started, steps = time.perf_counter(), stages(config)
    with torch.no_grad():
        for k, (label, names) in enumerate(steps):
            size = 0
            for group in units(names, per):
                full = _draw(draws, group)
                size += sum(x.numel() * x.element_size() for x in full.values())
                reference.take(group, full)
                sources = set(group)
                mine_src = [{n: p for n, p in rank.items() if p.source in sources}
                            for rank in src_pieces]
                given = [{n: p.take(full[p.source]) for n, p in rank.items()}
                         for rank in mine_src]
                for n in group:  # the reference has stepped; the source shards hold every row
                    del full[n]  # so the peak is 3x the parameter, not 4x (fn's own copies)
                want = [{n: p for n, p in rank.items() if p.source in sources}
                        for rank in dst_pieces]
                args = (given, t)
                if not signed:
                    check_signature(fn, args, role="converter", call="fn(shards, degree)")
                    signed = True
                versions = [x._version for rank in given for x in rank.values()]
                try:
                    out = fn(*args)
                except Exception as exc:
                    raise frame_error(exc, role="converter", function=describe_fn(fn),
                                      during=f"while converting {config.name} {source} -> "
                                             f"{target} ({', '.join(group)})") from exc
                if [x._version for rank in given for x in rank.values()] != versions:
                    raise UserCodeError(
                        f"your converter `{describe_fn(fn)}` wrote into the tensors it was "
                        f"given ({', '.join(group)}) while converting {config.name} {source} "
                        f"-> {target}: a streamed check hands fn its own tensors, not copies; "
                        "return new ones", role="converter", function=describe_fn(fn))
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
                            diagnosis.extend(diagnose_piece(canon, config, stored,
                                                            [w[stored] for w in want],
                                                            [r[stored] for r in out]))
                            del canon
                del given, args  # args holds given too
                inputs = [{c: selections[c].apply(out[rank]) for c in group}
                          for rank, selections in enumerate(plan.ranks)]  # upcast as read
                del out
                sharded.take(group, inputs)
                del inputs
            if progress is not None:
                progress(Step(k + 1, len(steps), label, size, time.perf_counter() - started))
    assert sharded.logits is not None and reference.expected is not None
    error = float((sharded.logits - reference.expected).abs().max())
    return Verdict(config=config.name, src=source.degree, dst=t, max_abs_error=error,
                   threshold=threshold, first_mismatch=differ[0] if differ else None,
                   mismatches=tuple(differ), diagnosis=tuple(diagnosis),
                   own_forward=bool(differ), conventions=(source.name, target.name),
                   notes=notes, dtype=name)


def verify_checkpoint(directory: str | Path, config: ModelConfig, dst: str, *,
                      src: str | None = None, seed: int = 0, backend: str = "inprocess",
                      threshold: float | None = None, measure_floor: bool = False
                      ) -> Verdict:
    """``check_convert``'s verdict on a checkpoint a converter wrote to ``directory`` in
    ``dst``'s files (``conventions.checkpoint``: per-rank safetensors for ``vllm:2``, an HF
    directory for ``hf``, consolidated files for ``meta:2``), against the synthetic model
    of ``seed`` (what ``wsb emit`` wrote). ``src`` names the source in the verdict only
    (default ``dst``); with the converter's source it is the verdict ``check_convert``
    gives the same tensors. A file missing, truncated, mis-named or holding a tensor of the
    wrong name, shape or dtype raises ``CheckpointError`` naming the file. The threshold is
    ``check_convert``'s (``floor_for``; ``measure_floor`` measures and caches an unmeasured
    geometry's floor, else ``FloorNotMeasured`` names the command)."""
    from weight_sync_bench.conventions.checkpoint import read_checkpoint

    InvalidNumber.seed("seed", seed)
    target = endpoint(dst)
    source = endpoint(src) if src is not None else target
    target.pieces(config)
    checkpoint = read_checkpoint(directory, target, config)
    checker = ConversionChecker(config, seed=seed, backend=backend, threshold=threshold,
                                measure_floor=measure_floor)
    try:
        validate_convention_shards(checkpoint.shards, target, config,
                                   {n: x.dtype for n, x in checker.checker.full.items()})
    except WrongShardShape as exc:  # names and shapes were read checked: a dtype
        path = checkpoint.file_of(exc.rank or 0, exc.name or "")
        raise CheckpointError(f"{path}: {exc}", path=str(path)) from None
    return checker.verdict(checkpoint.shards, src=source, dst=target)


def gloo_logits(forward: ForwardLayout, inputs: Sequence[Mapping[str, torch.Tensor]],
                tokens: torch.Tensor) -> torch.Tensor:
    """Phase 1b of a convention's forward: rank 0 of the process's shared rank pool holds
    every rank's forward inputs, ``GlooTransport`` scatters them under ``forward.layout``
    (whatever its placements: ``HeadReplicated``, a ``Shard(1)`` embedding), and each rank
    runs ``ShardedModel.forward`` over ``GlooCollective`` with ``forward.embedding``, as
    phase 1a runs it over ``InProcessCollective``. Returns rank 0's full logits."""
    from weight_sync_bench.collectives.gloo.pool import (
        shared_pool,  # rank processes start on first use
    )

    degree = len(inputs)
    dtype = next(iter(inputs[0].values())).dtype
    outcomes = shared_pool(max(4, degree)).run(
        conversion_forward_task, degree,
        kwargs={"forward": forward, "tokens": tokens, "dtype": dtype},
        rank_kwargs=[{"inputs": [dict(x) for x in inputs] if rank == 0 else None}
                     for rank in range(degree)])
    return outcomes[0]


def conversion_forward_task(ctx: RankContext, *, forward: ForwardLayout, tokens: torch.Tensor,
                            dtype: torch.dtype,
                            inputs: Sequence[Mapping[str, torch.Tensor]] | None
                            ) -> torch.Tensor | None:
    """The rank side of ``gloo_logits`` (``check.forwards.phase1b_task``'s transport and
    forward, under a convention's forward layout rather than ``layout_for``'s)."""
    from weight_sync_bench.collectives.gloo.collective import GlooCollective
    from weight_sync_bench.collectives.gloo.transport import GlooTransport, ParamSink

    sink = ParamSink()
    GlooTransport(ctx, forward.layout, dtype=dtype).sync(inputs if ctx.rank == 0 else None,
                                                         sink)
    ctx.tracer.mark("forward")
    model = ShardedModel(forward.config, [sink], GlooCollective(ctx),
                         embedding=forward.embedding)
    with torch.no_grad():
        (logits,) = model(tokens)
    return logits if ctx.rank == 0 else None


def measure_threshold(config: ModelConfig, endpoints: Iterable[str | Endpoint],
                      seeds: Iterable[int] = range(4)) -> float:
    """A threshold for a geometry with no committed floor (an HF config, reduced): the
    floor measured as the phase 1a artifact is, the max |logits - reference| of every
    endpoint's declared shards over model seeds ``s`` and token seeds ``1000 + s``, then
    ``derive_threshold`` (the smallest power of ten >= 100x it)."""
    worst = 0.0
    eps = [endpoint(e) for e in endpoints]
    for seed in seeds:
        params = init_params(config, seed)
        tokens = make_tokens(config, TOKEN_SEED_OFFSET + seed)
        reference = ReferenceModel(config, params)(tokens)
        for ep in eps:
            plan = reading_plan(ep.convention, config, ep.degree)
            shards = materialize(ep.pieces(config), params)
            logits = ShardedModel(plan.forward.config,
                                  forward_inputs(shards, ep.convention, config, ep.degree),
                                  InProcessCollective(ep.degree),
                                  embedding=plan.forward.embedding)(tokens)[0]
            worst = max(worst, float((logits - reference).abs().max()))
    return derive_threshold(worst)


def validate_convention_shards(shards: object, where: Endpoint, config: ModelConfig,
                               dtypes: Mapping[str, torch.dtype], *,
                               pieces: Pieces | None = None) -> None:
    """Raise unless ``shards`` is a list of ``where.degree`` dicts holding exactly the
    convention's stored names (str keys) with their declared shapes and the canonical
    parameters' dtypes. ``InvalidShards`` (``WrongShardShape`` for a shape or dtype) names
    the endpoint, the rank, the stored name, the expected and the actual value. ``pieces``:
    only these stored tensors (one stage of a streamed check), else all of them."""
    degree, shapes = where.degree, config.param_shapes()
    pieces = pieces if pieces is not None else where.pieces(config)
    if not isinstance(shards, Sequence) or isinstance(shards, (str, bytes)):
        raise InvalidShards(f"{where}: expected a list of {degree} rank dicts, got "
                            f"{type(shards).__name__}")
    if len(shards) != degree:
        raise InvalidShards(f"{where}: expected {degree} rank dicts, got {len(shards)}")
    for rank, (params, expected) in enumerate(zip(shards, pieces)):
        if not isinstance(params, Mapping):
            raise InvalidShards(f"{where} rank {rank}: expected a dict of tensors, got "
                                f"{type(params).__name__}")
        for key in params:
            if not isinstance(key, str):
                raise InvalidShards(f"{where} rank {rank}: key {key!r} is a "
                                    f"{type(key).__name__}, expected a str parameter name")
        missing = [n for n in expected if n not in params]
        extra = sorted(set(params) - set(expected))
        if missing or extra:
            parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
                [f"unexpected {', '.join(extra)}"] if extra else [])
            tied = (" (tied embeddings: the output layer reads the embedding table, not a "
                    "stored copy)" if config.tie_embeddings and extra else "")
            raise InvalidShards(f"{where} rank {rank}: {'; '.join(parts)}{tied}")
        for name, piece in expected.items():
            x = params[name]
            if not isinstance(x, torch.Tensor):
                raise InvalidShards(f"{where} rank {rank} {name}: expected a Tensor, got "
                                    f"{type(x).__name__}")
            want, actual = piece.local_shape(shapes[piece.source]), tuple(x.shape)
            if actual != want:
                raise WrongShardShape(f"{where} rank {rank} {name}: shape {list(actual)}, "
                                      f"declared {list(want)}", rank=rank, name=name,
                                      expected=want, actual=actual)
            if x.device.type != "cpu":
                raise InvalidShards(f"{where} rank {rank} {name}: on the {x.device.type} "
                                    "device: the check compares values, so return CPU tensors")
            if x.dtype != dtypes[piece.source]:
                raise WrongShardShape(f"{where} rank {rank} {name}: dtype {x.dtype}, declared "
                                      f"{dtypes[piece.source]}", rank=rank, name=name,
                                      expected_dtype=dtypes[piece.source], actual_dtype=x.dtype)


def diagnose_piece(canonical: Mapping[str, torch.Tensor], config: ModelConfig, name: str,
                   declared: list[Piece], shards: list[torch.Tensor], *,
                   index: Callable[[str, int], dict[bytes, int]] | None = None) -> list[str]:
    """For each rank whose ``name`` is not the declared one: which canonical indices it
    holds (its slices matched by bytes to the full canonical tensor's; an all-zero slice
    reads as padding) against the declared ones, in heads for the fused qkv."""
    lines = []
    for rank, (piece, shard) in enumerate(zip(declared, shards)):
        full = canonical[piece.source]
        if _bit_equal(shard, piece.take(full)):
            continue
        held: list[int | None] = locate(full, shard, piece.dim, index(piece.source, piece.dim)
                                        if index is not None else None)
        zero = (shard.movedim(piece.dim, 0).reshape(shard.shape[piece.dim], -1) == 0).all(1)
        held = [-1 if i is None and z else i for i, z in zip(held, zero.tolist())]
        want = piece.idx.tolist()
        if held == want:
            lines.append(f"rank {rank} {name} holds the declared "
                         f"{describe(want, piece, config)}, with values changed")
            continue
        lines.append(f"rank {rank} {name} holds {describe(held, piece, config)}; "
                     f"declared {describe(want, piece, config)}")
    return lines


def describe(indices: list[int | None], piece: Piece, config: ModelConfig) -> str:
    """Canonical indices as a person reads them: ``Q heads 0-3, K head 1, V head 1`` for the
    fused qkv (``... in pair order`` for Meta's interleaved-pair rows), ``gate rows 0-351,
    up rows 0-351`` for gate_up, else ``rows 0-15999, padding x64`` (``?`` for a slice found
    nowhere in the canonical tensor)."""
    if piece.dim == 0 and piece.source.endswith(("qkv.weight", "qkv.bias")):
        heads = _in_heads(indices, config)
        if heads is not None:
            return heads
    if piece.dim == 0 and piece.source.endswith("gate_up.weight"):
        blocks = _in_blocks(indices, [("gate", 0, config.ffn), ("up", config.ffn, 2 * config.ffn)])
        if blocks is not None:
            return blocks
    axis = ("elements" if len(config.param_shapes()[piece.source]) == 1
            else {0: "rows", 1: "columns"}.get(piece.dim, f"indices of dim {piece.dim}"))
    return f"{axis} {_with_padding(indices)}"


def _with_padding(indices: list[int | None]) -> str:
    """``format_indices``, with each run of padding (-1) written ``padding xN``."""
    return ", ".join(f"padding x{len(run)}" if pad else format_indices(run)
                     for pad, group in itertools.groupby(indices, key=lambda i: i == -1)
                     for run in [list(group)])


def _in_blocks(indices: list[int | None], blocks: list[tuple[str, int, int]]) -> str | None:
    """``gate rows 0-351, up rows 0-351``: each run of indices inside one named block."""
    out: list[tuple[str, list[int]]] = []
    for i in indices:
        if i is None or i < 0:
            return None
        label, start = next((lb, a) for lb, a, b in blocks if a <= i < b)
        if out and out[-1][0] == label:
            out[-1][1].append(i - start)
        else:
            out.append((label, [i - start]))
    return ", ".join(f"{label} rows {format_indices(list(rows))}" for label, rows in out)


def _in_heads(indices: list[int | None], config: ModelConfig) -> str | None:
    """The fused qkv's canonical rows as whole heads, or None when they are not whole heads
    (each hd-row unit one head's rows, in rotate-half or Meta's pair order)."""
    hd, q, kv = config.head_dim, config.q_rows, config.kv_rows
    if len(indices) % hd or any(i is None or i < 0 for i in indices):
        return None
    pair = [int(x) for x in torch.argsort(permute_index(hd, 1)).tolist()]  # Meta row order
    units: list[tuple[str, int, str]] = []  # (block, head, order)
    for u in range(0, len(indices), hd):
        unit = [int(i) for i in indices[u:u + hd]]  # type: ignore[arg-type]
        block, base = ("Q", 0) if unit[0] < q else ("K", q) if unit[0] < q + kv else ("V", q + kv)
        head, offsets = (unit[0] - base) // hd, [i - base - ((unit[0] - base) // hd) * hd
                                                   for i in unit]
        order = "" if offsets == list(range(hd)) else " in pair order" if offsets == pair else None
        if order is None:
            return None
        units.append((block, head, order))
    parts: list[tuple[str, int, int, str]] = []  # (block, first head, last head, order)
    for block, head, order in units:
        if parts and parts[-1][0] == block and parts[-1][2] == head - 1 and parts[-1][3] == order:
            parts[-1] = (block, parts[-1][1], head, order)
        else:
            parts.append((block, head, head, order))
    return ", ".join(f"{b} head {a}{o}" if a == z else f"{b} heads {a}-{z}{o}"
                     for b, a, z, o in parts)
