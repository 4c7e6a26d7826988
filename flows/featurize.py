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
        fits = {}  # each checkpoint's factors are its own (curvature/<id>): its tasks run beside the others'
        if engine.fit_first(config.curvature, config.curvature_rows):  # before that checkpoint's shards
            fits = {
                m.model_id: fit_task.submit(config, m.model_id, m.checkpoint, tasks=len(plan.models))
                for m in plan.models
            }
        jobs = plan.featurize_jobs()
        futures = [
            shard_task.submit(
                config, m.model_id, m.checkpoint, s, tasks=len(jobs), wait_for=[fits[m.model_id]] if fits else None
            )
            for m, s in jobs
        ]
        reduces = []
        if config.curvature in engine.FOLDED_CURVATURES:  # the factors from a checkpoint's shard sums, once all are in
            shards_of = {
                m.model_id: [f for (j, _), f in zip(jobs, futures, strict=True) if j.model_id == m.model_id]
                for m in plan.models
            }
            reduces = [reduce_curvature.submit(config, mid, wait_for=fs) for mid, fs in shards_of.items()]
        gather(list(fits.values()))  # a failed fit is raised as itself, not as its shards' missing upstream
        manifests = gather(futures, "featurize", lambda m: m.num_rows)
        gather(reduces)
    out = summarize(manifests)
    get_run_logger().info(
        "featurize: %d shard tasks, %d computed, %d skipped (complete in the store)",
        out["tasks"],
        out["computed"],
        out["skipped"],
    )
    return {**out, "manifests": manifests}
