"""Streaming scoring at GEMM speed: block sizes from the cache and memory sizes, and one worker thread per core,
each reading, multiplying (one-thread GEMM) and writing its own pieces of rows.

Scores of train rows [a, b) are Σ_c X_c[a:b] W_c combined with Q
(:func:`trak_core.scoring.combine.combine_checkpoints`),
X_c the stored projected gradients and W_c = A_c G_cᵀ (:func:`grads_right_hand`): traker's Φ_c G_cᵀ with
Φ_c = X_c A_c, at the same GEMM cost per row, without a features array (store schema 3).

:func:`stream_scores` splits [a, b) into pieces (:func:`score_pieces`): whole store chunks within one chunk of the
experiment's scores (about 8 MiB: a whole shard for a few hundred targets). Three kinds of thread share the work:

* one **reader** thread reads the pieces in order, one store read per checkpoint (zarr's codecs and file reads
  release the GIL) into a free buffer of workers + 1 (so one piece waits read while every worker multiplies), and
  each piece's Σ_c Q_c;
* as many **workers** as torch has intra-op threads each take the next piece: the conversion to float32 block by
  block (torch's vectorized copy into a preallocated buffer, ~1 % of the GEMM), the GEMMs with **one** thread each
  (``addmm_``), the combination; the buffer goes back to the reader after each checkpoint's GEMMs;
* the **calling** thread writes each score chunk once its pieces are computed, then the shard's flags (one chunk)
  once all its score chunks are written, and reports progress.

So the cores never wait at an OpenMP barrier: with one GEMM over both cores (an earlier design), whatever else ran
on a core — the reads, the writes, the zarr event loop, another process — stalled that core's half of the GEMM
while the other half spun in libgomp's barrier. Here a core that reads or writes leaves the others multiplying, and
a worker goes from one piece's GEMMs to the next without waiting for a read or a write.

The arithmetic is the one of the plain loop (zero the accumulator, ``acc.addmm_(X_c, W_c)`` per checkpoint in
the given order, then :func:`~trak_core.scoring.combine.combine_checkpoints`' float32 element-wise operations), and
MKL's
GEMM gives every row the same bits whatever the number of rows in the call and whatever its number of threads,
so the scores are bit-identical to the unpipelined loop for any block size (tests/trak_core/test_streaming.py,
tests/trak_core/test_scores_without_features.py check it).
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import numpy as np
import torch

from trak_core.errors import BadInputError, StateError
from trak_core.store import RunStore, model_array

#: used when the last-level cache size cannot be read (bytes)
DEFAULT_CACHE_BYTES = 8 << 20
#: used when the available memory cannot be read (bytes)
DEFAULT_MEMORY_BYTES = 4 << 30
#: the pipeline's buffers take at most this fraction of the available memory
MEMORY_FRACTION = 1 / 16
#: a GEMM with fewer rows than this runs below the BLAS peak (the per-call cost and the edge tiles show)
MIN_GEMM_ROWS = 256
#: arrays of at least this many bytes get their own mapping of small pages (:func:`page_array`)
PAGE_ARRAY_BYTES = 2 << 20
#: GEMM flops a score task should have at least (:func:`score_task_ranges`): ~2 s of two cores here, so that a
#: task's fixed costs (opening the store, reading G A, starting its workers, the first read before any GEMM, the
#: last write after it, the orchestrator's task run: ~0.2 s of one core) are a few per cent of it
SCORE_TASK_FLOPS = 4e11
#: ...but at least this many score tasks where the shards allow, and TASKS_PER_SLOT per concurrent task slot, so
#: that every slot of a run stays busy and uneven task times even out
MIN_SCORE_TASKS = 16
TASKS_PER_SLOT = 4


def page_array(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A writable, zero-filled array in an anonymous private mapping of its own that declines transparent huge
    pages (``MADV_NOHUGEPAGE``): for the scoring's large buffers, each written once and soon freed.

    numpy asks for huge pages for every array of 4 MiB or more. Where the host takes free memory back (a virtual
    machine with free page reporting or ballooning: the free pages come back to the guest on first touch), a huge
    page that has been free for a few seconds costs 3–6× more to fault in than the same bytes in small pages
    (``benchmarks/scoring_bench.py`` prints both: ``page_costs``); on bare metal huge pages are somewhat cheaper.
    Scoring writes its (n, m) result once and reuses its staging buffers, so the small pages' cost (~0.4 s/GiB
    here, whatever the memory's history) is the predictable one. Smaller arrays are plain ``np.zeros``."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * dtype.itemsize
    if nbytes < PAGE_ARRAY_BYTES or not hasattr(mmap, "MAP_PRIVATE"):
        return np.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


def _read_size(path: str) -> int | None:
    try:
        with open(path) as fh:
            text = fh.read().strip().upper()
    except OSError:
        return None
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in "KMG" else text
    return int(digits) * mult if digits.isdigit() else None


def cache_bytes() -> int:
    """The largest CPU cache (the last level, shared by the cores), from sysfs; DEFAULT_CACHE_BYTES if unknown."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    sizes = []
    if os.path.isdir(base):
        for name in sorted(os.listdir(base)):
            size = _read_size(os.path.join(base, name, "size"))
            if size:
                sizes.append(size)
    return max(sizes) if sizes else DEFAULT_CACHE_BYTES


