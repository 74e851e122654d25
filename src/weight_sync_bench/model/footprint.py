"""What checking a geometry costs, estimated from the geometry alone, and the one guard every
command puts before it allocates anything of one.

``footprint(config)`` is an upper estimate, in closed form (no tensor is made, nothing loops
over layers), of one check of ``config``: the bytes held at its peak and the flops done.
``unit`` says how the check holds the model: whole (``"model"``: ``wsb check``, ``emit``,
``verify``, ``sync``, a replayed corpus entry), or streamed one layer or one parameter at a
time (``"layer"``, ``"parameter"``: ``wsb check --stream``, a phase 1a floor measurement),
where only the largest such unit is held at once. ``require_fits(config, limits)`` raises
``GeometryTooLarge`` for an estimate over ``Limits``, naming the field that drives it, the
estimate and the flag that raises the limit (``--max-gib``, ``--max-gflop``).

The estimate is per check (one geometry at one degree pair): a command that runs several
checks runs them one after another, so its peak is one check's; ``wsb replay`` estimates
each corpus entry alone, with limits of its own (``fuzz.corpus.ReplayLimits``), since an
entry is a file from elsewhere, not a geometry the user typed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache

from weight_sync_bench import memory
from weight_sync_bench.errors import GeometryTooLarge, InvalidNumber
from weight_sync_bench.model.config import SHIPPED_HF_CONFIGS, ModelConfig, shipped_hf_config

FLOAT_BYTES = 4  # fp32 everywhere: a bf16 check's weights are upcast while a forward reads them
# What the element counts miss, and a deep, thin geometry is made of: every parameter tensor
# costs bookkeeping whatever its size (the tensor object, its storage, its entry in each
# copy's dict), and every kernel a forward dispatches costs time whatever its size. Chosen
# bounds, not measured figures a verdict reads: on the fuzz's smallest geometry (sizes 1-2)
# at 2 x 10^4 layers, init_params held ~930 bytes per tensor and the reference forward took
# ~0.4 ms per layer (~30 kernels), the time one core needs for a few 10^5 flops.
TENSOR_BYTES = 1024
TENSORS = (3, 9)  # (outside the layers: embedding, final norm, lm_head; per dense layer)
# An MoE layer's tensors beyond a dense layer's (router weight and bias, the shared expert's
# gate_up, down and gate), and per expert (a convention that stores each expert's gate, up
# and down apart: HF's, Mixtral's).
MOE_TENSORS, EXPERT_TENSORS = 5, 3
KERNEL_FLOPS = 20_000
KERNELS_PER_LAYER = 30  # norms, qkv, RoPE, attention, o_proj, SwiGLU, down, residuals
KERNELS_PER_EXPERT = 6  # the tokens routed to it gathered, gate_up, SwiGLU, down, scattered
# How many fp32 copies of what it holds at once a check keeps: whole, the full parameters,
# the declared split at src and at dst and the check's own shards (4); streamed, one unit's
# full tensors, its shards and (bf16) its fp32 upcast, measured at 2.0-3.05x the largest
# unit's bytes (README, "Real widths"), so 3.
COPIES = {"model": 4, "layer": 3, "parameter": 3}
UNITS = tuple(COPIES)
GIB = 2**30
# The default limits of a command (``Limits()``): this machine's physical memory, as the
# estimate counts more copies than a check was measured to hold, so that what it refuses
# cannot run here; 16 GiB where /proc/meminfo is unreadable. 10^13 flops (10,000 GFLOP):
# hours of one thread at the replay's calibration (50 GFLOP about a minute), where a shipped
# geometry at full width and --layers 1 estimates under 10^12.
FALLBACK_MAX_BYTES = 16 * GIB
DEFAULT_MAX_FLOPS = 1e13
# The fields a geometry's cost grows with, one of which the refusal names.
SIZES = ("vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn", "batch",
         "seq_len", "n_experts", "expert_ffn", "shared_ffn")


@dataclass(frozen=True)
class Footprint:
    """What one check costs: peak ``bytes`` held and ``flops`` done, estimated (see
    ``footprint``), with what they come from: the model's ``params``, the ``held`` of them
    at once (all of them, or the largest streamed ``unit``), ``copies`` of those, the
    ``activations`` of one forward and the parameter ``tensors`` kept."""

    params: int
    activations: int
    bytes: int
    flops: int
    tensors: int
    unit: str = "model"
    held: int = 0
    copies: int = COPIES["model"]

    def formula(self) -> str:
        """How ``bytes`` and ``flops`` were made, with the figures, for a refusal."""
        what = (f"{self.params:.3g} parameters" if self.unit == "model" else
                f"{self.held:.3g} parameters of its largest {self.unit}")
        return (f"{FLOAT_BYTES} B x ({self.copies} x {what} + {self.activations:.3g} "
                f"activations) + {self.copies} x {self.tensors:.3g} tensors x {TENSOR_BYTES} B, "
                f"{self.flops:.3g} flops; see model.footprint")


def _default_max_bytes() -> int:
    return memory.total() or FALLBACK_MAX_BYTES


@dataclass(frozen=True)
class Limits:
    """The most one check may cost (``footprint``): ``max_bytes`` held (default this
    machine's memory, ``memory.total()``; 16 GiB where unknown) and ``max_flops`` done
    (default 10^13). A command's ``--max-gib`` and ``--max-gflop`` set them."""

    max_bytes: int = field(default_factory=_default_max_bytes)
    max_flops: float = DEFAULT_MAX_FLOPS

    def __post_init__(self) -> None:
        InvalidNumber.positive("max_bytes", self.max_bytes)
        InvalidNumber.positive("max_flops", self.max_flops)

    def over(self, cost: Footprint) -> list[str]:
        """What of ``cost`` exceeds these limits, each with its limit and the flag that
        raises it (none: it fits)."""
        out = []
        if cost.bytes > self.max_bytes:
            out.append(f"about {cost.bytes / GIB:.3g} GiB (limit {self.max_bytes / GIB:.3g} GiB; "
                       "raise it with --max-gib)")
        if cost.flops > self.max_flops:
            out.append(f"about {cost.flops / 1e9:.3g} GFLOP (limit {self.max_flops / 1e9:.3g} "
                       "GFLOP; raise it with --max-gflop)")
        return out


def _layer_params(c: ModelConfig, moe: bool) -> int:
    """One layer's parameters: attention, norms and biases (counted whether present or not),
    and the dense MLP, or the router, every expert and the shared expert."""
    d, qkv = c.d_model, c.qkv_rows
    attention = qkv * d + d * c.q_rows + qkv + 4 * d
    if not moe:
        return attention + 3 * c.ffn * d
    return (attention - d + c.n_experts * (d + 1) + 3 * c.n_experts * c.expert_ffn * d
            + 3 * c.shared_ffn * d + d)


def _largest_param(c: ModelConfig) -> int:
    """The most elements of one parameter (``ModelConfig.param_shapes``, in closed form)."""
    d, e, f = c.d_model, c.n_experts, c.expert_ffn
    sizes = [c.padded_vocab * d, c.qkv_rows * d, d * c.q_rows]
    if c.has_dense_mlp:
        sizes.append(2 * c.ffn * d)
    if c.moe:
        sizes += [e * 2 * f * d, e * d, 2 * c.shared_ffn * d]
    return max(sizes)


def footprint(config: ModelConfig, unit: str = "model") -> Footprint:
    """An upper estimate of one check of ``config`` (reference, declared forward and one
    forward of the check's own shards), in closed form from the geometry; L_d dense and
    L_m MoE layers:

    - parameters ``P = 2 V d + d + L_d (qkv d + d q + 3 ffn d + qkv + 4 d) + L_m (qkv d +
      d q + qkv + 3 d + E (d + 1) + 3 E f_e d + 3 f_s d + d)`` (V the padded vocab, E experts
      of width f_e, a shared expert of f_s; biases counted whether present or not);
    - bytes ``4 x (C x H + A)``: ``C = COPIES[unit]`` copies of what is held at once (``H =
      P``, or streamed the largest layer or parameter), plus the activations of one forward
      at a time, ``A = B T (3 d + 2 qkv + m + 5 V) + 2 B H T^2`` (per-token widths of a layer,
      ``m`` its MLP's: ``3 ffn``, or ``3 (k f_e + f_s) + E`` for top-k routed experts; three
      logit tensors and the scratch; the attention scores);
    - flops ``3 x (2 P_a B T + 4 L B H T^2 head_dim)``: three forwards' matmuls over the
      parameters a token uses (``P_a``: k of the E experts) and attention.

    Plus what does not scale with the sizes, so that a geometry of a million one-wide layers
    is not estimated as free: ``TENSOR_BYTES`` per parameter tensor of each copy, and
    ``KERNEL_FLOPS`` per kernel each forward dispatches (``KERNELS_PER_LAYER`` per layer,
    ``KERNELS_PER_EXPERT`` per expert of an MoE layer).
    """
    if unit not in COPIES:
        raise ValueError(f"footprint: unit must be one of {UNITS}, got {unit!r}")
    c = config
    d, L, qkv = c.d_model, c.n_layers, c.qkv_rows
    V, B, T, H = c.padded_vocab, c.batch, c.seq_len, c.n_heads
    moe_layers = L - c.dense_layers if c.n_experts else 0
    dense_layers = L - moe_layers
    layer = (_layer_params(c, False), _layer_params(c, True))
    params = 2 * V * d + d + dense_layers * layer[0] + moe_layers * layer[1]
    unused = moe_layers * 3 * (c.n_experts - c.top_k) * c.expert_ffn * d  # experts not chosen
    mlp = max(3 * c.ffn if dense_layers else 0,
              3 * (c.top_k * c.expert_ffn + c.shared_ffn) + c.n_experts if moe_layers else 0)
    activations = B * T * (3 * d + 2 * qkv + mlp + 5 * V) + 2 * B * H * T * T
    per_layer = (TENSORS[1], TENSORS[1] + MOE_TENSORS + EXPERT_TENSORS * c.n_experts)
    kernels = L * KERNELS_PER_LAYER + moe_layers * KERNELS_PER_EXPERT * c.n_experts
    flops = 3 * (2 * (params - unused) * B * T + 4 * L * B * H * T * T * c.head_dim
                 + KERNEL_FLOPS * kernels)
    if unit == "model":
        held = params
        tensors = TENSORS[0] + dense_layers * per_layer[0] + moe_layers * per_layer[1]
    else:
        held = (_largest_param(c) if unit == "parameter" else
                max(V * d, layer[0] if dense_layers else 0, layer[1] if moe_layers else 0))
        tensors = per_layer[1] if moe_layers else per_layer[0]
    copies = COPIES[unit]
    held_bytes = FLOAT_BYTES * (copies * held + activations) + copies * TENSOR_BYTES * tensors
    return Footprint(params, activations, held_bytes, flops, tensors, unit, held, copies)


def driving_field(config: ModelConfig, reference: Mapping[str, int]) -> str | None:
    """The field of ``SIZES`` furthest above its ``reference`` size, relatively (what drives
    an estimate past the limits), or None where none is above it. A field the reference has
    at 0 (no experts) is infinitely above it wherever ``config`` sets it."""
    ratios = {k: getattr(config, k) / reference[k] if reference[k] else
              float("inf") if getattr(config, k) else 0.0 for k in SIZES}
    name = max(ratios, key=lambda k: ratios[k])
    return name if ratios[name] > 1 else None


def sizes(config: ModelConfig) -> dict[str, int]:
    """``config``'s ``SIZES``: a reference for ``driving_field``."""
    return {k: getattr(config, k) for k in SIZES}


@cache
def shipped_reference() -> dict[str, int]:
    """Every size at its largest over the shipped HF configs at full depth and width
    (``SHIPPED_HF_CONFIGS``; the default token shape): ``driving_field``'s reference for a
    command's geometry, beyond which a size is larger than any real model's shipped here."""
    shipped = [sizes(shipped_hf_config(name)) for name in SHIPPED_HF_CONFIGS]
    return {k: max(s[k] for s in shipped) for k in SIZES}


def require_fits(config: ModelConfig, limits: Limits | None = None, *, unit: str = "model",
                 names: Mapping[str, str] | None = None, hint: str = "") -> Footprint:
    """``footprint(config, unit)`` if it is within ``limits`` (default ``Limits()``), else
    ``GeometryTooLarge``: ``{config.name}: field 'F' is N: checking this geometry would need
    about X GiB (limit Y GiB; raise it with --max-gib) ...``, F the field furthest above the
    shipped configs (``driving_field``; ``names`` maps it to what the user wrote, e.g.
    ``{"d_model": "hidden_size"}``), then ``hint`` (another way to fit), then the estimate's
    formula with its figures. Call it before anything of ``config`` is allocated."""
    limits = limits or Limits()
    cost = footprint(config, unit)
    over = limits.over(cost)
    if not over:
        return cost
    driver = driving_field(config, shipped_reference())
    names = names or {}
    what = "" if driver is None else (
        f"field '{names.get(driver, driver)}'"
        + (f" ({driver})" if names.get(driver, driver) != driver else "")
        + f" is {getattr(config, driver)}: ")
    how = "checking this geometry" + ("" if unit == "model" else f" streamed per {unit}")
    raise GeometryTooLarge(
        f"{config.name}: {what}{how} would need {' and '.join(over)}{hint}, refused before "
        f"allocating anything (estimate: {cost.formula()})",
        field=names.get(driver, driver) if driver else None, estimate=cost.bytes,
        flops=cost.flops)
