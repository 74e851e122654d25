"""Phase 1b: one process per rank over gloo, shards delivered by GlooTransport.

``run_phase1b(config, t, param_seed=..., token_seed=...)`` runs, on ranks 0..t-1 of a
``RankPool``: rank 0 builds the full parameters from the seed and splits them (the
declared ``split``, a user's ``split_fn``, or the caller's ``shards``); ``GlooTransport``
scatters each rank its shards; every rank runs ``ShardedModel.forward`` over
``GlooCollective``, the same forward phase 1a runs over ``InProcessCollective``; rank 0's
full logits come back.

Parameters are built on rank 0 from the seed rather than in the caller and shipped through
a pipe, which costs more than building them (``bench/bench_gloo.py`` measures both); a fuzz
loop then sends a few integers per check. ``shards=`` ships the caller's shards when it has
them, and ``gloo_forward`` / ``phase1b_runner`` fit ``check.Forward`` / ``tolerance.ShardedRunner``.
"""

from __future__ import annotations

import hashlib
import inspect
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import CodeType, FunctionType, ModuleType
from typing import TYPE_CHECKING, Any

import torch

from weight_sync_bench.collectives.gloo.collective import GlooCollective
from weight_sync_bench.collectives.gloo.pool import RankPool, shared_pool
from weight_sync_bench.collectives.gloo.transport import (
    GlooTransport,
    ParamSink,
    SyncRecord,
)
from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.errors import UnsupportedLayout
from weight_sync_bench.layout.reshard import split, validate_shards
from weight_sync_bench.model.config import ModelConfig, init_params, make_tokens
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.sharded import RoutingGuard, ShardedModel

if TYPE_CHECKING:
    from weight_sync_bench.collectives.gloo.breadcrumbs import Fault
    from weight_sync_bench.collectives.gloo.rank import RankContext
    from weight_sync_bench.conventions import ForwardLayout

# (full params, degree) -> rank-local dicts: a user's split function, as ``check.SplitFn``
SplitFn = Callable[[dict[str, torch.Tensor], int], list[dict[str, torch.Tensor]]]
Params = dict[str, torch.Tensor]
# A check's sharded forward: (config, rank-local shards at degree t, tokens) -> rank 0's full
# logits (``inprocess_forward``, ``gloo_forward()``).
# (config, shards, tokens[, guard=]) -> rank 0's logits; ``guard``: an MoE forward's routing
# guard (``model.sharded.RoutingGuard``), None for a dense model
Forward = Callable[..., torch.Tensor]

# The modules the sharded forward is made of: ShardedModel and the blocks it shares with the
# reference. Not the collective (it differs between the phases by design) and not torch.
FORWARD_MODULES = ("weight_sync_bench.model.sharded", "weight_sync_bench.model.reference")

# Where a check's sharded forward runs: every rank in this process (``inprocess_forward``,
# phase 1a) or one process per rank over gloo (``gloo_forward``, phase 1b).
BACKENDS = ("inprocess", "gloo")


@dataclass(frozen=True)
class Phase1bResult:
    """What one phase 1b check returns.

    ``logits``: rank 0's full logits ``(B, T, vocab)``. ``reference``: the dense
    ``ReferenceModel`` logits of the same parameters and tokens, computed on rank 0 when
    asked. ``records``: every rank's ``SyncRecord``. ``forward_codes``: per rank, the fingerprint
    of the forward code it ran (``forward_fingerprint``). ``shards``: what each
    rank's sink received, when asked (for bit-exact checks of the transport).
    """

    logits: torch.Tensor
    reference: torch.Tensor | None
    records: tuple[SyncRecord, ...]
    forward_codes: tuple[str, ...]
    shards: tuple[dict[str, torch.Tensor], ...] | None = None


