"""ImageNet-size on one machine: the attribute flow on 1,281,167 synthetic train rows.

What runs: ``flows.attribute.attribute`` (the thread runner, its default ``max_workers``) in this process, on

* **data**: synthetic rows generated deterministically per block of ``BLOCK_ROWS`` rows (row i depends only on
  its block and the seed, so a smaller run's rows are the first rows of the full run). The pipeline's data
  contract is a tuple of tensors in memory (``tasks.config.load_data`` / ``tasks.common.cached_data``), so the
  input is kept small: 32 float32 features + an int64 label per row (168 bytes: 215 MB at 1.28M rows);
  labels are the argmax of a fixed random linear "teacher" (100 classes);
* **model**: an MLP 32 → 256 → 100 (ReLU; 34,148 parameters), one checkpoint: a random-init state_dict
  (seed 0; TRAK's numbers need no trained model to measure cost);
* proj_dim 2048, float16 store, the default projector, 1,000 targets, everything else the pipeline's defaults
  unless given on the command line.

Measured: wall time per stage (plan, featurize, finalize, targets, score, from the stage-start events of
``tasks.progress`` seen in this process), the summed task seconds of each stage (from the manifests), the
process's RSS sampled every ``--sample`` seconds with psutil in a background thread and attributed to the
stage running at that moment (with the thread runner every task of a stage runs in this process, so a stage's
peak is what its concurrent tasks cost on top of the interpreter, torch, Prefect and the in-memory data), and
the store's size on disk per array (allocated blocks, as ``du``).

    .venv/bin/python benchmarks/imagenet_scale.py --rows 64064 --json /tmp/imagenet_scale_64k.json
    .venv/bin/python benchmarks/imagenet_scale.py --rows 1281167 --json /tmp/imagenet_scale_full.json
    .venv/bin/python benchmarks/imagenet_scale.py --extrapolate /tmp/imagenet_scale_full.json

``--extrapolate`` prints the tables of a finished run again, with the host XᵀX partial timed on this machine. The
extrapolation table scales the measured per-row costs to N workers and uses the per-row costs measured on one H100
(docs/gpu.md): it is arithmetic, not a measurement.

The store goes under ``--workdir`` (default /tmp/imagenet_scale) and is deleted afterwards (``--keep`` keeps it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

IMAGENET_ROWS = 1_281_167
BLOCK_ROWS = 65_536
IN_DIM, HIDDEN, CLASSES = 32, 256, 100
ROWS_ENV, TARGETS_ENV, SEED_ENV = "IMAGENET_SCALE_ROWS", "IMAGENET_SCALE_TARGETS", "IMAGENET_SCALE_SEED"
TARGET_SEED_OFFSET = 1_000_003  # targets come from other blocks than any train row
STAGES = ("plan", "featurize", "finalize", "targets", "score", "tail")


# ---------------------------------------------------------------------------- model and data (import paths)
def make_model() -> torch.nn.Module:
    """The benchmark's model: MLP 32 → 256 → 100."""
    return torch.nn.Sequential(torch.nn.Linear(IN_DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))


def _teacher(seed: int) -> torch.Tensor:
    return torch.randn(IN_DIM, CLASSES, generator=torch.Generator().manual_seed(seed + 7))


