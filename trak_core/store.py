"""The Zarr v3 store: layout, metadata schema, per-row status, open/validate.

Layout (one group; a local path or any fsspec URL such as ``memory://x``, ``file:///x``, ``s3://b/x``)::

    /                       attrs: {"trakflow": StoreMetadata, "trakflow_pipeline": {...} (the pipeline's
                                   record, e.g. train_data_sha256)}
    /models/<id>/grads          (n, p)  float16|float32   projected, normalized train gradients X
    /models/<id>/out_to_loss    (n,)    float32           Q
    /models/<id>/featurized     (n,)    uint8             row status: 1 once its grads and Q are written
    /models/<id>/xtx_partials   (S, p(p+1)/2) float64     Xₛᵀ Xₛ of each shard s of ``shard_rows`` rows, its upper
                                                          triangle row by row (:func:`pack_upper`; (S, p, p) at
                                                          schema 3)
    /models/<id>/rowsum_partials (S, p+3) float64       [Xₛᵀqₛ, qₛᵀqₛ, Σ‖xᵢ‖⁴, Σqᵢ²‖xᵢ‖²] of each shard (q: Q; damping)
    /models/<id>/ggn_partials   (S, p(p+1)/2) float64     Xₛᵀ Rₛ Xₛ of each shard, packed as xtx_partials; only in a
                                                          store of ``curvature="ggn"`` (R = diag(Q(1 − Q)))
    /models/<id>/partial_done   (S,)    uint8             status of a shard's partials (all of them)
    /models/<id>/inverse        (1, p, p) float32         A = (H + λI)⁻¹, H = XᵀX (or XᵀRX: ``curvature``) (solved
                                                          in float64, traker's rescale applied; float32 is the
                                                          precision scores use it in)
    /models/<id>/inverse_done   (1,)    uint8
    /models/<id>                attrs: {"checkpoint": {"path", "sha256"}} (pipeline), {"finalize": {...}} once
                                the inverse is written
    /experiments/<exp>          attrs: {"num_targets": m, "target_data_sha256": ... (pipeline),
                                        "scored_with": [model ids the scores combine],
                                        "score_layout": {"chunk_rows", "done_rows"} (rows per chunk of
                                        scores and of scores_done)}
    /experiments/<exp>/models/<id>/grads   (m, p)   target gradients G
    /experiments/<exp>/models/<id>/scored  (m,)     uint8
    /experiments/<exp>/models/<id>/solved  (m, p)   float32   G A: the targets times the model's inverse
    /experiments/<exp>/models/<id>/solved_done (m,) uint8
    /experiments/<exp>/scores   (n, m)  float32        final scores (chunks of about SCORE_CHUNK_BYTES)
    /experiments/<exp>/scores_done (n,) uint8          row status, one chunk per shard

There are no features Φ = X A: scores are X (A Gᵀ), the stored gradients times ``solved``ᵀ, so a store holds
the n-row arrays once, and finalize is the p × p solve (schema 3; a schema-2 store, which held Φ, is refused).
Since schema 4 the XᵀX partials are packed upper triangles (a schema-3 store keeps its full ones and opens).

Every array's chunks are encoded ``bytes`` then zarr v3's ``crc32c`` codec (a checksum of each chunk,
checked by zarr on every read; no sharding: a chunk is the unit written, listed and verified). Each array's
zarr.json (shape, dtype, chunks, codecs) is checked against what the root metadata implies
(:meth:`TrakStore.array_spec`): all of them on open, or each as it is opened (``check_arrays="on_use"``, the
pipeline's tasks, after the run's plan checked them all); a chunk that fails its checksum raises
:class:`StoreDamageError` naming the array and the chunk (:class:`StoredArray`); trak_core.verify finds missing
and corrupt chunks of rows marked written, and repairs by unflagging them.

The row arrays of the models and targets share ``chunk_rows``, so a writer that owns whole chunks owns their
status too (zarr 3.1 loses data when two processes write the same chunk); an experiment's scores come in
chunks of whole ``chunk_rows`` that divide ``shard_rows`` and their flags in one chunk per shard, so a writer of
whole shards (a score task) owns those too. An experiment created before ``score_layout`` was recorded keeps
``chunk_rows`` for both. A row's status is set only after its data is
written, so a crash leaves unfinished rows visibly unfinished. Metadata is a pydantic model validated on
reopen: a mismatch is refused naming the field, before anything is written.

Every array and attribute above is read and written through this module (:class:`TrakStore`'s methods,
:class:`ModelArrays`, :class:`TargetArrays`, :class:`ExperimentArrays`); the run lock file
``trakflow.lock`` beside them is :class:`StoreLock`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal, cast
from urllib.parse import urlparse

import numpy as np
import zarr
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, model_validator
from zarr.codecs import Crc32cCodec
from zarr.core.metadata import ArrayV3Metadata

from .errors import BadInputError, LockLostError, StateError, StoreDamageError, StoreLockedError, StoreMismatchError

#: 4: each shard's XᵀX partial stored as its packed upper triangle (p(p+1)/2 float64: half the bytes); 3: no
#: features array — the inverse per model and G·A per (experiment, model) instead (2: features Φ stored; 1: no
#: checksums). A store of READABLE_SCHEMAS opens (3: its partials stay full p × p); an older one is refused
SCHEMA_VERSION = 4
READABLE_SCHEMAS = (3, 4)
_META_KEY = "trakflow"
_PIPELINE_KEY = "trakflow_pipeline"  # the pipeline's record (tasks/), kept beside the metadata


#: a chunk of a row array holds at most this many bytes by default (recorded per store as ``chunk_bytes``): a large
#: proj_dim (NoOpProjector: proj_dim = the number of parameters) gets few rows per chunk, a very wide row its
#: columns split, so writing one chunk never allocates more than this (zarr materializes whole chunks)
CHUNK_TARGET_BYTES = 32 << 20
#: at most this many rows per chunk (and never more than the array has)
MAX_CHUNK_ROWS = 1024
#: a chunk of an experiment's scores holds about this many bytes: as many rows (whole ``chunk_rows``, dividing
#: ``shard_rows``) as fit, so few targets do not mean many tiny chunk files (each a file and a zarr call)
SCORE_CHUNK_BYTES = 8 << 20


def choose_chunk_rows(
    row_bytes: int,
    rows: int,
    multiple_of: int | None = None,
    target_bytes: int = CHUNK_TARGET_BYTES,
    max_rows: int = MAX_CHUNK_ROWS,
) -> int:
    """Rows per chunk for rows of ``row_bytes`` bytes: as many as fit in ``target_bytes`` (at least 1), at most
    ``max_rows`` and ``rows``; with ``multiple_of`` (the shard rows) the largest divisor of it within those
    bounds, so that a shard is whole chunks (one writer per chunk)."""
    bound = max(1, min(int(max_rows), int(rows), int(target_bytes) // max(1, int(row_bytes))))
    if multiple_of is None:
        return bound
    return next(d for d in range(min(bound, int(multiple_of)), 0, -1) if multiple_of % d == 0)


def _score_layout(attrs: Mapping[str, Any], meta: StoreMetadata) -> tuple[int, int]:
    """Rows per chunk of an experiment's ``scores`` and of its ``scores_done`` flags: as recorded when the
    experiment was created (``score_layout``: scores by :meth:`StoreMetadata.score_chunk_rows`, flags one
    chunk per shard), or ``chunk_rows`` for both in an experiment created before that record existed."""
    layout = attrs.get("score_layout")
    if layout is None:
        return meta.rows_per_chunk, meta.rows_per_chunk
    score_rows, done_rows = int(layout["chunk_rows"]), int(layout["done_rows"])
    if score_rows <= 0 or done_rows % score_rows or meta.rows_per_shard % done_rows:
        raise StoreMismatchError(
            f"score_layout: {layout} does not tile this store's shards of {meta.rows_per_shard} rows (chunk rows "
            "dividing done rows dividing the shard)"
        )
    return score_rows, done_rows


@dataclass(frozen=True)
class ScoreWriter:
    """Writes an experiment's score rows and then their flags (:meth:`TrakStore.score_rows_writer`)."""

    store: TrakStore
    scores: StoredArray
    done: StoredArray

    @property
    def chunk_rows(self) -> int:
        """Rows per chunk of the scores (a writer of whole chunks needs no lock)."""
        return int(self.scores.chunks[0])

    @property
    def done_rows(self) -> int:
        """Rows per chunk of the flags (one per shard, or ``chunk_rows`` in an older experiment)."""
        return int(self.done.chunks[0])

    def rows(self, a: int, b: int, scores: np.ndarray) -> None:
        """The scores of train rows [a, b), not yet marked done."""
        self.scores[a:b] = scores.astype(np.float32, copy=False)

    def mark_done(self, a: int, b: int) -> None:
        """Mark rows [a, b) done (after their scores are written), if this process still holds the run lock."""
        self.store.check_lock()
        self.done[a:b] = 1

    def __call__(self, a: int, b: int, scores: np.ndarray) -> None:
        self.rows(a, b, scores)
        self.mark_done(a, b)


