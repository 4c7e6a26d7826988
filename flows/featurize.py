"""featurize: one task per (checkpoint, shard of train rows); each writes its own whole chunks."""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows.runners import ConfigTaskRunner, gather, run_lock, worker_api
from tasks import progress
from tasks.attribution import featurize_shard, fit_curvature, on_gpu, plan_attribution, reduce_curvature
from tasks.config import AttributeConfig
from tasks.plan import Plan, summarize
from trak_core import engine


@flow(name="featurize", task_runner=ConfigTaskRunner(), validate_parameters=True)
def featurize(config: AttributeConfig, plan: Plan | None = None) -> dict:
    """Projected train gradients X, weights Q and per-shard XᵀX partials for every checkpoint.
    ``plan`` (from the plan task) is computed when not given."""
    with run_lock(config), worker_api(config):
        plan = plan or plan_attribution(config)
        fit_task, shard_task = on_gpu(fit_curvature, featurize_shard)
        progress.start("featurize", plan.train_set_size * len(plan.models))
        if engine.fit_first(config.curvature, config.curvature_rows):  # one at a time (one record writer)
            for m in plan.models:
                fit_task.submit(config, m.model_id, m.checkpoint).result()
        jobs = plan.featurize_jobs()
        futures = [shard_task.submit(config, m.model_id, m.checkpoint, s, tasks=len(jobs)) for m, s in jobs]
        manifests = gather(futures, "featurize", lambda m: m.num_rows)
        if config.curvature in engine.FOLDED_CURVATURES:  # the shards' factor sums, one at a time (one record writer)
            for m in plan.models:
                reduce_curvature.submit(config, m.model_id).result()
    out = summarize(manifests)
    get_run_logger().info(
        "featurize: %d shard tasks, %d computed, %d skipped (complete in the store)",
        out["tasks"],
        out["computed"],
        out["skipped"],
    )
    return {**out, "manifests": manifests}
