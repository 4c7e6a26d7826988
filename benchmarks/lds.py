"""A small linear datamodeling score (LDS) on the demo setup: dense vs SJLT vs factored projection.

Setup (the embedded demo, ``examples/digits.py``): scikit-learn digits, 1,500 train rows, the held-out
digits as targets, the 64 → 32 → 10 MLP (2,410 parameters), TRAK on C checkpoints trained on the full
train set. Ground truth: M models trained on random half subsets S_m (750 rows, seeded), their target
margins f_j(θ_S_m) (the margin TRAK attributes). LDS = mean over targets j of the Spearman correlation
over m between Σ_{i ∈ S_m} τ_ij and f_j(θ_S_m).

All M + C models are trained at once (stacked weights, one batched SGD loop): SGD, momentum 0.9, lr 0.05,
batch 64, 15 epochs — the demo's training recipe. TRAK runs through ``trak_core.TRAKer`` with the given
projector, float32 store. ``--lambdas`` are relative: lambda_reg = λ · projector.scale (E‖Px‖²/‖x‖², i.e.
proj_dim for the projections, 1 for noop), so that one λ means the same damping for every kind and proj_dim.
Projector randomness is reported over several projector seeds; the difference to dense also as a paired
bootstrap over targets.

    .venv/bin/python benchmarks/lds.py                       # the table of benchmarks/RESULTS.md
    .venv/bin/python benchmarks/lds.py --quick               # a 1-minute smoke run
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import warnings

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import trak_core  # noqa: E402
from examples import digits  # noqa: E402
from trak_core.factored import FactoredProjector  # noqa: E402
from trak_core.projectors import DenseProjector, NoOpProjector  # noqa: E402
from trak_core.sjlt import SJLTProjector  # noqa: E402


# ---------------------------------------------------------------------------- stacked training
def _mlp_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    layers = list(model)
    lin = [m for m in layers if isinstance(m, torch.nn.Linear)]
    ok = all(isinstance(m, (torch.nn.Linear, torch.nn.ReLU)) for m in layers) and isinstance(
        layers[-1], torch.nn.Linear
    )
    if not ok:
        raise ValueError("the stacked trainer handles Sequential(Linear, ReLU, ..., Linear) models")
    return [(m.out_features, m.in_features) for m in lin]


def _forward(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """x (M, b, d) → logits (M, b, C) for the stacked MLP params [W1, b1, W2, b2, ...] (M, ...)."""
    h = x
    n = len(params) // 2
    for i in range(n):
        h = torch.baddbmm(params[2 * i + 1][:, None, :], h, params[2 * i].transpose(1, 2))
        if i < n - 1:
            h = torch.relu(h)
    return h


def train_stacked(
    x: torch.Tensor,
    y: torch.Tensor,
    subsets: torch.Tensor,
    seeds: list[int],
    epochs: int = 15,
    batch: int = 64,
    lr: float = 0.05,
    momentum: float = 0.9,
) -> list[dict]:
    """Train one model per row of ``subsets`` ((M, s) train indices, equal sizes) from make_model() with
    torch.manual_seed(seed) init; returns their state_dicts."""
    _mlp_shapes(digits.make_model())  # refuse other architectures
    inits = []
    for s in seeds:
        torch.manual_seed(s)
        inits.append(digits.make_model().state_dict())
    keys = list(inits[0])
    params = [torch.stack([sd[k] for sd in inits]).clone().requires_grad_(True) for k in keys]
    bufs = [torch.zeros_like(p) for p in params]
    m, s = subsets.shape
    gen = torch.Generator().manual_seed(12345 + int(sum(seeds)) % 1000)
    for _ in range(epochs):
        perm = torch.argsort(torch.rand(m, s, generator=gen), dim=1)
        order = torch.gather(subsets, 1, perm)
        for a in range(0, s, batch):
            idx = order[:, a : a + batch]
            logits = _forward(params, x[idx])
            loss = (
                torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), y[idx].reshape(-1), reduction="none"
                )
                .reshape(m, -1)
                .mean(1)
                .sum()
            )
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                for p, g, v in zip(params, grads, bufs):
                    v.mul_(momentum).add_(g)
                    p.sub_(lr * v)
    return [{k: params[i][j].detach().clone() for i, k in enumerate(keys)} for j in range(m)]


def margins(states: list[dict], x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    """(M, m) margins log(p_y / (1 - p_y)) of each model on each target."""
    keys = list(states[0])
    params = [torch.stack([sd[k] for sd in states]) for k in keys]
    with torch.no_grad():
        logits = _forward(params, x[None].expand(len(states), *x.shape))
        mask = torch.nn.functional.one_hot(y, logits.shape[-1]).bool()[None]
        correct = logits.masked_select(mask).reshape(len(states), -1)
        others = logits.masked_fill(mask, float("-inf")).logsumexp(-1)
    return (correct - others).numpy()


# ---------------------------------------------------------------------------- TRAK and LDS
def make_projector(kind: str, grad_dim: int, proj_dim: int, seed: int, c: int = 4):
    if kind == "dense":
        return DenseProjector(grad_dim, proj_dim, seed, "rademacher")
    if kind.startswith("sjlt"):  # "sjlt" (c from the argument) or "sjlt-cN"
        return SJLTProjector(grad_dim, proj_dim, seed, c=int(kind.split("-c")[1]) if "-c" in kind else c)
    if kind == "factored":
        return FactoredProjector.from_model(digits.make_model(), proj_dim, seed)
    if kind == "noop":
        return NoOpProjector()
    raise ValueError(kind)


def _scale(projector, grad_dim: int) -> float:
    """E‖Px‖² / ‖x‖² (noop: 1): lambda_reg is given per unit of it so that kinds and proj_dims compare."""
    return 1.0 if isinstance(projector, NoOpProjector) else float(projector.scale)


def trak_scores(projector, ckpts: list[dict], x, y, xt, yt, lambda_reg: float, batch: int = 500) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = trak_core.TRAKer(
            model=digits.make_model(),
            task="image_classification",
            train_set_size=len(x),
            save_dir=os.path.join(tmp, "store"),
            device="cpu",
            projector=projector,
            lambda_reg=lambda_reg,
            use_half_precision=False,
            logging_level=logging.ERROR,
            chunk_rows=500,
        )
        for mid, sd in enumerate(ckpts):
            tr.load_checkpoint(sd, model_id=mid)
            for a in range(0, len(x), batch):
                tr.featurize((x[a : a + batch], y[a : a + batch]), num_samples=min(batch, len(x) - a))
        tr.finalize_features()
        for mid, sd in enumerate(ckpts):
            tr.start_scoring_checkpoint("lds", sd, mid, num_targets=len(xt))
            tr.score((xt, yt), num_samples=len(xt))
        return np.asarray(tr.finalize_scores("lds"), dtype=np.float64)


def _ranks(a: np.ndarray) -> np.ndarray:
    """Ranks along axis 0 (average ranks for ties)."""
    from scipy.stats import rankdata

    return rankdata(a, axis=0)


def lds_per_target(scores: np.ndarray, masks: np.ndarray, true_margins: np.ndarray) -> np.ndarray:
    """Spearman over subsets of (masks @ scores)[:, j] and true_margins[:, j], for each target j."""
    pred = masks.astype(np.float64) @ scores  # (M, m)
    rp, rt = _ranks(pred), _ranks(true_margins)
    rp = rp - rp.mean(0)
    rt = rt - rt.mean(0)
    den = np.sqrt((rp**2).sum(0) * (rt**2).sum(0))
    return np.where(den > 0, (rp * rt).sum(0) / np.where(den > 0, den, 1), 0.0)


def bootstrap_diff(a: np.ndarray, b: np.ndarray, reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of mean(a - b) over targets (paired bootstrap)."""
    rng = np.random.default_rng(seed)
    d = a - b
    idx = rng.integers(0, len(d), size=(reps, len(d)))
    means = d[idx].mean(1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


# ---------------------------------------------------------------------------- the experiment
def run(
    num_subsets: int = 100,
    num_ckpts: int = 5,
    num_targets: int = 200,
    proj_dims=(512,),
    kinds=("dense", "sjlt", "factored"),
    proj_seeds=(0, 1, 2),
    lambdas=(1e-2,),
    c: int = 4,
    with_noop: bool = True,
    log=print,
) -> dict:
    torch.manual_seed(0)
    x, y = digits.train_data()
    hx, hy = digits.heldout_data()
    xt, yt = hx[:num_targets], hy[:num_targets]
    n = len(x)
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(2024)
    subsets = torch.stack([torch.randperm(n, generator=gen)[: n // 2] for _ in range(num_subsets)])
    masks = np.zeros((num_subsets, n), dtype=bool)
    masks[np.arange(num_subsets)[:, None], subsets.numpy()] = True
    sub_states = train_stacked(x, y, subsets, seeds=[1000 + i for i in range(num_subsets)])
    true = margins(sub_states, xt, yt)
    full = torch.arange(n).expand(num_ckpts, n).contiguous()
    ckpts = train_stacked(x, y, full, seeds=list(range(num_ckpts)))
    with torch.no_grad():
        m0 = digits.make_model()
        m0.load_state_dict(ckpts[0])
        acc = float((m0(xt).argmax(1) == yt).float().mean())
        m1 = digits.make_model()
        m1.load_state_dict(sub_states[0])
        acc_sub = float((m1(xt).argmax(1) == yt).float().mean())
    train_s = time.perf_counter() - t0
    log(
        f"trained {num_subsets} subset models + {num_ckpts} checkpoints in {train_s:.1f} s; "
        f"target accuracy: checkpoint 0 {acc:.3f}, subset model 0 {acc_sub:.3f}"
    )
    grad_dim = sum(p.numel() for p in digits.make_model().parameters())
    results = {
        "setup": {
            "num_subsets": num_subsets,
            "num_ckpts": num_ckpts,
            "num_targets": int(len(xt)),
            "train_size": n,
            "grad_dim": grad_dim,
            "sjlt_c": c,
            "target_accuracy": acc,
            "subset_model_accuracy": acc_sub,
            "train_seconds": train_s,
        },
        "rows": [],
    }
    per_target = {}
    for lam in lambdas:
        runs = [("noop", grad_dim, 0)] if with_noop else []
        runs += [(k, p, s) for p in proj_dims for k in kinds for s in proj_seeds]
        for kind, p, s in runs:
            t = time.perf_counter()
            proj = make_projector(kind, grad_dim, p, s, c)
            sc = trak_scores(proj, ckpts, x, y, xt, yt, lam * _scale(proj, grad_dim))
            lt = lds_per_target(sc, masks, true)
            per_target[(kind, p, s, lam)] = lt
            row = {
                "kind": kind,
                "proj_dim": p,
                "seed": s,
                "lambda_reg": lam,
                "lds": float(lt.mean()),
                "seconds": time.perf_counter() - t,
            }
            results["rows"].append(row)
            log(json.dumps(row))
    # summary: mean ± std over projector seeds, paired bootstrap of the difference to dense (seeds pooled)
    summary = []
    for lam in lambdas:
        if with_noop:
            lt = per_target[("noop", grad_dim, 0, lam)]
            summary.append(
                {
                    "kind": "noop (exact gradients)",
                    "proj_dim": grad_dim,
                    "lambda_reg": lam,
                    "lds_mean": float(lt.mean()),
                    "lds_std_seeds": 0.0,
                    "diff_vs_dense": None,
                }
            )
        for p in proj_dims:
            dense = (
                np.mean([per_target[("dense", p, s, lam)] for s in proj_seeds], axis=0) if "dense" in kinds else None
            )
            for kind in kinds:
                vals = [per_target[(kind, p, s, lam)] for s in proj_seeds]
                means = [float(v.mean()) for v in vals]
                row = {
                    "kind": kind,
                    "proj_dim": p,
                    "lambda_reg": lam,
                    "lds_mean": float(np.mean(means)),
                    "lds_std_seeds": float(np.std(means)),
                    "diff_vs_dense": None,
                    "diff_ci95": None,
                }
                if dense is not None and kind != "dense":
                    avg = np.mean(vals, axis=0)
                    row["diff_vs_dense"] = float(avg.mean() - dense.mean())
                    row["diff_ci95"] = bootstrap_diff(avg, dense)
                summary.append(row)
    results["summary"] = summary
    return results


def table(results: dict) -> str:
    st = results["setup"]
    lines = [
        "| projector | proj_dim | λ (lambda_reg = λ·proj_dim) | LDS (mean over projector seeds) | std over seeds | "
        "LDS − dense [95% CI, paired bootstrap over targets] |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["summary"]:
        d = (
            "—"
            if r.get("diff_vs_dense") is None
            else f"{r['diff_vs_dense']:+.3f} [{r['diff_ci95'][0]:+.3f}, {r['diff_ci95'][1]:+.3f}]"
        )
        lines.append(
            f"| {r['kind']} | {r['proj_dim']} | {r['lambda_reg']:g} | {r['lds_mean']:.3f} | "
            f"{r['lds_std_seeds']:.3f} | {d} |"
        )
    best = {}
    for r in results["summary"]:
        if r["kind"] not in best or r["lds_mean"] > best[r["kind"]]["lds_mean"]:
            best[r["kind"]] = r
    if len({r["lambda_reg"] for r in results["summary"]}) > 1:
        lines.append("")
        lines.append(
            "Best λ of each kind: "
            + "; ".join(f"{k} λ={r['lambda_reg']:g} (LDS {r['lds_mean']:.3f})" for k, r in best.items())
            + "."
        )
    lines.append("")
    lines.append(
        f"{st['train_size']} train digits, {st['num_targets']} held-out targets, {st['num_ckpts']} "
        f"checkpoints (target accuracy {st['target_accuracy']:.3f}), {st['num_subsets']} half-subset "
        f"models (accuracy {st['subset_model_accuracy']:.3f}), grad_dim {st['grad_dim']}, SJLT c="
        f"{st['sjlt_c']}."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--subsets", type=int, default=100)
    ap.add_argument("--ckpts", type=int, default=5)
    ap.add_argument("--targets", type=int, default=200)
    ap.add_argument("--proj-dims", type=int, nargs="+", default=[512])
    ap.add_argument("--kinds", nargs="+", default=["dense", "sjlt", "factored"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--lambdas", type=float, nargs="+", default=[1e-2])
    ap.add_argument("--c", type=int, default=4)
    ap.add_argument("--no-noop", action="store_true")
    ap.add_argument("--quick", action="store_true", help="30 subsets, 2 checkpoints, 1 seed")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.quick:
        a.subsets, a.ckpts, a.seeds = 30, 2, [0]
    torch.set_num_threads(max(1, torch.get_num_threads()))
    res = run(
        a.subsets,
        a.ckpts,
        a.targets,
        tuple(a.proj_dims),
        tuple(a.kinds),
        tuple(a.seeds),
        tuple(a.lambdas),
        a.c,
        not a.no_noop,
    )
    res["table"] = table(res)
    print(res["table"])
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)