def synthetic_rows(n: int, seed: int = 0, first_block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x (n, 32) float32, y (n,) int64), filled block by block: block k's rows come from a generator seeded
    with (seed, first_block + k) only, so no more than one block is generated at a time beyond the result."""
    x = torch.empty(n, IN_DIM)
    y = torch.empty(n, dtype=torch.int64)
    w = _teacher(seed)
    for k, a in enumerate(range(0, n, BLOCK_ROWS)):
        b = min(a + BLOCK_ROWS, n)
        g = torch.Generator().manual_seed(seed * 1_000_000_007 + first_block + k)
        xb = torch.randn(BLOCK_ROWS, IN_DIM, generator=g)[: b - a]
        x[a:b] = xb
        y[a:b] = (xb @ w + 0.5 * torch.randn(b - a, CLASSES, generator=g)).argmax(dim=1)
    return x, y


def train_data() -> tuple[torch.Tensor, torch.Tensor]:
    """``IMAGENET_SCALE_ROWS`` train rows (default 1,281,167)."""
    return synthetic_rows(int(os.environ.get(ROWS_ENV, IMAGENET_ROWS)), int(os.environ.get(SEED_ENV, 0)))


def target_data() -> tuple[torch.Tensor, torch.Tensor]:
    """``IMAGENET_SCALE_TARGETS`` target rows (default 1,000), from blocks no train row uses."""
    return synthetic_rows(
        int(os.environ.get(TARGETS_ENV, 1000)), int(os.environ.get(SEED_ENV, 0)), first_block=TARGET_SEED_OFFSET
    )


# ---------------------------------------------------------------------------- measurement
class RssSampler:
    """Samples this process's RSS (and its children's) in a background thread; each sample is attributed to
    the stage named by the last ``tasks.progress`` start event (``plan`` before the first one)."""

    def __init__(self, interval: float = 0.05):
        import psutil

        self.proc = psutil.Process()
        self.interval = interval
        self.stage = "plan"
        self.t0 = time.perf_counter()
        self.starts: dict[str, float] = {"plan": 0.0}
        self.peak: dict[str, int] = {}
        self.at_start: dict[str, int] = {}
        self.children_peak = 0
        self.samples: list[tuple[float, str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def listener(self, kind: str, stage: str, amount: float) -> None:
        if kind == "start" and stage not in self.starts:
            self.at_start[stage] = self.proc.memory_info().rss
            self.starts[stage] = time.perf_counter() - self.t0
            self.stage = stage

    def mark(self, stage: str) -> None:
        self.listener("start", stage, 0)

    def _sample(self) -> None:
        rss = self.proc.memory_info().rss
        st = self.stage
        self.peak[st] = max(self.peak.get(st, 0), rss)
        t = time.perf_counter() - self.t0
        if not self.samples or t - self.samples[-1][0] >= 1.0:
            self.samples.append((round(t, 2), st, rss))
        try:
            kids = sum(c.memory_info().rss for c in self.proc.children(recursive=True))
            self.children_peak = max(self.children_peak, kids)
        except Exception:  # a child gone between the listing and the read
            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __enter__(self):
        self.at_start["plan"] = self.proc.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._sample()
        self._stop.set()
        self._thread.join()
        self.end = time.perf_counter() - self.t0


def du_bytes(path: str) -> int:
    """Allocated bytes under ``path`` (st_blocks · 512, as du)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def store_sizes(store: str) -> dict[str, int]:
    """Bytes on disk of each array of the store (paths relative to the store), and the total."""
    out: dict[str, int] = {}
    for root, _, files in os.walk(store):
        if "zarr.json" in files:
            with open(os.path.join(root, "zarr.json")) as fh:
                if json.load(fh).get("node_type") == "array":
                    out[os.path.relpath(root, store)] = du_bytes(root)
    out["total"] = du_bytes(store)
    return out


def machine() -> dict:
    import psutil

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg_before": os.getloadavg(),
    }


