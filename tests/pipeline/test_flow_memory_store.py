"""The attribute flow on an in-memory store (a config naming ``memory://trakflow-memory/<name>``, opened through
the store factory like any location): the same scores as the flow on a Zarr store, bit for bit."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from trak_fixtures import tiny_attribute_config

from examples import tiny
from tasks.config import AttributeConfig
from trak_core.store import open_store
from trak_core.testing import MemoryStore, memory_location

pytestmark = pytest.mark.usefixtures("prefect_harness")


def test_attribute_flow_on_a_memory_store_gives_the_zarr_scores_bit_for_bit(tmp_path):
    from flows import attribute

    tiny.save_checkpoints(tmp_path / "ck", seeds=(0, 1))
    ckpts = str(tmp_path / "ck" / "model_*.pt")
    loc = memory_location(f"flow-{uuid.uuid4().hex}")
    try:
        scores = {}
        for name, where in (("zarr", tmp_path / "store.zarr"), ("memory", loc)):
            result = attribute(AttributeConfig.model_validate(tiny_attribute_config(where, ckpts)))
            assert result["score"]["model_ids"] == [0, 1]
            scores[name] = np.asarray(open_store(str(where), mode="r").scores("tiny")[:])
        assert isinstance(open_store(loc), MemoryStore)
        assert scores["memory"].shape == (tiny.NUM_TRAIN, tiny.NUM_TARGETS)
        assert np.array_equal(scores["memory"], scores["zarr"])
    finally:
        MemoryStore.delete(loc)
