"""The Zarr v3 store: layout, metadata schema, per-row status, open/validate.

Layout (one group; a local path or any fsspec URL such as ``memory://x``, ``file:///x``, ``s3://b/x``)::

    /                       attrs: {"trakflow": StoreMetadata}
    /models/<id>/grads          (n, p)  float16|float32   projected, normalized train gradients X
    /models/<id>/out_to_loss    (n,)    float32           Q
    /models/<id>/featurized     (n,)    uint8             row status: 1 once its grads and Q are written
    /models/<id>/xtx_partials   (S, p, p) float64         Xₛᵀ Xₛ of each shard s of ``shard_rows`` rows
    /models/<id>/partial_done   (S,)    uint8
    /models/<id>/features       (n, p)  float16|float32   Φ = X (XᵀX + λI)⁻¹
    /models/<id>/finalized      (n,)    uint8
    /models/<id>                attrs: {"finalize": {...}} once all features are written
    /experiments/<exp>          attrs: {"num_targets": m}
    /experiments/<exp>/models/<id>/grads   (m, p)   target gradients G
    /experiments/<exp>/models/<id>/scored  (m,)     uint8
    /experiments/<exp>/scores   (n, m)  float32        final scores
    /experiments/<exp>/scores_done (n,) uint8

All row arrays share ``chunk_rows`` so a writer that owns whole chunks owns their status too (zarr 3.1
loses data when two processes write the same chunk). A row's status is set only after its data is
written, so a crash leaves unfinished rows visibly unfinished. Metadata is a pydantic model validated on
reopen: a mismatch is refused naming the field, before anything is written.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from typing import Literal, Optional
from urllib.parse import urlparse

import numpy as np
import zarr
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, NonNegativeInt, model_validator

from .errors import BadInputError, StateError, StoreLockedError, StoreMismatchError

SCHEMA_VERSION = 1
_META_KEY = "trakflow"


def _versions() -> dict:
    import torch

    from . import __version__

    return {"trakflow": __version__, "torch": torch.__version__.split("+")[0], "zarr": zarr.__version__}


_SPEC_KEYS = ("kind", "proj_type", "seed", "grad_dim", "proj_dim")


class StoreMetadata(BaseModel):
    """What a store was created with. Every field but ``versions`` must match on reopen."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    train_set_size: PositiveInt
    grad_dim: PositiveInt
    proj_dim: PositiveInt
    projector: str = "dense"
    proj_type: str = "rademacher"
    proj_seed: NonNegativeInt = 0
    projector_params: dict = Field(default_factory=dict)  # kind-specific: SJLT's c, the factored layout
    dtype: Literal["float16", "float32"] = "float16"
    chunk_rows: PositiveInt = 1024
    shard_rows: PositiveInt = 8192
    task: str = ""
    versions: dict[str, str] = Field(default_factory=_versions)

    @model_validator(mode="after")
    def _shards_whole_chunks(self):
        if self.shard_rows % self.chunk_rows:
            raise ValueError(f"shard_rows={self.shard_rows} must be a multiple of chunk_rows={self.chunk_rows}")
        return self

    @classmethod
    def from_projector(cls, spec: dict, **fields) -> "StoreMetadata":
        """Metadata for a projector ``spec()`` (kind-specific entries go to ``projector_params``)."""
        params = {k: v for k, v in spec.items() if k not in _SPEC_KEYS}
        return cls(grad_dim=spec["grad_dim"], proj_dim=spec["proj_dim"], projector=spec["kind"],
                   proj_type=spec["proj_type"], proj_seed=spec["seed"],
                   projector_params=json.loads(json.dumps(params)), **fields)

    @property
    def num_shards(self) -> int:
        return math.ceil(self.train_set_size / self.shard_rows)

    def shard_range(self, shard: int) -> tuple[int, int]:
        if not 0 <= shard < self.num_shards:
            raise BadInputError(f"shard {shard} out of range [0, {self.num_shards})")
        return shard * self.shard_rows, min((shard + 1) * self.shard_rows, self.train_set_size)

    @property
    def np_dtype(self):
        return np.dtype(self.dtype)


