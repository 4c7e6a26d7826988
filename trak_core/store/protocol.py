"""What the algorithm needs from a store, split by responsibility:

- :class:`RunRecords`: records and status: the metadata, the pipeline's, model and experiment records, flags
  (which rows, shards, models and targets are done);
- :class:`RowAccess`: the arrays, by path and rows: train rows, shard partials, inverses, target gradients,
  scores (rows read, written, then flagged; which are still stored);
- :class:`RunLocking`: the run lock and the pinned block of handles;
- :class:`RunStore`: all three, what the engine, the index and TRAKer talk to.

:class:`~trak_core.store.TrakStore` (Zarr) is one; ``trak_core.testing.check_store`` checks any other against
the same contract. No module outside this package names the Zarr class: they open stores with
:func:`~trak_core.store.open_store` / :func:`~trak_core.store.create_or_open_store` and type them with these."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import BadInputError
from .lock import StoreLock
from .schema import StoreMetadata


@runtime_checkable
class RunRecords(Protocol):
    """The run's records and status flags. Reading a flag never reads rows."""

    meta: StoreMetadata
    location: str

    def validate(self, expected: StoreMetadata, grow: bool = False) -> None:
        """Refuse (StoreMismatchError) when ``expected`` differs from the stored metadata."""

    def pipeline_info(self) -> dict:
        """The pipeline's record of the run (plan, data fingerprints); {} when none."""

    def set_pipeline_info(self, info: dict) -> None: ...

    def write_factor_arrays(self, model_id: int, arrays: dict[str, np.ndarray], record: dict) -> None:
        """Replace ``model_id``'s curvature factors: the arrays ({name: float64 array}) and their ``record`` (JSON:
        layout, digest), the record last (a write stopped part way leaves none). Each model's factors are its own:
        writers of two models never write the same object."""

    def read_factor_record(self, model_id: int) -> dict | None:
        """The record written with ``model_id``'s factor arrays; None when none is."""

    def read_factor_arrays(self, model_id: int) -> dict[str, np.ndarray]:
        """``model_id``'s curvature factor arrays as written ({} when none)."""

    def write_factor_partial(self, model_id: int, shard: int, arrays: dict[str, np.ndarray], info: dict) -> None:
        """Replace a shard's sums of ``model_id``'s curvature factors (float64 ``arrays``, their layout ``info``)."""

    def read_factor_partial(self, model_id: int, shard: int) -> tuple[dict[str, np.ndarray], dict] | None:
        """(arrays, info) of a shard's factor sums as written; None when none are."""

    # models
    def model_ids(self) -> list[int]: ...

    def has_model(self, model_id: int) -> bool: ...

    def checkpoint_record(self, model_id: int) -> dict | None: ...

    def set_checkpoint_record(self, model_id: int, record: dict) -> None: ...

    def check_feature_settings(self, model_id: int, lambda_setting, rescale_inverse: bool) -> None:
        """Refuse settings that differ from those recorded for ``model_id``."""

    def record_feature_settings(self, model_id: int, lambda_setting, rescale_inverse: bool) -> None: ...

    def reset_model(self, model_id: int) -> None:
        """Forget every row, partial and inverse of ``model_id`` (its arrays stay)."""

    def featurized_mask(self, model_id: int) -> np.ndarray:
        """Returns: (n,) bool, the train rows of ``model_id`` written."""

    def shard_featurized(self, model_id: int, shard: int) -> bool: ...

    def partial_done(self, model_id: int, shard: int) -> bool: ...

    def finalize_info(self, model_id: int) -> dict | None: ...

    def set_finalize_info(self, model_id: int, info: dict) -> None:
        """Record finalize's result: the model is finalized."""

    def is_finalized(self, model_id: int) -> bool: ...

    # experiments
    def experiments(self) -> list[str]: ...

    def num_targets(self, exp_name: str) -> int: ...

    def target_data_sha256(self, exp_name: str) -> str | None: ...

    def set_target_data_sha256(self, exp_name: str, sha256: str) -> None: ...

    def experiment_model_ids(self, exp_name: str) -> list[int]: ...

    def targets_complete(self, exp_name: str, model_id: int) -> bool: ...

    def solved_complete(self, exp_name: str, model_id: int) -> bool: ...

    def scored_with(self, exp_name: str) -> list[int] | None: ...

    def set_scored_with(self, exp_name: str, model_ids) -> None: ...

    def scores_done_mask(self, exp_name: str) -> np.ndarray: ...


