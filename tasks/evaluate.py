"""The evaluate flow's steps: counterfactual ground truth (subset models → target margins), cached, and the
LDS of an experiment's scores against it.

Plain functions first (no Prefect in them), then thin ``@task`` wrappers at the end of the module.

Ground-truth cache (``config.cache_dir``), one folder per key (:func:`truth_identity`)::

    <cache_dir>/<key>/identity.json                 what the key stands for (data, model, recipe, seeds)
    <cache_dir>/<key>/models/s00012_r0.npy          margins (m,) of subset model (s=12, r=0) on the targets
    <cache_dir>/<key>/truth_M<M>.npz                masks (M, n) bool, margins (M, m) (mean over r), per_seed

A subset model's file is written atomically (tmp + rename) by the one task that trains it, so a crashed
run resumes and a re-run trains nothing. Subset s is the s-th draw of ``subset_seed``'s generator, so the
key does not include M and a larger ``num_subsets`` reuses the models already there.
"""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE

from trak_core.errors import BadInputError
from trak_core.lds import array_fingerprint, bootstrap_ci, lds, margins_from_logits, subset_masks, truth_key
from trak_core.store import open_store

from . import progress
from .attribution import RETRIED_TASK
from .common import cached_data, threads_per_task, torch_threads
from .config import EvaluateConfig, TrainConfig
from .plan import SubsetModelManifest, TruthPlan
from .report import image_markdown, store_artifact_key
from .trainer import forward, split_xy, train_on_rows

MARGIN = "log(p_y/(1-p_y)) of the target's label"


# ---------------------------------------------------------------------------- plain steps
def recipe_config(config: EvaluateConfig) -> TrainConfig:
    """The TrainConfig the subset models are trained with (the train flow's recipe fields)."""
    a = config.attribute
    return TrainConfig(
        model=a.model,
        train_data=a.train_data,
        out_dir=config.cache_dir,
        alpha_every=0,
        device=config.device,
        **config.recipe(),
    )


def truth_identity(config: EvaluateConfig) -> dict:
    """Everything the ground truth depends on (its cache key is a hash of this)."""
    a = config.attribute
    train = cached_data(a.train_data, "train_data")
    targets = cached_data(a.target_data, "target_data")
    return {
        "kind": "trakflow-lds-truth",
        "version": 1,
        "model": a.model,
        "train_data": a.train_data,
        "train_sha256": array_fingerprint(train),
        "n": int(train[0].shape[0]),
        "target_data": a.target_data,
        "target_sha256": array_fingerprint(targets),
        "m": int(targets[0].shape[0]),
        "recipe": config.recipe(),
        "subset_fraction": config.subset_fraction,
        "subset_seed": config.subset_seed,
        "model_seed": config.model_seed,
        "seeds_per_subset": config.seeds_per_subset,
        "margin": MARGIN,
    }


def model_seed(config: EvaluateConfig, s: int, r: int) -> int:
    return config.model_seed + s * config.seeds_per_subset + r


def _model_file(folder: Path, s: int, r: int) -> Path:
    return folder / "models" / f"s{s:05d}_r{r}.npy"


def plan_truth(config: EvaluateConfig) -> TruthPlan:
    """The cache folder of this ground truth (created with identity.json) and the (s, r) models to train."""
    a = config.attribute
    for field, path in (("train_data", a.train_data), ("target_data", a.target_data)):
        data = cached_data(path, field)
        split_xy(data, field)  # (inputs..., integer labels) or a clear error naming the field
    ident = truth_identity(config)
    key = truth_key(ident)
    folder = Path(config.cache_dir) / key
    (folder / "models").mkdir(parents=True, exist_ok=True)
    idf = folder / "identity.json"
    if not idf.is_file():
        tmp = idf.with_name(idf.name + ".tmp")
        tmp.write_text(json.dumps(ident, indent=1))
        os.replace(tmp, idf)
    jobs = [(s, r) for s in range(config.num_subsets) for r in range(config.seeds_per_subset)]
    todo = tuple(j for j in jobs if not _model_file(folder, *j).is_file())
    return TruthPlan(key=key, folder=str(folder), n=ident["n"], m=ident["m"], models=len(jobs), jobs=todo)


