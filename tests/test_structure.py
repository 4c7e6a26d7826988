"""The layout's rules, checked on the source (every import, function-local ones included):
trak_core imports neither Prefect nor the pipeline nor cuda_ext, the top-level packages import each other
without a cycle, the modules inside each package too, the core never imports its traker adapter
(trak_core.compat, nor does a fresh interpreter that imports the core, the pipeline or the index load it), no
production file is over MAX_LINES lines or cites an issue number, and no production
module reads a test hook. Each checker is also run on a planted case it must catch."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("trak_core", "tasks", "flows", "cuda_ext", "deployments", "trakflow_cli", "trakflow_demo_data")


def imported_packages(package: str) -> dict[str, set[str]]:
    """{module file: top-level names it imports}, every import statement of the package's source."""
    out = {}
    for path in sorted((REPO / package).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        out[str(path.relative_to(REPO))] = names
    return out


def package_graph() -> dict[str, set[str]]:
    return {
        p: {n for names in imported_packages(p).values() for n in names if n in PACKAGES and n != p} for p in PACKAGES
    }


def test_trak_core_imports_no_pipeline_prefect_or_cuda_ext():
    for module, names in imported_packages("trak_core").items():
        bad = names & {"prefect", "prefect_dask", *PACKAGES} - {"trak_core"}
        assert not bad, f"{module} imports {sorted(bad)}"


def test_no_import_cycle_between_top_level_packages():
    graph = package_graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError(f"import cycle: {' -> '.join([*path, node, nxt])}")
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for p in PACKAGES:
        if p not in state:
            visit(p, [])


def test_the_cycle_check_can_fail(monkeypatch):
    """The checker itself finds a planted cycle."""
    planted = {p: set() for p in PACKAGES}
    planted["trak_core"] = {"tasks"}
    planted["tasks"] = {"trak_core"}
    monkeypatch.setitem(globals(), "package_graph", lambda: planted)
    with pytest.raises(AssertionError, match="import cycle"):
        test_no_import_cycle_between_top_level_packages()


def test_no_test_hook_in_production_code():
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            text = path.read_text()
            assert "TRAKFLOW_TEST" not in text, f"{path} reads a test hook"


# ---------------------------------------------------------------------------- what the installed package ships
def packaged(pyproject: dict) -> set[str]:
    """The top-level packages that the wheel ships (setuptools' find with pyproject.toml's include patterns)."""
    from setuptools import find_packages

    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    return {p.split(".")[0] for p in find_packages(str(REPO), include=include)}


def unshipped_imports(shipped: set[str]) -> list[str]:
    """'module imports X' for each import, in a shipped package, of a top-level package of this repository that
    the wheel does not ship (an installed trakflow would fail on it, e.g. the CLI's demo importing examples/)."""
    local = {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()}
    return [
        f"{module} imports {name}"
        for package in sorted(shipped)
        for module, names in imported_packages(package).items()
        for name in sorted(names & local - shipped)
    ]


def test_the_package_ships_every_repository_package_it_imports():
    """The CLI, the flows and the deployments run the embedded default (trakflow_demo_data): the wheel ships it,
    and no shipped module imports a folder of the checkout that the wheel leaves out (examples/, benchmarks/)."""
    import tomllib

    shipped = packaged(tomllib.loads((REPO / "pyproject.toml").read_text()))
    assert set(PACKAGES) <= shipped, sorted(set(PACKAGES) - shipped)
    assert "examples" not in shipped and "tests" not in shipped and "benchmarks" not in shipped
    assert not unshipped_imports(shipped), unshipped_imports(shipped)


def test_the_shipping_check_can_fail():
    """Without trakflow_demo_data in the wheel, the CLI's, the flows' and the deployments' imports of it are named."""
    found = unshipped_imports(set(PACKAGES) - {"trakflow_demo_data"})
    assert any(f.startswith("trakflow_cli/main.py imports trakflow_demo_data") for f in found), found
    assert any(f.startswith("flows/demo.py imports trakflow_demo_data") for f in found), found
    assert any(f.startswith("deployments/serve.py imports trakflow_demo_data") for f in found), found


# ---------------------------------------------------------------------------- modules inside a package
MAX_LINES = 800


def production_files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph(root: Path, package: str, skip: set[str] = frozenset()) -> dict[str, set[str]]:
    """{module: modules of the same package it imports}, from every import statement (function-local ones
    too). ``from X import a`` names module X.a when that is a module of the package, else module X (a name
    defined in X, a package's ``__init__`` included); relative imports resolve against the importing module."""
    files = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        deps: set[str] = set()
        if str(path.relative_to(root)) not in skip:
            base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    deps |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom):
                    if node.level:
                        parent = base[: len(base) - (node.level - 1)]
                        src = ".".join(parent + ([node.module] if node.module else []))
                    else:
                        src = node.module or ""
                    deps |= {f"{src}.{a.name}" if f"{src}.{a.name}" in files else src for a in node.names}
        graph[mod] = set()
        for dep in deps:  # the longest module of the package that the dotted name starts with
            parts = dep.split(".")
            for i in range(len(parts), 0, -1):
                candidate = ".".join(parts[:i])
                if candidate in files:
                    if candidate != mod:
                        graph[mod].add(candidate)
                    break
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_among_the_modules_of_a_package(package):
    cycle = find_cycle(module_graph(REPO, package))
    assert cycle is None, f"import cycle in {package}: {' -> '.join(cycle)}"


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    "files",
    [
        # a bottom-of-file import, as a circle is usually hidden
        {"pkg/__init__.py": "", "pkg/a.py": "from .b import f\n", "pkg/b.py": "def f():\n    pass\nfrom .a import g\n"},
        # a function-local import
        {"pkg/__init__.py": "", "pkg/a.py": "import pkg.b\n", "pkg/b.py": "def f():\n    from pkg import a\n"},
        # through the package's __init__: a module reading a name the __init__ defines
        {"pkg/__init__.py": "from .a import x\nVERSION = 1\n", "pkg/a.py": "from . import VERSION\nx = 1\n"},
        # a subpackage two levels up
        {
            "pkg/__init__.py": "",
            "pkg/c.py": "from .sub.d import y\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/d.py": "from ..c import z\ny = 1\n",
        },
    ],
)
def test_the_module_cycle_check_can_fail(tmp_path, files):
    assert find_cycle(module_graph(_plant(tmp_path, files), "pkg")) is not None


