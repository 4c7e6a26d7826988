"""A checkpoint's curvature factors as binary arrays beside the store's records (``curvature/<model id>/<name>``,
float64, one chunk each): the pipeline record keeps only their layout and digest
(:mod:`trak_core.solve.kfac`). Megabytes of factors inside the root's attributes would be parsed again by every
open of the root group and rewritten by every record update (260 ms per array created at 30 MB of attributes)."""

from __future__ import annotations

import numpy as np
import zarr

#: the group of the factor arrays, beside ``models`` and ``experiments``
GROUP = "curvature"


class FactorArrays:
    """:class:`~trak_core.store.protocol.RunRecords`' factor arrays for a store whose root group is ``self.root``."""

    root: zarr.Group

    def write_factor_arrays(self, model_id: int, arrays: dict[str, np.ndarray]) -> None:
        """Replace ``model_id``'s factor arrays by ``arrays`` ({name: float64 array})."""
        top = self.root.require_group(GROUP)
        name = str(int(model_id))
        if name in top:
            del top[name]
        g = top.require_group(name)
        for key, value in arrays.items():
            v = np.ascontiguousarray(value, dtype="<f8")
            arr = g.create_array(key, shape=v.shape, chunks=tuple(int(d) for d in v.shape), dtype="<f8", fill_value=0.0)
            arr[...] = v

    def read_factor_arrays(self, model_id: int) -> dict[str, np.ndarray]:
        """``model_id``'s factor arrays ({} when none are written)."""
        try:
            g = self.root[f"{GROUP}/{int(model_id)}"]
        except KeyError:
            return {}
        assert isinstance(g, zarr.Group)
        return {key: np.asarray(array[...], dtype=np.float64) for key, array in g.arrays()}
