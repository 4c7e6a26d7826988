"""Verify a store (fsck) and repair it by unflagging what is damaged, so that a rerun recomputes exactly that.

A row's status flag says it was written; the chunk's presence (one listing of the array's keys) and its crc32c
checksum (zarr decodes every chunk through the ``crc32c`` codec) say it is still there, and its place record
(:mod:`.places`) that it is the chunk written at that place of this store. What each data array
must hold, and which flag says so:

====================================  ==================  =====================================================
array                                 flag                what depends on it (unflagged by ``repair_store``)
====================================  ==================  =====================================================
models/<id>/grads, out_to_loss        featurized          the shard's XᵀX partial, the inverse, the finalize
                                                          record and G·A, every score row combining the model
models/<id>/xtx_partials, rowsum_part. partial_done        (the next finalize recomputes them from the grads)
models/<id>/inverse                   inverse_done        the finalize record, G·A, every score row combining it
experiments/<e>/models/<id>/grads     scored              G·A of those targets, every score row of the experiment
experiments/<e>/models/<id>/solved    solved_done         every score row of the experiment
experiments/<e>/scores                scores_done         —
====================================  ==================  =====================================================

A damaged flag chunk is removed (its rows read as not done). An array whose zarr.json differs from what the
root metadata implies is removed and created again by the next plan (``init_model`` …); its rows are unflagged.

:func:`verify_store` returns a typed :class:`VerifyReport`; ``read_chunks=False`` is the cheap part (listing
only) that the pipeline's plan step runs before it skips work; :func:`require_present` is the same check for
the rows one step is about to read (TRAKer's finalize and scoring).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from ..errors import StoreDamageError
from .arrays import (
    StoredArray,
    _decode_problem,
    array_at,
    chunk_coords_of_rows,
    chunk_key,
    chunk_rows_of,
    read_chunk,
    stored_chunk_keys,
)
from .arrays import require_present as _require_present
from .places import place_problems
from .protocol import RunRecords
from .root import write_root
from .schema import SHARD_ARRAYS, ArraySpec, _expected_document
from .zarr_store import TrakStore

Kind = Literal["missing", "corrupt", "misplaced", "metadata"]

#: data array → the flag array (same group) whose set rows it must hold
_MODEL_DATA = {
    "grads": "featurized",
    "out_to_loss": "featurized",
    "xtx_partials": "partial_done",
    "rowsum_partials": "partial_done",
    "inverse": "inverse_done",
}
_MODEL_FLAGS = ("featurized", "partial_done", "inverse_done")
_EXP_DATA = {"scores": "scores_done"}
_TARGET_DATA = {"grads": "scored", "solved": "solved_done"}
_TARGET_FLAGS = ("scored", "solved_done")


@dataclass(frozen=True)
class ChunkDamage:
    """One damaged chunk (or a whole array when ``chunk`` is ``zarr.json``)."""

    array: str  # path in the store, e.g. "models/0/grads"
    chunk: str  # chunk key relative to the array, e.g. "c/1/0"; "zarr.json": the array's own metadata
    rows: tuple[int, int]  # [a, b) along axis 0: train rows, target rows, or shards (xtx_partials)
    kind: Kind
    detail: str = ""

    @property
    def unit(self) -> str:
        return "shards" if self.array.endswith(SHARD_ARRAYS) else "rows"

    def describe(self) -> str:
        a, b = self.rows
        what = {
            "missing": "is missing",
            "corrupt": self.detail or "is corrupt",
            "misplaced": self.detail or "does not belong here",
            "metadata": self.detail or "has wrong metadata",
        }[self.kind]
        where = "its zarr.json" if self.chunk == "zarr.json" else f"chunk {self.chunk}"
        if self.array.endswith(("inverse", "inverse_done")):  # one matrix: no rows to name
            return f"array {self.array}, {where}: {what}"
        return f"array {self.array}, {where} ({self.unit} {a}..{b - 1}): {what}"


@dataclass(frozen=True)
class ArrayCheck:
    """What was checked in one array."""

    array: str
    flag: str | None  # the flag array whose set rows this array must hold (None: a flag array)
    chunks: int  # chunks expected (data arrays: those holding flagged rows) or read (flag arrays)
    missing: int = 0
    corrupt: int = 0
    metadata: bool = False
    misplaced: int = 0

    @property
    def status(self) -> str:
        if self.metadata:
            return "metadata"
        if self.corrupt:
            return "corrupt"
        if self.misplaced:
            return "misplaced"
        return "missing" if self.missing else "intact"


@dataclass(frozen=True)
class VerifyReport:
    """The result of :func:`verify_store`: every array checked and every damage found."""

    location: str
    read_chunks: bool
    arrays: tuple[ArrayCheck, ...]
    damage: tuple[ChunkDamage, ...]
    inconsistent: tuple[str, ...] = ()  # e.g. a finalize record while the inverse is not marked written
    root: tuple[str, ...] = ()  # the root metadata or a sealed copy damaged (arrays checked against the intact one)

    @property
    def ok(self) -> bool:
        return not self.damage and not self.inconsistent and not self.root

    def summary(self) -> str:
        if self.ok:
            return f"store {self.location}: {len(self.arrays)} arrays intact"
        lines = list(self.root) + [d.describe() for d in self.damage] + list(self.inconsistent)
        more = f" (and {len(lines) - 5} more)" if len(lines) > 5 else ""
        return f"store {self.location}: " + "; ".join(lines[:5]) + more


@dataclass
class RepairResult:
    """What :func:`repair_store` did, one line each."""

    actions: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- checks
def _chunk_grid(arr: zarr.Array):
    return itertools.product(*(range(math.ceil(s / c)) for s, c in zip(arr.shape, arr.chunks, strict=True)))


def _read_flags(arr: zarr.Array, damage: list[ChunkDamage], sid: str) -> np.ndarray:
    """The flags of ``arr`` as bool; a flag chunk that does not decode or is not this place's counts as not set
    (and is damage)."""
    out = np.zeros(arr.shape[0], dtype=bool)
    present = stored_chunk_keys(arr)
    stored = [c for c in _chunk_grid(arr) if chunk_key(arr, c) in present]
    misplaced = dict(place_problems(arr, sid, stored))
    for coords in stored:
        key = chunk_key(arr, coords)
        a, b = chunk_rows_of(arr, coords)
        if coords in misplaced:
            damage.append(ChunkDamage(arr.path, key, (a, b), "misplaced", misplaced[coords]))
            continue
        try:
            out[a:b] = np.asarray(arr.get_block_selection(coords)).astype(bool)
        except Exception as e:  # zarr/numcodecs raise several types for an undecodable chunk
            damage.append(ChunkDamage(arr.path, key, (a, b), "corrupt", _decode_problem(e)))
    return out


def _damage(arr: zarr.Array, coords: tuple[int, ...], kind: Kind, detail: str) -> ChunkDamage:
    return ChunkDamage(arr.path, chunk_key(arr, coords), chunk_rows_of(arr, coords), kind, detail)


def _check_data(
    arr: zarr.Array, flagged: np.ndarray, damage: list[ChunkDamage], read_chunks: bool, flag: str, sid: str
) -> ArrayCheck:
    rows = np.flatnonzero(flagged)
    expected = chunk_coords_of_rows(arr, rows) if rows.size else []
    present = stored_chunk_keys(arr)
    missing = corrupt = misplaced = 0
    for coords in expected:
        key = chunk_key(arr, coords)
        if key not in present:
            missing += 1
            damage.append(ChunkDamage(arr.path, key, chunk_rows_of(arr, coords), "missing"))
    if read_chunks:  # every stored chunk, flagged or not (a damaged unflagged chunk would break a partial write)
        stored = [c for c in _chunk_grid(arr) if chunk_key(arr, c) in present]
        bad: dict[tuple[int, ...], str] = {}
        for coords in stored:
            problem = read_chunk(arr, coords)
            if problem is not None:
                bad[coords] = problem
                corrupt += 1
                damage.append(_damage(arr, coords, "corrupt", problem))
        for coords, problem in place_problems(arr, sid, [c for c in stored if c not in bad]):
            misplaced += 1
            damage.append(_damage(arr, coords, "misplaced", problem))
    return ArrayCheck(arr.path, flag, len(expected), missing, corrupt, misplaced=misplaced)


def _group_checks(
    store: TrakStore,
    group: zarr.Group,
    data: dict[str, str],
    flags: tuple[str, ...],
    damage: list[ChunkDamage],
    read_chunks: bool,
) -> list[ArrayCheck]:
    checks: list[ArrayCheck] = []
    arrays: dict[str, zarr.Array] = {}
    for name in list(flags) + list(data):
        path = f"{group.path}/{name}"
        spec = store.array_spec(path)
        try:
            arr = array_at(group, name)
        except Exception as e:  # absent, or an unreadable zarr.json
            n = spec.shape[0] if spec is not None else 0
            detail = "is missing" if isinstance(e, KeyError) else f"cannot be read ({type(e).__name__})"
            damage.append(ChunkDamage(path, "zarr.json", (0, n), "metadata", detail))
            checks.append(ArrayCheck(path, data.get(name), 0, metadata=True))
            continue
        problem = spec.problem(arr) if spec is not None else None
        if problem:
            damage.append(ChunkDamage(path, "zarr.json", (0, arr.shape[0]), "metadata", problem.split(": ", 1)[-1]))
            checks.append(ArrayCheck(path, data.get(name), 0, metadata=True))
            continue
        arrays[name] = arr
    flagged: dict[str, np.ndarray] = {}
    for name in flags:
        if name in arrays:
            before = len(damage)
            flagged[name] = _read_flags(arrays[name], damage, store.meta.store_id)
            bad = len(damage) - before
            checks.append(ArrayCheck(arrays[name].path, None, len(stored_chunk_keys(arrays[name])), corrupt=bad))
    for name, flag in data.items():
        if name in arrays:
            mask = flagged.get(flag)
            if mask is None:  # its flag array is damaged: all its rows get unflagged anyway
                mask = np.zeros(arrays[name].shape[0], dtype=bool)
            checks.append(_check_data(arrays[name], mask, damage, read_chunks, flag, store.meta.store_id))
    return checks


def verify_store(store: RunRecords, read_chunks: bool = True) -> VerifyReport:
    """Check every array of ``store``: its zarr.json against the root metadata, that every chunk holding rows
    marked written is present (one listing per array), and with ``read_chunks`` that every stored chunk decodes
    (zarr checks its crc32c). Reads nothing else and writes nothing. A store of another backend than Zarr keeps
    no chunks to lose: its report is empty (ok)."""
    if not isinstance(store, TrakStore):
        return VerifyReport(store.location, read_chunks, (), ())
    damage: list[ChunkDamage] = []
    checks: list[ArrayCheck] = []
    inconsistent: list[str] = []
    for mid in store.model_ids():
        g = store.model(mid).group
        data = {**_MODEL_DATA, "ggn_partials": "partial_done"} if store.meta.curvature == "ggn" else _MODEL_DATA
        checks += _group_checks(store, g, data, _MODEL_FLAGS, damage, read_chunks)
        if store.finalize_info(mid) is not None and not _inverse_done(g):
            inconsistent.append(f"model {mid}: finalized, but its inverse is not marked written")
    for exp in store.experiments():
        e = store.experiment(exp)
        if e.has_scores or "scores_done" in e.group:
            checks += _group_checks(store, e.group, _EXP_DATA, ("scores_done",), damage, read_chunks)
        for mid in e.model_ids():
            checks += _group_checks(store, e.model(mid).group, _TARGET_DATA, _TARGET_FLAGS, damage, read_chunks)
    return VerifyReport(
        store.location, read_chunks, tuple(checks), tuple(damage), tuple(inconsistent), store.root_problems
    )


def _inverse_done(g: zarr.Group) -> bool:
    try:
        return bool(np.asarray(array_at(g, "inverse_done")[:]).all())
    except Exception:  # absent or a damaged flag chunk (reported as damage)
        return False


def verify_location(location: str, storage_options: dict | None = None, read_chunks: bool = True) -> VerifyReport:
    """Open the store at ``location`` (without refusing damaged array metadata) and verify it."""
    return verify_store(TrakStore.open(location, storage_options, check_arrays=False), read_chunks)


def require_present(store: RunRecords, arrays: list[tuple[zarr.Array | StoredArray, np.ndarray]]) -> None:
    """Raise :class:`StoreDamageError` naming the array and chunk when a chunk holding the given rows is not in
    the store (zarr would read it back as zeros). ``arrays``: (array, axis-0 indices about to be read)."""
    _require_present(store.location, arrays)


# ---------------------------------------------------------------------------- repair
def _unflag(store: TrakStore, d: ChunkDamage, out: RepairResult) -> None:
    parts = d.array.split("/")
    a, b = d.rows
    rows = np.arange(a, b)
    if parts[0] == "models":
        mid, name = int(parts[1]), parts[2]
        if name in ("grads", "out_to_loss", "featurized"):
            store.unflag_train_rows(mid, rows)
            out.actions.append(
                f"model {mid}: rows {a}..{b - 1} unflagged (featurize, XᵀX partial, inverse, scores recomputed)"
            )
        elif name in ("inverse", "inverse_done"):
            store.unflag_inverse(mid)
            out.actions.append(f"model {mid}: inverse unflagged (finalize, scores recomputed)")
        elif name in SHARD_ARRAYS:
            store.model(mid).partial_done.oindex[rows] = 0
            out.actions.append(
                f"model {mid}: XᵀX partials of shards {a}..{b - 1} unflagged (recomputed from the grads)"
            )
    elif parts[0] == "experiments":
        exp = parts[1]
        e = store.experiment(exp)
        if len(parts) == 5:  # a target array: every score row of the experiment depends on it
            mid = int(parts[3])
            if e.has_model(mid):
                t = e.model(mid)
                if parts[4] in ("grads", "scored"):
                    t.scored.oindex[rows] = 0
                if "solved_done" in t.group:
                    t.solved_done.oindex[rows] = 0
            if e.has_scores:
                e.scores_done[:] = 0
            what = "G·A rows" if parts[4] in ("solved", "solved_done") else "target rows"
            out.actions.append(f"experiment {exp}: {what} {a}..{b - 1} of model {mid} and all score rows unflagged")
        elif e.has_scores:
            e.scores_done.oindex[rows] = 0
            out.actions.append(f"experiment {exp}: score rows {a}..{b - 1} unflagged")


def repair_store(store: TrakStore, report: VerifyReport) -> RepairResult:
    """Make the store whole without deleting intact data, then unflag what is lost so that a rerun recomputes
    exactly that: a damaged root metadata is restored from its sealed copy; an array whose zarr.json differs from
    the schema gets the schema's zarr.json back (its chunks kept, then checked); chunks that are corrupt or not
    their place's are removed; their rows, and what depends on them, unflagged. Take the store's run lock
    around it (``trakflow verify --repair`` does)."""
    out = RepairResult()
    if report.root:
        write_root(store.root, store.meta.model_dump(mode="json"))
        out.actions.append(
            "root metadata and its copies restored from the sealed copy (" + "; ".join(report.root) + ")"
        )
    restored = False
    for d in report.damage:
        if d.kind == "metadata":
            spec = store.array_spec(d.array)
            if spec is None:
                out.actions.append(f"{d.array}: not an array of this store's schema; left as it is")
                continue
            _restore_array_metadata(store, d.array, spec)
            restored = True
            out.actions.append(f"{d.array}: zarr.json restored from the schema ({d.detail}); its chunks kept")
    if restored:  # the restored arrays' chunks are checked now (their rows were not, under the wrong zarr.json)
        report = verify_store(store, read_chunks=True)
        for d in report.damage:
            if d.kind == "metadata":
                raise StoreDamageError(f"store {store.location}: {d.describe()}, still after restoring it; refusing")
    for d in report.damage:  # first remove what cannot be read, so that writing flags never reads it
        if d.kind in ("corrupt", "misplaced"):
            arr = store.raw_array(d.array)
            if arr is not None:
                coords = _coords_of_key(arr, d.chunk)
                store.delete_chunk(arr, coords)
                out.actions.append(f"{d.array}: chunk {d.chunk} removed ({d.kind})")
    for d in report.damage:
        _unflag(store, d, out)
    for mid in store.model_ids():
        if store.finalize_info(mid) is not None and not _inverse_done(store.model(mid).group):
            store.unflag_inverse(mid)
            out.actions.append(f"model {mid}: finalize record removed (inverse not written; finalize recomputes it)")
    return out


def _restore_array_metadata(store: TrakStore, path: str, spec: ArraySpec) -> None:
    """Write the schema's zarr.json for the array at ``path`` (no attributes: the store keeps none on arrays)."""
    doc = {**_expected_document(spec), "attributes": {}}
    buf = default_buffer_prototype().buffer.from_bytes(json.dumps(doc, indent=2).encode())
    sync(store.root.store.set(f"{path.strip('/')}/zarr.json", buf))


def _coords_of_key(arr: zarr.Array, key: str) -> tuple[int, ...]:
    for coords in _chunk_grid(arr):
        if chunk_key(arr, coords) == key:
            return coords
    raise KeyError(key)
