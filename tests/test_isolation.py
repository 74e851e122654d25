"""A test run never writes into the checkout: the corpus and fuzz outputs it may write go to
per-process copies (``conftest.py``), and ``.ci/run`` fails on any file left changed."""

import subprocess
from pathlib import Path

from weight_sync_bench.fuzz.corpus import entry_paths
from weight_sync_bench.paths import checkout, corpus_dir, fuzz_dir

ROOT = Path(__file__).resolve().parents[1]


def test_the_corpus_a_test_writes_to_is_a_copy_of_the_committed_one():
    assert checkout() == ROOT
    assert corpus_dir() != ROOT / "corpus" and not corpus_dir().is_relative_to(ROOT)
    assert [p.name for p in entry_paths()] == sorted(p.name for p in (ROOT / "corpus").glob("*.json"))
    assert not fuzz_dir().is_relative_to(ROOT)


def test_ci_fails_a_run_that_leaves_the_checkout_changed():
    script = (ROOT / ".ci" / "run").read_text()
    assert "make test" in script and "git status --porcelain" in script
    # the check itself: run it on a scratch repository with a stray file left behind
    check = script[script.index("left=$("):script.index("exit 0")]
    repo = Path(subprocess.run(["mktemp", "-d"], capture_output=True, text=True).stdout.strip())
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "stray.json").write_text("{}")
    run = subprocess.run(["bash", "-c", check], cwd=repo, capture_output=True, text=True)
    assert run.returncode == 1 and "stray.json" in run.stderr
    (repo / "stray.json").unlink()
    clean = subprocess.run(["bash", "-c", check + "exit 0"], cwd=repo, capture_output=True,
                           text=True)
    assert clean.returncode == 0, clean.stderr
