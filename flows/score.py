"""score: target gradients per checkpoint, then block-wise scoring tasks combining the checkpoints."""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows.runners import ConfigTaskRunner, gather, run_lock, worker_api
from tasks import progress
from tasks.attribution import featurize_targets, on_gpu, plan_attribution, prepare_scores, score_block
from tasks.config import AttributeConfig
from tasks.plan import Plan, summarize


@flow(name="score", task_runner=ConfigTaskRunner(), validate_parameters=True)
def score(config: AttributeConfig, plan: Plan | None = None, upstream: dict | None = None) -> dict:
    """``upstream``: the finalize stage's summary when run inside ``attribute``; not read — passing it draws
    the edge finalize → this stage in the UI's flow-run graph."""
    with run_lock(config), worker_api(config):
        plan = plan or plan_attribution(config)
        progress.start("targets", len(plan.models))
        (targets_task,) = on_gpu(featurize_targets)
        targets = gather(
            [targets_task.submit(config, m.model_id, m.checkpoint, tasks=len(plan.models)) for m in plan.models],
            "targets",
            lambda m: 1,
        )
        prep = prepare_scores(config, plan.model_ids)
        model_ids = list(prep.model_ids)
        progress.start("score", plan.train_set_size)
        blocks = gather(
            [score_block.submit(config, model_ids, a, b, tasks=len(prep.blocks)) for a, b in prep.blocks],
            "score",
            lambda m: m.num_rows,
        )
    t, s = summarize(targets), summarize(blocks)
    get_run_logger().info(
        "score: targets %d/%d computed, score blocks %d/%d computed, checkpoints combined: %s",
        t["computed"],
        t["tasks"],
        s["computed"],
        s["tasks"],
        model_ids,
    )
    return {
        "targets": {**t, "manifests": targets},
        "blocks": {**s, "manifests": blocks},
        "model_ids": model_ids,
        "computed": t["computed"] + s["computed"],
        "skipped": t["skipped"] + s["skipped"],
        "tasks": t["tasks"] + s["tasks"],
    }
