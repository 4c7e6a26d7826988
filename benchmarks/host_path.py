"""The host path of featurizing, in µs per row: everything a featurize step does except the model's arithmetic
(RESULTS.md, "Host path: featurize without the model's arithmetic").

Precomputed X (rounded to the store's float16, as the device hands it over) and Q are fed through the production
write paths, with the model's arithmetic replaced by slices of those arrays and each shard's XᵀX partial (the Gram
and row sums the device would compute) precomputed, on the device ``meta`` so the code takes its device path:

* ``traker``: :meth:`TRAKer.featurize` batch by batch in the GPU setting (partials stored as shards complete);
* ``traker-behind``: the same with ``TRAKer(write_behind=True)``;
* ``shard``: :func:`trak_core.engine.featurize_shard`, the pipeline task's step;
* ``floor``: the same bytes written to new files as the store writes a chunk, nothing else.

Each stage is the time spent inside the named production functions (``STAGES``), wall / CPU of the calling
thread, inclusive; ``total`` is the wall time of the whole loop and the process's CPU time, per row. A shard must
begin at a multiple of ``--pool`` rows (the defaults do).

    PYTHONPATH=. .venv/bin/python benchmarks/host_path.py                 # 65,536 rows, batches 256 and 2,048
    PYTHONPATH=. .venv/bin/python benchmarks/host_path.py --smoke         # every code path, tiny sizes
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import write_json  # noqa: E402

PARTIAL_STAGE = "XᵀX partial (Gram precomputed)"
#: the stood-in device arithmetic done on the host (the rows' norms), subtracted from the total and the partial's stage
DEVICE_ROW = "(device arithmetic stood in, subtracted)"

#: (label, module, attribute) of each timed stage
STAGES = [
    ("store write (all arrays)", "trak_core.store.zarr_store", "TrakStore.write_train_rows"),
    ("  zarr array read/write (guarded)", "trak_core.store.arrays", "StoredArray._guard"),
    ("  chunk encode (convert + crc32c)", "trak_core.store.chunkio", "encode_rows"),
    ("  crc32c (zarr codec)", "zarr.codecs.crc32c_", "Crc32cCodec._encode_sync"),
    ("  chunk files written", "trak_core.store.chunkio", "write_chunk_files"),
    ("  place records (check + write)", "trak_core.store.arrays", "record_places"),
    ("  place checks", "trak_core.store.arrays", "place_problems"),
    ("  lock check", "trak_core.store.zarr_store", "TrakStore.check_lock"),
    ("finalized check", "trak_core.store.zarr_store", "TrakStore.is_finalized"),
    (PARTIAL_STAGE, "trak_core.engine", "_write_partial_unmarked"),  # the shard task's
    (PARTIAL_STAGE, "trak_core.featurize.row_sink", "complete_shard"),  # TRAKer's (its partials' thread)
    ("  row sums (host float64)", "trak_core.solve.reduce", "shard_row_sums"),
    ("  partial written", "trak_core.store.zarr_store", "TrakStore.write_partial"),
]


def _resolve(module: str, attr: str):
    """(owner, name) of ``module``'s ``attr`` (dotted), or None where it is gone."""
    *path, name = attr.split(".")
    owner = importlib.import_module(module)
    for part in path:
        owner = getattr(owner, part, None)
    return (owner, name) if hasattr(owner, name) else None


@contextlib.contextmanager
def timed_stages(spent: dict):
    """Wrap each stage's function to add its wall seconds to ``spent[label]`` and the calling thread's CPU seconds to
    ``spent["cpu " + label]``; restored after."""
    import threading

    guard = threading.Lock()
    undo = []
    for label, module, attr in STAGES:
        found = _resolve(module, attr)
        if found is None:
            continue
        owner, name = found
        real = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)

        def wrapper(*a, _real=real, _label=label, **k):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return _real(*a, **k)
            finally:
                with guard:
                    spent[_label] += time.perf_counter() - t
                    spent["cpu " + _label] += time.thread_time() - c

        setattr(owner, name, wrapper)
        undo.append((owner, name, real))
    try:
        yield
    finally:
        for owner, name, real in reversed(undo):
            setattr(owner, name, real)


