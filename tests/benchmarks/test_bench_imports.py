"""Every benchmark script imports: a name moved in the library fails here, not on the next person to run it."""

import importlib
import sys

import pytest
from trak_fixtures import REPO_ROOT

BENCH = REPO_ROOT / "benchmarks"


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCH.glob("*.py")))
def test_benchmark_module_imports(name, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    module = importlib.import_module(name)
    assert module.__doc__, f"benchmarks/{name}.py says what it measures in its docstring"
    assert sys.modules[name] is module