# ---------------------------------------------------------------------------- the run
def run(args) -> dict:
    os.environ[ROWS_ENV] = str(args.rows)
    os.environ[TARGETS_ENV] = str(args.targets)
    os.environ[SEED_ENV] = str(args.seed)
    work = os.path.abspath(args.workdir)
    if os.path.exists(work):
        shutil.rmtree(work)
    os.makedirs(work)
    os.environ.setdefault("PREFECT_HOME", os.path.join(work, "prefect_home"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no network here
    ckpt = os.path.join(work, "model_000.pt")
    torch.manual_seed(0)
    torch.save(make_model().state_dict(), ckpt)

    from flows.attribute import attribute
    from tasks import progress
    from tasks.config import AttributeConfig

    mod = "benchmarks.imagenet_scale"
    fields = dict(
        model=f"{mod}:make_model",
        train_data=f"{mod}:train_data",
        target_data=f"{mod}:target_data",
        checkpoints=[ckpt],
        store=os.path.join(work, "store"),
        proj_dim=args.proj_dim,
        dtype="float16",
        device="cpu",
        task_runner="thread",
        report_targets=0,
    )
    for name in ("batch_size", "shard_size"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    config = AttributeConfig(**fields)
    info = {"machine": machine(), "config": config.model_dump(mode="json"), "rows": args.rows, "targets": args.targets}
    print(f"config: {json.dumps({k: v for k, v in info['config'].items() if v is not None})}", flush=True)

    sampler = RssSampler(args.sample)
    progress.add_listener(sampler.listener)
    try:
        with sampler:
            result = attribute(config)
            sampler.mark("tail")
    finally:
        progress.remove_listener(sampler.listener)
    info["ru_maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    info["loadavg_after"] = os.getloadavg()

    # stage walls from the start events; the last one ends when the flow returned
    order = [s for s in STAGES if s in sampler.starts]
    ends = [sampler.starts[s] for s in order[1:]] + [sampler.end]
    walls = {s: e - sampler.starts[s] for s, e in zip(order, ends)}
    sc = result["score"]
    task_seconds = {
        "featurize": sum(m.seconds for m in result["featurize"]["manifests"]),
        "finalize": sum(m.seconds for m in result["finalize"]["manifests"]),
        "targets": sum(m.seconds for m in sc["targets"]["manifests"]),
        "score": sum(m.seconds for m in sc["blocks"]["manifests"]),
    }
    tasks = {
        "featurize": len(result["featurize"]["manifests"]),
        "finalize": len(result["finalize"]["manifests"]),
        "targets": len(sc["targets"]["manifests"]),
        "score": len(sc["blocks"]["manifests"]),
    }
    stages = {}
    for s in order:
        stages[s] = {
            "wall_s": round(walls[s], 2),
            "task_s": round(task_seconds.get(s, float("nan")), 2),
            "tasks": tasks.get(s),
            "peak_rss_mib": round(sampler.peak.get(s, 0) / 2**20, 1),
            "rss_at_start_mib": round(sampler.at_start.get(s, 0) / 2**20, 1),
        }
    info["stages"] = stages
    info["flow_seconds"] = result["seconds"]
    info["children_peak_rss_mib"] = round(sampler.children_peak / 2**20, 1)
    info["finalize_info"] = [m.info for m in result["finalize"]["manifests"]]
    info["store_bytes"] = store_sizes(config.store)
    info["rss_timeline"] = sampler.samples
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return info


def report(info: dict) -> str:
    n = info["rows"]
    lines = [
        f"n = {n:,} train rows, {info['targets']:,} targets; flow {info['flow_seconds']:.1f} s; "
        f"ru_maxrss {info['ru_maxrss_mib']:.0f} MiB; Prefect server (child process) peak "
        f"{info['children_peak_rss_mib']:.0f} MiB",
        "",
        "| stage | tasks | wall s | task s (sum) | task µs / row | RSS at start MiB | peak RSS MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for s, v in info["stages"].items():
        per = ""
        if s in ("featurize", "finalize", "score"):
            per = f"{1e6 * v['task_s'] / n:.1f}"
        elif s == "targets":
            per = f"{1e6 * v['task_s'] / info['targets']:.0f} (per target)"
        tasks = "" if v["tasks"] is None else v["tasks"]
        task_s = "" if v["task_s"] != v["task_s"] else f"{v['task_s']:.1f}"
        lines.append(
            f"| {s} | {tasks} | {v['wall_s']:.1f} | {task_s} | {per} | {v['rss_at_start_mib']:.0f} | "
            f"{v['peak_rss_mib']:.0f} |"
        )
    lines += ["", "| array | MiB on disk | bytes / train row |", "|---|---|---|"]
    for k, b in sorted(info["store_bytes"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {k} | {b / 2**20:,.0f} | {b / n:,.0f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- extrapolation (not measured)
#: per-row cost on one H100 in µs, (low, high), measured (docs/gpu.md "Measured on one H100"): featurize from the
#: sum of its measured stages (factored fast path 1.75 + XᵀX partial on the GPU 0.15 + pageable copy to the host 3.2 +
#: float16 Zarr write 5.3) to TRAKer's measured end-to-end featurize (2.58 s for 65,536 rows, float32 store);
#: finalize: the host's sum of the stored partials (4.0 µs per row measured on the CPU machine; a GPU does not help)
#: to twice that; score: the GEMM 0.09 + reading X 2.2, to that + writing the 1,000 scores at the write rate 5.3
H100_US_PER_ROW = {"featurize": (10.4, 39.4), "finalize": (4.0, 8.0), "score": (2.3, 7.6)}
#: float64 Cholesky + inverse at p = 2048 on the H100, measured (benchmarks/gpu_stages.py)
H100_SOLVE_S = 3.2e-3
#: stages with one task per (checkpoint, shard): N workers divide them; finalize and targets are one task per
#: checkpoint (one checkpoint here), so N workers do not shorten them
FANS_OUT = {"featurize": True, "finalize": False, "targets": False, "score": True}


def partial_seconds(
    shard_rows: int = 4096, p: int = 2048, repeats: int = 3, threads: int | None = None, dtype=None
) -> float:
    """Seconds of one shard's XᵀX partial as featurize computes it on the host (trak_core.reduce.shard_partial:
    float16 rows → float64, one syrk), best of ``repeats``, with ``threads`` BLAS threads (None: this process's
    setting; each of the pipeline's two concurrent featurize tasks runs with one). ``dtype=np.float32``: the
    alternative not adopted, a float32 syrk of the shard widened to float64 (see :func:`float32_partial_error`)."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    rows = np.random.default_rng(0).standard_normal((shard_rows, p)).astype(np.float16)
    best = float("inf")
    with threadpool_limits(limits=threads, user_api="blas"):
        for _ in range(repeats):
            t = time.perf_counter()
            x = rows.astype(dtype or np.float64)
            _ = (x.T @ x).astype(np.float64, copy=False)
            best = min(best, time.perf_counter() - t)
    return best


def float32_partial_error(shard_rows: int = 4096, p: int = 2048) -> float:
    """max |P₃₂ − P₆₄| / max |P₆₄| of a shard's partial from a float32 syrk against the float64 one (float16 rows:
    their products are exact in float32, only the float32 sums round)."""
    import numpy as np

    rows = np.random.default_rng(0).standard_normal((shard_rows, p)).astype(np.float16)
    x64, x32 = rows.astype(np.float64), rows.astype(np.float32)
    ref = x64.T @ x64
    return float(np.abs((x32.T @ x32).astype(np.float64) - ref).max() / np.abs(ref).max())


def _sec(x: float) -> str:
    return f"{x:.3g}" if x < 100 else f"{x:,.0f}"


def extrapolate(
    info: dict, n_full: int = IMAGENET_ROWS, workers=(1, 8, 64), partial_s: dict | None = None, f32=None
) -> str:
    """The table: measured per-row costs (stage wall / n on this machine) scaled to ``n_full`` rows on N machines
    like this one, and the per-row costs measured on one H100 (docs/gpu.md) on N H100 workers. Extrapolation, not
    measurement of N workers."""
    n = info["rows"]
    st = info["stages"]
    shard = info["config"]["shard_size"]
    head = " / ".join(f"N={k}" for k in workers)
    lines = [
        f"| stage | fans out over workers | measured here: µs per row (stage wall / n) | {n_full:,} rows on N "
        f"machines like this one ({head}), s | H100: µs per row (measured stages, docs/gpu.md) | {n_full:,} rows "
        f"on N H100 workers ({head}), s |",
        "|---|---|---|---|---|---|",
    ]
    tot_cpu = [0.0] * len(workers)
    tot_gpu = [[0.0, 0.0] for _ in workers]
    for s in ("featurize", "finalize", "targets", "score"):
        wall = st[s]["wall_s"]
        fan = FANS_OUT[s]
        if s == "targets":  # a fixed 1,000 rows: the same at any n
            cpu = [wall for _ in workers]
            per = f"{wall:.1f} s in all (1,000 targets)"
        else:
            per_row = wall / n
            cpu = [n_full * per_row / (k if fan else 1) for k in workers]
            per = f"{1e6 * per_row:.1f}"
        tot_cpu = [a + b for a, b in zip(tot_cpu, cpu)]
        if s in H100_US_PER_ROW:
            lo, hi = H100_US_PER_ROW[s]
            fixed = H100_SOLVE_S if s == "finalize" else 0.0
            gpu = [[n_full * c * 1e-6 / (k if fan else 1) + fixed for c in (lo, hi)] for k in workers]
            gper = f"{lo:g}–{hi:g}" + (f" + {H100_SOLVE_S * 1e3:g} ms solve" if s == "finalize" else "")
        else:
            gpu = [[0.0, 0.0] for _ in workers]
            gper = "~0 (1,000 rows)"
        tot_gpu = [[a[0] + b[0], a[1] + b[1]] for a, b in zip(tot_gpu, gpu)]
        lines.append(
            f"| {s} | {'yes' if fan else 'no (one task per checkpoint)'} | {per} | "
            + " / ".join(_sec(c) for c in cpu)
            + f" | {gper} | "
            + " / ".join(f"{_sec(g[0])}–{_sec(g[1])}" for g in gpu)
            + " |"
        )
    lines.append(
        "| **total (stages)** | | | "
        + " / ".join(f"**{_sec(c)}**" for c in tot_cpu)
        + " | | "
        + " / ".join(f"**{_sec(g[0])}–{_sec(g[1])}**" for g in tot_gpu)
        + " |"
    )
    if partial_s:
        task_us = 1e6 * st["featurize"]["task_s"] / n
        per = "; ".join(
            f"{k} BLAS thread{'s' if k > 1 else ''}: {v:.3f} s per shard = {1e6 * v / shard:.0f} µs per row"
            for k, v in sorted(partial_s.items())
        )
        lines += [
            "",
            f"Host-side XᵀX partial (float16 → float64 syrk of one {shard}-row shard, as featurize does it on a CPU "
            f"worker), timed alone on this machine: {per}. Each of the two concurrent featurize tasks runs it with "
            f"one thread: {100 * 1e6 * partial_s[min(partial_s)] / shard / task_us:.0f} % of the featurize task time "
            f"per row ({task_us:.0f} µs). A GPU worker computes it on its device instead (0.15 µs per row measured "
            "on an H100, docs/gpu.md).",
        ]
    if f32 is not None:
        sec, err = f32
        lines += [
            "",
            f"Not adopted: a float32 syrk of the shard widened to float64 takes {sec:.3f} s per shard with one thread "
            f"({1e6 * sec / shard:.0f} µs per row), max error {err:.1e} of the largest entry against float64 (the "
            "float16 rows' products are exact in float32; only its sums round).",
        ]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=IMAGENET_ROWS)
    ap.add_argument("--targets", type=int, default=1000)
    ap.add_argument("--proj-dim", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=None, help="default: the pipeline's")
    ap.add_argument("--shard-size", type=int, default=None, help="default: the pipeline's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample", type=float, default=0.05, help="RSS sampling interval, seconds")
    ap.add_argument("--workdir", default="/tmp/imagenet_scale")
    ap.add_argument("--keep", action="store_true", help="keep the store")
    ap.add_argument("--json", default=None)
    ap.add_argument("--extrapolate", default=None, metavar="JSON", help="print the tables of a finished run's JSON")
    args = ap.parse_args(argv)
    if args.extrapolate:
        with open(args.extrapolate) as fh:
            info = json.load(fh)
        import numpy as np

        timed = {k: partial_seconds(threads=k) for k in (1, 2)}
        f32 = (partial_seconds(threads=1, dtype=np.float32), float32_partial_error())
        print(report(info) + "\n\n" + extrapolate(info, partial_s=timed, f32=f32), flush=True)
        return
    info = run(args)
    print(report(info) + "\n\n" + extrapolate(info), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(info, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
