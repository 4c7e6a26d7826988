"""Whole chunks written straight to their files (trak_core.store.chunkio) are the bytes zarr writes, sealed with the
same place records, and a write that fails part way leaves rows unflagged (featurized again, then identical)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from trak_core import engine
from trak_core.store import StoreMetadata, TrakStore, chunkio
from trak_core.store import places as store_places
from trak_core.store.verify import verify_location


def _float16_edges() -> np.ndarray:
    """float32 values at and around every float16 rounding boundary, and the special values."""
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    h = np.sort(h[np.isfinite(h)].astype(np.float32))
    mid = (h[:-1].astype(np.float64) + h[1:].astype(np.float64)) / 2  # exact ties (float32 holds them)
    mid32 = mid.astype(np.float32)
    near = [mid32, np.nextafter(mid32, np.float32(np.inf)), np.nextafter(mid32, np.float32(-np.inf))]
    special = np.array(
        [0.0, -0.0, np.inf, -np.inf, 65504.0, 65519.99, 65520.0, 1e-8, -1e-8, 6e-8, 2.98e-8, 3e38, -3e38, 1e-45],
        dtype=np.float32,
    )
    rng = np.random.default_rng(0)
    rand = (rng.standard_normal(200_000) * 10.0 ** rng.integers(-9, 6, 200_000)).astype(np.float32)
    return np.concatenate([h, *near, special, rand])


def test_float16_conversion_is_numpys_bit_for_bit():
    x = _float16_edges()
    x = x[: x.size // 7 * 7].reshape(-1, 7)
    with np.errstate(over="ignore"):  # values beyond float16's range become inf in both
        got = chunkio.to_dtype(x, np.float16)
        want = x.astype(np.float16)
    assert got.flags.c_contiguous
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    # NaNs keep numpy's payload bits (numpy's conversion is taken for a block holding one)
    nan = np.array([1.0, np.nan, -np.nan, np.uint32(0x7FA00001).view(np.float32)], dtype=np.float32)
    assert np.array_equal(chunkio.to_dtype(nan, np.float16).view(np.uint16), nan.astype(np.float16).view(np.uint16))
    strided = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4) / 7)
    assert np.array_equal(chunkio.to_dtype(strided, np.float16), strided.astype(np.float16))


def _meta(n: int, p: int = 24, chunk_rows: int = 8, dtype: str = "float16") -> StoreMetadata:
    return StoreMetadata(
        train_set_size=n, grad_dim=p, proj_dim=p, projector="noop", dtype=dtype, chunk_rows=chunk_rows, shard_rows=16
    )


def _files(root: Path, sub: str) -> dict[str, bytes]:
    base = root / sub
    return {str(f.relative_to(base)): f.read_bytes() for f in sorted(base.rglob("*")) if f.is_file()}


def _rows(n: int, p: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, p), dtype=np.float32) * np.float32(0.3), rng.random(n, dtype=np.float32)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_direct_chunks_are_zarrs_bytes_and_records(tmp_path, monkeypatch, dtype):
    n, p = 37, 24  # 5 chunks of 8 rows, the last one partly beyond the array (padded with zeros, as zarr pads)
    x, q = _rows(n, p)
    written = []
    real_write = chunkio.write_chunk_files
    monkeypatch.setattr(chunkio, "write_chunk_files", lambda *a: written.append(a[0].path) or real_write(*a))
    direct = TrakStore.create_or_open(str(tmp_path / "direct"), _meta(n, p, dtype=dtype))
    direct.init_model(0)
    stored = direct.write_train_rows(0, slice(0, 16), x[:16], q[:16])
    direct.write_train_rows(0, np.arange(16, n), x[16:], q[16:])
    assert written == ["models/0/grads", "models/0/out_to_loss", "models/0/featurized"] * 2  # no zarr write
    assert stored.dtype == np.dtype(dtype) and np.array_equal(stored, x[:16].astype(dtype))

    monkeypatch.setattr(chunkio, "direct_layout", lambda arr: None)  # the same writes through zarr
    ref = TrakStore.create_or_open(str(tmp_path / "zarr"), _meta(n, p, dtype=dtype))
    ref.init_model(0)
    ref.write_train_rows(0, slice(0, 16), x[:16], q[:16])
    ref.write_train_rows(0, np.arange(16, n), x[16:], q[16:])
    for name in ("grads", "out_to_loss", "featurized"):
        got = _files(tmp_path / "direct", f"models/0/{name}/c")
        assert got and got == _files(tmp_path / "zarr", f"models/0/{name}/c"), name
    # the records sealed from the trailers computed while writing are the ones record_places seals from the files
    before = _files(tmp_path / "direct", "models/0/grads/d")
    arr = direct.model(0).grads.array
    store_places.record_places(arr, direct.meta.store_id, [(i, 0) for i in range(5)])
    assert _files(tmp_path / "direct", "models/0/grads/d") == before and len(before) == 5
    reopened = TrakStore.open(str(tmp_path / "direct"))
    assert np.array_equal(np.asarray(reopened.model(0).grads[:]), x.astype(dtype))
    assert np.array_equal(np.asarray(reopened.model(0).out_to_loss[:]), q)
    assert verify_location(str(tmp_path / "direct")).ok


def test_partials_written_directly_are_zarrs_bytes(tmp_path, monkeypatch):
    n, p = 32, 24
    rng = np.random.default_rng(2)
    g = rng.standard_normal((p, p))
    part, sums = g @ g.T, rng.standard_normal(p + 3)
    for name in ("direct", "zarr"):
        if name == "zarr":
            monkeypatch.setattr(chunkio, "direct_layout", lambda arr: None)
        st = TrakStore.create_or_open(str(tmp_path / name), _meta(n, p))
        st.init_model(0)
        st.write_partial(0, 1, part, sums)
    for arr in ("xtx_partials", "rowsum_partials", "partial_done"):
        got = _files(tmp_path / "direct", f"models/0/{arr}/c")
        assert got and got == _files(tmp_path / "zarr", f"models/0/{arr}/c"), arr
    assert np.array_equal(TrakStore.open(str(tmp_path / "direct")).model(0).rowsum_partials[1], sums)


def test_rows_not_whole_chunks_go_through_zarr(tmp_path, monkeypatch):
    n, p = 20, 24
    x, q = _rows(n, p)
    calls = []
    monkeypatch.setattr(chunkio, "write_chunk_files", lambda *a: calls.append(a) or [])
    st = TrakStore.create_or_open(str(tmp_path / "s"), _meta(n, p))
    st.init_model(0)
    st.write_train_rows(0, slice(3, 11), x[3:11], q[3:11])  # parts of chunks 0 and 1
    st.write_train_rows(0, np.array([0, 2, 12]), x[[0, 2, 12]], q[[0, 2, 12]])  # not one run
    assert calls == []
    got = np.asarray(st.model(0).grads[:13])  # chunk 2 (rows 16..19) was never written: reading it is an error
    for rows in (slice(3, 11), [0, 2, 12]):
        assert np.array_equal(got[rows], x[rows].astype(np.float16))
    assert np.flatnonzero(st.featurized_mask(0)).tolist() == [0, 2, *range(3, 11), 12]


class _Feat:
    device = "cpu"

    def __init__(self, x, q):
        self.x, self.q = x, q

    def featurize(self, batch, model_id, indices):
        return self.x[indices.start : indices.stop], self.q[indices.start : indices.stop]


def test_a_write_failing_part_way_leaves_the_shard_to_featurize_again(tmp_path, monkeypatch):
    n, p = 32, 24
    x, q = _rows(n, p)
    st = TrakStore.create_or_open(str(tmp_path / "s"), _meta(n, p))
    engine.plan_model(st, 0)
    real_put = chunkio._put

    def failing(path, *a):
        if "/grads/" not in path and "_partials/" not in path:  # grads' two chunks written, then the disk fails
            raise OSError(28, "No space left on device")
        real_put(path, *a)

    monkeypatch.setattr(chunkio, "_put", failing)
    with pytest.raises(OSError, match="No space left"):
        engine.featurize_shard(st, 0, 0, lambda: _Feat(x, q), lambda a, b: [], 8)
    assert not st.featurized_mask(0)[:16].any() and not st.partial_done(0, 0)
    model = tmp_path / "s/models/0"
    left = sorted(str(f.relative_to(model)) for f in model.rglob("*") if f.is_file() and "/c/" in str(f))
    # grads' two chunks, the shard's partials written beside them but not marked done, no temporary file
    assert [f for f in left if f.startswith("grads/")] == ["grads/c/0/0", "grads/c/1/0"]
    assert all(f.startswith(("grads/", "xtx_partials/", "rowsum_partials/")) for f in left), left
    monkeypatch.setattr(chunkio, "_put", real_put)
    for shard in range(2):  # the rerun featurizes shard 0 again and completes both
        assert engine.featurize_shard(st, 0, shard, lambda: _Feat(x, q), lambda a, b: [], 8) is False
    again = TrakStore.open(str(tmp_path / "s"))
    assert np.array_equal(np.asarray(again.model(0).grads[:]), x.astype(np.float16))
    assert again.featurized_mask(0).all() and again.num_partials_done(0) == 2
    assert verify_location(str(tmp_path / "s")).ok


def test_a_shards_partial_is_marked_only_after_its_rows_and_a_failed_partial_is_completed_by_the_rerun(
    tmp_path, monkeypatch
):
    n, p = 32, 24
    x, q = _rows(n, p)
    st = TrakStore.create_or_open(str(tmp_path / "s"), _meta(n, p))
    engine.plan_model(st, 0)
    real_mark, marked_after = TrakStore.mark_partial, []

    def mark(self, model_id, shard):
        a, b = self.meta.shard_range(shard)
        marked_after.append(bool(self.featurized_mask(model_id)[a:b].all()))
        real_mark(self, model_id, shard)

    monkeypatch.setattr(TrakStore, "mark_partial", mark)
    assert engine.featurize_shard(st, 0, 0, lambda: _Feat(x, q), lambda a, b: [], 8) is False
    assert marked_after == [True] and st.partial_done(0, 0)
    real_partials = engine.shard_partials

    def failing(*a, **k):
        raise MemoryError("out of device memory")

    monkeypatch.setattr(engine, "shard_partials", failing)  # shard 1's partial fails; its rows are written
    with pytest.raises(MemoryError):
        engine.featurize_shard(st, 0, 1, lambda: _Feat(x, q), lambda a, b: [], 8)
    assert st.featurized_mask(0).all() and not st.partial_done(0, 1) and marked_after == [True]
    monkeypatch.setattr(engine, "shard_partials", real_partials)
    assert engine.featurize_shard(st, 0, 1, lambda: _Feat(x, q), lambda a, b: [], 8) is True  # rows kept
    want = x[16:].astype(np.float16).astype(np.float64)
    packed = np.asarray(st.model(0).xtx_partials[1])
    iu = np.triu_indices(p)
    np.testing.assert_allclose(packed, (want.T @ want)[iu], rtol=1e-6)
    assert st.num_partials_done(0) == 2 and verify_location(str(tmp_path / "s")).ok


def test_batches_converted_into_the_stored_rows_are_the_concatenation_converted(tmp_path):
    rng = np.random.default_rng(3)
    pieces = [rng.standard_normal((k, 24), dtype=np.float32) for k in (5, 1, 17)]
    pieces[1][0, 3] = np.nan  # a piece holding a NaN: numpy's bits for it
    want = np.concatenate(pieces).astype(np.float16)
    got = chunkio.stack_dtype(pieces, np.float16)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    n = 23
    st = TrakStore.create_or_open(str(tmp_path / "s"), _meta(n, 24))
    st.init_model(0)
    stored = st.write_train_rows(0, slice(0, n), pieces, np.zeros(n, dtype=np.float32))
    assert np.array_equal(stored.view(np.uint16), want.view(np.uint16))
    assert np.array_equal(np.asarray(st.model(0).grads[:]).view(np.uint16), want.view(np.uint16))
    buf = np.full((n, 24), 7, dtype=np.float16)  # a reused buffer: the rows land in it
    again = st.write_train_rows(0, slice(0, n), pieces, np.zeros(n, dtype=np.float32), out=buf)
    assert again is buf and np.array_equal(buf.view(np.uint16), want.view(np.uint16))
    with pytest.raises(ValueError, match="buffer"):
        st.write_train_rows(0, slice(0, n), pieces, np.zeros(n, dtype=np.float32), out=buf[:5])
