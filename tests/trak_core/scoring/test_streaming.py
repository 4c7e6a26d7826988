"""Streaming scoring (trak_core.scoring.streaming): bit-identical to the plain loop for any block size, block sizes from
the hardware, errors from the background threads reach the caller."""

import numpy as np
import pytest
import torch

from trak_core.errors import StoreDamageError
from trak_core.scoring import streaming
from trak_core.scoring.combine import combine_checkpoints
from trak_core.solve import reduce
from trak_core.store import StoreMetadata, TrakStore


def plain_loop(store: TrakStore, exp: str, used: list[int], step: int) -> np.ndarray:
    """The unpipelined loop the streaming replaced (one fresh float32 copy per read, no threads): X (A Gᵀ)."""
    targets = {
        mid: streaming.grads_right_hand(store.inverse(mid), reduce.load_targets(store, exp, [mid])[mid]) for mid in used
    }
    n, m = store.meta.train_set_size, store.num_targets(exp)
    out = np.empty((n, m), dtype=np.float32)
    for a in range(0, n, step):
        b = min(a + step, n)
        acc = torch.zeros(b - a, m, dtype=torch.float32)
        qsum = np.zeros(b - a, dtype=np.float64)
        for mid in used:
            mm = store.model(mid)
            acc.addmm_(torch.from_numpy(mm.grads[a:b].astype(np.float32)), targets[mid])
            qsum += mm.out_to_loss[a:b].astype(np.float64)
        out[a:b] = combine_checkpoints(acc.numpy(), qsum.astype(np.float32), len(used))
    return out


def finalized_model(st: TrakStore, mid: int, rng, scale: float = 3.0) -> None:
    """Rows X, Q and a (symmetric) inverse written for ``mid``, marked finalized."""
    n, p = st.meta.train_set_size, st.meta.proj_dim
    st.init_model(mid)
    x = (rng.standard_normal((n, p)) * scale).astype(st.meta.dtype)
    st.write_train_rows(mid, slice(0, n), x, rng.uniform(0, 1, n).astype(np.float32))
    b = rng.standard_normal((p, p))
    st.write_inverse(mid, b @ b.T / p + np.eye(p))
    st.set_finalize_info(mid, {"lambda_reg": 0.0})


def scored_store(path, dtype: str, ckpts: int, n: int = 300, p: int = 24, m: int = 9) -> TrakStore:
    rng = np.random.default_rng(5)
    st = TrakStore.create_or_open(
        str(path), StoreMetadata(train_set_size=n, grad_dim=100, proj_dim=p, dtype=dtype, chunk_rows=16)
    )
    st.init_experiment("e", m)
    for mid in range(ckpts):
        finalized_model(st, mid, rng)
        st.init_experiment_model("e", mid)
        st.write_target_rows("e", mid, slice(0, m), rng.standard_normal((m, p)).astype(np.float32))
    return st


@pytest.mark.parametrize("dtype,ckpts", [("float16", 1), ("float16", 3), ("float32", 2)])
@pytest.mark.parametrize("block_rows", [None, 7, 16, 64, 1000])
def test_finalize_scores_bit_identical_to_plain_loop(tmp_path, dtype, ckpts, block_rows):
    st = scored_store(tmp_path / "s", dtype, ckpts)
    want = plain_loop(st, "e", list(range(ckpts)), st.meta.shard_rows)
    got = reduce.finalize_scores(st, "e", block_rows=block_rows)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(st.scores("e")[:], want)  # the store holds the same bits


def test_score_rows_per_shard_bit_identical(tmp_path):
    st = scored_store(tmp_path / "s", "float16", 2)
    want = plain_loop(st, "e", [0, 1], st.meta.shard_rows)
    reduce.solve_targets(st, "e", [0, 1])  # the pipeline's prepare_scores
    st.begin_scores("e", [0, 1])
    for s in range(st.meta.num_shards):
        a, b = st.meta.shard_range(s)
        reduce.score_rows(st, "e", [0, 1], a, b, block_rows=32)
    np.testing.assert_array_equal(st.scores("e")[:], want)


