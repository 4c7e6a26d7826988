"""The in-memory store (trak_core.testing.MemoryStore): it passes the store contract, the factory opens its
locations, and TRAKer and TrakIndex give the Zarr store's scores on it, bit for bit."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from trak_fixtures import checkpoints, make_data, make_model, run_traker

from trak_core import TRAKer, TrakIndex
from trak_core.errors import BadInputError
from trak_core.store import StoreMetadata, TrakStore, create_or_open_store, open_store, store_exists
from trak_core.testing import MemoryStore, StoreCase, check_store, memory_location, parametrize_with_checks

N, M = 120, 7


def _memory(meta):
    return MemoryStore.create_or_open(memory_location(uuid.uuid4().hex), meta)


@parametrize_with_checks([StoreCase(_memory, id="numpy-memory")])
def test_memory_store_passes_each_check(obj, check):
    check(obj)


def test_the_contract_fails_a_memory_store_that_marks_partials_early():
    class Eager(MemoryStore):
        def write_partial(self, model_id, shard, partial, row_sums, ggn=None, mark=True):
            super().write_partial(model_id, shard, partial, row_sums, ggn, mark=True)

    def make(meta):
        st = _memory(meta)
        return Eager(st.location, st._state)

    with pytest.raises(AssertionError, match="^check_store_partials: a partial written unmarked is done"):
        check_store(make)


def test_the_factory_opens_memory_locations_in_memory_and_others_as_zarr(tmp_path):
    meta = StoreMetadata(train_set_size=8, grad_dim=10, proj_dim=4, chunk_rows=4, shard_rows=8)
    loc = memory_location(uuid.uuid4().hex)
    assert not store_exists(loc)
    with pytest.raises(BadInputError, match="no trakflow store"):
        open_store(loc)
    st = create_or_open_store(loc, meta)
    assert isinstance(st, MemoryStore) and store_exists(loc)
    st.set_pipeline_info({"a": (1, 2)})
    again = open_store(loc)
    assert isinstance(again, MemoryStore) and again.pipeline_info() == {"a": [1, 2]}  # one store per location
    assert isinstance(create_or_open_store(str(tmp_path / "z"), meta), TrakStore)
    MemoryStore.delete(loc)
    assert not store_exists(loc)


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """The same TRAKer run (2 checkpoints, float16 rows) on a Zarr store and on an in-memory store."""
    d = tmp_path_factory.mktemp("mem")
    data, ck = make_data(n=N, m=M), checkpoints(2)
    loc = memory_location(f"traker-{uuid.uuid4().hex}")
    _, zarr_tr = run_traker(TRAKer, d / "s.zarr", ck, data, half=True, lambda_reg=1e-2, proj_dim=32)
    _, mem_tr = run_traker(TRAKer, loc, ck, data, half=True, lambda_reg=1e-2, proj_dim=32)
    yield (d / "s.zarr", loc), ck, data, (np.asarray(zarr_tr.scores), np.asarray(mem_tr.scores)), mem_tr
    MemoryStore.delete(loc)


def test_traker_on_memory_gives_the_zarr_scores_bit_for_bit(both):
    (_, loc), _, _, (zarr_scores, mem_scores), tr = both
    assert isinstance(tr.store, MemoryStore) and tr.store.location == loc
    assert mem_scores.shape == (N, M) and mem_scores.dtype == np.float32
    assert np.array_equal(mem_scores, zarr_scores)
    assert np.array_equal(np.asarray(open_store(loc).scores("exp")[:]), zarr_scores)  # what the store holds


def test_index_on_memory_gives_the_zarr_top_k_bit_for_bit(both):
    (zarr_loc, loc), ck, (_, _, xt, yt), (zarr_scores, _), _ = both
    got = {}
    for name, where in (("zarr", zarr_loc), ("memory", loc)):
        index = TrakIndex(where, model=make_model(), checkpoints=ck, task="image_classification", device="cpu")
        got[name] = (index.query((xt, yt), k=10), index.query((xt, yt), k=10, opponents=True))
    for z, m in zip(got["zarr"], got["memory"], strict=True):
        assert np.array_equal(z.indices, m.indices) and np.array_equal(z.scores, m.scores)
    top = got["memory"][0]  # and the index's scores are the stored ones
    np.testing.assert_array_equal(top.scores, np.take_along_axis(zarr_scores.T, top.indices, 1))