#: the arrays of a model (``models/<id>/<name>``): train rows (grads, out_to_loss and their flags, featurized),
#: one entry per shard (xtx_partials, rowsum_partials, ggn_partials and their flags, partial_done), the inverse
MODEL_ARRAYS = (
    "grads",
    "out_to_loss",
    "featurized",
    "xtx_partials",
    "rowsum_partials",
    "ggn_partials",
    "partial_done",
    "inverse",
    "inverse_done",
)
#: the arrays of a model's targets in an experiment (``experiments/<exp>/models/<id>/<name>``)
TARGET_ARRAYS = ("grads", "scored", "solved", "solved_done")
#: the arrays of an experiment (``experiments/<exp>/<name>``)
EXPERIMENT_ARRAYS = ("scores", "scores_done")


def model_array(model_id: int, name: str) -> str:
    """The path of a model's array ``name`` (one of :data:`MODEL_ARRAYS`), as :class:`RowAccess` names it."""
    return f"models/{int(model_id)}/{name}"


def target_array(exp_name: str, model_id: int, name: str) -> str:
    """The path of the array ``name`` (one of :data:`TARGET_ARRAYS`) of ``model_id``'s targets in ``exp_name``."""
    return f"experiments/{exp_name}/models/{int(model_id)}/{name}"


def experiment_array(exp_name: str, name: str) -> str:
    """The path of the experiment's array ``name`` (one of :data:`EXPERIMENT_ARRAYS`)."""
    return f"experiments/{exp_name}/{name}"


def split_path(path: str) -> tuple[str | None, int | None, str]:
    """(experiment or None, model id or None, array name) of an array path (:func:`model_array`,
    :func:`target_array`, :func:`experiment_array`); BadInputError for any other path."""
    parts = path.strip("/").split("/")
    if len(parts) == 3 and parts[0] == "models" and parts[1].isdigit() and parts[2] in MODEL_ARRAYS:
        return None, int(parts[1]), parts[2]
    if len(parts) == 3 and parts[0] == "experiments" and parts[2] in EXPERIMENT_ARRAYS:
        return parts[1], None, parts[2]
    if len(parts) == 5 and parts[0] == "experiments" and parts[2] == "models" and parts[3].isdigit():
        if parts[4] in TARGET_ARRAYS:
            return parts[1], int(parts[3]), parts[4]
    raise BadInputError(f"{path!r} is not an array of a trakflow store")


class ScoreArray(Protocol):
    """An experiment's (n, m) scores as a store hands them out: ``scores[a:b]``, ``scores[:]``."""

    def __getitem__(self, selection: Any, /) -> Any: ...