class _Pool:
    """X and Q handed over batch by batch: rows of a pool (views; never written to), X in the store's float16."""

    def __init__(self, rows: int, p: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.x = (rng.standard_normal((rows, p), dtype=np.float32) * np.float32(0.02)).astype(np.float16)
        self.q = rng.random(rows, dtype=np.float32)
        self.packed = np.eye(p, dtype=np.float64)[np.triu_indices(p)]
        wide = self.x.astype(np.float16).astype(np.float64)  # each row's ‖xᵢ‖² as stored (float16), in float64
        self.norms = np.einsum("ij,ij->i", wide, wide)
        self.wide = wide
        self._sums: dict[int, np.ndarray] = {}
        self.sums_of(rows, self.q)  # a shard of the pool's length (the default): computed before anything is timed

    def sums_of(self, n: int, q: np.ndarray) -> np.ndarray:
        """The row sums of the first ``n`` rows handed over from the pool's start (a shard's, as stored) and their
        ``q``, which must be the pool's: computed once per length (the stood-in device's arithmetic)."""
        idx = np.arange(n) % len(self.q)
        if not np.array_equal(np.asarray(q, dtype=np.float32), self.q[idx]):
            raise RuntimeError("the stood-in device sums: a shard's q is not the pool's")
        if n not in self._sums:
            qd, rn = self.q[idx].astype(np.float64), self.norms[idx]
            self._sums[n] = np.concatenate([qd @ self.wide[idx], [qd @ qd, rn @ rn, (qd * qd) @ rn]])
        return self._sums[n]

    def take(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        n = len(self.q)
        i = a % n
        j = i + (b - a)
        if j <= n:  # a view: the device → host copy is not part of what is timed here
            return self.x[i:j], self.q[i:j]
        idx = np.arange(a, b) % n
        return self.x[idx], self.q[idx]


#: the device that the partials are computed "on": not the CPU, so that the production code takes its device path (the
#: device's arithmetic itself is the precomputed Gram, :func:`_gram_precomputed`)
DEVICE = "meta"


@contextlib.contextmanager
def _gram_precomputed(pool: _Pool, spent: dict):
    """The device's Gram arithmetic (``reduce._device_upper``) replaced by the precomputed packed triangle and the
    shard's row sums, summed here on the host from the pool's norms: that time, the device's arithmetic, is added to
    ``spent["device"]`` and subtracted from the figures."""
    from trak_core.solve import reduce

    def upper(x, device, scale=None, q=None, sums=None):
        if sums is not None:  # a shard begins at a multiple of the pool's rows
            t, c = time.perf_counter(), time.thread_time()
            idx = np.arange(len(x)) % len(pool.norms)
            for i in (0, len(x) - 1):  # the rows are the pool's, as stored
                if x[i].tobytes() != pool.x[idx[i]].astype(x.dtype).tobytes():
                    raise RuntimeError("the stood-in device sums: a shard's rows are not the pool's")
            sums[:] = pool.sums_of(len(x), q)
            spent["device"] += time.perf_counter() - t
            spent["cpu device"] += time.thread_time() - c
        return torch.from_numpy(pool.packed)

    real, reduce._device_upper = reduce._device_upper, upper
    try:
        yield
    finally:
        reduce._device_upper = real


def run_traker(
    folder: str, n: int, p: int, batch: int, pool: _Pool, chunk_rows: int | None, write_behind: bool = False
) -> float:
    """Wall seconds of TRAKer.featurize over ``n`` rows (GPU setting: partials while featurizing), the last write
    included; ``write_behind``: TRAKer(write_behind=True)."""
    from trak_core.compat.traker import TRAKer
    from trak_core.projection.projectors import DenseProjector, ProjectionType

    model = torch.nn.Linear(4, 2)
    proj = DenseProjector(10, p, 0, ProjectionType.rademacher, "cpu")
    extra = {"write_behind": True} if write_behind else {}
    tr = TRAKer(
        model, "image_classification", n, save_dir=folder, projector=proj, device="cpu", chunk_rows=chunk_rows, **extra
    )
    tr.load_checkpoint(model.state_dict(), 0)
    state = {"next": 0}

    def handed_over(b, model_id, inds):
        a = state["next"]
        state["next"] += len(inds)
        return pool.take(a, a + len(inds))

    tr.featurizer.featurize = handed_over
    tr._rows.partials_while_featurizing = lambda: True  # the GPU setting (the Gram is precomputed)
    tr._rows._shards.device = DEVICE
    inputs, labels = torch.zeros(batch, 4), torch.zeros(batch, dtype=torch.long)
    t = time.perf_counter()
    for s in range(0, n, batch):
        k = min(batch, n - s)
        tr.featurize([inputs[:k], labels[:k]], num_samples=k)
    tr._flush_rows()
    wall = time.perf_counter() - t
    done = tr.store.featurized_mask(0)
    parts = tr.store.num_partials_done(0)
    tr._close()
    if not done.all() or parts != tr.store.meta.num_shards:
        raise RuntimeError(f"traker path: {int(done.sum())} of {n} rows, {parts} partials stored")
    return wall


class _HandedOver:
    """A Featurizer stand-in for featurize_shard: X and Q from the pool."""

    device = DEVICE

    def __init__(self, pool: _Pool):
        self.pool = pool

    def featurize(self, batch, model_id, indices):
        return self.pool.take(indices.start, indices.stop)


def run_shard(folder: str, n: int, p: int, batch: int, pool: _Pool, chunk_rows: int | None) -> float:
    """Wall seconds of engine.featurize_shard over every shard of ``n`` rows."""
    from trak_core import engine
    from trak_core.featurize.modelout import resolve_task
    from trak_core.projection.projectors import DenseProjector, ProjectionType

    proj = DenseProjector(10, p, 0, ProjectionType.rademacher, "cpu")
    meta = engine.store_metadata(
        proj, train_set_size=n, dtype="float16", task=resolve_task("image_classification"), chunk_rows=chunk_rows
    )
    store = engine.open_run(folder, meta)
    engine.plan_model(store, 0)
    feat = _HandedOver(pool)
    t = time.perf_counter()
    for shard in range(meta.num_shards):
        engine.featurize_shard(store, 0, shard, lambda: feat, lambda a, b: [], batch)
    wall = time.perf_counter() - t
    if not store.featurized_mask(0).all() or store.num_partials_done(0) != meta.num_shards:
        raise RuntimeError("shard path: not every row or partial stored")
    return wall


def run_floor(folder: str, n: int, p: int, batch: int, pool: _Pool, chunk_rows: int | None) -> float:
    """Wall seconds of writing the bytes the store keeps of ``n`` rows (X in float16 and Q by chunk, each shard's
    packed partial) to new files as the store writes a chunk (a temporary file renamed over it): no conversion,
    checksum, record or flag. What the file system itself costs on this machine."""
    from trak_core import engine
    from trak_core.featurize.modelout import resolve_task
    from trak_core.projection.projectors import DenseProjector, ProjectionType

    proj = DenseProjector(10, p, 0, ProjectionType.rademacher, "cpu")
    meta = engine.store_metadata(
        proj, train_set_size=n, dtype="float16", task=resolve_task("image_classification"), chunk_rows=chunk_rows
    )
    x = pool.x[: meta.rows_per_chunk].astype(np.float16)
    q = np.zeros(meta.rows_per_chunk, dtype=np.float32)

    def put(path: str, data) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "wb") as fh:
            fh.write(data)
        os.replace(path + ".tmp", path)

    t = time.perf_counter()
    for c in range(-(-n // meta.rows_per_chunk)):
        k = min(meta.rows_per_chunk, n - c * meta.rows_per_chunk)
        put(os.path.join(folder, "grads", "c", str(c), "0"), x[:k].data)
        put(os.path.join(folder, "q", "c", str(c)), q[:k].data)
    for s in range(meta.num_shards):
        put(os.path.join(folder, "xtx", "c", str(s), "0"), pool.packed.data)
    return time.perf_counter() - t


def measure(path: str, n: int, p: int, batch: int, pool: _Pool, chunk_rows: int | None, repeats: int) -> dict:
    """Best-of-``repeats`` total and that run's stages, µs per row."""
    best: dict | None = None
    for _ in range(repeats):
        folder = tempfile.mkdtemp(prefix="host_path_")
        spent: dict = defaultdict(float)
        try:
            with timed_stages(spent), _gram_precomputed(pool, spent):
                cpu = time.process_time()
                where = os.path.join(folder, "store")
                if path == "shard":
                    wall = run_shard(where, n, p, batch, pool, chunk_rows)
                elif path == "floor":
                    wall = run_floor(where, n, p, batch, pool, chunk_rows)
                else:
                    wall = run_traker(where, n, p, batch, pool, chunk_rows, write_behind=path == "traker-behind")
                cpu = time.process_time() - cpu
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        dev, dev_cpu = spent["device"], spent["cpu device"]  # the device's arithmetic, stood in for: not counted
        row = {"path": path, "batch": batch, "total": (wall - dev) / n * 1e6, "total cpu": (cpu - dev_cpu) / n * 1e6}
        for label in dict.fromkeys(s[0] for s in STAGES):
            if label in spent:
                less = (dev, dev_cpu) if label == PARTIAL_STAGE else (0.0, 0.0)
                row[label] = [(spent[label] - less[0]) / n * 1e6, (spent["cpu " + label] - less[1]) / n * 1e6]
        row[DEVICE_ROW] = [dev / n * 1e6, dev_cpu / n * 1e6]
        if best is None or row["total"] < best["total"]:
            best = row
    assert best is not None
    return best


def table(rows: list[dict]) -> str:
    labels = [label for label in dict.fromkeys(s[0] for s in STAGES) if any(label in r for r in rows)] + [DEVICE_ROW]
    head = "| stage (µs per row, wall / CPU) | " + " | ".join(f"{r['path']} b{r['batch']}" for r in rows) + " |"
    lines = [head, "|---" * (len(rows) + 1) + "|"]
    lines.append(
        "| **total** (wall / process CPU) | "
        + " | ".join(f"**{r['total']:.2f}** / {r['total cpu']:.2f}" for r in rows)
        + " |"
    )
    for label in labels:
        cells = [f"{r[label][0]:.2f} / {r[label][1]:.2f}" if label in r else "—" for r in rows]
        name = "· " + label.strip() if label.startswith(" ") else label
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=65536, help="train rows")
    ap.add_argument("--p", type=int, default=2048, help="proj_dim")
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 2048])
    paths = ["traker", "traker-behind", "shard", "floor"]
    ap.add_argument("--paths", nargs="+", default=paths, choices=paths)
    ap.add_argument("--chunk-rows", type=int, default=None, help="store chunk rows (default: the store's choice)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per cell; the best is reported")
    ap.add_argument("--pool", type=int, default=8192, help="rows of precomputed X cycled through")
    ap.add_argument("--threads", type=int, default=None, help="torch and BLAS threads (default: as they are)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: every code path")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.n, args.p, args.batches, args.repeats, args.pool, args.chunk_rows = 300, 64, [32, 128], 1, 256, 64
    limit = contextlib.nullcontext()
    if args.threads:
        from threadpoolctl import threadpool_limits

        torch.set_num_threads(args.threads)
        limit = threadpool_limits(args.threads)
    pool = _Pool(args.pool, args.p)
    with limit:
        rows = [
            measure(path, args.n, args.p, b, pool, args.chunk_rows, args.repeats)
            for path in args.paths
            for b in args.batches
        ]
    with open("/proc/loadavg") as fh:
        load = fh.read().split()[:3]
    print(f"n={args.n} proj_dim={args.p} float16, torch threads {torch.get_num_threads()}, loadavg {' '.join(load)}")
    print(table(rows))
    write_json(args.json, {"n": args.n, "p": args.p, "loadavg": load, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
