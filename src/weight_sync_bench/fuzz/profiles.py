"""The harness's Hypothesis profiles, by name, registered on import; nothing here imports
torch, so the pytest plugin (``--wsb-profile``) and a test suite's conftest load them in a
fraction of a second.

Profiles have names of their own (Hypothesis loads its built-in ``ci`` profile whenever
``CI`` is set, and CI here sets ``CI=true``), each with ``database``, ``derandomize`` and
``deadline`` set explicitly; ``$WSB_PROFILE`` or ``wsb fuzz --profile`` selects one:

- ``wsb-test``: the default ``make test`` run; few examples, derandomized (the same
  examples every run, so the gate is deterministic), no database (the corpus is the memory);
- ``wsb-nightly``: the long scheduled run; random, with a local example database;
- ``wsb-replay``: only the explicit examples, i.e. the corpus, no generation;
- ``wsb-generate``: generation only (no shrinking, no database), for floor sampling.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from weight_sync_bench.errors import MissingArtifacts, WsbError
from weight_sync_bench.paths import fuzz_dir

PROFILE_ENV = "WSB_PROFILE"
DEFAULT_PROFILE = "wsb-test"
_EVERY_PHASE = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)


def _nightly_database() -> DirectoryBasedExampleDatabase | None:
    """The nightly profile's example database under ``paths.fuzz_dir()``; none where no
    checkout and no ``WSB_FUZZ_DIR`` says where (an installed package has nowhere to keep it)."""
    try:
        return DirectoryBasedExampleDatabase(str(fuzz_dir() / "wsb-nightly"))
    except MissingArtifacts:
        return None


PROFILES: dict[str, settings] = {
    "wsb-test": settings(max_examples=100, derandomize=True, database=None, deadline=None,
                         phases=_EVERY_PHASE, report_multiple_bugs=False, print_blob=False),
    "wsb-nightly": settings(max_examples=2000, derandomize=False, deadline=None,
                            database=_nightly_database(),
                            phases=_EVERY_PHASE, report_multiple_bugs=False,
                            suppress_health_check=[HealthCheck.too_slow]),
    "wsb-replay": settings(max_examples=1, derandomize=True, database=None, deadline=None,
                           phases=(Phase.explicit,), report_multiple_bugs=False),
    "wsb-generate": settings(max_examples=100, derandomize=False, database=None,
                             deadline=None, phases=(Phase.generate,),
                             suppress_health_check=[HealthCheck.too_slow]),
}
for _name, _settings in PROFILES.items():
    settings.register_profile(_name, _settings)


def profile_name(name: str | None = None) -> str:
    """``name``, else ``$WSB_PROFILE``, else ``wsb-test``; an unknown name is an error."""
    chosen = name or os.environ.get(PROFILE_ENV) or DEFAULT_PROFILE
    if chosen not in PROFILES:
        source = "--profile" if name else f"${PROFILE_ENV}"
        raise WsbError(f"unknown profile {chosen!r} (from {source}); known: {', '.join(PROFILES)}")
    return chosen