@runtime_checkable
class RowAccess(Protocol):
    """The arrays, by path (:func:`model_array`, :func:`target_array`, :func:`experiment_array`). Every write of
    rows is followed by their flags, so a crash leaves them visibly unfinished; a read of damaged data raises
    :class:`~trak_core.errors.StoreDamageError`."""

    meta: StoreMetadata

    # any array
    def read_rows(self, path: str, rows: slice | np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``rows`` (a slice, or sorted indices) along the first axis of the array at ``path``, as stored;
        with ``out`` (a caller's buffer of exactly those rows) read into it and returned."""

    def check_present(self, arrays: list[tuple[str, np.ndarray]]) -> None:
        """Raise :class:`~trak_core.errors.StoreDamageError` naming the array and rows when data holding the given
        rows is no longer stored (a lost chunk would read back as zeros). ``arrays``: (path, first-axis indices
        about to be read)."""

    # train rows, partials, inverse
    def init_model(self, model_id: int) -> object:
        """Create the arrays of ``model_id`` (idempotent)."""

    def write_train_rows(
        self, model_id: int, rows, grads, out_to_loss: np.ndarray, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Write rows (a slice or sorted indices) of projected gradients and Q, then mark them written;
        returns the gradients as stored."""

    def read_train_rows(self, model_id: int, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Returns: grads (b - a, p) and Q (b - a,) of train rows [a, b) as stored."""

    def write_partial(
        self,
        model_id: int,
        shard: int,
        partial: np.ndarray,
        row_sums: np.ndarray,
        ggn: np.ndarray | None = None,
        mark: bool = True,
    ) -> None:
        """Write a shard's XᵀX (and row sums, and XᵀRX for ``curvature="ggn"``), then (``mark``) mark it done."""

    def mark_partial(self, model_id: int, shard: int) -> None: ...

    def grow_train_rows(self, train_set_size: int) -> int:
        """Grow the store to ``train_set_size`` train rows, the stored ones kept bit for bit and everything that
        depends on every row marked not done; returns the number of rows it had."""

    def write_inverse(self, model_id: int, inverse: np.ndarray) -> None:
        """Write the (p, p) inverse of ``model_id``, then mark it written."""

    def inverse(self, model_id: int) -> np.ndarray:
        """Returns: the (p, p) float32 inverse of a finalized model."""

    # targets
    def init_experiment(self, exp_name: str, num_targets: int) -> object:
        """Create (or check) the experiment ``exp_name`` of ``num_targets`` targets."""

    def init_experiment_model(self, exp_name: str, model_id: int) -> object:
        """Create the target arrays of ``model_id`` in ``exp_name`` (idempotent)."""

    def stored_target_rows(self, exp_name: str, model_id: int, rows) -> np.ndarray | None:
        """The stored target gradients of rows ``rows``, or None unless every one is written."""

    def write_target_rows(self, exp_name: str, model_id: int, rows, grads: np.ndarray) -> None:
        """Write target gradient rows, then mark them written."""

    def write_solved(self, exp_name: str, model_id: int, solved: np.ndarray) -> None: ...

    # scores
    def init_scores(self, exp_name: str) -> object:
        """Create the experiment's score arrays (idempotent)."""

    def begin_scores(self, exp_name: str, model_ids) -> None:
        """Create the score arrays for the combination ``model_ids`` (other combinations' rows are forgotten)."""

    def reset_scores(self, exp_name: str) -> None: ...

    def score_layout(self, exp_name: str) -> tuple[int, int]:
        """(rows per piece of scores written at once, rows per piece of their flags): a writer of whole pieces
        never shares one with another writer."""

    def write_score_rows(self, exp_name: str, a: int, b: int, scores: np.ndarray, mark: bool = True) -> None:
        """Write the scores of train rows [a, b), then (``mark``) mark them done."""

    def mark_score_rows(self, exp_name: str, a: int, b: int) -> None:
        """Mark score rows [a, b) done (after their scores are written)."""

    def scores(self, exp_name: str) -> ScoreArray:
        """Returns: the (n, m) scores (array-like) once every row is done; StateError before."""


@runtime_checkable
class RunLocking(Protocol):
    """The run lock, and the block within which opened handles are reused."""

    @property
    def lock(self) -> StoreLock: ...

    def check_lock(self) -> None:
        """Raise LockLostError when the lock this store was opened under is gone or taken."""

    def pinned(self, handles: dict | None = None) -> AbstractContextManager[dict]:
        """A block within which the store's opened handles are reused (this thread's calls); yields them, so that
        another thread's block given them reuses them too."""


@runtime_checkable
class RunStore(RunRecords, RowAccess, RunLocking, Protocol):
    """Everything a run needs from its store."""
