"""Data selection with TRAK (the use LESS and DsDm make of it): rank the train rows by their summed influence on a
target set (e.g. a validation set of the task one cares about) and keep the top fraction.

The summed influence of train row i on m targets is Σ_j S[i, j], S the scores ``finalize_scores`` gives. Per
checkpoint c a score is X_c[i] · A_c g_cj (then combined over checkpoints with Q), which is linear in the target's
projected gradient g_cj; so Σ_j S[i, j] is row i's score against ONE target per checkpoint, s_c = Σ_j g_cj, combined
exactly as scoring combines (:func:`trak_core.scoring.streaming.stream_scores`: (1/C) Σ_c X_c A_c s_c, times the mean
of the
Q_c). A selection is therefore one streamed pass over the stored rows with a single right-hand column per checkpoint:
no n × m array is formed, and the memory is the n summed scores plus a few blocks of rows.

    from trak_core.scoring.selection import select
    sel = select(index, (x_val, y_val), fraction=0.1)       # index: a TrakIndex with a model
    sel.indices, sel.scores                                  # the 10 % with the largest summed influence, best first
    select(index, (x_val, y_val), k=500, opponents=True)     # the 500 rows that hurt the targets most

The targets' projected gradients are those :meth:`TrakIndex.featurize` gives (rounded to the store's dtype, as
stored targets are), summed in float64 per checkpoint. The sums differ from summing ``finalize_scores``' columns only
by float32 rounding (the tests compare both with a float64 reference).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from trak_core.errors import BadInputError, StateError
from trak_core.scoring.index import TrakIndex
from trak_core.scoring.streaming import grads_right_hand, page_array, stream_scores

#: targets featurized per call when summing a target set (their gradients are summed, never all held)
TARGET_BATCH = 64


@dataclass(frozen=True)
class Selection:
    """The selected train rows: ``indices`` (k,) int64 and their summed influence ``scores`` (k,) float32, best
    first (``opponents``: the most negative first, ties by the lower row either way); ``row_scores`` (n,) float32:
    every train row's summed influence on the ``num_targets`` targets; ``model_ids``: the checkpoints combined."""

    indices: np.ndarray
    scores: np.ndarray
    row_scores: np.ndarray
    opponents: bool
    num_targets: int
    model_ids: tuple[int, ...]

    @property
    def k(self) -> int:
        return int(self.indices.shape[0])

    @property
    def fraction(self) -> float:
        """The share of the train rows selected."""
        return self.k / max(1, self.row_scores.shape[0])

    def to_dict(self) -> dict:
        """JSON-able: the selection without ``row_scores``."""
        return {
            "opponents": self.opponents,
            "num_targets": self.num_targets,
            "model_ids": list(self.model_ids),
            "n": int(self.row_scores.shape[0]),
            "k": self.k,
            "indices": self.indices.tolist(),
            "scores": [float(s) for s in self.scores],
        }


def selection_size(n: int, fraction: float | None = None, k: int | None = None) -> int:
    """How many of ``n`` rows to select: ``k``, or ``round(fraction · n)``; exactly one of them, refused
    (BadInputError) unless 1 ≤ k ≤ n and 0 < fraction ≤ 1 selects at least one row."""
    if (fraction is None) == (k is None):
        raise BadInputError("selection size: give exactly one of fraction= and k=")
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= int(k) <= n:
            raise BadInputError(f"k={k!r}: must be an integer from 1 to the store's {n} train rows")
        return int(k)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float, np.floating, np.integer)):
        raise BadInputError(f"fraction={fraction!r}: must be a number in (0, 1]")
    f = float(fraction)
    if not (0.0 < f <= 1.0):
        raise BadInputError(f"fraction={fraction!r}: must be in (0, 1] (the share of the train rows to keep)")
    size = int(round(f * n))
    if size < 1:
        raise BadInputError(f"fraction={fraction!r} of the store's {n} train rows selects no row; use k= or more")
    return size


