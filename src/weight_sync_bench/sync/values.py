"""Parameter values as a pure function of (seed, parameter, canonical index), for phase 2.

``init_params`` draws each model from one ``torch.Generator`` stream, parameter after
parameter: no slice of it can be made without drawing everything before it, so a rank
holding one shard cannot recompute what it should hold. Phase 2's element check needs
exactly that, so its values come from a counter-based generator instead:

    value(seed, name, i) = scale(name) * irwin_hall(splitmix64(key(seed, name) + i))

``key`` is the first 8 bytes of ``blake2b(f"{seed}:{name}")`` (the same on every process,
unlike Python's ``hash``); ``i`` the flat index in the canonical full tensor; splitmix64 is
evaluated in numpy ``uint64`` (wrap-around defined); ``irwin_hall`` sums the hash's four
16-bit words and centres the sum (an integer in [-131070, 131070], exactly representable in
float32), an approximately normal draw; ``scale`` is ``DEFAULT_INIT``'s: weights
``0.02 * g``, norms ``1 + 0.1 * g``, each one correctly rounded float32 operation, so every
machine computes the same bits. Any box of any tensor is generated on its own (in chunks of
``CHUNK`` elements): a destination rank recomputes what it must hold without any rank
seeing a full tensor.

These values are not ``init_params``' values: the forward check, whose threshold was
measured on ``init_params``, runs on ``init_params`` shards resharded by the same plan.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from weight_sync_bench.model.config import DEFAULT_INIT

CHUNK = 1 << 18  # elements generated at a time: 2 MiB of uint64 scratch
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_PAIRS = np.uint64(0x0000FFFF0000FFFF)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_SD = 65536.0 / np.sqrt(3.0) * 2.0  # sd of the centred sum 2 * (w0 + w1 + w2 + w3) - 4 * 65535


def key(seed: int, name: str) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(),
                                                    digest_size=8).digest(), "little"))


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of ``z * golden + golden``, in place on ``z`` (uint64)."""
    with np.errstate(over="ignore"):
        z *= _GOLDEN
        z += _GOLDEN
        for shift, mult in ((30, _M1), (27, _M2)):
            z ^= z >> np.uint64(shift)
            z *= mult
        z ^= z >> np.uint64(31)
    return z


def values(seed: int, name: str, flat: np.ndarray) -> torch.Tensor:
    """float32 values of canonical ``name`` at flat indices ``flat`` (any shape)."""
    with np.errstate(over="ignore"):
        h = _splitmix64(flat.astype(np.uint64) + key(seed, name))
    # the four 16-bit words of each hash, summed (pairwise, in two lanes), then centred
    lanes = (h & _PAIRS) + ((h >> np.uint64(16)) & _PAIRS)
    words = (lanes & np.uint64(0xFFFFFFFF)) + (lanes >> np.uint64(32))
    g = torch.from_numpy((2 * words.astype(np.int64) - 4 * 65535).astype(np.float32))
    if name.endswith("norm.weight"):
        return g.mul_(_f32(DEFAULT_INIT.norm_spread / _SD)).add_(_f32(1.0))
    return g.mul_(_f32(DEFAULT_INIT.std / _SD))


def _f32(x: float) -> torch.Tensor:
    """A float32 0-d tensor: the operation then rounds once, in float32, on every machine."""
    return torch.tensor(x, dtype=torch.float32)


def region_values(seed: int, name: str, shape: tuple[int, ...],
                  region: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The values of canonical ``region`` (``(start, stop)`` per dim) of ``name``, whose full
    shape is ``shape``, as a tensor of the region's shape: no full tensor is made."""
    strides = np.cumprod((1, *shape[::-1][:-1]))[::-1]
    flat = np.zeros((1,) * len(shape), dtype=np.int64)
    for d, ((a, b), stride) in enumerate(zip(region, strides)):
        axis = np.arange(a, b, dtype=np.int64) * int(stride)
        flat = flat + axis.reshape([-1 if e == d else 1 for e in range(len(shape))])
    return values(seed, name, flat)


def fill(out: torch.Tensor, seed: int, name: str, shape: tuple[int, ...],
         region: tuple[tuple[int, int], ...]) -> None:
    """Write ``region_values`` into ``out`` (a view of the region's shape), ``CHUNK``
    elements of dim 0 at a time, so the scratch stays small whatever the region."""
    rows = region[0][1] - region[0][0]
    per_row = max(1, out.numel() // max(rows, 1))
    step = max(1, CHUNK // per_row)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        sub = ((region[0][0] + a, region[0][0] + b), *region[1:])
        out.narrow(0, a, b - a).copy_(region_values(seed, name, shape, sub))
