"""Training one checkpoint for TRAK (plain function; tasks/training.py wraps it as a Prefect task).

Per model ``i`` of a :class:`~tasks.config.TrainConfig` in ``out_dir``:

* ``model_{i:03d}.pt``       the state_dict (written atomically: tmp file, then rename);
* ``model_{i:03d}.step{s}.pt`` the state_dict after optimizer step ``s``, one per ``snapshots`` fraction below 1
                             (the step nearest the fraction of the run's steps; none that is the last step);
* ``model_{i:03d}.json``     its record (seed, subset, losses, accuracy, α per step); written last, so
                             a model is complete when its record exists;
* ``model_{i:03d}.subset.npy`` the train rows it saw (only with ``subset_fraction < 1``);
* ``model_{i:03d}.loss.png``, ``.alpha_trace.png``, ``.alpha_gauge.png`` its plots.

The train flow writes ``manifest.json`` listing the checkpoints; the attribute flow reads it.
cockpit's α is tracked when ``trak_core.alpha`` is importable and ``alpha_every > 0``.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from trak_core.errors import BadInputError

from . import progress
from .config import TrainConfig, load_data, load_object

# torch's process-global state, one thread at a time: seeding + building a model (torch.manual_seed is global),
# and α (torch.func.jvp's forward-AD levels are global: two threads inside jvp fail with "forward AD level with an
# invalid index"; and its torch.random.fork_rng restores the global RNG on exit, which would overwrite a seed set
# by another thread before its model is built)
_TORCH_STATE_LOCK = threading.Lock()


def model_stem(out_dir: str | Path, index: int) -> Path:
    return Path(out_dir) / f"model_{index:03d}"


def is_complete(out_dir: str | Path, index: int, snapshots: list[float] | None = None) -> bool:
    """Whether model ``index`` is trained: its checkpoint and record exist, and (with ``snapshots``) the record
    was made with those snapshot fractions and its snapshot files exist."""
    stem = model_stem(out_dir, index)
    if not (stem.with_suffix(".pt").is_file() and stem.with_suffix(".json").is_file()):
        return False
    if snapshots is None:
        return True
    try:
        record = json.loads(stem.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return False
    taken = record.get("snapshots") or []
    return record.get("snapshot_fractions", [1.0]) == sorted(set(snapshots)) and all(
        (Path(out_dir) / snap["path"]).is_file() for snap in taken
    )


def snapshot_steps(fractions: list[float], total_steps: int) -> dict[int, float]:
    """{step: fraction} of the snapshots before the end of a run of ``total_steps`` optimizer steps: the step
    nearest each fraction below 1 (at least 1); a fraction that lands on the last step is the run's own
    checkpoint, and two that land on one step give one snapshot."""
    out: dict[int, float] = {}
    for f in sorted(fractions):
        step = max(1, round(f * total_steps))
        if f < 1.0 and step < total_steps:
            out.setdefault(step, f)
    return out


def _save_state(model: torch.nn.Module, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, tmp)
    os.replace(tmp, path)


def _per_sample_ce(outputs, targets):
    return F.cross_entropy(outputs, targets, reduction="none")


def _alpha_tracker(every: int):
    if every <= 0:
        return None
    try:
        from trak_core.alpha import Alpha
    except ImportError:
        return None
    return Alpha(_per_sample_ce, track_schedule=lambda step: step % every == 0)


def _plot_loss(losses: list[float], path: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(np.arange(len(losses)), losses, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (batch mean)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=90)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def train_one(config: TrainConfig, index: int) -> dict:
    """Train model ``index``; returns its record (small: no tensors). Skips a complete model unless
    ``config.overwrite``."""
    t0 = time.perf_counter()
    out = Path(config.out_dir)
    stem = model_stem(out, index)
    if not config.overwrite and is_complete(out, index, config.snapshots):
        record = json.loads(stem.with_suffix(".json").read_text())
        progress.advance("train", config.epochs)
        return {**_brief(record), "skipped": True, "seconds": round(time.perf_counter() - t0, 4)}
    out.mkdir(parents=True, exist_ok=True)
    seed = config.model_seeds()[index]
    device = config.resolved_device()

    inputs, labels = _load_xy(config)
    n = labels.shape[0]
    subset = None
    if config.subset_fraction < 1.0:
        size = max(1, int(round(config.subset_fraction * n)))
        subset = np.sort(np.random.default_rng(seed).choice(n, size=size, replace=False))
        rows = torch.from_numpy(subset)
        inputs, labels = tuple(t[rows] for t in inputs), labels[rows]

    model = new_model(config, seed).to(device)
    # α's JVP calls model(x) with one input tensor: track it for single-input models only
    alpha = _alpha_tracker(config.alpha_every) if len(inputs) == 1 else None
    inputs, labels = tuple(t.to(device) for t in inputs), labels.to(device)
    steps = snapshot_steps(config.snapshots, config.epochs * math.ceil(labels.shape[0] / config.batch_size))
    snaps: list[dict] = []

    def snapshot(step: int) -> None:
        if step in steps:
            path = stem.with_name(f"{stem.name}.step{step}.pt")
            _save_state(model, path)
            snaps.append({"fraction": steps[step], "step": step, "path": path.name})

    fit = fit_model(
        config, model, inputs, labels, seed, alpha=alpha, what=f"model {index}", on_step=snapshot if steps else None
    )
    losses, epoch_loss, step, acc = fit["losses"], fit["epoch_loss"], fit["steps"], fit["train_accuracy"]

    ckpt = stem.with_suffix(".pt")
    _save_state(model, ckpt)
    if subset is not None:
        np.save(stem.with_name(stem.name + ".subset.npy"), subset)

    plots = {"loss": str(stem.with_name(stem.name + ".loss.png"))}
    _plot_loss(losses, Path(plots["loss"]), f"model {index} (seed {seed})")
    alpha_out: dict | None = None
    if alpha is not None:
        from trak_core.alpha_plots import plot_alpha_gauge, plot_alpha_trace

        alpha_out = {int(k): (None if v is None else float(v)) for k, v in alpha.get_output().items()}
        plots["alpha_trace"] = str(
            plot_alpha_trace(alpha_out, stem.with_name(stem.name + ".alpha_trace.png"), title=f"α, model {index}")
        )
        plots["alpha_gauge"] = str(
            plot_alpha_gauge(alpha_out, stem.with_name(stem.name + ".alpha_gauge.png"), title=f"α gauge, model {index}")
        )
    finite = [v for v in (alpha_out or {}).values() if v is not None and math.isfinite(v)]
    record = {
        "index": index,
        "path": ckpt.name,
        "seed": seed,
        "epochs": config.epochs,
        "steps": step,
        "optimizer": config.optimizer,
        "lr": config.lr,
        "momentum": config.momentum,
        "weight_decay": config.weight_decay,
        "batch_size": config.batch_size,
        "train_rows": int(labels.shape[0]),
        "subset": None if subset is None else stem.with_name(stem.name + ".subset.npy").name,
        "epoch_loss": epoch_loss,
        "final_loss": epoch_loss[-1] if epoch_loss else None,
        "train_accuracy": acc,
        "alpha": None if alpha_out is None else {str(k): v for k, v in alpha_out.items()},
        "alpha_mean": float(np.mean(finite)) if finite else None,
        "alpha_median": float(np.median(finite)) if finite else None,
        "plots": {k: Path(v).name for k, v in plots.items()},
        "snapshot_fractions": list(config.snapshots),
        "snapshots": snaps,
    }
    _atomic_write_text(stem.with_suffix(".json"), json.dumps(record, indent=1))
    return {**_brief(record), "skipped": False, "seconds": round(time.perf_counter() - t0, 4)}


def _brief(record: dict) -> dict:
    keep = (
        "index",
        "path",
        "seed",
        "epochs",
        "steps",
        "train_rows",
        "subset",
        "final_loss",
        "train_accuracy",
        "alpha_mean",
        "alpha_median",
        "plots",
        "snapshots",
    )
    return {k: record.get(k) for k in keep}


def split_xy(data: tuple, field: str = "train_data") -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """(inputs, integer labels) of a data tuple: the labels are the last tensor (1-d integers), the inputs
    the tensors before it (one for images, ``(input_ids, token_type_ids, attention_mask)`` for text)."""
    if len(data) < 2 or data[-1].dim() != 1 or data[-1].dtype.is_floating_point:
        raise BadInputError(
            f"{field}: training needs (inputs..., integer labels) tensors, got "
            f"{[(tuple(t.shape), str(t.dtype)) for t in data]}"
        )
    return tuple(data[:-1]), data[-1].long()


def _load_xy(config: TrainConfig) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    return split_xy(load_data(config.train_data, "train_data"))


def forward(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Logits of a batch. One input: ``model(x)``; three: TRAK's text_classification convention
    ``model(input_ids=, token_type_ids=, attention_mask=)`` (``.logits`` of a Hugging Face output is
    taken); otherwise ``model(*inputs)``."""
    if len(inputs) == 1:
        out = model(inputs[0])
    elif len(inputs) == 3:
        out = model(input_ids=inputs[0], token_type_ids=inputs[1], attention_mask=inputs[2])
    else:
        out = model(*inputs)
    return out.logits if hasattr(out, "logits") else out


