"""``training.kernels``: which tensors the compiled comparisons take, what they return
against the plain torch expressions, and what happens where they cannot be built (the
comparisons go on with torch, told why). What they compute is pinned to the bit on both
paths by ``test_compare_exact.py``; this file holds what is the kernels' own."""

import math
import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import torch

from weight_sync_bench.training import kernels

ROOT = Path(__file__).resolve().parents[2]
needs_kernels = pytest.mark.skipif(kernels.library() is None and not shutil.which("cc"),
                                   reason=f"no C compiler here: {kernels.why_not()}")


def plain(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    return (float((a.double() - b.double()).abs().max()), float(b.double().abs().max()))


def sums(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[float, float]:
    return (float(((a.double() - b.double()) ** 2).sum()),
            float(((b.double() - c.double()) ** 2).sum()))


@needs_kernels
def test_a_machine_with_a_compiler_builds_them_and_they_answer_the_known_case():
    assert kernels.library() is not None, kernels.why_not()
    assert kernels.why_not() == ""


def _matrix(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


@needs_kernels
@pytest.mark.parametrize("cols", [1, 7, 8, 9, 83])
def test_column_slices_are_read_row_by_row_to_the_bit(cols):
    """A row-parallel weight's shard against its columns of the reference: rows of ``cols``
    contiguous elements at each matrix's own row stride, a vector's width and a tail."""
    a, b, c = (_matrix(40, width, s) for s, width in enumerate((100, 100, 120)))
    got, want, start = a[:, 3:3 + cols], b[:, 11:11 + cols], c[:, :cols]  # three strides
    assert not got.is_contiguous() or cols == 1
    assert kernels.difference_and_magnitude(got, want) == plain(got, want)
    fused = kernels.squared_differences(got, want, start)
    assert fused == pytest.approx(sums(got, want, start), rel=1e-12, abs=0)
    whole = kernels.difference_and_magnitude(a, b)  # the twin: the rows outside the slice
    assert whole == plain(a, b) != plain(got, want)


@needs_kernels
@pytest.mark.parametrize("row, col", [(0, 0), (17, 8), (39, 82)])
def test_a_nan_anywhere_in_a_slice_is_a_nan_difference(row, col):
    """In a vector's lanes or in a row's tail, in the first row or the last."""
    a, b = _matrix(40, 100, 0), _matrix(40, 100, 1)
    got, want = a[:, 5:88], b[:, 5:88]
    assert not math.isnan(kernels.difference_and_magnitude(got, want)[0])  # the twin
    a[row, 5 + col] = float("nan")
    assert math.isnan(kernels.difference_and_magnitude(got, want)[0])
    assert math.isnan(kernels.squared_differences(got, want, want)[0])


@needs_kernels
def test_infinities_read_as_torch_reads_them():
    a, b = _matrix(4, 50, 0), _matrix(4, 50, 1)
    a[2, 40] = float("inf")
    assert kernels.difference_and_magnitude(a, b) == (math.inf, plain(a, b)[1])
    b[2, 40] = float("inf")  # inf - inf
    assert math.isnan(kernels.difference_and_magnitude(a, b)[0])
    b[2, 40], b[3, 1] = 0.0, float("-inf")
    assert kernels.difference_and_magnitude(a, b) == (math.inf, math.inf)


@needs_kernels
@pytest.mark.parametrize("name, pair", [
    ("fp64", lambda a, b: (a.double(), b.double())),
    ("bf16 against fp32", lambda a, b: (a.bfloat16(), b)),
    ("two shapes", lambda a, b: (a, b[:, :1])),
    ("transposed", lambda a, b: (a.t(), b.t())),
    ("strided rows", lambda a, b: (a[:, ::2], b[:, ::2])),
    ("two strided columns", lambda a, b: (a[:, ::5], b[:, ::5])),
    ("3-D, not contiguous",
     lambda a, b: (a.view(4, 10, 10)[:, :, :5], b.view(4, 10, 10)[:, :, :5])),
    ("empty", lambda a, b: (a[:0], b[:0])),
])
def test_what_they_do_not_take_is_left_to_torch(name, pair):
    a, b = pair(_matrix(40, 10, 0), _matrix(40, 10, 1))
    assert kernels.difference_and_magnitude(a, b) is None, name
    assert kernels.squared_differences(a, b, b) is None, name
    same = _matrix(40, 10, 0)  # the twin: plain fp32 matrices are taken
    assert kernels.difference_and_magnitude(same, same) == (0.0, plain(same, same)[1])


@needs_kernels
def test_a_single_column_is_read_as_rows_whatever_its_column_stride():
    a, b = _matrix(40, 10, 0), _matrix(40, 10, 1)
    got, want = a[:, ::10], b[:, 3::10]  # (40, 1), column strides 10
    assert kernels.difference_and_magnitude(got, want) == plain(got, want)
    assert kernels.squared_differences(got, want, got) == pytest.approx(sums(got, want, got),
                                                                       rel=1e-12, abs=0)


@needs_kernels
def test_a_contiguous_tensor_beside_a_column_slice_is_read_as_rows():
    a, b = _matrix(30, 20, 0), _matrix(30, 64, 1)
    assert kernels.difference_and_magnitude(a, b[:, 7:27]) == plain(a, b[:, 7:27])
    assert kernels.squared_differences(b[:, :20], a, a.clone()) == pytest.approx(
        sums(b[:, :20], a, a), rel=1e-12, abs=0)


@needs_kernels
def test_requires_grad_and_offset_views_are_read_where_they_lie():
    a, b = _matrix(8, 64, 0).requires_grad_(), _matrix(8, 64, 1)
    assert kernels.difference_and_magnitude(a[3:], b[:5]) == plain(a.detach()[3:], b[:5])


def test_no_compiler_leaves_the_comparisons_to_torch_and_says_why(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/wsb-cc")
    lib, why = kernels._build.__wrapped__()
    assert lib is None and why.startswith("/nonexistent/wsb-cc: ")


def test_a_compiler_that_fails_is_named_with_its_last_line(monkeypatch, tmp_path):
    failing = tmp_path / "failing-cc"
    failing.write_text("#!/bin/sh\necho 'first line' >&2\necho 'kernels.c: no such luck' >&2\n"
                       "exit 3\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    assert kernels._build.__wrapped__() == (None, f"{failing}: kernels.c: no such luck")
    failing.write_text("#!/bin/sh\nexit 3\n")  # silent
    assert kernels._build.__wrapped__() == (None, f"{failing}: exit 3")


def test_a_compiler_that_writes_no_library_is_a_load_failure(monkeypatch, tmp_path):
    liar = tmp_path / "liar-cc"
    liar.write_text("#!/bin/sh\nexit 0\n")  # "succeeds", writes nothing
    liar.chmod(0o755)
    monkeypatch.setenv("CC", str(liar))
    lib, why = kernels._build.__wrapped__()
    assert lib is None and why.startswith("loading the built kernels: ")


@needs_kernels
def test_the_build_leaves_nothing_behind(monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    lib, why = kernels._build.__wrapped__()
    assert lib is not None, why
    assert os.listdir(tmp_path) == []


class Wrong:
    """A built library that answers one of the two known cases wrongly."""

    def __init__(self, which: str):
        self.which = which

    def wsb_difference_and_magnitude(self, a, lda, b, ldb, rows, cols, out):
        kernels.library().wsb_difference_and_magnitude(a, lda, b, ldb, rows, cols, out)
        if self.which == "max":
            out[0] = math.nextafter(out[0], 0.0)  # one ulp: the bit is the contract
        elif self.which == "fp32":  # the difference taken in fp32, not fp64
            out[0] = float(torch.tensor(out[0], dtype=torch.float32))
        elif self.which == "magnitude":
            out[1] = math.nextafter(out[1], 0.0)

    def wsb_squared_differences(self, a, lda, b, ldb, c, ldc, rows, cols, out):
        kernels.library().wsb_squared_differences(a, lda, b, ldb, c, ldc, rows, cols, out)
        if self.which == "sums":
            out[1] *= 1 + 1e-9
        elif self.which == "reordered":  # within what reordering a sum of 55 moves it
            out[1] *= 1 + 1e-13


@needs_kernels
@pytest.mark.parametrize("which, why", [
    ("max", "the built kernels' max |a - b| differs from torch's"),
    ("fp32", "the built kernels' max |a - b| differs from torch's"),
    ("magnitude", "the built kernels' max |a - b| differs from torch's"),
    ("sums", "the built kernels' sums of squares differ from torch's"),
])
def test_a_library_that_misses_the_known_case_is_not_used(which, why):
    assert kernels._known_answer(kernels.library()) == ""  # the twin
    assert kernels._known_answer(Wrong("reordered")) == ""  # a sum in another order: taken
    assert kernels._known_answer(Wrong(which)) == why  # type: ignore[arg-type]


@needs_kernels
def test_the_comparisons_take_the_kernels_and_torch_where_they_are_not_built(monkeypatch):
    from weight_sync_bench.training import compare

    calls = []
    real = kernels.library()

    class Counting:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real, name)

    a, b, c = (_matrix(300, 300, s) for s in range(3))
    monkeypatch.setattr(kernels, "library", Counting)
    assert compare.difference_and_magnitude(a, b) == plain(a, b)
    assert compare.update_deviation(a, b, c) == pytest.approx(
        math.sqrt(sums(a, b, c)[0] / sums(a, b, c)[1]), rel=1e-12)
    assert compare.max_abs_difference(a, b) == plain(a, b)[0]
    assert calls == ["wsb_difference_and_magnitude", "wsb_squared_differences",
                     "wsb_difference_and_magnitude"]
    monkeypatch.setattr(kernels, "library", lambda: None)  # the twin: torch alone
    assert compare.difference_and_magnitude(a, b) == plain(a, b)
    assert compare.max_abs_difference(a, b) == plain(a, b)[0]
    assert len(calls) == 3


def test_the_source_ships_beside_the_module_as_package_data():
    assert kernels.SOURCE.is_file() and kernels.SOURCE.parent == Path(kernels.__file__).parent
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"]["package-data"]
    assert kernels.SOURCE.name in data["weight_sync_bench.training"]


@pytest.mark.skipif(not shutil.which("cc"), reason="no C compiler here")
def test_the_source_needs_no_header_and_no_library(tmp_path):
    """A slim image's bare compiler, without the C library's headers, builds it."""
    built = tmp_path / "kernels.so"
    run = subprocess.run(["cc", *kernels.FLAGS, "-nostdinc", "-o", str(built),
                          str(kernels.SOURCE)], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr


def test_the_comparisons_return_what_the_kernels_return(monkeypatch):
    """Not the torch path's figure computed beside them (the kernels' answers here are
    planted, so only a comparison that returns them passes)."""
    from weight_sync_bench.training import compare

    monkeypatch.setattr(kernels, "difference_and_magnitude", lambda a, b: (7.0, 3.0))
    monkeypatch.setattr(kernels, "squared_differences", lambda a, b, c: (4.0, 16.0))
    a, b, c = (_matrix(4, 8, s) for s in range(3))
    assert compare.max_abs_difference(a, b) == 7.0
    assert compare.difference_and_magnitude(a, b) == (7.0, 3.0)
    assert compare.update_deviation(a, b, c) == 0.5
    assert compare.relative_deviation(a, b) == 7.0 / 3.0
