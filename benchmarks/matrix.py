"""The benchmark matrix (RESULTS.md, "The benchmark matrix" and "GPU session"): model families × sizes × proj_dim,
each cell in fresh processes through ``featurize_bench``'s worker (the same code as its table): the **floor**, traker
0.3.2's fastest (``BasicSingleBlockProjector`` where its matrix fits in ``--traker-max-gib``; on ``--device cuda``
also fast_jl's ``CudaProjector`` where it imports) and **trakflow**'s ``TRAKer`` defaults, cold and warm.

    .venv/bin/python benchmarks/matrix.py                       # the whole matrix (tens of minutes on 2 cores)
    .venv/bin/python benchmarks/matrix.py --models mlp3w --threads 1 --stat median --repeats 5

``--threads`` sets every worker's torch and BLAS threads; ``--stat median`` keeps each cell's median process
instead of its best (a shared machine); ``--curvatures xtx kfac``: the floor and TRAKer at each curvature, alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
import time

import bench_models
import featurize_bench as fb
from common import write_json

#: rows featurized per model (the large ones fewer: cost per row is what the table compares) and batch size
ROWS = {"resnet18": (256, 64), "gpt": (512, 64)}


def cells(a) -> list[dict]:
    out = []
    for m in a.models:
        n, bs = ROWS.get(m, (a.n, a.batch))
        d = sum(q.numel() for q in bench_models.make(m)[0].parameters())  # grad_dim
        for p in a.proj_dims:
            impls = ["floor", "factored"]
            if d * p * 4 <= a.traker_max_gib * 2**30:
                impls.append("traker-fastest")
            if a.device.startswith("cuda") and importlib.util.find_spec("fast_jl") is not None:
                impls.append("traker-fastjl")
            cell = dict(model=m, n=n, batch=bs, proj_dim=p, warm_runs=a.warm_runs, device=a.device)
            curv = [dict(cell, impl="factored", curvature=c) for c in a.curvatures or ()]  # with the floor, alone
            out += [dict(cell, impl="floor")] + curv if curv else [dict(cell, impl=i) for i in impls]
    return out


def _key(r: dict) -> tuple:
    return (r["model"], r["proj_dim"], r["impl"]) + ((r["curvature"],) if r.get("curvature") else ())


def curvature_table(res: dict, command: str) -> str:
    """``--curvatures``: each model's warm featurize + finalize at each curvature and proj_dim against its floor."""
    by, curv = {_key(r): r for r in res["cells"]}, res["curvatures"]
    dims = sorted({r["proj_dim"] for r in res["cells"]})
    lines = [f"| model | parameters | compression at {' / '.join(map(str, dims))} | floor s | "
             + " | ".join(f"{c}: s, × floor" for c in curv)
             + f" | peak MiB at {dims[-1]}: {' / '.join(curv)} |", "|---" * (5 + len(curv)) + "|"]  # fmt: skip
    for m in dict.fromkeys(k[0] for k in by):
        fl = [by[(m, p, "floor")]["warm_s"] for p in dims]
        rs = {c: [by[(m, p, "factored", c)] for p in dims] for c in curv}
        d = rs[curv[0]][0]["grad_dim"]
        cells = [" / ".join(f"{r['warm_s']:.2f}" for r in rs[c]) + ", " + " / ".join(
            f"{r['warm_s'] / f:.1f}×" for r, f in zip(rs[c], fl, strict=True)) for c in curv]  # fmt: skip
        peak = " / ".join(f"{rs[c][-1]['peak_rss_mib'] - rs[c][-1]['baseline_rss_mib']:.0f}" for c in curv)
        lines.append(f"| {bench_models.LABELS.get(m, m)} | {d:,} | {' / '.join(f'{d / p:,.0f}×' for p in dims)} | "
                     + " / ".join(f"{f:.2f}" for f in fl) + " | " + " | ".join(cells) + f" | {peak} |")  # fmt: skip
    return "\n".join([*lines, "", f"`{command}`: {res['seconds'] / 60:.1f} min, load {fb._load_range(res['cells'])}."])


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
    ap.add_argument("--curvatures", nargs="+", default=None, help="TRAKer at each, beside the floor")
    a = ap.parse_args()
    if a.threads:  # read by torch, OpenBLAS and MKL as each worker starts
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(a.threads)
    command = shlex.join([".venv/bin/python", "benchmarks/matrix.py", *sys.argv[1:]])
    t0 = time.perf_counter()
    runs = fb.interleaved(cells(a), a.repeats, 3600, _key)
    res = {"cells": [fb.best(v, a.stat) for v in runs.values()], "seconds": time.perf_counter() - t0}
    res["threads"], res["curvatures"] = a.threads, a.curvatures
    write_json(a.json, res)
    print((curvature_table if a.curvatures else table)(res, command))


if __name__ == "__main__":
    main()
