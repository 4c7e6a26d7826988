"""The host side of a shard's XᵀX partial: packed on the device and copied into reused host buffers
(:class:`trak_core.solve.reduce.GramBuffers`), packed on the host into them; the stored bytes are those of the plain
path
(the full Gram, mirrored, then :func:`pack_upper`). A device here is the CPU device standing in for a GPU (the
production code takes its device branch for any device that is not the CPU, here ``meta``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trak_core import engine
from trak_core.featurize.row_sink import RowSink
from trak_core.solve import reduce
from trak_core.solve.damping import loss_curvature
from trak_core.store import StoreMetadata, TrakStore, pack_upper

P = 24


def _store_meta(curvature: str = "xtx", dtype: str = "float16", n: int = 100, shard_rows: int = 32) -> StoreMetadata:
    return StoreMetadata(
        train_set_size=n, grad_dim=100, proj_dim=P, dtype=dtype, chunk_rows=16, shard_rows=shard_rows,
        curvature=curvature,
    )  # fmt: skip


def _store(path, curvature: str = "xtx", dtype: str = "float16", n: int = 100, shard_rows: int = 32) -> TrakStore:
    st = TrakStore.create_or_open(str(path), _store_meta(curvature, dtype, n, shard_rows))
    st.init_model(0)
    g = np.random.default_rng(3)
    x = (g.standard_normal((n, P)) * g.uniform(0.2, 3.0, P)).astype(np.float32)
    x[:, 5] = -0.0  # a column of negative zeros: Gram entries that are ±0
    st.write_train_rows(0, slice(0, n), x, (g.uniform(0, 1, n) ** 3).astype(np.float32))
    return st


@pytest.fixture
def device_on_cpu(monkeypatch):
    """The device's float64 product run on the CPU device, whatever device is named."""
    real = reduce._device_product
    seen: list[str] = []

    def on_cpu(x, device, scale=None, q=None, sums=None):
        seen.append(device.type)
        return real(x, torch.device("cpu"), scale, q, sums)

    monkeypatch.setattr(reduce, "_device_product", on_cpu)
    return seen


@pytest.mark.parametrize("weighted", [False, True])
def test_device_upper_is_the_packed_mirrored_gram_bit_for_bit(monkeypatch, weighted):
    """Packed on the device: the bits of the mirrored Gram packed on the host (−0.0 entries become +0.0 as there),
    in blocks of rows that do not divide n."""
    monkeypatch.setattr(reduce, "DEVICE_BLOCK_BYTES", 8 * P * 7)
    g = np.random.default_rng(1)
    x = g.standard_normal((90, P)).astype(np.float16)
    x[:, 3], x[:40, 4] = -0.0, 0.0
    scale = np.sqrt(g.uniform(0, 1, (90, 1))) if weighted else None
    got = reduce._device_upper(x, torch.device("cpu"), scale).numpy()
    want = pack_upper(reduce._device_gram(x, torch.device("cpu"), scale))
    assert got.dtype == np.float64 and got.tobytes() == want.tobytes()
    assert not np.signbit(got[got == 0]).any()


@pytest.mark.parametrize("curvature", ["xtx", "ggn"])
@pytest.mark.parametrize("on_device", [False, True])
def test_packed_grams_in_reused_buffers_are_the_plain_grams(tmp_path, device_on_cpu, curvature, on_device):
    """shard_grams(packed=True) into GramBuffers, shard after shard: each result is pack_upper of the unpacked
    Grams (bytes), returned in the same buffers every shard."""
    st = _store(tmp_path / "s", curvature)
    device = "meta" if on_device else None
    bufs = reduce.GramBuffers()
    held = None
    for s in range(st.meta.num_shards):
        a, b = st.meta.shard_range(s)
        rows, q = st.model(0).grads[a:b], st.model(0).out_to_loss[a:b]
        got = reduce.shard_grams(st, 0, s, rows, q, device, packed=True, buffers=bufs)
        want = reduce.shard_grams(st, 0, s, rows, q, device)
        assert (got[1] is None) == (curvature == "xtx") == (want[1] is None)
        for g, w in zip(got, want, strict=True):
            if w is not None:
                assert g.tobytes() == pack_upper(w).tobytes()
        ids = [id(g) for g in got if g is not None]
        assert held is None or ids == held  # the same buffers, reused
        held = ids
        assert len(set(ids)) == len(ids)  # XᵀX and XᵀRX in buffers of their own
    assert device_on_cpu == (["meta"] * (4 if curvature == "ggn" else 2) * st.meta.num_shards if on_device else [])


