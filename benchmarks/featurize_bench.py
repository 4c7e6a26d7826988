"""Featurize + finalize side by side (RESULTS.md, "Speed against the floor and traker"): the floor, traker 0.3.2
(default and fastest CPU configurations) and trakflow's projectors, cold (first use in a fresh process) and warm
(steady state), each row in ``--repeats`` fresh processes interleaved in time, best kept.

    .venv/bin/python benchmarks/featurize_bench.py --repeats 2      # writes its section of benchmarks/RESULTS.md

Rows: **floor** (a training pass over the same N examples + finalize's float32 XᵀX, Cholesky, inverse and Φ = X A);
**traker** (its CPU default, ``BasicProjector``, regenerating its matrix per batch); **traker-fastest**
(``BasicSingleBlockProjector``, the matrix generated once and kept); **traker-fastjl** (``CudaProjector``, on a
GPU); trakflow's ``factored`` (the default), ``factored@<λ>`` (a fixed λ: 0 is refused where proj_dim ≥ n),
``pipeline`` (the pipeline's task functions). The report's paragraph below the table says what each pass includes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import shlex
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [p for p in (ROOT, HERE) if p not in sys.path]

START, END = "<!-- featurize_bench:start -->", "<!-- featurize_bench:end -->"

# the models and their data live in bench_models.py (re-exported here: the tests and matrix.py's workers use them)
from bench_models import TRANSFORMER, make_data, make_model  # noqa: E402,F401
from common import cpu_name, fresh_json, write_json, write_section  # noqa: E402

MODEL_LABEL = {
    "mlp400k": "MLP 784-512-10",
    "convnet": "ConvNet 3×32×32 (2 conv + linear)",
    "transformer": "Transformer text classifier (embeddings + 2 encoder layers + head)",
}
IMPL_LABEL = {
    "floor": "**floor** (training pass + float32 XᵀX, Cholesky inverse, X·A)",
    "traker": "traker 0.3.2, default (BasicProjector, normal, regenerated per batch)",
    "traker-fastest": "traker 0.3.2, fastest (BasicSingleBlockProjector, matrix kept)",
    "traker-fastjl": "traker 0.3.2, GPU default (CudaProjector: fast_jl)",
    "factored": "trakflow — factored (default)",
    "factored@0": "trakflow — factored, lambda_reg=0 (traker's damping)",
    "pipeline": "trakflow pipeline tasks (featurize_shard + finalize_checkpoint), factored",
}


# ---------------------------------------------------------------------------- one row, in a fresh process
def _pass_times(t0: float, t1: float, t2: float, t3: float, feats) -> dict:
    """One pass's stage times (init, featurize, finalize) and whether its features (an array) are finite."""
    import numpy as np

    return {
        "init_s": t1 - t0,
        "featurize_s": t2 - t1,
        "finalize_s": t3 - t2,
        "total_s": t3 - t0,
        "finite": bool(np.isfinite(feats).all()),
    }


def _result(spec: dict, projector: str, grad_dim: int, passes: list[dict], **extra) -> dict:
    """A worker's result: its cold pass (the first) and its best warm pass (None without one)."""
    warm = min(passes[1:], key=lambda r: r["total_s"]) if len(passes) > 1 else None
    cold_s, warm_s = passes[0]["total_s"], warm["total_s"] if warm else None
    return {**spec, "projector": projector, "grad_dim": grad_dim, "passes": passes, "cold": passes[0], "warm": warm,
            "cold_s": cold_s, "warm_s": warm_s, **extra}  # fmt: skip


