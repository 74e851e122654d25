"""A user's script that starts the harness's ranks at import time, with no
``if __name__ == "__main__":``, gets ``UnguardedMain`` saying so, instead of a rank that
"exited with code 1" and no log; the same script under the guard runs (the twin)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

BODY = """
from weight_sync_bench.collectives.gloo.pool import RankPool
pool = RankPool(2)
pool.start()
pool.close()
print("started and closed")
"""


def _run(tmp_path, text):
    script = tmp_path / "my_check.py"
    script.write_text(text)
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)


def test_a_script_without_the_main_guard_is_told_to_add_it(tmp_path):
    done = _run(tmp_path, BODY)
    assert done.returncode != 0
    assert "weight_sync_bench.errors.UnguardedMain: rank " in done.stderr, done.stderr[-2000:]
    assert f"re-imported your script ({tmp_path / 'my_check.py'})" in done.stderr
    assert 'Put the code that runs checks under `if __name__ == "__main__":`' in done.stderr


# 3.5 s, an interpreter of its own: the long run. By default the twin is
# test_long_tmpdir.py's test_the_rank_pool_starts_and_checks_under_a_very_long_tmpdir: a
# script that starts the harness's rank pool under the guard, run as __main__, exits 0 (its
# ranks re-import it without starting a pool).
@pytest.mark.slow
def test_the_same_script_under_the_guard_runs(tmp_path):
    guarded = "if __name__ == '__main__':\n" + textwrap.indent(BODY, "    ")
    done = _run(tmp_path, guarded)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "started and closed" in done.stdout