def test_gram_buffers_follow_the_size():
    bufs = reduce.GramBuffers()
    a = bufs.take(0, 10, "cpu")
    assert a.shape == (10,) and a.dtype == np.float64 and bufs.take(0, 10, "cpu") is a
    assert bufs.take(1, 10, "cpu") is not a
    b = bufs.take(0, 6, "cpu")  # another proj_dim: a new buffer, the old ones dropped
    assert b.shape == (6,) and bufs.take(0, 10, "cpu") is not a


@pytest.mark.parametrize("curvature", ["xtx", "ggn"])
def test_partials_completed_on_a_device_store_the_plain_paths_bytes(tmp_path, device_on_cpu, curvature):
    """engine.complete_shard on a device with reused buffers, shard after shard (the last one short), stores the
    bytes that the device path without them stores (its full Gram mirrored, packed by the store); the row sums,
    summed on the device, are the host's to float64 round-off."""
    ref = _store(tmp_path / "ref", curvature)
    st = _store(tmp_path / "new", curvature)
    bufs = reduce.GramBuffers()
    for s in range(st.meta.num_shards):
        a, b = st.meta.shard_range(s)
        rows, q = np.asarray(st.model(0).grads[a:b]), np.asarray(st.model(0).out_to_loss[a:b])
        engine.complete_shard(st, 0, s, "meta", rows, q, bufs)
        xtx, ggn = reduce.shard_grams(ref, 0, s, rows, q, "meta")  # the unpacked device path, packed by the store
        ref.write_partial(0, s, xtx, reduce.shard_row_sums(ref, 0, s, rows, q), ggn)
    new, old = st.model(0), ref.model(0)
    assert new.partial_done[:].all()
    assert new.xtx_partials[:].tobytes() == old.xtx_partials[:].tobytes()
    np.testing.assert_allclose(new.rowsum_partials[:], old.rowsum_partials[:], rtol=1e-13)
    if curvature == "ggn":
        assert new.ggn_partials[:].tobytes() == old.ggn_partials[:].tobytes()
        r = loss_curvature(np.asarray(st.model(0).out_to_loss[0:32]))
        x = np.asarray(st.model(0).grads[0:32]).astype(np.float64)
        np.testing.assert_allclose(
            new.ggn_partials[0], pack_upper((x * r[:, None]).T @ x), rtol=1e-12, atol=1e-12 * np.abs(x).max() ** 2
        )


@pytest.mark.parametrize("n", [1, 255, 256, 700])
def test_row_sums_with_reused_buffers_are_the_blockwise_numpy_sums(n):
    """row_sums_vec widening into one reused float64 block (float16 through a float32 one): the bits of the same
    blocked sums with numpy's widening into new arrays, also for a last block that is short or the only one."""
    g = np.random.default_rng(n)
    x, q = g.standard_normal((n, 64)).astype(np.float16), g.standard_normal(n).astype(np.float32)
    qd, rn, xtq = q.astype(np.float64), np.empty(n), np.zeros(64)
    for a in range(0, n, reduce.ROW_SUMS_BLOCK):
        xb = x[a : a + reduce.ROW_SUMS_BLOCK].astype(np.float64)
        rn[a : a + reduce.ROW_SUMS_BLOCK] = np.einsum("ij,ij->i", xb, xb)
        xtq += qd[a : a + reduce.ROW_SUMS_BLOCK] @ xb
    want = np.concatenate([xtq, [qd @ qd, rn @ rn, (qd * qd) @ rn]])
    assert reduce.row_sums_vec(x, q, np.float16).tobytes() == want.tobytes()
    x32 = x.astype(np.float32)
    assert reduce.row_sums_vec(x32, q, np.float32).tobytes() == reduce.row_sums_vec(x32, q, np.float16).tobytes()


def test_pack_upper_into_a_buffer():
    a = np.arange(16.0).reshape(4, 4)
    out = np.full(10, np.nan)
    assert pack_upper(a, out) is out and np.array_equal(out, pack_upper(a))
    with pytest.raises(ValueError, match="out has shape"):
        pack_upper(a, np.empty(9))


def test_device_upper_stores_negative_zeros_as_the_mirrored_path_does(monkeypatch):
    """A product holding −0.0 in its upper triangle: the packed triangle has the mirrored path's +0.0 there."""
    acc = torch.tensor([[-0.0, 1.5, -0.0], [1.5, 2.0, -3.0], [-0.0, -3.0, -0.0]], dtype=torch.float64)
    monkeypatch.setattr(reduce, "_device_product", lambda x, device, scale=None, q=None, sums=None: acc.clone())
    got = reduce._device_upper(np.zeros((1, 3)), torch.device("cpu")).numpy()
    want = pack_upper(reduce._device_gram(np.zeros((1, 3)), torch.device("cpu")))
    assert got.tobytes() == want.tobytes() and not np.signbit(got[got == 0]).any()


