"""LDS versus damping (lambda_reg) on the digits demo and the text example; chooses AUTO_DAMPING.

For each setup: C checkpoints are trained on the full train set with the setup's recipe (the demo's for
digits: SGD lr 0.01, momentum 0.9, batch 64, 4 epochs; the text example's: full-batch Adam lr 0.05, 60
epochs), through ``tasks.trainer.train_on_rows`` (the train flow's code). The ground truth is M models
trained with the same recipe on random half subsets (``trak_core.lds.subset_masks``), with
``seeds_per_subset`` inits averaged, and their margins on held-out targets. The projected gradients X, Q,
G are computed once per checkpoint (``trak_core.featurize.Featurizer``, the pipeline's featurizer); each
``lambda_reg`` setting then only redoes the p×p solve and the scores, with ``trak_core.scoring``'s
functions in the store's order and dtypes (checked against ``trak_core.TRAKer`` for one setting).
``lambda_reg`` settings: 0, absolute values, and ``rel:f`` = f × the mean eigenvalue of XᵀX (per
checkpoint, as ``resolve_lambda`` does). Reported: LDS (mean over targets of the Spearman correlation)
with a 95 % bootstrap interval over targets.

    .venv/bin/python benchmarks/damping.py                     # the table of benchmarks/RESULTS.md
    .venv/bin/python benchmarks/damping.py --quick             # a smoke run (fewer subsets, targets)
"""

from __future__ import annotations

import argparse
import json
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

from tasks.config import TrainConfig  # noqa: E402
from tasks.trainer import forward, split_xy, train_on_rows  # noqa: E402
from trak_core import TRAKer  # noqa: E402
from trak_core.damping import regularized_inverse, resolve_lambda  # noqa: E402
from trak_core.featurize import Featurizer  # noqa: E402
from trak_core.gradients import grad_dim_of  # noqa: E402
from trak_core.lds import bootstrap_ci, lds, margins_from_logits, subset_masks  # noqa: E402
from trak_core.projectors import make_projector  # noqa: E402
from trak_core.scoring import combine_checkpoints, features_block, scores_block, xtx_partial  # noqa: E402

SETTINGS = [
    0.0,
    1e-2,
    1e-1,
    1.0,
    10.0,
    100.0,
    "rel:0.001",
    "rel:0.01",
    "rel:0.03",
    "rel:0.1",
    "rel:0.3",
    "rel:0.5",
    "rel:1",
    "rel:2",
    "rel:3",
    "rel:10",
]

HIGHLIGHT = ("auto", "rel:0.1", "rel:0.3", "rel:1")  # settings whose paired difference to λ=0 the table lists


# ---------------------------------------------------------------------------- the two setups
def digits_setup(num_targets: int, long: bool = False) -> dict:
    """The demo (4 epochs at lr 0.01, ~90 % train accuracy), or with ``long`` a model trained further (15
    epochs at lr 0.05, benchmarks/lds.py's recipe, ~100 % train accuracy)."""
    from examples import digits

    x, y = digits.train_data()
    hx, hy = digits.heldout_data()
    recipe = dict(epochs=4, batch_size=64, optimizer="sgd", lr=0.01, momentum=0.9)  # the demo's (digits.demo_configs)
    if long:
        recipe.update(epochs=15, lr=0.05)
    return {
        "name": "digits (15 epochs)" if long else "digits (demo)",
        "model": "examples.digits:make_model",
        "train_data": "examples.digits:train_data",
        "task": "image_classification",
        "train": (x, y),
        "targets": (hx[:num_targets], hy[:num_targets]),
        "recipe": recipe,
    }


def text_heldout(num: int) -> tuple:
    """``num`` held-out sentences: the generator's draws after the train rows (the first NUM_TARGETS of them
    are examples.text.target_data)."""
    from examples import text

    rng = np.random.default_rng(text.SEED)
    pairs = [text._sentence(rng) for _ in range(text.NUM_TRAIN + num)][text.NUM_TRAIN :]
    ids, types, mask = text.encode([p[0] for p in pairs])
    return ids, types, mask, torch.tensor([p[1] for p in pairs], dtype=torch.long)