def test_default_blocks_below_a_shard_bit_identical(tmp_path, monkeypatch):
    """Blocks smaller than a shard (the cache decides), a last shard that does not divide into them."""
    monkeypatch.setattr(streaming, "cache_bytes", lambda: 2 * 4 * (256 + 64) * 128)  # 128 rows fit: 256 (the min)
    rng = np.random.default_rng(7)
    n, p, m = 2600, 256, 64  # shards of 1024, 1024, 552 rows: blocks of 256, the last 296 (256 + 40)
    meta = StoreMetadata(train_set_size=n, grad_dim=1000, proj_dim=p, dtype="float16", chunk_rows=64, shard_rows=1024)
    st = TrakStore.create_or_open(str(tmp_path / "s"), meta)
    st.init_experiment("e", m)
    for mid in range(2):
        finalized_model(st, mid, rng, scale=1.0)
        st.init_experiment_model("e", mid)
        st.write_target_rows("e", mid, slice(0, m), rng.standard_normal((m, p)).astype(np.float32))
    assert streaming.score_block_rows(p, m, 64, 1024) == streaming.MIN_GEMM_ROWS
    assert streaming.score_blocks(0, n, 256, 1024)[-2:] == [(2048, 2304), (2304, 2600)]
    want = plain_loop(st, "e", [0, 1], 1024)
    np.testing.assert_array_equal(reduce.finalize_scores(st, "e"), want)


def test_score_blocks_tile_shards():
    assert streaming.score_blocks(0, 300, 128, 128) == [(0, 128), (128, 256), (256, 300)]
    # blocks never cross a shard; a small remainder joins the shard's last full block
    assert streaming.score_blocks(0, 1500, 128, 512)[-3:] == [(1024, 1152), (1152, 1280), (1280, 1500)]
    assert streaming.score_blocks(512, 1024, 128, 512) == [(512, 640), (640, 768), (768, 896), (896, 1024)]
    # a shard no larger than a block is one block, as in the one-GEMM-per-shard loop
    assert streaming.score_blocks(0, 1030, 1024, 1024) == [(0, 1024), (1024, 1030)]
    # an explicit block size without shards: exactly those blocks
    assert streaming.score_blocks(0, 50, 15) == [(0, 15), (15, 30), (30, 45), (45, 50)]


def test_progress_counts_every_row(tmp_path):
    """progress(rows) once per score chunk written: here 128-row chunks (a shard: few targets), the last 44. The
    writers run concurrently, so the order of the reports is not guaranteed; the multiset of chunk sizes is."""
    st = scored_store(tmp_path / "s", "float16", 1)
    seen = []
    reduce.finalize_scores(st, "e", block_rows=48, progress=seen.append)
    assert st.experiment("e").scores.chunks[0] == st.meta.shard_rows == 128
    assert sorted(seen) == [44, 128, 128]
    assert sum(seen) == st.meta.train_set_size


