"""Train rows that arrive batch by batch (TRAKer's ``featurize`` calls), written to the store in whole chunks:
:class:`RowSink` holds consecutive rows until a chunk boundary (one write per chunk instead of a read-modify-write
of the chunk per batch), writes them on a background thread where asked (the device does not wait on the store),
and on a GPU stores each completed shard's XᵀX partial from the rows still in memory on a thread of its own. Rows
are flagged only once written: a process killed in between leaves them unflagged, featurized again next time.

The pipeline's shard task writes a whole shard at once (:func:`trak_core.engine.featurize_shard`); both end in
:func:`trak_core.engine.write_rows` and :func:`trak_core.engine.complete_shard`.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from trak_core.solve.reduce import GramBuffers, PartialSums, ensure_partial, host_empty
from trak_core.store import RunStore, model_array
from trak_core.store.writer import BackgroundWriter


def write_rows(store: RunStore, model_id: int, rows, x, q: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Write featurized train rows (then mark them featurized); ``x`` an array or a list of arrays of consecutive
    rows (batches). Returns ``x`` as stored (the store's dtype: what the shard's partial is computed from), in
    ``out`` when given (a reused buffer of those rows)."""
    return store.write_train_rows(model_id, rows, x, q, out)


def complete_shard(
    store: RunStore, model_id: int, shard: int, device=None, x=None, q=None, buffers=None, sums=None
) -> None:
    """Store the XᵀX partial (and row sums) of a shard whose rows are all featurized, unless it is there; from
    ``x``/``q`` (the shard's rows as written, still in memory) or read back. ``buffers``: a caller's reused host
    buffers for the partials (:class:`~trak_core.solve.reduce.GramBuffers`); ``sums``: a
    :class:`~trak_core.solve.reduce.PartialSums` that gets the partial stored (or, when it was there, loses its run)."""
    stored = ensure_partial(store, model_id, shard, device, x, q, buffers)
    if sums is not None:
        if stored is None:
            sums.end()
        else:
            sums.add(model_id, shard, *stored)


