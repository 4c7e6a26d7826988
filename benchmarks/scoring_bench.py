"""Streaming scoring against the float32 matmul peak, in one process (RESULTS.md, "Scoring against the matmul peak").

On a store of n float16 rows X and m targets: the square-matmul peak, the same GEMM with X in memory,
``scores_from_grads`` (the reference the other paths equal bit for bit), ``reduce.finalize_scores`` and the score
tasks (``prepare_scores`` + ``score_block``, as the flow runs them, and one at a time); each stage's CPU time per
block and by thread, finalize, the bytes stored. *interleaved*: each time / a 4096² matmul timed right before it.

    .venv/bin/python benchmarks/scoring_bench.py --n 65536 --targets 256 1024 4096 --repeats 2 [--results]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import cpu_name, write_json, write_section  # noqa: E402

from tasks import core  # noqa: E402
from tasks.common import cores, threads_per_task, torch_threads  # noqa: E402
from tasks.config import AttributeConfig  # noqa: E402
from trak_core.errors import BadInputError, StateError  # noqa: E402
from trak_core.scoring.combine import combine_checkpoints  # noqa: E402
from trak_core.scoring.streaming import (  # noqa: E402
    cache_bytes,
    grads_right_hand,
    memory_bytes,
    page_array,
    score_block_rows,
    stream_scores,
)
from trak_core.solve import reduce  # noqa: E402
from trak_core.store import StoreMetadata, TrakStore  # noqa: E402
from trak_core.store.verify import require_present  # noqa: E402

START, END = "<!-- scoring_bench:start -->", "<!-- scoring_bench:end -->"


def scores_from_grads(
    store: TrakStore,
    exp_name: str,
    inverses: dict[int, np.ndarray],
    *,
    block_rows: int | None = None,
    out: np.ndarray | None = None,
    progress: Callable[[int], None] | None = None,
) -> np.ndarray:
    """The experiment's combined (n, m) float32 scores from the stored X and given inverses A_c: W_c = A_c G_cᵀ, X_c W_c
    streamed as ``stream_scores`` does, combined with Q (also stored). Equals ``reduce.finalize_scores`` from the
    stored inverses bit for bit; needs every train row featurized and every target written."""
    with store.pinned():  # one call: its groups and arrays opened once
        ids = [int(mid) for mid in inverses]
        if not ids:
            raise BadInputError(f"scores_from_grads: no checkpoint given for experiment {exp_name!r}")
        n, p = store.meta.train_set_size, store.meta.proj_dim
        rows, targets_idx = np.arange(n), np.arange(store.num_targets(exp_name))
        right: dict[int, torch.Tensor] = {}
        for mid in ids:
            mask = store.featurized_mask(mid)
            if not mask.all():
                raise StateError(f"model_id={mid}: {int((~mask).sum())} of {n} train rows are not featurized")
            if not store.targets_complete(exp_name, mid):
                raise StateError(f"target gradients of experiment {exp_name!r} for model_id={mid} are incomplete")
            mm, tg = store.model(mid), store.target_grads(exp_name, mid)
            require_present(store, [(mm.grads, rows), (mm.out_to_loss, rows), (tg, targets_idx)])
            g_t = torch.from_numpy(tg[:].astype(np.float32)).T.contiguous()
            if tuple(np.shape(inverses[mid])) != (p, p):
                raise BadInputError(f"inverses[{mid}] has shape {np.shape(inverses[mid])}, expected ({p}, {p})")
            right[mid] = grads_right_hand(inverses[mid], g_t)
        store.reset_scores(exp_name)  # a new combination: recompute all rows
        if out is None:
            out = page_array((n, store.num_targets(exp_name)), np.float32)
        stream_scores(store, exp_name, ids, 0, n, right, block_rows=block_rows, out=out, progress=progress)
        store.set_scored_with(exp_name, ids)
    return out


def square_gflops(s: int, reps: int = 3) -> float:
    a, b = torch.randn(s, s), torch.randn(s, s)
    torch.matmul(a, b)
    best = min(_timed(lambda: torch.matmul(a, b)) for _ in range(reps))
    return 2 * s**3 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def pipeline_config(store: TrakStore, exp: str, **over) -> AttributeConfig:
    """The pipeline's default config (no validation: only the fields its score step reads) on this store."""
    return AttributeConfig.model_construct(store=store.location, exp_name=exp, **over)


