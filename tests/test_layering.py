"""The package layout is the architecture: lower layers never import higher ones, only the CLI
prints, the core never imports the Hypothesis strategies, and every package is installed.
Inside a package, modules import one way too: no import cycle between its modules, and no
module imports another's ``_private`` name (a helper two modules need is a public name of
the lower one).

Checked by walking the AST of every module under ``src/weight_sync_bench`` (every import,
``TYPE_CHECKING`` and function-local ones included: a cycle broken by a function-local
import is still a cycle). Each rule has a twin run on a small synthetic package that breaks
it, so the walk is shown to see what it claims to see.
"""

from __future__ import annotations

import ast
import functools
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "weight_sync_bench"

# Lowest first: a module of layer i may import layers 0..i, never i+1.. .
# ``help`` (``wsb --help`` without torch, a module) reads the CLI's parsers to keep their
# texts; ``testing`` (the public pytest front end of the fuzz, a module) sits at the top,
# beside cli; ``pytest_plugin`` (the pytest11 entry point) above it.
LAYERS = ("layout", "collectives", "model", "conventions", "tolerance", "check", "sync", "training",
          "fuzz", "cli", "help", "testing", "pytest_plugin")
ANYWHERE = ("errors", "paths", "memory", "files", "version")  # importable from every layer; they import no layer themselves
# Entry points may import anything: the package's public surface and ``python -m`` targets.
ENTRY_POINTS = ("__init__", "__main__")
STRATEGIES = "fuzz.strategies"
# Who may import the Hypothesis strategies: the fuzz front end and what sits above it.
# ``fuzz.user`` is the front end for a user's own functions (``wsb fuzz --resharder``).
STRATEGY_USERS = ("fuzz.runner", "fuzz.strategies", "fuzz.user", "cli", "testing")
PRINTERS = ("cli",)

# Known violations of the two module rules, listed one by one: none is left. The tests below
# fail on each entry no longer found (a stale entry would let its violation come back
# unseen). Nothing may be added to them.
KNOWN_CYCLES: set[tuple[str, ...]] = set()
KNOWN_PRIVATE_IMPORTS: set[str] = set()

# Every test here reads every module: each source is parsed once a process (not mutated)
_parse = functools.lru_cache(maxsize=None)(ast.parse)