def text_setup(num_targets: int) -> dict:
    from examples import text

    recipe = dict(epochs=60, batch_size=text.NUM_TRAIN, optimizer="adam", lr=0.05, momentum=0.0)  # text.train_model's
    return {
        "name": "text (embedding bag)",
        "model": "examples.text:make_model",
        "train_data": "examples.text:train_data",
        "task": "text_classification",
        "train": text.train_data(),
        "targets": text_heldout(num_targets),
        "recipe": recipe,
    }


# ---------------------------------------------------------------------------- pieces
def recipe_config(setup: dict, out_dir: str) -> TrainConfig:
    return TrainConfig(
        model=setup["model"],
        train_data=setup["train_data"],
        out_dir=out_dir,
        alpha_every=0,
        device="cpu",
        **setup["recipe"],
    )


def target_margins(model, targets: tuple) -> np.ndarray:
    inputs, labels = split_xy(targets, "target_data")
    with torch.no_grad():
        return margins_from_logits(forward(model, inputs), labels)


def featurize_all(setup: dict, states: list[dict], kind: str, proj_dim: int, batch: int = 250) -> list[dict]:
    """Per checkpoint: X (n, p), Q (n,), G (m, p) as the pipeline stores them (float32)."""
    from tasks.config import load_object

    make = load_object(setup["model"])
    out = []
    for mid, sd in enumerate(states):
        model = make()
        gd = grad_dim_of(model)
        proj = make_projector(kind, gd, proj_dim, 0, "rademacher", "cpu", model=model)
        feat = Featurizer(model, setup["task"], proj, device="cpu")
        feat.load_state(sd)
        train, targets = setup["train"], setup["targets"]
        n = train[0].shape[0]
        xs, qs = [], []
        for a in range(0, n, batch):
            x, q = feat.featurize([t[a : a + batch] for t in train], mid, range(a, min(a + batch, n)))
            xs.append(x)
            qs.append(q)
        g = feat.target_features(list(targets), mid)
        out.append({"X": np.concatenate(xs), "Q": np.concatenate(qs), "G": g})
    return out


def scores_for(feats: list[dict], setting, rescale: bool = True) -> tuple[np.ndarray, list[float]]:
    """The pipeline's formula (float64 XᵀX and inverse, float32 features and scores, traker's combination)."""
    acc, qsum, lams = None, None, []
    for f in feats:
        x = torch.from_numpy(f["X"])
        xtx = xtx_partial(x)
        lam = resolve_lambda(setting, xtx)
        lams.append(lam)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            inv = regularized_inverse(xtx, lam, rescale=rescale)
        phi = features_block(x, inv)
        block = scores_block(phi, torch.from_numpy(f["G"]))
        acc = block if acc is None else acc + block
        q = f["Q"].astype(np.float64)
        qsum = q if qsum is None else qsum + q
    return combine_checkpoints(acc.numpy(), qsum.astype(np.float32), len(feats)).astype(np.float64), lams


