"""Warm top-k query latency of trak_core.TrakIndex against its floor, in one process (RESULTS.md, "Queries: top-k
from a finished store").

A synthetic finalized store (``--rows`` rows of random float16 X per ``--checkpoints`` checkpoint) is queried with
m random vectors per checkpoint (``TrakIndex.query_vectors``: the scoring pass without a model); per m, p50 / p95
of ``--repeats`` warm queries against the floor measured in the same run: **read** (one pass over the stored rows
through the store API, warm page cache) + **GEMM** (X @ W in float32 in memory, the fastest of a cache-sized
block and 8192 rows, threaded or one thread per core), each the faster of a measurement before and after the
queries. The peak extra resident memory during the queries (sampled every 5 ms) shows memory flat in n.

    .venv/bin/python benchmarks/query_bench.py                      # 100,000 rows, m = 1, 16, 256
    .venv/bin/python benchmarks/query_bench.py --imagenet           # 1,281,167 rows (~5.2 GB per checkpoint)

The store is kept under ``--dir`` (reused by later runs with the same shape); check ``df -h`` first.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import write_json  # noqa: E402

from trak_core.featurize.budget import process_rss  # noqa: E402
from trak_core.scoring.index import TrakIndex  # noqa: E402
from trak_core.scoring.streaming import score_block_rows  # noqa: E402
from trak_core.store import StoreMetadata, TrakStore  # noqa: E402

IMAGENET_ROWS = 1_281_167


def build_store(path: str, rows: int, proj_dim: int, checkpoints: int, seed: int = 0) -> TrakStore:
    """The synthetic store (reused when one of this shape is there)."""
    if TrakStore.exists(path):
        store = TrakStore.open(path, mode="r")
        m = store.meta
        if (m.train_set_size, m.proj_dim) == (rows, proj_dim) and all(
            store.has_model(c) and store.is_finalized(c) for c in range(checkpoints)
        ):
            return store
        shutil.rmtree(path)
    meta = StoreMetadata(
        train_set_size=rows, grad_dim=16 * proj_dim, proj_dim=proj_dim, projector="dense", dtype="float16"
    )
    store = TrakStore.create_or_open(path, meta)
    rng = np.random.default_rng(seed)
    shard = meta.rows_per_shard
    for mid in range(checkpoints):
        store.init_model(mid)
        for a in range(0, rows, shard):
            b = min(a + shard, rows)
            x = (rng.standard_normal((b - a, proj_dim), dtype=np.float32) * 0.05).astype(np.float16)
            q = rng.random(b - a, dtype=np.float32)
            store.write_train_rows(mid, slice(a, b), x, q)
        noise = rng.standard_normal((proj_dim, proj_dim), dtype=np.float32) * (0.1 / proj_dim**0.5)
        store.write_inverse(mid, np.eye(proj_dim, dtype=np.float32) + (noise + noise.T) / 2)
        store.set_finalize_info(mid, {"lambda": 0.0, "synthetic": True})
        print(f"  wrote checkpoint {mid}: {rows} rows", flush=True)
    return store


def time_read(store: TrakStore, ids: list[int], block: int) -> float:
    """Seconds for one read of every checkpoint's rows (X and Q) through the store API."""
    n, p = store.meta.train_set_size, store.meta.proj_dim
    buf = np.empty((block, p), dtype=store.meta.np_dtype)
    t0 = time.perf_counter()
    for mid in ids:
        mm = store.model(mid)
        for a in range(0, n, block):
            b = min(a + block, n)
            mm.grads.read_into(a, b, buf[: b - a])
            mm.out_to_loss[a:b]
    return time.perf_counter() - t0


def time_gemm(n: int, p: int, m: int, checkpoints: int, block: int, workers: int = 0) -> float:
    """Seconds for X W over n rows per checkpoint: a float32 block of rows times W (p × m), repeated. ``workers``:
    that many threads, each with one-thread GEMMs on its share of the blocks (as the scoring's workers); 0: one
    GEMM call at a time with all of torch's threads."""
    x = torch.randn(block, p)
    w = torch.randn(p, m)
    full, rest = divmod(n, block)
    sizes = [block] * (full * checkpoints) + [rest] * (checkpoints if rest else 0)

    def run(share: list[int], threads: int) -> None:
        torch.set_num_threads(threads)
        acc = torch.empty(block, m)
        for rows in share:
            torch.mm(x[:rows], w, out=acc[:rows])

    threads = torch.get_num_threads()
    torch.mm(x, w)  # warm
    t0 = time.perf_counter()
    try:
        if not workers:
            run(sizes, threads)
        else:
            pool = [threading.Thread(target=run, args=(sizes[i::workers], 1)) for i in range(workers)]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
    finally:
        torch.set_num_threads(threads)
    return time.perf_counter() - t0


