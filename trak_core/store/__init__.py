"""The store: a Zarr v3 group holding a run's arrays, its metadata and its run lock.

Layout (a local path or any fsspec URL such as ``memory://x``, ``s3://b/x``)::

    /                            attrs: {"trakflow": StoreMetadata, "trakflow_pipeline": {...}}
    /models/<id>/grads           (n, p) float16|float32   projected, normalized train gradients X
    /models/<id>/out_to_loss     (n,)   float32           Q
    /models/<id>/featurized      (n,)   uint8             row status: 1 once its grads and Q are written
    /models/<id>/xtx_partials    (S, p(p+1)/2) float64    Xₛᵀ Xₛ of each shard, packed upper triangle
    /models/<id>/rowsum_partials (S, p+3) float64         [Xₛᵀqₛ, qₛᵀqₛ, Σ‖xᵢ‖⁴, Σqᵢ²‖xᵢ‖²] of each shard
    /models/<id>/ggn_partials    (S, p(p+1)/2) float64    Xₛᵀ Rₛ Xₛ (``curvature="ggn"`` only)
    /models/<id>/partial_done    (S,)   uint8             status of a shard's partials
    /models/<id>/inverse         (1, p, p) float32        A = (H + λI)⁻¹
    /models/<id>/inverse_done    (1,)   uint8
    /experiments/<exp>           attrs: num_targets, scored_with, score_layout (, target_data_sha256)
    /experiments/<exp>/models/<id>/{grads, scored, solved, solved_done}   target gradients G and G·A
    /experiments/<exp>/{scores (n, m) float32, scores_done (n,) uint8}

Every chunk ends with zarr's crc32c and has a place record ``<array>/d/<coords>`` sealing it to (store id,
array, coordinates); the root metadata is sealed and kept twice more (``models/``, ``experiments/``).

Modules, by job: :mod:`.schema` (metadata, array layout), :mod:`.root` (the sealed root metadata),
:mod:`.arrays` (chunks and the damage guard), :mod:`.places` (the chunks' place records), :mod:`.nodes` (views
of the groups), :mod:`.location` (paths, URLs), :mod:`.lock` (the run lock), :mod:`.zarr_store`
(:class:`TrakStore`), :mod:`.verify` (fsck and repair), :mod:`.protocol` (what the algorithm needs from a store:
:class:`RunRecords`, :class:`RowAccess`, :class:`RunLocking`, together :class:`RunStore`), :mod:`.factory`
(:func:`open_store`, :func:`create_or_open_store`, :func:`store_exists`: how the rest of trak_core opens a store).
A new backend implements :class:`RunStore` and passes ``trak_core.testing.check_store``.
"""

from .arrays import (
    StoredArray,
    array_at,
    chunk_coords_of_rows,
    chunk_key,
    chunk_rows_of,
    damaged_chunk_error,
    find_corrupt_chunk,
    group_at,
    read_chunk,
    stored_chunk_keys,
)
from .factory import create_or_open_store, open_store, store_exists
from .lock import StoreLock
from .nodes import ExperimentArrays, ModelArrays, ScoreWriter, TargetArrays
from .protocol import (
    EXPERIMENT_ARRAYS,
    MODEL_ARRAYS,
    TARGET_ARRAYS,
    RowAccess,
    RunLocking,
    RunRecords,
    RunStore,
    ScoreArray,
    experiment_array,
    model_array,
    target_array,
)
from .schema import (
    CHUNK_TARGET_BYTES,
    CODEC_NAMES,
    MAX_CHUNK_ROWS,
    SCHEMA_VERSION,
    SCORE_CHUNK_BYTES,
    SHARD_ARRAYS,
    ArraySpec,
    StoreMetadata,
    array_spec,
    check_exp_name,
    choose_chunk_rows,
    mirror_upper,
    pack_upper,
    unpack_upper,
)
from .zarr_store import TrakStore, check_writable

__all__ = [
    "CHUNK_TARGET_BYTES",
    "CODEC_NAMES",
    "EXPERIMENT_ARRAYS",
    "MODEL_ARRAYS",
    "TARGET_ARRAYS",
    "MAX_CHUNK_ROWS",
    "SCHEMA_VERSION",
    "SCORE_CHUNK_BYTES",
    "SHARD_ARRAYS",
    "ArraySpec",
    "ExperimentArrays",
    "ModelArrays",
    "RowAccess",
    "RunLocking",
    "RunRecords",
    "RunStore",
    "ScoreArray",
    "ScoreWriter",
    "StoreLock",
    "StoreMetadata",
    "StoredArray",
    "TargetArrays",
    "TrakStore",
    "array_at",
    "array_spec",
    "check_exp_name",
    "check_writable",
    "create_or_open_store",
    "experiment_array",
    "model_array",
    "target_array",
    "choose_chunk_rows",
    "chunk_coords_of_rows",
    "chunk_key",
    "chunk_rows_of",
    "damaged_chunk_error",
    "find_corrupt_chunk",
    "group_at",
    "mirror_upper",
    "open_store",
    "pack_upper",
    "read_chunk",
    "store_exists",
    "stored_chunk_keys",
    "unpack_upper",
]
