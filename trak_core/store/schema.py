"""The store's schema: its metadata (:class:`StoreMetadata`), the layout of its arrays (:func:`array_spec`)
and the packed layout of the XᵀX partials."""

from __future__ import annotations

import functools
import json
import math
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import zarr
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, model_validator
from zarr.codecs import Crc32cCodec
from zarr.core.metadata import ArrayV3Metadata

from .._version import __version__
from ..errors import BadInputError, StateError, StoreMismatchError

#: the layout this version writes and reads. 5: a store id, and a place record per chunk (.places); 4: each
#: shard's XᵀX partial stored as its packed upper triangle; 3: no
#: features array (the inverse per model, G·A per experiment and model). A store of another schema is refused
SCHEMA_VERSION = 5
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

    return {"trakflow": __version__, "torch": torch.__version__.split("+")[0], "zarr": zarr.__version__}


_SPEC_KEYS = ("kind", "proj_type", "seed", "grad_dim", "proj_dim")


def pack_upper(a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The upper triangle of a (p, p) matrix, row by row: (p(p+1)/2,). Exact (a copy of the entries); into
    ``out`` (a caller's reused buffer of that shape) when given."""
    p = a.shape[0]
    if out is None:
        out = np.empty(p * (p + 1) // 2, dtype=a.dtype)
    elif out.shape != (p * (p + 1) // 2,):
        raise ValueError(f"pack_upper: out has shape {out.shape}, not ({p * (p + 1) // 2},)")
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
    """What a store was created with. Every field but ``versions`` and ``store_id`` (random at creation) must
    match on reopen."""

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
    # of the loss in the model output, R = diag(rᵢ), rᵢ = Qᵢ(1 − Qᵢ) (damping.loss_curvature); set at creation: a
    # "ggn" store keeps both partials per shard (λ's rule reads XᵀX's spectrum)
    # "kfac" / "ekfac": each Linear layer's Kronecker factors in the projected space (trak_core.solve.kfac; its factors
    # are in the pipeline record, "curvature_factors"), the inverse block-diagonal; "kfac-eigen": those layers
    # projected in their factors' eigenbasis (fitted before the rows), each such block's inverse diagonal
    curvature: Literal["xtx", "ggn", "kfac", "ekfac", "kfac-eigen"] = "xtx"
    versions: dict[str, str] = Field(default_factory=_versions)
    # random at creation: each chunk's place record is sealed with it (a chunk of another store does not pass)
    store_id: str = Field(default_factory=lambda: uuid.uuid4().hex, pattern=r"^[0-9a-f]{32}$")

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
        """Whether the XᵀX partials are stored as packed upper triangles (always, since schema 4)."""
        return True

    @property
    def partial_shape(self) -> tuple[int, ...]:
        """The shape of one stored XᵀX partial: (p(p+1)/2,), its packed upper triangle."""
        p = self.proj_dim
        return (p * (p + 1) // 2,)

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


#: the per-model arrays with one entry per shard (not per row)
SHARD_ARRAYS = ("xtx_partials", "rowsum_partials", "ggn_partials", "partial_done")

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
        have_doc, want_doc = _document(arr.metadata), _expected_document(self)
        for field in sorted(set(have_doc) | set(want_doc)):
            if have_doc.get(field) != want_doc.get(field):
                return (
                    f"array {arr.path}: its zarr.json says {field}={json.dumps(have_doc.get(field))}, but the "
                    f"store's schema says {field}={json.dumps(want_doc.get(field))}"
                )
        return None


def _document(metadata: ArrayV3Metadata) -> dict:
    """An array's zarr.json as JSON values, without its attributes (the store's records, checked elsewhere)."""
    doc = json.loads(json.dumps(metadata.to_dict(), default=str))
    doc.pop("attributes", None)
    return doc


@functools.lru_cache(maxsize=256)
def _expected_document(spec: ArraySpec) -> dict:
    """The zarr.json (less attributes) of an array of ``spec`` as the store creates it (every field: codecs and
    their configuration, fill value, chunk grid and key encoding), made once in memory."""
    from zarr.storage import MemoryStore

    g = zarr.open_group(store=MemoryStore(), mode="w", zarr_format=3)
    arr = g.create_array(
        "a", shape=spec.shape, chunks=spec.chunks, dtype=spec.dtype, compressors=[Crc32cCodec()], fill_value=0
    )
    assert isinstance(arr.metadata, ArrayV3Metadata)
    return _document(arr.metadata)


def array_spec(m: StoreMetadata, path: str, experiment_attrs: Mapping[str, Any] | None = None) -> ArraySpec | None:
    """What the array at ``path`` (e.g. ``models/0/grads``) must be, from the root metadata ``m`` (and, for an
    experiment's arrays, the experiment's attributes); None for a path that is not one of the store's arrays."""
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
            attrs = experiment_attrs or {}
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


def check_metadata(have_meta: StoreMetadata, expected: StoreMetadata, location: str, grow: bool = False) -> None:
    """Refuse (:class:`StoreMismatchError`) ``expected`` when it differs from the metadata ``have_meta`` of the store
    at ``location``; with ``grow``, more train rows than it holds pass, fewer are refused."""
    have = have_meta.model_dump()
    want = expected.model_dump()
    for field in StoreMetadata.model_fields:
        if field in ("versions", "store_id"):
            continue
        if grow and field == "train_set_size" and want[field] != have[field]:
            if want[field] < have[field]:
                raise StoreMismatchError(
                    f"train_data: {want[field]} rows, but the store at {location} holds {have[field]}; a "
                    "store only grows (use a new store for fewer rows)"
                )
            continue
        if have[field] != want[field]:
            raise StoreMismatchError(
                f"store at {location} was created with {field}={have[field]!r}, but this run asks "
                f"for {field}={want[field]!r}. Use another store, or the same {field}."
            )


def check_partial_kind(meta: StoreMetadata, ggn) -> None:
    """A shard's Xₛᵀ Rₛ Xₛ partial (``ggn``) is given exactly when the store's curvature is ``"ggn"``."""
    if (ggn is not None) != (meta.curvature == "ggn"):
        raise BadInputError(
            f"write_partial: the store's curvature is {meta.curvature!r}; "
            + ("its Xₛᵀ Rₛ Xₛ partial (ggn=) is required" if ggn is None else "it keeps no Xₛᵀ Rₛ Xₛ partial")
        )


def check_model_id(model_id) -> None:
    if not isinstance(model_id, (int, np.integer)) or isinstance(model_id, bool) or model_id < 0:
        raise BadInputError(f"model_id must be a non-negative integer, got {model_id!r}")
