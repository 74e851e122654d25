"""Run tests against chosen mutmut mutants, without touching mutmut's own state.

    python mutation/try_mutant.py [--snapshot DIR] MUTANT [MUTANT ...] -- PYTEST_ARGS ...

MUTANT is a name as ``mutmut results`` prints it (``weight_sync_bench.fuzz.corpus.
x_case_from__mutmut_12``), or a prefix ending in ``*`` for every surviving mutant it starts
(read from ``mutants/``). The mutated sources are copied once from ``mutants/`` into the
snapshot directory (default ``/tmp/wsb-mutsnap``; ``--fresh`` re-copies), with the floors and
corpus beside them, so ``paths.checkout()`` resolves there, as under mutmut. The parent
imports torch and the snapshot's package once, then forks per mutant: the child sets
``MUTANT_UNDER_TEST`` (mutmut's trampolines read it at every call) and runs ``pytest.main``
with PYTEST_ARGS. First the unmutated code is run (it must pass), then each mutant; one line
each: ``killed`` (a test failed), ``timeout`` (not done in ``--timeout`` seconds, default
120: killed, as mutmut's CPU limit would) or ``SURVIVED``. Exit 0 when every mutant is killed.

A function that runs while its module is imported (a factory building a module-level table,
as ``conventions.mutations``' ``_only`` and ``_both`` build the conversion catalogue) ran
unmutated in the parent, so its mutants would survive whatever the tests: ``--reload
MODULE`` (repeatable) re-imports MODULE in each child after the mutant is set, so the table
is built by the mutated code. Names other modules bound with ``from MODULE import X`` keep
the parent's objects; tests that read ``MODULE.X`` see the new ones.

``--warm`` runs the unmutated tests in the parent itself, so every child starts with the test
modules imported and collected once (1.5-2.5 s a mutant instead of 3-10 s, with
``--tb=no``). A cache the parent's run filled (``functools.cache``, a module-level table)
would then answer a child without calling the mutated code, so a mutant that survives warm
is run again the cold way, in a fresh ``try_mutant.py`` process: only its verdict there is
printed.

A mutant that writes into the snapshot's floors or corpus (a committed artifact's path,
where its test passed ``--out``) would change what every later mutant's tests read, and
kill them all: after each mutant they are compared with what they were, and copied again
from ``mutants/`` where it changed them (a ``restored`` line names the files).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = ROOT / "mutants"


def snapshot(target: Path, fresh: bool) -> None:
    if target.exists() and not fresh:
        return
    if not (MUTANTS / "src").is_dir():
        sys.exit(f"{MUTANTS}/src is missing: run `make mutation` (mutmut run) first")
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for name in ("src", "tolerance", "corpus"):
        shutil.copytree(MUTANTS / name, target / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.meta", "*.spans"))
    shutil.copy(MUTANTS / "pyproject.toml", target / "pyproject.toml")


KEPT = ("tolerance", "corpus")  # the snapshot's data beside the sources


def data_state(target: Path) -> dict[str, tuple[int, int]]:
    """(mtime, size) of every file of the snapshot's ``KEPT`` data: a mutant that writes
    there (a committed artifact's path where a test passed ``--out``) changes it."""
    return {str(p.relative_to(target)): (p.stat().st_mtime_ns, p.stat().st_size)
            for name in KEPT for p in sorted((target / name).rglob("*")) if p.is_file()}


def restore_data(target: Path, before: dict[str, tuple[int, int]]) -> list[str]:
    """The files of ``KEPT`` a mutant changed, added or removed (none: []), the data
    copied again from ``mutants/`` where there are any, so the next mutant's tests read
    the committed floors and corpus, not what this one wrote."""
    after = data_state(target)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        for name in KEPT:
            shutil.rmtree(target / name, ignore_errors=True)
            shutil.copytree(MUTANTS / name, target / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
    return changed


def survivors(prefix: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "mutmut", "results"], cwd=ROOT,
                         capture_output=True, text=True, check=False).stdout
    names = [line.split(":")[0].strip() for line in out.splitlines()
             if line.strip().endswith("survived")]
    return [n for n in names if n.startswith(prefix)]


TIMEOUT = -1  # run_one's code for a mutant that did not finish in --timeout seconds


def run_one(mutant: str, pytest_args: list[str], timeout: float = 120.0,
            reload: Sequence[str] = ()) -> int:
    """The child's exit code, or ``TIMEOUT`` after killing it (a mutant that loops forever
    is a timeout, as under mutmut's CPU limit). ``reload``: modules re-imported in the
    child once the mutant is set (``--reload``)."""
    import signal
    import time

    pid = os.fork()
    if pid == 0:
        os.environ["MUTANT_UNDER_TEST"] = mutant
        import importlib
        for module in reload:
            importlib.reload(sys.modules[module])
        import pytest
        code = pytest.main(["-q", "-x", "-n", "0", "-p", "no:cacheprovider", "--no-header",
                            *pytest_args])
        os._exit(int(code))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return TIMEOUT


def main() -> int:
    argv = sys.argv[1:]
    if "--" not in argv:
        sys.exit(__doc__)
    split = argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("--snapshot", type=Path, default=Path("/tmp/wsb-mutsnap"))
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds per mutant before it counts as a timeout (killed)")
    parser.add_argument("--reload", action="append", default=[], metavar="MODULE",
                        help="re-import MODULE in each child once the mutant is set (its "
                             "import-time code runs mutated); repeatable")
    parser.add_argument("--warm", action="store_true",
                        help="run the unmutated tests in the parent (children start with the "
                             "tests imported); each survivor is run again the cold way")
    parser.add_argument("mutants", nargs="+")
    args = parser.parse_args(argv[:split])
    pytest_args = argv[split + 1:]
    snapshot(args.snapshot, args.fresh)
    names = [n for m in args.mutants for n in (survivors(m[:-1]) if m.endswith("*") else [m])]
    sys.path.insert(0, str(args.snapshot / "src"))
    sys.path.insert(1, str(ROOT))  # as `python -m pytest` from the checkout has it: `tests`
    # for any subprocess a test starts; the checkout too, so that a gloo rank can unpickle a
    # task a test module defines (``tests.sync.resharders``): the forkserver that forks the
    # ranks takes this process's sys.path, a subprocess PYTHONPATH
    os.environ["PYTHONPATH"] = os.pathsep.join([str(args.snapshot / "src"), str(ROOT)])
    import torch
    torch.set_num_threads(1)
    import weight_sync_bench
    # Imported here, once, not in each child: pytest assertion-rewrites every module of a
    # package that provides a pytest plugin as it imports it (hypothesis's 73 modules,
    # xdist's, and the snapshot's own: the mutated sources are ~10x the size), and with no
    # bytecode written that was 2.5-10 s of each mutant's run.
    import importlib
    import pkgutil

    import _hypothesis_pytestplugin  # noqa: F401
    import hypothesis.strategies  # noqa: F401
    import xdist.plugin  # noqa: F401
    for module in pkgutil.walk_packages(weight_sync_bench.__path__, "weight_sync_bench."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    if not Path(weight_sync_bench.__file__).is_relative_to(args.snapshot):
        sys.exit(f"weight_sync_bench imported from {weight_sync_bench.__file__}, not the snapshot")
    os.chdir(ROOT)
    unknown = [m for m in args.reload if m not in sys.modules]
    if unknown:
        sys.exit(f"--reload: {', '.join(unknown)} is not a module of the snapshot's package")
    if (unmutated(pytest_args) if args.warm else run_one("", pytest_args, reload=args.reload)):
        print("the unmutated code fails these tests: fix them first")
        return 2
    alive = []
    data = data_state(args.snapshot)
    for name in names:
        code = run_one(name, pytest_args, args.timeout, args.reload)
        changed = restore_data(args.snapshot, data)
        if changed:
            print(f"restored  the snapshot's {', '.join(changed[:3])}"
                  f"{' ...' if len(changed) > 3 else ''}: {name} wrote there", flush=True)
            data = data_state(args.snapshot)
        verdict = "timeout" if code == TIMEOUT else "killed" if code != 0 else "SURVIVED"
        if code == 0 and args.warm:
            alive.append(name)  # printed once the cold run has judged it
            continue
        print(f"{verdict}  {name}", flush=True)
        if code == 0:
            alive.append(name)
    if args.warm and alive:
        alive = cold(args, alive, pytest_args)
    print(f"{len(names) - len(alive)} of {len(names)} killed")
    return 1 if alive else 0


def unmutated(pytest_args: list[str]) -> int:
    """The unmutated run of ``--warm``, in this process: its exit code."""
    import pytest
    os.environ["MUTANT_UNDER_TEST"] = ""
    return int(pytest.main(["-q", "-x", "-n", "0", "-p", "no:cacheprovider", "--no-header",
                            *pytest_args]))


def cold(args: argparse.Namespace, names: list[str], pytest_args: list[str]) -> list[str]:
    """``names`` (warm survivors) run again by a fresh ``try_mutant.py`` without ``--warm``,
    its verdict lines printed; the names it reports surviving."""
    command = [sys.executable, __file__, "--snapshot", str(args.snapshot), "--timeout",
               str(args.timeout), *(f"--reload={m}" for m in args.reload), *names, "--",
               *pytest_args]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False).stdout
    lines = [line for line in out.splitlines()
             if line.split("  ")[0] in ("killed", "timeout", "SURVIVED")]
    for line in lines:
        print(line, flush=True)
    judged = {line.split("  ", 1)[1]: line.split("  ")[0] for line in lines}
    missing = [n for n in names if n not in judged]
    if missing:
        sys.exit(f"the cold run judged none of {', '.join(missing)}:\n{out}")
    return [n for n in names if judged[n] == "SURVIVED"]


if __name__ == "__main__":
    sys.exit(main())
