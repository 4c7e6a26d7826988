"""Prefect task of the train flow: one checkpoint per task run, with its plots as artifacts."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact

from . import trainer
from .attribution import RETRIED_TASK
from .common import threads_per_task, torch_threads
from .config import TrainConfig
from .report import image_markdown, store_artifact_key


@task(name="train-model", task_run_name="train-model-{index}", **RETRIED_TASK)
def train_model(config: TrainConfig, index: int, tasks: int = 1) -> dict:
    """``tasks``: the models the flow trains, which sets this task's torch threads (tasks.common.threads_per_task:
    concurrent trainings on all the cores each spin at each other's OpenMP barriers)."""
    with torch_threads(threads_per_task(config, tasks)):
        rec = trainer.train_one(config, index)
    if rec["skipped"]:
        return rec
    out = Path(config.out_dir)
    lines = [
        f"### model {index} (seed {rec['seed']})",
        "",
        "| what | value |",
        "|---|---|",
        f"| checkpoint | `{out / rec['path']}` |",
        f"| epochs / steps | {rec['epochs']} / {rec['steps']} |",
        f"| train rows | {rec['train_rows']} |",
        f"| final loss | {rec['final_loss']:.4f} |",
        f"| train accuracy | {rec['train_accuracy']:.3f} |",
    ]
    if rec.get("alpha_mean") is not None:
        lines.append(f"| α mean / median | {rec['alpha_mean']:.3f} / {rec['alpha_median']:.3f} |")
    create_markdown_artifact(
        markdown="\n".join(lines) + "\n",
        key=store_artifact_key(config.out_dir, "train-model", index),
        description=f"training summary of model {index}",
    )
    for name, file in rec["plots"].items():
        path = out / file
        if path.is_file():
            create_markdown_artifact(
                markdown=image_markdown(path.read_bytes(), name),
                key=store_artifact_key(config.out_dir, "train-model", index, name),
                description=f"{name} of model {index} ({path})",
            )
    return rec
