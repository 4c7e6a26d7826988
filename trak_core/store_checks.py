"""The store contract suite (as scikit-learn's ``check_estimator``): :func:`check_store` runs every named check
on a backend, :func:`store_checks` lists them, and :class:`StoreCase` hands one to
:func:`trak_core.testing.parametrize_with_checks`. A backend implements :class:`~trak_core.store.RunStore`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .checks import _check


@dataclass
class StoreCase:
    """A store backend to check: ``make_store(meta)`` returns a new, empty store for a
    :class:`~trak_core.store.StoreMetadata` on every call (each check builds its own)."""

    make_store: Callable[[Any], Any]
    id: str | None = None
    marks: Any = ()

    @property
    def name(self) -> str:
        return self.id or getattr(self.make_store, "__name__", "store").replace("<lambda>", "store")


_N, _P, _M = 24, 6, 5  # train rows, projected dim, targets of the stores the checks build


def _as_store_case(obj) -> StoreCase:
    if isinstance(obj, StoreCase):
        return obj
    if callable(obj):
        return StoreCase(obj)
    raise TypeError(f"store checks take a StoreCase or a make_store(meta) callable, got {type(obj).__name__}")


def _new_store(obj):
    """(store, meta, train gradients x (n, p) float32, Q (n,) float32): a fresh store of 3 shards of 8 rows."""
    import numpy as np

    from .store import StoreMetadata

    meta = StoreMetadata(train_set_size=_N, grad_dim=40, proj_dim=_P, dtype="float32", chunk_rows=4, shard_rows=8)
    rng = np.random.default_rng(0)
    x, q = rng.standard_normal((_N, _P)).astype(np.float32), rng.random(_N).astype(np.float32)
    return _as_store_case(obj).make_store(meta), meta, x, q


def _finalize(st, meta, x):
    """Write every shard's XᵀX and the inverse of model 0 (after its rows); returns the float64 inverse."""
    import numpy as np

    for s in range(meta.num_shards):
        xs = x[8 * s : 8 * (s + 1)].astype(np.float64)
        st.write_partial(0, s, xs.T @ xs, np.zeros(_P + 3))
    a = np.linalg.inv(x.T.astype(np.float64) @ x + np.eye(_P))
    st.write_inverse(0, a)
    st.set_finalize_info(0, {"lambda_reg": 1.0})
    return a


@_check
def check_store_protocol(obj) -> None:
    """The store implements :class:`~trak_core.store.RunStore` and keeps the metadata it was made for."""
    from .store import RunStore

    st, meta, _, _ = _new_store(obj)
    assert isinstance(st, RunStore), f"{type(st).__name__} lacks methods of RunStore"
    assert st.meta.model_dump(exclude={"versions"}) == meta.model_dump(exclude={"versions"}), "meta differs"


@_check
def check_store_train_rows(obj) -> None:
    """Train rows (a slice or indices) read back as written and their flags follow them; init_model is
    idempotent."""
    import numpy as np

    st, meta, x, q = _new_store(obj)
    st.init_model(0)
    st.init_model(0)  # idempotent
    assert not st.featurized_mask(0).any(), "a new model has rows marked written"
    st.write_train_rows(0, slice(0, 8), x[:8], q[:8])
    st.write_train_rows(0, np.arange(12, 16), x[12:16], q[12:16])
    want = np.zeros(meta.train_set_size, dtype=bool)
    want[:8] = want[12:16] = True
    assert np.array_equal(st.featurized_mask(0), want), "featurized_mask is not the rows written"
    g, qq = st.read_train_rows(0, 2, 8)  # written rows only: a read of rows never written may be refused
    g2, qq2 = st.read_train_rows(0, 12, 14)
    same = np.array_equal(g, x[2:8]) and np.array_equal(g2, x[12:14])
    assert same and np.array_equal(qq, q[2:8]) and np.array_equal(qq2, q[12:14]), "rows read back differ"


