"""Prefect tasks of the attribution DAG: thin wrappers over tasks.core / tasks.report.

Every task returns a small manifest (never arrays), is idempotent through the store (a re-run skips
complete work), does not use Prefect's result cache (``cache_policy=NONE``: the store is the truth),
and retries transient failures but not bad input (``retry_condition_fn``).
"""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE

from . import core, report
from .common import GPU_TAG, should_retry, threads_per_task, torch_threads
from .config import AttributeConfig
from .plan import FinalizeManifest, Plan, ScoreBlockManifest, ScorePlan, ShardManifest, TargetsManifest

RETRIES = 2
RETRY_DELAY_SECONDS = 2


def retry_unless_bad_input(task, task_run, state) -> bool:
    """Prefect retry_condition_fn: no retry for bad input, a mismatching or damaged store, or a full disk
    (tasks.common.should_retry)."""
    exc = state.data if isinstance(state.data, BaseException) else None
    return should_retry(exc)


#: the options of every retried pipeline task (attribution, training, evaluation)
RETRIED_TASK = dict(
    cache_policy=NONE,
    persist_result=False,
    retries=RETRIES,
    retry_delay_seconds=RETRY_DELAY_SECONDS,
    retry_condition_fn=retry_unless_bad_input,
)


def gpu_limited() -> bool:
    """Whether the Prefect API has a concurrency limit on the tag ``trakflow-gpu``
    (``prefect concurrency-limit create trakflow-gpu N``). An API that does not answer counts as yes."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    try:
        with get_client(sync_client=True) as client:
            client.read_concurrency_limit_by_tag(GPU_TAG)
    except ObjectNotFound:
        return False
    except Exception:  # no answer: tag the tasks, so that a limit that exists still holds
        return True
    return True


def on_gpu(*tasks):
    """The tasks that run model code, tagged ``trakflow-gpu`` when a limit on that tag exists (checked once, as
    the flow starts them), else as they are. Prefect takes a lease from the server for every start of a tagged
    task, limit or not; untagged tasks take none."""
    if not gpu_limited():
        return tasks
    return tuple(t.with_options(tags={*t.tags, GPU_TAG}) for t in tasks)


@task(name="plan", cache_policy=NONE, persist_result=False)
def plan_attribution(config: AttributeConfig) -> Plan:
    """Validate model/data/checkpoints/store together, then create the store's arrays (one writer)."""
    return core.make_plan(config)


@task(name="featurize-shard", task_run_name="featurize-m{model_id}-s{shard}", **RETRIED_TASK)
def featurize_shard(
    config: AttributeConfig, model_id: int, checkpoint: str, shard: int, tasks: int = 1
) -> ShardManifest:
    """``tasks``: the stage's number of tasks, which sets this task's torch and OpenBLAS threads
    (tasks.common.threads_per_task); the other stages' tasks take it too."""
    with torch_threads(threads_per_task(config, tasks)):
        return core.featurize_shard(config, model_id, checkpoint, shard)


@task(name="fit-curvature", task_run_name="curvature-m{model_id}", **RETRIED_TASK)
def fit_curvature(config: AttributeConfig, model_id: int, checkpoint: str, tasks: int = 1) -> bool:
    """Kronecker-factored curvature of one checkpoint (``curvature: kfac`` / ``ekfac``), before its shards."""
    with torch_threads(threads_per_task(config, tasks)):
        return core.fit_curvature(config, model_id, checkpoint)


@task(name="reduce-curvature", task_run_name="curvature-sums-m{model_id}", **RETRIED_TASK)
def reduce_curvature(config: AttributeConfig, model_id: int) -> bool:
    """Kronecker factors of one checkpoint (``curvature: kfac`` / ``ekfac``) from its shards' sums, recorded."""
    return core.reduce_curvature(config, model_id)


@task(name="finalize-checkpoint", task_run_name="finalize-m{model_id}", **RETRIED_TASK)
def finalize_checkpoint(config: AttributeConfig, model_id: int, tasks: int = 1) -> FinalizeManifest:
    with torch_threads(threads_per_task(config, tasks)):
        return core.finalize_checkpoint(config, model_id)


@task(name="featurize-targets", task_run_name="targets-m{model_id}", **RETRIED_TASK)
def featurize_targets(config: AttributeConfig, model_id: int, checkpoint: str, tasks: int = 1) -> TargetsManifest:
    with torch_threads(threads_per_task(config, tasks)):
        return core.featurize_targets(config, model_id, checkpoint)


@task(name="prepare-scores", cache_policy=NONE, persist_result=False)
def prepare_scores(config: AttributeConfig, model_ids: list[int]) -> ScorePlan:
    return core.prepare_scores(config, model_ids)


@task(name="score-block", task_run_name="score-rows-{a}-{b}", **RETRIED_TASK)
def score_block(config: AttributeConfig, model_ids: list[int], a: int, b: int, tasks: int = 1) -> ScoreBlockManifest:
    with torch_threads(threads_per_task(config, tasks)):
        return core.score_block(config, model_ids, a, b)


@task(name="report-top-k", cache_policy=NONE, persist_result=False)
def report_top_k(config: AttributeConfig) -> dict:
    """Top proponents/opponents per target: files in report_dir and Prefect artifacts (markdown table,
    one image per target)."""
    summary, pngs = report.build_report(config)
    exp = config.exp_name
    create_markdown_artifact(
        markdown=summary["markdown"],
        key=report.store_artifact_key(config.store, exp, "top-k"),
        description=f"top-{config.top_k} proponents/opponents, experiment {exp}",
    )
    for j, png in pngs.items():
        create_markdown_artifact(
            markdown=report.image_markdown(png, f"target {j}"),
            key=report.store_artifact_key(config.store, exp, "target", j),
            description=f"target {j} and its top proponents (top row) / opponents (bottom row)"
            if not summary.get("text")
            else f"target {j} and its top proponents / opponents (text)",
        )
    create_markdown_artifact(
        markdown=report.image_markdown(summary["histogram_png"], "score histogram"),
        key=report.store_artifact_key(config.store, exp, "score-histogram"),
        description=f"histogram of all scores of experiment {exp}",
    )
    return {k: v for k, v in summary.items() if k not in ("markdown", "histogram_png")}
