"""``wsb fuzz`` and its corpus directory: two runs writing one directory at once keep one
whole entry per case and a summary each; a directory that cannot be written is refused before
anything runs (``CorpusNotWritable``, exit 2, naming it), never a traceback (exit 3)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from weight_sync_bench.cli import main
from weight_sync_bench.fuzz.corpus import load_entry

ROOT = Path(__file__).resolve().parents[2]
FUNCTIONS = ROOT / "tests" / "fuzz" / "user_functions.py"
BUGGY = ("--resharder", "my_functions:reshard_wrong_for_mha")  # a planted bug: found at once
# the shipped geometries (measured thresholds, ~1.5 s a fresh process) have nothing to do
# with the corpus; test_user_fuzz.py runs them
FUZZ = ("fuzz", "--examples", "10", "--seed", "1", "--no-real-geometries", *BUGGY)


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's project: their functions beside them, ``wsb`` run from there."""
    shutil.copy(FUNCTIONS, tmp_path / "my_functions.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_functions", raising=False)
    monkeypatch.delenv("WSB_FUZZ_DIR", raising=False)
    return tmp_path


def _refused(capsys, corpus: Path) -> str:
    code = main([*FUZZ])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert "Traceback" not in err and "internal error" not in err
    assert "examples in" not in out  # refused before any example ran
    return err


def test_a_corpus_path_under_a_file_is_refused_before_the_run_naming_it(project, capsys,
                                                                       monkeypatch):
    """Root-proof (root writes through a 0o555 directory): a file where the directory goes."""
    (project / "not_a_dir").write_text("")
    corpus = project / "not_a_dir" / "corpus"
    monkeypatch.setenv("WSB_CORPUS_DIR", str(corpus))
    err = _refused(capsys, corpus)
    assert (f"wsb fuzz: the corpus directory {corpus} cannot be written (Not a directory): set "
            "WSB_CORPUS_DIR to a writable directory") in err


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="root writes through a 0o555 directory: the test above uses a file "
                           "in the directory's way instead")
def test_a_read_only_corpus_directory_is_refused_before_the_run_naming_it(project, capsys,
                                                                        monkeypatch):
    corpus = project / "corpus"
    corpus.mkdir()
    corpus.chmod(0o555)
    monkeypatch.setenv("WSB_CORPUS_DIR", str(corpus))
    try:
        err = _refused(capsys, corpus)
    finally:
        corpus.chmod(0o755)
    assert f"the corpus directory {corpus} cannot be written (Permission denied" in err
    assert list(corpus.iterdir()) == []  # not even the probe's file is left


def test_the_twin_a_writable_corpus_gets_the_counterexample_exit_1(project, capsys,
                                                                   monkeypatch):
    corpus = project / "deep" / "corpus"  # made where missing, as before
    monkeypatch.setenv("WSB_CORPUS_DIR", str(corpus))
    assert main([*FUZZ]) == 1
    (entry,) = corpus.glob("*.json")
    assert f"corpus entry: {entry}" in capsys.readouterr().out
    assert [p.name for p in corpus.iterdir()] == [entry.name]  # no probe, no temporary file


def test_two_runs_writing_one_corpus_at_once_keep_one_whole_entry_and_a_summary_each(project):
    """Two ``wsb fuzz`` processes, the same seed and planted bug, one corpus and one
    ``.hypothesis/``: both find the bug, both name the one entry (written once, whole), and
    neither's campaign summary replaces the other's. The timeout only detects a hang."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WSB_CORPUS_DIR": str(project / "corpus"),
           "PYTHONPATH": os.pathsep.join([str(project), str(ROOT / "src"),
                                          os.environ.get("PYTHONPATH", "")])}
    runs = [subprocess.Popen([sys.executable, "-m", "weight_sync_bench", *FUZZ, "--json"],
                             cwd=project, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    done = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [1, 1], done
    (entry,) = (project / "corpus").iterdir()  # one file: no temporary file, no duplicate
    assert entry.suffix == ".json" and load_entry(entry).prop == "invariant"
    summaries = []
    for out, _err in done:
        records = [json.loads(line) for line in out.splitlines()]
        (failure,) = [r for r in records if r["kind"] == "counterexample"]
        assert f"corpus entry: {entry}" in failure["message"]  # new, or "(already there)"
        summaries += [r["summary_file"] for r in records if r["kind"] == "summary"]
    assert len(set(summaries)) == 2 and all(Path(s).is_file() for s in summaries)
