"""TRAKer on a GPU stores each shard's XᵀX partial as soon as the shard's rows are written (from the rows still in
memory), so finalize neither reads the rows back nor copies them to the device again. The policy is
``RowSink.partials_while_featurizing`` (device != cpu); here it is switched on for the CPU, where the partials must be
the very bits finalize computes from the stored rows."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

import trak_core
from trak_core.featurize.row_sink import RowSink

N, CHUNK, SHARD = 150, 8, 32  # 5 shards, the last one short


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3)).eval()


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 12, generator=g), torch.randint(0, 3, (N,), generator=g)


def _traker(path, model, dtype_half=False, curvature="xtx"):
    return trak_core.TRAKer(
        model=model,
        task="image_classification",
        train_set_size=N,
        save_dir=str(path),
        device="cpu",
        proj_dim=24,
        use_half_precision=dtype_half,
        chunk_rows=CHUNK,
        shard_rows=SHARD,
        logging_level=logging.ERROR,
        curvature=curvature,
    )


def _featurize(tr, model, x, y, order):
    tr.load_checkpoint(model.state_dict(), model_id=0)
    for inds in order:
        tr.featurize((x[inds], y[inds]), inds=np.asarray(inds))


def _runs(batches):
    """Consecutive ascending batches of the given sizes over all N rows."""
    out, a = [], 0
    for b in batches:
        out.append(list(range(a, min(a + b, N))))
        a += b
    return [r for r in out if r]


@pytest.mark.parametrize("curvature", ["xtx", "ggn"])  # ggn: the XᵀRX partials too
@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("batches", [[10] * 15, [5, 27, 40, 3, 75], [150]], ids=["10s", "ragged", "one"])
def test_partials_stored_while_featurizing_are_finalizes_bits(tmp_path, monkeypatch, half, batches, curvature):
    model = _model()
    x, y = _data()
    ref = _traker(tmp_path / "ref", model, half, curvature)
    _featurize(ref, model, x, y, _runs(batches))
    ref._flush_rows()
    assert not ref.store.model(0).partial_done[:].any()  # the CPU policy: finalize computes them
    monkeypatch.setattr(RowSink, "partials_while_featurizing", lambda self: True)
    tr = _traker(tmp_path / "gpu", model, half, curvature)
    _featurize(tr, model, x, y, _runs(batches))
    tr._flush_rows()
    assert tr.store.model(0).partial_done[:].all()  # every shard's partial, before finalize
    ref.finalize_features()
    tr.finalize_features()
    a, b = ref.store.model(0), tr.store.model(0)
    np.testing.assert_array_equal(b.xtx_partials[:], a.xtx_partials[:])
    np.testing.assert_array_equal(b.rowsum_partials[:], a.rowsum_partials[:])
    if curvature == "ggn":
        assert b.ggn_partials[:].any()
        np.testing.assert_array_equal(b.ggn_partials[:], a.ggn_partials[:])
    np.testing.assert_array_equal(b.inverse[:], a.inverse[:])
    assert tr.store.finalize_info(0) == ref.store.finalize_info(0)


def test_rows_out_of_order_leave_their_shards_to_finalize(tmp_path, monkeypatch):
    """A shard whose rows do not come in one ascending run from its first row (here: shard 1 begun mid-way, shard
    3 interrupted by rows of shard 2 written on their own) gets no early partial; finalize computes it, and the
    result is the reference's."""
    monkeypatch.setattr(RowSink, "partials_while_featurizing", lambda self: True)
    model = _model()
    x, y = _data()
    order = [list(range(0, 32)), list(range(40, 64)), list(range(96, 110)), [70, 65, 66], list(range(110, 150))]
    order += [list(range(32, 40)), [64], list(range(67, 70)), list(range(71, 96))]
    tr = _traker(tmp_path / "t", model)
    _featurize(tr, model, x, y, order)
    tr._flush_rows()
    done = tr.store.model(0).partial_done[:].astype(bool).tolist()
    assert done == [True, False, False, False, True]
    tr.finalize_features()
    monkeypatch.undo()
    ref = _traker(tmp_path / "ref", model)  # the same batches (a row's float32 gradient depends on its batch)
    _featurize(ref, model, x, y, order)
    ref.finalize_features()
    np.testing.assert_array_equal(tr.store.model(0).xtx_partials[:], ref.store.model(0).xtx_partials[:])
    np.testing.assert_array_equal(tr.store.model(0).inverse[:], ref.store.model(0).inverse[:])


