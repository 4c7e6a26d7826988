"""Every read of stored rows is checked when it is made, not only when the index is opened: a grads or
out_to_loss chunk deleted (or damaged) after TrakIndex opened the store makes the next query fail naming the
array and the rows, never answer with the lost rows read as zeros."""

from __future__ import annotations

import gc
import os
import shutil

import numpy as np
import pytest
from trak_fixtures import checkpoints, make_data, make_model, run_traker

from trak_core import TRAKer, TrakIndex
from trak_core.errors import StoreDamageError

N, M = 96, 4


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("readchk")
    data = make_data(n=N, m=M)
    ck = checkpoints(2)
    _, tr = run_traker(TRAKer, d / "s.zarr", ck, data, lambda_reg=1e-2, proj_dim=16, chunk_rows=16, shard_rows=32)
    del tr
    gc.collect()
    return d / "s.zarr", ck, data


@pytest.mark.parametrize("array", ["grads", "out_to_loss"])
@pytest.mark.parametrize("how", ["deleted", "flipped"])
def test_chunk_lost_after_open_is_an_error_naming_it(built, tmp_path, array, how):
    src, ck, (_, _, xt, yt) = built
    store = tmp_path / "s.zarr"
    shutil.copytree(src, store)
    index = TrakIndex(store, model=make_model(), checkpoints=ck, device="cpu")
    want = index.query((xt, yt), k=5)
    chunk = store / "models" / "1" / array / "c" / ("2/0" if array == "grads" else "2")
    assert chunk.is_file()
    if how == "deleted":
        os.remove(chunk)
    else:
        raw = bytearray(chunk.read_bytes())
        raw[3] ^= 0x40
        chunk.write_bytes(bytes(raw))
    problem = "is missing" if how == "deleted" else "fails its crc32c checksum"
    rows = r"\(rows 32\.\.47\)"
    with pytest.raises(StoreDamageError, match=rf"array models/1/{array}, chunk c/2[/0]* {rows} {problem}"):
        index.query((xt, yt), k=5)
    shutil.copyfile(src / chunk.relative_to(store), chunk)  # restored: the same answer again
    again = index.query((xt, yt), k=5)
    np.testing.assert_array_equal(again.indices, want.indices)
    np.testing.assert_array_equal(again.scores, want.scores)
