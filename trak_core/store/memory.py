"""A store held in this process's memory, its arrays numpy arrays: :class:`MemoryStore`.

A second backend of :class:`~trak_core.store.RunStore` beside the Zarr store, for tests and notebooks: the engine,
TRAKer, the pipeline and the index run on it unchanged and give the Zarr store's scores bit for bit (the same
rows in the same dtype, the same arithmetic). Its locations start with :data:`MEMORY_PREFIX`
(``memory://trakflow-memory/<name>``); :func:`~trak_core.store.open_store` and
:func:`~trak_core.store.create_or_open_store` open them here, every other location as Zarr. A location is one
store for the life of the process (every open shares its arrays; :meth:`MemoryStore.delete` forgets it); its run
lock is a file of fsspec's memory filesystem under the same URL, as for a Zarr store at a ``memory://`` URL.

Nothing of it is on disk, so nothing can be lost or damaged there: :meth:`MemoryStore.check_present` only checks
that the arrays exist, and ``trakflow verify`` has nothing to check.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ..errors import BadInputError, StateError, StoreMismatchError
from .chunkio import stack_dtype, to_dtype
from .lock import StoreLock, check_lock_held
from .protocol import split_path
from .schema import StoreMetadata, check_exp_name, check_metadata, check_model_id, check_partial_kind, pack_upper

#: the locations of in-memory stores: ``memory://trakflow-memory/<name>``
MEMORY_PREFIX = "memory://trakflow-memory/"


def memory_location(name: str) -> str:
    """The location of the in-memory store ``name``."""
    return MEMORY_PREFIX + str(name).strip("/")


def _json(value: Any) -> Any:
    """``value`` as a record holds it: through JSON, as the Zarr store's attributes (tuples become lists)."""
    return json.loads(json.dumps(value))


@dataclass
class _Model:
    arrays: dict[str, np.ndarray]
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Experiment:
    num_targets: int
    layout: tuple[int, int]  # rows per piece of scores, of their flags
    attrs: dict[str, Any] = field(default_factory=dict)
    models: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    scores: dict[str, np.ndarray] = field(default_factory=dict)  # "scores", "scores_done" once created


@dataclass
class _State:
    meta: StoreMetadata
    pipeline: dict[str, Any] = field(default_factory=dict)
    factors: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    factor_records: dict[int, dict] = field(default_factory=dict)
    factor_partials: dict[tuple[int, int], tuple[dict[str, np.ndarray], dict]] = field(default_factory=dict)
    models: dict[int, _Model] = field(default_factory=dict)
    experiments: dict[str, _Experiment] = field(default_factory=dict)


_STORES: dict[str, _State] = {}
_GUARD = threading.Lock()


def _key(location: str) -> str:
    return str(location).rstrip("/")