def _is_url(location: str) -> bool:
    return "://" in str(location)


def check_writable(location: str) -> None:
    """Fail before any compute when a local store location cannot be created or written.

    Walks up to the first existing ancestor, which must be a directory in which a probe directory can be
    created and removed (works as root too, where permission bits do not tell). Leaves nothing behind.
    """
    if _is_url(location) and not str(location).startswith("file://"):
        return  # remote stores are checked by the first write
    path = urlparse(str(location)).path if str(location).startswith("file://") else str(location)
    path = os.path.abspath(path)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise BadInputError(f"store: {path} exists and is not a directory")
    probe = path
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise BadInputError(f"store: {path} cannot be created: {probe} exists and is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".trakflow-probe-", dir=probe))
    except OSError as e:
        raise BadInputError(f"store: {path} is not writable ({probe}: {e.strerror or e})") from None


def _open_zarr(location: str, mode: str, storage_options: Optional[dict] = None):
    if str(location).startswith("file://"):  # fsspec's local files do not create parents: use zarr's LocalStore
        location = urlparse(str(location)).path
    kw = {}
    if storage_options and _is_url(location):
        kw["storage_options"] = storage_options
    return zarr.open_group(store=str(location), mode=mode, zarr_format=3, **kw)


@dataclass
class ModelArrays:
    group: zarr.Group

    def __getattr__(self, name):
        return self.group[name]


class TrakStore:
    """A TRAK store. Create with :meth:`create_or_open`, open existing ones with :meth:`open`."""

    def __init__(self, location: str, group: zarr.Group, meta: StoreMetadata):
        self.location = str(location)
        self.root = group
        self.meta = meta

    # ---------------------------------------------------------------- open / create
    @classmethod
    def exists(cls, location: str, storage_options: Optional[dict] = None) -> bool:
        try:
            g = _open_zarr(location, "r", storage_options)
        except Exception:  # zarr raises several types for a missing or unreadable group
            return False
        return _META_KEY in g.attrs

    @classmethod
    def open(cls, location: str, storage_options: Optional[dict] = None, mode: str = "r+") -> "TrakStore":
        """Open an existing store (error if there is none)."""
        try:
            g = _open_zarr(location, "r" if mode == "r" else "r+", storage_options)
        except Exception as e:  # zarr raises several types for a missing group
            raise BadInputError(f"store: no trakflow store at {location} ({type(e).__name__}: {e})") from None
        if _META_KEY not in g.attrs:
            raise BadInputError(f"store: {location} is a Zarr group but not a trakflow store (no metadata)")
        meta = StoreMetadata.model_validate(g.attrs[_META_KEY])
        return cls(location, g, meta)

    @classmethod
    def create_or_open(cls, location: str, meta: StoreMetadata, storage_options: Optional[dict] = None,
                       allow_existing: bool = True) -> "TrakStore":
        """Open the store at ``location`` checking it matches ``meta``, or create it."""
        if cls.exists(location, storage_options):
            if not allow_existing:
                raise BadInputError(f"store: {location} already exists")
            store = cls.open(location, storage_options)
            store.validate(meta)
            return store
        check_writable(location)
        g = _open_zarr(location, "a", storage_options)
        g.require_group("models")
        g.require_group("experiments")
        g.attrs[_META_KEY] = meta.model_dump(mode="json")
        return cls(location, g, meta)

    def validate(self, expected: StoreMetadata) -> None:
        """Refuse (:class:`StoreMismatchError`) when ``expected`` differs from the stored metadata."""
        have = self.meta.model_dump()
        want = expected.model_dump()
        for field in StoreMetadata.model_fields:
            if field == "versions":
                continue
            if have[field] != want[field]:
                raise StoreMismatchError(
                    f"store at {self.location} was created with {field}={have[field]!r}, but this run asks "
                    f"for {field}={want[field]!r}. Use another store, or the same {field}."
                )

    # ---------------------------------------------------------------- run lock
    LOCK_NAME = "trakflow.lock"

    @classmethod
    def lock_handle(cls, location: str) -> "TrakStore":
        """A handle for the run lock alone: the store itself may not exist yet (a run locks first)."""
        return cls(location, None, None)  # type: ignore[arg-type]

    def _fs_and_path(self):
        import fsspec
        from fsspec.core import url_to_fs

        loc = self.location
        if loc.startswith("file://"):
            loc = urlparse(loc).path
        if _is_url(loc):
            fs, path = url_to_fs(loc)
        else:
            fs, path = fsspec.filesystem("file"), os.path.abspath(loc)
        return fs, path.rstrip("/") + "/" + self.LOCK_NAME

    def lock_holder(self) -> Optional[dict]:
        fs, path = self._fs_and_path()
        try:
            with fs.open(path, "rb") as fh:
                return json.loads(fh.read().decode() or "{}")
        except FileNotFoundError:
            return None

    @staticmethod
    def holder_alive(holder: dict) -> bool:
        """Whether a lock holder may still run (a holder on another host is assumed alive)."""
        if holder.get("host") != socket.gethostname():
            return True  # cannot tell for another machine: assume alive
        pid = int(holder.get("pid", -1))
        if pid <= 0:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def acquire_lock(self, run: str = "", force: bool = False) -> dict:
        """Take the store's run lock or raise :class:`StoreLockedError` naming the live holder.

        A lock left by a dead process of this host (a crash, SIGKILL) is stale and taken over, so a
        rerun resumes. Workers of one run (Dask, processes) write disjoint chunks and need no lock.
        """
        fs, path = self._fs_and_path()
        me = {"host": socket.gethostname(), "pid": os.getpid(), "run": run, "since": time.time()}
        holder = self.lock_holder()
        if holder is not None and holder.get("host") == me["host"] and holder.get("pid") == me["pid"]:
            return holder  # re-entrant within one process
        if holder is not None and not force and self.holder_alive(holder):
            raise StoreLockedError(
                f"store {self.location} is in use by run {holder.get('run') or '?'} (pid {holder.get('pid')} on "
                f"{holder.get('host')}); two runs on one store are refused. Wait for it, or if that run is "
                f"gone, remove the lock with `trakflow unlock {self.location}`."
            )
        payload = json.dumps(me).encode()
        if holder is None and not _is_url(self.location.replace("file://", "")):
            try:  # atomic on local filesystems
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return self.acquire_lock(run, force)
            with os.fdopen(fd, "wb") as fh:
                fh.write(payload)
        else:
            with fs.open(path, "wb") as fh:
                fh.write(payload)
        if self.lock_holder() != me:  # lost a race on a non-atomic filesystem
            raise StoreLockedError(f"store {self.location}: another run took the lock at the same time")
        return me

    def release_lock(self) -> None:
        fs, path = self._fs_and_path()
        holder = self.lock_holder()
        if holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            fs.rm(path)

    def force_unlock(self) -> Optional[dict]:
        fs, path = self._fs_and_path()
        holder = self.lock_holder()
        if holder is not None:
            fs.rm(path)
        return holder

    @contextlib.contextmanager
    def locked(self, run: str = "", force: bool = False):
        """``with store.locked(run_name): ...`` — hold the run lock for the block."""
        self.acquire_lock(run, force)
        try:
            yield self
        finally:
            self.release_lock()

    # ---------------------------------------------------------------- helpers
    def _row_array(self, g: zarr.Group, name: str, dtype, width: Optional[int] = None, rows: Optional[int] = None):
        n = rows if rows is not None else self.meta.train_set_size
        if name in g:
            return g[name]
        shape = (n,) if width is None else (n, width)
        chunks = (self.meta.chunk_rows,) if width is None else (self.meta.chunk_rows, width)
        return g.create_array(name, shape=shape, chunks=chunks, dtype=dtype, compressors=None, fill_value=0)

    # ---------------------------------------------------------------- models
    def model_ids(self) -> list[int]:
        return sorted(int(k) for k in self.root["models"].group_keys())

    def has_model(self, model_id: int) -> bool:
        return str(int(model_id)) in self.root["models"]

    def init_model(self, model_id: int) -> ModelArrays:
        """Create the arrays of ``model_id`` (idempotent). Call from one process before fanning out."""
        _check_model_id(model_id)
        m = self.meta
        g = self.root["models"].require_group(str(int(model_id)))
        self._row_array(g, "grads", m.dtype, m.proj_dim)
        self._row_array(g, "out_to_loss", "float32")
        self._row_array(g, "featurized", "uint8")
        self._row_array(g, "features", m.dtype, m.proj_dim)
        self._row_array(g, "finalized", "uint8")
        if "xtx_partials" not in g:
            g.create_array("xtx_partials", shape=(m.num_shards, m.proj_dim, m.proj_dim),
                           chunks=(1, m.proj_dim, m.proj_dim), dtype="float64", compressors=None, fill_value=0)
            g.create_array("partial_done", shape=(m.num_shards,), chunks=(1,), dtype="uint8",
                           compressors=None, fill_value=0)
        return ModelArrays(g)

    def model(self, model_id: int) -> ModelArrays:
        if not self.has_model(model_id):
            raise BadInputError(f"model_id={model_id} is not in the store at {self.location} "
                                f"(it has {self.model_ids()})")
        return ModelArrays(self.root["models"][str(int(model_id))])

    def featurized_mask(self, model_id: int) -> np.ndarray:
        return self.model(model_id).featurized[:].astype(bool)

    def shard_featurized(self, model_id: int, shard: int) -> bool:
        a, b = self.meta.shard_range(shard)
        return bool(self.model(model_id).featurized[a:b].all())

    def partial_done(self, model_id: int, shard: int) -> bool:
        return bool(self.model(model_id).partial_done[shard])

    def finalize_info(self, model_id: int) -> Optional[dict]:
        return self.model(model_id).group.attrs.get("finalize")

    def is_finalized(self, model_id: int) -> bool:
        return self.has_model(model_id) and self.finalize_info(model_id) is not None

    def write_train_rows(self, model_id: int, rows, grads: np.ndarray, out_to_loss: np.ndarray) -> None:
        """Write rows (slice or sorted index array) then mark them featurized."""
        if self.is_finalized(model_id):
            raise StateError(f"model_id={model_id} is already finalized; featurizing it again would make its "
                             "features stale. Use a new model_id or a new store.")
        m = self.model(model_id)
        _write_rows(m.grads, rows, grads.astype(self.meta.np_dtype, copy=False))
        _write_rows(m.out_to_loss, rows, out_to_loss.astype(np.float32, copy=False))
        _write_rows(m.featurized, rows, np.ones(grads.shape[0], dtype=np.uint8))

    def write_partial(self, model_id: int, shard: int, partial: np.ndarray) -> None:
        m = self.model(model_id)
        m.xtx_partials[shard] = partial
        m.partial_done[shard] = 1

    # ---------------------------------------------------------------- experiments
    def experiments(self) -> list[str]:
        return sorted(self.root["experiments"].group_keys())

    def init_experiment(self, exp_name: str, num_targets: int) -> zarr.Group:
        if not isinstance(exp_name, str) or not exp_name or "/" in exp_name:
            raise BadInputError(f"exp_name must be a non-empty string without '/', got {exp_name!r}")
        if not isinstance(num_targets, (int, np.integer)) or num_targets <= 0:
            raise BadInputError(f"num_targets must be a positive integer, got {num_targets!r}")
        exps = self.root["experiments"]
        if exp_name in exps:
            have = exps[exp_name].attrs.get("num_targets")
            if have != int(num_targets):
                raise StoreMismatchError(f"experiment {exp_name!r} exists with num_targets={have}, "
                                         f"not {num_targets}")
            return exps[exp_name]
        g = exps.require_group(exp_name)
        g.require_group("models")
        g.attrs["num_targets"] = int(num_targets)
        return g

    def experiment(self, exp_name: str) -> zarr.Group:
        if exp_name not in self.root["experiments"]:
            raise BadInputError(f"unknown experiment {exp_name!r}; the store has {self.experiments()}")
        return self.root["experiments"][exp_name]

    def num_targets(self, exp_name: str) -> int:
        return int(self.experiment(exp_name).attrs["num_targets"])

    def init_experiment_model(self, exp_name: str, model_id: int) -> zarr.Group:
        e = self.experiment(exp_name)
        m = self.num_targets(exp_name)
        g = e["models"].require_group(str(int(model_id)))
        self._row_array(g, "grads", self.meta.dtype, self.meta.proj_dim, rows=m)
        self._row_array(g, "scored", "uint8", rows=m)
        return g

    def experiment_model_ids(self, exp_name: str) -> list[int]:
        return sorted(int(k) for k in self.experiment(exp_name)["models"].group_keys())

    def target_grads(self, exp_name: str, model_id: int) -> zarr.Array:
        e = self.experiment(exp_name)
        if str(int(model_id)) not in e["models"]:
            raise BadInputError(f"experiment {exp_name!r} has no target gradients for model_id={model_id}")
        return e["models"][str(int(model_id))]["grads"]

    def targets_complete(self, exp_name: str, model_id: int) -> bool:
        e = self.experiment(exp_name)
        if str(int(model_id)) not in e["models"]:
            return False
        return bool(e["models"][str(int(model_id))]["scored"][:].all())

    def write_target_rows(self, exp_name: str, model_id: int, rows, grads: np.ndarray) -> None:
        g = self.experiment(exp_name)["models"][str(int(model_id))]
        _write_rows(g["grads"], rows, grads.astype(self.meta.np_dtype, copy=False))
        _write_rows(g["scored"], rows, np.ones(grads.shape[0], dtype=np.uint8))

    def init_scores(self, exp_name: str) -> tuple[zarr.Array, zarr.Array]:
        e = self.experiment(exp_name)
        m = self.num_targets(exp_name)
        scores = self._row_array(e, "scores", "float32", m)
        done = self._row_array(e, "scores_done", "uint8")
        return scores, done

    def scores(self, exp_name: str) -> zarr.Array:
        e = self.experiment(exp_name)
        if "scores" not in e or not bool(e["scores_done"][:].all()):
            raise StateError(f"scores of experiment {exp_name!r} are not finalized yet")
        return e["scores"]

    # ---------------------------------------------------------------- reporting
    def status(self) -> dict:
        """A small summary: per model featurized/finalized counts, per experiment progress."""
        out = {"location": self.location, "metadata": self.meta.model_dump(mode="json"), "models": {},
               "experiments": {}}
        n = self.meta.train_set_size
        for mid in self.model_ids():
            m = self.model(mid)
            out["models"][mid] = {"featurized": int(m.featurized[:].sum()), "of": n,
                                  "finalized": self.is_finalized(mid)}
        for exp in self.experiments():
            e = self.experiment(exp)
            info = {"num_targets": self.num_targets(exp), "models": self.experiment_model_ids(exp)}
            info["scored_models"] = [mid for mid in info["models"] if self.targets_complete(exp, mid)]
            info["scores_rows_done"] = int(e["scores_done"][:].sum()) if "scores_done" in e else 0
            out["experiments"][exp] = info
        return out


def _check_model_id(model_id) -> None:
    if not isinstance(model_id, (int, np.integer)) or isinstance(model_id, bool) or model_id < 0:
        raise BadInputError(f"model_id must be a non-negative integer, got {model_id!r}")


def _write_rows(arr: zarr.Array, rows, values: np.ndarray) -> None:
    if isinstance(rows, slice):
        arr[rows] = values
        return
    rows = np.asarray(rows)
    if rows.size and np.all(np.diff(rows) == 1):
        arr[int(rows[0]):int(rows[-1]) + 1] = values
    else:
        arr.oindex[rows] = values
