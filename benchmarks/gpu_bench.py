"""GPU projection benchmark: our kernels (cuda_ext) against fast_jl and cuBLAS, plus correctness vs the CPU.

Run on a CUDA machine from the repository root (the lent GPU of the `device` tool, see docs/gpu.md):

    pip install ninja            # if missing; fast_jl optional: pip install fast_jl --no-build-isolation
    python benchmarks/gpu_bench.py --out benchmarks/gpu_bench_results.md

It prints (and writes with --out) a markdown report:
1. the environment (GPU, SM count, driver, torch/CUDA/nvcc versions, fast_jl version, the command line);
2. correctness: each GPU path against the CPU definition (trak_core) for several shapes, including
   grad_dim × batch > 2**31 (32 × 70M, float16, sparse x so the exact answer is cheap on the CPU),
   as max |gpu − exact| / max |exact|, and whether two runs are bit-identical;
3. throughput at proj_dim 2048 and a ResNet-18-sized grad_dim (11,689,512) for batch 32, 64, 128:
   our dense kernels (fma, tc3, tc2, tc1; float32 and float16 inputs), the normal kind, SJLT, the build-free
   torch path, fast_jl (project_rademacher_*, if importable, float16 and float32 inputs, num_sms feature
   tiles as traker passes), and cuBLAS with a materialized matrix (float32 and bf16; measured on a row slice
   that fits in memory and scaled to grad_dim, which the table says).
Times are medians of CUDA-event timings after warm-up; throughput is examples/s and effective TFLOP/s
(2·B·grad_dim·proj_dim / t).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
try:
    import trak_core  # noqa: F401
except ImportError:  # a Python without the pipeline's dependencies (zarr, pydantic): pure-torch modules only
    _pkg = types.ModuleType("trak_core")
    _pkg.__path__ = [str(ROOT / "trak_core")]
    sys.modules["trak_core"] = _pkg

import cuda_ext  # noqa: E402
from cuda_ext import _build, torch_path  # noqa: E402
from cuda_ext.projectors import CudaDenseProjector, CudaSJLTProjector  # noqa: E402
from trak_core import counter_rng  # noqa: E402
from trak_core.projectors import DenseProjector  # noqa: E402

RESNET18_PARAMS = 11_689_512
# --smoke-cpu runs every code path of this script at toy sizes on the CPU (our projectors on their torch
# backend): a check of the script itself, before spending GPU time on it
DEV = "cuda"
BACKEND = "auto"


def dense(*a, **k):
    return CudaDenseProjector(*a, device=DEV, backend=BACKEND, **k)


def sjlt(*a, **k):
    return CudaSJLTProjector(*a, device=DEV, backend=BACKEND, **k)


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def free_bytes() -> int:
    return torch.cuda.mem_get_info()[0] if DEV == "cuda" else 64 * 2**30


def tc_available() -> bool:
    return DEV == "cpu" or torch.cuda.get_device_capability() >= (8, 0)


# ------------------------------------------------------------------------------------------- helpers
def sh(cmd: str) -> str:
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60).stdout.strip()
    except Exception as e:  # pragma: no cover
        return f"({e})"


def environment() -> dict:
    if DEV == "cpu":
        props = types.SimpleNamespace(
            name=f"CPU smoke run ({platform.processor() or platform.machine()})",
            major=0,
            minor=0,
            multi_processor_count=os.cpu_count(),
            total_memory=0,
        )
    else:
        props = torch.cuda.get_device_properties(0)
    env = {
        "gpu": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "driver": sh("nvidia-smi --query-gpu=driver_version --format=csv,noheader"),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nvcc": sh("nvcc --version | tail -2 | head -1") if shutil.which("nvcc") else "not found",
        "python": platform.python_version(),
        "cuda_ext_sources": _build.source_digest(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
    }
    try:
        from importlib.metadata import version

        import fast_jl  # noqa: F401

        env["fast_jl"] = version("fast_jl")
    except Exception as e:
        env["fast_jl"] = f"not available ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    return env


def cuda_time(fn, reps: int, warmup: int = 2) -> float:
    """Median seconds of fn() over reps (CUDA events), after warm-up."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        if DEV == "cpu":
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def rel_err(out, ref) -> float:
    ref = ref.double().cpu()
    return float((out.double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def empty_cache() -> None:
    if DEV == "cuda":
        torch.cuda.empty_cache()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- correctness
def correctness(args) -> str:
    rows = []
    algos = ["fma"] + (["tc3", "tc2", "tc1"] if tc_available() else [])
    shapes = ((1000, 1000, 1), (4097, 2047, 7), (70001, 512, 33), (33000, 100, 100), (100_000, 2048, 32))
    for grad_dim, proj_dim, batch in shapes[:2] if DEV == "cpu" else shapes:
        x = torch.randn(batch, grad_dim, generator=torch.Generator().manual_seed(grad_dim))
        for kind in ("rademacher", "normal"):
            mat = DenseProjector(grad_dim, proj_dim, seed=1, proj_type=kind).matrix(3).double()
            exact = x.double() @ mat
            del mat
            cpu = DenseProjector(grad_dim, proj_dim, seed=1, proj_type=kind).project(x, 3)
            rows.append(
                [
                    f"{grad_dim}×{proj_dim}, B={batch}",
                    f"dense {kind}",
                    "CPU float32 (trak_core)",
                    f"{rel_err(cpu, exact):.1e}",
                    "—",
                ]
            )
            for algo in algos if kind == "rademacher" else ["fma"]:
                p = dense(grad_dim, proj_dim, seed=1, proj_type=kind, algo=algo)
                out = p.project(x.to(DEV), 3)
                same = torch.equal(out, p.project(x.to(DEV), 3))
                rows.append(
                    [
                        f"{grad_dim}×{proj_dim}, B={batch}",
                        f"dense {kind}",
                        f"kernel {algo}",
                        f"{rel_err(out, exact):.1e}",
                        "yes" if same else "NO",
                    ]
                )
        for c in (1, 4):
            exact = torch_path.sjlt_reference(x, 1, 3, proj_dim, c)
            p = sjlt(grad_dim, proj_dim, seed=1, c=c)
            out = p.project(x.to(DEV), 3)
            same = torch.equal(out, p.project(x.to(DEV), 3))
            rows.append(
                [
                    f"{grad_dim}×{proj_dim}, B={batch}",
                    f"sjlt c={c}",
                    "kernel",
                    f"{rel_err(out, exact):.1e}",
                    "yes" if same else "NO",
                ]
            )
        log(f"correctness {grad_dim}x{proj_dim} B={batch} done")
    if not args.skip_big:
        rows += correctness_big(algos, *((32, 70_000_000, 2048) if DEV == "cuda" else (4, 3000, 64)))
    return md_table(
        ["shape (grad_dim×proj_dim, batch)", "matrix", "path", "max rel. error vs exact", "2 runs bit-identical"], rows
    )


def correctness_big(algos, batch, grad_dim, proj_dim) -> list[list]:
    """grad_dim × batch > 2**31: 32 × 70M float16 with a few nonzeros (some beyond flat index 2**31)."""
    if free_bytes() < 12 * 2**30:
        return [[f"{grad_dim}×{proj_dim}, B={batch}", "—", "skipped", "needs 12 GB free", "—"]]
    x = torch.zeros(batch, grad_dim, dtype=torch.float16, device=DEV)
    spots = [
        (0, 0, 1.0),
        (0, grad_dim - 1, -2.0),
        (batch - 1, grad_dim - 1, 0.5),
        (batch - 1, 1234, 3.0),
        (batch // 2, grad_dim // 3 + 7, -1.5),
        (batch - 2, grad_dim // 2, 2.5),
    ]
    for b, i, v in spots:
        x[b, i] = v
    label = f"{grad_dim:,}×{proj_dim}, B={batch} (B·K = {batch * grad_dim / 2**31:.2f}·2³¹), fp16, sparse x"
    rows = []
    for what in algos + ["normal", "sjlt"]:
        exact = torch.zeros(batch, proj_dim, dtype=torch.float64)
        for b, i, v in spots:
            if what == "sjlt":
                row = torch_path.sjlt_reference(torch.ones(1, 1), 1, 0, proj_dim, 2, row0=i)[0]
            elif what == "normal":
                row = counter_rng.normal_block(1, 0, i, i + 1, proj_dim)[0].double()
            else:
                row = counter_rng.rademacher_block(1, 0, i, i + 1, proj_dim)[0].double()
            exact[b] += v * row
        if what == "sjlt":
            p = sjlt(grad_dim, proj_dim, seed=1, c=2)
        elif what == "normal":
            p = dense(grad_dim, proj_dim, seed=1, proj_type="normal", algo="fma")
        else:
            p = dense(grad_dim, proj_dim, seed=1, algo=what)
        out = p.project(x if DEV == "cuda" else x.float(), 0)
        same = torch.equal(out, p.project(x if DEV == "cuda" else x.float(), 0))
        rows.append(
            [
                label,
                "sjlt c=2" if what == "sjlt" else f"dense {'normal' if what == 'normal' else 'rademacher'}",
                f"kernel {'fma' if what == 'normal' else '' if what == 'sjlt' else what}".strip(),
                f"{rel_err(out, exact):.1e}",
                "yes" if same else "NO",
            ]
        )
        del p
        empty_cache()
        log(f"big correctness {what} done")
    # dense x, proj_dim 64: the kernels against the torch path (the same matrix generated by torch ops)
    xd = torch.randn(batch, grad_dim, dtype=torch.float16, device=DEV)
    ref = torch_path.dense_project(xd, "rademacher", 1, 0, 64)
    for algo in algos:
        out = dense(grad_dim, 64, seed=1, algo=algo).project(xd if DEV == "cuda" else xd.float(), 0)
        rows.append(
            [
                f"{grad_dim:,}×64, B={batch}, fp16, dense x",
                "dense rademacher",
                f"kernel {algo} vs torch path",
                f"{rel_err(out, ref):.1e}",
                "—",
            ]
        )
    del x, xd
    empty_cache()
    return rows


# ------------------------------------------------------------------------------------------- throughput
def throughput(args, env) -> tuple[str, list[dict]]:
    grad_dim, proj_dim = args.grad_dim, args.proj_dim
    tc_ok = tc_available()
    results: list[dict] = []

    def record(name, batch, dtype, t, note=""):
        flops = 2.0 * batch * grad_dim * proj_dim
        results.append(
            {
                "impl": name,
                "batch": batch,
                "input": str(dtype).replace("torch.", ""),
                "ms": t * 1e3,
                "examples_per_s": batch / t,
                "tflops": flops / t / 1e12,
                "note": note,
            }
        )
        log(f"{name:28s} B={batch:4d} {str(dtype):14s} {t * 1e3:10.2f} ms  {note}")

    for batch in args.batches:
        x32 = torch.randn(batch, grad_dim, device=DEV)
        x16 = x32.half() if DEV == "cuda" else x32.bfloat16()
        # ours, dense Rademacher
        for algo in ["fma"] + (["tc3", "tc2", "tc1"] if tc_ok else []):
            p = dense(grad_dim, proj_dim, seed=0, algo=algo)
            for x in (x32, x16):
                record(f"cuda_ext dense {algo}", batch, x.dtype, cuda_time(lambda p=p, x=x: p.project(x, 0), args.reps))
        p = dense(grad_dim, proj_dim, seed=0, proj_type="normal")
        record(
            "cuda_ext dense normal fma",
            batch,
            x32.dtype,
            cuda_time(lambda p=p, x32=x32: p.project(x32, 0), max(1, args.reps // 2)),
        )
        for c in (1, 4):
            s = sjlt(grad_dim, proj_dim, seed=0, c=c)
            t0 = time.perf_counter()
            s.plan(0)
            sync()
            plan_s = time.perf_counter() - t0
            record(
                f"cuda_ext sjlt c={c}",
                batch,
                x32.dtype,
                cuda_time(lambda s=s, x32=x32: s.project(x32, 0), args.reps),
                f"plan built once per model: {plan_s * 1e3:.0f} ms",
            )
            del s
        # build-free torch path (one timed run: it regenerates the whole matrix)
        if not args.skip_torch_path and batch == args.batches[0]:
            p = CudaDenseProjector(grad_dim, proj_dim, seed=0, device=DEV, backend="torch")
            record(
                "torch path (no build)",
                batch,
                x32.dtype,
                cuda_time(lambda p=p, x32=x32: p.project(x32, 0), 1, warmup=0),
            )
        # fast_jl
        try:
            import fast_jl

            fn = getattr(fast_jl, f"project_rademacher_{min(32, 8 if batch <= 8 else 16 if batch <= 16 else 32)}")
            sms = env["sm_count"]
            for x in (x16, x32):
                record(
                    "fast_jl rademacher",
                    batch,
                    x.dtype,
                    cuda_time(lambda fn=fn, x=x, sms=sms: fn(x, proj_dim, 0, sms), args.reps),
                    f"num_feature_tiles={sms}",
                )
        except ImportError:
            pass
        except Exception as e:  # report, do not stop the run
            results.append(
                {
                    "impl": "fast_jl rademacher",
                    "batch": batch,
                    "input": "-",
                    "ms": float("nan"),
                    "examples_per_s": float("nan"),
                    "tflops": float("nan"),
                    "note": f"failed: {str(e).splitlines()[0][:150]}",
                }
            )
        del x16
        # cuBLAS with a materialized matrix (generated by our kernel), on a row slice, scaled to grad_dim
        for mdt in (torch.float32, torch.bfloat16):
            bytes_per_row = proj_dim * (4 if mdt == torch.float32 else 2)
            rows = min(grad_dim, int(0.6 * free_bytes() / bytes_per_row), args.cublas_rows)
            gen = dense(grad_dim, proj_dim, seed=0, algo="fma")
            mat = torch.empty(rows, proj_dim, dtype=mdt, device=DEV)
            step = 1 << 18
            for r0 in range(0, rows, step):
                mat[r0 : min(r0 + step, rows)] = gen.generate(0, r0, min(r0 + step, rows)).to(mdt)
            xs = x32[:, :rows].to(mdt).contiguous()
            prev = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = False
            t = cuda_time(lambda xs=xs, mat=mat: xs @ mat, args.reps) * grad_dim / rows
            torch.backends.cuda.matmul.allow_tf32 = prev
            note = "full matrix" if rows == grad_dim else f"measured on {rows:,} rows, scaled ×{grad_dim / rows:.2f}"
            record(f"cuBLAS materialized {str(mdt).replace('torch.', '')}", batch, mdt, t, note)
            del mat, xs
            empty_cache()
        del x32
        empty_cache()

    fj = {r["batch"]: r["ms"] for r in results if r["impl"] == "fast_jl rademacher" and r["input"] == "float16"}
    rows = []
    for r in results:
        ref = fj.get(r["batch"])
        speed = f"{ref / r['ms']:.2f}×" if ref and r["ms"] == r["ms"] else "—"
        rows.append(
            [
                r["impl"],
                r["batch"],
                r["input"],
                f"{r['ms']:.2f}",
                f"{r['examples_per_s']:,.0f}",
                f"{r['tflops']:.1f}",
                speed,
                r["note"],
            ]
        )
    table = md_table(
        [
            "implementation",
            "batch",
            "input",
            "ms / batch",
            "examples/s",
            "eff. TFLOP/s",
            "vs fast_jl (fp16 input)",
            "note",
        ],
        rows,
    )
    return table, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grad-dim", type=int, default=RESNET18_PARAMS)
    ap.add_argument("--proj-dim", type=int, default=2048)
    ap.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")], default=[32, 64, 128])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cublas-rows", type=int, default=1 << 22, help="rows of the materialized matrix at most")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--skip-big", action="store_true", help="skip the grad_dim × batch > 2**31 checks")
    ap.add_argument("--skip-torch-path", action="store_true")
    ap.add_argument("--out", help="write the markdown report here too")
    ap.add_argument("--json", help="write the raw throughput numbers here")
    ap.add_argument(
        "--smoke-cpu",
        action="store_true",
        help="run every code path at toy sizes on the CPU (torch backend): checks the script, measures nothing",
    )
    args = ap.parse_args()

    global DEV, BACKEND
    if args.smoke_cpu:
        DEV, BACKEND = "cpu", "torch"
        args.grad_dim, args.proj_dim, args.batches, args.reps = 5000, 256, [3, 8], 1
        env = environment()
        parts = [
            "# gpu_bench smoke run on the CPU (torch backend; no measurement)",
            "",
            md_table(["key", "value"], [[k, v] for k, v in env.items()]),
            "",
            correctness(args),
            "",
            throughput(args, env)[0],
        ]
        print("\n".join(parts))
        return
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device visible; nothing to measure (run this on a GPU machine, see docs/gpu.md)")
        sys.exit(2)
    t_build = time.perf_counter()
    if cuda_ext.load_extension() is None:
        print(f"gpu_bench: the CUDA kernels did not build: {cuda_ext.unavailable_reason()}")
        sys.exit(3)
    build_s = time.perf_counter() - t_build
    env = environment()
    env["extension_load_s"] = round(build_s, 1)
    log(json.dumps(env, indent=1))

    parts = [
        "# GPU projection benchmark (cuda_ext)",
        "",
        "## Environment",
        "",
        md_table(["key", "value"], [[k, v] for k, v in env.items()]),
        "",
    ]
    if not args.skip_correctness:
        parts += ["## Correctness against the CPU definition", "", correctness(args), ""]
    table, results = throughput(args, env)
    parts += [f"## Throughput: grad_dim {args.grad_dim:,}, proj_dim {args.proj_dim}", "", table, ""]
    report = "\n".join(parts)
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "throughput": results}, indent=1))


if __name__ == "__main__":
    main()