class _Feat:
    """A featurizer handing over given rows (on ``device``)."""

    def __init__(self, x, q, device):
        self.x, self.q, self.device = x, q, device

    def featurize(self, batch, model_id, indices):
        return self.x[indices.start : indices.stop], self.q[indices.start : indices.stop]


@pytest.mark.parametrize("curvature", ["xtx", "ggn"])
@pytest.mark.parametrize("on_device", [False, True])
def test_featurize_shard_after_shard_stores_finalizes_bits(tmp_path, device_on_cpu, curvature, on_device):
    """featurize_shard, shard after shard in one thread (its rows and partial buffers reused; the last shard short):
    the rows as stored, and partials with the bytes finalize computes from the stored rows (on the same device)."""
    n = 100
    g = np.random.default_rng(8)
    x = (g.standard_normal((n, P)) * g.uniform(0.2, 3.0, P)).astype(np.float32)
    q = (g.uniform(0, 1, n) ** 3).astype(np.float32)
    device = "meta" if on_device else "cpu"
    st = _store(tmp_path / "new", curvature)
    st = TrakStore.create_or_open(str(tmp_path / "s"), st.meta)
    engine.plan_model(st, 0)
    for s in range(st.meta.num_shards):
        assert engine.featurize_shard(st, 0, s, lambda: _Feat(x, q, device), lambda a, b: [], 10) is False
    ref = TrakStore.create_or_open(str(tmp_path / "ref"), st.meta)
    ref.init_model(0)
    ref.write_train_rows(0, slice(0, n), x, q)
    for s in range(ref.meta.num_shards):  # finalize's path: each partial from the rows read back
        assert reduce.ensure_partial(ref, 0, s, device="meta" if on_device else None) is not None
    new, old = st.model(0), ref.model(0)
    assert new.grads[:].tobytes() == x.astype(np.float16).tobytes() == old.grads[:].tobytes()
    names = ["xtx_partials", "rowsum_partials"] + (["ggn_partials"] if curvature == "ggn" else [])
    for name in names:
        assert getattr(new, name)[:].tobytes() == getattr(old, name)[:].tobytes(), name
    assert new.partial_done[:].all()


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("curvature", ["xtx", "ggn"])
def test_row_sums_summed_on_the_device_are_the_exact_sums_to_round_off(tmp_path, device_on_cpu, dtype, curvature):
    """ensure_partial on a device: the row sums come back with the Gram (no host sum of the rows), from the rows as
    stored and before XᵀRX's weights; each is the exact sum (math.fsum of float64 terms, exact products) to float64
    round-off, and finalize on the same device recomputes the same bits."""
    import math

    n = 100
    g = np.random.default_rng(5)
    x = (g.standard_normal((n, P)) * np.exp2(g.integers(-12, 3, (n, P)))).astype(np.float32)
    q = g.uniform(-1, 1, n).astype(np.float32)
    st = _store(tmp_path / "dev", curvature, dtype)
    st.write_train_rows(0, slice(0, n), x, q)

    def host_sums_not_called(*a, **k):
        raise AssertionError("the host summed the rows")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reduce, "shard_row_sums", host_sums_not_called)
        for s in range(st.meta.num_shards):
            reduce.ensure_partial(st, 0, s, device="meta")
    got = st.model(0).rowsum_partials[:]
    for s in range(st.meta.num_shards):
        a, b = st.meta.shard_range(s)
        xs, qs = x[a:b].astype(dtype).astype(np.float64), q[a:b].astype(np.float64)
        norms = [math.fsum(v * v for v in row) for row in xs]
        want = [math.fsum(qs * xs[:, j]) for j in range(P)]
        want += [math.fsum(qs * qs), math.fsum(v * v for v in norms), math.fsum(qs * qs * np.array(norms))]
        np.testing.assert_allclose(got[s], want, rtol=1e-13, atol=1e-13 * np.abs(want).max())
    again = _store(tmp_path / "again", curvature, dtype)
    again.write_train_rows(0, slice(0, n), x, q)
    for s in range(st.meta.num_shards):
        a, b = st.meta.shard_range(s)
        rows = np.asarray(again.model(0).grads[a:b])  # the rows in memory, as a featurizing caller hands them
        assert reduce.ensure_partial(again, 0, s, device="meta", rows=rows) is not None
    assert again.model(0).rowsum_partials[:].tobytes() == got.tobytes()
    assert device_on_cpu.count("meta") >= 2 * st.meta.num_shards