@_check
def check_store_inverse(obj) -> None:
    """The inverse of an unfinalized model is refused (StateError); once written and the model finalized, it
    reads back as float32(A)."""
    import numpy as np

    from .errors import StateError

    st, meta, x, q = _new_store(obj)
    st.init_model(0)
    st.write_train_rows(0, slice(0, meta.train_set_size), x, q)
    try:
        st.inverse(0)
    except StateError:
        pass
    else:
        raise AssertionError("inverse() of an unfinalized model returned")
    a = _finalize(st, meta, x)
    assert st.is_finalized(0), "is_finalized is False after set_finalize_info"
    assert np.array_equal(st.inverse(0), a.astype(np.float32)), "the inverse reads back other than float32(A)"


@_check
def check_store_experiment(obj) -> None:
    """An experiment reopened with another number of targets is refused (StoreMismatchError); target rows
    read back as written once every one asked for is written (None before)."""
    import numpy as np

    from .errors import StoreMismatchError

    st, _, x, _ = _new_store(obj)
    st.init_model(0)
    st.init_experiment("e", _M)
    st.init_experiment("e", _M)  # the same again: accepted
    try:
        st.init_experiment("e", _M + 1)
    except StoreMismatchError:
        pass
    else:
        raise AssertionError("an experiment reopened with another num_targets was accepted")
    assert st.num_targets("e") == _M, f"num_targets is {st.num_targets('e')}, not {_M}"
    st.init_experiment_model("e", 0)
    st.write_target_rows("e", 0, slice(0, 2), x[:2])
    everyone = np.arange(_M)
    assert st.stored_target_rows("e", 0, everyone) is None, "stored_target_rows returned unwritten rows"
    assert not st.targets_complete("e", 0), "targets_complete with rows unwritten"
    st.write_target_rows("e", 0, slice(2, _M), x[2:_M])
    assert st.targets_complete("e", 0), "targets_complete is False with every row written"
    got = st.stored_target_rows("e", 0, everyone)
    assert got is not None and np.array_equal(np.asarray(got), x[:_M]), "target rows read back differ"


@_check
def check_store_scores(obj) -> None:
    """Scores are refused (StateError) while some rows are not done and read back as written once all are."""
    import numpy as np

    from .errors import StateError

    st, meta, x, q = _new_store(obj)
    st.init_model(0)
    st.write_train_rows(0, slice(0, meta.train_set_size), x, q)
    _finalize(st, meta, x)
    st.init_experiment("e", _M)
    st.init_experiment_model("e", 0)
    st.write_target_rows("e", 0, slice(0, _M), x[:_M])
    scores = np.random.default_rng(1).standard_normal((meta.train_set_size, _M)).astype(np.float32)
    st.begin_scores("e", [0])
    st.write_score_rows("e", 0, 8, scores[:8])
    try:
        st.scores("e")
    except StateError:
        pass
    else:
        raise AssertionError("scores() returned while rows were not done")
    st.write_score_rows("e", 8, meta.train_set_size, scores[8:])
    assert np.array_equal(np.asarray(st.scores("e")[:]), scores), "scores read back differ"


@_check
def check_store_rows_by_path(obj) -> None:
    """Rows of any array read back by path as written (a slice, sorted indices, into a caller's buffer); the
    presence check passes for written rows; an unknown path or model is refused (BadInputError)."""
    import numpy as np

    from .errors import BadInputError
    from .store import model_array

    st, meta, x, q = _new_store(obj)
    st.init_model(0)
    st.write_train_rows(0, slice(0, 12), x[:12], q[:12])
    grads = model_array(0, "grads")
    assert np.array_equal(st.read_rows(grads, slice(2, 9)), x[2:9]), "read_rows of a slice differs"
    assert np.array_equal(st.read_rows(grads, np.array([1, 4, 11])), x[[1, 4, 11]]), "read_rows of indices differs"
    buf = np.full((4, _P), np.nan, dtype=np.float32)
    got = st.read_rows(grads, slice(4, 8), buf)
    assert got is buf and np.array_equal(buf, x[4:8]), "read_rows into a buffer differs"
    assert np.array_equal(st.read_rows(model_array(0, "out_to_loss"), slice(0, 12)), q[:12]), "Q read back differs"
    flags = st.read_rows(model_array(0, "featurized"), slice(None))
    assert np.array_equal(flags.astype(bool), np.arange(meta.train_set_size) < 12), "flags read back differ"
    st.check_present([(grads, np.arange(12)), (model_array(0, "out_to_loss"), np.arange(12))])
    for bad in ("models/0/nothing", model_array(7, "grads"), "elsewhere"):
        try:
            st.read_rows(bad, slice(0, 1))
        except BadInputError:
            continue
        raise AssertionError(f"read_rows({bad!r}) was not refused")


