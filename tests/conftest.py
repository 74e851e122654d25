"""One torch thread per process, the fuzz profile (``$WSB_PROFILE``, else ``wsb-test``; never
Hypothesis's built-in ``ci``, which ``CI=true`` would otherwise load), and a test run that
never writes into the checkout.

Each test process (every xdist worker) works on its own copy of the committed corpus and its
own fuzz directory: a property that fails against buggy code writes its case there, not into
``corpus/``, where a stray file would fail the next clean run. The committed tolerance
artifacts are read in place; a test that writes one writes under ``tmp_path``. ``.ci/run``
fails if a run leaves ``git status --porcelain`` non-empty.
"""

import gc
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir

from weight_sync_bench.fuzz.profiles import profile_name  # registers the wsb-* profiles
from weight_sync_bench.paths import corpus_dir

torch.set_num_threads(1)
settings.load_profile(profile_name())
# The objects of torch, Hypothesis and pytest, alive for the whole session, leave the cyclic
# garbage collector's scans: otherwise every collection of the oldest generation walks them
# all, and collecting the suite (each xdist worker rewrites the asserts of every test module,
# allocating millions of AST nodes) spent more time in the collector than in the rewriting.
gc.freeze()

CHECKOUT_TOLERANCE = Path(__file__).resolve().parents[1] / "tolerance"
_SET: dict[str, str] = {}  # what this session put into os.environ, to take out at its end


def pytest_configure(config):
    # Made per session, not per import: mutmut runs several pytest sessions in one process,
    # and each must get a live scratch directory and its own copy of the corpus.
    scratch = Path(tempfile.mkdtemp(prefix="wsb-test-"))
    _SET["scratch"] = str(scratch)
    # Hypothesis keeps what it learns (the constants of the code under test, examples)
    # under ./.hypothesis by default: the checkout, when the suite runs from there
    set_hypothesis_home_dir(scratch / "hypothesis")
    if "WSB_CORPUS_DIR" not in os.environ:
        copy = scratch / "corpus"
        shutil.copytree(corpus_dir(), copy)
        os.environ["WSB_CORPUS_DIR"] = _SET["WSB_CORPUS_DIR"] = str(copy)
    if "WSB_FUZZ_DIR" not in os.environ:
        os.environ["WSB_FUZZ_DIR"] = _SET["WSB_FUZZ_DIR"] = str(scratch / "fuzz")
    if "WSB_FLOOR_CACHE" not in os.environ:  # a floor a test measures: never ~/.cache
        os.environ["WSB_FLOOR_CACHE"] = _SET["WSB_FLOOR_CACHE"] = str(scratch / "floors")


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """Collecting rewrites the asserts of every test module (each xdist worker, again: no
    bytecode is cached under ``PYTHONDONTWRITEBYTECODE``), millions of short-lived AST nodes
    that set off a collection every 700 allocations: collected with the collector rarely
    run, 7 s a worker instead of 13 here. The collected items, alive until the session ends,
    then leave its scans too, and the tests run under the default thresholds."""
    thresholds = gc.get_threshold()
    gc.set_threshold(100_000, 50, 1000)
    try:
        return (yield)
    finally:
        gc.set_threshold(*thresholds)
        gc.collect()
        gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()  # mutmut runs several sessions a process: each one's items collectable after it
    for name in ("WSB_CORPUS_DIR", "WSB_FUZZ_DIR", "WSB_FLOOR_CACHE"):
        value = _SET.pop(name, None)
        if value is not None and os.environ.get(name) == value:
            del os.environ[name]
    scratch = _SET.pop("scratch", None)
    set_hypothesis_home_dir(None)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture
def tolerance(tmp_path, monkeypatch):
    """The committed floors, copied under ``tmp_path`` without the per-geometry ones, with
    ``WSB_TOLERANCE_DIR`` and the user's floor cache (``WSB_FLOOR_CACHE``) both pointing
    there: a floor a test measures lands in ``copy / "geometry"``, never in the checkout."""
    copy = tmp_path / "tolerance"
    shutil.copytree(CHECKOUT_TOLERANCE, copy, ignore=shutil.ignore_patterns("geometry"))
    monkeypatch.setenv("WSB_TOLERANCE_DIR", str(copy))
    monkeypatch.setenv("WSB_FLOOR_CACHE", str(copy))
    return copy


@pytest.fixture
def planted_converter():
    """``planted_converter(mutation)``: the harness's converter with that conversion mutation
    built in wherever it applies and is not the identity (what a user's converter with the
    bug returns; the fuzz cannot tell it from a real one)."""
    from weight_sync_bench.conventions import convert
    from weight_sync_bench.conventions.mutations import MUTATIONS, Conversion

    def planted(mutation):
        m = MUTATIONS[mutation]

        def buggy(shards, src, dst, config):
            out = convert(shards, src, dst, config)
            conversion = Conversion(config, src, dst)
            if m.not_applicable(conversion) or m.identity_reason(conversion):
                return out
            return m.apply(out, conversion)
        return buggy
    return planted


@pytest.fixture
def edit_artifact(tolerance):
    """``edit_artifact(name, change)``: ``change(artifact)`` applied to the copied floor
    ``name`` (``tolerance``'s copy, never the checkout's), written back."""
    def edit(name, change):
        path = tolerance / name
        artifact = json.loads(path.read_text())
        change(artifact)
        path.write_text(json.dumps(artifact))
    return edit


@pytest.fixture(autouse=True)
def _fresh_layouts():
    """``layout_for`` is cached per config (``model.plan``), a table's validations, ranges,
    supported degrees and reshard plans per frozen placement (``layout.table``,
    ``layout.reshard``), a convention's index maps and refusals (``conventions.convention``)
    and a few models' draws (``init_params``). mutmut forks each mutant's run from a
    process that ran the tests unmutated, so under mutmut (``MUTANT_UNDER_TEST`` set, in
    every phase of its run, as by ``mutation/try_mutant.py``) each test computes its own: a
    cached answer would carry what the unmutated code computed into the mutant's tests.
    Otherwise they are kept across tests, as in a user's process."""
    from weight_sync_bench.layout import reshard, table
    from weight_sync_bench.model.plan import layout_for

    if "MUTANT_UNDER_TEST" in os.environ:  # under mutmut; kept across tests otherwise
        from weight_sync_bench.conventions.convention import clear_caches
        from weight_sync_bench.model.config import clear_kept_params

        layout_for.cache_clear()
        table.clear_caches()
        reshard.clear_caches()
        clear_kept_params()
        clear_caches()
    yield
