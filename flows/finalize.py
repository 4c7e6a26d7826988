"""finalize: per checkpoint, sum the per-shard XᵀX partials (in shard order), solve, write features."""

from __future__ import annotations

from typing import Optional

from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from tasks import progress
from tasks.attribution import finalize_checkpoint, plan_attribution
from tasks.common import summarize
from trak_core.config import AttributeConfig

from flows.runners import gather, run_lock, worker_api


@flow(name="finalize", task_runner=ThreadPoolTaskRunner(max_workers=2), validate_parameters=True)
def finalize(config: AttributeConfig, plan: Optional[dict] = None) -> dict:
    with run_lock(config), worker_api(config):
        plan = plan or plan_attribution(config)
        progress.start("finalize", len(plan["models"]))
        manifests = gather([finalize_checkpoint.submit(config, m["model_id"]) for m in plan["models"]],
                           "finalize", lambda m: 1)
    out = summarize(manifests)
    log = get_run_logger()
    for m in manifests:
        info = m.get("info") or {}
        log.info("model_id=%s: condition number of XᵀX+λI %.3g (lambda_reg=%s)%s", m["model_id"],
                 info.get("condition", float("nan")), info.get("lambda_reg"), " [skipped]" if m["skipped"] else "")
        for w in m.get("warnings", []):
            log.warning(w)
    return {**out, "manifests": manifests}
