"""train: N checkpoints (one task each) for TRAK, with loss and cockpit's α tracked per step, and a
manifest.json the attribute flow can take as ``checkpoints``."""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows.runners import ConfigTaskRunner, gather
from tasks import progress
from tasks.attribution import on_gpu
from tasks.config import TrainConfig
from tasks.plan import summarize
from tasks.trainer import write_manifest
from tasks.training import train_model


@flow(name="train", task_runner=ConfigTaskRunner(), validate_parameters=True)
def train(config: TrainConfig) -> dict:
    progress.start("train", config.num_models * config.epochs)
    (train_task,) = on_gpu(train_model)
    records = gather([train_task.submit(config, i, tasks=config.num_models) for i in range(config.num_models)])
    manifest = write_manifest(config, records)
    out = summarize(records)
    get_run_logger().info(
        "train: %d models (%d trained, %d already there); manifest %s",
        out["tasks"],
        out["computed"],
        out["skipped"],
        manifest,
    )
    return {**out, "manifest": manifest, "models": records}