def score_tasks(store: TrakStore, exp: str, used: list[int], **over):
    """The pipeline's score step (flows/score.py without Prefect): prepare_scores (G A once, begin_scores, the
    task ranges), then score_block per range, ``task_slots`` at once, each in its share of the cores (what the
    Prefect task wrapper runs). ``over``: config fields instead of the defaults (e.g. ``max_workers``)."""
    config = pipeline_config(store, exp, **over)
    store.reset_scores(exp)  # else the repetitions after the first find every row done
    plan = core.prepare_scores(config, used)
    threads = threads_per_task(config, len(plan.blocks))

    def task(block: tuple[int, int]) -> None:
        with torch_threads(threads):
            core.score_block(config, list(plan.model_ids), *block)

    with ThreadPoolExecutor(config.task_slots) as pool:
        list(pool.map(task, plan.blocks))
    return lambda: store.scores(exp)[:]  # read back for the checks, after the timing


def score_tasks_label(store: TrakStore, exp: str, used: list[int]) -> str:
    config = pipeline_config(store, exp)
    n = len(core.score_ranges(config, store, used))
    return (
        f"score tasks ({n} of score_task_ranges, {config.task_slots} at once, "
        f"{threads_per_task(config, n)} thread(s) each)"
    )


def build_store(path: str, n: int, p: int, ms: list[int], ckpts: int, dtype: str, lambda_reg="adaptive") -> TrakStore:
    """n rows of projected gradients X (standard normal, columns scaled 0.2-3), their XᵀX partials and row sums,
    the inverse A (``reduce.finalize_model``), Q, and m target gradients per experiment ``m<m>``."""
    rng = np.random.default_rng(0)
    meta = StoreMetadata(train_set_size=n, grad_dim=10 * p, proj_dim=p, dtype=dtype)
    st = TrakStore.create_or_open(path, meta)
    scale = rng.uniform(0.2, 3.0, p).astype(np.float32)
    for mid in range(ckpts):
        st.init_model(mid)
        for a in range(0, n, meta.shard_rows):
            b = min(a + meta.shard_rows, n)
            x = rng.standard_normal((b - a, p), dtype=np.float32) * scale
            st.write_train_rows(mid, slice(a, b), x, rng.uniform(0.5, 1.5, b - a).astype(np.float32))
        for s in range(meta.num_shards):
            reduce.ensure_partial(st, mid, s)
        reduce.finalize_model(st, mid, lambda_reg=lambda_reg)
    for m in ms:
        exp = f"m{m}"
        st.init_experiment(exp, m)
        for mid in range(ckpts):
            g = rng.standard_normal((m, p), dtype=np.float32)
            st.init_experiment_model(exp, mid)
            st.write_target_rows(exp, mid, slice(0, m), g)
    return st


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def store_bytes(st: TrakStore, path: str, ckpts: int) -> dict:
    """Bytes on disk: all model arrays, their grads and XᵀX partials, and the whole store (with the experiments'
    targets, G A and scores)."""

    def arr(name: str) -> int:
        return sum(dir_bytes(os.path.join(path, "models", str(mid), name)) for mid in range(ckpts))

    models = sum(dir_bytes(os.path.join(path, "models", str(mid))) for mid in range(ckpts))
    return {"models": models, "grads": arr("grads"), "partials": arr("xtx_partials"), "total": dir_bytes(path)}


def max_rel(got: np.ndarray, want: np.ndarray, step: int = 4096) -> float:
    """max |got - want| / max |want| (normwise: elementwise ratios blow up at scores near 0), in row blocks."""
    diff = top = 0.0
    for a in range(0, len(want), step):
        w = np.asarray(want[a : a + step], dtype=np.float64)
        diff = max(diff, float(np.abs(np.asarray(got[a : a + step], dtype=np.float64) - w).max()))
        top = max(top, float(np.abs(w).max()))
    return diff / top


