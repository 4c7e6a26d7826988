"""evaluate: counterfactual LDS of an experiment — (attribute →) plan → train subset models → truth → LDS."""

from __future__ import annotations

import time

from prefect import flow, get_run_logger

from flows.attribute import attribute
from flows.runners import ConfigTaskRunner, gather
from tasks import progress
from tasks.attribution import on_gpu
from tasks.config import EvaluateConfig
from tasks.evaluate import assemble_truth_task, compute_lds_task, plan_truth_task, train_subset_model_task
from tasks.plan import summarize


@flow(name="evaluate", task_runner=ConfigTaskRunner(), validate_parameters=True)
def evaluate(config: EvaluateConfig) -> dict:
    """LDS of ``config.attribute``'s experiment: the mean over targets of the Spearman correlation, over
    ``num_subsets`` random train subsets, between the summed scores of a subset and the target's margin
    under a model trained on it. Subset models are trained one task each (the train flow's code) and
    cached under ``cache_dir``; a re-run trains nothing."""
    t0 = time.perf_counter()
    log = get_run_logger()
    attr = None
    if config.run_attribute:
        attr = attribute(config.attribute)
    plan = plan_truth_task(config)
    log.info("ground truth %s: %d subset models, %d to train", plan.folder, plan.models, plan.to_train)
    progress.start("lds-train", len(plan.jobs))
    (subset_task,) = on_gpu(train_subset_model_task)
    trained = gather([subset_task.submit(config, plan.folder, s, r, tasks=len(plan.jobs)) for s, r in plan.jobs])
    stats = summarize(trained) if trained else {"tasks": 0, "computed": 0, "skipped": 0, "seconds": 0.0}
    truth = assemble_truth_task(config, plan.folder)
    result = compute_lds_task(config, truth, stats["computed"])
    log.info(
        "LDS of experiment %r: %.4f [%.3f, %.3f] over %d targets, %d subsets (%d models trained now)",
        config.attribute.exp_name,
        result["lds"],
        *result["ci95"],
        result["num_targets"],
        result["num_subsets"],
        stats["computed"],
    )
    return {**result, "attribute": attr, "train": stats, "seconds": round(time.perf_counter() - t0, 3)}
