"""The comparisons' two paths (``training.kernels``' compiled loops, and torch's, which
takes over where those are not built): a module that marks itself with
``pytest.mark.usefixtures("comparison_path")`` runs each of its tests on both."""

import shutil

import pytest

from weight_sync_bench.training import kernels


@pytest.fixture(params=["kernels", "torch"])
def comparison_path(request, monkeypatch) -> str:
    if request.param == "torch":
        monkeypatch.setattr(kernels, "library", lambda: None)
    elif kernels.library() is None:
        if shutil.which("cc"):  # a machine with a compiler must build them
            pytest.fail(f"training.kernels not built: {kernels.why_not()}")
        pytest.skip(f"training.kernels not built here: {kernels.why_not()}")
    return request.param
