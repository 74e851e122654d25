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
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from weight_sync_bench.model.config import DEFAULT_INIT

if TYPE_CHECKING:
    from weight_sync_bench.model.config import ModelConfig

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
    """float32 values of canonical ``name`` at flat indices ``flat``, an array of any shape
    with one dimension or more (numpy makes a 0-d array's arithmetic a scalar)."""
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


class WeightValues:
    """A user's weights as phase 2's values (``SyncSession(weights=DIR)``): what each
    region of a canonical parameter holds, read from the checkpoint directory
    (``conventions.checkpoint.read_weights``) on the rank that asks, in float32 (bf16 and
    fp16 convert exactly). Picklable: the directory's path travels to the rank processes,
    each opens it on first use and keeps the last parameter it read (a rank's boxes of one
    tensor follow each other): one parameter in memory at a time on a rank for an HF
    directory, read lazily; a Megatron checkpoint is read whole by each rank that opens it."""

    def __init__(self, directory: str, config: ModelConfig) -> None:
        self.directory, self.config = str(directory), config
        self._open: Any = None
        self._last: tuple[str, torch.Tensor] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory, "config": self.config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["directory"], state["config"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"WeightValues({self.directory!r})"

    def parameter(self, name: str) -> torch.Tensor:
        """The whole canonical parameter ``name``, float32."""
        if self._last is None or self._last[0] != name:
            if self._open is None:
                from weight_sync_bench.conventions.checkpoint import read_weights

                self._open = read_weights(self.directory, self.config)
            self._last = (name, self._open[name].float())
        return self._last[1]

    def region(self, name: str, shape: tuple[int, ...],
               region: tuple[tuple[int, int], ...]) -> torch.Tensor:
        x = self.parameter(name)
        assert tuple(x.shape) == tuple(shape), (name, tuple(x.shape), shape)
        for d, (a, b) in enumerate(region):
            x = x.narrow(d, a, b - a)
        return x


Source = int | WeightValues  # phase 2's values: the generator's of a seed, or the user's


def region_of(source: Source, name: str, shape: tuple[int, ...],
              region: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The values of canonical ``region`` of ``name``: the generator's (a seed) or the
    user's weights'."""
    if isinstance(source, WeightValues):
        return source.region(name, shape, region)
    return region_values(source, name, shape, region)


def fill(out: torch.Tensor, seed: Source, name: str, shape: tuple[int, ...],
         region: tuple[tuple[int, int], ...]) -> None:
    """Write ``region_of`` into ``out`` (a view of the region's shape), ``CHUNK``
    elements of dim 0 at a time, so the scratch stays small whatever the region."""
    rows = region[0][1] - region[0][0]
    per_row = max(1, out.numel() // max(rows, 1))
    step = max(1, CHUNK // per_row)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        sub = ((region[0][0] + a, region[0][0] + b), *region[1:])
        out.narrow(0, a, b - a).copy_(region_of(seed, name, shape, sub))