_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


def check_exp_name(name, field: str = "exp_name") -> None:
    """An experiment name is one folder of the store: letters, digits, ``_``, ``-``, ``.`` (at most 128, not
    starting with ``.`` or ``-``, no ``..``); separators, backslashes and ``..`` are refused."""
    if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name) or ".." in name:
        raise BadInputError(
            f"{field}: {name!r} is not a safe experiment name (it names a folder of the store): use "
            "1-128 letters, digits, '_', '-' or '.', not starting with '.' or '-', without '..', "
            "'/' or '\\'"
        )


def _versions() -> dict:
    import torch

    from . import __version__

    return {"trakflow": __version__, "torch": torch.__version__.split("+")[0], "zarr": zarr.__version__}


_SPEC_KEYS = ("kind", "proj_type", "seed", "grad_dim", "proj_dim")


def pack_upper(a: np.ndarray) -> np.ndarray:
    """The upper triangle of a (p, p) matrix, row by row: (p(p+1)/2,). Exact (a copy of the entries)."""
    p = a.shape[0]
    out = np.empty(p * (p + 1) // 2, dtype=a.dtype)
    off = 0
    for i in range(p):
        out[off : off + p - i] = a[i, i:]
        off += p - i
    return out


def unpack_upper(v: np.ndarray, p: int) -> np.ndarray:
    """The symmetric (p, p) matrix whose upper triangle :func:`pack_upper` gave as ``v``: the rows' upper parts
    copied (contiguous), then mirrored by panels (2.5× faster at p = 2048 than writing each column too)."""
    out = np.empty((p, p), dtype=v.dtype)
    off = 0
    for i in range(p):
        out[i, i:] = v[off : off + p - i]
        off += p - i
    return mirror_upper(out)


def mirror_upper(a: np.ndarray, block: int = 256) -> np.ndarray:
    """Fill the strict lower triangle of the square C-ordered ``a`` from its upper triangle, in place, by
    panels (cache-friendly transposed copies; about one pass over the matrix)."""
    p = a.shape[0]
    for i in range(0, p, block):
        j = min(i + block, p)
        d = a[i:j, i:j]
        low = np.tri(j - i, k=-1, dtype=bool)
        d[low] = d.T[low]
        if j < p:
            a[j:, i:j] = a[i:j, j:].T
    return a


class StoreMetadata(BaseModel):
    """What a store was created with. Every field but ``versions`` (and ``schema_version`` among the
    readable ones) must match on reopen."""

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
    chunk_rows: PositiveInt | None = None  # None: chosen by bytes (choose_chunk_rows), dividing shard_rows
    shard_rows: PositiveInt | None = None  # None: 8 chunks
    chunk_bytes: PositiveInt = CHUNK_TARGET_BYTES  # the most bytes a chunk of a row array holds (row_chunks)
    task: str = ""
    # the curvature H of the inverse A = (H + λI)⁻¹: "xtx" = XᵀX (traker's), "ggn" = XᵀRX, the Gauss-Newton matrix
    # of the loss in the model output, R = diag(rᵢ), rᵢ = Qᵢ(1 − Qᵢ) (scoring.loss_curvature); set at creation: a
    # "ggn" store keeps both partials per shard (λ's rule reads XᵀX's spectrum)
    curvature: Literal["xtx", "ggn"] = "xtx"
    versions: dict[str, str] = Field(default_factory=_versions)

    @model_validator(mode="after")
    def _shards_whole_chunks(self):
        if self.chunk_rows is None:
            self.chunk_rows = choose_chunk_rows(
                self.proj_dim * self.np_dtype.itemsize, self.train_set_size, self.shard_rows, self.chunk_bytes
            )
        if self.shard_rows is None:
            self.shard_rows = 8 * self.chunk_rows
        if self.shard_rows % self.chunk_rows:
            raise ValueError(f"shard_rows={self.shard_rows} must be a multiple of chunk_rows={self.chunk_rows}")
        return self

    @property
    def packed_partials(self) -> bool:
        """Whether the XᵀX partials are stored as packed upper triangles (schema 4 on) or full (schema 3)."""
        return self.schema_version >= 4

    @property
    def partial_shape(self) -> tuple[int, ...]:
        """The shape of one stored XᵀX partial: (p(p+1)/2,) packed, else (p, p)."""
        p = self.proj_dim
        return (p * (p + 1) // 2,) if self.packed_partials else (p, p)

    @classmethod
    def from_projector(cls, spec: dict, **fields) -> StoreMetadata:
        """Metadata for a projector ``spec()`` (kind-specific entries go to ``projector_params``)."""
        params = {k: v for k, v in spec.items() if k not in _SPEC_KEYS}
        return cls(
            grad_dim=spec["grad_dim"],
            proj_dim=spec["proj_dim"],
            projector=spec["kind"],
            proj_type=spec["proj_type"],
            proj_seed=spec["seed"],
            projector_params=json.loads(json.dumps(params)),
            **fields,
        )

    @property
    def rows_per_chunk(self) -> int:
        """``chunk_rows`` as an int: validation sets it (None only as an input, meaning "choose")."""
        if self.chunk_rows is None:
            raise StateError("StoreMetadata.chunk_rows is unset: build the metadata through validation")
        return self.chunk_rows

    @property
    def rows_per_shard(self) -> int:
        """``shard_rows`` as an int: validation sets it (None only as an input, meaning "choose")."""
        if self.shard_rows is None:
            raise StateError("StoreMetadata.shard_rows is unset: build the metadata through validation")
        return self.shard_rows

    @property
    def num_shards(self) -> int:
        return math.ceil(self.train_set_size / self.rows_per_shard)

    def shard_range(self, shard: int) -> tuple[int, int]:
        if not 0 <= shard < self.num_shards:
            raise BadInputError(f"shard {shard} out of range [0, {self.num_shards})")
        return shard * self.rows_per_shard, min((shard + 1) * self.rows_per_shard, self.train_set_size)

    @property
    def np_dtype(self):
        return np.dtype(self.dtype)

    def row_chunks(self, width: int | None, itemsize: int, rows: int | None = None) -> tuple[int, ...]:
        """The chunk shape of a row array of ``width`` columns (None: 1-D) of ``itemsize``-byte entries:
        ``rows`` rows (default ``chunk_rows``; a writer of whole shards owns whole chunks), and as many columns
        as keep the chunk within ``chunk_bytes`` (all of them unless one row is wider than that, or the array is
        a wide one such as the scores of many targets)."""
        rows = self.rows_per_chunk if rows is None else int(rows)
        if width is None:
            return (rows,)
        cols = max(1, self.chunk_bytes // (rows * int(itemsize)))
        return (rows, min(int(width), cols))

    def score_chunk_rows(self, num_targets: int) -> int:
        """Rows per chunk of an experiment's (n, m) float32 scores: the most whole ``chunk_rows`` that divide
        ``shard_rows`` and keep a chunk within SCORE_CHUNK_BYTES and ``chunk_bytes`` (at least ``chunk_rows``; at
        most a shard). A shard is whole score chunks, so a score task still owns the chunks it writes."""
        c, s = self.rows_per_chunk, self.rows_per_shard
        fit = max(c, min(SCORE_CHUNK_BYTES, self.chunk_bytes) // max(1, 4 * int(num_targets)))
        return max(d for d in range(c, min(fit, s) + 1, c) if s % d == 0)


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


def _open_zarr(
    location: str, mode: Literal["r", "r+", "a", "w", "w-"], storage_options: dict | None = None
) -> zarr.Group:
    if str(location).startswith("file://"):  # fsspec's local files do not create parents: use zarr's LocalStore
        location = urlparse(str(location)).path
    if not _is_url(location):  # zarr's LocalStore strips a relative root from keys by str.replace (`s/` in `models/`)
        location = os.path.abspath(location)
    options = storage_options if storage_options and _is_url(location) else None  # None: zarr's default
    return zarr.open_group(store=str(location), mode=mode, zarr_format=3, storage_options=options)


# ---------------------------------------------------------------------------- arrays and their checks
#: the codec names of every array: raw little-endian bytes, then a crc32c checksum per chunk
CODEC_NAMES = ("bytes", "crc32c")


def _codecs() -> list:
    """The bytes→bytes codecs of every array (after zarr's default ``bytes`` serializer)."""
    return [Crc32cCodec()]


@dataclass(frozen=True)
class ArraySpec:
    """What one array of the store must be (its zarr.json), derived from the root metadata."""

    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: str

    def problem(self, arr: zarr.Array) -> str | None:
        """What in ``arr``'s own metadata differs from this spec (None: it matches)."""
        if not isinstance(arr.metadata, ArrayV3Metadata):  # a v2 zarr.json has no codecs
            return f"array {arr.path}: its zarr.json is zarr format {arr.metadata.zarr_format}, not 3"
        codecs = tuple(c.to_dict()["name"] for c in arr.metadata.codecs)
        for field, want, have in (
            ("shape", self.shape, tuple(arr.shape)),
            ("dtype", self.dtype, str(arr.dtype)),
            ("chunks", self.chunks, tuple(arr.chunks)),
            ("codecs", CODEC_NAMES, codecs),
        ):
            if want != have:
                return (
                    f"array {arr.path}: its zarr.json says {field}={have}, but the store's metadata (root "
                    f"zarr.json) implies {field}={want}"
                )
        return None


def chunk_rows_of(arr: zarr.Array, coords: tuple[int, ...]) -> tuple[int, int]:
    """The rows [a, b) (indices along axis 0) chunk ``coords`` of ``arr`` holds."""
    step = arr.chunks[0]
    return coords[0] * step, min((coords[0] + 1) * step, arr.shape[0])


def chunk_key(arr: zarr.Array, coords: tuple[int, ...]) -> str:
    """The key of chunk ``coords`` relative to the array (e.g. ``c/1/0``)."""
    return arr.metadata.encode_chunk_key(tuple(coords))


def chunk_coords_of_rows(arr: zarr.Array, rows: np.ndarray) -> list[tuple[int, ...]]:
    """The chunks (coordinates) holding the given axis-0 indices (all chunks along the other axes)."""
    import itertools

    coords = np.asarray(rows, dtype=np.int64).reshape(-1) // int(arr.chunks[0])
    if coords.size and bool(np.all(coords[1:] >= coords[:-1])):  # sorted rows (the usual np.arange): no hashing
        firsts = coords[np.r_[True, coords[1:] != coords[:-1]]].tolist()
    else:
        firsts = np.unique(coords).tolist()
    rest = [range(math.ceil(s / c)) for s, c in zip(arr.shape[1:], arr.chunks[1:], strict=True)]
    return [(i, *other) for i in firsts for other in itertools.product(*rest)]


def stored_chunk_keys(arr: zarr.Array) -> set[str]:
    """The chunk keys (relative to the array) present in the store: one listing, no chunk is read."""
    from zarr.core.sync import sync

    prefix = arr.path.rstrip("/") + "/"

    async def _list() -> list[str]:
        return [k async for k in arr.store.list_prefix(prefix)]

    return {k[len(prefix) :] for k in sync(_list())} - {"zarr.json"}


def _decode_problem(e: BaseException) -> str:
    text = str(e)
    if "checksum" in text.lower():
        return "fails its crc32c checksum"
    return f"cannot be decoded ({type(e).__name__}: {text[:120]})"


def read_chunk(arr: zarr.Array, coords: tuple[int, ...]) -> str | None:
    """Read (decode) one chunk; what is wrong with it, or None when it decodes (zarr checks its crc32c)."""
    try:
        arr.get_block_selection(tuple(coords))
    except Exception as e:  # zarr/numcodecs raise several types for an undecodable chunk
        return _decode_problem(e)
    return None


def find_corrupt_chunk(arr: zarr.Array) -> tuple[tuple[int, ...], str] | None:
    """The first stored chunk of ``arr`` that does not decode, and why (None: all decode)."""
    import itertools

    present = stored_chunk_keys(arr)
    for coords in itertools.product(*(range(math.ceil(s / c)) for s, c in zip(arr.shape, arr.chunks, strict=True))):
        if chunk_key(arr, coords) in present:
            problem = read_chunk(arr, coords)
            if problem is not None:
                return coords, problem
    return None


def damaged_chunk_error(arr: zarr.Array, coords: tuple[int, ...], problem: str) -> StoreDamageError:
    a, b = chunk_rows_of(arr, coords)
    unit = "shards" if arr.path.endswith(SHARD_ARRAYS) else "rows"
    where, what = f" ({unit} {a}..{b - 1})", f"those {unit}"
    if arr.path.endswith(("inverse", "inverse_done")):  # one matrix: no rows to name
        where, what = "", "it"
    loc = str(arr.store)
    return StoreDamageError(
        f"store {loc}: array {arr.path}, chunk {chunk_key(arr, coords)}{where} {problem} (damaged "
        f"on disk). Run `trakflow verify {loc} --repair`, then rerun to recompute {what}."
    )


class StoredArray:
    """An array of the store: zarr's array (every chunk written, zeros too, so a missing chunk is damage), whose
    reads and writes raise :class:`StoreDamageError` naming the array and the chunk when a chunk does not decode
    (fails its crc32c checksum: flipped bits, truncation), instead of zarr's or numcodecs' own exception.
    Everything else is the zarr array's (``shape``, ``path``, ``get_block_selection``, ...)."""

    def __init__(self, array: zarr.Array):
        self.array = array

    def __getattr__(self, name: str):
        return getattr(self.array, name)

    def __len__(self) -> int:  # zarr 3's Array has no __len__: the length along axis 0, as numpy's
        return int(self.array.shape[0])

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self[...], dtype=dtype)

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except (KeyboardInterrupt, SystemExit, MemoryError, IndexError, TypeError):
            raise
        except Exception as e:
            if isinstance(e, (BadInputError, StateError)):
                raise
            found = find_corrupt_chunk(self.array)
            if found is None:
                raise
            raise damaged_chunk_error(self.array, *found) from None

    def __getitem__(self, selection):
        return self._guard(self.array.__getitem__, selection)

    def __setitem__(self, selection, value) -> None:  # a partial-chunk write reads the chunk first
        self._guard(self.array.__setitem__, selection, value)

    def read_into(self, a: int, b: int, out: np.ndarray) -> None:
        """``out[:] = self[a:b]`` along the first axis without allocating the result: zarr decodes the chunks
        straight into ``out`` (a caller's reused buffer)."""
        from zarr.core.buffer import default_buffer_prototype

        nd = default_buffer_prototype().nd_buffer.from_numpy_array(out)
        self._guard(lambda: self.array.get_basic_selection((slice(a, b),), out=nd))

    @property
    def oindex(self) -> _GuardedIndex:
        return _GuardedIndex(self, self.array.oindex)


class _GuardedIndex:
    def __init__(self, owner: StoredArray, index):
        self.owner, self.index = owner, index

    def __getitem__(self, selection):
        return self.owner._guard(self.index.__getitem__, selection)

    def __setitem__(self, selection, value) -> None:
        self.owner._guard(self.index.__setitem__, selection, value)


def _member_kind_error(group: zarr.Group, name: str, want: str) -> StoreDamageError:
    path = f"{group.path}/{name}".strip("/")
    return StoreDamageError(f"store {group.store}: {path} is not a zarr {want} (the store is damaged)")


def array_at(group: zarr.Group, name: str) -> zarr.Array:
    """``group[name]``, which must be an array (zarr types a member as ``Array | Group``): KeyError when it is
    absent, :class:`StoreDamageError` when it is a group."""
    node = group[name]
    if not isinstance(node, zarr.Array):
        raise _member_kind_error(group, name, "array")
    return node


def group_at(group: zarr.Group, name: str) -> zarr.Group:
    """``group[name]``, which must be a group: KeyError when it is absent, :class:`StoreDamageError` when it is
    an array."""
    node = group[name]
    if not isinstance(node, zarr.Group):
        raise _member_kind_error(group, name, "group")
    return node


def _attrs(node: zarr.Group | zarr.Array) -> MutableMapping[str, Any]:
    """``node.attrs``, its values typed Any: zarr types each as JSON (a union mypy cannot narrow per key); what
    each key of the store holds is this module's schema (written only through it)."""
    return cast(MutableMapping[str, Any], node.attrs)


def _stored(group: zarr.Group, name: str, check: Callable[[zarr.Array], None] | None = None) -> StoredArray:
    """The array ``name`` of ``group``; ``check(array)`` first when given (a store opened with
    ``check_arrays="on_use"``: its zarr.json against the root metadata)."""
    try:
        arr = array_at(group, name)
    except KeyError:
        path = f"{group.path}/{name}".strip("/")
        raise StoreDamageError(
            f"store {group.store}: array {path} is missing (its zarr.json is gone). Run "
            f"`trakflow verify {group.store} --repair`, then rerun to recompute it."
        ) from None
    if check is not None:
        check(arr)
    return StoredArray(arr.with_config({"write_empty_chunks": True}))


def _damaged_metadata(location: str, problems: list[str]) -> StoreDamageError:
    """The error for arrays whose zarr.json differs from what the root metadata implies."""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return StoreDamageError(
        f"store {location}: {problems[0]}{more}. The array's metadata was edited or "
        f"damaged: run `trakflow verify {location} --repair` (it recreates the array "
        "and unflags its rows), then rerun."
    )


def _pinned(pins: dict | None, key: tuple, open_: Callable[[], Any]) -> Any:
    """``open_()``, or within :meth:`TrakStore.pinned` (``pins``: the handles opened there) the one opened first
    under ``key``."""
    if pins is None:
        return open_()
    node = pins.get(key)
    if node is None:
        node = pins[key] = open_()
    return node


@dataclass(frozen=True)
class _Node:
    """A group of the store and its arrays, opened on access; within :meth:`TrakStore.pinned` (``pins`` set)
    each array is opened once; ``check`` (a store opened with ``check_arrays="on_use"``) checks each array's
    zarr.json as it is opened."""

    group: zarr.Group
    pins: dict | None = dataclasses.field(default=None, repr=False, compare=False)
    check: Callable[[zarr.Array], None] | None = dataclasses.field(default=None, repr=False, compare=False)

    def _array(self, name: str) -> StoredArray:
        return _pinned(self.pins, ("array", self.group.path, name), lambda: _stored(self.group, name, self.check))


#: the per-model arrays with one entry per shard (not per row)
SHARD_ARRAYS = ("xtx_partials", "rowsum_partials", "ggn_partials", "partial_done")


@dataclass(frozen=True)
class ModelArrays(_Node):
    """The arrays of one checkpoint (``/models/<id>``)."""

    @property
    def grads(self) -> StoredArray:
        """(n, p) projected, normalized train gradients X."""
        return self._array("grads")

    @property
    def out_to_loss(self) -> StoredArray:
        """(n,) float32 Q."""
        return self._array("out_to_loss")

    @property
    def featurized(self) -> StoredArray:
        """(n,) uint8 row status: 1 once the row's grads and Q are written."""
        return self._array("featurized")

    @property
    def xtx_partials(self) -> StoredArray:
        """Xₛᵀ Xₛ of each shard, float64: (S, p(p+1)/2) packed upper triangles (``meta.partial_shape``; (S, p, p)
        at schema 3)."""
        return self._array("xtx_partials")

    @property
    def rowsum_partials(self) -> StoredArray:
        """(S, p + 3) float64 [Xₛᵀqₛ, qₛᵀqₛ, Σ‖xᵢ‖⁴, Σqᵢ²‖xᵢ‖²] of each shard (reduce.RowSums)."""
        return self._array("rowsum_partials")

    @property
    def ggn_partials(self) -> StoredArray:
        """(S, p(p+1)/2) float64 Xₛᵀ Rₛ Xₛ of each shard, packed (a store of ``curvature="ggn"`` only)."""
        return self._array("ggn_partials")

    @property
    def partial_done(self) -> StoredArray:
        """(S,) uint8 shard status of ``xtx_partials``, ``rowsum_partials`` (and ``ggn_partials``)."""
        return self._array("partial_done")

    @property
    def inverse(self) -> StoredArray:
        """(1, p, p) float32 A = (XᵀX + λI)⁻¹ (traker's rescale applied)."""
        return self._array("inverse")

    @property
    def inverse_done(self) -> StoredArray:
        """(1,) uint8 status of ``inverse``."""
        return self._array("inverse_done")


@dataclass(frozen=True)
class TargetArrays(_Node):
    """The target gradients of one checkpoint in one experiment (``/experiments/<exp>/models/<id>``)."""

    @property
    def grads(self) -> StoredArray:
        """(m, p) target gradients G."""
        return self._array("grads")

    @property
    def scored(self) -> StoredArray:
        """(m,) uint8 row status of ``grads``."""
        return self._array("scored")

    @property
    def solved(self) -> StoredArray:
        """(m, p) float32 G A: the target gradients times the model's inverse (scores are X · solvedᵀ)."""
        return self._array("solved")

    @property
    def solved_done(self) -> StoredArray:
        """(m,) uint8 row status of ``solved``."""
        return self._array("solved_done")


@dataclass(frozen=True)
class ExperimentArrays(_Node):
    """One experiment (``/experiments/<exp>``): its targets and its combined scores."""

    @property
    def name(self) -> str:
        return self.group.basename

    @property
    def num_targets(self) -> int:
        return int(_attrs(self.group)["num_targets"])

    @property
    def has_scores(self) -> bool:
        return "scores" in self.group

    @property
    def scores(self) -> StoredArray:
        """(n, m) float32 combined scores."""
        return self._array("scores")

    @property
    def scores_done(self) -> StoredArray:
        """(n,) uint8 row status of ``scores``."""
        return self._array("scores_done")

    def _models(self) -> zarr.Group:
        return _pinned(self.pins, ("group", self.group.path, "models"), lambda: group_at(self.group, "models"))

    def model_ids(self) -> list[int]:
        return sorted(int(k) for k in self._models().group_keys())

    def has_model(self, model_id: int) -> bool:
        return str(int(model_id)) in self._models()

    def model(self, model_id: int) -> TargetArrays:
        return _pinned(
            self.pins,
            ("target", self.group.path, int(model_id)),
            lambda: TargetArrays(group_at(self._models(), str(int(model_id))), self.pins, self.check),
        )


# ---------------------------------------------------------------------------- run lock
class StoreLock:
    """The run lock of a store: a small JSON file ``trakflow.lock`` (host, pid, run, since, token) in its folder.

    It needs only the location (a run locks before the plan creates the store). ``with
    StoreLock(location, run): ...`` holds it for a block. A lock left by a dead process of this host (a
    crash, SIGKILL) is stale and taken over, so a rerun resumes. Workers of one run (Dask, processes)
    write disjoint chunks and need no lock; the store checks before each commit of row flags that the lock
    it was opened under is still in place (:meth:`TrakStore.check_lock`).

    On a local filesystem every step is atomic, so of N processes racing for one lock exactly one wins:

    * a free lock is created by writing the payload to a private temporary file and hard-linking it to
      ``trakflow.lock`` (``link`` fails when the name exists; readers never see a half-written lock);
    * a stale lock is taken over by compare-and-swap: the racers that read the same stale content ``H``
      race to create ``trakflow.lock.takeover-<sha256(H)>`` with ``O_CREAT | O_EXCL``; the one that
      creates it re-reads the lock, and only if it still holds ``H`` renames its own payload over it
      (``os.replace``), then removes the claim file. The others see the new, live holder and are refused.

    On fsspec object stores (``s3://``, ``memory://``, ...) there is no such primitive: the lock is
    written, then read back (best effort; two racers can both pass in a narrow window). The per-commit
    check then stops the run whose lock was overwritten before it commits more rows.
    """

    NAME = "trakflow.lock"
    _CLAIM = ".takeover-"
    _ATTEMPTS = 200  # rounds of read → create/swap before giving up (a loser waits for the winner to install)

    def __init__(self, location: str, run: str = ""):
        self.location = str(location)
        self.run = run

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
        return fs, path.rstrip("/") + "/" + self.NAME

    def _local_path(self) -> str | None:
        """The lock file's path on a local filesystem (None for other fsspec stores)."""
        loc = self.location
        if loc.startswith("file://"):
            loc = urlparse(loc).path
        if _is_url(loc):
            return None
        return os.path.abspath(loc).rstrip("/") + "/" + self.NAME

    def read_raw(self) -> bytes | None:
        """The lock file's bytes (None: there is no lock)."""
        local = self._local_path()
        try:
            if local is not None:
                with open(local, "rb") as fh:
                    return fh.read()
            fs, path = self._fs_and_path()
            with fs.open(path, "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None

    def fingerprint(self) -> str | None:
        """sha256 of the lock file's bytes (None: no lock). Any change of holder changes it."""
        raw = self.read_raw()
        return None if raw is None else hashlib.sha256(raw).hexdigest()

    def _parse(self, raw: bytes) -> dict:
        """The holder recorded in ``raw``; a torn (empty, truncated, not JSON) lock file gives
        ``{"torn": True, ...}`` with ``run`` saying so."""
        try:
            holder = json.loads(raw.decode())
            if isinstance(holder, dict) and "pid" in holder and "host" in holder:
                return holder
        except (UnicodeDecodeError, ValueError):
            pass
        what = "empty" if not raw.strip() else f"not a lock record ({raw[:40]!r})"
        return {"torn": True, "host": None, "pid": None, "run": f"<torn lock file: {what}>", "since": 0}

    def holder(self) -> dict | None:
        """Who holds the lock (``{"host", "pid", "run", "since", "token"}``), None if nobody; a torn lock file
        (empty or unreadable: a crash while it was written, or damage) gives a dict with ``"torn": True``."""
        raw = self.read_raw()
        return None if raw is None else self._parse(raw)

    def _torn_error(self, holder: dict) -> StoreLockedError:
        _, path = self._fs_and_path()
        return StoreLockedError(
            f"store {self.location}: its lock file {path} is {holder['run'][len('<torn lock file: ') : -1]} "
            "(torn: a run crashed while writing it, or the file was damaged), so the run holding the store "
            f"cannot be identified. If no run uses this store, remove the lock with `trakflow unlock "
            f"{self.location}`."
        )

    @staticmethod
    def holder_alive(holder: dict) -> bool:
        """Whether a lock holder may still run (a holder on another host, or a torn lock, is assumed alive)."""
        if holder.get("torn") or holder.get("host") != socket.gethostname():
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

    @staticmethod
    def _is_me(holder: dict) -> bool:
        return holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid()

    def _locked_error(self, holder: dict) -> StoreLockedError:
        return StoreLockedError(
            f"store {self.location} is in use by run {holder.get('run') or '?'} (pid {holder.get('pid')} on "
            f"{holder.get('host')}); two runs on one store are refused. Wait for it, or if that run is "
            f"gone, remove the lock with `trakflow unlock {self.location}`."
        )

    # local, atomic steps
    def _write_private(self, path: str, payload: bytes) -> str:
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "xb") as fh:
            fh.write(payload)
        return tmp

    def _create_local(self, path: str, payload: bytes) -> bool:
        """Create the lock atomically with its content; False when it exists already."""
        tmp = self._write_private(path, payload)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links: exclusive create, then write
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as fh:
                fh.write(payload)
            return True
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def _swap_local(self, path: str, seen: bytes, payload: bytes) -> bool | None:
        """Replace the lock holding ``seen`` by ``payload`` if it still holds ``seen`` (compare-and-swap).
        False: another process changed or is taking over the lock; None: a takeover claim on ``seen`` was
        left by a process that died in the middle of it."""
        claim = path + self._CLAIM + hashlib.sha256(seen).hexdigest()[:32]
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                with open(claim, "rb") as fh:
                    other = json.loads(fh.read().decode() or "{}")
            except (OSError, ValueError):
                return False
            return None if other and not self.holder_alive(other) else False
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(payload)
            if self.read_raw() != seen:
                return False  # installed or released by someone else meanwhile
            tmp = self._write_private(path, payload)
            os.replace(tmp, path)
            return True
        finally:
            with contextlib.suppress(OSError):
                os.unlink(claim)

    def acquire(self, run: str | None = None, force: bool = False) -> dict:
        """Take the lock or raise :class:`StoreLockedError` naming the live holder (re-entrant within one
        process; a dead holder of this host is taken over atomically; ``force`` takes it from a live one;
        a torn lock file is refused with what to do)."""
        run = self.run if run is None else run
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "run": run,
            "since": time.time(),
            "token": uuid.uuid4().hex,
        }
        payload = json.dumps(me).encode()
        local = self._local_path()
        orphan_claim = False
        for _ in range(self._ATTEMPTS):
            raw = self.read_raw()
            if raw is None:
                if local is not None:
                    if self._create_local(local, payload):
                        return me
                    continue  # another process created it: look at it
                return self._write_remote(payload, me)
            holder = self._parse(raw)
            if holder.get("torn"):
                if not force:
                    raise self._torn_error(holder)
            elif self._is_me(holder):
                return holder  # re-entrant within one process
            elif not force and self.holder_alive(holder):
                raise self._locked_error(holder)
            if local is None:
                return self._write_remote(payload, me)
            won = self._swap_local(local, raw, payload)
            if won:
                return me
            orphan_claim = won is None
            time.sleep(0.005)  # another process is taking it over: give it time to install its lock
        _, path = self._fs_and_path()
        why = (
            f"a takeover claim {path}{self._CLAIM}* was left by a process that died while taking over the lock"
            if orphan_claim
            else "other processes kept changing the lock"
        )
        raise StoreLockedError(
            f"store {self.location}: could not take the lock ({why}). If no run uses this store, "
            f"remove the lock with `trakflow unlock {self.location}`."
        )

    def _write_remote(self, payload: bytes, me: dict) -> dict:
        fs, path = self._fs_and_path()
        with fs.open(path, "wb") as fh:
            fh.write(payload)
        if self.read_raw() != payload:  # lost a race on a store without an atomic primitive
            raise StoreLockedError(f"store {self.location}: another run took the lock at the same time")
        return me

    def release(self) -> None:
        """Remove the lock if this process holds it."""
        holder = self.holder()
        if holder is not None and not holder.get("torn") and self._is_me(holder):
            fs, path = self._fs_and_path()
            with contextlib.suppress(FileNotFoundError):
                fs.rm(path)

    def force_unlock(self) -> dict | None:
        """Remove the lock whoever holds it (and takeover claims left beside it); returns the previous holder
        (None: it was not locked; ``"torn": True`` for a torn lock file)."""
        fs, path = self._fs_and_path()
        holder = self.holder()
        if holder is not None:
            with contextlib.suppress(FileNotFoundError):
                fs.rm(path)
        local = self._local_path()
        if local is not None:
            folder, base = os.path.split(local)
            with contextlib.suppress(OSError):
                for name in os.listdir(folder):
                    if name.startswith(base + self._CLAIM):
                        with contextlib.suppress(OSError):
                            os.unlink(os.path.join(folder, name))
        return holder

    @contextlib.contextmanager
    def held(self, run: str | None = None, force: bool = False):
        """``with lock.held(run_name): ...`` — hold the lock for the block."""
        self.acquire(run, force)
        try:
            yield self
        finally:
            self.release()

    def __enter__(self) -> StoreLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class TrakStore:
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
        arrays of a store that may hold hundreds); False: never (trak_core.verify, which reports those itself)."""
        if check_arrays not in (True, False, "on_use"):
            raise BadInputError(f"check_arrays={check_arrays!r}: expected True, False or 'on_use'")
        try:
            g = _open_zarr(location, "r" if mode == "r" else "r+", storage_options)
        except Exception as e:  # zarr raises several types for a missing group
            _refuse_orphan_arrays(location, storage_options)
            raise BadInputError(f"store: no trakflow store at {location} ({type(e).__name__}: {e})") from None
        if _META_KEY not in g.attrs:
            _refuse_orphan_arrays(location, storage_options)
            raise BadInputError(f"store: {location} is a Zarr group but not a trakflow store (no metadata)")
        meta = StoreMetadata.model_validate(g.attrs[_META_KEY])
        if meta.schema_version not in READABLE_SCHEMAS:
            raise StoreMismatchError(
                f"schema_version: the store at {location} has schema_version={meta.schema_version}, written by an "
                f"earlier trakflow ({meta.versions.get('trakflow', 'unknown version')}); this version reads "
                f"schema_version {' and '.join(map(str, READABLE_SCHEMAS))} (no features array: the inverse per "
                "checkpoint instead). Use a new "
                "store location; the checkpoints and data are unchanged."
            )
        store = cls(location, g, meta, check_on_use=check_arrays == "on_use")
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
        g.require_group("models")
        g.require_group("experiments")
        g.attrs[_META_KEY] = meta.model_dump(mode="json")
        return cls(location, g, meta)

    def validate(self, expected: StoreMetadata) -> None:
        """Refuse (:class:`StoreMismatchError`) when ``expected`` differs from the stored metadata."""
        have = self.meta.model_dump()
        want = expected.model_dump()
        for field in StoreMetadata.model_fields:
            if field == "versions" or (field == "schema_version" and have[field] in READABLE_SCHEMAS):
                continue  # a store of an older readable schema is used in its own layout
            if have[field] != want[field]:
                raise StoreMismatchError(
                    f"store at {self.location} was created with {field}={have[field]!r}, but this run asks "
                    f"for {field}={want[field]!r}. Use another store, or the same {field}."
                )

    # ---------------------------------------------------------------- run lock
    @property
    def lock(self) -> StoreLock:
        """This store's run lock (``store.lock.acquire(run)``, ``with store.lock.held(run): ...``)."""
        return StoreLock(self.location)

    def check_lock(self) -> None:
        """Raise :class:`LockLostError` when the run lock present when this store was opened has since been
        removed or taken by another run (one small read; nothing when the store was opened unlocked). Called
        before every commit of row flags, so a run that lost its lock stops before marking more rows done."""
        if self._lock_seen is None:
            return
        lock = StoreLock(self.location)
        raw = lock.read_raw()
        if raw is not None and hashlib.sha256(raw).hexdigest() == self._lock_seen:
            return
        if raw is None:
            what = "was removed (e.g. `trakflow unlock`)"
        else:
            h = lock._parse(raw)
            what = f"is now held by run {h.get('run') or '?'} (pid {h.get('pid')} on {h.get('host')})"
        raise LockLostError(
            f"store {self.location}: the run lock this run was writing under {what}; stopping before committing "
            "more rows (rows already marked done are complete). Make sure only one run uses the store, then "
            "rerun: it resumes from the rows marked done."
        )

    # ---------------------------------------------------------------- helpers
    @contextlib.contextmanager
    def pinned(self):
        """Within the block, the groups and arrays the store's methods open are opened once and reused: each
        open reads a zarr.json (~0.2 ms here), and a scoring call opens about a hundred. For a block in which no
        other process adds or removes the groups and arrays it uses or changes their attributes — one scoring
        call of the run that holds the store's lock. Blocks nest (the outer one's handles are kept); this
        thread's calls only."""
        me = threading.get_ident()
        if me in self._pinned:
            yield self
            return
        self._pinned[me] = {}
        try:
            yield self
        finally:
            del self._pinned[me]

    @property
    def _pins(self) -> dict | None:
        """This thread's handles within :meth:`pinned` (None outside it)."""
        return self._pinned.get(threading.get_ident())

    def _pin(self, key: tuple, open_: Callable[[], Any]) -> Any:
        return _pinned(self._pins, key, open_)

    def _models(self) -> zarr.Group:
        return self._pin(("group", "models"), lambda: group_at(self.root, "models"))

    def _experiments(self) -> zarr.Group:
        return self._pin(("group", "experiments"), lambda: group_at(self.root, "experiments"))

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
            return _stored(g, name, self._check)
        shape = (n,) if width is None else (n, width)
        chunks = self.meta.row_chunks(width, np.dtype(dtype).itemsize, chunk_rows)
        g.create_array(name, shape=shape, chunks=chunks, dtype=dtype, compressors=_codecs(), fill_value=0)
        return _stored(g, name)

    def array_spec(self, path: str) -> ArraySpec | None:
        """What the array at ``path`` (e.g. ``models/0/grads``) must be, from the root metadata; None for a path
        that is not one of the store's arrays."""
        m = self.meta
        n, p, s = m.train_set_size, m.proj_dim, m.num_shards
        parts = path.strip("/").split("/")

        def rows(k: int, width: int | None, dtype: str, chunk_rows: int | None = None) -> ArraySpec:
            return ArraySpec(
                (k,) if width is None else (k, width), m.row_chunks(width, np.dtype(dtype).itemsize, chunk_rows), dtype
            )

        if len(parts) == 3 and parts[0] == "models":
            if parts[2] == "ggn_partials" and m.curvature != "ggn":
                return None
            return {
                "ggn_partials": ArraySpec((s, *m.partial_shape), (1, *m.partial_shape), "float64"),
                "grads": rows(n, p, m.dtype),
                "out_to_loss": rows(n, None, "float32"),
                "featurized": rows(n, None, "uint8"),
                "xtx_partials": ArraySpec((s, *m.partial_shape), (1, *m.partial_shape), "float64"),
                "rowsum_partials": ArraySpec((s, p + 3), (1, p + 3), "float64"),
                "partial_done": ArraySpec((s,), (1,), "uint8"),
                "inverse": ArraySpec((1, p, p), (1, p, p), "float32"),
                "inverse_done": ArraySpec((1,), (1,), "uint8"),
            }.get(parts[2])
        if len(parts) in (3, 5) and parts[0] == "experiments":
            try:
                attrs = _attrs(self._experiments()[parts[1]])
                t = int(attrs["num_targets"])
                score_rows, done_rows = _score_layout(attrs, m)
            except (KeyError, TypeError, ValueError):
                return None
            if len(parts) == 3:
                return {
                    "scores": rows(n, t, "float32", score_rows),
                    "scores_done": rows(n, None, "uint8", done_rows),
                }.get(parts[2])
            if parts[2] == "models":
                return {
                    "grads": rows(t, p, m.dtype),
                    "scored": rows(t, None, "uint8"),
                    "solved": rows(t, p, "float32"),
                    "solved_done": rows(t, None, "uint8"),
                }.get(parts[4])
        return None

    def array_groups(self) -> list[zarr.Group]:
        """The groups holding the store's arrays: each model's, each experiment's and its models'."""
        models = self._models()
        out = [group_at(models, k) for k in sorted(models.group_keys(), key=_natural)]
        for e in sorted(self._experiments().group_keys()):
            eg = group_at(self._experiments(), e)
            out.append(eg)
            if "models" in eg:
                em = group_at(eg, "models")
                out += [group_at(em, k) for k in sorted(em.group_keys(), key=_natural)]
        return out

    def array_problems(self) -> list[str]:
        """Each array whose zarr.json cannot be read or differs from :meth:`array_spec` (one line each)."""
        problems = []
        for g in self.array_groups():
            for name in sorted(g.array_keys()):
                path = f"{g.path}/{name}"
                try:
                    arr = array_at(g, name)
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
        """Remove one chunk (a damaged one, before its rows are unflagged and recomputed)."""
        from zarr.core.sync import sync

        sync(arr.store.delete(f"{arr.path}/{chunk_key(arr, coords)}"))

    def delete_array(self, path: str) -> None:
        """Remove an array (its zarr.json and chunks); the plan (init_model, ...) creates it again."""
        from zarr.core.sync import sync

        async def _delete() -> None:
            await self.root.store.delete_dir(path.strip("/"))

        sync(_delete())

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
        return str(int(model_id)) in self._models()

    def init_model(self, model_id: int) -> ModelArrays:
        """Create the arrays of ``model_id`` (idempotent). Call from one process before fanning out."""
        _check_model_id(model_id)
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
        return ModelArrays(g, check=self._check)

    def model(self, model_id: int) -> ModelArrays:
        def open_() -> ModelArrays:
            try:
                return ModelArrays(group_at(self._models(), str(int(model_id))), self._pins, self._check)
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
        m.inverse[0] = np.asarray(inverse).astype(np.float32)
        self.check_lock()
        m.inverse_done[0] = 1

    def inverse(self, model_id: int) -> np.ndarray:
        """The (p, p) float32 inverse of a finalized ``model_id``."""
        if not self.is_finalized(model_id):
            raise StateError(f"model_id={model_id} is not finalized; finalize it first")
        return np.asarray(self.model(model_id).inverse[0])

    def is_finalized(self, model_id: int) -> bool:
        return self.has_model(model_id) and self.finalize_info(model_id) is not None

    def write_train_rows(self, model_id: int, rows, grads: np.ndarray, out_to_loss: np.ndarray) -> None:
        """Write rows (slice or sorted index array) then mark them featurized."""
        if self.is_finalized(model_id):
            raise StateError(
                f"model_id={model_id} is already finalized; featurizing it again would make its "
                "inverse stale. Use a new model_id or a new store."
            )
        m = self.model(model_id)
        _write_rows(m.grads, rows, grads.astype(self.meta.np_dtype, copy=False))
        _write_rows(m.out_to_loss, rows, out_to_loss.astype(np.float32, copy=False))
        self.check_lock()
        _write_rows(m.featurized, rows, np.ones(grads.shape[0], dtype=np.uint8))

    def write_partial(
        self, model_id: int, shard: int, partial: np.ndarray, row_sums: np.ndarray, ggn: np.ndarray | None = None
    ) -> None:
        """Write a shard's Xₛᵀ Xₛ (p, p, symmetric, or already :func:`pack_upper`-ed; stored packed at schema 4),
        its row sums (p + 3,) and, in a store of ``curvature="ggn"`` (where it is required), its Xₛᵀ Rₛ Xₛ
        (``ggn``, as ``partial``), then mark the shard's partials done."""
        if (ggn is not None) != (self.meta.curvature == "ggn"):
            raise BadInputError(
                f"write_partial: the store's curvature is {self.meta.curvature!r}; "
                + ("its Xₛᵀ Rₛ Xₛ partial (ggn=) is required" if ggn is None else "it keeps no Xₛᵀ Rₛ Xₛ partial")
            )
        m = self.model(model_id)
        packed = self.meta.packed_partials
        m.xtx_partials[shard] = pack_upper(partial) if packed and partial.ndim == 2 else partial
        m.rowsum_partials[shard] = row_sums
        if ggn is not None:
            m.ggn_partials[shard] = pack_upper(ggn) if packed and ggn.ndim == 2 else ggn
        self.check_lock()
        m.partial_done[shard] = 1

    # ---------------------------------------------------------------- experiments
    def experiments(self) -> list[str]:
        return sorted(self._experiments().group_keys())

    def init_experiment(self, exp_name: str, num_targets: int) -> ExperimentArrays:
        check_exp_name(exp_name)
        if not isinstance(num_targets, (int, np.integer)) or num_targets <= 0:
            raise BadInputError(f"num_targets must be a positive integer, got {num_targets!r}")
        exps = self._experiments()
        if exp_name in exps:
            have = exps[exp_name].attrs.get("num_targets")
            if have != int(num_targets):
                raise StoreMismatchError(f"experiment {exp_name!r} exists with num_targets={have}, not {num_targets}")
            return ExperimentArrays(group_at(exps, exp_name), check=self._check)
        g = exps.require_group(exp_name)
        g.require_group("models")
        g.attrs["num_targets"] = int(num_targets)
        g.attrs["score_layout"] = {
            "chunk_rows": self.meta.score_chunk_rows(int(num_targets)),
            "done_rows": self.meta.rows_per_shard,
        }
        return ExperimentArrays(g, check=self._check)

    def experiment(self, exp_name: str) -> ExperimentArrays:
        def open_() -> ExperimentArrays:
            try:
                return ExperimentArrays(group_at(self._experiments(), exp_name), self._pins, self._check)
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
        g = group_at(e.group, "models").require_group(str(int(model_id)))
        self._row_array(g, "grads", self.meta.dtype, self.meta.proj_dim, rows=m)
        self._row_array(g, "scored", "uint8", rows=m)
        self._row_array(g, "solved", "float32", self.meta.proj_dim, rows=m)
        self._row_array(g, "solved_done", "uint8", rows=m)
        return TargetArrays(g, check=self._check)

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

    def write_score_rows(self, exp_name: str, a: int, b: int, scores: np.ndarray) -> None:
        """Write the combined scores of train rows [a, b) then mark them done."""
        self.score_rows_writer(exp_name)(a, b, scores)

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


def _natural(key: str):
    return (0, int(key)) if key.isdigit() else (1, key)


def _refuse_orphan_arrays(location: str, storage_options: dict | None = None) -> None:
    """Refuse (:class:`StoreDamageError`) a location that holds a store's arrays but no root metadata (its
    root zarr.json deleted or rewritten): creating a store there would adopt arrays made with other settings."""
    loc = str(location)
    if loc.startswith("file://"):
        loc = urlparse(loc).path
    try:
        if _is_url(loc):
            from fsspec.core import url_to_fs

            fs, path = url_to_fs(loc, **(storage_options or {}))
            names = [n.rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(path, detail=False)]
        else:
            names = os.listdir(loc)
    except (FileNotFoundError, NotADirectoryError):
        return
    found = sorted(n for n in names if n in ("models", "experiments"))
    if found:
        raise StoreDamageError(
            f"store {location}: it holds a store's arrays ({', '.join(n + '/' for n in found)}) but no root metadata "
            "(its root zarr.json is missing or has no trakflow metadata), so the settings its arrays were made "
            "with cannot be checked; refusing to create a store over them. Restore the root zarr.json (e.g. from a "
            "backup), or use a new store location."
        )


def _check_model_id(model_id) -> None:
    if not isinstance(model_id, (int, np.integer)) or isinstance(model_id, bool) or model_id < 0:
        raise BadInputError(f"model_id must be a non-negative integer, got {model_id!r}")


def _write_rows(arr: StoredArray, rows, values: np.ndarray) -> None:
    if isinstance(rows, slice):
        arr[rows] = values
        return
    rows = np.asarray(rows)
    if rows.size and np.all(np.diff(rows) == 1):
        arr[int(rows[0]) : int(rows[-1]) + 1] = values
    else:
        arr.oindex[rows] = values
