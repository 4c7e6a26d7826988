"""Every benchmark script imports (a name moved in the library fails here, not on the next person to run it), the
scripts import each other without a circle, and benchmarks/ holds scripts and results tables, not raw logs."""

import ast
import importlib
import sys

import pytest
from trak_fixtures import REPO_ROOT

BENCH = REPO_ROOT / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__main__")


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_module_imports(name, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    module = importlib.import_module(name)
    assert module.__doc__, f"benchmarks/{name}.py says what it measures in its docstring"
    assert sys.modules[name] is module


def imports_of(name: str) -> set[str]:
    """The benchmark scripts that benchmarks/<name>.py imports (at any depth of its code)."""
    tree = ast.parse((BENCH / f"{name}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[-1] if a.name.startswith("benchmarks.") else a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.split(".")[-1] if node.module.startswith("benchmarks.") else node.module)
    return (found & set(SCRIPTS)) - {name}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A path that returns to its start in the graph, or None."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [node])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [])):
            return found
    return None


def test_cycle_finds_a_circle():
    assert cycle({"a": {"b"}, "b": {"a"}}) is not None
    assert cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_benchmark_scripts_import_each_other_without_a_circle():
    graph = {name: imports_of(name) for name in SCRIPTS}
    assert "bench_models" in graph["featurize_bench"]  # the models live in one place, used from there
    assert cycle(graph) is None, cycle(graph)


def test_benchmarks_hold_no_raw_logs():
    """Scripts, RESULTS.md and the results tables it cites; raw reports and before/after files stay in git history."""
    entries = {p.name for p in BENCH.iterdir() if p.name != "__pycache__"}
    assert not [p for p in BENCH.iterdir() if p.is_dir() and p.name != "__pycache__"]
    assert not [n for n in entries if n.endswith((".log", ".txt", ".json"))]
    results = (BENCH / "RESULTS.md").read_text()
    assert all(n in results for n in entries if n.endswith(".md") and n != "RESULTS.md")


def test_benchmarks_stay_a_small_suite():
    lines = sum(len(p.read_text().splitlines()) for p in BENCH.glob("*.py"))
    assert lines <= 4000, f"benchmarks/ has {lines} lines of Python"