def forward_fingerprint(modules: Sequence[str] = FORWARD_MODULES) -> str:
    """One digest of every function and method defined in ``modules`` (the forward and every
    block it calls: rms_norm, rope, attention, swiglu, the region and reduction methods):
    equal in two processes exactly when both would run the same compiled forward. What it
    does not cover: torch itself and the collective object the forward is handed."""
    digest = hashlib.sha256()
    for name in modules:
        for qualname, function in _functions(sys.modules[name]):
            digest.update(f"{name}.{qualname}".encode())
            _feed(digest, function.__code__)
    return digest.hexdigest()[:16]


# What a code object is, field by field. Not ``marshal.dumps``: marshal flags an object
# referenced more than once (``w_ref`` reads its reference count), so the same code gave other
# bytes in a process that had loaded it from a .pyc, or ran under a profiler.
_CODE_FIELDS = ("co_name", "co_qualname", "co_filename", "co_firstlineno", "co_argcount",
                "co_posonlyargcount", "co_kwonlyargcount", "co_flags", "co_code", "co_names",
                "co_varnames", "co_freevars", "co_cellvars", "co_linetable",
                "co_exceptiontable")


def _feed(digest: Any, value: object) -> None:
    """Feed ``value`` (a code object, one of its fields or constants) to ``digest``, the
    same in every process: nested code recursively, a frozenset's members sorted (their
    iteration order follows each process's string hash seed), any other constant by type
    and ``repr``."""
    if isinstance(value, CodeType):
        digest.update(b"code(")
        for field in _CODE_FIELDS:
            _feed(digest, getattr(value, field, None))
        _feed(digest, value.co_consts)
        digest.update(b")")
    elif isinstance(value, tuple):
        digest.update(b"tuple(")
        for item in value:
            _feed(digest, item)
        digest.update(b")")
    elif isinstance(value, frozenset):
        digest.update(b"frozenset(" + b",".join(sorted(repr(v).encode() for v in value)) + b")")
    elif isinstance(value, bytes):
        digest.update(b"bytes%d:" % len(value) + value)
    else:
        digest.update(f"{type(value).__name__}:{value!r};".encode())


def _functions(module: ModuleType) -> list[tuple[str, FunctionType]]:
    """``(qualname, function)`` of every function and method ``module`` defines, sorted."""
    found: list[tuple[str, FunctionType]] = []
    for name, value in vars(module).items():
        if inspect.isfunction(value) and value.__module__ == module.__name__:
            found.append((name, value))
        elif inspect.isclass(value) and value.__module__ == module.__name__:
            found += [(f"{name}.{attr}", fn) for attr, fn in vars(value).items()
                      if inspect.isfunction(fn)]
    return sorted(found, key=lambda item: item[0])