def exact_rows(st: TrakStore, exp: str, used: list[int], rows: int) -> np.ndarray:
    """float64 scores of the first ``rows`` train rows from the stored X, Q, G and the recorded λ:
    A = (XᵀX + λI)⁻¹ / mean|A| (XᵀX from all n rows), S = combine(Σ_c X_c A_c G_cᵀ, Σ_c Q_c)."""
    acc, q = 0.0, 0.0
    for mid in used:
        mm, lam = st.model(mid), st.finalize_info(mid)["lambda_reg"]
        x = mm.grads[:rows].astype(np.float64)
        inv = np.linalg.inv(reduce.total_xtx(st, mid) + lam * np.eye(x.shape[1]))
        inv /= np.abs(inv).mean()
        acc = acc + (x @ inv) @ st.target_grads(exp, mid)[:].astype(np.float64).T
        q = q + mm.out_to_loss[:rows].astype(np.float64)
    return combine_checkpoints(acc, q, len(used))


def stage_costs(st: TrakStore, exp: str, rows: int, reps: int = 8) -> dict:
    """Process CPU time per block of ``rows`` train rows of each stage of the streaming scoring (one torch thread,
    stages one after the other, best of ``reps``), each Zarr stage timed in the units the stream uses."""
    p, m, n = st.meta.proj_dim, st.num_targets(exp), st.meta.train_set_size
    grads = st.model(0).grads
    arr, done = st.init_scores(exp)
    score_rows, done_rows = min(arr.chunks[0], n), min(done.chunks[0], n)
    raw = np.empty((score_rows, p), dtype=st.meta.np_dtype)
    x, w, acc = torch.empty(rows, p), torch.randn(p, m), torch.zeros(rows, m)
    q = np.ones(rows, dtype=np.float64)
    res, chunk = acc.numpy(), np.zeros((score_rows, m), dtype=np.float32)

    def combine():
        np.divide(res, 1, out=res)
        np.multiply(res, q.astype(np.float32).reshape(-1, 1), out=res)

    def units(size: int) -> list[tuple[int, int]]:
        return [(s, s + size) for s in range(0, n - size + 1, size)][:reps]

    stages = {  # name: (function of a unit [s, e), the unit's rows)
        "read X (Zarr, crc32c)": (lambda s, e: grads.read_into(s, e, raw), score_rows),
        "float16 → float32": (lambda s, e: x.copy_(torch.from_numpy(raw[:rows])), rows),
        "GEMM (one thread)": (lambda s, e: acc.addmm_(x, w), rows),
        "combination with Q": (lambda s, e: combine(), rows),
        "write scores (Zarr, crc32c)": (lambda s, e: arr.__setitem__(slice(s, e), chunk), score_rows),
        "mark rows done (Zarr)": (lambda s, e: done.__setitem__(slice(s, e), 1), done_rows),
    }
    out = {}
    with one_torch_thread():
        for k, (fn, size) in stages.items():
            blocks = units(size)
            fn(*blocks[0])
            best = float("inf")
            for blk in blocks:
                c = time.process_time()
                fn(*blk)
                best = min(best, time.process_time() - c)
            out[k] = best * rows / size
    st.reset_scores(exp)
    return out


@contextlib.contextmanager
def one_torch_thread():
    """Torch's intra-op threads at 1 inside the block, restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def one_thread_gemm_cpu(x: torch.Tensor, w: torch.Tensor, rows: int = 8192) -> float:
    """CPU seconds of x @ w with one torch thread, from its first ``rows`` rows scaled to all of x (best of 2):
    the CPU time the scoring's GEMM needs on its own, whatever the load (other processes do not count)."""
    part, acc = x[:rows], torch.zeros(min(rows, len(x)), w.shape[1])
    best = float("inf")
    with one_torch_thread():
        for _ in range(2):
            c = time.process_time()
            acc.addmm_(part, w)
            best = min(best, time.process_time() - c)
    return best * len(x) / len(part)