def rank_rows(row_scores: np.ndarray, k: int, opponents: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` rows with the largest (``opponents``: smallest) scores, best first, ties by the lower row (−0.0
    counted as 0.0): (indices int64, scores). O(n) to find them, O(k log k) to order them."""
    s = np.asarray(row_scores, dtype=np.float32).reshape(-1)
    n = s.shape[0]
    if not 1 <= k <= n:
        raise BadInputError(f"k={k}: must be from 1 to {n}")
    key = s if opponents else -s
    if k < n:
        kth = np.partition(key, k - 1)[k - 1]
        below = np.flatnonzero(key < kth)
        at = np.flatnonzero(key == kth)[: k - below.shape[0]]  # ties at the edge: the lower rows
        cand = np.concatenate([below, at])
    else:
        cand = np.arange(n)
    order = cand[np.lexsort((cand, key[cand]))]
    return order.astype(np.int64), s[order].copy()


def target_sums(
    index: TrakIndex, targets: Sequence[Tensor], batch_size: int = TARGET_BATCH
) -> tuple[dict[int, np.ndarray], int]:
    """Per checkpoint, the sum of the targets' projected gradients (as :meth:`TrakIndex.featurize` gives them),
    accumulated in float64 over batches of ``batch_size`` targets: ({model_id: (p,) float64}, m)."""
    m = index.check_batch(targets)  # the whole batch is checked before any compute
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise BadInputError(f"batch_size={batch_size!r}: must be a positive integer")
    p = index.store.meta.proj_dim
    sums = {mid: np.zeros(p, dtype=np.float64) for mid in index.model_ids}
    for a in range(0, m, int(batch_size)):
        part = tuple(t[a : a + int(batch_size)] for t in targets)
        for mid, x in index.featurize(part).items():
            sums[mid] += x.astype(np.float64).sum(axis=0)
    return sums, m


def vector_sums(index: TrakIndex, vectors: Mapping[int, np.ndarray | Tensor]) -> tuple[dict[int, np.ndarray], int]:
    """:func:`target_sums` from given projected gradients {model_id: (m, p)} (e.g. :meth:`TrakIndex.featurize`'s)."""
    p = index.store.meta.proj_dim
    if set(vectors) != set(index.model_ids):
        raise BadInputError(f"vectors: one (m, {p}) array per model_id {list(index.model_ids)}, got {sorted(vectors)}")
    arrays = {mid: np.asarray(torch.as_tensor(v).detach().cpu(), dtype=np.float64) for mid, v in vectors.items()}
    shapes = sorted({a.shape for a in arrays.values()})
    if len(shapes) != 1 or len(shapes[0]) != 2 or shapes[0][1] != p or shapes[0][0] < 1:
        raise BadInputError(f"vectors: expected (m, {p}) arrays with one m ≥ 1, got shapes {shapes}")
    for mid, a in arrays.items():
        if not np.isfinite(a).all():
            raise BadInputError(f"vectors[{mid}]: NaN or inf")
    return {mid: a.sum(axis=0) for mid, a in arrays.items()}, int(shapes[0][0])


class _IntoVector:
    """The score writer :func:`stream_scores` gets: its ``out`` already holds the scores; nothing is written."""

    def __init__(self, chunk_rows: int):
        self.chunk_rows = self.done_rows = int(chunk_rows)

    def rows(self, a: int, b: int, scores: np.ndarray) -> None:
        """The scores are in ``out`` already."""

    def mark_done(self, a: int, b: int) -> None:
        """Nothing is stored, nothing to mark."""


def summed_influence(
    index: TrakIndex, sums: Mapping[int, np.ndarray], progress: Callable[[int], None] | None = None
) -> np.ndarray:
    """Every train row's score against one target per checkpoint (``sums[model_id]``, (p,)), combined over the
    index's checkpoints as scoring combines: (n,) float32, from one streamed pass over the stored rows. With
    ``sums`` the targets' summed projected gradients this is each row's summed influence on the targets."""
    store, p, n = index.store, index.store.meta.proj_dim, index.n
    if set(sums) != set(index.model_ids):
        raise BadInputError(f"sums: one ({p},) vector per model_id {list(index.model_ids)}, got {sorted(sums)}")
    right = {}
    for mid in index.model_ids:
        s = np.asarray(sums[mid], dtype=np.float64).reshape(-1)
        if s.shape != (p,) or not np.isfinite(s).all():
            raise BadInputError(f"sums[{mid}]: expected a finite ({p},) vector, got shape {s.shape}")
        col = torch.from_numpy(s.astype(np.float32)).reshape(p, 1)
        right[mid] = grads_right_hand(store.inverse(mid), col)
    out = page_array((n, 1), np.float32)
    index._check_snapshot("since the index was opened")  # a store a run changed is refused, as a query's
    with store.pinned():
        sink = _IntoVector(store.meta.score_chunk_rows(1))
        stream_scores(store, "select", list(index.model_ids), 0, n, right, out=out, progress=progress, sink=sink)
    index._check_snapshot("during the selection")
    return out.reshape(-1)


def select(
    source: TrakIndex | str | os.PathLike,
    targets: Sequence[Tensor] | None = None,
    *,
    vectors: Mapping[int, np.ndarray | Tensor] | None = None,
    fraction: float | None = None,
    k: int | None = None,
    opponents: bool = False,
    batch_size: int = TARGET_BATCH,
    progress: Callable[[int], None] | None = None,
    **index_kwargs: Any,
) -> Selection:
    """The train rows with the largest summed influence on ``targets`` (``opponents``: the most negative): the top
    ``fraction`` of the rows, or ``k`` rows.

    Args:
        source: a :class:`TrakIndex`, or a store path opened as ``TrakIndex(source, **index_kwargs)``.
        targets: the target batch in the task's format (e.g. (inputs, labels)); needs an index with a model.
        vectors: instead of ``targets``, their projected gradients {model_id: (m, proj_dim)}.
        fraction / k: how many rows to keep (exactly one; ``round(fraction · n)`` rows, at least one).
        opponents: keep the rows with the lowest summed influence (those that hurt the targets most).
        batch_size: targets featurized at once.
        progress: called with the rows scored.

    Returns:
        a :class:`Selection`; its ``row_scores`` are Σ_j ``finalize_scores``[:, j] up to float32 rounding.
    """
    if index_kwargs and isinstance(source, TrakIndex):
        raise BadInputError(f"{sorted(index_kwargs)}: index arguments are given with an index already open")
    index = source if isinstance(source, TrakIndex) else TrakIndex(source, **index_kwargs)
    size = selection_size(index.n, fraction, k)
    if (targets is None) == (vectors is None):
        raise BadInputError("targets: give exactly one of targets (a batch) and vectors (their projected gradients)")
    if targets is not None and index.featurizer is None:
        raise StateError("targets: this index has no model (TrakIndex(..., model=None)); pass vectors= instead")
    sums, m = target_sums(index, targets, batch_size) if targets is not None else vector_sums(index, vectors or {})
    row_scores = summed_influence(index, sums, progress)
    bad = np.flatnonzero(~np.isfinite(row_scores))
    if bad.size:
        raise StateError(f"summed influence is NaN or inf at train rows {bad[:10].tolist()} (check the store)")
    idx, scores = rank_rows(row_scores, size, opponents)
    return Selection(idx, scores, row_scores, bool(opponents), m, tuple(index.model_ids))


__all__ = ["Selection", "rank_rows", "select", "selection_size", "summed_influence", "target_sums", "vector_sums"]