def run_phase1b(config: ModelConfig, degree: int, *, param_seed: int, token_seed: int,
                pool: RankPool | None = None,
                shards: Sequence[Mapping[str, torch.Tensor]] | None = None,
                split_fn: SplitFn | None = None, tokens: torch.Tensor | None = None,
                guard: RoutingGuard | None = None,
                reference: bool = False, return_shards: bool = False,
                deadline: float | None = None, fault: Fault | None = None) -> Phase1bResult:
    """One phase 1b check on ``pool`` (a one-off pool of ``degree`` ranks when None).

    Rank 0 builds ``init_params(config, param_seed)`` and splits it with ``split_fn``
    (``(full, degree) -> list[dict]`` as ``check.SplitFn``, picklable by reference) or the
    declared ``split``; or pass ``shards``, rank-local dicts already made (checked here,
    before anything reaches a rank; ``param_seed`` then only feeds ``reference``). Tokens
    are ``make_tokens(config, token_seed)`` on every rank, or ``tokens`` when given.
    ``deadline`` and ``fault`` go to ``RankPool.run``.
    """
    layout = layout_for(config)
    layout.validate(degree)
    if shards is not None and split_fn is not None:
        raise ValueError("run_phase1b: pass shards or split_fn, not both")
    if shards is not None:
        validate_shards(shards, layout, degree)
        shards = [dict(params) for params in shards]
    if split_fn is not None:
        try:
            pickle.dumps(split_fn)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise TypeError(f"run_phase1b: split_fn {split_fn!r} must be picklable by reference "
                            f"(a module-level function) to run on rank 0: {exc}") from exc
    kwargs = {"config": config, "param_seed": param_seed, "token_seed": token_seed,
              "tokens": tokens, "split_fn": split_fn, "reference": reference, "guard": guard,
              "return_shards": return_shards}
    rank_kwargs = [{"shards": shards if rank == 0 else None} for rank in range(degree)]
    if pool is None:
        with RankPool(degree) as one_off:
            outcomes = one_off.run(phase1b_task, degree, kwargs=kwargs, rank_kwargs=rank_kwargs,
                                   deadline=deadline, fault=fault)
    else:
        outcomes = pool.run(phase1b_task, degree, kwargs=kwargs, rank_kwargs=rank_kwargs,
                            deadline=deadline, fault=fault)
    first = outcomes[0]
    return Phase1bResult(
        logits=first["logits"], reference=first["reference"],
        records=tuple(o["record"] for o in outcomes),
        forward_codes=tuple(o["forward_code"] for o in outcomes),
        shards=tuple(o["shards"] for o in outcomes) if return_shards else None)


def phase1b_logits(config: ModelConfig, degree: int, *, param_seed: int, token_seed: int,
                   pool: RankPool | None = None,
                   shards: Sequence[Mapping[str, torch.Tensor]] | None = None,
                   split_fn: SplitFn | None = None) -> torch.Tensor:
    """Rank 0's full logits of one phase 1b check (see ``run_phase1b``)."""
    return run_phase1b(config, degree, param_seed=param_seed, token_seed=token_seed, pool=pool,
                       shards=shards, split_fn=split_fn).logits


def phase1b_task(ctx: RankContext, *, config: ModelConfig, param_seed: int, token_seed: int,
                 tokens: torch.Tensor | None, shards: Sequence[Mapping[str, torch.Tensor]] | None,
                 split_fn: SplitFn | None, reference: bool, return_shards: bool,
                 guard: RoutingGuard | None = None) -> dict[str, Any]:
    """The rank side of ``run_phase1b``: transport, then the sharded forward."""
    layout = layout_for(config)
    full: dict[str, torch.Tensor] = {}

    def outgoing() -> Sequence[Mapping[str, torch.Tensor]]:
        if shards is not None:
            return shards
        full.update(init_params(config, param_seed))
        if split_fn is not None:
            return split_fn({name: x.clone() for name, x in full.items()}, ctx.degree)
        return split(full, layout, ctx.degree)

    sink = ParamSink()
    record = GlooTransport(ctx, layout).sync(outgoing if ctx.rank == 0 else None, sink)
    ctx.tracer.mark("forward")
    if tokens is None:
        tokens = make_tokens(config, token_seed)
    model = ShardedModel(config, [sink], GlooCollective(ctx), guard=guard)
    with torch.no_grad():
        (logits,) = model(tokens)
    expected = None
    if reference and ctx.rank == 0:
        ctx.tracer.mark("reference")
        with torch.no_grad():
            expected = ReferenceModel(config, full or init_params(config, param_seed))(tokens)
    return {"logits": logits if ctx.rank == 0 else None, "reference": expected,
            "record": record, "forward_code": forward_fingerprint(),
            "shards": dict(sink) if return_shards else None}


def phase1b_runner(pool: RankPool | None = None
                   ) -> Callable[[ModelConfig, int, int, int], torch.Tensor]:
    """``tolerance.ShardedRunner`` for phase 1b: ``(config, t, param_seed, token_seed)`` ->
    rank 0's logits under the declared split, on ``pool`` (else the process's shared pool
    of 4 ranks)."""
    def runner(config: ModelConfig, degree: int, param_seed: int, token_seed: int) -> torch.Tensor:
        return phase1b_logits(config, degree, param_seed=param_seed, token_seed=token_seed,
                              pool=pool or shared_pool(max(4, degree)))
    return runner


