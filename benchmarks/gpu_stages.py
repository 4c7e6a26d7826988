"""Per-row cost of each TRAK stage on one GPU, to check docs/gpu.md's on-paper table.

Each stage is timed on the device alone (inputs already there, CUDA-synchronized, the median of several
repeats after a warm-up), then the host side the pipeline adds (device → host copy of X, a Zarr write and
read of the float16 store):

* featurize: ``trak_core.featurize.Featurizer`` (loss weights Q + projected gradients X) per batch, for the
  factored projector (no per-example gradients) and for per-example gradients + cuda_ext's dense (tensor
  cores) and SJLT kernels, at batch 256 and 2,048;
* XᵀX: one n × p block, float32 GEMM and float64 syrk (what finalize accumulates);
* solve: Cholesky + inverse of the p × p matrix, float64 (once per checkpoint);
* scoring: X (A Gᵀ) for m targets from a float16 block (conversion included), float32;
* host: X to pinned / pageable host memory, and a float16 Zarr array written and read (CPU side).

    python3 benchmarks/gpu_stages.py --out $OUT/gpu_stages.md --json $OUT/gpu_stages.json
    python benchmarks/gpu_stages.py --device cpu --n 2048 --smoke     # every code path, tiny sizes

Per-row µs = stage seconds / rows · 10⁶. The model is featurize_bench.py's 407,050-parameter MLP.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]


def _timer(device: str):
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def timed(fn, reps: int, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        sync()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    return timed


def _row(stage: str, what: str, rows: int | None, s: float, batch: int | None = None) -> dict:
    per = None if rows is None else s / rows * 1e6
    return {"stage": stage, "what": what, "batch": batch, "rows": rows, "s": s, "us_per_row": per}


def _projectors(model, grad_dim: int, p: int, device: str, smoke: bool) -> dict:
    from trak_core.factored import FactoredProjector

    out = {"factored": FactoredProjector.from_model(model, p, 0, device=device)}
    if device.startswith("cuda"):
        from cuda_ext.projectors import CudaDenseProjector, CudaSJLTProjector

        out["dense (cuda_ext, auto)"] = CudaDenseProjector(grad_dim, p, 0, device=device)
        out["dense (cuda_ext, tc2)"] = CudaDenseProjector(grad_dim, p, 0, device=device, algo="tc2")
        out["sjlt c=4 (cuda_ext)"] = CudaSJLTProjector(grad_dim, p, 0, device=device, c=4)
    else:
        from trak_core.sjlt import SJLTProjector

        out["sjlt c=4 (trak_core)"] = SJLTProjector(grad_dim, p, 0, c=4, device=device)
    return out


def featurize_rows(device: str, n_rows: int, p: int, batches: list[int], reps: int, smoke: bool) -> list[dict]:
    from featurize_bench import make_data, make_model

    from trak_core.featurize import Featurizer

    timed = _timer(device)
    model, shape, kind = make_model("mlp400k")
    model.to(device)
    grad_dim = sum(q.numel() for q in model.parameters())
    rows = []
    for name, proj in _projectors(model, grad_dim, p, device, smoke).items():
        f = Featurizer(model, "image_classification", proj, device=device)
        f.load_state(model.state_dict())
        for bs in batches:
            x, y = make_data(shape, kind, bs)
            batch = [x.to(device), y.to(device)]
            idx = list(range(bs))

            def one(batch=batch, idx=idx, f=f):
                f.out_to_loss(batch, 0, idx)
                f.project_batch(batch, 0, idx)

            s = timed(one, reps)
            rows.append(_row("featurize", name, bs, s, batch=bs))
    return rows


def linalg_rows(device: str, n: int, p: int, m: int, reps: int) -> list[dict]:
    timed = _timer(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(n, p, generator=g).to(device)
    x16 = x.half()
    rows = []
    s = timed(lambda: x.T @ x, reps)
    rows.append(_row("XᵀX", "float32 GEMM", n, s))
    x64 = x.double()
    s = timed(lambda: x64.T @ x64, reps)
    rows.append(_row("XᵀX", "float64 GEMM", n, s))
    s = timed(lambda: x16.float().double().T @ x16.float().double(), reps)
    rows.append(_row("XᵀX", "float16 block → float64 GEMM", n, s))
    xtx = (x64.T @ x64) / n
    xtx.diagonal().add_(1e-3)

    def solve():
        c = torch.linalg.cholesky(xtx)
        return torch.cholesky_inverse(c)

    s = timed(solve, max(3, reps // 2))
    rows.append(_row("solve", f"float64 Cholesky + inverse, p = {p}", None, s))
    ag = torch.randn(p, m, generator=g).to(device)

    def score():
        return x16.float() @ ag

    s = timed(score, reps)
    rows.append(_row("scoring", f"float16 X → float32, X (A Gᵀ), m = {m}", n, s))
    return rows


def host_rows(device: str, n: int, p: int, reps: int) -> list[dict]:
    import numpy as np
    import zarr

    timed = _timer(device)
    x = torch.randn(n, p).to(device)
    rows = []
    if device.startswith("cuda"):
        pinned = torch.empty(n, p, dtype=torch.float16, pin_memory=True)
        x16 = x.half()
        s = timed(lambda: pinned.copy_(x16), reps)
        rows.append(_row("host", "X float16 device → pinned host", n, s))
        s = timed(lambda: x16.cpu(), reps)
        rows.append(_row("host", "X float16 device → pageable host", n, s))
    a = x.half().cpu().numpy()
    with tempfile.TemporaryDirectory() as tmp:
        z = zarr.create_array(
            os.path.join(tmp, "x.zarr"), shape=(n, p), chunks=(min(n, 2048), p), dtype="float16", compressors=None
        )
        t = time.perf_counter()
        z[:] = a
        w = time.perf_counter() - t
        t = time.perf_counter()
        back = z[:]
        r = time.perf_counter() - t
        assert np.array_equal(back, a)
    rows.append(_row("host", "Zarr write, float16, chunks of 2,048 rows", n, w))
    rows.append(_row("host", "Zarr read, float16", n, r))
    return rows


def env(device: str) -> dict:
    e = {"torch": torch.__version__, "python": platform.python_version(), "device": device}
    if device.startswith("cuda"):
        e["gpu"] = torch.cuda.get_device_name()
        e["torch_cuda"] = torch.version.cuda
        e["matmul_tf32"] = torch.backends.cuda.matmul.allow_tf32
    else:
        e["cpu_threads"] = torch.get_num_threads()
    return e


def table(rows: list[dict]) -> str:
    out = ["| stage | what | batch | rows | median s | µs per row |", "|---|---|---|---|---|---|"]
    for r in rows:
        per = "—" if r["us_per_row"] is None else f"{r['us_per_row']:.3f}"
        out.append(f"| {r['stage']} | {r['what']} | {r['batch'] or '—'} | {r['rows'] or '—'} | {r['s']:.5f} | {per} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n", type=int, default=65536, help="rows of the X block for XᵀX, scoring and the host rows")
    ap.add_argument("--proj-dim", type=int, default=2048)
    ap.add_argument("--targets", type=int, default=1000)
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script, measures nothing")
    ap.add_argument("--out")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.smoke:
        a.n, a.proj_dim, a.targets, a.batches, a.reps = min(a.n, 2048), 256, 16, [32], 2
    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    rows = featurize_rows(a.device, a.n, a.proj_dim, a.batches, a.reps, a.smoke)
    rows += linalg_rows(a.device, a.n, a.proj_dim, a.targets, a.reps)
    rows += host_rows(a.device, a.n, a.proj_dim, max(2, a.reps // 3))
    cmd = "python3 benchmarks/gpu_stages.py " + " ".join(sys.argv[1:])
    e = env(a.device)
    md = "\n".join(
        [
            f"Produced by `{cmd}` in {time.perf_counter() - t0:.0f} s.",
            "",
            "| key | value |",
            "|---|---|",
            *[f"| {k} | {v} |" for k, v in e.items()],
            "",
            table(rows),
        ]
    )
    print(md)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(md + "\n")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"env": e, "rows": rows, "command": cmd}, fh, indent=1)


if __name__ == "__main__":
    main()
