"""What the algorithm needs from a store: :class:`RunStore`. :class:`~trak_core.store.TrakStore` (Zarr) is one;
``trak_core.testing.check_store`` checks any other against the same contract."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from .schema import StoreMetadata


@runtime_checkable
class RunStore(Protocol):
    """The steps' reads and writes. Every write of rows is followed by their flags, so a crash leaves them
    visibly unfinished; a read of damaged data raises :class:`~trak_core.errors.StoreDamageError`."""

    meta: StoreMetadata
    location: str

    def init_model(self, model_id: int) -> object:
        """Create the arrays of ``model_id`` (idempotent)."""

    def featurized_mask(self, model_id: int) -> np.ndarray:
        """Returns: (n,) bool, the train rows of ``model_id`` written."""

    def write_train_rows(self, model_id: int, rows, grads: np.ndarray, out_to_loss: np.ndarray) -> None:
        """Write rows (a slice or sorted indices) of projected gradients and Q, then mark them written."""

    def read_train_rows(self, model_id: int, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Returns: grads (b - a, p) and Q (b - a,) of train rows [a, b) as stored."""

    def write_partial(
        self, model_id: int, shard: int, partial: np.ndarray, row_sums: np.ndarray, ggn: np.ndarray | None = None
    ) -> None:
        """Write a shard's XᵀX (and row sums, and XᵀRX for ``curvature="ggn"``), then mark it done."""

    def write_inverse(self, model_id: int, inverse: np.ndarray) -> None:
        """Write the (p, p) inverse of ``model_id``, then mark it written."""

    def set_finalize_info(self, model_id: int, info: dict) -> None:
        """Record finalize's result: the model is finalized."""

    def inverse(self, model_id: int) -> np.ndarray:
        """Returns: the (p, p) float32 inverse of a finalized model."""

    def init_experiment(self, exp_name: str, num_targets: int) -> object:
        """Create (or check) the experiment ``exp_name`` of ``num_targets`` targets."""

    def init_experiment_model(self, exp_name: str, model_id: int) -> object:
        """Create the target arrays of ``model_id`` in ``exp_name`` (idempotent)."""

    def stored_target_rows(self, exp_name: str, model_id: int, rows) -> np.ndarray | None:
        """The stored target gradients of rows ``rows``, or None unless every one is written."""

    def write_target_rows(self, exp_name: str, model_id: int, rows, grads: np.ndarray) -> None:
        """Write target gradient rows, then mark them written."""

    def begin_scores(self, exp_name: str, model_ids) -> None:
        """Create the score arrays for the combination ``model_ids`` (other combinations' rows are forgotten)."""

    def write_score_rows(self, exp_name: str, a: int, b: int, scores: np.ndarray) -> None:
        """Write the scores of train rows [a, b), then mark them done."""

    def scores(self, exp_name: str) -> object:
        """Returns: the (n, m) scores (array-like) once every row is done; StateError before."""