def test_the_module_cycle_check_accepts_a_one_way_package(tmp_path):
    """``from . import sub`` names the submodule, not the package: no cycle with an __init__ that imports it."""
    root = _plant(
        tmp_path,
        {"pkg/__init__.py": "from .a import x\n", "pkg/a.py": "from . import b\nx = b.y\n", "pkg/b.py": "y = 1\n"},
    )
    assert module_graph(root, "pkg") == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": set()}
    assert find_cycle(module_graph(root, "pkg")) is None


def test_the_core_never_imports_its_traker_adapter():
    """Only the adapter's own modules import trak_core.compat (trak_core's __init__ resolves its names lazily)."""
    graph = module_graph(REPO, "trak_core")
    bad = [
        mod
        for mod, deps in graph.items()
        if not mod.startswith("trak_core.compat") and any(d.startswith("trak_core.compat") for d in deps)
    ]
    assert not bad, f"core modules import the adapter: {bad}"


# ---------------------------------------------------------------------------- what an import loads
#: imports every module of the packages named in argv[1:] (a module alone when it is not a package; the adapter's own
#: modules aside), in order, and prints each one that brought trak_core.compat (the traker adapter, whose import
#: registers an exit hook) in
ADAPTER_PROBE = """
import importlib, pkgutil, sys
def loaded():
    return any(m == "trak_core.compat" or m.startswith("trak_core.compat.") for m in sys.modules)
def load(name):
    before = loaded()
    module = importlib.import_module(name)
    if loaded() and not before:
        print("ADAPTER", name)
    return module
for root in sys.argv[1:]:
    package = load(root)
    for info in pkgutil.walk_packages(getattr(package, "__path__", []), root + "."):
        if not info.name.startswith("trak_core.compat"):
            load(info.name)
print("DONE")
"""