def train_subset_model(config: EvaluateConfig, folder: str, s: int, r: int) -> SubsetModelManifest:
    """Train counterfactual model (s, r) on subset s; write its target margins. Skips a model already there."""
    t0 = time.perf_counter()
    out = _model_file(Path(folder), s, r)
    if out.is_file():
        progress.advance("lds-train", 1)
        return SubsetModelManifest.timed(t0, True, subset=s, seed_index=r)
    a = config.attribute
    train = cached_data(a.train_data, "train_data")
    n = int(train[0].shape[0])
    masks = subset_masks(n, s + 1, config.subset_fraction, config.subset_seed)
    rows = np.flatnonzero(masks[s])
    seed = model_seed(config, s, r)
    model = train_on_rows(recipe_config(config), seed, rows, train)
    margins = target_margins(model, cached_data(a.target_data, "target_data"), config.resolved_device())
    tmp = out.with_name(out.stem + f".{os.getpid()}.tmp.npy")
    np.save(tmp, margins)
    os.replace(tmp, out)
    progress.advance("lds-train", 1)
    return SubsetModelManifest.timed(t0, False, subset=s, seed_index=r, seed=seed, rows=int(rows.size))


def target_margins(model: torch.nn.Module, targets: tuple, device: str = "cpu", batch: int = 1024) -> np.ndarray:
    """(m,) margins log(p_y / (1 − p_y)) of the model on the targets, float64."""
    inputs, labels = split_xy(targets, "target_data")
    out = []
    with torch.no_grad():
        for a in range(0, labels.shape[0], batch):
            logits = forward(model, tuple(t[a : a + batch].to(device) for t in inputs))
            out.append(margins_from_logits(logits.cpu(), labels[a : a + batch]))
    return np.concatenate(out)


def assemble_truth(config: EvaluateConfig, folder: str) -> str:
    """truth_M<M>.npz from the per-model files: masks (M, n), margins (M, m) averaged over the seeds,
    per_seed (M, R, m). Returns its path (rewritten only when absent)."""
    folder_p = Path(folder)
    path = folder_p / f"truth_M{config.num_subsets}.npz"
    if path.is_file():
        return str(path)
    a = config.attribute
    n = int(cached_data(a.train_data, "train_data")[0].shape[0])
    masks = subset_masks(n, config.num_subsets, config.subset_fraction, config.subset_seed)
    per_seed = np.stack(
        [
            np.stack([np.load(_model_file(folder_p, s, r)) for r in range(config.seeds_per_subset)])
            for s in range(config.num_subsets)
        ]
    )
    tmp = folder_p / f".truth_M{config.num_subsets}.{os.getpid()}.tmp.npz"
    np.savez(tmp, masks=masks, margins=per_seed.mean(axis=1), per_seed=per_seed)
    os.replace(tmp, path)
    return str(path)


def load_truth(path: str) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def experiment_scores(config: EvaluateConfig) -> np.ndarray:
    a = config.attribute
    store = open_store(a.store, a.storage_options, mode="r")
    if a.exp_name not in store.experiments():
        raise BadInputError(
            f"exp_name: no experiment {a.exp_name!r} in {a.store} (it has {store.experiments()}); "
            "run the attribute flow first (run_attribute: true)"
        )
    done = store.scores_done_mask(a.exp_name)
    if not done.all():
        raise BadInputError(
            f"exp_name: experiment {a.exp_name!r} in {a.store} is not fully scored "
            f"({int(done.sum())}/{done.size} rows); run the attribute flow (run_attribute: true)"
        )
    return np.asarray(store.scores(a.exp_name)[:], dtype=np.float64)


def compute_lds(config: EvaluateConfig, truth_path: str, trained: int = 0) -> dict:
    """LDS of the experiment's scores against the ground truth, with a bootstrap interval over targets;
    also written next to the truth as ``lds_<exp>.json``."""
    a = config.attribute
    scores = experiment_scores(config)
    truth = load_truth(truth_path)
    if scores.shape != (truth["masks"].shape[1], truth["margins"].shape[1]):
        raise BadInputError(
            f"scores {scores.shape} of experiment {a.exp_name!r} do not match the ground truth "
            f"(n={truth['masks'].shape[1]}, m={truth['margins'].shape[1]})"
        )
    value, per = lds(scores, truth["masks"], truth["margins"])
    lo, hi = bootstrap_ci(per)
    store = open_store(a.store, a.storage_options, mode="r")
    fin = [store.finalize_info(mid) or {} for mid in store.model_ids()]
    result = {
        "lds": value,
        "ci95": [lo, hi],
        "per_target": [None if not np.isfinite(v) else float(v) for v in per],
        "num_targets": int(per.size),
        "num_subsets": int(truth["masks"].shape[0]),
        "seeds_per_subset": int(truth["per_seed"].shape[1]),
        "subset_fraction": config.subset_fraction,
        "store": a.store,
        "exp_name": a.exp_name,
        "truth": truth_path,
        "trained": int(trained),
        "settings": {
            "proj_dim": a.proj_dim,
            "projector": a.projector,
            "lambda_reg": a.lambda_reg,
            "lambda_abs": [f.get("lambda_reg") for f in fin],
            "checkpoints": len(fin),
            "recipe": config.recipe(),
        },
    }
    out = Path(truth_path).parent / f"lds_{_safe(a.exp_name)}.json"
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out)
    return result


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in name)


