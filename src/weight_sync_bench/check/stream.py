"""Streamed checks: memory bounded by the largest parameter, not by the model.

Parameters are drawn one at a time from the seed's generator in the forward's order
(``model.config.iter_params``), so each is made when the forward reaches it and dropped
after. The reference and the sharded forward advance stage by stage (the embedding, each
layer, the final norm and head: ``ReferenceModel.begin / block / end``, the same steps for
``ShardedModel``), each stage holding only its own parameters. Per stage:

1. draw the stage's full parameters; the reference takes its step (fp32, from the synced
   values);
2. the user's shards: ``fn`` is called with the stage's parameters only (``per="layer"``:
   one call per stage, ``per="parameter"``: one call per parameter), with the whole-model
   signature, ``fn(full, degree)`` for a split and ``fn(shards, dst)`` for a reshard (the
   declared split at ``src``, cut from the full tensor, which is then dropped): the dicts
   hold just that stage's (or parameter's) names, and are the harness's own tensors (an
   ``fn`` that writes into them is refused: they are what its output is compared with);
3. each parameter's bytes compared as soon as ``fn`` returns it, rank by rank against views
   of its declared slice (of the full tensor, or of the source shards for a reshard), the
   first that differs diagnosed while its full tensor is here; then its full tensor (or
   source shards) dropped;
4. the sharded forward takes its step on the user's shards, and everything is dropped.

The peak is about two copies of the largest parameter (its full tensor, or source shards,
and the user's shards; a declared slice is copied only where it is not one range) plus
activations, never all the model's; ``per="layer"`` holds a whole layer twice, and a bf16
stage is upcast for the forwards (two more bytes per weight). With tied embeddings the
embedding (and its shards) stay until the head. The verdict is the whole-model check's bit
for bit: the same draws, the same forward steps in the same order, the same byte comparison.
Phase 1a only (every rank in this process).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from weight_sync_bench.check.checker import Verdict, environment_notes, resolve_floor
from weight_sync_bench.check.diagnosis import _bit_equal, diagnose
from weight_sync_bench.check.floor import computing
from weight_sync_bench.check.user_code import call_user, describe
from weight_sync_bench.collectives.inprocess import InProcessCollective
from weight_sync_bench.errors import InvalidNumber, UserCodeError
from weight_sync_bench.layout.reshard import (
    gather_tensor,
    reshard_pieces,
    reshard_tensor,
    shard_of,
    split_tensor,
)
from weight_sync_bench.layout.table import LayoutTable
from weight_sync_bench.model.config import (
    ModelConfig,
    dtype_name,
    iter_params,
    make_tokens,
    parse_dtype,
)
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.sharded import ShardedModel
from weight_sync_bench.tolerance.rules import TOKEN_SEED_OFFSET

PER = ("layer", "parameter")
Params = dict[str, torch.Tensor]
# (a stage's full parameters, degree) -> per rank, that stage's shards; or
# (per rank, a stage's shards at src, dst) -> per rank, its shards at dst
StageFn = Callable[..., list[dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class Progress:
    """After each stage: ``stage`` of ``stages`` done, its label (``"layers.3"``), the bytes
    of its full parameters, the seconds since the check began."""

    stage: int
    stages: int
    label: str
    bytes: int
    elapsed: float

    def __str__(self) -> str:
        return (f"stage {self.stage}/{self.stages} {self.label} ({self.bytes / 2**20:,.0f} MiB), "
                f"{self.elapsed:.1f} s")


def stages(config: ModelConfig) -> list[tuple[str, list[str]]]:
    """The forward's stages and the parameters each reads, in the order they are drawn:
    ``embedding``, ``layers.0`` ... ``layers.{n-1}``, ``head`` (the final norm, and lm_head
    unless tied: the tied head reads the embedding, kept from the first stage)."""
    names = list(config.param_shapes())
    out: list[tuple[str, list[str]]] = [("embedding", ["tok_embeddings.weight"])]
    for i in range(config.n_layers):
        out.append((f"layers.{i}", [n for n in names if n.startswith(f"layers.{i}.")]))
    out.append(("head", [n for n in ("norm.weight", "lm_head.weight") if n in names]))
    assert [n for _, group in out for n in group] == names, "stages must follow the draw order"
    return out


def largest_param_bytes(config: ModelConfig, dtype: torch.dtype | str = torch.float32) -> int:
    """Bytes of the model's largest parameter in ``dtype``: what the streamed peak scales by."""
    size = torch.empty((), dtype=parse_dtype(dtype)).element_size()
    return max(_numel(s) for s in config.param_shapes().values()) * size