def modules_loading_the_adapter(roots: list[str], tmp_path: Path) -> list[str]:
    """The modules (of the packages ``roots``) whose import, in a fresh interpreter, imports trak_core.compat."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    out = subprocess.run(
        [sys.executable, "-c", ADAPTER_PROBE, *roots],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and "DONE" in out.stdout, out.stderr[-3000:]
    return [line.split()[1] for line in out.stdout.splitlines() if line.startswith("ADAPTER ")]


def test_importing_the_core_the_pipeline_or_the_index_leaves_the_adapter_out(tmp_path):
    """``import trak_core.engine`` (what every Prefect task imports), the pipeline's packages, the index and the
    CLI do not import trak_core.compat (nor run its import-time exit hook registration); ``trak_core.TRAKer`` is
    resolved from it on first use."""
    roots = ["trak_core", "trak_core.engine", "trak_core.scoring.index", "trak_core.testing", "tasks", "flows"]
    roots += ["trakflow_cli.main", "deployments.serve"]
    assert modules_loading_the_adapter(roots, tmp_path) == []


def test_the_adapter_check_can_fail_and_trak_core_names_resolve_lazily(tmp_path):
    """The probe names the first module that imports the adapter; ``from trak_core import TRAKer`` still works."""
    assert modules_loading_the_adapter(["trak_core.engine", "trak_core.compat.alias"], tmp_path) == [
        "trak_core.compat.alias"
    ]
    import trak_core
    from trak_core.compat import errors, projectors, traker

    assert trak_core.TRAKer is traker.TRAKer and trak_core.ModelIDException is errors.ModelIDException
    assert trak_core.BasicProjector is projectors.BasicProjector
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        trak_core.NoSuchName  # noqa: B018


# ---------------------------------------------------------------------------- file size, issue numbers
def too_long(paths: list[Path], limit: int = MAX_LINES) -> list[str]:
    return [f"{p}: {n} lines" for p in paths if (n := len(p.read_text().splitlines())) > limit]


#: "issue 12", "issues 3 and 4", "#27" (a number after '#' that is not a colour or a comment's spacing)
ISSUE_NUMBER = re.compile(r"\bissues? \d+|(?<![\w&#])#\d+\b", re.IGNORECASE)


def issue_numbers(paths: list[Path]) -> list[str]:
    return [
        f"{p}:{i}: {line.strip()}"
        for p in paths
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if ISSUE_NUMBER.search(line)
    ]


def test_no_production_file_over_the_line_limit():
    files = production_files()
    assert not too_long(files), too_long(files)


def test_no_issue_numbers_in_production_code():
    files = production_files()
    found = issue_numbers(files)
    assert not found, "\n".join(found)


def test_no_issue_numbers_in_tests_benchmarks_or_examples():
    """The same for the tests (but the two checkers, which plant citations on purpose), benchmarks and examples."""
    checkers = {REPO / "tests" / "test_structure.py", REPO / "tests" / "test_docs.py"}
    files = [
        p for d in ("tests", "benchmarks", "examples") for p in sorted((REPO / d).rglob("*.py")) if p not in checkers
    ]
    found = issue_numbers(files)
    assert not found, "\n".join(found)


def test_the_size_and_issue_checks_can_fail(tmp_path):
    long = tmp_path / "long.py"
    long.write_text("x = 1\n" * (MAX_LINES + 1))
    short = tmp_path / "short.py"
    short.write_text("x = 1\n" * MAX_LINES)
    assert too_long([long, short]) == [f"{long}: {MAX_LINES + 1} lines"]
    cites = tmp_path / "cites.py"
    cites.write_text('"""Fixed in issue 12."""\n# see #27\nx = 1  # issues 3\ncolour = "#fff"\n')
    assert [line.split(":")[1] for line in issue_numbers([cites])] == ["1", "2", "3"]


def test_tests_mirror_the_source_tree():
    """A test lives in the folder of what it tests (tests/trak_core/..., tests/pipeline/, tests/cli/, ...); only
    the repository-wide checks stay at the top."""
    stages = {
        f"trak_core/{p.parent.name}" for p in (REPO / "trak_core").glob("*/__init__.py") if p.parent.name != "compat"
    }
    folders = {"trak_core", *stages, "compat", "pipeline", "cli", "cuda_ext", "benchmarks"}
    tests = REPO / "tests"
    top = sorted(p.name for p in tests.glob("test_*.py"))
    assert top == ["test_docs.py", "test_structure.py"], top
    for path in tests.rglob("test_*.py"):
        folder = str(path.parent.relative_to(tests))
        assert folder == "." or folder in folders, f"{path}: tests/{folder} mirrors no part of the source tree"
    names = [p.name for p in tests.rglob("test_*.py")]
    assert len(names) == len(set(names)), "two test files share a name (pytest imports them by basename)"