def floor_worker(spec: dict) -> dict:
    """A training pass + finalize's float32 linear algebra, warm, best of ``reps``."""
    import torch

    dev = spec.get("device", "cpu")
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    model, shape, kind = make_model(spec["model"])
    model.train().to(dev)
    n, bs, p = spec["n"], spec["batch"], spec["proj_dim"]
    x, y = (v.to(dev) for v in make_data(shape, kind, n))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    xg = torch.randn(n, p, generator=torch.Generator().manual_seed(2)).to(dev)
    train, linalg = [], []
    for _ in range(spec.get("reps", 3) + 1):  # the first of each is a warm-up
        t = time.perf_counter()
        for a in range(0, n, bs):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x[a : a + bs]), y[a : a + bs]).backward()
            opt.step()
        sync()
        train.append(time.perf_counter() - t)
        t = time.perf_counter()
        xtx = xg.T @ xg
        xtx.diagonal().add_(1e-3 * float(xtx.diagonal().mean()))  # n = p: keep it positive definite
        chol = torch.linalg.cholesky(xtx)
        a_inv = torch.cholesky_inverse(chol)
        phi = xg @ a_inv
        sync()
        linalg.append(time.perf_counter() - t)
        assert torch.isfinite(phi).all()
    tr, la = min(train[1:]), min(linalg[1:])
    return {
        **spec,
        "grad_dim": sum(q.numel() for q in model.parameters()),
        "train_s": tr,
        "linalg_s": la,
        "warm_s": tr + la,
        "cold_s": None,
    }


def worker(spec: dict) -> dict:
    """Cold pass, then ``warm_runs`` warm passes, of one library/projector (in a fresh process)."""
    import numpy as np

    if spec["impl"] == "floor":
        return floor_worker(spec)
    if spec["impl"] == "pipeline":
        return pipeline_worker(spec)
    warnings.simplefilter("ignore")
    impl, _, lam = spec["impl"].partition("@")  # "factored@0": TRAKer with lambda_reg=0
    dev = spec.get("device", "cpu")
    model, shape, kind = make_model(spec["model"])
    model.to(dev)
    n, bs, p = spec["n"], spec["batch"], spec["proj_dim"]
    x, y = (v.to(dev) for v in make_data(shape, kind, n))  # on the device for both (traker does not move them)
    grad_dim = sum(q.numel() for q in model.parameters())
    kept = {}
    passes = []
    # the library is imported before the cold pass: cold = first use in the process, not first import
    if impl.startswith("traker"):
        import trak as lib
    else:
        import trak_core as lib
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(1 + spec["warm_runs"]):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            # traker: its default lambda_reg (0); trakflow: its default ('adaptive') unless the row names one
            kw = {"lambda_reg": 0.0} if impl.startswith("traker") else {"lambda_reg": float(lam)} if lam else {}
            kw.update({"curvature": spec["curvature"]} if spec.get("curvature") else {})  # matrix.py --curvatures
            if impl == "traker-fastest":
                from trak.projectors import BasicSingleBlockProjector, ProjectionType

                if "proj" not in kept:  # generated once (in the cold pass), then kept
                    kept["proj"] = BasicSingleBlockProjector(grad_dim, p, 0, ProjectionType.rademacher, dev)
                    # traker frees the matrix after finalize (and never regenerates it for the same
                    # model_id): keep it, as this configuration means
                    kept["proj"].free_memory = lambda: None
                kw["projector"] = kept["proj"]
            elif impl == "traker-fastjl":
                from trak.projectors import CudaProjector, ProjectionType

                # traker's own choice on a GPU (max_batch_size 32: its TRAKer's default)
                kw["projector"] = CudaProjector(grad_dim, p, 0, ProjectionType.rademacher, dev, 32)
            tr = lib.TRAKer(
                model=model,
                task="image_classification",
                train_set_size=n,
                save_dir=os.path.join(tmp, "s"),
                device=dev,
                proj_dim=p,
                use_half_precision=False,
                logging_level=logging.ERROR,
                **kw,
            )
            t1 = time.perf_counter()
            tr.load_checkpoint(model.state_dict(), model_id=0)
            if spec.get("curvature") == "kfac-eigen":  # its factors before its rows: the fit counts as featurizing
                tr.fit_curvature([(x[a : a + bs], y[a : a + bs]) for a in range(0, n, bs)])
            for a in range(0, n, bs):
                b = min(a + bs, n)
                tr.featurize((x[a:b], y[a:b]), num_samples=b - a)
            t2 = time.perf_counter()
            tr.finalize_features()
            t3 = time.perf_counter()
            if impl.startswith("traker"):
                feats = np.asarray(tr.saver.current_store["features"][:n], dtype=np.float32)
            else:
                feats = tr.features(0, 0, n)  # Φ = X A on demand (the store keeps the inverse, not Φ)
            passes.append(_pass_times(t0, t1, t2, t3, feats))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return _result(
        spec,
        type(tr.projector).__name__,
        grad_dim,
        passes,
        peak_rss_mib=peak / 1024,
        baseline_rss_mib=base / 1024,
        code=os.path.dirname(os.path.abspath(lib.__file__)),
    )