def model_bytes(config: ModelConfig, dtype: torch.dtype | str = torch.float32) -> int:
    """Bytes of the whole model in ``dtype``: what a whole-model check holds at least once."""
    return config.n_params * torch.empty((), dtype=parse_dtype(dtype)).element_size()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def stage_split(layout: LayoutTable) -> StageFn:
    """The declared split written per parameter, the shape of a streamed ``fn``: works on a
    dict of any subset of ``layout``'s names (one parameter, one layer, or all)."""
    def fn(full: Params, degree: int) -> list[Params]:
        out: list[Params] = [{} for _ in range(degree)]
        for name, x in full.items():
            for rank, shard in enumerate(split_tensor(x, layout[name], degree)):
                out[rank][name] = shard
        return out
    return fn


def stage_reshard(layout: LayoutTable) -> StageFn:
    """The declared reshard written per parameter (``reshard_tensor``), for any subset."""
    def fn(shards: list[Params], dst: int) -> list[Params]:
        out: list[Params] = [{} for _ in range(dst)]
        for name in shards[0]:
            for rank, shard in enumerate(reshard_tensor([s[name] for s in shards],
                                                        layout[name], dst)):
                out[rank][name] = shard
        return out
    return fn


def stream_check(config: ModelConfig, dst: int, *, fn: StageFn | None = None,
                 src: int | None = None, per: str = "layer", seed: int = 0,
                 dtype: torch.dtype | str = torch.float32, threshold: float | None = None,
                 measure_floor: bool = False,
                 progress: Callable[[Progress], None] | None = None) -> Verdict:
    """The streamed check of a split to ``dst`` (``src`` None) or of a reshard ``src -> dst``
    from the declared split at ``src``; ``fn`` None checks the declared split or reshard
    itself (the bare cost of a streamed check). See the module docstring; ``progress`` is
    called after each stage."""
    InvalidNumber.seed("seed", seed)
    if per not in PER:
        raise ValueError(f"per={per!r}: a streamed check calls fn per "
                         f"{' or per '.join(PER)}")
    weights = parse_dtype(dtype)
    layout = layout_for(config)
    layout.validate(dst)
    if src is not None:
        layout.validate(src)
    name = dtype_name(weights)
    notes: tuple[str, ...] = ()
    if threshold is None:  # refused before anything is drawn
        floor = resolve_floor(config, "1a", name, measure=measure_floor)
        threshold, notes = floor.threshold, environment_notes(floor, config, "1a", name)
    run = _run(config, layout, dst, fn, src, per, seed, weights, progress)
    error = float((run.logits - run.expected).abs().max())
    return Verdict(config=config.name, src=src, dst=dst, max_abs_error=error,
                   threshold=threshold, first_mismatch=run.differ[0] if run.differ else None,
                   mismatches=tuple(run.differ), diagnosis=tuple(run.diagnosis),
                   own_forward=bool(run.differ), notes=notes, dtype=name)


def stream_deviation(config: ModelConfig, dst: int, *, seed: int = 0,
                     dtype: torch.dtype | str = torch.float32,
                     progress: Callable[[Progress], None] | None = None) -> torch.Tensor:
    """|sharded - reference logits| of the declared split at ``dst``, streamed, flattened: one
    repetition of a phase floor measurement at a width too large to hold whole."""
    layout = layout_for(config)
    layout.validate(dst)
    run = _run(config, layout, dst, None, None, "layer", seed, parse_dtype(dtype), progress)
    return (run.logits - run.expected).abs().flatten()


@dataclass
class _Run:
    differ: list[str]
    diagnosis: list[str]
    logits: torch.Tensor  # rank 0's sharded logits
    expected: torch.Tensor  # the reference's


def _run(config: ModelConfig, layout: LayoutTable, dst: int, fn: StageFn | None,
         src: int | None, per: str, seed: int, weights: torch.dtype,
         progress: Callable[[Progress], None] | None) -> _Run:
    """The streamed forwards and byte comparison (the module docstring's steps 1-4)."""
    tokens = make_tokens(config, TOKEN_SEED_OFFSET + seed)
    reference = ReferenceModel(config, {})
    sharded = ShardedModel(config, [{} for _ in range(dst)], InProcessCollective(dst))
    draws = iter_params(config, seed, dtype=weights)
    tied: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # (full upcast, user shards)
    differ: list[str] = []
    diagnosis: list[str] = []
    started, plan = time.perf_counter(), stages(config)
    with torch.no_grad():
        for k, (label, names) in enumerate(plan):
            full = _draw(draws, names)
            size = sum(x.numel() * x.element_size() for x in full.values())
            compute = computing(full)
            if label == "head" and tied is not None:
                compute["tok_embeddings.weight"] = tied[0]
            reference.params = compute
            if label == "embedding":
                ref_state = reference.begin(tokens)
            elif label == "head":
                expected = reference.end(ref_state)
            else:
                reference.block(ref_state, k - 1)
            if config.tie_embeddings and label == "embedding":
                tied_full = compute["tok_embeddings.weight"]
            del compute
            reference.params = {}
            out = _stage_shards(fn, config, layout, full, names, dst, src, per, weights,
                                differ, diagnosis)  # drops each full tensor once compared
            del full
            sharded.shards = [computing(o) for o in out]
            del out
            if label == "embedding":
                sharded_state = sharded.begin(tokens)
                if config.tie_embeddings:
                    tied = (tied_full, [s["tok_embeddings.weight"] for s in sharded.shards])
            elif label == "head":
                if tied is not None:
                    for s, table in zip(sharded.shards, tied[1]):
                        s["tok_embeddings.weight"] = table
                logits = sharded.end(sharded_state)[0]
            else:
                sharded.block(sharded_state, k - 1)
            sharded.shards = [{} for _ in range(dst)]
            if progress is not None:
                progress(Progress(k + 1, len(plan), label, size,
                                  time.perf_counter() - started))
    return _Run(differ, diagnosis, logits, expected)


