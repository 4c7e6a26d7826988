"""A checkpoint's curvature factors as binary arrays beside the store's records (``curvature/<model id>/<name>``,
float64, one chunk each), their record (layout and digest, :mod:`trak_core.solve.kfac_record`) in that group's
attributes, so that the tasks of two checkpoints write no common object; and each shard's sums of them, written as
it is featurized (``curvature/partials/<model id>/<shard>/<name>``, their layout in the group's attributes).
Megabytes of factors inside the root's attributes would be parsed again by every open of the root group and
rewritten by every record update (260 ms per array created at 30 MB of attributes)."""

from __future__ import annotations

import numpy as np
import zarr
from zarr.errors import ContainsGroupError

#: the group of the factor arrays, beside ``models`` and ``experiments``
GROUP = "curvature"
#: the attribute of a model's factor group that holds their record
RECORD_ATTR = "factor_record"


def _child(parent: zarr.Group, name: str) -> zarr.Group:
    """The group ``name`` under ``parent``, created if missing (another shard's task may create it at once)."""
    try:
        return parent.require_group(name)
    except ContainsGroupError:
        g = parent[name]
        assert isinstance(g, zarr.Group)
        return g


def _replace_group(parent: zarr.Group, name: str, arrays: dict[str, np.ndarray]) -> zarr.Group:
    if name in parent:
        del parent[name]
    g = parent.require_group(name)
    for key, value in arrays.items():
        v = np.ascontiguousarray(value, dtype="<f8")
        arr = g.create_array(key, shape=v.shape, chunks=tuple(int(d) for d in v.shape), dtype="<f8", fill_value=0.0)
        arr[...] = v
    return g


def _read_group(root: zarr.Group, path: str) -> zarr.Group | None:
    try:
        g = root[path]
    except KeyError:
        return None
    assert isinstance(g, zarr.Group)
    return g


class FactorArrays:
    """:class:`~trak_core.store.protocol.RunRecords`' factor arrays for a store whose root group is ``self.root``."""

    root: zarr.Group

    def write_factor_arrays(self, model_id: int, arrays: dict[str, np.ndarray], record: dict) -> None:
        """Replace ``model_id``'s factors by ``arrays`` ({name: float64 array}) and their ``record``, written last."""
        g = _replace_group(_child(self.root, GROUP), str(int(model_id)), arrays)
        g.attrs[RECORD_ATTR] = dict(record)

    def read_factor_record(self, model_id: int) -> dict | None:
        """The record written with ``model_id``'s factors (None: none, or a write stopped before it)."""
        g = _read_group(self.root, f"{GROUP}/{int(model_id)}")
        rec = None if g is None else g.attrs.get(RECORD_ATTR)
        return dict(rec) if isinstance(rec, dict) else None

    def read_factor_arrays(self, model_id: int) -> dict[str, np.ndarray]:
        """``model_id``'s factor arrays ({} when none are written)."""
        g = _read_group(self.root, f"{GROUP}/{int(model_id)}")
        return {} if g is None else {k: np.asarray(a[...], dtype=np.float64) for k, a in g.arrays()}

    def write_factor_partial(self, model_id: int, shard: int, arrays: dict[str, np.ndarray], info: dict) -> None:
        """Replace shard ``shard``'s factor sums of ``model_id``: ``arrays`` and their layout ``info`` (JSON)."""
        parent = _child(_child(_child(self.root, GROUP), "partials"), str(int(model_id)))
        g = _replace_group(parent, str(int(shard)), arrays)
        g.attrs["factor_sums"] = dict(info)

    def read_factor_partial(self, model_id: int, shard: int) -> tuple[dict[str, np.ndarray], dict] | None:
        """(arrays, info) of a shard's factor sums as written; None when none are (or their info is not)."""
        g = _read_group(self.root, f"{GROUP}/partials/{int(model_id)}/{int(shard)}")
        info = None if g is None else g.attrs.get("factor_sums")
        if g is None or not isinstance(info, dict):
            return None
        return {k: np.asarray(a[...], dtype=np.float64) for k, a in g.arrays()}, dict(info)
