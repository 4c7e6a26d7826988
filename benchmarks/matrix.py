"""The benchmark matrix (RESULTS.md, "The benchmark matrix" and "GPU session"): model families × sizes × proj_dim,
each cell in fresh processes through ``featurize_bench``'s worker (the same code as its table): the **floor**, traker
0.3.2's fastest (``BasicSingleBlockProjector`` where its matrix fits in ``--traker-max-gib``; on ``--device cuda``
also fast_jl's ``CudaProjector`` where it imports) and **trakflow**'s ``TRAKer`` defaults, cold and warm.

    .venv/bin/python benchmarks/matrix.py                       # the whole matrix (tens of minutes on 2 cores)
    .venv/bin/python benchmarks/matrix.py --models mlp3 --proj-dims 2048 --repeats 2
    .venv/bin/python benchmarks/matrix.py --models mlp3w --threads 1 --stat median --repeats 5 --baseline /tmp/old

``--threads`` sets every worker's torch and BLAS threads; ``--stat median`` keeps each cell's median process
instead of its best (a shared machine); ``--baseline DIR`` also runs another checkout's trakflow (DIR/benchmarks/
featurize_bench.py, so DIR's trak_core) in the same interleaved loop and prints it beside this one's (before/after
a change: not a table of RESULTS.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_models  # noqa: E402
import featurize_bench as fb  # noqa: E402

#: rows featurized per model (the large ones fewer: cost per row is what the table compares) and batch size
ROWS = {"resnet18": (256, 64), "gpt": (512, 64)}


def grad_dim(name: str) -> int:
    model, _, _ = bench_models.make(name)
    return sum(p.numel() for p in model.parameters())


def cells(a) -> list[dict]:
    out = []
    for m in a.models:
        n, bs = ROWS.get(m, (a.n, a.batch))
        d = grad_dim(m)
        for p in a.proj_dims:
            impls = ["floor", "factored"] + (["baseline"] if a.baseline else [])
            if d * p * 4 <= a.traker_max_gib * 2**30:
                impls.append("traker-fastest")
            if a.device.startswith("cuda") and importlib.util.find_spec("fast_jl") is not None:
                impls.append("traker-fastjl")
            for i in impls:
                out.append(
                    {
                        "model": m,
                        "impl": i,
                        "n": n,
                        "batch": bs,
                        "proj_dim": p,
                        "warm_runs": a.warm_runs,
                        "device": a.device,
                    }
                )
    return out


def best(runs: list[dict], stat: str = "min") -> dict:
    """One cell from its processes: the best warm pass (``stat="median"``: the median process's), the best cold."""
    r = dict(runs[0])
    warms = sorted((x for x in runs if x.get("warm_s") is not None), key=lambda x: x["warm_s"])
    if warms:
        w = warms[0] if stat == "min" else warms[(len(warms) - 1) // 2]
        r.update({k: w[k] for k in ("warm_s", "warm", "train_s", "linalg_s") if k in w})
    colds = [x["cold_s"] for x in runs if x.get("cold_s") is not None]
    r["cold_s"] = min(colds) if colds else None
    r["load_avg"] = [v for x in runs for v in x.get("load_avg", [])]
    return r


def _key(r: dict) -> tuple:
    return (r["model"], r["proj_dim"], r["impl"])


def _vs(other: dict | None, r: dict) -> str:
    """'seconds | ratio | ' of another library's warm pass against trakflow's row."""
    if not other or other.get("warm_s") is None:
        return "— (not run) | — | "
    return f"{other['warm_s']:.2f} | {other['warm_s'] / r['warm_s']:.1f}× | "


def table(res: dict, command: str) -> str:
    by = {_key(r): r for r in res["cells"]}
    fj = any(k[2] == "traker-fastjl" for k in by)
    lines = [
        "| model | parameters | rows | proj_dim | floor s | trakflow warm s | × floor | cold/warm | "
        + "traker-fastest s | × traker | "
        + ("traker + fast_jl s | × traker + fast_jl | " if fj else "")
        + "warm split: set-up / featurize / finalize |",
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if fj else ""),
    ]
    for (m, p, impl), r in by.items():
        if impl != "factored":
            continue
        fl, tk = by.get((m, p, "floor")), by.get((m, p, "traker-fastest"))
        w = r["warm"] or {}
        fl_s = fl["warm_s"] if fl else None
        tk_s = tk["warm_s"] if tk else None
        lines.append(
            f"| {bench_models.LABELS.get(m, m)} | {r['grad_dim']:,} | {r['n']} | {p} | "
            f"{fl_s:.2f} | {r['warm_s']:.2f} | {r['warm_s'] / fl_s:.1f}× | {r['cold_s'] / r['warm_s']:.2f} | "
            + (f"{tk_s:.2f} | {tk_s / r['warm_s']:.1f}× | " if tk_s else "— (not run) | — | ")
            + (_vs(by.get((m, p, "traker-fastjl")), r) if fj else "")
            + f"{w.get('init_s', 0):.2f} / {w.get('featurize_s', 0):.2f} / {w.get('finalize_s', 0):.2f} |"
        )
    loads = [v for r in res["cells"] for v in r["load_avg"]]
    threads = res.get("threads")
    lines += [
        "",
        f"Produced by `{command}` ({res['seconds'] / 60:.1f} min; 1-min load average {min(loads):.2f}–"
        f"{max(loads):.2f} on {os.cpu_count()} cores"
        + (f"; {threads} torch and BLAS thread{'s' if threads > 1 else ''} per worker" if threads else "")
        + ").",
    ]
    return "\n".join(lines)


def baseline_table(res: dict) -> str:
    """This checkout's trakflow beside ``--baseline``'s, each against the floor and traker's fastest of the run."""
    by = {_key(r): r for r in res["cells"]}
    lines = [
        "| model | proj_dim | floor s | traker-fastest s | baseline s (× floor, × traker) | "
        "this s (× floor, × traker) | finalize: baseline / this |",
        "|---|---|---|---|---|---|---|",
    ]
    for (m, p, impl), r in by.items():
        if impl != "factored" or (m, p, "baseline") not in by:
            continue
        fl, tk, b = (
            by[(m, p, "floor")]["warm_s"],
            by.get((m, p, "traker-fastest"), {}).get("warm_s"),
            by[(m, p, "baseline")],
        )

        def cell(x: dict) -> str:
            s = x["warm_s"]
            return f"{s:.2f} ({s / fl:.1f}×, " + (f"{tk / s:.1f}×)" if tk else "—)")

        lines.append(
            f"| {bench_models.LABELS.get(m, m)} | {p} | {fl:.2f} | " + (f"{tk:.2f}" if tk else "—") + " | "
            f"{cell(b)} | {cell(r)} | {(b['warm'] or {}).get('finalize_s', 0):.2f} / "
            f"{(r['warm'] or {}).get('finalize_s', 0):.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(bench_models.LABELS))
    ap.add_argument("--proj-dims", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--n", type=int, default=2048, help="rows of the small models")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--device", default="cpu", help="cuda: every cell on the GPU")
    ap.add_argument("--repeats", type=int, default=1, help="fresh processes per cell, interleaved; best kept")
    ap.add_argument("--warm-runs", type=int, default=1)
    ap.add_argument("--traker-max-gib", type=float, default=4.0, help="largest traker matrix tried")
    ap.add_argument("--json", default=None, help="write the raw results here")
    ap.add_argument("--threads", type=int, default=None, help="torch and BLAS threads of every worker")
    ap.add_argument("--stat", choices=("min", "median"), default="min", help="of a cell's --repeats processes")
    ap.add_argument("--baseline", default=None, help="another checkout whose trakflow runs beside this one's")
    a = ap.parse_args()
    if a.threads:  # read by torch, OpenBLAS and MKL as each worker starts
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(a.threads)
    command = shlex.join([".venv/bin/python", "benchmarks/matrix.py", *sys.argv[1:]])
    t0 = time.perf_counter()
    specs = cells(a)
    runs: dict = {}
    for _ in range(a.repeats):
        for spec in specs:
            if spec["impl"] == "baseline":
                r = fb.run_worker({**spec, "impl": "factored"}, timeout=3600, tree=os.path.abspath(a.baseline))
                r["impl"] = "baseline"
            else:
                r = fb.run_worker(spec, timeout=3600)
            runs.setdefault(_key(spec), []).append(r)
            keys = ("model", "proj_dim", "impl", "code", "cold_s", "warm_s")
            print(json.dumps({k: r.get(k) for k in keys}), flush=True)
    res = {
        "cells": [best(v, a.stat) for v in runs.values()],
        "seconds": time.perf_counter() - t0,
        "threads": a.threads,
    }
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1, default=str)
    print(table(res, command))
    if a.baseline:
        print("\n" + baseline_table(res))


if __name__ == "__main__":
    main()