def best_gemm(n: int, p: int, m: int, checkpoints: int, blocks: list[int]) -> float:
    """The fastest :func:`time_gemm` over the block sizes, all-thread GEMMs and one-thread GEMMs per worker."""
    threads = torch.get_num_threads()
    return min(time_gemm(n, p, m, checkpoints, b, w) for b in blocks for w in (0, threads))


class PeakRss:
    """The peak resident memory above the start, sampled every 5 ms in a thread."""

    def __init__(self):
        self.base = process_rss()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, process_rss())

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    @property
    def extra_mib(self) -> float:
        return (self.peak - self.base) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--imagenet", action="store_true", help=f"--rows {IMAGENET_ROWS}")
    ap.add_argument("--proj-dim", type=int, default=2048)
    ap.add_argument("--checkpoints", type=int, default=2)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "trakflow_query_bench"))
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    rows = IMAGENET_ROWS if args.imagenet else args.rows
    path = os.path.join(os.path.abspath(args.dir), f"n{rows}_p{args.proj_dim}_c{args.checkpoints}.zarr")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    t0 = time.perf_counter()
    store = build_store(path, rows, args.proj_dim, args.checkpoints)
    print(f"store {path}: ready in {time.perf_counter() - t0:.1f} s", flush=True)
    index = TrakIndex(path)
    ids = list(index.model_ids)
    p = args.proj_dim
    chunk = store.meta.rows_per_chunk
    block = max(chunk, 8192 // chunk * chunk)
    rng = np.random.default_rng(1)
    results = []
    time_read(store, ids, block)  # the page cache warm, as for the warm queries
    for m in args.m:
        vectors = {mid: rng.standard_normal((m, p), dtype=np.float32) for mid in ids}
        index.query_vectors(vectors, k=args.k)  # warm: threads, buffers, page cache
        read = time_read(store, ids, block)
        gemm_blocks = sorted({score_block_rows(p, m, chunk, store.meta.rows_per_shard, workers=1), block})
        gemm = best_gemm(rows, p, m, len(ids), gemm_blocks)
        times = []
        with PeakRss() as mem:
            for _ in range(args.repeats):
                t = time.perf_counter()
                index.query_vectors(vectors, k=args.k)
                times.append(time.perf_counter() - t)
        read = min(read, time_read(store, ids, block))  # the floor: the faster of before and after the queries
        gemm = min(gemm, best_gemm(rows, p, m, len(ids), gemm_blocks))
        floor = read + gemm
        times.sort()
        p50 = statistics.median(times)
        p95 = times[min(len(times) - 1, int(round(0.95 * (len(times) - 1))))]
        row = dict(
            rows=rows, m=m, k=args.k, checkpoints=len(ids), proj_dim=p, p50_s=p50, p95_s=p95, read_s=read,
            gemm_s=gemm, floor_s=floor, p50_x_floor=p50 / floor, p95_x_floor=p95 / floor,
            peak_extra_mib=mem.extra_mib, loadavg=open("/proc/loadavg").read().split()[:3],
        )  # fmt: skip
        results.append(row)
        print(
            f"m={m:4d}: p50 {p50 * 1e3:8.1f} ms  p95 {p95 * 1e3:8.1f} ms | floor {floor * 1e3:8.1f} ms "
            f"(read {read * 1e3:.1f} + GEMM {gemm * 1e3:.1f}) | p50 {p50 / floor:.2f}x  p95 {p95 / floor:.2f}x "
            f"floor | peak extra RSS {mem.extra_mib:.0f} MiB | loadavg {' '.join(row['loadavg'])}",
            flush=True,
        )
    print("\n| rows | m | p50 (ms) | p95 (ms) | floor (ms): read + GEMM | p50 / floor | p95 / floor | extra RSS |")
    print("|---:|---:|---:|---:|---|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['rows']:,} | {r['m']} | {r['p50_s'] * 1e3:.0f} | {r['p95_s'] * 1e3:.0f} | "
            f"{r['floor_s'] * 1e3:.0f} = {r['read_s'] * 1e3:.0f} + {r['gemm_s'] * 1e3:.0f} | "
            f"{r['p50_x_floor']:.2f}× | {r['p95_x_floor']:.2f}× | {r['peak_extra_mib']:.0f} MiB |"
        )
    print(f"\ntorch threads {torch.get_num_threads()}, cores {os.cpu_count()}, {args.repeats} warm queries per m, "
          f"k={args.k}, {len(ids)} checkpoints, proj_dim {p}")  # fmt: skip
    write_json(args.json, results)


if __name__ == "__main__":
    main()
