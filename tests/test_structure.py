"""The layout's rules, checked on the source (every import, function-local ones included):
trak_core imports neither Prefect nor the pipeline nor cuda_ext, the top-level packages import each other
without a cycle, and no production module reads a test hook."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("trak_core", "tasks", "flows", "cuda_ext", "deployments", "trakflow_cli")


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
        bad = names & {"prefect", "prefect_dask", "tasks", "flows", "cuda_ext", "deployments", "trakflow_cli"}
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
    import pytest

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