class RowSink:
    """Featurized train rows on their way into a store (see the module docstring).

    Args:
        device: the featurizer's device: on a GPU each shard's partial is computed as its rows are written.
        write_behind: write on a background thread (a call returns before its rows are in the store; a write's
            error is raised by a later call).
    """

    def __init__(self, device, write_behind: bool) -> None:
        self.device = device
        self.write_behind = bool(write_behind)
        # one ascending run of rows of one model, held until a chunk boundary or the last train row
        self._pending: dict | None = None
        self._shards = _ShardRuns(device)
        self._writer: BackgroundWriter | None = None
        # the store's groups and arrays opened once while featurizing one model (store.pinned)
        self.handles: dict = {}
        # (model id, its rows' featurized flags as read once and updated by this sink's own writes): a row flagged
        # there is read again from the store before it is skipped; a row not flagged is featurized without a read
        self._flags: tuple[int, np.ndarray] | None = None

    @property
    def partial_sums(self) -> PartialSums:
        """The stored partials' running sum (finalize uses it where it covers all of a model's shards)."""
        return self._shards.sums

    def partials_while_featurizing(self) -> bool:
        """On a GPU each shard's XᵀX partial is computed as soon as the shard's rows are written, from the rows
        still in memory: finalize then neither reads the rows back from the store nor copies them to the device
        again (on the CPU finalize computes them: the same work, and no shard of rows held)."""
        return torch.device(self.device).type != "cpu"

    def forget(self) -> None:
        """Drop what featurizing one model keeps between calls (a step other than featurize may change it)."""
        self.handles = {}
        self._shards.handles = {}
        self._flags = None

    def new_model(self) -> None:
        """A checkpoint was loaded: no shard run continues across it."""
        self.forget()
        self._shards.run = None

    def todo(self, store, mid: int, inds: np.ndarray) -> np.ndarray:
        """Which of rows ``inds`` of ``mid`` still need featurizing (not stored, not held)."""
        pend = self._pending
        if pend is not None and pend["mid"] != mid:
            self._pending = None
            self._hand_over(store, pend["mid"], slice(pend["start"], pend["stop"]), pend["x"], pend["q"])
            pend = None
        if self._flags is None or self._flags[0] != mid:
            self._flags = (mid, store.featurized_mask(mid))
        done = self._flags[1][inds]
        if done.any():  # flagged when last seen: the store says whether they still are
            done = store.read_rows(model_array(mid, "featurized"), inds).astype(bool)
        if pend is not None:
            done |= (inds >= pend["start"]) & (inds < pend["stop"])
        return ~done

    def add(self, store, mid: int, inds: np.ndarray, x, q: np.ndarray) -> None:
        """Rows ``inds`` of ``mid`` (distinct), featurized as (``x``, ``q``): held while they continue one ascending
        run short of a chunk boundary, else handed over (with the rows held before them)."""
        rows = inds
        if inds.size > 1 and not bool((inds[1:] > inds[:-1]).all()):  # in ascending order (no copy when they are)
            order = np.argsort(inds)
            rows, x, q = inds[order], x[order], q[order]
        pend = self._pending
        run = rows.size > 0 and rows[-1] - rows[0] + 1 == rows.size
        if pend is not None and (not run or pend["stop"] != rows[0]):  # the rows held are handed over first
            self._pending = None
            self._hand_over(store, pend["mid"], slice(pend["start"], pend["stop"]), pend["x"], pend["q"])
            pend = None
        if not run:  # not one run of rows: written now
            self._hand_over(store, mid, rows, [x], [q])
            return
        start, stop = int(rows[0]), int(rows[-1]) + 1
        if pend is None:
            pend = self._pending = {"mid": mid, "start": start, "stop": start, "x": [], "q": []}
        pend["x"].append(x)
        pend["q"].append(q)
        pend["stop"] = stop
        chunk, last = store.meta.rows_per_chunk, store.meta.train_set_size
        if stop == last or stop // chunk > start // chunk:  # reached the end or a chunk boundary
            cut = stop if stop == last else stop // chunk * chunk  # whole chunks written, the rest held
            xs, qs, tail = pend["x"], pend["q"], stop - cut
            self._pending = None
            if tail:  # the rows after the boundary: the end of this batch
                self._pending = {"mid": mid, "start": cut, "stop": stop, "x": [x[-tail:]], "q": [q[-tail:]]}
                xs, qs = [*xs[:-1], x[:-tail]], [*qs[:-1], q[:-tail]]
            self._hand_over(store, mid, slice(pend["start"], cut), xs, qs)

    def flush(self, store) -> None:
        """Write the rows held and wait until every queued write (and partial) is done (its error raised here)."""
        pend, self._pending = self._pending, None
        if pend is not None:
            self._hand_over(store, pend["mid"], slice(pend["start"], pend["stop"]), pend["x"], pend["q"])
        if self._writer is not None:
            self._on_writer(self._writer.drain)
        self._shards.drain()

    def close(self) -> None:
        """Stop the threads (after :meth:`flush`)."""
        writer, self._writer = self._writer, None
        for closing in (writer, self._shards):
            if closing is not None:
                try:
                    closing.close()
                except Exception:  # interpreter shutdown or a closed store: the rows stay unflagged
                    pass

    def _hand_over(self, store, mid: int, rows, xs: list, qs: list) -> None:
        """Write rows ``rows`` (a slice, or sorted indices) of ``mid``, then flag them (on a GPU, then store a
        completed shard's partial); with ``write_behind``, queued for the background writer, and an error of an
        earlier write is raised here (its rows and the ones queued after it stay unflagged)."""
        flags = self._flags[1] if self._flags is not None and self._flags[0] == mid else None
        shards = self._shards if self.partials_while_featurizing() else None
        job = functools.partial(_write_rows_job, store, self.handles, mid, rows, xs, qs, flags, shards)
        if not self.write_behind:
            self._on_writer(job)
            return
        if self._writer is None:
            self._writer = BackgroundWriter(depth=2)
        self._on_writer(self._writer.submit, job)

    def _on_writer(self, call, *args) -> None:
        try:
            call(*args)
        except BaseException:
            self._flags = None  # rows of the failed write (and those queued after it) are unflagged: read again
            raise


def _write_rows_job(store, handles: dict, mid: int, rows, xs: list, qs: list, flags, shards) -> None:
    """The job of :meth:`RowSink._hand_over`: write rows (then their flags), note them in ``flags`` (the sink's
    known flags), and on a GPU (``shards``) collect them for their shard's partial, converted straight into the
    shard's buffer where they continue its run. It keeps no reference to the sink (one dropped with writes
    queued is still collected)."""
    x = xs[0] if len(xs) == 1 else xs  # batches: converted into the stored rows one by one
    q = qs[0] if len(qs) == 1 else np.concatenate(qs)
    with store.pinned(handles):
        run = shards is not None and isinstance(rows, slice)
        out = shards.slot(store.meta, mid, rows.start, rows.stop) if run else None
        stored = write_rows(store, mid, rows, x, q, out)
        if flags is not None:
            flags[rows] = True
        if run:
            shards.add(store, mid, rows.start, stored, q)  # the rows as stored: the partial rounds them so anyway
        elif shards is not None:
            shards.run = None  # not one run: their shards' partials are left to finalize


