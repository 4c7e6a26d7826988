"""The benchmark matrix (RESULTS.md, "The benchmark matrix" and "GPU (H200)"): model families × sizes × proj_dim,
each cell in fresh processes through ``featurize_bench``'s worker (the same code as its table): the **floor**, traker
0.3.2's fastest (``BasicSingleBlockProjector`` where its matrix fits in ``--traker-max-gib``; on ``--device cuda``
also fast_jl's ``CudaProjector`` where it imports) and **trakflow**'s ``TRAKer`` defaults, cold and warm.

    .venv/bin/python benchmarks/matrix.py                       # the whole matrix (tens of minutes on 2 cores)
    .venv/bin/python benchmarks/matrix.py --models mlp3 --proj-dims 2048 --repeats 2
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
            impls = ["floor", "factored"]
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


def best(runs: list[dict]) -> dict:
    r = dict(runs[0])
    warms = [x for x in runs if x.get("warm_s") is not None]
    if warms:
        w = min(warms, key=lambda x: x["warm_s"])
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
    lines += [
        "",
        f"Produced by `{command}` ({res['seconds'] / 60:.1f} min; 1-min load average {min(loads):.2f}–"
        f"{max(loads):.2f} on {os.cpu_count()} cores).",
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
    a = ap.parse_args()
    command = shlex.join([".venv/bin/python", "benchmarks/matrix.py", *sys.argv[1:]])
    t0 = time.perf_counter()
    specs = cells(a)
    runs: dict = {}
    for _ in range(a.repeats):
        for spec in specs:
            r = fb.run_worker(spec, timeout=3600)
            runs.setdefault(_key(spec), []).append(r)
            keys = ("model", "proj_dim", "impl", "code", "cold_s", "warm_s")
            print(json.dumps({k: r.get(k) for k in keys}), flush=True)
    res = {"cells": [best(v) for v in runs.values()], "seconds": time.perf_counter() - t0}
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1, default=str)
    print(table(res, command))


if __name__ == "__main__":
    main()