def pipe_model():
    """The pipeline config's ``model``: the bench model the worker names (the config imports this module
    anew, so the choice travels in the environment)."""
    return make_model(os.environ["FEATURIZE_BENCH_MODEL"])[0]


def pipe_data():
    """The pipeline config's ``train_data`` / ``target_data``."""
    _, shape, kind = make_model(os.environ["FEATURIZE_BENCH_MODEL"])
    return make_data(shape, kind, int(os.environ["FEATURIZE_BENCH_N"]))


def pipeline_worker(spec: dict) -> dict:
    """Cold pass, then ``warm_runs`` warm passes, through the pipeline's task functions in this process (what
    one worker runs; no flow orchestration): ``make_plan`` (validate, fingerprint, create the store), then
    ``featurize_shard`` for each shard (builds the featurizer from the config and the checkpoint file, featurizes
    in batches, one store write and the XᵀX partial per shard) and ``finalize_checkpoint`` — the pipeline's
    defaults otherwise (factored projector, lambda_reg 'adaptive'), float32 store like the TRAKer rows."""
    import torch

    from tasks.config import AttributeConfig
    from tasks.core import featurize_shard, finalize_checkpoint, make_plan, open_store
    from trak_core.solve.reduce import features_rows

    warnings.simplefilter("ignore")
    os.environ["FEATURIZE_BENCH_MODEL"], os.environ["FEATURIZE_BENCH_N"] = spec["model"], str(spec["n"])
    model = pipe_model()
    passes = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "model_0.pt")
        torch.save(model.state_dict(), ckpt)
        for i in range(1 + spec["warm_runs"]):
            cfg = AttributeConfig(
                model="featurize_bench:pipe_model",
                train_data="featurize_bench:pipe_data",
                target_data="featurize_bench:pipe_data",
                checkpoints=[ckpt],
                store=os.path.join(tmp, f"store{i}"),
                proj_dim=spec["proj_dim"],
                dtype="float32",
                batch_size=spec["batch"],
                device=spec.get("device", "cpu"),
                report_targets=0,
            )
            t0 = time.perf_counter()
            plan = make_plan(cfg)
            t1 = time.perf_counter()
            for shard in range(plan.num_shards):
                featurize_shard(cfg, 0, ckpt, shard)
            t2 = time.perf_counter()
            finalize_checkpoint(cfg, 0)
            t3 = time.perf_counter()
            feats = features_rows(open_store(cfg), 0, 0, spec["n"])
            lam = open_store(cfg).finalize_info(0)["lambda_reg"]
            passes.append({**_pass_times(t0, t1, t2, t3, feats), "lambda_reg": lam})
    return _result(spec, "FactoredProjector", sum(q.numel() for q in model.parameters()), passes)


def run_worker(spec: dict, timeout: int = 900) -> dict:
    """Run one measurement in a fresh interpreter (this parent process never runs a model: the children's peak RSS
    is theirs), with the 1-min load average before and after."""
    load0 = os.getloadavg()[0]
    res = fresh_json([os.path.abspath(__file__), "--worker", json.dumps(spec)], timeout=timeout)
    res["load_avg"] = [load0, os.getloadavg()[0]]
    return res