def _draw(draws: Iterator[tuple[str, torch.Tensor]], names: list[str]) -> Params:
    full = {}
    for want in names:
        got, x = next(draws)
        assert got == want, f"drawn {got}, the stage reads {want}"
        full[got] = x
    return full


def _stage_shards(fn: StageFn | None, config: ModelConfig, layout: LayoutTable, full: Params,
                  names: list[str], dst: int, src: int | None, per: str, weights: torch.dtype,
                  differ: list[str], diagnosis: list[str]) -> list[Params]:
    """Per rank, the stage's shards at ``dst``: the declared ones when ``fn`` is None, else
    what ``fn`` returns, called per stage or per parameter and checked as shards. Each
    parameter's bytes are compared as soon as ``fn`` returns it (``differ``; the first that
    differs diagnosed into ``diagnosis``), and its full tensor (and source shards) dropped
    from ``full`` then: with ``per="parameter"`` the stage never holds more than the
    remaining full tensors, one parameter's source shards and the shards returned so far."""
    out: list[Params] = [{} for _ in range(dst)]
    groups = [names] if per == "layer" else [[n] for n in names]
    for group in groups:
        given: Params | list[Params]
        if src is None:
            given = {n: full[n] for n in group}
        else:  # the source shards; the full tensor is not needed past its split
            given = [{} for _ in range(src)]
            for n in group:
                for rank, shard in enumerate(split_tensor(full.pop(n), layout[n], src)):
                    given[rank][n] = shard
        if fn is None:  # the declared split, or the declared reshard of the src shards
            moved = {n: split_tensor(full[n], layout[n], dst) if src is None
                     else reshard_tensor([g[n] for g in given], layout[n], dst)  # type: ignore[index]
                     for n in group}
            result = [{n: moved[n][rank] for n in group} for rank in range(dst)]
            del moved
        else:
            sub = LayoutTable(tuple(layout[n] for n in group))
            what = "splitting" if src is None else f"resharding {src} -> {dst}"
            role = "splitter" if src is None else "resharder"
            inputs = list(given.values()) if isinstance(given, dict) else [
                x for g in given for x in g.values()]
            versions = [x._version for x in inputs]  # fn gets the harness's tensors, not copies
            result = call_user(fn, (given, dst), role=role,
                               call="fn(full, degree)" if src is None else "fn(shards, dst)",
                               during=f"while {what} {config.name} ({', '.join(group)})",
                               layout=sub, degree=dst, dtypes=weights)
            if [x._version for x in inputs] != versions:  # compared with them next: refuse
                raise UserCodeError(f"your {role} `{describe(fn)}` wrote into the tensors it "
                                    f"was given ({', '.join(group)}) while {what} "
                                    f"{config.name}: a streamed check hands fn its own "
                                    "tensors, not copies; return new ones", role=role,
                                    function=describe(fn))
        for n in group:
            mine = [r[n] for r in result]
            spec = layout[n]
            if src is None:  # each rank against a view of its declared slice of the full
                same = all(_bit_equal(m, shard_of(full[n], spec, dst, rank))
                           for rank, m in enumerate(mine))
            else:  # against views of the source shards that hold its declared slice
                held = [g[n] for g in given]  # type: ignore[index]
                dim = spec.ranges(dst, 0)[0]
                same = all(_bit_equal(m.narrow(dim, at, piece.shape[dim]), piece)
                           for rank, m in enumerate(mine)
                           for at, piece in reshard_pieces(held, spec, dst, rank))
            if not same:
                differ.append(n)
                if len(differ) == 1:
                    whole = full[n] if src is None else gather_tensor(held, spec)
                    diagnosis.extend(diagnose(whole, spec, mine))
            if src is None:
                del full[n]
            else:
                for g in given:  # type: ignore[union-attr]
                    del g[n]
        for rank in range(dst):
            out[rank].update(result[rank])
        del given, result
    return out
