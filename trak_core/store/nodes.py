"""Views of the store's groups: a model's arrays, an experiment's, its targets', and the score writer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import zarr

from . import arrays as _arrays
from .arrays import StoredArray, _attrs, _stored


class _LockChecked(Protocol):
    def check_lock(self) -> None: ...


@dataclass(frozen=True)
class ScoreWriter:
    """Writes an experiment's score rows and then their flags (:meth:`TrakStore.score_rows_writer`)."""

    store: _LockChecked
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
    sid: str | None = dataclasses.field(default=None, repr=False, compare=False)  # the store's id: place checks

    def _array(self, name: str) -> StoredArray:
        key = ("array", self.group.path, name)
        return _pinned(self.pins, key, lambda: _stored(self.group, name, self.check, self.sid))


#: the per-model arrays with one entry per shard (not per row)


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
        """Xₛᵀ Xₛ of each shard, float64: (S, p(p+1)/2) packed upper triangles (``meta.partial_shape``)."""
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
        return _pinned(self.pins, ("group", self.group.path, "models"), lambda: _arrays.group_at(self.group, "models"))

    def model_ids(self) -> list[int]:
        return sorted(int(k) for k in self._models().group_keys())

    def has_model(self, model_id: int) -> bool:
        return str(int(model_id)) in self._models()

    def model(self, model_id: int) -> TargetArrays:
        return _pinned(
            self.pins,
            ("target", self.group.path, int(model_id)),
            lambda: TargetArrays(_arrays.group_at(self._models(), str(int(model_id))), self.pins, self.check, self.sid),
        )