def best(runs: list[dict], stat: str = "min") -> dict:
    """One row from its processes: the best cold pass and the best warm pass (``stat="median"``: the median
    process's), each process's cold and warm seconds, the load averages."""
    r = dict(runs[0])
    warms = sorted((x for x in runs if x.get("warm_s") is not None), key=lambda x: x["warm_s"])
    if warms:
        w = warms[0] if stat == "min" else warms[(len(warms) - 1) // 2]
        r.update({k: w[k] for k in ("warm_s", "warm", "train_s", "linalg_s") if k in w})
    colds = [x["cold_s"] for x in runs if x.get("cold_s") is not None]
    r["cold_s"] = min(colds) if colds else None
    r["all_cold_s"], r["all_warm_s"] = colds, [x.get("warm_s") for x in runs]
    r["load_avg"] = [v for x in runs for v in x.get("load_avg", [])]
    r["processes"] = len(runs)
    return r


def interleaved(specs: list[dict], repeats: int, timeout: int, key, adapt=lambda rep, spec: spec) -> dict:
    """{key(spec): [each process's result]}: every spec in ``repeats`` fresh processes, the repetitions interleaved
    in time (rep 1 of every spec, then rep 2, ...): a load spike from other jobs on shared cores has to hit every
    repetition of a row to show up. ``adapt(rep, spec)``: the spec that repetition runs, or None to skip it."""
    runs: dict = {}
    for rep in range(repeats):
        for spec in specs:
            if (run := adapt(rep, spec)) is not None:
                r = run_worker(run, timeout=timeout)
                runs.setdefault(key(spec), []).append(r)
                keys = ("model", "impl", "proj_dim", "cold_s", "warm_s", "train_s", "linalg_s", "load_avg")
                print(json.dumps({k: r.get(k) for k in keys}), flush=True)
    return runs


def machine() -> dict:
    import torch

    cpu = cpu_name() or platform.processor()
    import trak  # noqa: F401

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "traker": getattr(trak, "__version__", "0.3.2"),
        "python": platform.python_version(),
    }


def _fmt_s(v) -> str:
    return "—" if v is None else f"{v:.2f}"


