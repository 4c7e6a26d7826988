"""The store contract (trak_core.testing.check_store) on the Zarr store, local and in memory; the check fails on
a store that breaks it."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from trak_core.store import TrakStore
from trak_core.testing import StoreCase, check_store, parametrize_with_checks, store_checks


def _local(tmp_path):
    return lambda meta: TrakStore.create_or_open(str(tmp_path / uuid.uuid4().hex), meta)


def test_zarr_store_passes_the_contract(tmp_path):
    check_store(_local(tmp_path))


def _in_memory(meta):
    return TrakStore.create_or_open(f"memory://{uuid.uuid4().hex}", meta)


@parametrize_with_checks([StoreCase(_in_memory, id="zarr-memory")])
def test_zarr_store_in_memory_passes_each_check(obj, check):
    check(obj)


def test_store_checks_are_named_and_listed():
    names = [c.__name__ for c in store_checks()]
    assert names == [
        "check_store_protocol",
        "check_store_train_rows",
        "check_store_inverse",
        "check_store_experiment",
        "check_store_scores",
        "check_store_rows_by_path",
        "check_store_partials",
        "check_store_factor_arrays",
        "check_store_score_pieces",
        "check_store_grow",
    ]


def test_the_contract_fails_a_store_that_loses_flags(tmp_path):
    class Forgetful(TrakStore):
        def featurized_mask(self, model_id: int) -> np.ndarray:
            return np.zeros(self.meta.train_set_size, dtype=bool)

    def make(meta):
        st = TrakStore.create_or_open(str(tmp_path / uuid.uuid4().hex), meta)
        return Forgetful(st.location, st.root, st.meta)

    with pytest.raises(AssertionError, match="^check_store_train_rows: featurized_mask"):
        check_store(make)


def test_the_contract_fails_a_store_that_keeps_old_factor_arrays(tmp_path):
    class Merging(TrakStore):
        def write_factor_arrays(self, model_id: int, arrays: dict, record: dict) -> None:
            super().write_factor_arrays(model_id, {**self.read_factor_arrays(model_id), **arrays}, record)

    def make(meta):
        st = TrakStore.create_or_open(str(tmp_path / uuid.uuid4().hex), meta)
        return Merging(st.location, st.root, st.meta)

    with pytest.raises(AssertionError, match="^check_store_factor_arrays: a second write does not replace"):
        check_store(make, checks=[store_checks()[7]])


def test_the_contract_fails_a_store_that_shares_one_factor_record(tmp_path):
    """A store keeping one record for every model (tasks of two checkpoints would then write the same object)."""

    class Shared(TrakStore):
        def write_factor_arrays(self, model_id: int, arrays: dict, record: dict) -> None:
            super().write_factor_arrays(model_id, arrays, record)
            self.root.attrs["one_factor_record"] = dict(record)

        def read_factor_record(self, model_id: int):
            return None if super().read_factor_record(model_id) is None else self.root.attrs["one_factor_record"]

    def make(meta):
        st = TrakStore.create_or_open(str(tmp_path / uuid.uuid4().hex), meta)
        return Shared(st.location, st.root, st.meta)

    with pytest.raises(AssertionError, match="^check_store_factor_arrays: the record reads otherwise"):
        check_store(make, checks=[store_checks()[7]])


def test_store_package_modules_import_one_way_and_stay_small():
    """No import circle among trak_core.store's modules (function-local imports included); each < 800 lines."""
    import ast
    from pathlib import Path

    import trak_core.store as pkg

    root = Path(pkg.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in root.glob("*.py"):
        text = path.read_text()
        assert len(text.splitlines()) < 800, path
        deps = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module} if node.module else {a.name for a in node.names}
        graph[path.stem] = {d.split(".")[0] for d in deps} - {path.stem}
    graph["__init__"] = set()  # the package's own re-exports; no module imports it (relative level 1 only)
    state: dict[str, int] = {}

    def visit(n: str, trail: list[str]) -> None:
        state[n] = 1
        for d in sorted(graph.get(n, ())):
            assert state.get(d) != 1, f"import circle: {' -> '.join([*trail, n, d])}"
            if d not in state:
                visit(d, [*trail, n])
        state[n] = 2

    for n in graph:
        if n not in state:
            visit(n, [])
    assert "zarr_store" in graph["verify"] and "schema" in graph["arrays"]


def test_the_contract_fails_a_store_that_returns_unfinished_scores(tmp_path):
    class Hasty(TrakStore):
        def scores(self, exp_name: str):
            return self.experiment(exp_name).scores

    def make(meta):
        st = TrakStore.create_or_open(str(tmp_path / uuid.uuid4().hex), meta)
        return Hasty(st.location, st.root, st.meta)

    check_store(make, checks=[c for c in store_checks() if c.__name__ != "check_store_scores"])  # the others pass
    with pytest.raises(AssertionError, match="^check_store_scores: scores\\(\\) returned while rows were not done"):
        check_store(make)


def test_only_the_store_package_names_the_zarr_class():
    """The engine, reduce, streaming, the index, selection and compat talk to the store protocols: no module of
    trak_core outside trak_core/store/ (its ``__init__`` and ``testing`` aside) names ``TrakStore``."""
    import re
    from pathlib import Path

    import trak_core

    root = Path(trak_core.__file__).parent
    naming = sorted(
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if path.relative_to(root).parts[0] != "store"
        and path.relative_to(root).as_posix() not in ("__init__.py", "testing.py")
        and re.search(r"\bTrakStore\b", path.read_text())
    )
    assert naming == []


def test_only_the_store_package_imports_zarr():
    """The algorithm reads and writes rows through the protocol's methods (rows by array path): no module of
    trak_core outside trak_core/store/ imports zarr or reaches for a store's Zarr arrays."""
    import ast
    import re
    from pathlib import Path

    import trak_core

    root = Path(trak_core.__file__).parent
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if rel.parts[0] == "store":
            continue
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [f"{rel}: imports {n}" for n in names if n.split(".")[0] == "zarr"]
        found += [f"{rel}: {m.group(0)}" for m in re.finditer(r"\.(oindex|score_rows_writer|target_grads)\b", text)]
    assert found == []
