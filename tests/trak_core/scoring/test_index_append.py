"""A checkpoint appended to a pipeline store: the rerun featurizes and finalizes only the new checkpoint, keeps
the old rows bit for bit, and gives the scores (and the index's answers) of one run over all checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
from trak_fixtures import tiny_attribute_config

from examples import tiny
from tasks.config import AttributeConfig
from trak_core import TrakIndex
from trak_core.store import TrakStore

pytestmark = pytest.mark.usefixtures("prefect_harness")


def test_appended_checkpoint_equals_one_run(tmp_path):
    from flows import attribute

    grow, once = tmp_path / "grow", tmp_path / "once"
    tiny.save_checkpoints(grow / "ck", seeds=(0, 1))
    tiny.save_checkpoints(once / "ck", seeds=(0, 1, 2))

    def cfg(root):
        return AttributeConfig.model_validate(tiny_attribute_config(root / "s.zarr", str(root / "ck" / "model_*.pt")))

    attribute(cfg(grow))
    old = TrakStore.open(str(grow / "s.zarr"), mode="r")
    rows_before = [old.model(mid).grads[:].copy() for mid in (0, 1)]
    inverse_before = [old.inverse(mid).copy() for mid in (0, 1)]
    index_before = TrakIndex.from_config(cfg(grow))  # opened on the two-checkpoint store

    tiny.save_checkpoints(grow / "ck", seeds=(2,))  # a new checkpoint arrives (sorted last: model_id 2)
    out = attribute(cfg(grow))
    assert out["featurize"]["computed"] == tiny.NUM_TRAIN // 16  # the new checkpoint's shards only
    assert out["score"]["model_ids"] == [0, 1, 2]
    attribute(cfg(once))

    grown, ref = TrakStore.open(str(grow / "s.zarr"), mode="r"), TrakStore.open(str(once / "s.zarr"), mode="r")
    for mid in (0, 1):
        np.testing.assert_array_equal(grown.model(mid).grads[:], rows_before[mid])
        np.testing.assert_array_equal(grown.inverse(mid), inverse_before[mid])
    np.testing.assert_array_equal(grown.scores("tiny")[:], ref.scores("tiny")[:])

    x = tiny.target_data()
    a = TrakIndex.from_config(cfg(grow)).query(x, k=4)
    b = TrakIndex.from_config(cfg(once)).query(x, k=4)
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_array_equal(a.scores, b.scores)
    assert a.model_ids == (0, 1, 2)
    # the index opened before the append still answers from its two checkpoints, which the append left alone
    assert index_before.query(x, k=4).model_ids == (0, 1)