class MemoryStore:
    """A run's store in memory (see the module). Create with :meth:`create_or_open`, open with :meth:`open`."""

    def __init__(self, location: str, state: _State):
        self.location = _key(location)
        self._state = state
        self._lock_seen = StoreLock(self.location).fingerprint()  # the run lock it was opened under (or None)

    # ---------------------------------------------------------------- open / create
    @classmethod
    def exists(cls, location: str, storage_options: dict | None = None) -> bool:
        with _GUARD:
            return _key(location) in _STORES

    @classmethod
    def open(
        cls,
        location: str,
        storage_options: dict | None = None,
        mode: str = "r+",
        check_arrays: bool | Literal["on_use"] = True,
    ) -> MemoryStore:
        """The in-memory store at ``location`` (BadInputError when there is none)."""
        if check_arrays not in (True, False, "on_use"):
            raise BadInputError(f"check_arrays={check_arrays!r}: expected True, False or 'on_use'")
        with _GUARD:
            state = _STORES.get(_key(location))
        if state is None:
            raise BadInputError(f"store: no trakflow store at {location} (no in-memory store of that name)")
        return cls(location, state)

    @classmethod
    def create_or_open(
        cls, location: str, meta: StoreMetadata, storage_options: dict | None = None, allow_existing: bool = True
    ) -> MemoryStore:
        """Open the store at ``location`` checking it matches ``meta``, or create it."""
        with _GUARD:
            state = _STORES.get(_key(location))
            if state is None:
                state = _STORES[_key(location)] = _State(meta)
                return cls(location, state)
        if not allow_existing:
            raise BadInputError(f"store: {location} already exists")
        store = cls(location, state)
        store.validate(meta)
        return store

    @classmethod
    def delete(cls, location: str) -> None:
        """Forget the in-memory store at ``location`` (nothing when there is none)."""
        with _GUARD:
            _STORES.pop(_key(location), None)

    @property
    def meta(self) -> StoreMetadata:
        return self._state.meta

    @meta.setter
    def meta(self, value: StoreMetadata) -> None:
        self._state.meta = value

    def validate(self, expected: StoreMetadata, grow: bool = False) -> None:
        check_metadata(self.meta, expected, self.location, grow)

    # ---------------------------------------------------------------- run lock
    @property
    def lock(self) -> StoreLock:
        return StoreLock(self.location)

    def check_lock(self) -> None:
        check_lock_held(self.location, self._lock_seen)

    @contextlib.contextmanager
    def pinned(self, handles: dict | None = None) -> Iterator[dict]:
        """Nothing to open: the block runs as it is (yields ``handles``, unused)."""
        yield {} if handles is None else handles

    # ---------------------------------------------------------------- the pipeline's record
    def pipeline_info(self) -> dict:
        return _json(self._state.pipeline)

    def set_pipeline_info(self, info: dict) -> None:
        self._state.pipeline = _json(dict(info))

    def write_factor_arrays(self, model_id: int, arrays: dict[str, np.ndarray], record: dict) -> None:
        self._state.factor_records.pop(int(model_id), None)
        self._state.factors[int(model_id)] = {k: np.array(v, dtype=np.float64) for k, v in arrays.items()}
        self._state.factor_records[int(model_id)] = _json(dict(record))

    def read_factor_record(self, model_id: int) -> dict | None:
        got = self._state.factor_records.get(int(model_id))
        return None if got is None else _json(got)

    def read_factor_arrays(self, model_id: int) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self._state.factors.get(int(model_id), {}).items()}

    def write_factor_partial(self, model_id: int, shard: int, arrays: dict[str, np.ndarray], info: dict) -> None:
        copied = {k: np.array(v, dtype=np.float64) for k, v in arrays.items()}
        self._state.factor_partials[(int(model_id), int(shard))] = (copied, _json(dict(info)))

    def read_factor_partial(self, model_id: int, shard: int) -> tuple[dict[str, np.ndarray], dict] | None:
        got = self._state.factor_partials.get((int(model_id), int(shard)))
        return None if got is None else ({k: v.copy() for k, v in got[0].items()}, _json(got[1]))

    # ---------------------------------------------------------------- models
    def _model(self, model_id: int) -> _Model:
        m = self._state.models.get(int(model_id))
        if m is None:
            raise BadInputError(
                f"model_id={model_id} is not in the store at {self.location} (it has {self.model_ids()})"
            )
        return m

    def model_ids(self) -> list[int]:
        return sorted(self._state.models)

    def has_model(self, model_id: int) -> bool:
        return int(model_id) in self._state.models

    def init_model(self, model_id: int) -> None:
        check_model_id(model_id)
        if int(model_id) in self._state.models:
            return
        m, n, s = self.meta, self.meta.train_set_size, self.meta.num_shards
        arrays = {
            "grads": np.zeros((n, m.proj_dim), dtype=m.np_dtype),
            "out_to_loss": np.zeros(n, dtype=np.float32),
            "featurized": np.zeros(n, dtype=np.uint8),
            "xtx_partials": np.zeros((s, *m.partial_shape), dtype=np.float64),
            "rowsum_partials": np.zeros((s, m.proj_dim + 3), dtype=np.float64),
            "partial_done": np.zeros(s, dtype=np.uint8),
            "inverse": np.zeros((1, m.proj_dim, m.proj_dim), dtype=np.float32),
            "inverse_done": np.zeros(1, dtype=np.uint8),
        }
        if m.curvature == "ggn":
            arrays["ggn_partials"] = np.zeros((s, *m.partial_shape), dtype=np.float64)
        self._state.models[int(model_id)] = _Model(arrays)

    def checkpoint_record(self, model_id: int) -> dict | None:
        return self._model(model_id).attrs.get("checkpoint")

    def set_checkpoint_record(self, model_id: int, record: dict) -> None:
        self._model(model_id).attrs["checkpoint"] = _json(dict(record))

    def check_feature_settings(self, model_id: int, lambda_setting, rescale_inverse: bool) -> None:
        have = self._model(model_id).attrs.get("feature_settings") if self.has_model(model_id) else None
        if have is None:
            return
        for name, want in (("lambda_reg", lambda_setting), ("rescale_inverse", bool(rescale_inverse))):
            if name in have and have[name] != want:
                raise StoreMismatchError(
                    f"{name}: model_id={model_id} in {self.location} was planned with {name}={have[name]!r} "
                    f"(its inverse is computed with it), not {want!r}; use a new store (or the same {name})"
                )

    def record_feature_settings(self, model_id: int, lambda_setting, rescale_inverse: bool) -> None:
        self.check_feature_settings(model_id, lambda_setting, rescale_inverse)
        attrs = self._model(model_id).attrs
        if attrs.get("feature_settings") is None:
            attrs["feature_settings"] = _json({"lambda_reg": lambda_setting, "rescale_inverse": bool(rescale_inverse)})

    def reset_model(self, model_id: int) -> None:
        self.init_model(model_id)
        m = self._model(model_id)
        for name in ("featurized", "inverse_done", "partial_done"):
            m.arrays[name][:] = 0
        for key in ("finalize", "feature_settings", "checkpoint"):
            m.attrs.pop(key, None)
        for e in self._state.experiments.values():
            t = e.models.get(int(model_id))
            if t is not None:
                t["scored"][:] = 0
                t["solved_done"][:] = 0
            if int(model_id) in (e.attrs.get("scored_with") or []) and e.scores:
                e.scores["scores_done"][:] = 0

    def featurized_mask(self, model_id: int) -> np.ndarray:
        return self._model(model_id).arrays["featurized"].astype(bool)

    def shard_featurized(self, model_id: int, shard: int) -> bool:
        a, b = self.meta.shard_range(shard)
        return bool(self._model(model_id).arrays["featurized"][a:b].all())

    def partial_done(self, model_id: int, shard: int) -> bool:
        return bool(self._model(model_id).arrays["partial_done"][shard])

    def finalize_info(self, model_id: int) -> dict | None:
        return self._model(model_id).attrs.get("finalize")

    def set_finalize_info(self, model_id: int, info: dict) -> None:
        self.check_lock()
        self._model(model_id).attrs["finalize"] = _json(dict(info))

    def is_finalized(self, model_id: int) -> bool:
        return self.has_model(model_id) and self.finalize_info(model_id) is not None

    def _clear_finalize(self, model_id: int) -> None:
        m = self._model(model_id)
        m.attrs.pop("finalize", None)
        m.arrays["inverse_done"][:] = 0
        for e in self._state.experiments.values():
            if int(model_id) in e.models:
                e.models[int(model_id)]["solved_done"][:] = 0

    # ---------------------------------------------------------------- rows
    def _array(self, path: str) -> np.ndarray:
        exp, mid, name = split_path(path)
        if exp is None:
            arrays = self._model(int(mid or 0)).arrays
        else:
            e = self._experiment(exp)
            if mid is None:
                arrays = e.scores
            elif mid in e.models:
                arrays = e.models[mid]
            else:
                raise BadInputError(f"experiment {exp!r} has no target gradients for model_id={mid}")
        if name not in arrays:
            raise BadInputError(f"store {self.location}: there is no array {path} (not created)")
        return arrays[name]

    def read_rows(self, path: str, rows: slice | np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        got = self._array(path)[rows if isinstance(rows, slice) else np.asarray(rows)]
        if out is not None:
            out[...] = got
            return out
        return np.array(got)

    def check_present(self, arrays: list[tuple[str, np.ndarray]]) -> None:
        """Every row of an array in memory is there: only the arrays are checked to exist."""
        for path, _ in arrays:
            self._array(path)

    def write_train_rows(
        self, model_id: int, rows, grads, out_to_loss: np.ndarray, out: np.ndarray | None = None
    ) -> np.ndarray:
        if self.is_finalized(model_id):
            raise StateError(
                f"model_id={model_id} is already finalized; featurizing it again would make its "
                "inverse stale. Use a new model_id or a new store."
            )
        m = self._model(model_id).arrays
        pieces = grads if isinstance(grads, (list, tuple)) else [grads]
        stored = stack_dtype(pieces, self.meta.np_dtype, out)
        m["grads"][rows] = stored
        m["out_to_loss"][rows] = np.asarray(out_to_loss, dtype=np.float32)
        self.check_lock()
        m["featurized"][rows] = 1
        return stored

    def read_train_rows(self, model_id: int, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        m = self._model(model_id).arrays
        return m["grads"][a:b].copy(), m["out_to_loss"][a:b].copy()

    def write_partial(
        self,
        model_id: int,
        shard: int,
        partial: np.ndarray,
        row_sums: np.ndarray,
        ggn: np.ndarray | None = None,
        mark: bool = True,
    ) -> None:
        check_partial_kind(self.meta, ggn)
        m = self._model(model_id).arrays
        m["xtx_partials"][shard] = _packed(partial)
        m["rowsum_partials"][shard] = np.asarray(row_sums)
        if ggn is not None:
            m["ggn_partials"][shard] = _packed(ggn)
        if mark:
            self.mark_partial(model_id, shard)

    def mark_partial(self, model_id: int, shard: int) -> None:
        self.check_lock()
        self._model(model_id).arrays["partial_done"][shard] = 1

    def grow_train_rows(self, train_set_size: int) -> int:
        meta = self.meta
        old, new = meta.train_set_size, int(train_set_size)
        if new < old:
            raise BadInputError(
                f"train_data: {new} rows, but the store at {self.location} holds {old}; a store only grows "
                "(use a new store for fewer rows)"
            )
        if new == old:
            return old
        grown = meta.model_copy(update={"train_set_size": new})
        completes_last = old % meta.rows_per_shard != 0  # the old last shard gets new rows: its partial is redone
        for mid, m in self._state.models.items():
            self._clear_finalize(mid)
            if completes_last:
                m.arrays["partial_done"][meta.num_shards - 1] = 0
            for name in ("grads", "out_to_loss", "featurized"):
                m.arrays[name] = _grown(m.arrays[name], new)
            for name in ("xtx_partials", "rowsum_partials", "ggn_partials", "partial_done"):
                if name in m.arrays:
                    m.arrays[name] = _grown(m.arrays[name], grown.num_shards)
        for e in self._state.experiments.values():
            if e.scores:
                e.scores["scores_done"][:] = 0
                e.scores = {name: _grown(arr, new) for name, arr in e.scores.items()}
        self.meta = grown
        return old

    def write_inverse(self, model_id: int, inverse: np.ndarray) -> None:
        m = self._model(model_id).arrays
        m["inverse"][0] = to_dtype(np.asarray(inverse), np.dtype(np.float32))
        self.check_lock()
        m["inverse_done"][0] = 1

    def inverse(self, model_id: int) -> np.ndarray:
        if not self.is_finalized(model_id):
            raise StateError(f"model_id={model_id} is not finalized; finalize it first")
        return self._model(model_id).arrays["inverse"][0].copy()

    # ---------------------------------------------------------------- experiments
    def _experiment(self, exp_name: str) -> _Experiment:
        e = self._state.experiments.get(exp_name)
        if e is None:
            raise BadInputError(f"unknown experiment {exp_name!r}; the store has {self.experiments()}")
        return e

    def experiments(self) -> list[str]:
        return sorted(self._state.experiments)

    def init_experiment(self, exp_name: str, num_targets: int) -> None:
        check_exp_name(exp_name)
        if not isinstance(num_targets, (int, np.integer)) or num_targets <= 0:
            raise BadInputError(f"num_targets must be a positive integer, got {num_targets!r}")
        exps = self._state.experiments
        if exp_name not in exps:
            layout = (self.meta.score_chunk_rows(int(num_targets)), self.meta.rows_per_shard)
            exps[exp_name] = _Experiment(int(num_targets), layout)
        have = exps[exp_name].num_targets
        if have != int(num_targets):
            raise StoreMismatchError(f"experiment {exp_name!r} exists with num_targets={have}, not {num_targets}")

    def num_targets(self, exp_name: str) -> int:
        return self._experiment(exp_name).num_targets

    def target_data_sha256(self, exp_name: str) -> str | None:
        return self._experiment(exp_name).attrs.get("target_data_sha256")

    def set_target_data_sha256(self, exp_name: str, sha256: str) -> None:
        self._experiment(exp_name).attrs["target_data_sha256"] = str(sha256)

    def init_experiment_model(self, exp_name: str, model_id: int) -> None:
        e = self._experiment(exp_name)
        if int(model_id) in e.models:
            return
        m, p = e.num_targets, self.meta.proj_dim
        e.models[int(model_id)] = {
            "grads": np.zeros((m, p), dtype=self.meta.np_dtype),
            "scored": np.zeros(m, dtype=np.uint8),
            "solved": np.zeros((m, p), dtype=np.float32),
            "solved_done": np.zeros(m, dtype=np.uint8),
        }

    def experiment_model_ids(self, exp_name: str) -> list[int]:
        return sorted(self._experiment(exp_name).models)

    def targets_complete(self, exp_name: str, model_id: int) -> bool:
        t = self._experiment(exp_name).models.get(int(model_id))
        return t is not None and bool(t["scored"].all())

    def stored_target_rows(self, exp_name: str, model_id: int, rows) -> np.ndarray | None:
        t = self._experiment(exp_name).models.get(int(model_id))
        if t is None or not bool(t["scored"][rows].all()):
            return None
        return np.array(t["grads"][rows])

    def write_target_rows(self, exp_name: str, model_id: int, rows, grads: np.ndarray) -> None:
        t = self._targets(exp_name, model_id)
        t["solved_done"][rows] = 0  # G·A of these rows is stale
        t["grads"][rows] = grads.astype(self.meta.np_dtype, copy=False)
        self.check_lock()
        t["scored"][rows] = 1

    def _targets(self, exp_name: str, model_id: int) -> dict[str, np.ndarray]:
        t = self._experiment(exp_name).models.get(int(model_id))
        if t is None:
            raise BadInputError(f"experiment {exp_name!r} has no target gradients for model_id={model_id}")
        return t

    def solved_complete(self, exp_name: str, model_id: int) -> bool:
        t = self._experiment(exp_name).models.get(int(model_id))
        return t is not None and bool(t["solved_done"].all())

    def write_solved(self, exp_name: str, model_id: int, solved: np.ndarray) -> None:
        t = self._targets(exp_name, model_id)
        t["solved"][:] = np.asarray(solved, dtype=np.float32)
        self.check_lock()
        t["solved_done"][:] = 1

    # ---------------------------------------------------------------- scores
    def init_scores(self, exp_name: str) -> None:
        e = self._experiment(exp_name)
        if not e.scores:
            n = self.meta.train_set_size
            e.scores = {
                "scores": np.zeros((n, e.num_targets), dtype=np.float32),
                "scores_done": np.zeros(n, dtype=np.uint8),
            }

    def scored_with(self, exp_name: str) -> list[int] | None:
        ids = self._experiment(exp_name).attrs.get("scored_with")
        return None if ids is None else [int(x) for x in ids]

    def set_scored_with(self, exp_name: str, model_ids) -> None:
        self._experiment(exp_name).attrs["scored_with"] = [int(x) for x in model_ids]

    def begin_scores(self, exp_name: str, model_ids) -> None:
        ids = [int(x) for x in model_ids]
        self.init_scores(exp_name)
        if self.scored_with(exp_name) != ids:
            self.reset_scores(exp_name)
            self.set_scored_with(exp_name, ids)

    def reset_scores(self, exp_name: str) -> None:
        self.init_scores(exp_name)
        self._experiment(exp_name).scores["scores_done"][:] = 0

    def scores_done_mask(self, exp_name: str) -> np.ndarray:
        e = self._experiment(exp_name)
        if not e.scores:
            return np.zeros(self.meta.train_set_size, dtype=bool)
        return e.scores["scores_done"].astype(bool)

    def score_layout(self, exp_name: str) -> tuple[int, int]:
        return self._experiment(exp_name).layout

    def write_score_rows(self, exp_name: str, a: int, b: int, scores: np.ndarray, mark: bool = True) -> None:
        self.init_scores(exp_name)
        self._experiment(exp_name).scores["scores"][a:b] = scores.astype(np.float32, copy=False)
        if mark:
            self.mark_score_rows(exp_name, a, b)

    def mark_score_rows(self, exp_name: str, a: int, b: int) -> None:
        self.check_lock()
        self._experiment(exp_name).scores["scores_done"][a:b] = 1

    def scores(self, exp_name: str) -> np.ndarray:
        e = self._experiment(exp_name)
        if not e.scores or not bool(e.scores["scores_done"].all()):
            raise StateError(f"scores of experiment {exp_name!r} are not finalized yet")
        return e.scores["scores"].copy()


def _packed(gram: np.ndarray) -> np.ndarray:
    """A (p, p) symmetric Gram partial packed (:func:`pack_upper`), or one already packed as it is."""
    return pack_upper(gram) if gram.ndim == 2 else np.asarray(gram)


def _grown(arr: np.ndarray, rows: int) -> np.ndarray:
    """``arr`` with zero rows appended up to ``rows`` along the first axis."""
    out = np.zeros((rows, *arr.shape[1:]), dtype=arr.dtype)
    out[: arr.shape[0]] = arr
    return out
