"""attribute: the whole DAG — plan → featurize → finalize → score → report."""

from __future__ import annotations

import time

from prefect import flow, get_run_logger

from flows.featurize import featurize
from flows.finalize import finalize
from flows.runners import ConfigTaskRunner, run_lock, stage_runners, worker_api
from flows.score import score
from tasks.attribution import plan_attribution, report_top_k
from tasks.config import AttributeConfig


@flow(name="attribute", task_runner=ConfigTaskRunner(), validate_parameters=True)
def attribute(config: AttributeConfig) -> dict:
    """TRAK scores of every train example for every target, stored in ``config.store`` under
    ``config.exp_name``; the same numbers as trak_core.TRAKer on the same inputs. Re-running skips what
    the store already holds. Holds the store's run lock; the stages run on ``config.task_runner``."""
    t0 = time.perf_counter()
    log = get_run_logger()
    with run_lock(config), worker_api(config), stage_runners(config) as runner:
        plan = plan_attribution(config)
        log.info(
            "plan: %d train rows in %d shards, %d targets, %d checkpoints, grad_dim=%d → proj_dim=%d, store %s",
            plan.train_set_size,
            plan.num_shards,
            plan.num_targets,
            len(plan.models),
            plan.grad_dim,
            plan.proj_dim,
            plan.store,
        )
        if plan.grown_from is not None:
            log.info(
                "the store grew from %d to %d train rows: featurizing the new rows only, solving every checkpoint "
                "again (XᵀX changed) and recomputing experiment %r's scores over all %d rows",
                plan.grown_from,
                plan.train_set_size,
                plan.exp_name,
                plan.train_set_size,
            )
        f = featurize.with_options(task_runner=runner())(config, plan)
        # upstream=: the previous stage's result, so the UI's graph draws featurize → finalize → score
        fi = finalize.with_options(task_runner=runner())(config, plan, upstream=f)
        sc = score.with_options(task_runner=runner())(config, plan, upstream=fi)
        rep = report_top_k(config) if config.report_targets else None
    if rep and rep.get("label_agreement") is not None:
        log.info("fraction of top-%d proponents sharing the target's label: %.2f", config.top_k, rep["label_agreement"])
    return {
        "store": config.store,
        "exp_name": config.exp_name,
        "plan": plan,
        "featurize": f,
        "finalize": fi,
        "score": sc,
        "report": rep,
        "seconds": round(time.perf_counter() - t0, 3),
    }
