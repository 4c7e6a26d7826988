"""finalize: per checkpoint, sum the per-shard XᵀX partials (in shard order), solve, write the inverse."""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows.runners import ConfigTaskRunner, gather, run_lock, worker_api
from tasks import progress
from tasks.attribution import finalize_checkpoint, plan_attribution
from tasks.config import AttributeConfig
from tasks.plan import Plan, summarize


@flow(name="finalize", task_runner=ConfigTaskRunner(), validate_parameters=True)
def finalize(config: AttributeConfig, plan: Plan | None = None, upstream: dict | None = None) -> dict:
    """``upstream``: the featurize stage's summary when run inside ``attribute``; not read — passing it draws
    the edge featurize → this stage in the UI's flow-run graph."""
    with run_lock(config), worker_api(config):
        plan = plan or plan_attribution(config)
        progress.start("finalize", len(plan.models))
        ids = plan.model_ids
        manifests = gather(
            [finalize_checkpoint.submit(config, mid, tasks=len(ids)) for mid in ids], "finalize", lambda m: 1
        )
    out = summarize(manifests)
    log = get_run_logger()
    for m in manifests:
        info = m.info or {}
        log.info(
            "model_id=%s: condition number of %s+λI %.3g (lambda_reg=%s)%s",
            m.model_id,
            "XᵀRX" if info.get("curvature") == "ggn" else "XᵀX",
            info.get("condition", float("nan")),
            info.get("lambda_reg"),
            " [skipped]" if m.skipped else "",
        )
        for w in m.warnings:
            log.warning(w)
    return {**out, "manifests": manifests}