def lds_markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"## LDS of experiment {result['exp_name']!r}",
        "",
        f"**LDS = {result['lds']:.3f}** (95% bootstrap interval over targets "
        f"[{result['ci95'][0]:.3f}, {result['ci95'][1]:.3f}])",
        "",
        "| what | value |",
        "|---|---|",
        f"| store | `{result['store']}` |",
        f"| targets | {result['num_targets']} |",
        f"| counterfactual models | {result['num_subsets']} subsets × {result['seeds_per_subset']} seeds, "
        f"fraction {result['subset_fraction']} ({result['trained']} trained in this run) |",
        f"| subset recipe | {s['recipe']} |",
        f"| TRAK | {s['checkpoints']} checkpoints, projector {s['projector']}, proj_dim {s['proj_dim']}, "
        f"lambda_reg {s['lambda_reg']} (λ = {', '.join(f'{x:.3g}' for x in s['lambda_abs'] if x is not None)}) |",
        f"| ground truth | `{result['truth']}` |",
    ]
    return "\n".join(lines) + "\n"


def lds_histogram_png(result: dict) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    vals = np.array([v for v in result["per_target"] if v is not None])
    fig = Figure(figsize=(5, 3))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.hist(vals, bins=min(30, max(5, vals.size // 3)), range=(-1, 1), color="tab:blue")
    ax.axvline(result["lds"], color="black", linestyle="--", linewidth=1, label=f"LDS {result['lds']:.3f}")
    ax.set_xlabel("Spearman correlation per target")
    ax.set_ylabel("targets")
    ax.set_title(f"LDS per target, experiment {result['exp_name']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()


def write_lds_report(config: EvaluateConfig, result: dict) -> tuple[str, bytes, list[str]]:
    md, png = lds_markdown(result), lds_histogram_png(result)
    files: list[str] = []
    if config.report_dir:
        out = Path(config.report_dir)
        out.mkdir(parents=True, exist_ok=True)
        exp = _safe(result["exp_name"])
        (out / f"{exp}_lds.md").write_text(md)
        (out / f"{exp}_lds_per_target.png").write_bytes(png)
        files = [str(out / f"{exp}_lds.md"), str(out / f"{exp}_lds_per_target.png")]
    return md, png, files


# ---------------------------------------------------------------------------- Prefect tasks
@task(name="plan-lds", cache_policy=NONE, persist_result=False)
def plan_truth_task(config: EvaluateConfig) -> TruthPlan:
    return plan_truth(config)


@task(name="train-subset-model", task_run_name="subset-{s}-seed-{r}", **RETRIED_TASK)
def train_subset_model_task(config: EvaluateConfig, folder: str, s: int, r: int, tasks: int = 1) -> SubsetModelManifest:
    """``tasks``: the subset models the flow trains, which sets this task's torch threads (threads_per_task)."""
    with torch_threads(threads_per_task(config, tasks)):
        return train_subset_model(config, folder, s, r)


@task(name="assemble-truth", cache_policy=NONE, persist_result=False)
def assemble_truth_task(config: EvaluateConfig, folder: str) -> str:
    return assemble_truth(config, folder)


@task(name="compute-lds", cache_policy=NONE, persist_result=False)
def compute_lds_task(config: EvaluateConfig, truth_path: str, trained: int = 0) -> dict:
    result = compute_lds(config, truth_path, trained)
    md, png, files = write_lds_report(config, result)
    exp = config.attribute.exp_name
    create_markdown_artifact(
        markdown=md, key=store_artifact_key(config.attribute.store, exp, "lds"), description=f"LDS of experiment {exp}"
    )
    create_markdown_artifact(
        markdown=image_markdown(png, "per-target Spearman correlations"),
        key=store_artifact_key(config.attribute.store, exp, "lds", "per-target"),
        description=f"per-target Spearman correlations, experiment {exp}",
    )
    return {**result, "files": files}


__all__ = [
    "recipe_config",
    "truth_identity",
    "plan_truth",
    "train_subset_model",
    "target_margins",
    "assemble_truth",
    "load_truth",
    "compute_lds",
    "lds_markdown",
    "write_lds_report",
]