def feat_table(rows: list[dict], models: list) -> str:
    """Cold and warm seconds per row, the stage split of the warm pass, × the floor and traker's fastest."""
    lines = [
        "| model | params | library / projector | examples | cold s | warm s | warm: init / featurize / "
        "finalize s | cold / warm | warm × floor | × traker-fastest (warm) | × traker-fastest (cold) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model in models:
        sel = [r for r in rows if r["model"] == model]
        if not sel:
            continue
        floor = next((r for r in sel if r["impl"] == "floor"), None)
        fast = next((r for r in sel if r["impl"] == "traker-fastest"), None)
        for r in sel:
            w, c = r.get("warm_s"), r.get("cold_s")
            if r["impl"] == "floor":
                split = f"train {r['train_s']:.3f} + linalg {r['linalg_s']:.3f}"
            else:
                ww = r.get("warm") or {}
                split = " / ".join(f"{ww[k]:.2f}" for k in ("init_s", "featurize_s", "finalize_s")) if ww else "—"
            cw = f"{c / w:.2f}" if c and w else "—"
            xf = f"{w / floor['warm_s']:.1f}" if (floor and w) else "—"
            rw = f"{fast['warm_s'] / w:.1f}×" if (fast and w and fast.get("warm_s")) else "—"
            if r["impl"] == "traker" and not w and fast and c and fast.get("warm_s"):
                rw = f"{fast['warm_s'] / c:.2f}× (cold)"
            rc = f"{fast['cold_s'] / c:.1f}×" if (fast and c and fast.get("cold_s")) else "—"
            n = f"{r['n']:,}"
            lines.append(
                f"| {MODEL_LABEL[model]} | {r['grad_dim']:,} | {IMPL_LABEL.get(r['impl'], r['impl'])} | {n} | "
                f"{_fmt_s(c)} | {_fmt_s(w)} | {split} | {cw} | {xf} | {rw} | {rc} |"
            )
    return "\n".join(lines)


def _times(ratio: float) -> str:
    """'12× faster' / '1.3× faster' / '0.90× as fast (slower)' for a speed ratio (theirs / ours)."""
    if ratio >= 10:
        return f"{ratio:.0f}× faster"
    return f"{ratio:.1f}× faster" if ratio >= 1 else f"{ratio:.2f}× as fast (slower)"


def _load_range(rows: list) -> str:
    vals = [v for r in rows for v in r.get("load_avg", [])]
    return f"{min(vals):.1f}–{max(vals):.1f} on {os.cpu_count()} cores" if vals else "not recorded"


DEFAULT_IMPLS = ["floor", "traker", "traker-fastest", "factored", "pipeline"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=2048, help="examples featurized per row")
    ap.add_argument("--proj-dim", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--device", default="cpu", help="cuda: on a GPU (the floor, traker and trakflow alike)")
    ap.add_argument("--repeats", type=int, default=1, help="fresh processes per row, interleaved; best cold/warm kept")
    ap.add_argument("--warm-runs", type=int, default=2, help="warm passes after the cold one, in each process")
    ap.add_argument("--slow-repeats", type=int, default=1, help="processes for traker's default row (minutes each)")
    ap.add_argument("--slow-warm-runs", type=int, default=0, help="warm passes of traker's default row (cold ≈ warm)")
    ap.add_argument("--models", nargs="+", default=["mlp400k", "convnet", "transformer"])
    ap.add_argument("--impls", nargs="+", default=DEFAULT_IMPLS, choices=list(IMPL_LABEL))
    ap.add_argument("--skip", nargs="*", default=[], help="model:impl")
    ap.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
    ap.add_argument("--json", default=os.path.join(ROOT, ".cache", "featurize_bench.json"), help="the raw results")
    a = ap.parse_args()
    if a.worker:
        spec = json.loads(a.worker)
        print(json.dumps({"machine": machine()} if spec.get("section") == "machine" else worker(spec)))
        return

    command = "`" + shlex.join([".venv/bin/python", "benchmarks/featurize_bench.py", *sys.argv[1:]]) + "`"
    t_all = time.perf_counter()
    res: dict = {"command": command}

    # featurize + finalize, side by side: every row in `--repeats` fresh processes, interleaved; best kept
    specs = [
        dict(model=m, impl=i, n=a.n, batch=a.batch, proj_dim=a.proj_dim, warm_runs=a.warm_runs, device=a.device)
        for m in a.models
        for i in a.impls
        if f"{m}:{i}" not in a.skip
    ]

    def adapt(rep: int, spec: dict) -> dict | None:  # traker's default row: its own repeats and warm passes
        if spec["impl"] != "traker":
            return spec
        return dict(spec, warm_runs=a.slow_warm_runs) if rep < a.slow_repeats else None

    runs = interleaved(specs, a.repeats, 1800, lambda s: (s["model"], s["impl"]), adapt)
    res["featurize"] = [best(runs[(spec["model"], spec["impl"])]) for spec in specs]
    res["machine"] = run_worker({"section": "machine"})["machine"]
    res["featurize_seconds"] = res["total_seconds"] = time.perf_counter() - t_all
    write_json(a.json, res)
    write_section(a.out, report(res, a), START, END)
    print(report(res, a), f"\nwrote {a.out} ({res['total_seconds']:.0f} s)", flush=True)


def report(res: dict, a) -> str:
    m = res["machine"]
    feats = res["featurize"]
    by = {(r["model"], r["impl"]): r for r in feats}
    out = [
        "### Featurize + finalize: the floor, traker 0.3.2 (default and fastest), trakflow — cold and warm",
        "",
        f"Produced by {res['command']} in one run ({res['featurize_seconds'] / 60:.1f} min) on "
        f"{m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['threads']} threads), traker {m['traker']}, "
        f"Python {m['python']}. Load average (1 min) during the run: {_load_range(feats)}. "
        + "Compare **ratios** within the table.",
        "",
    ]
    f, t, d = by.get(("mlp400k", "floor")), by.get(("mlp400k", "traker-fastest")), by.get(("mlp400k", "factored"))
    if f and t and d and d.get("warm_s"):
        out += [
            f"**Headline (400k-parameter MLP, {d['n']:,} examples, proj_dim {d['proj_dim']}, batch "
            f"{d['batch']}):** trakflow's default (`factored`) featurizes + finalizes in "
            f"{d['warm_s']:.2f} s warm / {d['cold_s']:.2f} s cold; traker 0.3.2's fastest "
            f"{'CPU' if a.device == 'cpu' else a.device} configuration "
            f"takes {t['warm_s']:.1f} s warm / {t['cold_s']:.1f} s cold — **{_times(t['warm_s'] / d['warm_s'])} "
            f"warm, {_times(t['cold_s'] / d['cold_s'])} cold**. The floor is {f['warm_s']:.2f} s: we are "
            f"at **{d['warm_s'] / f['warm_s']:.1f}× the floor** warm, cold/warm = "
            f"{d['cold_s'] / d['warm_s']:.2f}."
            + "".join(
                f" {what}: {r['warm_s']:.2f} s warm / {r['cold_s']:.2f} s cold, **{r['warm_s'] / f['warm_s']:.1f}× "
                f"the floor** warm, cold/warm = {r['cold_s'] / r['warm_s']:.2f}."
                for what, r in (("Through the pipeline's task functions", by.get(("mlp400k", "pipeline"))),)
                if r and r.get("warm_s") and r.get("cold_s")
            ),
            "",
        ]
    out += [
        feat_table(feats, a.models),
        "",
        f"Each row: the best of {a.repeats} fresh process(es) (traker's default: {a.slow_repeats}), the "
        "processes of all rows interleaved in time. *cold* = the first pass in a fresh process (after "
        "`import torch, trak_core/trak`): TRAKer construction with its store, load_checkpoint, featurize "
        f"in batches of {a.batch}, finalize_features; *warm* = the best of the next {a.warm_runs} passes in "
        "that process, each with a new TRAKer and a new store (traker's default: "
        f"{a.slow_warm_runs}; it regenerates its matrix for every batch, so cold ≈ warm). traker-fastest "
        "generates its grad_dim × proj_dim matrix once, in the cold pass, and keeps it (its free_memory() "
        "after finalize is disabled: traker never regenerates it for the same model_id). *× floor* = warm "
        "seconds / the floor's; *× traker-fastest* = its seconds / the row's. Both libraries run their "
        "defaults otherwise: float32 store (`use_half_precision=False`), traker `lambda_reg=0` (its default), "
        "trakflow its default `lambda_reg='adaptive'` (λ from the eigenvalues of XᵀX: float32 eigenvalues "
        "checked against the exact effective dimension, `trak_core.solve.damping.solve_deff_fast`); "
        "the *pipeline* row runs the pipeline's task functions in the worker process (`make_plan`, "
        "`featurize_shard` per shard, `finalize_checkpoint`; init = make_plan), its defaults otherwise; the "
        "model in eval mode, random inputs. The floor: a training pass over the same examples (forward, backward, SGD "
        "step per batch) + float32 XᵀX, Cholesky, Cholesky inverse and Φ = X·A on an n × proj_dim matrix, "
        "best of 3 warm. Rows left out: " + (", ".join(a.skip) or "none") + ".",
        "",
    ]
    return "\n".join(out)


if __name__ == "__main__":
    main()
