"""The training check's two comparisons as compiled loops that read each tensor once.

A comparison of a shard with its slice of the reference must read both from memory (the
tensors are far larger than any cache); torch takes three kernels and a scratch write per
block for what one loop does (``max |a - b|`` beside ``max |b|``, or the two sums of
squares of a parameter's update), and on the training check those kernels cost 0.9-1.0x
the reference's whole training step, against 0.25x to read the same bytes
(``bench/bench_training.py``, issue 33). ``kernels.c`` is that loop, built with the
machine's C compiler (``$CC``, else ``cc``) into a temporary directory the first time a
process compares, loaded, and the file removed; nothing is written anywhere else, nothing
kept. Where no compiler builds it, or the built library does not answer a known case as
torch does, the comparisons take their torch path (``training.compare``), which returns
the same maxima to the bit: every function here returns ``None`` for a case it does not
take, and the caller goes on with torch.

Taken: CPU fp32 tensors of one shape, each either contiguous or a 2-D view whose rows are
contiguous (a column slice of a matrix). The maxima are those of ``(a.double() -
b.double()).abs().max()`` and ``b.double().abs().max()`` to the bit; the sums of squares are
reordered fp64 sums, within 1e-12 of torch's (6e-13 at most over every verdict of ``wsb
train-check --config all``)."""

from __future__ import annotations

import ctypes
import functools
import os
import shlex
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernels.c")
# -march=native: the generic vectors in kernels.c become the machine's widest (built on the
# machine that runs them, never shipped). -ffp-contract=off: no fused multiply-add, so a
# sum of squares is the same on every CPU that has one and every CPU that has not.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC")
_CALLS = {
    "wsb_difference_and_magnitude": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_void_p],
    "wsb_squared_differences": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p],
}


def library() -> ctypes.CDLL | None:
    """The built ``kernels.c``, once per process; ``None`` where it cannot be built or
    loaded, or answers a known case differently from torch (``why_not()`` says which)."""
    return _build()[0]


def why_not() -> str:
    """Why ``library()`` is ``None`` (the compiler's last line, or the case it missed);
    "" where it is built."""
    return _build()[1]


@functools.cache
def _build() -> tuple[ctypes.CDLL | None, str]:
    compiler = shlex.split(os.environ.get("CC") or "cc")
    with tempfile.TemporaryDirectory(prefix="wsb-kernels-") as tmp:
        built = Path(tmp) / "kernels.so"
        try:
            run = subprocess.run([*compiler, *FLAGS, "-o", str(built), str(SOURCE)],
                                 capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"{' '.join(compiler)}: {e}"
        if run.returncode != 0:
            lines = (run.stderr or run.stdout).strip().splitlines() or [f"exit {run.returncode}"]
            return None, f"{' '.join(compiler)}: {lines[-1]}"
        try:
            lib = ctypes.CDLL(str(built))  # mapped: the file may go once it is loaded
        except OSError as e:
            return None, f"loading the built kernels: {e}"
    for name, arguments in _CALLS.items():
        call = getattr(lib, name)
        call.argtypes, call.restype = arguments, None
    missed = _known_answer(lib)
    return (None, missed) if missed else (lib, "")


def _known_answer(lib: ctypes.CDLL) -> str:
    """"" where the built library answers a small case as torch does, else the case: rows
    of a column slice (a vector's width and a tail, at a row stride of 19). Random fp32
    differences mostly need more bits than fp32 has, so a library that took them in fp32
    would miss it too."""
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(5, 19, generator=g)[:, 2:13] for _ in range(3))
    want = ((a.double() - b.double()).abs().max().item(), b.double().abs().max().item())
    if _difference_and_magnitude(lib, a, b) != want:
        return "the built kernels' max |a - b| differs from torch's"
    sums = _squared_differences(lib, a, b, c)
    want_sums = (float(((a.double() - b.double()) ** 2).sum()),
                 float(((b.double() - c.double()) ** 2).sum()))
    if any(abs(x - y) > 1e-12 * y for x, y in zip(sums, want_sums)):
        return "the built kernels' sums of squares differ from torch's"
    return ""


def _rows(tensors: tuple[torch.Tensor, ...]) -> list[tuple[int, int, int]] | None:
    """``(rows, cols, row stride)`` of each tensor, one ``(rows, cols)`` for all; ``None``
    unless they are CPU fp32 tensors of one non-empty shape, each contiguous or a 2-D view
    with contiguous rows."""
    shape = tensors[0].shape
    if not all(t.dtype == torch.float32 and t.device.type == "cpu" and t.shape == shape
               for t in tensors) or not tensors[0].numel():
        return None
    if all(t.is_contiguous() for t in tensors):
        n = tensors[0].numel()
        return [(1, n, n)] * len(tensors)
    if len(shape) != 2:
        return None
    out = []
    for t in tensors:
        if t.stride(1) != 1 and shape[1] != 1:
            return None
        out.append((shape[0], shape[1], t.stride(0)))
    return out


def _difference_and_magnitude(lib: ctypes.CDLL, a: torch.Tensor, b: torch.Tensor
                              ) -> tuple[float, float] | None:
    layout = _rows((a, b))
    if layout is None:
        return None
    (rows, cols, lda), (_, _, ldb) = layout
    out = (ctypes.c_double * 2)()
    lib.wsb_difference_and_magnitude(a.data_ptr(), lda, b.data_ptr(), ldb, rows, cols, out)
    return out[0], out[1]


def _squared_differences(lib: ctypes.CDLL, a: torch.Tensor, b: torch.Tensor,
                         c: torch.Tensor) -> tuple[float, float] | None:
    layout = _rows((a, b, c))
    if layout is None:
        return None
    (rows, cols, lda), (_, _, ldb), (_, _, ldc) = layout
    out = (ctypes.c_double * 2)()
    lib.wsb_squared_differences(a.data_ptr(), lda, b.data_ptr(), ldb, c.data_ptr(), ldc,
                                rows, cols, out)
    return out[0], out[1]


def difference_and_magnitude(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float] | None:
    """``(max |a - b|, max |b|)`` as the plain fp64 expressions give them, to the bit (the
    first NaN if a difference is NaN; the second then undefined), from one read of each;
    ``None`` where the kernels are not built or the pair is not of their form."""
    lib = library()
    return None if lib is None else _difference_and_magnitude(lib, a.detach(), b.detach())


def squared_differences(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor
                        ) -> tuple[float, float] | None:
    """``(sum (a - b)^2, sum (b - c)^2)`` in fp64, reordered, from one read of each;
    ``None`` where the kernels are not built or the three are not of their form."""
    lib = library()
    return None if lib is None else _squared_differences(lib, a.detach(), b.detach(),
                                                         c.detach())
