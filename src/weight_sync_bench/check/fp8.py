"""The verdict on a converter into an FP8 endpoint (``check_convert(fn, config, src,
"vllm:tp=2,fp8=block128")``, or ``fp8=tensor``).

The declared destination is ``conventions.fp8.fp8_shards``: the source weights quantized by
the reference quantizer, each HF tensor whole and on its own, the FP8 bytes and each
``weight_scale_inv`` cut as the engine's loader cuts them. The converter's output is
compared with it bit for bit, weights and scales (first the structural check every
convention's shards get, ``check.shards.validate_shards``: names, CPU tensors, shapes and
dtypes, else ``InvalidShards`` / ``WrongShardShape``); a NaN or an infinity in a weight or
a scale never passes and is named. Then computation: the destination's forward reads every
rank's tensors dequantized (``q.float() * scale`` per block, or per part for per-tensor
scales) and is compared with the dense reference on the same dequantized full weights, so
the difference is reduction order only, judged by the committed FP8 floor where it covers
the check (a seed's weights at a committed geometry: ``tolerance/phase1a_fp8_<scheme>.json``, measured
under every kernel set on bf16 weights quantized in that scheme), else by a threshold
measured on these dequantized weights (``check.weights.measure_threshold``); never by a
floor of unquantized ones. The
quantization error itself (the reference on the dequantized weights against the reference
on the source weights) is reported in a note,
for information, never as a threshold: quantization is a discontinuity designed for here,
not absorbed into a looser tolerance.

Where the bytes differ, the diagnosis says what the tensor holds when it is something
recognisable: a scale transposed, another rank's scale, a scale never written (vLLM
initialises an unloaded block scale to ``finfo(float32).min``, FusedMoE's to ones), its
reciprocal, zeros, weights requantized to power-of-two scales (UE8M0), NaN from an
unclamped all-zero block, or a rank's own shard quantized after the cut
(``conventions.fp8.shard_quantized``: the full tensor's bytes per block at every degree vLLM
accepts, where every cut is on a block edge; another amax per shard per tensor at TP > 1).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from weight_sync_bench.check.conversion import require_cell
from weight_sync_bench.check.diagnosis import bit_equal
from weight_sync_bench.check.floor import convention_logits
from weight_sync_bench.check.shards import validate_shards
from weight_sync_bench.check.threshold import environment_notes
from weight_sync_bench.check.user_code import call
from weight_sync_bench.check.verdict import Verdict
from weight_sync_bench.check.weights import measure_worst, measured_note, threshold_ends
from weight_sync_bench.conventions import materialize
from weight_sync_bench.conventions.fp8 import (
    FP8,
    dequantize_canonical,
    dequantize_stored,
    fp8_shards,
    is_scale,
    quantize_canonical,
    scale_name,
    scheme_of,
    shard_quantized,
)
from weight_sync_bench.conventions.fp8_mutations import FP8_MUTATIONS, Fp8Mutation
from weight_sync_bench.errors import FloorNotMeasured, InvalidShards, WrongShardShape
from weight_sync_bench.model.config import dtype_name, make_tokens
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.sharded import RoutingGuard
from weight_sync_bench.tolerance.artifacts import artifact_path
from weight_sync_bench.tolerance.rules import (
    TOKEN_SEED_OFFSET,
    derive_threshold,
    floor_for,
    load_artifact,
    threshold_from,
)

if TYPE_CHECKING:
    from weight_sync_bench.check.streamed_conversion import ConvertFn
    from weight_sync_bench.conventions import Endpoint
    from weight_sync_bench.model.config import ModelConfig

Params = dict[str, torch.Tensor]


def dequantized(config: ModelConfig, target: Endpoint,
                shards: Sequence[Mapping[str, torch.Tensor]]) -> list[Params]:
    """Every rank's tensors as the forward computes with them: each FP8 weight times its
    scale (per block, or per part per tensor; member by member where experts are
    stacked), the rest in float32; the scales themselves dropped."""
    scheme = scheme_of(target)
    out = []
    for rank, pieces in zip(shards, target.unquantized().pieces(config)):
        held: Params = {}
        for name, x in rank.items():
            if is_scale(name):
                continue
            held[name] = x.float() if x.dtype != FP8 else dequantize_stored(
                config, pieces[name], x, rank[scale_name(name, scheme)], scheme)
        out.append(held)
    return out


def _nonfinite(shards: Sequence[Mapping[str, torch.Tensor]]) -> list[tuple[str, str]]:
    """``(name, "rank r name: n NaN, m Inf")`` for every tensor holding one, rank by rank."""
    out = []
    for rank, params in enumerate(shards):
        for name, x in params.items():
            values = x.float()
            nan, inf = int(values.isnan().sum()), int(values.isinf().sum())
            if nan or inf:
                out.append((name, f"rank {rank} {name}: " + ", ".join(
                    f"{n} {what}" for n, what in ((nan, "NaN"), (inf, "Inf")) if n)))
    return out


def _diagnose(rank: int, name: str, checked: Params, declared: Sequence[Params],
              per_shard: Sequence[Params], scheme: str) -> str:
    """What a differing tensor holds, where it is recognisable."""
    got, want = checked[name], declared[rank][name]
    where = f"rank {rank} {name}"
    own = per_shard[rank].get(name)
    key = scale_name(name, scheme)
    # (a weight is listed before its scale, and a shard quantized on its own differs in its
    # weights wherever its scale differs: the weight is what differs first)
    if own is not None and bit_equal(got, own) and bit_equal(checked[key],
                                                             per_shard[rank][key]):
        return (f"{where} holds this rank's own shard quantized after the TP cut (the amax "
                "of its own rows); the frameworks quantize each HF tensor whole, before the "
                "cut (slime quantize_params_fp8 after the all-gather), and vLLM's loader cuts "
                "weights and scales from it")
    if is_scale(name):
        if want.dim() >= 2 and want.shape[-1] == want.shape[-2] and bit_equal(
                got, want.transpose(-1, -2).contiguous()):
            return f"{where} holds the declared scale transposed (a square block grid)"
        for other, params in enumerate(declared):
            if other != rank and name in params and bit_equal(got, params[name]):
                return f"{where} holds rank {other}'s scale"
        for value, what in ((torch.finfo(torch.float32).min, "vLLM's fill of an unloaded "
                             "block scale (finfo(float32).min): never written"),
                            (1.0, "ones (FusedMoE's initial scale): never written"),
                            (0.0, "zeros: a scale of 0 dequantizes every weight to 0 or NaN")):
            if bool((got == value).all()):
                return f"{where} holds {what}"
        if bit_equal(got, 1 / want):
            return f"{where} holds the reciprocal of the declared scale (448 / amax)"
        if got.isnan().any():
            return f"{where} holds NaN in {int(got.isnan().sum())} of {got.numel()} blocks"
        return f"{where}: {int((got != want).sum())} of {got.numel()} block scales differ"
    scale = checked.get(key)
    nan = int(got.float().isnan().sum())
    if nan:
        zero = int((scale == 0).sum()) if scale is not None else 0
        return (f"{where} holds NaN in {nan} of {got.numel()} elements" + (
            f"; its scale is 0 in {zero} blocks (an all-zero block quantized without the "
            "amax clamp: 0 / 0, THUDM/slime PR #2256)" if zero else ""))
    if scale is not None and not bit_equal(scale, declared[rank][key]) and bool(
            (scale > 0).all()) and bool((torch.exp2(torch.log2(scale).round()) == scale).all()):
        return (f"{where} and its scale are requantized to powers of two (UE8M0, DeepGEMM's "
                "packing), where the raw scale amax / 448 is expected")
    differ = int((got.view(torch.uint8) != want.view(torch.uint8)).sum()) if got.dtype == FP8 \
        else int((got != want).sum())
    return f"{where}: {differ} of {got.numel()} elements differ from the declared bytes"


def fp8_threshold(config: ModelConfig, target: Endpoint, full: Mapping[str, torch.Tensor],
                  threshold: float | None, *, seeded: bool) -> tuple[float, tuple[str, ...]]:
    """The threshold an FP8 check judges its forward by, and the notes that say where it
    came from: ``threshold`` where given; the committed FP8 floor of the target's scheme
    where ``seeded`` (the seed's weights) and it measured this geometry at the target's
    forward and degree (with its environment notes); else measured on ``full``, the
    dequantized weights."""
    plain, scheme = target.unquantized(), scheme_of(target)
    if threshold is None and seeded:
        try:
            floor = floor_for(config, "1a", f"fp8_{scheme}")
            require_cell(floor, config, plain)
        except FloorNotMeasured:
            floor = None
        if floor is not None:
            found = threshold_from(floor.artifact)
            return found, (f"fp8: the threshold {found:g} is the committed FP8 floor's "
                           f"({floor.path.name}: bf16 weights quantized {scheme}, every kernel "
                           "set measured, the reference and the sharded forward on the same "
                           "dequantized weights)",
                           *environment_notes(floor, config, "1a", f"fp8_{scheme}"))
    if threshold is None:
        ends = [plain, *threshold_ends(config, every=True)]
        worst = measure_worst(config, ends, weights=full)
        if worst == 0.0:
            # every sharded forward summed exactly on these weights: no floor to derive from
            # (derive_threshold refuses 0), so the committed FP8 floor's threshold, said so
            artifact = load_artifact("1a", artifact_path("1a", dtype=f"fp8_{scheme}"))
            found = threshold_from(artifact)
            return found, (f"fp8: the sharded forwards summed exactly on these dequantized "
                           f"weights (floor 0 at {', '.join(map(str, ends))}, token seeds "
                           f"1000-1003): judged by the committed FP8 floor's threshold "
                           f"{found:g} (phase1a_fp8_{scheme}.json, measured on TOY and "
                           "TOY_KV4)",)
        threshold = derive_threshold(worst)
        note = measured_note(threshold, every=True)
    else:
        note = "your weights: the threshold was given"
    return threshold, ("fp8: the reference is the dense forward on the same dequantized "
                       "weights; " + note.replace("your weights", "the dequantized weights", 1),)


class Fp8Check:
    """One FP8 check's side of the comparison, for ``params`` (the canonical source weights;
    ``seeded``: the seed's in the check's dtype, else the user's): the declared destination
    (each HF part quantized once, ``fp8_shards`` cutting those values) at once, so a
    refused degree is refused before any converter runs; the dequantized reference, its
    forward and the threshold on first use (``forward``), so a converter that raises
    costs no forward. ``verdict`` judges any number of outputs against them (the kill
    matrix judges every mutation of one destination with one ``Fp8Check``)."""

    def __init__(self, config: ModelConfig, source: Endpoint, target: Endpoint,
                 params: Mapping[str, torch.Tensor], *, threshold: float | None = None,
                 seed: int = 0, weights_note: str | None = None, seeded: bool = True) -> None:
        if source.quantized:
            raise InvalidShards(f"{source}: an FP8 source is not modelled (the harness "
                                "quantizes into FP8 endpoints, not out of them)")
        self.config, self.source, self.target, self.params = config, source, target, params
        self.scheme = scheme_of(target)
        self.quantized = quantize_canonical(config, params, self.scheme)
        self.declared = fp8_shards(config, target, params, quantized=self.quantized)
        self._given, self._seed, self._seeded = threshold, seed, seeded
        self._weights_note = weights_note

    @functools.cached_property
    def forward(self) -> tuple[torch.Tensor, torch.Tensor, Any, float, tuple[str, ...]]:
        """``(tokens, reference logits, its routings, threshold, notes)``: the dense forward
        on the dequantized weights, the threshold for it (``fp8_threshold``) and the
        quantization error against the unquantized model, a note."""
        config, params = self.config, self.params
        full = dequantize_canonical(config, *self.quantized, params, self.scheme)
        tokens = make_tokens(config, TOKEN_SEED_OFFSET + self._seed)
        model = ReferenceModel(config, full)
        with torch.no_grad():
            reference = model(tokens)
            unquantized = ReferenceModel(config, {n: x.float() for n, x in params.items()})(
                tokens)
        threshold, origin = fp8_threshold(config, self.target, full, self._given,
                                          seeded=self._seeded)
        quant_error = float((reference - unquantized).abs().max())
        notes = (*origin,
                 f"fp8 quantization error (the dequantized model against the unquantized one, "
                 f"for information, never a threshold): max |logit difference| "
                 f"{quant_error:.4g}", *([self._weights_note] if self._weights_note else []))
        return tokens, reference, model.routings, threshold, notes

    @property
    def threshold(self) -> float:
        return self.forward[3]

    @functools.cached_property
    def per_shard(self) -> list[Params]:
        """Each rank's shards quantized after the cut (``shard_quantized``), for a diagnosis."""
        return shard_quantized(self.config, self.target, self.params)

    def inputs(self) -> list[Params]:
        """What a converter gets: the source's declared shards of ``params``."""
        return materialize(self.source.pieces(self.config), self.params)

    def verdict(self, out: object) -> Verdict:
        """``out`` (a converter's return) against the declared destination, bytes first,
        then the destination's forward on its dequantized tensors."""
        config, target, declared = self.config, self.target, self.declared
        checked = [dict(rank) for rank in validate_shards(
            out, target, [{n: (tuple(x.shape), x.dtype) for n, x in rank.items()}
                          for rank in declared])]
        tokens, reference, routings, threshold, notes = self.forward
        guard = RoutingGuard(routings, threshold) if config.n_experts else None
        names = list(dict.fromkeys(n for rank in declared for n in rank))
        differ = [n for n in names if any(n in d and not bit_equal(c[n], d[n])
                                          for c, d in zip(checked, declared))]
        bad = _nonfinite(checked)
        logits = convention_logits(target.unquantized(), config,
                                   dequantized(config, target, checked), tokens, guard=guard)
        error = float((logits - reference).abs().max())
        if math.isnan(error):
            error = math.inf
        lines: list[str] = []
        if differ:
            first = differ[0]
            rank = next(r for r, (c, d) in enumerate(zip(checked, declared))
                        if first in d and not bit_equal(c[first], d[first]))
            lines.append(_diagnose(rank, first, checked[rank], declared, self.per_shard,
                                   self.scheme))
        more = len(bad) - 4
        lines += [f"not finite: {line}" for _, line in bad[:4]] + (
            [f"not finite: {more} more tensor{'s' if more > 1 else ''}"] if more > 0 else [])
        dtypes = {x.dtype for x in self.params.values()}
        return Verdict(config=config.name, src=self.source.degree, dst=target.degree,
                       max_abs_error=error if not bad else math.inf, threshold=threshold,
                       first_mismatch=differ[0] if differ else (bad[0][0] if bad else None),
                       mismatches=tuple(differ), diagnosis=tuple(lines), own_forward=True,
                       conventions=(str(self.source), str(target)), notes=notes,
                       dtype=dtype_name(next(iter(dtypes))) if len(dtypes) == 1 else "mixed",
                       **({"near_ties": guard.near_ties(), "route_bound": guard.bound}
                          if guard is not None else {}))


def check_fp8_convert(fn: ConvertFn, config: ModelConfig, source: Endpoint, target: Endpoint,
                      params: Mapping[str, torch.Tensor], *, threshold: float | None = None,
                      seed: int = 0, weights_note: str | None = None,
                      seeded: bool = True, name: str | None = None) -> Verdict:
    """``check_convert`` into a quantized ``target`` (see the module docstring): ``params``
    the canonical source weights (``seeded``: the seed's in the check's dtype, else the
    user's); ``name``: what a failure calls the function (default its import path)."""
    check = Fp8Check(config, source, target, params, threshold=threshold, seed=seed,
                     weights_note=weights_note, seeded=seeded)
    out = call(fn, (check.inputs(), target.world), role="converter", config=config,
               during=f"while converting {config.name} {source} -> {target}",
               ends=(source, target), name=name)
    return check.verdict(out)


@dataclass(frozen=True)
class Fp8KillRow:
    """One FP8 mutation at one destination: ``outcome`` ``"not applicable"`` or
    ``"identity"`` (``reason`` says why), ``"refused"`` (a dtype the check refuses by name:
    ``reason``), or ``"killed"`` / ``"survived"`` (the verdict)."""

    mutation: str
    outcome: str
    reason: str | None = None
    verdict: Verdict | None = None

    @property
    def ratio(self) -> float | None:
        return self.verdict.ratio if self.verdict is not None else None


def fp8_kill_matrix(config: ModelConfig, source: Endpoint, target: Endpoint,
                    params: Mapping[str, torch.Tensor],
                    mutations: Iterable[Fp8Mutation] = FP8_MUTATIONS.values(), *,
                    seed: int = 0) -> list[Fp8KillRow]:
    """Each FP8 mutation of the correct destination (``conventions.fp8_mutations``) judged
    as ``check_convert`` judges a converter's output, on ``params``: one ``Fp8Check`` (one
    reference forward, one threshold, the clean check's) for every row. A mutation whose
    bytes equal the declared ones here is an identity, and says so."""
    check = Fp8Check(config, source, target, params, seed=seed)
    declared = check.declared
    rows = []
    for mutation in mutations:
        why = mutation.not_applicable(config, target)
        if why is not None:
            rows.append(Fp8KillRow(mutation.name, "not applicable", why))
            continue
        out = mutation.apply([{n: x.clone() for n, x in rank.items()} for rank in declared],
                             config, target, params)
        if all(set(o) == set(d) and all(bit_equal(o[n], d[n]) for n in d)
               for o, d in zip(out, declared)):
            rows.append(Fp8KillRow(mutation.name, "identity", "the declared bytes here"))
            continue
        try:
            verdict = check.verdict(out)
        except WrongShardShape as exc:
            rows.append(Fp8KillRow(mutation.name, "refused", str(exc)))
            continue
        rows.append(Fp8KillRow(mutation.name, "survived" if verdict.passed else "killed",
                               verdict=verdict))
    return rows
