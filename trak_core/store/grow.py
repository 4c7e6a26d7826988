"""Growing a store along its train rows: more rows than it was created with, the old ones kept bit for bit.

Every row array (a model's grads, Q and row flags, an experiment's scores and their flags) and every shard array
(the XᵀX partials, row sums and their flags) is resized: resizing up rewrites the array's zarr.json only, so
the chunks already written and their place records (:mod:`.places`) stay as they are. What depends on every row
is marked not done first: each model's inverse and finalize record, each experiment's G·A and score rows, and
the partial of a last shard that the new rows complete. The root metadata (sealed, with its copies) is written
last, with the new ``train_set_size``.
"""

from __future__ import annotations

from typing import Protocol

import zarr

from ..errors import BadInputError
from .nodes import ExperimentArrays, ModelArrays
from .protocol import RunStore
from .root import write_root
from .schema import SHARD_ARRAYS


class _Growable(RunStore, Protocol):
    """A store whose arrays are Zarr's (:class:`~trak_core.store.TrakStore`): what growing it touches."""

    root: zarr.Group

    def clear_finalize_info(self, model_id: int) -> None: ...

    def model(self, model_id: int) -> ModelArrays: ...

    def experiment(self, exp_name: str) -> ExperimentArrays: ...


#: a model's arrays with one entry per train row
ROW_ARRAYS = ("grads", "out_to_loss", "featurized")


def grow_train_rows(store: _Growable, train_set_size: int) -> int:
    """Grow ``store`` to ``train_set_size`` train rows (rows [n, train_set_size) not featurized yet).

    Args:
        train_set_size: the new number of train rows, more than the store's.
    Returns:
        The number of rows the store had before.
    """
    meta = store.meta
    old, new = meta.train_set_size, int(train_set_size)
    if new < old:
        raise BadInputError(
            f"train_data: {new} rows, but the store at {store.location} holds {old}; a store only grows "
            "(use a new store for fewer rows)"
        )
    if new == old:
        return old
    grown = meta.model_copy(update={"train_set_size": new})
    last = meta.num_shards - 1
    completes_last = old % meta.rows_per_shard != 0  # the old last shard gets new rows: its partial is redone
    for mid in store.model_ids():  # first what depends on every row: nothing stale survives a crash below
        store.clear_finalize_info(mid)
        if completes_last:
            store.model(mid).partial_done[last] = 0
    for exp in store.experiments():
        if store.experiment(exp).has_scores:
            store.reset_scores(exp)
    for mid in store.model_ids():
        g = store.model(mid).group
        for name in ROW_ARRAYS:
            _resize(g, name, new)
        for name in SHARD_ARRAYS:
            _resize(g, name, grown.num_shards)
    for exp in store.experiments():
        g = store.experiment(exp).group
        for name in ("scores", "scores_done"):
            _resize(g, name, new)
    write_root(store.root, grown.model_dump(mode="json"))
    store.meta = grown
    return old


def _resize(group, name: str, rows: int) -> None:
    if name in group:
        arr = group[name]
        arr.resize((rows, *arr.shape[1:]))