def module_name(path: Path, package: Path) -> str:
    """``.../weight_sync_bench/check/checker.py`` -> ``check.checker``."""
    parts = list(path.relative_to(package).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def imported(tree: ast.AST, top: str) -> list[tuple[int, str]]:
    """Every ``top.x.y`` module this tree imports, relative to ``top`` (``x.y``), with its line."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == top:  # ``from weight_sync_bench import check``: submodules
                found += [(node.lineno, a.name) for a in node.names]
            elif node.module.startswith(top + "."):
                found.append((node.lineno, node.module[len(top) + 1:]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name[len(top) + 1:]) for a in node.names
                      if a.name.startswith(top + ".")]
    return found


def _layer(module: str) -> str:
    return module.split(".")[0]


def _is(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def import_violations(package: Path, top: str = "weight_sync_bench") -> list[str]:
    """``path:line: a imports b`` for every import that climbs the layers, or that reaches
    the strategies from outside the fuzz front end."""
    out = []
    for path in sorted(package.rglob("*.py")):
        me = module_name(path, package)
        if me.split(".")[-1] in ENTRY_POINTS and (me in ENTRY_POINTS or path.stem == "__main__"):
            continue
        mine = _layer(me)
        for line, target in imported(_parse(path.read_text()), top):
            where = f"{path.relative_to(package)}:{line}: {me} imports {target}"
            if _is(target, (STRATEGIES,)) and not _is(me, STRATEGY_USERS):
                out.append(where + " (only the fuzz front end uses the strategies)")
            theirs = _layer(target)
            if theirs in ANYWHERE or theirs in ENTRY_POINTS:
                if theirs in ENTRY_POINTS:
                    out.append(where + " (the package's entry point is not a library)")
                continue
            if mine in ANYWHERE:
                out.append(where + f" ({mine} must import no layer)")
            elif mine not in LAYERS or theirs not in LAYERS:
                out.append(where + f" (a package outside the layers {LAYERS})")
            elif LAYERS.index(theirs) > LAYERS.index(mine):
                out.append(where + f" ({mine} is below {theirs})")
    return out


def module_imports(package: Path, top: str = "weight_sync_bench"
                   ) -> tuple[dict[str, set[str]], list[str]]:
    """Each module's imports of the package's own modules (``x.y``, every import counted),
    and ``a imports _name from b`` for every import of a ``_private`` name (not a submodule,
    not a dunder) from another module."""
    paths = {module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    edges: dict[str, set[str]] = {m: set() for m in paths}
    private = []
    for me, path in paths.items():
        base = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
        for node in ast.walk(_parse(path.read_text())):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith(top + "."):
                        _add(edges, me, _resolve(a.name[len(top) + 1:], paths))
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the importing module's package
                    parts = base[:len(base) - node.level + 1] + (
                        node.module.split(".") if node.module else [])
                    source = ".".join(parts)
                elif node.module == top or (node.module or "").startswith(top + "."):
                    source = node.module[len(top) + 1:]  # type: ignore[index]
                else:
                    continue
                for a in node.names:
                    whole = f"{source}.{a.name}" if source else a.name
                    target = whole if whole in paths else _resolve(source, paths)
                    _add(edges, me, target)
                    if (a.name.startswith("_") and not a.name.startswith("__")
                            and whole not in paths and target not in (None, me)):
                        private.append(f"{me} imports {a.name} from {target}")
    return edges, private


def _resolve(name: str, paths: dict[str, Path]) -> str | None:
    """The module ``name`` is, or the innermost module it is an attribute of."""
    while name and name not in paths:
        name = name.rpartition(".")[0]
    return name or None


def _add(edges: dict[str, set[str]], me: str, target: str | None) -> None:
    if target is not None and target != me:
        edges[me].add(target)


def package_cycles(package: Path) -> set[tuple[str, ...]]:
    """The import cycles between modules of one package (its strongly connected components
    of more than one module, each sorted). A package's ``__init__`` re-exporting its own
    modules is not one: ``__init__`` modules are left out."""
    edges, _ = module_imports(package)
    inits = {module_name(p, package) for p in package.rglob("__init__.py")}
    inner = {m: {t for t in targets if t not in inits and _layer(t) == _layer(m)}
             for m, targets in edges.items() if m not in inits}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(inner[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = [stack.pop()]
            while component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.add(tuple(sorted(component)))

    for v in sorted(inner):
        if v not in index:
            visit(v)
    return found


def private_imports(package: Path) -> set[str]:
    return set(module_imports(package)[1])


def print_violations(package: Path) -> list[str]:
    """``path:line`` of every ``print(...)``, ``sys.stdout/stderr.write`` and ``pprint``
    outside the CLI and the ``__main__`` entry points."""
    out = []
    for path in sorted(package.rglob("*.py")):
        me = module_name(path, package)
        if _is(me, PRINTERS) or path.stem == "__main__":
            continue
        for node in ast.walk(_parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = (f.id if isinstance(f, ast.Name) else
                    ast.unparse(f) if isinstance(f, ast.Attribute) else "")
            if name in ("print", "pprint", "pprint.pprint") or name.endswith(
                    ("sys.stdout.write", "sys.stderr.write")):
                out.append(f"{path.relative_to(package)}:{node.lineno}: {name}(...)")
    return out


def test_no_module_imports_a_layer_above_its_own():
    assert import_violations(PACKAGE) == []


def test_only_the_cli_prints():
    assert print_violations(PACKAGE) == []


def test_no_import_cycle_between_the_modules_of_a_package():
    found = package_cycles(PACKAGE)
    assert found - KNOWN_CYCLES == set(), "new cycles (break them: a helper two modules need " \
        "is a public name of the lower one)"
    assert KNOWN_CYCLES - found == set(), "gone: remove them from KNOWN_CYCLES"


def test_no_module_imports_another_modules_private_name():
    found = private_imports(PACKAGE)
    assert found - KNOWN_PRIVATE_IMPORTS == set(), "make the name public in the lower module"
    assert KNOWN_PRIVATE_IMPORTS - found == set(), "gone: remove them from KNOWN_PRIVATE_IMPORTS"


def test_every_package_under_src_is_installed_and_the_strategies_map_to_the_fuzz_package():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {"weight_sync_bench" + ("." + module_name(p, PACKAGE) if p.parent != PACKAGE else "")
             for p in PACKAGE.rglob("__init__.py")}
    assert found | {"weight_sync_bench.fuzz.strategies"} == listed
    assert config["package-dir"]["weight_sync_bench.fuzz.strategies"] == "strategies"
    assert not any(p.startswith("strategies") for p in listed)  # no top-level `strategies`


def test_every_package_is_a_layer():
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages <= set(LAYERS), packages - set(LAYERS)


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    """A package laid out like the real one, with nothing wrong in it yet."""
    pkg = tmp_path / "weight_sync_bench"
    for sub in ("layout", "model", "check", "cli", "fuzz"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from weight_sync_bench.cli.main import main\n")
    (pkg / "errors.py").write_text("class WsbError(Exception): ...\n")
    (pkg / "layout" / "table.py").write_text("from weight_sync_bench.errors import WsbError\n")
    (pkg / "model" / "plan.py").write_text("from weight_sync_bench.layout.table import x\n")
    (pkg / "check" / "checker.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from weight_sync_bench.model.plan import y\n")
    (pkg / "fuzz" / "runner.py").write_text("from weight_sync_bench.fuzz.strategies import z\n")
    (pkg / "cli" / "main.py").write_text("from weight_sync_bench.check import checker\n"
                                         "def main():\n    print('ok')\n")
    return pkg


def test_a_clean_synthetic_package_has_no_violation(fake: Path):
    assert import_violations(fake) == [] and print_violations(fake) == []
    assert package_cycles(fake) == set() and private_imports(fake) == set()


@pytest.mark.parametrize(("module", "source", "expected"), [
    # an upward import, hidden in a function body
    ("layout/reshard.py", "def f():\n    from weight_sync_bench.model.plan import layout_for\n",
     "layout is below model"),
    # an upward import only for type checking still couples the layers
    ("model/config.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                        "    from weight_sync_bench.check.checker import Verdict\n",
     "model is below check"),
    # `from weight_sync_bench import cli` names a submodule
    ("check/diagnosis.py", "from weight_sync_bench import cli\n", "check is below cli"),
    # the fuzz layer's own core (the corpus) reaching for the Hypothesis strategies
    ("fuzz/corpus.py", "from weight_sync_bench.fuzz.strategies import geometries\n",
     "only the fuzz front end uses the strategies"),
    # an always-importable module that imports a layer would make the layers a cycle
    ("errors.py", "from weight_sync_bench.layout.table import LayoutTable\n",
     "errors must import no layer"),
])
def test_each_kind_of_import_violation_is_reported(fake: Path, module, source, expected):
    (fake / module).write_text(source)
    found = import_violations(fake)
    assert len(found) == 1 and expected in found[0], found


@pytest.mark.parametrize("source", [
    "def report(x):\n    print(x)\n",
    "import sys\ndef report(x):\n    sys.stderr.write(x)\n",
    "from pprint import pprint\npprint({})\n",
])
def test_a_print_outside_the_cli_is_reported(fake: Path, source):
    (fake / "check" / "checker.py").write_text(source)
    assert len(print_violations(fake)) == 1



@pytest.mark.parametrize("a, b", [
    # two modules importing each other at the top
    ("from weight_sync_bench.check.b import g\n", "from weight_sync_bench.check.a import f\n"),
    # one side hidden in a function body: still a cycle
    ("from weight_sync_bench.check.b import g\n",
     "def g():\n    from weight_sync_bench.check.a import f\n    return f\n"),
    # one side only for type checking, and `from package import module`
    ("from weight_sync_bench.check import b\n",
     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
     "    from weight_sync_bench.check.a import f\n"),
])
def test_an_import_cycle_inside_a_package_is_reported(fake: Path, a, b):
    (fake / "check" / "a.py").write_text(a + "def f(): ...\n")
    (fake / "check" / "b.py").write_text(b + "def g(): ...\n")
    assert package_cycles(fake) == {("check.a", "check.b")}
    assert import_violations(fake) == []  # the layer rule alone does not see it


def test_a_three_module_cycle_is_one_cycle_and_a_packages_init_re_exporting_is_none(fake: Path):
    for me, other in (("a", "b"), ("b", "c"), ("c", "a")):
        (fake / "check" / f"{me}.py").write_text(f"from weight_sync_bench.check.{other} import x\n")
    assert package_cycles(fake) == {("check.a", "check.b", "check.c")}
    (fake / "check" / "c.py").write_text("x = 1\n")
    (fake / "check" / "__init__.py").write_text("from weight_sync_bench.check.a import x\n")
    assert package_cycles(fake) == set()


@pytest.mark.parametrize("source, expected", [
    ("from weight_sync_bench.layout.table import _helper\n",
     "check.checker imports _helper from layout.table"),
    # a private name of a sibling module, imported inside a function
    ("def f():\n    from weight_sync_bench.check.diagnosis import _slab\n",
     "check.checker imports _slab from check.diagnosis"),
])
def test_a_private_name_imported_from_another_module_is_reported(fake: Path, source, expected):
    (fake / "check" / "diagnosis.py").write_text("_slab = 1\n")
    (fake / "check" / "checker.py").write_text(source)
    assert private_imports(fake) == {expected}


def test_public_names_dunders_and_private_submodules_are_not_private_imports(fake: Path):
    (fake / "check" / "_internal.py").write_text("x = 1\n")
    (fake / "check" / "checker.py").write_text(
        "from weight_sync_bench.layout.table import helper\n"
        "from weight_sync_bench.layout.table import __version__\n"
        "from weight_sync_bench.check import _internal\n")
    assert private_imports(fake) == set()
