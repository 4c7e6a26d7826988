"""TRAKer is an adapter over the engine: compat/traker.py reaches the core only through the engine, the errors and the
API types that traker's signatures take (gradient computers, model outputs, projectors), and starts no thread of its
own (no threading / concurrent import). Read from its import statements; the checker is also run on planted sources
it must refuse."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRAKER = REPO / "trak_core" / "compat" / "traker.py"

#: the core modules TRAKer may import (compat's own modules aside)
ALLOWED = {
    "trak_core.engine",
    "trak_core.errors",
    "trak_core.featurize.gradients",
    "trak_core.featurize.modelout",
    "trak_core.projection.projectors",
}
#: standard modules that would start or manage threads
THREADS = {"threading", "_thread", "concurrent"}


def imported_modules(source: str, module: str = "trak_core.compat.traker") -> set[str]:
    """Every module ``source`` (the text of ``module``) imports, absolute, function-local imports too; ``from P import
    n`` names ``P.n`` where that is a module of the repository, else ``P``."""
    package = module.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] if node.level else [])
            src = ".".join(p for p in (base, node.module or "") if p)
            for a in node.names:
                sub = f"{src}.{a.name}"
                path = REPO.joinpath(*sub.split("."))
                out.add(sub if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file() else src)
    return out


def refused(modules: set[str]) -> list[str]:
    """The imports of ``modules`` an adapter may not have: a core module outside :data:`ALLOWED` (and outside
    compat), or a threading module."""
    bad = []
    for m in sorted(modules):
        top = m.split(".")[0]
        if top in THREADS:
            bad.append(f"{m} (a thread)")
        elif top == "trak_core" and m not in ALLOWED and not m.startswith("trak_core.compat."):
            bad.append(f"{m} (a core module besides the engine)")
    return bad


def test_traker_imports_the_core_only_through_the_engine():
    modules = imported_modules(TRAKER.read_text())
    assert not refused(modules), refused(modules)
    core = {m for m in modules if m.startswith("trak_core") and not m.startswith("trak_core.compat.")}
    assert "trak_core.engine" in core  # (the parse finds the imports at all)
    assert core <= ALLOWED, sorted(core - ALLOWED)


@pytest.mark.parametrize(
    "line, named",
    [
        ("from trak_core import plan", "trak_core.plan"),
        ("from trak_core.solve import kfac", "trak_core.solve.kfac"),
        ("from ..plan import check_batch", "trak_core.plan"),
        ("from ..store.writer import ShardWriter", "trak_core.store.writer"),
        ("import trak_core.projection.energy", "trak_core.projection.energy"),
        ("from concurrent.futures import ThreadPoolExecutor", "concurrent.futures"),
        ("def f():\n    import threading", "threading"),
    ],
)
def test_the_import_check_can_fail(line, named):
    """A planted import of another core module or of a thread module is named."""
    found = refused(imported_modules(f"from trak_core import engine\n{line}\n"))
    assert [b.split(" ")[0] for b in found] == [named], found


def test_the_import_check_passes_compat_and_the_api_types():
    source = (
        "from trak_core import engine\nfrom ..errors import BadInputError\nfrom .savers import check_saver\n"
        "from trak_core.projection.projectors import make_projector\nimport atexit\n"
    )
    assert refused(imported_modules(source)) == []