@_check
def check_store_partials(obj) -> None:
    """A shard's partials read back packed as written; written unmarked they are not done until marked."""
    import numpy as np

    from .store import model_array, pack_upper

    st, meta, x, q = _new_store(obj)
    st.init_model(0)
    st.write_train_rows(0, slice(0, meta.train_set_size), x, q)
    xs = x[8:16].astype(np.float64)
    sums = np.arange(_P + 3, dtype=np.float64)
    st.write_partial(0, 1, xs.T @ xs, sums, mark=False)
    assert not st.partial_done(0, 1), "a partial written unmarked is done"
    st.mark_partial(0, 1)
    assert st.partial_done(0, 1) and not st.partial_done(0, 0), "partial_done is not the shard marked"
    got = st.read_rows(model_array(0, "xtx_partials"), slice(1, 2))[0]
    want = pack_upper(xs.T @ xs) if meta.packed_partials else xs.T @ xs
    assert np.array_equal(got, want), "the partial reads back other than as written (packed)"
    assert np.array_equal(st.read_rows(model_array(0, "rowsum_partials"), slice(1, 2))[0], sums), "row sums differ"


@_check
def check_store_factor_arrays(obj) -> None:
    """A model's curvature factor arrays and their record read back as written, another model's are its own, and a
    second write replaces the first whole; the pipeline record is not where they live."""
    import numpy as np

    st, _, _, _ = _new_store(obj)
    assert st.read_factor_arrays(0) == {} and st.read_factor_record(0) is None, "a model without factors has some"
    rng = np.random.default_rng(1)
    first = {"a0": rng.standard_normal((3, 3)), "s0": rng.standard_normal((2, 2))}
    st.write_factor_arrays(0, first, {"sha256": "x", "blocks": {"l": {"d_in": 2}}})
    st.write_factor_arrays(1, {"a0": np.eye(4)}, {"sha256": "y"})
    got = st.read_factor_arrays(0)
    assert set(got) == set(first) and all(np.array_equal(got[k], v) for k, v in first.items()), "arrays differ"
    assert st.read_factor_record(0) == {"sha256": "x", "blocks": {"l": {"d_in": 2}}}, "the record reads otherwise"
    assert set(st.read_factor_arrays(1)) == {"a0"} and np.array_equal(st.read_factor_arrays(1)["a0"], np.eye(4))
    assert st.read_factor_record(1) == {"sha256": "y"}, "another model's record is not its own"
    st.write_factor_arrays(0, {"a1": np.ones((1, 5))}, {"sha256": "z"})
    assert set(st.read_factor_arrays(0)) == {"a1"}, "a second write does not replace the first whole"
    assert st.read_factor_record(0) == {"sha256": "z"}, "a second write does not replace the record"
    assert st.pipeline_info() == {}, "factor arrays went into the pipeline record"
    assert st.read_factor_partial(0, 1) is None, "a shard without factor sums reads some"
    st.write_factor_partial(0, 1, first, {"examples": 8, "sites": ["a"]})
    st.write_factor_partial(0, 2, {"a0": np.eye(2)}, {"examples": 3})
    arrays, info = st.read_factor_partial(0, 1)
    assert info == {"examples": 8, "sites": ["a"]} and set(arrays) == set(first), "a shard's sums read back otherwise"
    assert all(np.array_equal(arrays[k], v) for k, v in first.items()), "a shard's sums read back otherwise"
    st.write_factor_partial(0, 1, {"s1": np.ones(3)}, {"examples": 1})
    arrays, info = st.read_factor_partial(0, 1)
    assert set(arrays) == {"s1"} and info == {"examples": 1}, "a shard's second write does not replace the first"
    assert set(st.read_factor_arrays(0)) == {"a1"}, "a shard's sums replaced the model's factors"