def memory_bytes() -> int:
    """Available memory (MemAvailable), DEFAULT_MEMORY_BYTES if unknown; within a memory budget
    (:func:`trak_core.featurize.budget.memory_limit`) at most what the budget leaves."""
    from trak_core.featurize.budget import headroom

    room = headroom()
    return _available() if room is None else min(room, _available())


def _available() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return DEFAULT_MEMORY_BYTES


def score_block_rows(
    proj_dim: int,
    num_targets: int,
    chunk_rows: int,
    shard_rows: int | None = None,
    *,
    itemsize: int = 2,
    cache: int | None = None,
    memory: int | None = None,
    workers: int = 1,
) -> int:
    """Rows per GEMM of the streaming scoring: a whole number of store chunks (a read never decodes a chunk
    twice, a write owns whole chunks) chosen from the hardware, for ``workers`` threads each multiplying its own
    block.

    * cache: each worker's float32 block (rows × p) and its accumulator (rows × m) fit in half its share of the
      last-level cache, so the GEMM finds the block the conversion just wrote in cache (the other half holds the
      right-hand panels and the stored block being decoded); at least MIN_GEMM_ROWS rows;
    * memory: the workers' buffers (each: a read buffer of ``itemsize`` bytes, the float32 block, an
      accumulator) stay within MEMORY_FRACTION of the available memory;
    * with ``shard_rows``: a divisor of it (at most a shard), so blocks tile the shards the score tasks own;
    * at least one chunk.
    """
    cache = cache_bytes() if cache is None else cache
    memory = memory_bytes() if memory is None else memory
    workers = max(1, workers)
    row_hot = 4 * (proj_dim + num_targets)  # float32 block row + accumulator row
    rows = max(MIN_GEMM_ROWS, (cache // (2 * workers)) // row_hot)
    row_buffers = workers * (itemsize * proj_dim + 4 * proj_dim + 4 * num_targets)
    rows = min(rows, max(1, int(memory * MEMORY_FRACTION) // row_buffers))
    if shard_rows is not None and shard_rows % chunk_rows == 0:
        fits = [d for d in range(chunk_rows, min(rows, shard_rows) + 1, chunk_rows) if shard_rows % d == 0]
        return fits[-1] if fits else chunk_rows
    return max(chunk_rows, rows // chunk_rows * chunk_rows)


def score_task_ranges(
    n: int,
    shard_rows: int,
    proj_dim: int,
    num_targets: int,
    checkpoints: int,
    rows: int | None = None,
    slots: int | None = 1,
) -> tuple[tuple[int, int], ...]:
    """The train-row ranges [a, b) of the pipeline's score tasks: whole shards of ``shard_rows`` rows (the last
    may be short), in order, tiling [0, n).

    ``rows``: rows per task (a multiple of ``shard_rows``). By default as many shards as give a task
    SCORE_TASK_FLOPS of GEMM (2 · proj_dim · num_targets · checkpoints per row), but no more than leave
    max(MIN_SCORE_TASKS, TASKS_PER_SLOT · ``slots``) tasks (``slots``: tasks the run executes at once; None when
    that is unknown, e.g. an existing Dask cluster: one task per shard), and at least one shard: one task per shard
    when each shard is work enough or when there are few shards."""
    if rows is not None and (rows <= 0 or rows % shard_rows):
        raise BadInputError(f"score_task_rows: {rows} must be a positive multiple of shard_size={shard_rows}")
    shards = -(-n // shard_rows)
    if rows is None and slots is None:
        rows = shard_rows
    if rows is None:
        per_row = 2 * proj_dim * num_targets * max(1, checkpoints)
        want = -(-int(SCORE_TASK_FLOPS) // max(1, per_row * shard_rows))  # shards for the flops
        tasks = max(MIN_SCORE_TASKS, TASKS_PER_SLOT * max(1, slots or 1))
        rows = max(1, min(want, shards // tasks)) * shard_rows
    return tuple((a, min(a + rows, n)) for a in range(0, n, rows))


def score_blocks(a: int, b: int, step: int, shard_rows: int | None = None) -> list[tuple[int, int]]:
    """The row blocks [s, e) of [a, b): ``step`` rows each, never across a shard boundary (``shard_rows``). A
    shard of at most ``step`` rows is one block, and a shard's remainder below MIN_GEMM_ROWS joins its last
    full block: no GEMM gets a handful of rows where the one-GEMM-per-shard loop had many (BLAS takes other
    code paths for tiny row counts, with other rounding)."""
    out = []
    edges = range(a - a % shard_rows + shard_rows, b, shard_rows) if shard_rows else []
    bounds = [a, *edges, b]
    for s0, s1 in zip(bounds[:-1], bounds[1:], strict=True):
        blocks = [(s, min(s + step, s1)) for s in range(s0, s1, step)]
        if shard_rows and len(blocks) > 1 and blocks[-1][1] - blocks[-1][0] < min(step, MIN_GEMM_ROWS):
            last = blocks.pop()
            blocks[-1] = (blocks[-1][0], last[1])
        out += blocks
    return out


class ScoreSink(Protocol):
    """Where :func:`stream_scores` puts each computed piece of scores: the experiment's score array
    (:class:`StoreScores`), or a query's running top-k."""

    @property
    def chunk_rows(self) -> int:
        """Rows of a piece of scores written at once (a writer of whole pieces needs no lock)."""

    @property
    def done_rows(self) -> int:
        """Rows of a piece of flags marked at once."""

    def rows(self, a: int, b: int, scores: np.ndarray) -> None:
        """The scores of train rows [a, b), not yet marked done."""

    def mark_done(self, a: int, b: int) -> None:
        """Mark rows [a, b) done (after their scores are written)."""


class StoreScores:
    """The experiment's score array of a store as a :class:`ScoreSink` (its layout read once)."""

    def __init__(self, store: RunStore, exp_name: str):
        self._store, self._exp = store, exp_name
        self._layout = store.score_layout(exp_name)

    @property
    def chunk_rows(self) -> int:
        return self._layout[0]

    @property
    def done_rows(self) -> int:
        return self._layout[1]

    def rows(self, a: int, b: int, scores: np.ndarray) -> None:
        self._store.write_score_rows(self._exp, a, b, scores, mark=False)

    def mark_done(self, a: int, b: int) -> None:
        self._store.mark_score_rows(self._exp, a, b)


def score_pieces(
    a: int, b: int, score_rows: int, chunk_rows: int, workers: int, max_rows: int
) -> list[tuple[int, int, int]]:
    """The work units of :func:`stream_scores`: ``(start, end, segment)`` row ranges of [a, b). A segment is
    [a, b) within one score chunk (``score_rows``), written once all its pieces are computed; a piece is whole
    store chunks (``chunk_rows``; its ends at a chunk boundary, or at a or b) of one segment, at most
    ``max_rows`` rows (one Zarr read each per checkpoint). Pieces are split further (largest first, at a chunk
    boundary near its middle) until there is one per worker or none can be split."""
    segs = [(s, min(s - s % score_rows + score_rows, b)) for s in _starts(a, b, score_rows)]
    pieces: list[tuple[int, int, int]] = []
    for i, (s0, s1) in enumerate(segs):
        cuts = [s0, *range(s0 - s0 % chunk_rows + chunk_rows, s1, chunk_rows), s1]  # chunk boundaries
        start = 0
        while start < len(cuts) - 1:
            end = start + 1
            while end < len(cuts) - 1 and cuts[end + 1] - cuts[start] <= max_rows:
                end += 1
            pieces.append((cuts[start], cuts[end], i))
            start = end
    while len(pieces) < workers:
        k = max(range(len(pieces)), key=lambda j: pieces[j][1] - pieces[j][0])
        s0, s1, i = pieces[k]
        mid = s0 + (s1 - s0) // 2
        cut = min(range(s0 - s0 % chunk_rows + chunk_rows, s1, chunk_rows), key=lambda c: abs(c - mid), default=None)
        if cut is None:
            break
        pieces[k : k + 1] = [(s0, cut, i), (cut, s1, i)]
    return pieces


def _starts(a: int, b: int, step: int) -> list[int]:
    """a, then the multiples of ``step`` in (a, b)."""
    return [a, *range(a - a % step + step, b, step)]


def stream_scores(
    store: RunStore,
    exp_name: str,
    model_ids: Sequence[int],
    a: int,
    b: int,
    targets: dict[int, torch.Tensor],
    *,
    block_rows: int | None = None,
    out: np.ndarray | None = None,
    progress: Callable[[int], None] | None = None,
    sink: ScoreSink | None = None,
) -> None:
    """Combined scores of train rows [a, b) from ``model_ids``' stored rows and the right-hand matrices
    ``targets`` ((p, m) float32 each), written to the experiment's score array one score chunk at a time, and
    each flag chunk (a shard) marked done once all its score chunks are written (``sink``: somewhere else, e.g.
    a query's running top-k; ``exp_name`` then only names the call).

    The rows streamed are the stored projected gradients X; ``targets`` are W = A Gᵀ from :func:`grads_right_hand`
    (see ``trak_core.solve.reduce.solve_targets``).
    ``block_rows``: rows per GEMM, exactly (default: :func:`score_block_rows`, a remainder below MIN_GEMM_ROWS
    joining the last block of its piece); ``out``: an (n, m) float32 array that also receives the scores (the
    accumulators are its rows: no copy); ``progress(rows)`` as score chunks are written, in the calling thread.

    The work is split into pieces (:func:`score_pieces`): whole store chunks within one score chunk, read ahead
    by a reader thread with one Zarr call per checkpoint, multiplied in blocks of ``block_rows`` by the workers;
    this thread writes each score chunk once computed, and a shard's flags (one flag chunk per shard: one
    write, not one per block) once its score chunks are written. An error in any thread stops the others and
    is raised here; the rows marked done are those written."""
    if a >= b:
        return
    with store.pinned() as opened:  # the store's arrays opened once in the call (its reader thread too)
        _stream(store, exp_name, model_ids, a, b, targets, block_rows, out, progress, sink, opened)


def _stream(
    store: RunStore,
    exp_name: str,
    model_ids: Sequence[int],
    a: int,
    b: int,
    targets: dict[int, torch.Tensor],
    block_rows: int | None,
    out: np.ndarray | None,
    progress: Callable[[int], None] | None,
    sink: ScoreSink | None,
    opened: dict,
) -> None:
    ids = [int(mid) for mid in model_ids]
    meta = store.meta
    rights = [targets[mid] for mid in ids]
    p, m = meta.proj_dim, (int(rights[0].shape[1]) if rights else store.num_targets(exp_name))
    threads = torch.get_num_threads()
    writer = StoreScores(store, exp_name) if sink is None else sink
    itemsize = meta.np_dtype.itemsize
    if block_rows:
        step, merge = int(block_rows), None
    else:
        step = score_block_rows(p, m, meta.rows_per_chunk, meta.rows_per_shard, itemsize=itemsize, workers=threads)
        merge = meta.rows_per_shard
    buffers = threads + 1  # one piece read ahead of the workers
    budget = int(memory_bytes() * MEMORY_FRACTION) // buffers  # a read buffer
    max_rows = max(meta.rows_per_chunk, budget // max(1, itemsize * p) // meta.rows_per_chunk * meta.rows_per_chunk)
    pieces = score_pieces(a, b, writer.chunk_rows, meta.rows_per_chunk, threads, max_rows)
    seg_range: dict[int, tuple[int, int]] = {}  # segment → its rows [s0, s1)
    seg_left: dict[int, int] = {}  # segment → its pieces not yet computed
    for s, e, i in pieces:  # in row order
        seg_range[i] = (seg_range[i][0], e) if i in seg_range else (s, e)
        seg_left[i] = seg_left.get(i, 0) + 1
    # flag chunks: the segments each covers (marked done once they are all written)
    flag_of = {i: s0 // writer.done_rows for i, (s0, _) in seg_range.items()}
    flag_left: dict[int, int] = {}
    for chunk in flag_of.values():
        flag_left[chunk] = flag_left.get(chunk, 0) + 1
    workers = max(1, min(threads, len(pieces)))
    piece_rows = max(e - s for s, e, _ in pieces)
    feats = [model_array(mid, "grads") for mid in ids]
    qs = [model_array(mid, "out_to_loss") for mid in ids]
    staging: dict[int, np.ndarray] = {}  # without ``out``: a segment's scores until it is written
    held: dict[int, np.ndarray] = {}  # the whole buffer (seg_rows × m) each staging view is of
    spare: list[np.ndarray] = []  # buffers whose segment is written, for the next segments
    seg_rows = max(e - s for s, e in seg_range.values())
    lock = threading.Lock()
    staged = threading.Condition(lock)  # without ``out``: at most workers + 1 score chunks staged at once
    stopped = [False]  # set when the call ends (an error): a worker waiting for a staging buffer gives up
    local = threading.local()
    ready = threading.Barrier(workers + 1)
    raws = _Buffers(workers + 1, lambda: page_array((piece_rows, p), meta.np_dtype))  # workers <= threads
    computed: queue.SimpleQueue = queue.SimpleQueue()  # segments whose pieces are all computed, or an error

    def start_worker() -> None:
        try:
            torch.set_num_threads(1)  # this thread's OpenMP/MKL: one-thread GEMMs, one per core
            f32 = meta.np_dtype == np.float32
            # a block: ``step`` rows, or fewer than step + MIN_GEMM_ROWS where a remainder joined it
            local.x = None if f32 else torch.empty(min(step + MIN_GEMM_ROWS, piece_rows), p, dtype=torch.float32)
        except BaseException:
            ready.abort()  # the caller and the other workers stop waiting
            raise
        ready.wait()

    def read_qsum(s: int, e: int) -> np.ndarray:
        """Σ_c Q_c of rows [s, e), summed in float64 in the checkpoints' order (the reader thread)."""
        total = np.zeros(e - s, dtype=np.float64)
        with store.pinned(opened):
            for q in qs:
                total += store.read_rows(q, slice(s, e)).astype(np.float64)
        return total

    def read_piece(s: int, e: int, k: int) -> np.ndarray:
        """Piece [s, e) of checkpoint k, as stored, in a free read buffer (the reader thread, in piece order)."""
        raw = raws.take()
        try:
            with store.pinned(opened):
                store.read_rows(feats[k], slice(s, e), raw[: e - s])  # decoded straight into the buffer
        except BaseException:
            raws.give(raw)
            raise
        return raw

    def accumulator(s: int, e: int, seg: int) -> np.ndarray:
        if out is not None:
            return out[s:e]
        with staged:
            # a new segment waits while workers + 1 are staged (computed ones wait for the caller's write)
            while seg not in staging and len(staging) > workers and not stopped[0]:
                staged.wait()
            if stopped[0]:
                raise StateError("streaming scores stopped")
            if seg not in staging:
                s0, s1 = seg_range[seg]
                held[seg] = spare.pop() if spare else page_array((seg_rows, m), np.float32)
                staging[seg] = held[seg][: s1 - s0]
            buf = staging[seg]
        s0 = seg_range[seg][0]
        return buf[s - s0 : e - s0]

    def score_piece(j: int) -> None:
        """Computes piece j's rows [s, e) from its reads; hands its segment to the caller once complete."""
        s, e, seg = pieces[j]
        res = accumulator(s, e, seg)
        acc = torch.from_numpy(res)
        acc.zero_()
        blocks = score_blocks(s, e, step, merge)
        for k in range(len(ids)):
            raw = reads[j][1][k].result()
            try:
                for bs, be in blocks:
                    x = torch.from_numpy(raw[bs - s : be - s])
                    if local.x is not None:  # float16 store: convert into the GEMM's float32 operand (exact)
                        x = local.x[: be - bs]
                        x.copy_(torch.from_numpy(raw[bs - s : be - s]))
                    acc[bs - s : be - s].addmm_(x, rights[k])  # acc += X_c W_c, one GEMM per block and checkpoint
            finally:
                raws.give(raw)
        # combine_checkpoints' float32 operations, element for element, in place (no piece-sized temporary)
        c = len(ids)
        np.divide(res, c, out=res)
        qsum = reads[j][0].result()
        np.multiply(res, qsum.astype(np.float32).reshape(-1, 1) / c, out=res)
        with lock:
            seg_left[seg] -= 1
            if not seg_left[seg]:
                computed.put(seg)

    def write_segment(seg: int) -> int:
        """Writes a computed segment, then its shard's flags if that was the shard's last (the caller's thread)."""
        s0, s1 = seg_range[seg]
        writer.rows(s0, s1, out[s0:s1] if out is not None else staging[seg])
        with staged:
            staging.pop(seg, None)
            if seg in held:
                spare.append(held.pop(seg))
            staged.notify_all()
        flag_left[flag_of[seg]] -= 1
        if not flag_left[flag_of[seg]]:
            f0 = flag_of[seg] * writer.done_rows
            writer.mark_done(max(a, f0), min(b, f0 + writer.done_rows))
        return s1 - s0

    def report_error(f: Future) -> None:
        if not f.cancelled() and f.exception() is not None:
            computed.put(f.exception())

    pool = ThreadPoolExecutor(workers, thread_name_prefix="trak-score")
    reader = ThreadPoolExecutor(1, thread_name_prefix="trak-read")
    reads: list[tuple[Future, list[Future]]] = []  # per piece: its Σ_c Q_c, its X of each checkpoint
    futures: list[Future] = []
    try:
        starts: list[Future] = []
        try:
            starts += [pool.submit(start_worker) for _ in range(workers)]  # one per thread: each waits at the barrier
            for s, e, _ in pieces:  # in piece order: Q, then X of each checkpoint
                qsum = reader.submit(read_qsum, s, e)
                reads.append((qsum, [reader.submit(read_piece, s, e, k) for k in range(len(ids))]))
            ready.wait()
        except BaseException as e:
            ready.abort()  # frees the workers waiting when a thread could not start
            errors = [f.exception() for f in starts] if isinstance(e, threading.BrokenBarrierError) else []
            root = next((x for x in errors if x and not isinstance(x, threading.BrokenBarrierError)), None)
            if root is None:
                raise
            raise root from None  # the worker's own error (e.g. no memory for its buffers)
        finally:
            torch.set_num_threads(threads)  # the process default the workers changed; this thread's is unchanged
        futures = [pool.submit(score_piece, j) for j in range(len(pieces))]
        for f in futures:
            f.add_done_callback(report_error)
        for _ in range(len(seg_range)):  # the writes, here: the workers go on reading and multiplying
            item = computed.get()
            if isinstance(item, BaseException):
                raise item
            rows = write_segment(item)
            if progress:
                progress(rows)
    finally:
        raws.close()  # a read waiting for a buffer gives up
        with staged:
            stopped[0] = True
            staged.notify_all()
        for f in (*futures, *(r for q, xs in reads for r in (q, *xs))):
            f.cancel()
        pool.shutdown(wait=True)
        reader.shutdown(wait=True)


class _Buffers:
    """Up to ``count`` read buffers made on demand by ``make``: :meth:`take` waits for a free one (or raises
    :class:`StateError` once closed), :meth:`give` returns it."""

    def __init__(self, count: int, make: Callable[[], np.ndarray]):
        self._free: list[np.ndarray] = []
        self._left = count
        self._make = make
        self._closed = False
        self._cond = threading.Condition()

    def take(self) -> np.ndarray:
        with self._cond:
            while not self._free and not self._left and not self._closed:
                self._cond.wait()
            if self._closed:
                raise StateError("streaming scores stopped")
            if self._free:
                return self._free.pop()
            self._left -= 1
        try:
            return self._make()
        except BaseException:
            with self._cond:
                self._left += 1
                self._cond.notify()
            raise

    def give(self, buf: np.ndarray) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def grads_right_hand(inverse: np.ndarray | torch.Tensor, target_t: torch.Tensor) -> torch.Tensor:
    """W = A Gᵀ, (p, m) float32: the right-hand matrix that makes X W = (X A) Gᵀ = Φ Gᵀ, from a checkpoint's
    (rescaled) inverse A = (XᵀX + λI)⁻¹ (p, p) and its targets Gᵀ (p, m) float32 (:func:`load_targets`' form).
    One float32 GEMM (2 p² m flops), the precision :func:`trak_core.scoring.combine.features_block` computes Φ in."""
    inv = torch.as_tensor(inverse)
    p = target_t.shape[0]
    if inv.shape != (p, p):
        raise BadInputError(f"inverse of shape {tuple(inv.shape)} for targets of proj_dim {p}: expected ({p}, {p})")
    return torch.mm(inv.to(torch.float32), target_t.to(torch.float32))
