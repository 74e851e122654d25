"""A long TMPDIR does not break the gloo rank pool (issue 11).

multiprocessing's forkserver binds an AF_UNIX socket at ``$TMPDIR/pymp-XXXXXXXX/listener-
XXXXXXXX``; past about 70 bytes of TMPDIR that path exceeds ``sun_path`` and the pool could
not start. The pool now makes multiprocessing's temporary directory under a short system one
when TMPDIR is too long (``pool.socket_tempdir``), and keeps its own files under TMPDIR."""

from __future__ import annotations

import os
import subprocess
import sys

from weight_sync_bench.collectives.gloo.pool import (
    SHORT_TEMP_BASES,
    SUN_PATH_MAX,
    socket_tempdir,
)

_RANKS = """
import multiprocessing.util as util
from weight_sync_bench.check.forwards import run_phase1b
from weight_sync_bench.collectives.gloo.pool import RankPool
from weight_sync_bench.model.config import TOY

TINY = TOY.replace(name="tiny", vocab=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                   head_dim=8, ffn=48, batch=1, seq_len=8)
if __name__ == "__main__":
    with RankPool(2) as pool:
        r = run_phase1b(TINY, 2, param_seed=1, token_seed=2, pool=pool, reference=True)
        print(util.get_temp_dir(), float((r.logits - r.reference).abs().max()), flush=True)
"""


def _long_tmpdir(tmp_path):
    long = tmp_path / ("t" * 150)
    long.mkdir()
    assert len(os.fsencode(str(long))) > SUN_PATH_MAX
    return long


def _run(code, tmpdir, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(code)
    env = {**os.environ, "TMPDIR": str(tmpdir), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=120, check=False)


def test_the_rank_pool_starts_and_checks_under_a_very_long_tmpdir(tmp_path):
    """Also the default run's twin of test_unguarded_main.py's UnguardedMain: the pool is
    started under ``if __name__ == "__main__":`` in the script run as ``__main__``, and
    runs."""
    long = _long_tmpdir(tmp_path)
    out = _run(_RANKS, long, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    mp_dir, error = out.stdout.split()
    assert float(error) < 1e-4  # the check ran, over gloo, and agreed with the reference
    assert os.path.dirname(mp_dir) in SHORT_TEMP_BASES  # multiprocessing's files went short
    assert not os.path.exists(mp_dir)  # and multiprocessing removed them at exit
    assert list(long.iterdir()) == []  # the pool's own directory was removed too


def test_twin_the_same_tmpdir_breaks_a_plain_forkserver(tmp_path):
    """Without the pool's fallback the forkserver cannot bind its socket there: the long
    TMPDIR of the test above is a real case, not a harmless one."""
    long = _long_tmpdir(tmp_path)
    code = ("import multiprocessing.forkserver as fs\n"
            "if __name__ == '__main__':\n"
            "    fs.ensure_running()\n")
    out = _run(code, long, tmp_path)
    assert out.returncode != 0 and "AF_UNIX path too long" in out.stderr, out.stderr[-2000:]


def test_socket_tempdir_keeps_a_short_tmpdir_and_replaces_one_a_byte_too_long(tmp_path):
    suffix = len("/pymp-XXXXXXXX/listener-XXXXXXXX")  # what multiprocessing appends
    fits = "/" + "a" * (SUN_PATH_MAX - suffix - 1)
    assert socket_tempdir("/tmp") is None and socket_tempdir(fits) is None  # left alone
    assert socket_tempdir(fits + "a") in SHORT_TEMP_BASES
    assert socket_tempdir(str(_long_tmpdir(tmp_path))) in SHORT_TEMP_BASES