def gloo_forward(pool: RankPool | None = None) -> Forward:
    """``check.Forward`` for phase 1b: ``(config, shards, tokens)`` -> rank 0's logits, the
    caller's shards shipped to rank 0 and scattered by ``GlooTransport``, on ``pool`` (else
    the process's shared pool)."""
    def forward(config: ModelConfig, shards: list[Params], tokens: torch.Tensor,
                guard: RoutingGuard | None = None) -> torch.Tensor:
        return run_phase1b(config, len(shards), param_seed=0, token_seed=0, shards=shards,
                           tokens=tokens, pool=pool or shared_pool(max(4, len(shards))),
                           guard=guard).logits
    return forward


def inprocess_forward(config: ModelConfig, shards: list[Params], tokens: torch.Tensor,
                      guard: RoutingGuard | None = None) -> torch.Tensor:
    """Phase 1a: every rank in this process over ``InProcessCollective``."""
    return ShardedModel(config, shards, InProcessCollective(len(shards)), guard=guard)(tokens)[0]


def gloo_logits(forward: ForwardLayout, inputs: Sequence[Mapping[str, torch.Tensor]],
                tokens: torch.Tensor, guard: RoutingGuard | None = None) -> torch.Tensor:
    """Phase 1b of a convention's forward: rank 0 of the process's shared rank pool holds
    every rank's forward inputs, ``GlooTransport`` scatters them under ``forward.layout``
    (whatever its placements: ``HeadReplicated``, a ``Shard(1)`` embedding), and each rank
    runs ``ShardedModel.forward`` over ``GlooCollective`` with ``forward.embedding``, as
    phase 1a runs it over ``InProcessCollective``. Returns rank 0's full logits."""
    degree = len(inputs)
    if forward.tp and forward.tp != degree:
        raise UnsupportedLayout(
            f"{forward.config.name}: over gloo the forward runs one TP group; this layout holds "
            f"{degree // forward.tp} data-parallel replicas of TP {forward.tp} (experts over "
            f"{degree} ranks): check it in process (phase 1a)")
    dtype = next(iter(inputs[0].values())).dtype
    outcomes = shared_pool(max(4, degree)).run(
        conversion_forward_task, degree,
        kwargs={"forward": forward, "tokens": tokens, "dtype": dtype, "guard": guard},
        rank_kwargs=[{"inputs": [dict(x) for x in inputs] if rank == 0 else None}
                     for rank in range(degree)])
    return outcomes[0]


def conversion_forward_task(ctx: RankContext, *, forward: ForwardLayout, tokens: torch.Tensor,
                            dtype: torch.dtype,
                            inputs: Sequence[Mapping[str, torch.Tensor]] | None,
                            guard: RoutingGuard | None = None) -> torch.Tensor | None:
    """The rank side of ``gloo_logits`` (``phase1b_task``'s transport and forward, under a
    convention's forward layout rather than ``layout_for``'s)."""
    sink = ParamSink()
    GlooTransport(ctx, forward.layout, dtype=dtype).sync(inputs if ctx.rank == 0 else None,
                                                         sink)
    ctx.tracer.mark("forward")
    model = ShardedModel(forward.config, [sink], GlooCollective(ctx),
                         embedding=forward.embedding, experts=forward.experts, guard=guard)
    with torch.no_grad():
        (logits,) = model(tokens)
    return logits if ctx.rank == 0 else None


def phase_forward(phase: str) -> Forward:
    """The forward of a phase: every rank in this process (1a), or the shared gloo rank pool
    (1b)."""
    return inprocess_forward if phase == "1a" else gloo_forward()