def _thread_cpu() -> dict[int, float]:
    """CPU seconds of each live thread of this process (Linux: /proc/self/task), by native thread id."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                f = fh.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (int(f[11]) + int(f[12])) / tick  # utime + stime
    return out


def cpu_by_thread(fn) -> dict | None:
    """Where the CPU time of ``fn()`` went, by thread (None without /proc): zarr's event-loop and I/O threads
    (``zarr_io``, ``asyncio_*``: the Zarr reads and writes, crc32c, the copies into the caller's buffers), the
    calling thread, the other threads alive before and after (torch's OpenMP pool), and the threads that ``fn``
    started and ended (the scoring's workers and reader): the process's CPU time less the others'."""
    if not os.path.isdir("/proc/self/task"):
        return None
    before, c = _thread_cpu(), time.process_time()
    fn()
    total, after = time.process_time() - c, _thread_cpu()
    named = {t.native_id: t.name for t in threading.enumerate()}
    me = threading.get_native_id()
    out = {"zarr": 0.0, "caller": 0.0, "other": 0.0}
    for tid, v in after.items():
        if tid not in before:  # started by fn and still alive: counted with fn's threads
            continue
        d = v - before[tid]
        name = named.get(tid, "")
        key = "caller" if tid == me else "zarr" if name == "zarr_io" or name.startswith("asyncio_") else "other"
        out[key] += d
    out["started"] = max(0.0, total - sum(out.values()))
    out["total"] = total
    return out


def finalize_times(st: TrakStore, mid: int, lambda_reg, repeats: int) -> dict:
    """finalize (the partials summed, the solve, A written: no pass over the rows) against the solve alone from
    the summed partials; best of ``repeats`` each, alternated."""
    full, solve = [], []
    for _ in range(repeats):
        st.clear_finalize_info(mid)
        full.append(_timed(lambda: reduce.finalize_model(st, mid, lambda_reg)))
        solve.append(_timed(lambda: reduce.solve_model(st, mid, lambda_reg)))
    return {"finalize": min(full), "solve": min(solve)}


def run(a) -> dict:
    peaks = {s: square_gflops(s) for s in (2048, 4096, 6144)}
    ref_a, ref_b = torch.randn(4096, 4096), torch.randn(4096, 4096)
    rows = []
    used = list(range(a.ckpts))
    loads = [os.getloadavg()[0]]
    stages: dict[int, dict] = {}
    threads_cpu: dict[int, dict] = {}
    meta = StoreMetadata(train_set_size=a.n, grad_dim=10 * a.p, proj_dim=a.p, dtype=a.dtype)
    block_rows = {
        m: score_block_rows(
            a.p, m, meta.chunk_rows, meta.shard_rows, itemsize=meta.np_dtype.itemsize, workers=torch.get_num_threads()
        )
        for m in a.targets
    }
    with tempfile.TemporaryDirectory(dir=a.tmp) as tmp:
        t0 = time.perf_counter()
        path = os.path.join(tmp, "s")
        st = build_store(path, a.n, a.p, a.targets, a.ckpts, a.dtype, a.lambda_reg)
        build_s = time.perf_counter() - t0
        fin = finalize_times(st, 0, a.lambda_reg, a.repeats)
        inverses = {mid: reduce.solve_model(st, mid, a.lambda_reg)[0] for mid in used}
        x_mem = torch.from_numpy(st.model(0).grads[:].astype(np.float32))
        for m in a.targets:
            exp = f"m{m}"
            flops = 2 * a.n * a.p * m * a.ckpts
            reduce.solve_targets(st, exp, used)
            g = reduce.load_solved(st, exp, used)  # W = A Gᵀ per checkpoint
            out = torch.empty(a.n, m)

            def gemm_only(out=out, g=g):
                out.zero_()
                for mid in used:
                    out.addmm_(x_mem, g[mid])

            paths = {
                "GEMM only (X in memory, float32)": gemm_only,
                "X · (A Gᵀ) (scores_from_grads)": lambda exp=exp: scores_from_grads(st, exp, inverses),
                "finalize_scores (G A from the store)": lambda exp=exp: reduce.finalize_scores(st, exp),
                score_tasks_label(st, exp, used): lambda exp=exp: score_tasks(st, exp, used),
                f"score tasks, one at a time ({cores()} threads each)": lambda exp=exp: score_tasks(
                    st, exp, used, max_workers=1
                ),
            }
            res = {k: {"t": [], "frac": [], "cpu": []} for k in paths}
            gemm_cpu = one_thread_gemm_cpu(x_mem, g[used[0]]) * len(used)
            exact = exact_rows(st, exp, used, a.exact_rows)
            checks: dict[str, tuple[bool, float, float]] = {}  # bitwise == before, rel. diff, rel. to float64
            base = None
            for rep in range(a.repeats):
                for k, fn in paths.items():
                    ref = 2 * 4096**3 / _timed(lambda: torch.matmul(ref_a, ref_b)) / 1e9
                    c, t = time.process_time(), time.perf_counter()
                    r = fn()
                    dt = time.perf_counter() - t
                    res[k]["cpu"].append(gemm_cpu / (time.process_time() - c))
                    r = r() if callable(r) else r  # the score tasks' scores, read back untimed
                    res[k]["t"].append(dt)
                    res[k]["frac"].append(flops / dt / 1e9 / ref)
                    loads.append(os.getloadavg()[0])
                    if r is not None and rep == a.repeats - 1:  # X · (A Gᵀ) runs first: the reference
                        r = np.asarray(r)
                        base = r if base is None else base
                        same = bool(np.array_equal(r, base))
                        checks[k] = (same, max_rel(r, base), max_rel(r[: a.exact_rows], exact))
                    del r
            for k in paths:
                best = min(res[k]["t"])
                row = {"path": k, "m": m, "seconds": best, "gflops": flops / best / 1e9}
                row.update(interleaved=statistics.median(res[k]["frac"]), cpu_share=statistics.median(res[k]["cpu"]))
                row.update(zip(("bit_identical", "rel_diff", "rel_exact"), checks.get(k, (None, None, None))))
                rows.append(row)
                print(json.dumps(rows[-1]), flush=True)
            del out, base, checks
            split = cpu_by_thread(lambda exp=exp: reduce.finalize_scores(st, exp))
            if split is not None:
                split["gemm"], split["flops"] = gemm_cpu, flops
                threads_cpu[m] = split
                print(json.dumps({"m": m, "cpu_by_thread": split}), flush=True)
            stages[m] = stage_costs(st, exp, rows=block_rows[m])
            print(json.dumps({"m": m, "stages": stages[m]}), flush=True)
        sizes = {a.dtype: store_bytes(st, path, a.ckpts)}
        x_mem = torch.empty(0)  # free the in-memory X before the second store
    # the other store dtype: the same X (float32 or rounded to float16), scores at the smallest m
    other = "float32" if a.dtype == "float16" else "float16"
    with tempfile.TemporaryDirectory(dir=a.tmp) as tmp:
        path = os.path.join(tmp, "s")
        m = min(a.targets)
        st = build_store(path, a.n, a.p, [m], a.ckpts, other, a.lambda_reg)
        inverses = {mid: reduce.solve_model(st, mid, a.lambda_reg)[0] for mid in used}
        via_store = reduce.finalize_scores(st, f"m{m}").copy()
        via_grads = scores_from_grads(st, f"m{m}", inverses)
        exact = exact_rows(st, f"m{m}", used, a.exact_rows)
        sizes[other] = store_bytes(st, path, a.ckpts)
        other_row = {
            "dtype": other,
            "m": m,
            "same": bool(np.array_equal(via_store, via_grads)),
            "grads_exact": max_rel(via_grads[: a.exact_rows], exact),
        }
        print(json.dumps(other_row), flush=True)
    for s in peaks:
        peaks[s] = max(peaks[s], square_gflops(s))
    return {
        "peaks": peaks,
        "peak": max(peaks.values()),
        "rows": rows,
        "build_s": build_s,
        "finalize": fin,
        "sizes": sizes,
        "other_dtype": other_row,
        "chunk_rows": meta.chunk_rows,
        "shard_rows": meta.shard_rows,
        "block_rows": block_rows,
        "stages": stages,
        "threads_cpu": threads_cpu,
        "cache": cache_bytes(),
        "memory": memory_bytes(),
        "loads": loads,
        "workers": torch.get_num_threads(),
    }


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds all processes have used, this process's), or None without /proc/stat: their difference over
    the run is what other processes took from the cores (the load average counts this benchmark's own threads)."""
    try:
        with open("/proc/stat") as fh:
            f = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = f[0] + f[1] + f[2] + sum(f[5:8])  # user, nice, system, irq, softirq, steal (not idle, iowait)
    own = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system


def report(res: dict, a, cmd: str, wall: float, load: list, others: float | None = None) -> str:
    """``others``: the fraction of the cores other processes used during the run (None: unknown)."""
    peak = res["peak"]
    load = [*load, *res["loads"]]
    busy = others > 0.1 if others is not None else max(load) > 0.75 * (os.cpu_count() or 1)
    shared = f"other processes used {others:.0%} of the cores during the run" if others is not None else ""
    lines = [
        "### Streaming scoring against the matmul peak",
        "",
        f"Produced by `{cmd}` in one run ({wall / 60:.1f} min) on {platform.processor() or 'x86_64'} "
        f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads). "
        f"Load average (1 min) at each measurement, this benchmark's own threads included: "
        f"{min(load):.1f}–{max(load):.1f} on {os.cpu_count()} cores"
        + (f"; {shared} (`/proc/stat` busy time less this process's CPU time)" if shared else "")
        + (
            ": **the machine was shared with other jobs**, so absolute GFLOP/s are noisy; "
            if busy
            else " (a quiet machine); "
        )
        + "the *interleaved* column (each measurement divided by a 4096² matmul timed right before it, median over "
        "repetitions) is the load-robust one for wall-clock time; *CPU share of the GEMM* (the CPU seconds of the "
        "same GEMM with one torch thread, divided by the process's CPU seconds for the path, median over repetitions) "
        "does not count other processes at all: on a quiet machine it bounds the fraction of the GEMM's speed the "
        "path reaches (reached when no core idles). The streaming paths run "
        f"{res['workers']} worker threads (torch's intra-op threads), one-thread GEMMs each.",
        "",
        f"n = {a.n:,} train rows, proj_dim {a.p}, {a.dtype} store ({res['chunk_rows']} rows per chunk, "
        f"{res['shard_rows']} per shard), {a.ckpts} checkpoint(s); best of {a.repeats}. Measured float32 "
        f"matmul peak: **{peak:.1f} GFLOP/s** (square n×n, best of the run: "
        + ", ".join(f"{s}: {v:.1f}" for s, v in res["peaks"].items())
        + "). Block rows chosen by `score_block_rows` on this machine (last-level cache "
        f"{res['cache'] >> 20} MiB, {res['memory'] >> 30} GiB available): "
        + ", ".join(f"m={m}: {r}" for m, r in res["block_rows"].items())
        + ".",
        "",
        "| path | targets m | seconds (best) | GFLOP/s | % of the matmul peak | % of GEMM only | interleaved "
        "(vs 4096² just before) | CPU share of the GEMM | scores == X · (A Gᵀ) (bitwise) | "
        f"max rel. diff vs X · (A Gᵀ) | max rel. diff vs float64 (first {a.exact_rows:,} rows) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in a.targets:
        gemm = next(r for r in res["rows"] if r["m"] == m and r["path"].startswith("GEMM"))
        for r in (r for r in res["rows"] if r["m"] == m):
            same = "—" if r["bit_identical"] is None else ("yes" if r["bit_identical"] else "**no**")
            diff = "—" if r["rel_diff"] is None else f"{r['rel_diff']:.1e}"
            exact = "—" if r["rel_exact"] is None else f"{r['rel_exact']:.1e}"
            lines.append(
                f"| {r['path']} | {m} | {r['seconds']:.2f} | {r['gflops']:.1f} | {100 * r['gflops'] / peak:.0f}% | "
                f"{100 * r['gflops'] / gemm['gflops']:.0f}% | {100 * r['interleaved']:.0f}% | "
                f"{100 * r['cpu_share']:.0f}% | {same} | {diff} | {exact} |"
            )
    if res.get("stages"):
        names = list(next(iter(res["stages"].values())))
        lines += [
            "",
            "CPU time per block of each stage (`stage_costs`: process CPU time, zarr's event-loop and I/O threads "
            "included, one torch thread, the stages run one after the other, best of 8 blocks; rows per block as "
            "chosen above). The GEMM's share of the sum bounds what the cores can spend on the GEMM, however the "
            "stages overlap:",
            "",
            "| targets m | rows | " + " | ".join(names) + " | GEMM share of the sum |",
            "|---" * (len(names) + 3) + "|",
        ]
        for m, st in res["stages"].items():
            tot = sum(st.values())
            gemm = next(v for k, v in st.items() if k.startswith("GEMM"))
            lines.append(
                f"| {m} | {res['block_rows'][m]} | "
                + " | ".join(f"{1e3 * v:.2f} ms" for v in st.values())
                + f" | {100 * gemm / tot:.0f}% |"
            )
    if res.get("threads_cpu"):
        cores = res["workers"]
        lines += [
            "",
            "Where `finalize_scores`' CPU time goes, by thread (`cpu_by_thread`: one more call per m after the timed "
            "ones; CPU seconds from /proc/self/task). *Workers and reader*: the threads the call starts and ends "
            "(the process's CPU time less the others'); their GEMM alone is the one-thread GEMM's CPU time above. "
            f"*Ceiling*: the speed if the {cores} cores did this CPU work with no idle moment (process CPU / {cores}), "
            "as % of the matmul peak — what this path can reach on this machine while the Zarr I/O costs what it "
            "does:",
            "",
            "| targets m | process CPU | GEMM (one thread) | workers and reader, besides the GEMM | zarr's threads "
            "(`zarr_io`, `asyncio_*`) | calling thread | other threads | ceiling, % of the matmul peak | measured, "
            "% of the matmul peak |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for m, t in res["threads_cpu"].items():
            fin = next(r for r in res["rows"] if r["m"] == m and r["path"].startswith("finalize_scores (G A"))
            ceiling = t["flops"] / (t["total"] / cores) / 1e9 / peak
            lines.append(
                f"| {m} | {t['total']:.2f} s | {t['gemm']:.2f} s | {max(0.0, t['started'] - t['gemm']):.2f} s | "
                f"{t['zarr']:.2f} s | {t['caller']:.2f} s | {t['other']:.2f} s | {100 * ceiling:.0f}% | "
                f"{100 * fin['gflops'] / peak:.0f}% |"
            )
    fin, o = res["finalize"], res["other_dtype"]
    lines += [
        "",
        "### Finalize and bytes stored: measured in the same run",
        "",
        f"Finalize of one checkpoint (n = {a.n:,}, proj_dim {a.p}, {a.dtype}, lambda_reg {a.lambda_reg!r}; best of "
        f"{a.repeats}): `reduce.finalize_model` (the shard partials summed, the solve, A written; no pass over the "
        f"rows) **{fin['finalize']:.2f} s**; the solve alone (`reduce.solve_model` from the stored partials) "
        f"**{fin['solve']:.2f} s**.",
        "",
        "| store | model arrays (all checkpoints) | of which grads (X) | of which XᵀX partials | "
        "whole store (with the experiments' targets, G A and scores) |",
        "|---|---|---|---|---|",
    ]
    for dt, b in res["sizes"].items():
        lines.append(
            f"| {dt}, n = {a.n:,} | {b['models'] / 2**20:,.0f} MiB | {b['grads'] / 2**20:,.0f} MiB | "
            f"{b['partials'] / 2**20:,.0f} MiB | {b['total'] / 2**20:,.0f} MiB |"
        )
    lines += [
        "",
        f"{o['dtype']} store (same X, m = {o['m']}): `finalize_scores` (G A from the store) and `scores_from_grads` "
        f"(W from the inverses) {'bitwise equal' if o['same'] else '**not bitwise equal**'}; against float64 scores "
        f"(first {a.exact_rows:,} rows) {o['grads_exact']:.1e} (max |Δ| / max |reference|).",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--p", type=int, default=2048)
    ap.add_argument("--targets", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--ckpts", type=int, default=1)
    ap.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--lambda-reg", default="adaptive", help="finalize's lambda_reg (the pipeline's default)")
    ap.add_argument("--exact-rows", type=int, default=2048, help="rows compared against float64 scores")
    ap.add_argument("--tmp", default=None, help="folder for the store (default: the system's temp folder)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--results", action="store_true", help="write the table into benchmarks/RESULTS.md")
    a = ap.parse_args()
    shown = [x for i, x in enumerate(sys.argv[1:]) if x not in ("--results", "--json") and sys.argv[i] != "--json"]
    cmd = ".venv/bin/python benchmarks/scoring_bench.py " + " ".join(shown)  # the table's arguments
    load = [os.getloadavg()[0]]
    t, cpu0 = time.perf_counter(), cpu_seconds()
    res = run(a)
    load.append(os.getloadavg()[0])
    cpu1, wall = cpu_seconds(), time.perf_counter() - t
    others = None
    if cpu0 and cpu1:
        others = max(0.0, (cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1])) / (wall * (os.cpu_count() or 1))
    text = report(res, a, cmd, wall, load, others)
    print(text)
    write_json(a.json, res)
    if a.results:
        write_section(os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"), text, START, END)


if __name__ == "__main__":
    main()
