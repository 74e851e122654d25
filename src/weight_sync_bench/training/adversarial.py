"""Adversarial values: parameters and labels chosen so a semantic bug cannot hide in noise.

- ``cancelling``: rank pairs (0, 1), (2, 3), ... of a row-parallel layer compute partial
  sums that nearly cancel (rank 2k+1 holds a copy of rank 2k's heads and neurons, and the
  negated output columns scaled by 1 - ``margin``): the reduced sum is ``margin`` times
  each partial, so reordering error is large relative to the result.
- ``max_elsewhere``: every valid label is a class owned by a TP rank other than the one
  holding the reference's largest logit, so the softmax's maximum and the target's logit
  must come from different ranks.
- ``loud_biases``: row-parallel biases of size ``scale``, against weights of 0.02, so a
  bias added once per rank moves everything.

Each returns new parameters or a new case; nothing is modified in place.
"""

from __future__ import annotations

import dataclasses

import torch

from weight_sync_bench.errors import InvalidConfig
from weight_sync_bench.layout.reshard import gather, split
from weight_sync_bench.model.config import ModelConfig
from weight_sync_bench.model.plan import layout_for
from weight_sync_bench.model.reference import ReferenceModel
from weight_sync_bench.training.loss import IGNORE_INDEX
from weight_sync_bench.training.step import TrainingCase

Params = dict[str, torch.Tensor]


def cancelling(config: ModelConfig, params: Params, degree: int, margin: float = 1e-3
               ) -> Params:
    """Parameters whose row-parallel partial sums cancel pairwise at ``degree`` (even)."""
    if degree < 2 or degree % 2:
        raise InvalidConfig(f"{config.name}: cancelling pairs ranks, needs an even degree "
                            f">= 2 (t={degree})")
    layout = layout_for(config)
    shards = split(params, layout, degree)
    for i in range(config.n_layers):
        pre = f"layers.{i}."
        copied = [pre + "qkv.weight", pre + "gate_up.weight"] + (
            [pre + "qkv.bias"] if config.has_qkv_bias else [])
        for even in range(0, degree, 2):
            src, dst = shards[even], shards[even + 1]
            for name in copied:
                dst[name] = src[name].clone()
            for name in (pre + "o_proj.weight", pre + "down.weight"):
                dst[name] = -(1.0 - margin) * src[name]
    return gather(shards, layout)


def loud_biases(config: ModelConfig, params: Params, scale: float = 0.5) -> Params:
    """Row-parallel biases of magnitude ``scale`` (signs kept), others unchanged."""
    if not (config.has_o_bias or config.has_down_bias):
        raise InvalidConfig(f"{config.name}: loud_biases needs a row-parallel bias (bias=True "
                            "or o_bias=True)")
    out = dict(params)
    for name, p in params.items():
        if name.endswith(("o_proj.bias", "down.bias")):
            out[name] = scale * torch.where(p >= 0, 1.0, -1.0)
    return out


def owner(classes: torch.Tensor, config: ModelConfig, degree: int) -> torch.Tensor:
    """The TP rank whose vocab slice holds each class id."""
    return classes // (config.padded_vocab // degree)


def max_elsewhere(case: TrainingCase, degree: int) -> TrainingCase:
    """``case`` with every valid label moved to a class another TP rank owns than the one
    holding the reference's largest logit at that position (``degree`` >= 2)."""
    config = case.config
    if degree < 2:
        raise InvalidConfig(f"{config.name}: the maximum and the target need two ranks "
                            f"(t={degree})")
    assert case.params is not None
    width = config.padded_vocab // degree
    starts = [r * width for r in range(degree) if r * width < config.vocab]
    if len(starts) < 2:
        raise InvalidConfig(f"{config.name}: only one rank holds real classes at t={degree}")
    batches = []
    with torch.no_grad():
        for batch in case.batches:
            top = ReferenceModel(config, case.params)(batch.tokens, batch.model_segments).argmax(-1)
            top_owner = owner(top, config, degree)  # (B, T)
            # the first real class of the lowest rank, other than the top logit's owner,
            # that holds real classes
            choices = torch.tensor(starts)  # (R,)
            owners = owner(choices, config, degree)
            later = owners[None, None, :] != top_owner[..., None]  # (B, T, R)
            target = choices[later.int().argmax(-1)]  # (B, T)
            targets = torch.where(batch.targets == IGNORE_INDEX, batch.targets, target)
            batches.append(dataclasses.replace(batch, targets=targets))
    out = dataclasses.replace(case)
    out.params = case.params
    out.batches = batches
    return out