def new_model(config: TrainConfig, seed: int) -> torch.nn.Module:
    """A fresh model from ``config.model`` with ``torch.manual_seed(seed)`` (under a process-wide lock:
    the seed is global)."""
    with _TORCH_STATE_LOCK:
        torch.manual_seed(seed)
        model = load_object(config.model, "model")()
    if not isinstance(model, torch.nn.Module):
        raise BadInputError(f"model: {config.model!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def fit_model(
    config: TrainConfig,
    model: torch.nn.Module,
    inputs: tuple[torch.Tensor, ...],
    labels: torch.Tensor,
    seed: int,
    *,
    alpha=None,
    what: str = "model",
    progress_stage: str | None = "train",
    on_step=None,
) -> dict:
    """The training recipe of ``config`` (optimizer, lr, momentum, weight decay, epochs, batch size; batch
    order from ``seed``) applied to ``model`` on the given rows, in place. Returns the losses per step and
    per epoch, the number of steps and the train accuracy (the model is left in eval mode). ``on_step(k)``
    after the k-th optimizer step (k = 1, 2, ...), e.g. to save a snapshot."""
    if config.optimizer == "sgd":
        opt = torch.optim.SGD(
            model.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    else:
        opt = torch.optim.Adam(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    gen = torch.Generator().manual_seed(seed)
    device = labels.device
    n = labels.shape[0]
    losses: list[float] = []
    epoch_loss: list[float] = []
    step = 0
    model.train()
    for _epoch in range(config.epochs):
        perm = torch.randperm(n, generator=gen).to(device)
        total = 0.0
        for s in range(0, n, config.batch_size):
            idx = perm[s : s + config.batch_size]
            x, y = tuple(t[idx] for t in inputs), labels[idx]
            opt.zero_grad(set_to_none=True)
            loss = _per_sample_ce(forward(model, x), y).mean()
            if not torch.isfinite(loss):
                raise FloatingPointError(f"{what}: non-finite loss at step {step}; lower lr")
            loss.backward()
            if alpha is not None and alpha.should_track(step):
                with _TORCH_STATE_LOCK:
                    alpha.track(step, model, x[0], y)
            opt.step()
            value = loss.detach().item()
            losses.append(value)
            total += value * y.shape[0]
            step += 1
            if on_step is not None:
                on_step(step)
        epoch_loss.append(total / n)
        if progress_stage:
            progress.advance(progress_stage, 1)
    if alpha is not None:
        with _TORCH_STATE_LOCK:
            alpha.finish(model)
    model.eval()
    with torch.no_grad():
        acc = float((forward(model, inputs).argmax(dim=1) == labels).float().mean())
    return {"losses": losses, "epoch_loss": epoch_loss, "steps": step, "train_accuracy": acc}


def train_on_rows(
    config: TrainConfig, seed: int, rows: np.ndarray | None = None, data: tuple | None = None
) -> torch.nn.Module:
    """A fresh model (seed ``seed``) trained with ``config``'s recipe on ``rows`` of the train data (all rows
    when None) — what the train flow does for one checkpoint, without files; used by the evaluate flow's
    counterfactual (subset) models. ``data`` (the train tuple) avoids reloading it."""
    inputs, labels = split_xy(data if data is not None else load_data(config.train_data, "train_data"))
    if rows is not None:
        r = torch.as_tensor(np.asarray(rows), dtype=torch.long)
        inputs, labels = tuple(t[r] for t in inputs), labels[r]
    device = config.resolved_device()
    model = new_model(config, seed).to(device)
    fit_model(config, model, tuple(t.to(device) for t in inputs), labels.to(device), seed, progress_stage=None)
    return model


def write_manifest(config: TrainConfig, records: list[dict]) -> str:
    """manifest.json: the checkpoints (paths relative to the manifest) and the config that made them."""
    out = Path(config.out_dir)
    records = sorted(records, key=lambda r: r["index"])
    checkpoints = []
    for r in records:
        entry = {k: v for k, v in r.items() if k not in ("skipped", "seconds", "snapshots")}
        for snap in r.get("snapshots") or []:  # each snapshot is a checkpoint of its own
            checkpoints.append({**entry, "path": snap["path"], "snapshot": snap["fraction"], "steps": snap["step"]})
        checkpoints.append({**entry, "snapshot": 1.0})
    body = {"kind": "trakflow-checkpoints", "config": config.model_dump(mode="json"), "checkpoints": checkpoints}
    path = out / "manifest.json"
    _atomic_write_text(path, json.dumps(body, indent=1))
    return str(path)