@_check
def check_store_score_pieces(obj) -> None:
    """Score pieces (:meth:`score_layout`: whole pieces of scores within pieces of flags) written unmarked are
    not done until marked; the flags read by path follow."""
    import numpy as np

    from .store import experiment_array

    st, meta, x, q = _new_store(obj)
    st.init_model(0)
    st.init_experiment("e", _M)
    st.begin_scores("e", [0])
    rows, done_rows = st.score_layout("e")
    assert rows > 0 and done_rows % rows == 0 and meta.rows_per_shard % done_rows == 0, "score_layout does not tile"
    scores = np.random.default_rng(2).standard_normal((meta.train_set_size, _M)).astype(np.float32)
    st.write_score_rows("e", 0, done_rows, scores[:done_rows], mark=False)
    assert not st.scores_done_mask("e").any(), "score rows written unmarked are done"
    st.mark_score_rows("e", 0, done_rows)
    want = np.arange(meta.train_set_size) < done_rows
    assert np.array_equal(st.scores_done_mask("e"), want), "scores_done_mask is not the rows marked"
    flags = st.read_rows(experiment_array("e", "scores_done"), slice(None)).astype(bool)
    assert np.array_equal(flags, want), "the flags read by path differ"
    st.write_score_rows("e", done_rows, meta.train_set_size, scores[done_rows:])
    assert np.array_equal(np.asarray(st.scores("e")[:]), scores), "scores read back differ"


@_check
def check_store_grow(obj) -> None:
    """Growing keeps the stored rows bit for bit, adds rows not written, and marks what depends on every row not
    done (the inverse, the score rows); fewer rows are refused (BadInputError)."""
    import numpy as np

    from .errors import BadInputError
    from .store import model_array

    st, meta, x, q = _new_store(obj)
    st.init_model(0)
    st.write_train_rows(0, slice(0, meta.train_set_size), x, q)
    _finalize(st, meta, x)
    st.init_experiment("e", _M)
    st.begin_scores("e", [0])
    st.write_score_rows("e", 0, meta.train_set_size, np.ones((meta.train_set_size, _M), dtype=np.float32))
    n = meta.train_set_size
    assert st.grow_train_rows(n + 4) == n, "grow_train_rows does not return the rows the store had"
    assert st.meta.train_set_size == n + 4, "the metadata does not have the new rows"
    assert np.array_equal(st.read_rows(model_array(0, "grads"), slice(0, n)), x), "stored rows changed"
    assert np.array_equal(st.featurized_mask(0), np.arange(n + 4) < n), "the new rows are not the rows unwritten"
    assert not st.is_finalized(0) and not st.scores_done_mask("e").any(), "results of the old rows are still done"
    assert [st.partial_done(0, s) for s in range(st.meta.num_shards)] == [True] * 3 + [False], "partials differ"
    try:
        st.grow_train_rows(n)
    except BadInputError:
        pass
    else:
        raise AssertionError("growing to fewer rows was not refused")


STORE_CHECKS = (
    check_store_protocol,
    check_store_train_rows,
    check_store_inverse,
    check_store_experiment,
    check_store_scores,
    check_store_rows_by_path,
    check_store_partials,
    check_store_factor_arrays,
    check_store_score_pieces,
    check_store_grow,
)


def store_checks() -> tuple:
    """The store checks, each ``check(make_store_or_case)``."""
    return STORE_CHECKS


def check_store(make_store: Callable[[Any], Any], *, checks: Sequence[Callable] | None = None) -> None:
    """Run every store check (or ``checks``) on a backend (the contract of :class:`~trak_core.store.RunStore`):
    ``make_store(meta)`` returns a new, empty store for a :class:`~trak_core.store.StoreMetadata` on every call.
    Rows read back as written (in the store's dtype), flags follow their rows, unfinished results are refused;
    the first failure raises AssertionError starting with the check's name."""
    case = _as_store_case(make_store)
    for check in checks or STORE_CHECKS:
        check(case)