def test_score_chunks_by_bytes_and_flags_per_shard(tmp_path):
    """A new experiment's scores come in chunks of whole chunk_rows that divide shard_rows and hold about
    SCORE_CHUNK_BYTES (at least chunk_rows), its flags in one chunk per shard; the stream writes each score chunk
    once and each shard's flags once."""
    from trak_core import store as store_mod

    meta = StoreMetadata(train_set_size=10_000, grad_dim=100, proj_dim=64, chunk_rows=1024, shard_rows=8192)
    budget = store_mod.SCORE_CHUNK_BYTES
    assert meta.score_chunk_rows(budget // (4 * 8192)) == 8192  # a whole shard fits
    assert meta.score_chunk_rows(budget // (4 * 4096)) == 4096
    assert meta.score_chunk_rows(budget // (4 * 3072)) == 2048  # 3072 rows fit, but do not divide the shard
    assert meta.score_chunk_rows(10 * budget) == 1024  # wider than the budget: one chunk of rows at least
    st = scored_store(tmp_path / "s", "float16", 2, n=300, p=24, m=9)
    calls = {"rows": [], "done": []}
    real = st.score_rows_writer

    def spy(exp):
        w = real(exp)
        rows, done = w.rows, w.mark_done
        object.__setattr__(w, "rows", lambda a, b, x: (calls["rows"].append((a, b)), rows(a, b, x)))
        object.__setattr__(w, "mark_done", lambda a, b: (calls["done"].append((a, b)), done(a, b)))
        return w

    st.score_rows_writer = spy
    got = reduce.finalize_scores(st, "e", block_rows=16)
    e = st.experiment("e")
    assert e.scores.chunks[0] == 128 and e.scores_done.chunks == (128,)
    assert sorted(calls["rows"]) == [(0, 128), (128, 256), (256, 300)]
    assert sorted(calls["done"]) == [(0, 128), (128, 256), (256, 300)]
    np.testing.assert_array_equal(got, plain_loop(st, "e", [0, 1], st.meta.shard_rows))


def test_experiment_without_score_layout_keeps_its_chunks(tmp_path):
    """An experiment created before ``score_layout`` was recorded (scores and flags in chunk_rows chunks) reopens
    (its arrays checked against what its attributes imply), streams bit-identically and is written per chunk."""
    st = scored_store(tmp_path / "s", "float16", 1)
    del st.experiment("e").group.attrs["score_layout"]
    want = plain_loop(st, "e", [0], st.meta.shard_rows)
    seen = []
    np.testing.assert_array_equal(reduce.finalize_scores(st, "e", block_rows=48, progress=seen.append), want)
    e = st.experiment("e")
    assert e.scores.chunks[0] == e.scores_done.chunks[0] == st.meta.chunk_rows == 16
    assert seen == [16] * 18 + [12]
    again = TrakStore.open(str(tmp_path / "s"))  # check_arrays: the old chunking is what its attributes imply
    np.testing.assert_array_equal(again.scores("e")[:], want)


def test_score_layout_that_does_not_tile_the_shards_is_refused(tmp_path):
    from trak_core.errors import StoreMismatchError

    st = scored_store(tmp_path / "s", "float16", 1)
    st.experiment("e").group.attrs["score_layout"] = {"chunk_rows": 48, "done_rows": 128}  # 48 does not divide 128
    with pytest.raises(StoreMismatchError, match="score_layout"):
        reduce.finalize_scores(st, "e")
    assert "scores" not in st.experiment("e").group  # nothing created


def test_score_pieces_tile_the_range():
    # one segment per score chunk, pieces of whole chunks, split until every worker has one
    assert streaming.score_pieces(0, 300, 128, 16, 1, 10**6) == [(0, 128, 0), (128, 256, 1), (256, 300, 2)]
    assert streaming.score_pieces(0, 128, 128, 16, 2, 10**6) == [(0, 64, 0), (64, 128, 0)]
    assert streaming.score_pieces(0, 128, 128, 16, 3, 10**6) == [(0, 32, 0), (32, 64, 0), (64, 128, 0)]
    assert streaming.score_pieces(0, 16, 128, 16, 4, 10**6) == [(0, 16, 0)]  # one chunk: cannot split
    assert streaming.score_pieces(0, 128, 128, 16, 1, 48) == [(0, 48, 0), (48, 96, 0), (96, 128, 0)]  # read budget
    assert streaming.score_pieces(40, 300, 128, 16, 1, 10**6) == [(40, 128, 0), (128, 256, 1), (256, 300, 2)]
    for a, b, w in [(0, 1000, 2), (7, 999, 3), (130, 131, 2)]:
        pieces = streaming.score_pieces(a, b, 128, 16, w, 64)
        assert pieces[0][0] == a and pieces[-1][1] == b
        assert all(e0 == s1 for (_, e0, _), (s1, _, _) in zip(pieces, pieces[1:], strict=False))
        for s, e, seg in pieces:
            assert (s == a or s % 16 == 0) and (e == b or e % 16 == 0) and e - s <= 64
            assert (s - (s % 128)) // 128 == (e - 1) // 128  # within one score chunk


def test_threads_of_the_caller_and_of_new_threads_unchanged(tmp_path):
    """The workers multiply with one torch thread each; the caller's count, and the one a thread started
    afterwards gets, are what they were (torch's default for new threads is process-wide)."""
    import threading

    st = scored_store(tmp_path / "s", "float16", 2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = plain_loop(st, "e", [0, 1], st.meta.shard_rows)
        np.testing.assert_array_equal(reduce.finalize_scores(st, "e", block_rows=32), want)
        seen = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert torch.get_num_threads() == 2 and seen == [2]
    finally:
        torch.set_num_threads(before)


def test_a_worker_that_cannot_start_raises_its_error(tmp_path, monkeypatch):
    """A worker thread failing before the start barrier (here: its thread setting) neither hangs the caller nor
    the other workers; its own error reaches the caller, and the caller's thread count is restored."""
    import threading

    st = scored_store(tmp_path / "s", "float16", 1)
    real = torch.set_num_threads
    main = threading.get_ident()

    def failing(n):
        if threading.get_ident() != main:
            raise MemoryError("no buffers for this worker")
        real(n)

    before = torch.get_num_threads()
    monkeypatch.setattr(streaming.torch, "set_num_threads", failing)
    with pytest.raises(MemoryError, match="no buffers"):
        reduce.finalize_scores(st, "e", block_rows=32)
    monkeypatch.undo()
    assert torch.get_num_threads() == before
    np.testing.assert_array_equal(
        reduce.finalize_scores(st, "e", block_rows=32), plain_loop(st, "e", [0], st.meta.shard_rows)
    )


def test_damaged_chunk_read_in_the_reader_thread_is_named(tmp_path):
    st = scored_store(tmp_path / "s", "float16", 1)
    chunk = tmp_path / "s" / "models" / "0" / "grads" / "c" / "3" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[10] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    with pytest.raises(StoreDamageError, match="models/0/grads"):
        reduce.finalize_scores(st, "e", block_rows=32)


def test_block_rows_from_cache_and_memory():
    # whole chunks, at least one
    assert streaming.score_block_rows(2048, 1024, 1024, cache=32 << 20, memory=16 << 30) == 1024
    assert streaming.score_block_rows(512, 100, 1024, 8192, cache=32 << 20, memory=16 << 30) == 4096  # divides
    rows = streaming.score_block_rows(512, 100, 64, cache=32 << 20, memory=16 << 30)
    assert rows % 64 == 0 and rows * 4 * (512 + 100) <= 16 << 20
    # a small cache still gives a GEMM of MIN_GEMM_ROWS rows; little memory caps the buffers
    assert streaming.score_block_rows(2048, 256, 16, cache=1 << 20, memory=16 << 30) == streaming.MIN_GEMM_ROWS
    small = streaming.score_block_rows(2048, 256, 16, cache=1 << 30, memory=64 << 20)
    assert small % 16 == 0 and small * (2 * 2048 + 4 * 2048 + 4 * 256) <= (64 << 20) * streaming.MEMORY_FRACTION
    # each of w workers has its own buffers and its share of the cache
    for w in (2, 4):
        shared = streaming.score_block_rows(512, 100, 64, cache=32 << 20, memory=16 << 30, workers=w)
        assert shared % 64 == 0 and w * shared * 4 * (512 + 100) <= 16 << 20
        capped = streaming.score_block_rows(2048, 256, 16, cache=1 << 30, memory=64 << 20, workers=w)
        assert capped < small and w * capped * (2 * 2048 + 4 * 2048 + 4 * 256) <= (64 << 20) * streaming.MEMORY_FRACTION
    assert streaming.cache_bytes() > 0 and streaming.memory_bytes() > 0


def _vm_flags(arr: np.ndarray) -> list[str] | None:
    """The kernel's VmFlags of the mapping that holds ``arr``'s middle byte (None if smaps cannot be read):
    ``nh`` marks MADV_NOHUGEPAGE, ``hg`` MADV_HUGEPAGE."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    ptr, inside = arr.__array_interface__["data"][0] + arr.nbytes // 2, False
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return None


def test_page_array_is_zeroed_writable_and_declines_huge_pages():
    """The scoring's large buffers: zero-filled, writable, of the asked shape and dtype, in a mapping marked
    MADV_NOHUGEPAGE (where numpy's own large arrays are marked MADV_HUGEPAGE); small ones are plain arrays."""
    big = streaming.page_array((1024, 1024), np.float32)  # 4 MiB
    assert big.shape == (1024, 1024) and big.dtype == np.float32 and big.flags.writeable and big.flags.c_contiguous
    assert not big.any()
    big[-1, -1] = 3.0
    assert big.sum() == 3.0
    small = streaming.page_array((3, 5), np.float16)
    assert small.shape == (3, 5) and small.dtype == np.float16 and not small.any()
    flags = _vm_flags(big)
    if flags is None:
        pytest.skip("no /proc/self/smaps here")
    assert "nh" in flags and "hg" not in flags
    plain = np.ones((4096, 1024), dtype=np.float32)  # numpy madvises MADV_HUGEPAGE for arrays of 4 MiB and more
    if "hg" not in (_vm_flags(plain) or []):
        pytest.skip("numpy does not ask for huge pages here (no transparent huge pages)")


def test_finalize_scores_returns_scores_in_small_pages(tmp_path, monkeypatch):
    """The returned (n, m) array of a large experiment is a page_array (scores equal to the plain loop)."""
    monkeypatch.setattr(streaming, "PAGE_ARRAY_BYTES", 1024)
    st = scored_store(tmp_path / "s", "float16", 2, n=300, m=9)
    got = reduce.finalize_scores(st, "e")
    import mmap

    base = got
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)
    np.testing.assert_array_equal(got, plain_loop(st, "e", [0, 1], st.meta.shard_rows))


def test_score_task_ranges_whole_shards_sized_by_work():
    """Score tasks: whole shards tiling [0, n); by default enough shards for SCORE_TASK_FLOPS of GEMM, but at
    least MIN_SCORE_TASKS tasks where the shards allow; an explicit size must be whole shards."""
    from trak_core.errors import BadInputError

    def check(ranges, n, shard):
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:], strict=False))
        assert all(a % shard == 0 for a, _ in ranges)

    n, shard = 1_281_167, 4096  # ImageNet-size, the pipeline's default shard_size: 313 shards
    big = streaming.score_task_ranges(n, shard, 2048, 1000, 1)
    check(big, n, shard)
    per_row = 2 * 2048 * 1000
    # 4e11 flops want 24 shards a task, which would leave 14 tasks: capped at 313 // 16 = 19 shards, 17 tasks
    assert {b - a for a, b in big[:-1]} == {19 * shard} and len(big) == 17 >= streaming.MIN_SCORE_TASKS
    assert 19 * shard * per_row < streaming.SCORE_TASK_FLOPS < 24 * shard * per_row
    many = streaming.score_task_ranges(10 * n, shard, 2048, 1000, 1)  # 3,128 shards: the flops decide
    check(many, 10 * n, shard)
    assert {b - a for a, b in many[:-1]} == {24 * shard}
    wide = streaming.score_task_ranges(n, shard, 2048, 1000, 1, slots=8)  # 8 task slots: at least 32 tasks
    check(wide, n, shard)
    assert {b - a for a, b in wide[:-1]} == {313 // 32 * shard} and len(wide) >= 4 * 8
    unknown = streaming.score_task_ranges(n, shard, 2048, 1000, 1, slots=None)  # e.g. an existing Dask cluster
    assert unknown == tuple((a, min(a + shard, n)) for a in range(0, n, shard))
    heavy = streaming.score_task_ranges(n, shard, 2048, 100_000, 4)  # each shard is work enough
    assert heavy == tuple((a, min(a + shard, n)) for a in range(0, n, shard))
    few = streaming.score_task_ranges(300, 16, 24, 9, 1)  # 19 shards: one task each
    assert few == tuple((a, min(a + 16, 300)) for a in range(0, 300, 16))
    assert streaming.score_task_ranges(300, 16, 24, 9, 1, rows=64) == (
        (0, 64),
        (64, 128),
        (128, 192),
        (192, 256),
        (256, 300),
    )
    for bad in (24, 0):
        with pytest.raises(BadInputError, match="score_task_rows"):
            streaming.score_task_ranges(300, 16, 24, 9, 1, rows=bad)


def test_staging_buffers_are_reused_across_segments(tmp_path, monkeypatch):
    """Without an ``out`` array (the score tasks), each score chunk is staged until written; a written chunk's
    buffer serves the next one, so a range of 16 score chunks allocates about one buffer per worker, and the
    scores still equal the plain loop's."""
    st = scored_store(tmp_path / "s", "float16", 2, n=2000, m=9)
    reduce.solve_targets(st, "e", [0, 1])
    made = []
    real = streaming.page_array

    def counting(shape, dtype):
        made.append(tuple(shape))
        return real(shape, dtype)

    monkeypatch.setattr(streaming, "page_array", counting)
    st.reset_scores("e")
    reduce.score_rows(st, "e", [0, 1], 0, 2000, reduce.load_solved(st, "e", [0, 1]))
    rows = st.experiment("e").scores.chunks[0]
    staged = [s for s in made if s[1:] == (9,)]
    assert -(-2000 // rows) >= 16 and 1 <= len(staged) <= torch.get_num_threads() + 1, (rows, staged)
    np.testing.assert_array_equal(st.scores("e")[:], plain_loop(st, "e", [0, 1], st.meta.shard_rows))


def test_reads_ahead_in_a_reader_thread_and_writes_in_the_callers(tmp_path, monkeypatch):
    """The stored rows are read by one reader thread in piece order (a piece read ahead of the workers: at most
    one read buffer more than the workers), the score chunks and flags written by the calling thread (progress
    there too), and the scores equal the plain loop's."""
    import threading

    st = scored_store(tmp_path / "s", "float16", 2, n=2000, m=9)
    reduce.solve_targets(st, "e", [0, 1])
    right = reduce.load_solved(st, "e", [0, 1])
    seen: dict[str, list] = {"read": [], "rows": [], "done": [], "raw": []}
    real_read, real_rows, real_done = TrakStore.read_rows, TrakStore.write_score_rows, TrakStore.mark_score_rows
    real_page = streaming.page_array
    monkeypatch.setattr(streaming, "PAGE_ARRAY_BYTES", 1024)  # every read buffer is a page_array here

    def read(store, path, rows, out=None):
        if path.endswith("/grads") and out is not None:  # a piece of stored rows read into a buffer
            seen["read"].append((threading.current_thread().name, rows.start))
        return real_read(store, path, rows, out)

    def page(shape, dtype):
        if np.dtype(dtype) == np.float16:
            seen["raw"].append(tuple(shape))
        return real_page(shape, dtype)

    def rows(store, exp, a, b, x, mark=True):
        seen["rows"].append(threading.current_thread())
        real_rows(store, exp, a, b, x, mark)

    def done(store, exp, a, b):
        seen["done"].append(threading.current_thread())
        real_done(store, exp, a, b)

    monkeypatch.setattr(TrakStore, "read_rows", read)
    monkeypatch.setattr(streaming, "page_array", page)
    monkeypatch.setattr(TrakStore, "write_score_rows", rows)
    monkeypatch.setattr(TrakStore, "mark_score_rows", done)
    st.reset_scores("e")
    prog = []
    reduce.score_rows(
        st, "e", [0, 1], 0, 2000, right, block_rows=32, progress=lambda r: prog.append((threading.current_thread(), r))
    )
    main = threading.current_thread()
    assert {name for name, _ in seen["read"]} == {"trak-read_0"}
    starts = [a for _, a in seen["read"]]
    assert starts == sorted(starts) and len(starts) == 2 * len(set(starts))  # in order, once per checkpoint
    assert 1 <= len(seen["raw"]) <= torch.get_num_threads() + 1
    assert seen["rows"] and set(seen["rows"]) == {main} and set(seen["done"]) == {main}
    assert {t for t, _ in prog} == {main} and sum(r for _, r in prog) == 2000
    np.testing.assert_array_equal(st.scores("e")[:], plain_loop(st, "e", [0, 1], st.meta.shard_rows))


def test_a_worker_failing_mid_stream_raises_its_error_and_marks_no_unwritten_rows(tmp_path, monkeypatch):
    """A GEMM failing in a worker after some score chunks are written: its error reaches the caller (the reader
    and the other worker stop, nothing hangs), the rows marked done are exactly those written, and a rerun
    completes them."""
    st = scored_store(tmp_path / "s", "float16", 1, n=2000, m=9)
    reduce.solve_targets(st, "e", [0])
    right = reduce.load_solved(st, "e", [0])
    real_blocks = streaming.score_blocks
    # the failure starts at a score chunk's first row: a piece that starts below it ends at or before it (a piece
    # never crosses a score chunk), so which rows may be written does not depend on which thread finishes first
    cut = 8 * st.score_layout("e")[0]
    assert 0 < cut < 2000

    def blocks(s, e, step, shard_rows=None):
        if s >= cut:
            raise MemoryError(f"no memory for rows {s}..{e}")
        return real_blocks(s, e, step, shard_rows)

    monkeypatch.setattr(streaming, "score_blocks", blocks)
    st.reset_scores("e")
    with pytest.raises(MemoryError, match="no memory for rows"):
        reduce.score_rows(st, "e", [0], 0, 2000, right, block_rows=32)
    monkeypatch.undo()
    done = st.scores_done_mask("e")
    assert done[:cut].any() and not done[cut:].any()
    want = plain_loop(st, "e", [0], st.meta.shard_rows)
    np.testing.assert_array_equal(st.experiment("e").scores[:][done], want[done])
    for s, e in reduce.unscored_ranges(st, "e", 0, 2000):
        reduce.score_rows(st, "e", [0], s, e, right)
    np.testing.assert_array_equal(st.scores("e")[:], want)


def test_a_scoring_call_opens_each_group_and_array_once(tmp_path, monkeypatch):
    """finalize_scores runs in TrakStore.pinned(): each group and array of the store is opened (its zarr.json
    read) once per call, not once per use; outside the block nothing is kept, so a change made through another
    handle of the store (another process) is seen by the next call."""
    from collections import Counter

    from trak_core.store import arrays as store_mod

    st = scored_store(tmp_path / "s", "float16", 2, n=300, m=9)
    want = reduce.finalize_scores(st, "e").copy()
    opened: Counter = Counter()
    real_group, real_array = store_mod.group_at, store_mod.array_at

    def group_at(g, name):
        opened[("group", g.path, name)] += 1
        return real_group(g, name)

    def array_at(g, name):
        opened[("array", g.path, name)] += 1
        return real_array(g, name)

    monkeypatch.setattr(store_mod, "group_at", group_at)
    monkeypatch.setattr(store_mod, "array_at", array_at)
    np.testing.assert_array_equal(reduce.finalize_scores(st, "e"), want)
    assert opened and max(opened.values()) == 1, opened.most_common(3)
    assert st._pins is None  # the block is over: nothing kept
    import threading

    with st.pinned():
        with st.pinned():  # nested: the outer block's handles
            assert st.experiment("e") is st.experiment("e")
        assert st._pins is not None
        seen = []  # another thread's calls are not in the block
        t = threading.Thread(target=lambda: seen.append(st.experiment("e") is st.experiment("e")))
        t.start()
        t.join()
        assert seen == [False]
    assert st.experiment("e") is not st.experiment("e")
    other = TrakStore.open(str(tmp_path / "s"))
    other.set_scored_with("e", [1, 0])
    assert st.scored_with("e") == [1, 0]


def test_staged_score_chunks_are_bounded_while_the_writer_is_slow(tmp_path, monkeypatch):
    """Without ``out`` (the score tasks) the workers stage at most workers + 1 score chunks: while the caller's
    first write is held back, they stop at that many instead of computing the whole range into new buffers; the
    scores still equal the plain loop's."""
    import sys
    import threading

    from trak_core import store as store_mod

    st = scored_store(tmp_path / "s", "float16", 2, n=2000, m=9)
    reduce.solve_targets(st, "e", [0, 1])
    right = reduce.load_solved(st, "e", [0, 1])
    workers = torch.get_num_threads()
    made = []
    real_page, real_rows = streaming.page_array, store_mod.ScoreWriter.rows

    def counting(shape, dtype):
        if tuple(shape[1:]) == (9,):
            made.append(tuple(shape))
        return real_page(shape, dtype)

    def waiting_for_a_buffer(ident: int) -> bool:
        frame = sys._current_frames().get(ident)
        names = []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        return "accumulator" in names and names[0] == "wait"

    first = []

    def slow_rows(w, a, b, x):
        if not first:  # hold the first write until every worker waits for a staging buffer (or too many exist)
            first.append(a)
            scorers = [t for t in threading.enumerate() if t.name.startswith("trak-score")]
            while len(made) <= workers + 1 and not all(waiting_for_a_buffer(t.ident) for t in scorers):
                threading.Event().wait(0.001)
        return real_rows(w, a, b, x)

    monkeypatch.setattr(streaming, "page_array", counting)
    monkeypatch.setattr(store_mod.ScoreWriter, "rows", slow_rows)
    st.reset_scores("e")
    reduce.score_rows(st, "e", [0, 1], 0, 2000, right)
    rows = st.experiment("e").scores.chunks[0]
    assert -(-2000 // rows) >= 8 and 1 <= len(made) <= workers + 1, (rows, made)
    np.testing.assert_array_equal(st.scores("e")[:], plain_loop(st, "e", [0, 1], st.meta.shard_rows))