def traker_check(setup: dict, states: list[dict], proj_dim: int, setting, ours: np.ndarray) -> float:
    """max |ours − TRAKer| / max |TRAKer| for one setting (same projector, float32 store)."""
    from tasks.config import load_object

    make = load_object(setup["model"])
    train, targets = setup["train"], setup["targets"]
    n = train[0].shape[0]
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = TRAKer(
            make(),
            setup["task"],
            n,
            save_dir=os.path.join(tmp, "s.zarr"),
            device="cpu",
            proj_dim=proj_dim,
            lambda_reg=setting,
            use_half_precision=False,
            chunk_rows=250,
            logging_level=40,
        )
        for mid, sd in enumerate(states):
            tr.load_checkpoint(sd, mid)
            for a in range(0, n, 250):
                tr.featurize([t[a : a + 250] for t in train], inds=np.arange(a, min(a + 250, n)))
        tr.finalize_features()
        for mid, sd in enumerate(states):
            tr.start_scoring_checkpoint("x", sd, mid, targets[0].shape[0])
            tr.score(list(targets), inds=np.arange(targets[0].shape[0]))
        ref = np.asarray(tr.finalize_scores("x"), dtype=np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def run_setup(
    setup: dict,
    num_subsets: int,
    seeds_per_subset: int,
    num_ckpts: int,
    proj_dims,
    settings,
    with_noop: bool,
    log=print,
) -> dict:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = recipe_config(setup, tmp)
    train = setup["train"]
    n = train[0].shape[0]
    ckpts = [train_on_rows(cfg, seed, None, train) for seed in range(num_ckpts)]
    acc = [
        float((forward(m, split_xy(setup["targets"])[0]).argmax(1) == setup["targets"][-1]).float().mean())
        for m in ckpts
    ]
    states = [m.state_dict() for m in ckpts]
    masks = subset_masks(n, num_subsets, 0.5, seed=2024)
    margins = np.zeros((num_subsets, setup["targets"][0].shape[0]))
    for s in range(num_subsets):
        for r in range(seeds_per_subset):
            model = train_on_rows(cfg, 1000 + s * seeds_per_subset + r, np.flatnonzero(masks[s]), train)
            margins[s] += target_margins(model, setup["targets"]) / seeds_per_subset
    train_s = time.perf_counter() - t0
    log(
        f"{setup['name']}: {num_ckpts} checkpoints (target accuracy {np.mean(acc):.3f}) and "
        f"{num_subsets}×{seeds_per_subset} subset models trained in {train_s:.1f} s"
    )
    rows = []
    kinds = [("dense", p) for p in proj_dims] + ([("noop", None)] if with_noop else [])
    for kind, p in kinds:
        t = time.perf_counter()
        feats = featurize_all(setup, states, kind, p or 1)
        pdim = feats[0]["X"].shape[1]
        mean_eig = float(np.mean([np.trace(xtx_partial(torch.from_numpy(f["X"])).numpy()) / pdim for f in feats]))
        log(
            f"  {kind} (proj_dim {pdim}): featurized in {time.perf_counter() - t:.1f} s; mean eigenvalue of XᵀX "
            f"{mean_eig:.4g}"
        )
        for setting in settings:
            sc, lams = scores_for(feats, setting)
            value, per = lds(sc, masks, margins)
            lo, hi = bootstrap_ci(per)
            row = {
                "setup": setup["name"],
                "projector": kind,
                "proj_dim": pdim,
                "lambda_reg": setting,
                "lambda_abs": float(np.mean(lams)),
                "lds": value,
                "ci95": [lo, hi],
                "per_target": [float(v) for v in per],
            }
            rows.append(row)
            log(f"    lambda_reg={setting!s:>10} (λ≈{np.mean(lams):.3g}): LDS {value:.3f} [{lo:.3f}, {hi:.3f}]")
    p0 = proj_dims[0]
    check = traker_check(
        setup, states, p0, "rel:0.1", scores_for(featurize_all(setup, states, "dense", p0), "rel:0.1")[0]
    )
    log(f"  check: our formula vs trak_core.TRAKer (rel:0.1): max rel. difference {check:.2e}")
    return {
        "setup": setup["name"],
        "n": n,
        "num_targets": int(setup["targets"][0].shape[0]),
        "num_subsets": num_subsets,
        "seeds_per_subset": seeds_per_subset,
        "num_ckpts": num_ckpts,
        "recipe": setup["recipe"],
        "target_accuracy": float(np.mean(acc)),
        "train_seconds": train_s,
        "traker_check": check,
        "rows": rows,
    }


def paired_diff(a: list[float], b: list[float], reps: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    d = np.asarray(a) - np.asarray(b)
    d = d[np.isfinite(d)]
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(reps, d.size))].mean(1)
    return float(d.mean()), float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def choose_auto(results: list[dict]) -> tuple[str, dict]:
    """The relative setting whose worst ratio LDS / (best LDS of that column) over the dense columns of all
    setups is highest (a minimax-regret choice), and those worst ratios per relative setting."""
    cols: dict[tuple, dict[str, float]] = {}
    for res in results:
        for r in res["rows"]:
            if r["projector"] == "dense":
                cols.setdefault((res["setup"], r["proj_dim"]), {})[str(r["lambda_reg"])] = r["lds"]
    rel = [k for k in next(iter(cols.values())) if k.startswith("rel:")]
    worst = {k: min(c[k] / max(c.values()) for c in cols.values() if k in c) for k in rel}
    return max(worst, key=worst.get), worst


