"""Real weights as a check's source: the user's own parameters (a mapping, or a checkpoint
directory that ``conventions.checkpoint.read_weights`` reads) in place of a seed's.

Bytes are compared as always. The forward's threshold is never a floor measured on other
weights: it is measured on these (``measure_threshold``: the declared shards of the check's
ends, and of the plain layout at its smallest sharded degree, over four token seeds, 100x
the worst, as ``tolerance.rules.derive_threshold`` makes one), and the verdict's notes say
which (``weights_threshold``). Used by ``check_convert``, ``check_split`` and
``check_reshard`` alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from weight_sync_bench.check.floor import convention_logits
from weight_sync_bench.conventions import endpoint, materialize
from weight_sync_bench.conventions.checkpoint import read_weights
from weight_sync_bench.errors import InvalidConfig
from weight_sync_bench.model.config import init_params, make_tokens
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.model.sharded import RoutingGuard
from weight_sync_bench.model.stepwise import computing
from weight_sync_bench.tolerance.rules import TOKEN_SEED_OFFSET, derive_threshold

if TYPE_CHECKING:
    from weight_sync_bench.conventions import Endpoint
    from weight_sync_bench.model.config import ModelConfig

Weights = Mapping[str, torch.Tensor] | str | Path


def held_weights(weights: Weights, config: ModelConfig) -> dict[str, torch.Tensor]:
    """``weights`` as canonical parameters in memory, checked: every parameter of ``config``
    with its shape, floating point (``InvalidConfig``, exit 2, naming the first that is
    not); in their own dtypes, one or several (``dtypes_of``)."""
    if isinstance(weights, (str, Path)):
        weights = read_weights(weights, config)
    shapes = config.param_shapes()
    missing = [n for n in shapes if n not in weights]
    if missing:
        raise InvalidConfig(f"weights: {config.name} has {missing[0]}, the weights do not "
                            f"({len(missing)} missing)")
    held = {name: weights[name] for name in shapes}
    for name, x in held.items():
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shapes[name]:
            got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise InvalidConfig(f"weights: {name} is {got}, {config.name} declares "
                                f"{list(shapes[name])}")
    floating = [n for n, x in held.items() if not x.is_floating_point()]
    if floating:
        raise InvalidConfig(f"weights: {floating[0]} is {held[floating[0]].dtype}, not a "
                            "floating-point parameter (quantized weights are not checked here)")
    return held


def dtypes_of(weights: Mapping[str, torch.Tensor]) -> tuple[torch.dtype, str | None]:
    """The dtype a check on ``weights`` is named by (the one most elements have), and where
    they hold several (bf16 matrices beside an fp32 router bias or norms, as trainers save
    them), the note that says which parameters are in which: each tensor is compared in
    its own dtype, and the forwards compute in fp32 from every one's values."""
    counts: dict[torch.dtype, int] = {}
    for x in weights.values():
        counts[x.dtype] = counts.get(x.dtype, 0) + x.numel()
    main = max(counts, key=lambda d: (counts[d], str(d)))
    if len(counts) == 1:
        return main, None
    others = [(n, x.dtype) for n, x in weights.items() if x.dtype != main]
    shown = ", ".join(f"{n} {str(d).removeprefix('torch.')}" for n, d in others[:3])
    more = f" and {len(others) - 3} more" if len(others) > 3 else ""
    return main, (f"your weights hold several dtypes: {str(main).removeprefix('torch.')}, "
                  f"beside {shown}{more}; each tensor is compared in its own dtype")


def measure_threshold(config: ModelConfig, endpoints: Iterable[str | Endpoint],
                      seeds: Iterable[int] = range(4), *,
                      weights: Mapping[str, torch.Tensor] | None = None,
                      phase: str = "1a") -> float:
    """A threshold for a geometry with no committed floor (an HF config, reduced): the
    floor measured as the phase 1a artifact is, the max |logits - reference| of every
    endpoint's declared shards over model seeds ``s`` and token seeds ``1000 + s``, then
    ``derive_threshold`` (the smallest power of ten >= 100x it). ``weights``: these
    weights at every seed, only the tokens drawn (a floor measured on real weights).
    ``phase="1b"``: the endpoints' forwards over gloo, as phase 2's destination forward runs."""
    return derive_threshold(measure_worst(config, endpoints, seeds, weights=weights,
                                          phase=phase))


def measure_worst(config: ModelConfig, endpoints: Iterable[str | Endpoint],
                  seeds: Iterable[int] = range(4), *,
                  weights: Mapping[str, torch.Tensor] | None = None,
                  phase: str = "1a") -> float:
    """``measure_threshold``'s observation before the rule: the worst max |logits -
    reference| over the endpoints and seeds (0.0 where every forward summed exactly)."""
    worst = 0.0
    eps = [endpoint(e) for e in endpoints]
    held = computing(weights) if weights is not None else None  # fp32, as the forwards read
    for seed in seeds:
        params = init_params(config, seed) if held is None else held
        tokens = make_tokens(config, TOKEN_SEED_OFFSET + seed)
        model = ReferenceModel(config, params)
        reference = model(tokens)
        guard = RoutingGuard(model.routings, math.inf)  # the floor of the continuous part
        for ep in eps:
            logits = convention_logits(ep, config, materialize(ep.pieces(config), params),
                                       tokens, phase=phase, guard=guard)
            worst = max(worst, float((logits - reference).abs().max()))
    return worst


def threshold_ends(config: ModelConfig, *, every: bool = False) -> list[str]:
    """The plain layout's sharded degrees a threshold on real weights is measured at, beside
    the check's ends: the smallest (``every``: all of them)."""
    sharded = [t for t in layout_for(config).supported_degrees() if t > 1]
    return [f"plain:{t}" for t in sharded[:None if every else 1]]


def weights_threshold(config: ModelConfig, ends: Iterable[str | Endpoint],
                      weights: Mapping[str, torch.Tensor], threshold: float | None,
                      phase: str = "1a", *, every: bool = False) -> tuple[float, str]:
    """The threshold a check on ``weights`` judges its forward by, and the note that says
    where it came from: ``threshold`` where given, else measured on the weights over the
    check's ``ends`` and the plain layout at its smallest sharded degree (two one-rank ends
    compute exactly the reference's sums, and a floor of zero sets no threshold); ``every``:
    at every sharded degree (a small geometry's smallest one can sum exactly: 4 heads of
    64 at t=2, d_model 64, gave a floor of 0 over four seeds, t=4 one of 1.4e-6)."""
    if threshold is not None:
        return threshold, "your weights: the threshold was given"
    measured = measure_threshold(config, [*ends, *threshold_ends(config, every=every)],
                                 weights=weights, phase=phase)
    return measured, measured_note(measured, every=every, phase=phase)


def measured_note(measured: float, *, every: bool = False, phase: str = "1a") -> str:
    """What a verdict says of a threshold measured on its weights (``weights_threshold``)."""
    return (f"your weights: the threshold {measured:g} was measured on them (the declared "
            "shards of the check's ends and of the plain layout at its "
            + ("sharded degrees" if every else "smallest sharded degree")
            + ", token seeds 1000-1003, 100x the worst"
            + (", over gloo)" if phase == "1b" else ")"))