@pytest.mark.parametrize("order", ["ascending", "shard-1-late"])
def test_finalize_sums_the_partials_it_stored_without_reading_them_back(tmp_path, monkeypatch, order):
    """The partials stored while featurizing are summed as they are stored (shard order, the additions finalize
    makes reading them): finalize then reads none back and gives the reference's bits. A shard completed out of
    order ends the running sum: then they are all read back."""
    from trak_core.store.arrays import StoredArray

    model = _model()
    x, y = _data()
    runs = _runs([32] * 5)
    if order == "shard-1-late":
        runs = [runs[0], runs[2], runs[1], runs[3], runs[4]]
    ref = _traker(tmp_path / "ref", model)
    _featurize(ref, model, x, y, runs)
    ref.finalize_features()
    monkeypatch.setattr(RowSink, "partials_while_featurizing", lambda self: True)
    tr = _traker(tmp_path / "gpu", model)
    _featurize(tr, model, x, y, runs)
    tr._flush_rows()
    assert tr.store.model(0).partial_done[:].all()
    reads = []
    real = StoredArray.read_into
    monkeypatch.setattr(StoredArray, "read_into", lambda self, *a: reads.append(self.array.path) or real(self, *a))
    tr.finalize_features()
    assert (reads == []) == (order == "ascending"), reads
    np.testing.assert_array_equal(tr.store.model(0).inverse[:], ref.store.model(0).inverse[:])
    assert tr.store.finalize_info(0) == ref.store.finalize_info(0)


def _finalized_reference(tmp_path):
    """(model, x, y, batches of 10, a TRAKer that featurized them and finalized on the CPU's policy)."""
    model = _model()
    x, y = _data()
    runs = _runs([10] * 15)
    ref = _traker(tmp_path / "ref", model)
    _featurize(ref, model, x, y, runs)
    ref.finalize_features()
    return model, x, y, runs, ref


def test_a_partial_still_being_stored_reads_its_own_rows(tmp_path, monkeypatch):
    """A shard's partial is stored on a thread of its own while the next shard's rows are written: here the first
    partial is held back until rows of the second shard are in memory, and it still has the first shard's rows
    (each run has its own buffer); the result is the reference's bits."""
    import threading

    from trak_core import engine

    model, x, y, runs, ref = _finalized_reference(tmp_path)
    go, real = threading.Event(), engine.complete_shard

    def held(store, mid, shard, *args):
        if shard == 0:
            assert go.wait(30)
        return real(store, mid, shard, *args)

    monkeypatch.setattr(engine, "complete_shard", held)
    monkeypatch.setattr(RowSink, "partials_while_featurizing", lambda self: True)
    tr = _traker(tmp_path / "t", model)
    _featurize(tr, model, x, y, runs[:5])  # rows 0..49: shard 0 complete, 18 rows of shard 1 written
    go.set()
    for inds in runs[5:]:
        tr.featurize((x[inds], y[inds]), inds=np.asarray(inds))
    tr._flush_rows()
    assert tr.store.model(0).partial_done[:].all()
    tr.finalize_features()
    np.testing.assert_array_equal(tr.store.model(0).xtx_partials[:], ref.store.model(0).xtx_partials[:])
    np.testing.assert_array_equal(tr.store.model(0).inverse[:], ref.store.model(0).inverse[:])


def test_a_failed_partial_is_raised_and_left_to_finalize(tmp_path, monkeypatch):
    """A partial that fails on its thread is raised in the caller (by the next featurize or flush); the rows stay
    written and flagged, and finalize computes the missing partial: the reference's bits."""
    from trak_core.featurize import row_sink

    model, x, y, runs, ref = _finalized_reference(tmp_path)
    real = row_sink.complete_shard

    def failing(store, mid, shard, *args):
        if shard == 1:
            raise OSError("disk full (test)")
        return real(store, mid, shard, *args)

    monkeypatch.setattr(row_sink, "complete_shard", failing)
    monkeypatch.setattr(RowSink, "partials_while_featurizing", lambda self: True)
    tr = _traker(tmp_path / "t", model)
    tr.load_checkpoint(model.state_dict(), model_id=0)
    raised = []
    for inds in runs:  # the reference's batches (a row's float32 gradient depends on its batch)
        try:
            tr.featurize((x[inds], y[inds]), inds=np.asarray(inds))
        except OSError as e:
            raised.append(str(e))
    try:
        tr._flush_rows()
    except OSError as e:
        raised.append(str(e))
    assert raised == ["disk full (test)"]  # given once
    tr._flush_rows()
    assert tr.store.model(0).featurized[:].all()
    assert not tr.store.model(0).partial_done[1]
    tr.finalize_features()
    np.testing.assert_array_equal(tr.store.model(0).xtx_partials[:], ref.store.model(0).xtx_partials[:])
    np.testing.assert_array_equal(tr.store.model(0).inverse[:], ref.store.model(0).inverse[:])