def test_shard_buffers_are_kept_up_to_their_bound(tmp_path, monkeypatch):
    """featurize_shard keeps a thread's shard buffers only while a shard's fit SHARD_BUFFER_BYTES: above it each
    shard gets new memory (the kept buffers dropped) and stores the same bytes."""
    n = 64
    g = np.random.default_rng(2)
    x, q = g.standard_normal((n, P)).astype(np.float32), g.uniform(0, 1, n).astype(np.float32)
    stored = {}
    for name, bound in (("kept", 1 << 30), ("new", 1)):
        monkeypatch.setattr(engine, "SHARD_BUFFER_BYTES", bound)
        meta = _store(tmp_path / f"{name}0", n=n).meta
        st = TrakStore.create_or_open(str(tmp_path / name), meta)
        engine.plan_model(st, 0)
        for s in range(meta.num_shards):
            engine.featurize_shard(st, 0, s, lambda: _Feat(x, q, "cpu"), lambda a, b: [], 16)
            kept = engine._shard_buffers.rows_buf
            assert (kept is not None) == (name == "kept")
        stored[name] = [st.model(0).grads[:].tobytes(), st.model(0).xtx_partials[:].tobytes()]
        stored[name].append(st.model(0).rowsum_partials[:].tobytes())
    assert stored["kept"] == stored["new"]


@pytest.mark.parametrize("refused", [False, True])
def test_host_buffers_for_cuda_ask_for_page_locked_memory(monkeypatch, refused):
    """For data to or from a CUDA device (the Gram partials, TRAKer's shard rows) the host buffers are page-locked
    (asked of torch; here without CUDA, a stand-in that hands back ordinary memory), pageable where that is refused;
    for the CPU nothing is asked."""
    from trak_core.featurize.row_sink import _ShardRuns

    asked = []
    real = torch.empty

    def empty(*args, pin_memory=False, **kw):
        asked.append((pin_memory, kw.get("dtype")))
        if pin_memory and refused:
            raise RuntimeError("cannot lock memory")
        return real(*args, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    buf = reduce.GramBuffers().take(0, 12, "cuda")
    assert asked == [(True, torch.float64)] and buf.shape == (12,) and buf.dtype == np.float64
    asked.clear()
    meta = _store_meta()
    rows = _ShardRuns("cuda")._buffer(meta, 0)
    assert asked == [(True, torch.float16)] and rows.shape == (meta.rows_per_shard, P) and rows.dtype == np.float16
    asked.clear()
    reduce.GramBuffers().take(0, 12, "cpu")
    assert _ShardRuns("cpu")._buffer(meta, 1).dtype == np.float16 and asked == []


@pytest.mark.parametrize("curvature", ["xtx", "ggn"])
def test_traker_on_a_device_stores_the_plain_paths_partials(tmp_path, device_on_cpu, monkeypatch, curvature):
    """TRAKer in its GPU setting (partials while featurizing, computed on a device: here the CPU standing in), shard
    after shard into its reused buffers: the stored partials and row sums are the plain device path's bytes from
    the stored rows (the row sums summed on the device)."""
    import logging

    from trak_core.compat.traker import TRAKer

    monkeypatch.setattr(RowSink, "partials_while_featurizing", lambda self: True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).eval()
    n = 100
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 12, generator=g), torch.randint(0, 3, (n,), generator=g)
    tr = TRAKer(
        model=model, task="image_classification", train_set_size=n, save_dir=str(tmp_path / "t"), device="cpu",
        proj_dim=P, chunk_rows=8, shard_rows=32, logging_level=logging.ERROR, curvature=curvature,
    )  # fmt: skip
    tr._rows._shards.device = "meta"
    tr.load_checkpoint(model.state_dict(), model_id=0)
    for a in range(0, n, 10):
        tr.featurize((x[a : a + 10], y[a : a + 10]), num_samples=len(x[a : a + 10]))
    tr._flush_rows()
    st = tr.store
    m = st.model(0)
    assert m.partial_done[:].all() and device_on_cpu.count("meta") >= st.meta.num_shards
    ref = TrakStore.create_or_open(str(tmp_path / "ref"), st.meta)
    ref.init_model(0)
    ref.write_train_rows(0, slice(0, n), np.asarray(m.grads[:]), np.asarray(m.out_to_loss[:]))
    for s in range(st.meta.num_shards):
        a, b = st.meta.shard_range(s)
        rows, q = np.asarray(m.grads[a:b]), np.asarray(m.out_to_loss[a:b])
        xtx, ggn = reduce.shard_grams(ref, 0, s, rows, q, "meta")
        sums = np.empty(P + 3)
        reduce.shard_grams(ref, 0, s, rows, q, "meta", packed=True, sums=sums)
        ref.write_partial(0, s, xtx, sums, ggn)
    names = ["xtx_partials", "rowsum_partials"] + (["ggn_partials"] if curvature == "ggn" else [])
    for name in names:
        assert getattr(m, name)[:].tobytes() == getattr(ref.model(0), name)[:].tobytes(), name
    tr._close()