def _complete_shard_job(store, handles: dict, mid: int, s: int, device, rows, q, runs: _ShardRuns) -> None:
    """The partials' thread's job: shard ``s``'s partial stored (:func:`engine.complete_shard`), with the store's
    handles this thread opened for the model kept over its shards."""
    with store.pinned(handles):
        complete_shard(store, mid, s, device, rows, q, runs.grams, runs.sums)


class _ShardRuns:
    """The written rows of the shard being featurized in one ascending run from its first row, kept (in a buffer of
    a shard's rows in the store's dtype) until the shard is complete, when its partial is stored
    (:func:`engine.complete_shard` on ``device``: the bits finalize would compute from the stored rows) on a thread
    of its own, while the next shard's rows are written into the other of two buffers. Rows that do not continue
    the run drop it (finalize computes that shard's partial)."""

    def __init__(self, device):
        self.device = device
        self.run: dict | None = None
        self.bufs: list[np.ndarray | None] = [None, None]
        self.busy = 1  # the buffer of the partial last handed to the partials' thread (the next run takes the other)
        self.grams = GramBuffers()  # the host buffers of the partials, reused shard after shard
        self.sums = PartialSums()  # the partials stored, summed in shard order: finalize reads none back
        self.partials: BackgroundWriter | None = None
        self.handles: dict = {}  # the store's handles the partials' thread opened (dropped with the sink's own)

    def _buffer(self, meta, i: int) -> np.ndarray:
        shape = (meta.rows_per_shard, meta.proj_dim)
        buf = self.bufs[i]
        if buf is None or buf.shape != shape or buf.dtype != meta.np_dtype:
            buf = self.bufs[i] = host_empty(shape, meta.np_dtype, self.device)  # page-locked for a CUDA device
        return buf

    def _continues(self, meta, mid: int, a: int) -> bool:
        s = a // meta.rows_per_shard
        run = self.run
        return a == s * meta.rows_per_shard or (
            run is not None and (run["mid"], run["shard"], run["next"]) == (mid, s, a)
        )

    def _run_buffer(self, meta, mid: int, a: int) -> int:
        """The buffer of the run that rows from ``a`` continue (or begin: the one the last partial does not use)."""
        run = self.run
        if run is not None and (run["mid"], run["shard"], run["next"]) == (mid, a // meta.rows_per_shard, a):
            return run["buf"]
        return 1 - self.busy

    def slot(self, meta, mid: int, start: int, stop: int) -> np.ndarray | None:
        """Where rows [start, stop) go in the buffer, when they lie in one shard and continue (or begin) its run."""
        if start >= stop or start // meta.rows_per_shard != (stop - 1) // meta.rows_per_shard:
            return None
        if not self._continues(meta, mid, start):
            return None
        sa = start // meta.rows_per_shard * meta.rows_per_shard
        return self._buffer(meta, self._run_buffer(meta, mid, start))[start - sa : stop - sa]

    def add(self, store, mid: int, start: int, x: np.ndarray, q: np.ndarray) -> None:
        meta = store.meta
        stop = start + len(x)
        for s in range(start // meta.rows_per_shard, (stop - 1) // meta.rows_per_shard + 1):
            sa, sb = meta.shard_range(s)
            a, b = max(start, sa), min(stop, sb)
            if not self._continues(meta, mid, a):
                self.run = None
                continue
            if a == sa:
                self.run = {"mid": mid, "shard": s, "next": sa, "q": [], "buf": self._run_buffer(meta, mid, a)}
            run = self.run
            assert run is not None
            place = self._buffer(meta, run["buf"])[a - sa : b - sa]
            rows = x[a - start : b - start]
            if place.__array_interface__["data"][0] != rows.__array_interface__["data"][0]:  # not written in place
                place[...] = rows
            run["q"].append(q[a - start : b - start])
            run["next"] = b
            if b == sb:
                self.run = None
                if store.shard_featurized(mid, s):
                    self._store_partial(store, mid, s, self._buffer(meta, run["buf"])[: sb - sa], run)

    def _store_partial(self, store, mid: int, s: int, rows: np.ndarray, run: dict) -> None:
        """Store shard ``s``'s partial on the partials' thread, once the one before it is stored (its error, if
        any, raised here): one partial at a time, so the buffer it reads is not the one written next."""
        if self.partials is None:
            self.partials = BackgroundWriter(depth=1, name="trakflow-partials")
        self.partials.drain()
        self.busy = run["buf"]
        job = functools.partial(
            _complete_shard_job, store, self.handles, mid, s, self.device, rows, np.concatenate(run["q"]), self
        )
        self.partials.submit(job)

    def drain(self) -> None:
        """Wait until the partials handed over are stored (their error, if any, raised here)."""
        if self.partials is not None:
            self.partials.drain()

    def close(self) -> None:
        partials, self.partials = self.partials, None
        if partials is not None:
            partials.close()
