"""The Zarr v3 implementation of the store: :class:`TrakStore`."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import zarr
from pydantic import ValidationError

from ..errors import BadInputError, StateError, StoreDamageError, StoreMismatchError
from . import arrays as _arrays
from .arrays import (
    StoredArray,
    _attrs,
    _codecs,
    _damaged_metadata,
    _stored,
    _write_rows,
    chunk_coords_of_rows,
    chunk_key,
    chunk_rows_of,
    stored_chunk_keys,
)
from .chunkio import stack_dtype
from .factor_arrays import FactorArrays
from .grow import grow_train_rows as _grow_train_rows
from .location import _open_zarr, _refuse_orphan_arrays, check_writable
from .lock import StoreLock, check_lock_held
from .nodes import ExperimentArrays, ModelArrays, ScoreWriter, TargetArrays, _pinned
from .places import drop_record
from .protocol import split_path
from .root import read_root, write_root
from .schema import (
    _META_KEY,
    _PIPELINE_KEY,
    SCHEMA_VERSION,
    ArraySpec,
    StoreMetadata,
    _score_layout,
    array_spec,
    check_exp_name,
    check_metadata,
    check_model_id,
    check_partial_kind,
    pack_upper,
)


class TrakStore(FactorArrays):
    """A TRAK store. Create with :meth:`create_or_open`, open existing ones with :meth:`open`."""

    def __init__(self, location: str, group: zarr.Group, meta: StoreMetadata, check_on_use: bool = False):
        self.location = str(location)
        self.root = group
        self.meta = meta
        # check_arrays="on_use": each array's zarr.json is checked as it is opened, instead of all at open
        self._check = self._check_array if check_on_use else None
        self._pinned: dict[int, dict] = {}  # thread id → the handles opened once within its pinned() block
        # the run lock this store was opened under (None: no lock); row flags are committed only while it holds
        self._lock_seen = StoreLock(self.location).fingerprint()
        # what is wrong with the root metadata or its sealed copies (set by open; trak_core.store.verify reports it)
        self.root_problems: tuple[str, ...] = ()

    # ---------------------------------------------------------------- open / create
    @classmethod
    def exists(cls, location: str, storage_options: dict | None = None) -> bool:
        try:
            g = _open_zarr(location, "r", storage_options)
        except Exception:  # zarr raises several types for a missing or unreadable group
            return False
        return _META_KEY in g.attrs

    @classmethod
    def open(
        cls,
        location: str,
        storage_options: dict | None = None,
        mode: str = "r+",
        check_arrays: bool | Literal["on_use"] = True,
    ) -> TrakStore:
        """Open an existing store (error if there is none). ``check_arrays``: check every array's zarr.json
        against the root metadata (:class:`StoreDamageError` naming the array); ``"on_use"``: check each array
        as it is opened instead (a pipeline task, after the run's plan checked them all: a task opens a few
        arrays of a store that may hold hundreds); False: never (trak_core.store.verify, which reports those itself)."""
        if check_arrays not in (True, False, "on_use"):
            raise BadInputError(f"check_arrays={check_arrays!r}: expected True, False or 'on_use'")
        try:
            g = _open_zarr(location, "r" if mode == "r" else "r+", storage_options)
        except Exception as e:  # zarr raises several types for a missing group
            _refuse_orphan_arrays(location, storage_options)
            if "://" not in str(location) and os.path.isfile(location):
                raise BadInputError(
                    f"store: {location} is a file, not a trakflow store (a store is a folder)"
                ) from None
            raise BadInputError(f"store: no trakflow store at {location} ({type(e).__name__}: {e})") from None
        if _META_KEY not in g.attrs:
            _refuse_orphan_arrays(location, storage_options)
            raise BadInputError(f"store: {location} is a Zarr group but not a trakflow store (no metadata)")
        raw = _attrs(g)[_META_KEY]
        version = raw.get("schema_version") if isinstance(raw, dict) else None
        if isinstance(version, int) and version != SCHEMA_VERSION:  # another layout (malformed: checked by its seal)
            written = raw.get("versions", {}).get("trakflow", "?") if isinstance(raw, dict) else "?"
            raise StoreMismatchError(
                f"schema_version: the store at {location} has schema_version={version} (trakflow {written}); this "
                f"version reads {SCHEMA_VERSION} only. Use a new store location and rerun (the checkpoints and data "
                "are unchanged)"
            )
        try:
            doc, root_problem, copy_problems = read_root(g, check_copies=check_arrays is False)
        except KeyError as e:
            raise StoreDamageError(
                f"store {location}: {e.args[0]}; restore the root zarr.json from a backup, or use a new store"
            ) from None
        if root_problem and check_arrays is not False:
            raise StoreDamageError(
                f"store {location}: {root_problem}. Run `trakflow verify {location} --repair`: it restores the root "
                "from its sealed copy (the arrays are not touched)"
            )
        try:
            meta = StoreMetadata.model_validate(doc)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err["loc"]) or "metadata"
            raise StoreDamageError(
                f"store {location}: its trakflow metadata is malformed: {where}: {err['msg']}"
            ) from None
        store = cls(location, g, meta, check_on_use=check_arrays == "on_use")
        store.root_problems = tuple(p for p in (root_problem, *copy_problems) if p)
        if check_arrays is True:
            problems = store.array_problems()
            if problems:
                raise _damaged_metadata(location, problems)
        return store

    def _check_array(self, arr: zarr.Array) -> None:
        """Raise :class:`StoreDamageError` when ``arr``'s zarr.json differs from what the root metadata implies."""
        spec = self.array_spec(arr.path)
        problem = spec.problem(arr) if spec is not None else None
        if problem:
            raise _damaged_metadata(self.location, [problem])

    @classmethod
    def create_or_open(
        cls, location: str, meta: StoreMetadata, storage_options: dict | None = None, allow_existing: bool = True
    ) -> TrakStore:
        """Open the store at ``location`` checking it matches ``meta``, or create it."""
        if cls.exists(location, storage_options):
            if not allow_existing:
                raise BadInputError(f"store: {location} already exists")
            store = cls.open(location, storage_options)
            store.validate(meta)
            return store
        _refuse_orphan_arrays(location, storage_options)
        check_writable(location)
        g = _open_zarr(location, "a", storage_options)
        write_root(g, meta.model_dump(mode="json"))
        return cls(location, g, meta)

    def validate(self, expected: StoreMetadata, grow: bool = False) -> None:
        """Refuse (:class:`StoreMismatchError`) when ``expected`` differs from the stored metadata; with ``grow``,
        more train rows than the store holds pass (:meth:`grow_train_rows` adds them), fewer are refused."""
        check_metadata(self.meta, expected, self.location, grow)

    # ---------------------------------------------------------------- run lock
    @property
    def lock(self) -> StoreLock:
        """This store's run lock (``store.lock.acquire(run)``, ``with store.lock.held(run): ...``)."""
        return StoreLock(self.location)

    def check_lock(self) -> None:
        """Raise :class:`LockLostError` when the run lock present when this store was opened has since been
        removed or taken by another run (one small read; nothing when the store was opened unlocked). Called
        before every commit of row flags, so a run that lost its lock stops before marking more rows done."""
        check_lock_held(self.location, self._lock_seen)

    # ---------------------------------------------------------------- helpers
    @contextlib.contextmanager
    def pinned(self, handles: dict | None = None):
        """Within the block, the groups and arrays the store's methods open are opened once and reused: each
        open reads a zarr.json (~0.2 ms here), and a scoring call opens about a hundred. For a block in which no
        other process adds or removes the groups and arrays it uses or changes their attributes — one scoring
        call of the run that holds the store's lock. Blocks nest (the outer one's handles are kept); this
        thread's calls only. ``handles``: a dict the caller keeps to reuse them over several blocks (a TRAKer's
        featurize calls on one model; it drops them when anything else may have changed). Yields the handles of the
        block: another thread's block given them reuses them (a reader thread of the same call)."""
        me = threading.get_ident()
        if me in self._pinned:
            yield self._pinned[me]
            return
        self._pinned[me] = {} if handles is None else handles
        try:
            yield self._pinned[me]
        finally:
            del self._pinned[me]

    @property
    def _pins(self) -> dict | None:
        """This thread's handles within :meth:`pinned` (None outside it)."""
        return self._pinned.get(threading.get_ident())

    def _pin(self, key: tuple, open_: Callable[[], Any]) -> Any:
        return _pinned(self._pins, key, open_)

    def _models(self) -> zarr.Group:
        return self._pin(("group", "models"), lambda: _arrays.group_at(self.root, "models"))

    def _experiments(self) -> zarr.Group:
        return self._pin(("group", "experiments"), lambda: _arrays.group_at(self.root, "experiments"))

    def _row_array(
        self,
        g: zarr.Group,
        name: str,
        dtype,
        width: int | None = None,
        rows: int | None = None,
        chunk_rows: int | None = None,
    ) -> StoredArray:
        n = rows if rows is not None else self.meta.train_set_size
        if name in g:
            return _stored(g, name, self._check, self.meta.store_id)
        shape = (n,) if width is None else (n, width)
        chunks = self.meta.row_chunks(width, np.dtype(dtype).itemsize, chunk_rows)
        g.create_array(name, shape=shape, chunks=chunks, dtype=dtype, compressors=_codecs(), fill_value=0)
        return _stored(g, name, sid=self.meta.store_id)

    def array_spec(self, path: str) -> ArraySpec | None:
        """What the array at ``path`` (e.g. ``models/0/grads``) must be, from the root metadata; None for a path
        that is not one of the store's arrays."""
        parts = path.strip("/").split("/")
        attrs = None
        if len(parts) in (3, 5) and parts[0] == "experiments":
            try:
                attrs = _attrs(self._experiments()[parts[1]])
            except KeyError:
                return None
        return array_spec(self.meta, path, attrs)

    def array_groups(self) -> list[zarr.Group]:
        """The groups holding the store's arrays: each model's, each experiment's and its models'."""
        models = self._models()
        out = [_arrays.group_at(models, k) for k in sorted(models.group_keys(), key=_natural)]
        for e in sorted(self._experiments().group_keys()):
            eg = _arrays.group_at(self._experiments(), e)
            out.append(eg)
            if "models" in eg:
                em = _arrays.group_at(eg, "models")
                out += [_arrays.group_at(em, k) for k in sorted(em.group_keys(), key=_natural)]
        return out

    def array_problems(self) -> list[str]:
        """Each array whose zarr.json cannot be read or differs from :meth:`array_spec` (one line each)."""
        problems = []
        for g in self.array_groups():
            for name in sorted(g.array_keys()):
                path = f"{g.path}/{name}"
                try:
                    arr = _arrays.array_at(g, name)
                except Exception as e:  # an unreadable zarr.json
                    problems.append(f"array {path}: its zarr.json cannot be read ({type(e).__name__}: {e})")
                    continue
                spec = self.array_spec(path)
                problem = spec.problem(arr) if spec is not None else None
                if problem:
                    problems.append(problem)
        return problems

    def raw_array(self, path: str) -> zarr.Array | None:
        """The zarr array at ``path`` as it is on disk (no checks; None if absent)."""
        try:
            node = self.root[path]
        except Exception:
            return None
        return node if isinstance(node, zarr.Array) else None

    def delete_chunk(self, arr: zarr.Array, coords: tuple[int, ...]) -> None:
        """Remove one chunk and its place record (a damaged one, before its rows are unflagged and recomputed)."""
        from zarr.core.sync import sync

        sync(arr.store.delete(f"{arr.path}/{chunk_key(arr, coords)}"))
        drop_record(arr, coords)

    def delete_array(self, path: str) -> None:
        """Remove an array (its zarr.json and chunks); the plan (init_model, ...) creates it again."""
        from zarr.core.sync import sync

        async def _delete() -> None:
            await self.root.store.delete_dir(path.strip("/"))

        sync(_delete())

    # ---------------------------------------------------------------- rows by path (the protocol's RowAccess)
    def stored_array(self, path: str) -> StoredArray:
        """The array at ``path`` (:func:`~trak_core.store.protocol.model_array`, ``target_array``,
        ``experiment_array``) with its damage guard; BadInputError naming an unknown model, experiment or array."""
        exp, mid, name = split_path(path)
        if exp is None:
            return self.model(int(mid or 0))._array(name)
        e = self.experiment(exp)
        if mid is None:
            return e._array(name)
        if not e.has_model(mid):
            raise BadInputError(f"experiment {exp!r} has no target gradients for model_id={mid}")
        return e.model(mid)._array(name)

    def read_rows(self, path: str, rows: slice | np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``rows`` (a slice, or sorted indices) along the first axis of the array at ``path`` as stored;
        with ``out``, decoded straight into it (a slice of rows only)."""
        arr = self.stored_array(path)
        if isinstance(rows, slice):
            if out is not None:
                start, stop, _ = rows.indices(int(arr.shape[0]))
                arr.read_into(start, stop, out)
                return out
            return np.asarray(arr[rows])
        got = np.asarray(arr.oindex[np.asarray(rows)])
        if out is not None:
            out[...] = got
            return out
        return got

    def check_present(self, arrays: list[tuple[str, np.ndarray]]) -> None:
        """Raise :class:`StoreDamageError` naming the array and chunk when a chunk holding the given rows is not in
        the store (zarr would read it back as zeros): one listing per array, no chunk is read."""
        _arrays.require_present(self.location, [(self.stored_array(path), rows) for path, rows in arrays])

    # ---------------------------------------------------------------- what determines the inverse
    def feature_settings(self, model_id: int) -> dict | None:
        """The settings the inverse of ``model_id`` is (to be) computed with: ``{"lambda_reg": <setting>,
        "rescale_inverse": bool}``, recorded when the model is planned (None: not recorded)."""
        return _attrs(self.model(model_id).group).get("feature_settings")

    def check_feature_settings(self, model_id: int, lambda_setting, rescale_inverse: bool) -> None:
        """Refuse (:class:`StoreMismatchError` naming the field) settings other than the recorded ones."""
        have = self.feature_settings(model_id) if self.has_model(model_id) else None
        if have is None:
            return
        for field, want in (("lambda_reg", lambda_setting), ("rescale_inverse", bool(rescale_inverse))):
            if field in have and have[field] != want:
                raise StoreMismatchError(
                    f"{field}: model_id={model_id} in {self.location} was planned with {field}={have[field]!r} "
                    f"(its inverse is computed with it), not {want!r}; use a new "
                    f"store (or the same {field})"
                )

    def record_feature_settings(self, model_id: int, lambda_setting, rescale_inverse: bool) -> None:
        """Record the settings that determine the inverse of ``model_id`` (first call), or refuse others."""
        self.check_feature_settings(model_id, lambda_setting, rescale_inverse)
        if self.feature_settings(model_id) is None:
            self.model(model_id).group.attrs["feature_settings"] = {
                "lambda_reg": lambda_setting,
                "rescale_inverse": bool(rescale_inverse),
            }

    # ---------------------------------------------------------------- unflagging (repair, start over)
    def clear_finalize_info(self, model_id: int) -> None:
        """Mark ``model_id`` not finalized: its inverse, and every experiment's G·A of it (``solved``), are
        computed again; score rows are the caller's (:meth:`unflag_inverse`)."""
        m = self.model(model_id)
        attrs = m.group.attrs
        if "finalize" in attrs:
            del attrs["finalize"]
        if "inverse_done" in m.group:
            m.inverse_done[:] = 0
        for exp in self.experiments():
            e = self.experiment(exp)
            if e.has_model(model_id) and "solved_done" in e.model(model_id).group:
                e.model(model_id).solved_done[:] = 0

    def unflag_inverse(self, model_id: int) -> None:
        """Mark the inverse of ``model_id`` not done, and what depends on it: the finalize record, G·A in every
        experiment, and every score row of the experiments that combine the model."""
        self.clear_finalize_info(model_id)
        for exp in self.experiments():
            if model_id in (self.scored_with(exp) or []) and self.experiment(exp).has_scores:
                self.experiment(exp).scores_done[:] = 0

    def unflag_train_rows(self, model_id: int, rows: np.ndarray) -> None:
        """Mark train ``rows`` of ``model_id`` not done, and what depends on them: their featurized flags,
        their shards' XᵀX partials, the model's inverse (and the finalize record, and G·A), and every score row
        of the experiments that combine the model (the inverse changes with any row)."""
        rows = np.unique(np.asarray(rows, dtype=np.int64))
        if not rows.size:
            return
        m = self.model(model_id)
        m.featurized.oindex[rows] = 0
        m.partial_done.oindex[np.unique(rows // self.meta.shard_rows)] = 0
        self.unflag_inverse(model_id)

    def reset_model(self, model_id: int) -> None:
        """Start ``model_id`` over (``TRAKer(load_from_save_dir=False)``): every row, partial, feature and the
        records of the model marked not done, and its target gradients and the scores combining it too."""
        m = self.init_model(model_id)
        for flags in (m.featurized, m.inverse_done, m.partial_done):
            flags[:] = 0
        for key in ("finalize", "feature_settings", "checkpoint"):
            if key in m.group.attrs:
                del m.group.attrs[key]
        for exp in self.experiments():
            e = self.experiment(exp)
            if e.has_model(model_id):
                t = self.init_experiment_model(exp, model_id)
                t.scored[:] = 0
                t.solved_done[:] = 0
            if model_id in (self.scored_with(exp) or []) and e.has_scores:
                e.scores_done[:] = 0

    # ---------------------------------------------------------------- the pipeline's record
    def pipeline_info(self) -> dict:
        """What the pipeline recorded when it created the store (e.g. ``train_data_sha256``); {} if none."""
        return dict(_attrs(self.root).get(_PIPELINE_KEY) or {})

    def set_pipeline_info(self, info: dict) -> None:
        self.root.attrs[_PIPELINE_KEY] = dict(info)

    # ---------------------------------------------------------------- models
    def model_ids(self) -> list[int]:
        return sorted(int(k) for k in self._models().group_keys())

    def has_model(self, model_id: int) -> bool:
        pins = self._pins
        if pins is not None and ("model", int(model_id)) in pins:  # opened in this pinned block: it is there
            return True
        return str(int(model_id)) in self._models()

    def init_model(self, model_id: int) -> ModelArrays:
        """Create the arrays of ``model_id`` (idempotent). Call from one process before fanning out."""
        check_model_id(model_id)
        m = self.meta
        g = self._models().require_group(str(int(model_id)))
        self._row_array(g, "grads", m.dtype, m.proj_dim)
        self._row_array(g, "out_to_loss", "float32")
        self._row_array(g, "featurized", "uint8")
        for name, rows, shape, dtype in (
            ("xtx_partials", m.num_shards, m.partial_shape, "float64"),
            *((("ggn_partials", m.num_shards, m.partial_shape, "float64"),) if m.curvature == "ggn" else ()),
            ("inverse", 1, (m.proj_dim, m.proj_dim), "float32"),
        ):
            if name not in g:
                g.create_array(
                    name,
                    shape=(rows, *shape),
                    chunks=(1, *shape),
                    dtype=dtype,
                    compressors=_codecs(),
                    fill_value=0,
                )
        if "rowsum_partials" not in g:
            g.create_array(
                "rowsum_partials",
                shape=(m.num_shards, m.proj_dim + 3),
                chunks=(1, m.proj_dim + 3),
                dtype="float64",
                compressors=_codecs(),
                fill_value=0,
            )
        for name, rows in (("partial_done", m.num_shards), ("inverse_done", 1)):
            if name not in g:
                g.create_array(name, shape=(rows,), chunks=(1,), dtype="uint8", compressors=_codecs(), fill_value=0)
        return ModelArrays(g, check=self._check, sid=self.meta.store_id)

    def model(self, model_id: int) -> ModelArrays:
        def open_() -> ModelArrays:
            try:
                g = _arrays.group_at(self._models(), str(int(model_id)))
                return ModelArrays(g, self._pins, self._check, self.meta.store_id)
            except KeyError:
                raise BadInputError(
                    f"model_id={model_id} is not in the store at {self.location} (it has {self.model_ids()})"
                ) from None

        return self._pin(("model", int(model_id)), open_)

    def checkpoint_record(self, model_id: int) -> dict | None:
        """The checkpoint ``model_id`` was featurized from (``{"path", "sha256"}``), if recorded."""
        return _attrs(self.model(model_id).group).get("checkpoint")

    def set_checkpoint_record(self, model_id: int, record: dict) -> None:
        self.model(model_id).group.attrs["checkpoint"] = dict(record)

    def featurized_mask(self, model_id: int) -> np.ndarray:
        return self.model(model_id).featurized[:].astype(bool)

    def shard_featurized(self, model_id: int, shard: int) -> bool:
        a, b = self.meta.shard_range(shard)
        return bool(self.model(model_id).featurized[a:b].all())

    def partial_done(self, model_id: int, shard: int) -> bool:
        return bool(self.model(model_id).partial_done[shard])

    def num_partials_done(self, model_id: int) -> int:
        return int(self.model(model_id).partial_done[:].sum())

    def finalize_info(self, model_id: int) -> dict | None:
        """What finalize recorded (λ, its setting, rescale, condition, ...); None until finalized."""
        return _attrs(self.model(model_id).group).get("finalize")

    def set_finalize_info(self, model_id: int, info: dict) -> None:
        """Mark ``model_id`` finalized (call after its inverse is written)."""
        self.check_lock()
        self.model(model_id).group.attrs["finalize"] = dict(info)

    def write_inverse(self, model_id: int, inverse: np.ndarray) -> None:
        """Write the (p, p) inverse of ``model_id`` (rounded to float32, the precision scores use it in) then mark
        it done (finalize records it after)."""
        m = self.model(model_id)
        _arrays._write_rows(m.inverse, slice(0, 1), np.asarray(inverse)[None])  # one whole chunk: straight to its file
        self.check_lock()
        m.inverse_done[0] = 1

    def inverse(self, model_id: int) -> np.ndarray:
        """The (p, p) float32 inverse of a finalized ``model_id``."""
        if not self.is_finalized(model_id):
            raise StateError(f"model_id={model_id} is not finalized; finalize it first")
        return np.asarray(self.model(model_id).inverse[0])

    def is_finalized(self, model_id: int) -> bool:
        return self.has_model(model_id) and self.finalize_info(model_id) is not None

    def write_train_rows(
        self, model_id: int, rows, grads, out_to_loss: np.ndarray, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Write rows (slice or sorted index array) then mark them featurized. ``grads``: an array, or a list of
        arrays of consecutive rows (converted to the store's dtype piece by piece, never concatenated first).
        Returns the grads as stored (in the store's dtype), in ``out`` when given (a caller's reused buffer)."""
        if self.is_finalized(model_id):
            raise StateError(
                f"model_id={model_id} is already finalized; featurizing it again would make its "
                "inverse stale. Use a new model_id or a new store."
            )
        m = self.model(model_id)
        if out is not None or isinstance(grads, (list, tuple)):
            grads = stack_dtype(grads if isinstance(grads, (list, tuple)) else [grads], self.meta.np_dtype, out)
        stored = _write_rows(m.grads, rows, grads)
        _write_rows(m.out_to_loss, rows, np.asarray(out_to_loss, dtype=np.float32))
        self.check_lock()
        _write_rows(m.featurized, rows, np.ones(grads.shape[0], dtype=np.uint8))
        return stored

    def read_train_rows(self, model_id: int, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Returns: the grads (b - a, p) and Q (b - a,) of train rows [a, b) of ``model_id`` as stored."""
        m = self.model(model_id)
        return np.asarray(m.grads[a:b]), np.asarray(m.out_to_loss[a:b])

    def write_partial(
        self,
        model_id: int,
        shard: int,
        partial: np.ndarray,
        row_sums: np.ndarray,
        ggn: np.ndarray | None = None,
        mark: bool = True,
    ) -> None:
        """Write a shard's Xₛᵀ Xₛ (p, p, symmetric, or already :func:`pack_upper`-ed; stored packed),
        its row sums (p + 3,) and, in a store of ``curvature="ggn"`` (where it is required), its Xₛᵀ Rₛ Xₛ
        (``ggn``, as ``partial``), then mark the shard's partials done (``mark=False``: the caller does, with
        :meth:`mark_partial`, once the shard's rows are marked featurized; unmarked, they are never read)."""
        check_partial_kind(self.meta, ggn)
        m = self.model(model_id)
        _arrays._write_rows(m.xtx_partials, slice(shard, shard + 1), _packed(partial)[None])
        _arrays._write_rows(m.rowsum_partials, slice(shard, shard + 1), np.asarray(row_sums)[None])
        if ggn is not None:
            _arrays._write_rows(m.ggn_partials, slice(shard, shard + 1), _packed(ggn)[None])
        if mark:
            self.mark_partial(model_id, shard)

    def grow_train_rows(self, train_set_size: int) -> int:
        """Grow to ``train_set_size`` train rows, the stored ones kept (:func:`.grow.grow_train_rows`)."""
        return _grow_train_rows(self, train_set_size)

    def mark_partial(self, model_id: int, shard: int) -> None:
        """Mark the partials :meth:`write_partial` wrote for ``shard`` done."""
        self.check_lock()
        self.model(model_id).partial_done[shard] = 1

    # ---------------------------------------------------------------- experiments
    def experiments(self) -> list[str]:
        return sorted(self._experiments().group_keys())

    def init_experiment(self, exp_name: str, num_targets: int) -> ExperimentArrays:
        check_exp_name(exp_name)
        if not isinstance(num_targets, (int, np.integer)) or num_targets <= 0:
            raise BadInputError(f"num_targets must be a positive integer, got {num_targets!r}")
        exps = self._experiments()
        if exp_name not in exps:  # the group and its attributes in one write: a crash leaves both or neither
            layout = {"chunk_rows": self.meta.score_chunk_rows(int(num_targets)), "done_rows": self.meta.rows_per_shard}
            exps.create_group(exp_name, attributes={"num_targets": int(num_targets), "score_layout": layout})
        g = _arrays.group_at(exps, exp_name)
        have = g.attrs.get("num_targets")
        if have != int(num_targets):
            raise StoreMismatchError(f"experiment {exp_name!r} exists with num_targets={have}, not {num_targets}")
        if "models" not in g:  # created next (a run killed in between creates it on its rerun)
            g.require_group("models")
        return ExperimentArrays(g, check=self._check, sid=self.meta.store_id)

    def experiment(self, exp_name: str) -> ExperimentArrays:
        def open_() -> ExperimentArrays:
            try:
                g = _arrays.group_at(self._experiments(), exp_name)
                return ExperimentArrays(g, self._pins, self._check, self.meta.store_id)
            except KeyError:
                raise BadInputError(f"unknown experiment {exp_name!r}; the store has {self.experiments()}") from None

        return self._pin(("experiment", exp_name), open_)

    def num_targets(self, exp_name: str) -> int:
        return self.experiment(exp_name).num_targets

    def target_data_sha256(self, exp_name: str) -> str | None:
        """The fingerprint of the targets the pipeline recorded for ``exp_name`` (None if none)."""
        return _attrs(self.experiment(exp_name).group).get("target_data_sha256")

    def set_target_data_sha256(self, exp_name: str, sha256: str) -> None:
        self.experiment(exp_name).group.attrs["target_data_sha256"] = str(sha256)

    def init_experiment_model(self, exp_name: str, model_id: int) -> TargetArrays:
        e = self.experiment(exp_name)
        m = e.num_targets
        g = _arrays.group_at(e.group, "models").require_group(str(int(model_id)))
        self._row_array(g, "grads", self.meta.dtype, self.meta.proj_dim, rows=m)
        self._row_array(g, "scored", "uint8", rows=m)
        self._row_array(g, "solved", "float32", self.meta.proj_dim, rows=m)
        self._row_array(g, "solved_done", "uint8", rows=m)
        return TargetArrays(g, check=self._check, sid=self.meta.store_id)

    def experiment_model_ids(self, exp_name: str) -> list[int]:
        return self.experiment(exp_name).model_ids()

    def target_grads(self, exp_name: str, model_id: int) -> StoredArray:
        e = self.experiment(exp_name)
        if not e.has_model(model_id):
            raise BadInputError(f"experiment {exp_name!r} has no target gradients for model_id={model_id}")
        return e.model(model_id).grads

    def targets_complete(self, exp_name: str, model_id: int) -> bool:
        e = self.experiment(exp_name)
        if not e.has_model(model_id):
            return False
        return bool(e.model(model_id).scored[:].all())

    def stored_target_rows(self, exp_name: str, model_id: int, rows) -> np.ndarray | None:
        """The stored target gradients of rows ``rows`` (sorted indices), None unless every one is written."""
        e = self.experiment(exp_name)
        if not e.has_model(model_id):
            return None
        t = e.model(model_id)
        if not bool(t.scored.oindex[rows].all()):
            return None
        return np.asarray(t.grads.oindex[rows, :])

    def write_target_rows(self, exp_name: str, model_id: int, rows, grads: np.ndarray) -> None:
        t = self.experiment(exp_name).model(model_id)
        _write_rows(t.solved_done, rows, np.zeros(grads.shape[0], dtype=np.uint8))  # G·A of these rows is stale
        _write_rows(t.grads, rows, grads.astype(self.meta.np_dtype, copy=False))
        self.check_lock()
        _write_rows(t.scored, rows, np.ones(grads.shape[0], dtype=np.uint8))

    def solved_complete(self, exp_name: str, model_id: int) -> bool:
        """Whether G·A of every target of ``exp_name`` is written for ``model_id``."""
        e = self.experiment(exp_name)
        return e.has_model(model_id) and bool(e.model(model_id).solved_done[:].all())

    def write_solved(self, exp_name: str, model_id: int, solved: np.ndarray) -> None:
        """Write G·A ((m, p) float32) of all targets of ``exp_name`` for ``model_id``, then mark it done."""
        t = self.experiment(exp_name).model(model_id)
        t.solved[:] = np.asarray(solved, dtype=np.float32)
        self.check_lock()
        t.solved_done[:] = 1

    def init_scores(self, exp_name: str) -> tuple[StoredArray, StoredArray]:
        def open_() -> tuple[StoredArray, StoredArray]:
            e = self.experiment(exp_name)
            score_rows, done_rows = _score_layout(_attrs(e.group), self.meta)
            scores = self._row_array(e.group, "scores", "float32", e.num_targets, chunk_rows=score_rows)
            done = self._row_array(e.group, "scores_done", "uint8", chunk_rows=done_rows)
            return scores, done

        return self._pin(("scores", exp_name), open_)

    def scored_with(self, exp_name: str) -> list[int] | None:
        """The model ids the experiment's scores combine (None before any scoring)."""
        ids = _attrs(self.experiment(exp_name).group).get("scored_with")
        return None if ids is None else [int(x) for x in ids]

    def set_scored_with(self, exp_name: str, model_ids) -> None:
        """Record which model ids the score rows marked done combine."""
        self.experiment(exp_name).group.attrs["scored_with"] = [int(x) for x in model_ids]

    def begin_scores(self, exp_name: str, model_ids) -> None:
        """Create the score arrays and make their done rows refer to the combination ``model_ids``: when it
        differs from the recorded one, every row is marked not done (rows of another combination are
        forgotten), then the new combination is recorded."""
        ids = [int(x) for x in model_ids]
        self.init_scores(exp_name)
        if self.scored_with(exp_name) != ids:
            self.reset_scores(exp_name)
            self.set_scored_with(exp_name, ids)

    def reset_scores(self, exp_name: str) -> None:
        """Mark every score row of the experiment not done."""
        _, done = self.init_scores(exp_name)
        done[:] = 0

    def scores_done_mask(self, exp_name: str) -> np.ndarray:
        """(n,) bool: which train rows have their scores written (all False before scoring)."""
        e = self.experiment(exp_name)
        if not e.has_scores:
            return np.zeros(self.meta.train_set_size, dtype=bool)
        return e.scores_done[:].astype(bool)

    def write_score_rows(self, exp_name: str, a: int, b: int, scores: np.ndarray, mark: bool = True) -> None:
        """Write the combined scores of train rows [a, b) then (``mark``) mark them done."""
        writer = self.score_rows_writer(exp_name)
        writer.rows(a, b, scores)
        if mark:
            writer.mark_done(a, b)

    def mark_score_rows(self, exp_name: str, a: int, b: int) -> None:
        """Mark score rows [a, b) done (their scores written), if this process still holds the run lock."""
        self.score_rows_writer(exp_name).mark_done(a, b)

    def score_layout(self, exp_name: str) -> tuple[int, int]:
        """(rows per chunk of the scores, rows per chunk of their flags: one shard, or the scores' chunk rows in an
        older experiment)."""
        writer = self.score_rows_writer(exp_name)
        return writer.chunk_rows, writer.done_rows

    def score_rows_writer(self, exp_name: str) -> ScoreWriter:
        """:meth:`write_score_rows` for many blocks, with the score arrays opened once (opening them costs as
        much as writing a 1 MiB block): ``writer(a, b, scores)``, or ``writer.rows`` then ``writer.mark_done``
        for a caller that writes several score chunks before the flag chunk that covers them."""
        arr, done = self.init_scores(exp_name)
        return ScoreWriter(self, arr, done)

    def scores(self, exp_name: str) -> StoredArray:
        e = self.experiment(exp_name)
        if not e.has_scores or not bool(e.scores_done[:].all()):
            raise StateError(f"scores of experiment {exp_name!r} are not finalized yet")
        raw = e.scores.array  # a chunk lost since its rows were marked done would read back as zeros (`show`)
        present = stored_chunk_keys(raw)
        for coords in chunk_coords_of_rows(raw, np.arange(0, raw.shape[0], raw.chunks[0])):
            if chunk_key(raw, coords) not in present:
                a, b = chunk_rows_of(raw, coords)
                raise StoreDamageError(
                    f"store {self.location}: array {raw.path}, chunk {chunk_key(raw, coords)} (rows {a}..{b - 1}): is "
                    f"missing (deleted or lost on disk). Run `trakflow verify {self.location} --repair`, then rerun "
                    "to recompute those rows."
                )
        return e.scores

    # ---------------------------------------------------------------- reporting
    def status(self) -> dict:
        """A small summary: per model featurized/finalized counts, per experiment progress."""
        out: dict[str, Any] = {
            "location": self.location,
            "metadata": self.meta.model_dump(mode="json"),
            "models": {},
            "experiments": {},
        }
        n = self.meta.train_set_size
        for mid in self.model_ids():
            m = self.model(mid)
            out["models"][mid] = {
                "featurized": int(m.featurized[:].sum()),
                "of": n,
                "finalized": self.is_finalized(mid),
            }
        for exp in self.experiments():
            info: dict[str, Any] = {"num_targets": self.num_targets(exp), "models": self.experiment_model_ids(exp)}
            info["scored_models"] = [mid for mid in info["models"] if self.targets_complete(exp, mid)]
            info["scores_rows_done"] = int(self.scores_done_mask(exp).sum())
            out["experiments"][exp] = info
        return out


def _packed(gram: np.ndarray) -> np.ndarray:
    """A (p, p) symmetric Gram partial packed (:func:`pack_upper`), or one already packed as it is."""
    return pack_upper(gram) if gram.ndim == 2 else np.asarray(gram)


def _natural(key: str):
    return (0, int(key)) if key.isdigit() else (1, key)