def table(results: list[dict]) -> str:
    """Markdown: one row per setting, one LDS column per (setup, projector)."""
    cols = []
    for res in results:
        for r in res["rows"]:
            key = (res["setup"], r["projector"], r["proj_dim"])
            if key not in cols:
                cols.append(key)
    by = {
        (res["setup"], r["projector"], r["proj_dim"], str(r["lambda_reg"])): r for res in results for r in res["rows"]
    }
    settings = []
    for res in results:
        for r in res["rows"]:
            if str(r["lambda_reg"]) not in settings:
                settings.append(str(r["lambda_reg"]))
    head = "| lambda_reg | " + " | ".join(f"{s.split(' ')[0]}, {k} {p}" for s, k, p in cols) + " |"
    lines = [head, "|---|" + "---|" * len(cols)]
    for st in settings:
        cells = []
        for s, k, p in cols:
            r = by.get((s, k, p, st))
            cells.append("—" if r is None else f"{r['lds']:.3f} ±{(r['ci95'][1] - r['ci95'][0]) / 2:.3f}")
        lines.append(f"| {st} | " + " | ".join(cells) + " |")
    lines.append("")
    for res in results:
        lines.append(
            f"- {res['setup']}: n={res['n']}, {res['num_targets']} held-out targets, {res['num_ckpts']} "
            f"checkpoints (target accuracy {res['target_accuracy']:.3f}), {res['num_subsets']} half subsets × "
            f"{res['seeds_per_subset']} seeds, recipe {res['recipe']}; formula vs TRAKer max rel. diff "
            f"{res['traker_check']:.1e}."
        )
        for r in res["rows"]:
            zero = by.get((res["setup"], r["projector"], r["proj_dim"], "0.0"))
            if zero is not None and str(r["lambda_reg"]) in HIGHLIGHT:
                d, lo, hi = paired_diff(r["per_target"], zero["per_target"])
                lines.append(
                    f"  - {r['projector']} {r['proj_dim']}, {r['lambda_reg']} − λ=0: {d:+.3f} "
                    f"[95% CI {lo:+.3f}, {hi:+.3f}] (paired over targets)"
                )
    best, worst = choose_auto(results)
    lines.append("")
    lines.append(
        "Worst ratio LDS / best LDS of its column over the dense columns, per relative setting: "
        + ", ".join(f"{k} {v:.2f}" for k, v in worst.items())
        + f". Highest: **{best}**."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setups", nargs="+", default=["digits", "text"], help="digits, digits-long, text")
    ap.add_argument("--subsets", type=int, default=100)
    ap.add_argument("--seeds-per-subset", type=int, default=2)
    ap.add_argument("--ckpts", type=int, default=3)
    ap.add_argument("--targets", type=int, default=200)
    ap.add_argument("--proj-dims", type=int, nargs="+", default=[512])
    ap.add_argument("--settings", nargs="+", default=None, help="lambda_reg values (numbers, 'rel:f', 'auto')")
    ap.add_argument("--no-noop", action="store_true", help="skip the exact-gradient (noop) rows")
    ap.add_argument("--quick", action="store_true", help="30 subsets × 1 seed, 50 targets")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.quick:
        a.subsets, a.seeds_per_subset, a.targets = 30, 1, 50
    settings = (
        SETTINGS
        if a.settings is None
        else [s if (s == "auto" or s.startswith("rel:")) else float(s) for s in a.settings]
    )
    torch.set_num_threads(1)
    results = []
    for name in a.setups:
        setup = {
            "digits": lambda: digits_setup(a.targets),
            "digits-long": lambda: digits_setup(a.targets, True),
            "text": lambda: text_setup(a.targets),
        }[name]()
        results.append(run_setup(setup, a.subsets, a.seeds_per_subset, a.ckpts, a.proj_dims, settings, not a.no_noop))
    out = table(results)
    print(out)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"results": results, "table": out}, fh, indent=1)
