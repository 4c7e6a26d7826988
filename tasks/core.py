"""The attribution steps of the pipeline as plain functions (no Prefect import; tasks/attribution.py wraps
them): each reads its inputs from the config, then calls the engine step (trak_core.engine) that TRAKer calls
too, and returns a manifest. Every step returns ``skipped=True`` when the store already holds its output.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from trak_core import engine, plan
from trak_core.featurize.budget import memory_limit
from trak_core.featurize.featurizer import Featurizer
from trak_core.plan import read_checkpoint
from trak_core.scoring.streaming import score_task_ranges
from trak_core.store import RunStore, StoreMetadata

from . import progress
from .common import adopt_train_source, cached_data, open_store
from .config import AttributeConfig, load_object
from .plan import FinalizeManifest, Plan, PlannedModel, ScoreBlockManifest, ScorePlan, ShardManifest, TargetsManifest


# ---------------------------------------------------------------------------- plan
def validate_inputs(config: AttributeConfig) -> plan.CheckedInputs:
    """Check everything that can be checked without computing gradients (:func:`trak_core.plan.check_inputs` of
    the config's model, task, data and checkpoints). Raises BadInputError naming the field."""
    adopt_train_source(config)
    return plan.check_inputs(
        config.settings,
        config.build_model(),
        config.build_task(),
        cached_data(config.train_data, "train_data"),
        cached_data(config.target_data, "target_data"),
        config.checkpoint_paths,
        location=config.store,
        storage_options=config.storage_options,
        batch_size=config.batch_size,
        chunk_rows=config.chunk_rows,
        shard_rows=config.shard_size,
        max_memory=config.max_memory,
        model_name=config.model,
        curvature_rows=config.curvature_rows,
        device=config.resolved_device(),
    )


def task_projector(config: AttributeConfig, meta: StoreMetadata, device: str, model: torch.nn.Module):
    """The projector of a featurize task: rebuilt from the store's metadata ``meta`` for ``model``."""
    return plan.task_projector(config.settings, meta, device, model, open_store(config))


def build_featurizer(config: AttributeConfig, checkpoint: str, store: RunStore) -> Featurizer:
    """The featurizer of a task: the projector rebuilt from the store's metadata (never probed again)."""
    device = config.resolved_device()
    return plan.task_featurizer(
        config.settings,
        store.meta,
        config.build_model(),
        config.build_task(),
        read_checkpoint(checkpoint, device),
        device,
        config.max_memory,
        store,
    )


def record_train_source(store: RunStore, config: AttributeConfig) -> None:
    """Record where the train data came from (``train_source``: its import path, and what the data callable
    says of its source, e.g. a folder), so a route that reads the store later (a query) sees the same rows."""
    source: dict = {"train_data": config.train_data}
    describe = getattr(load_object(config.train_data, "train_data", config.import_roots), "data_source", None)
    if callable(describe):
        source.update(describe())
    info = store.pipeline_info()
    if info.get("train_source") != source:
        store.set_pipeline_info({**info, "train_source": source})


def _plan_of(config: AttributeConfig, inputs: plan.CheckedInputs, grown_from: int | None = None) -> Plan:
    meta = inputs.meta
    models = tuple(PlannedModel(model_id=mid, checkpoint=path) for mid, path in enumerate(inputs.checkpoints))
    return Plan(
        store=config.store,
        exp_name=config.exp_name,
        train_set_size=meta.train_set_size,
        num_targets=inputs.num_targets,
        grad_dim=meta.grad_dim,
        proj_dim=meta.proj_dim,
        shard_rows=meta.shard_rows,
        chunk_rows=meta.chunk_rows,
        num_shards=meta.num_shards,
        models=models,
        grown_from=grown_from,
    )


def make_plan(config: AttributeConfig) -> Plan:
    """validate → fingerprint → check the existing store and create its arrays (:mod:`trak_core.plan`).

    Raises (BadInputError / StoreMismatchError, naming the field) before writing anything when the model,
    data, task, checkpoints or an existing store do not fit together.
    """
    inputs = validate_inputs(config)
    store, grown = plan.create_run(config.store, inputs, config.settings, config.exp_name, config.storage_options)
    record_train_source(store, config)
    return _plan_of(config, inputs, grown_from=grown)


# ---------------------------------------------------------------------------- featurize
def featurize_shard(config: AttributeConfig, model_id: int, checkpoint: str, shard: int) -> ShardManifest:
    """Projected gradients X and weights Q of one shard of train rows, then its XᵀX partial."""
    t0 = time.perf_counter()
    if config.processes_per_task > 1:  # the model sharded over several processes (tasks/sharded.py)
        from . import sharded

        skipped = sharded.featurize_shard(config, model_id, checkpoint, shard, task_projector)
        rows = open_store(config).meta.shard_range(shard)
        progress.advance("featurize", rows[1] - rows[0])
        return ShardManifest.timed(t0, skipped, model_id=model_id, shard=shard, rows=rows)
    store = open_store(config)
    data = cached_data(config.train_data, "train_data")
    skipped = engine.featurize_shard(
        store,
        model_id,
        shard,
        lambda: build_featurizer(config, checkpoint, store),
        lambda a, b: [t[a:b] for t in data],
        config.batch_size,
        device=config.resolved_device(),
        progress=lambda n: progress.advance("featurize", n),
        curvature_damping=config.curvature_damping,
        grad_wrt=config.grad_wrt,
    )
    return ShardManifest.timed(t0, skipped, model_id=model_id, shard=shard, rows=store.meta.shard_range(shard))


# ---------------------------------------------------------------------------- curvature
def fit_curvature(config: AttributeConfig, model_id: int, checkpoint: str) -> bool:
    """The Kronecker-factored curvature of one checkpoint, where a run fits it before the rows
    (:func:`trak_core.engine.fit_first`: ``kfac-eigen``, whose plan fitted model 0's already, or ``curvature_rows``
    given; else ``kfac`` / ``ekfac`` sum it per shard), fitted on every train row (or ``curvature_rows`` of them,
    evenly spaced) in batches of ``batch_size`` and recorded in the store before its shards are featurized
    (:func:`trak_core.engine.fit_curvature`; a checkpoint that has factors keeps them).
    Returns whether it fitted."""
    store = open_store(config)
    if not engine.needs_curvature(store, model_id):
        return False
    data = cached_data(config.train_data, "train_data")
    feat = build_featurizer(config, checkpoint, store)
    batches = engine.curvature_batches(data, config.curvature_rows, config.batch_size)
    engine.fit_curvature(store, model_id, feat, batches, config.curvature_damping, config.grad_wrt)
    return True


def reduce_curvature(config: AttributeConfig, model_id: int) -> bool:
    """The factors of one ``kfac`` / ``ekfac`` checkpoint from its shards' sums, recorded once every shard is
    featurized (:func:`trak_core.engine.record_folded`; nothing where they are recorded). Returns whether it did."""
    return engine.record_folded(open_store(config), model_id) is not None


# ---------------------------------------------------------------------------- finalize
def finalize_checkpoint(config: AttributeConfig, model_id: int) -> FinalizeManifest:
    """Σ shard partials (in shard order) → A = (XᵀX + λI)⁻¹ of one checkpoint, written to the store."""
    t0 = time.perf_counter()
    st = config.settings
    info, skipped, caught = engine.finalize(
        open_store(config), model_id, st.lambda_reg, st.rescale_inverse, device=config.resolved_device()
    )
    progress.advance("finalize", 1)
    return FinalizeManifest.timed(t0, skipped, model_id=model_id, info=info, warnings=caught)


# ---------------------------------------------------------------------------- targets and scores
def featurize_targets(config: AttributeConfig, model_id: int, checkpoint: str) -> TargetsManifest:
    """Projected gradients G of all targets of the experiment for one checkpoint."""
    t0 = time.perf_counter()
    store = open_store(config)
    data = cached_data(config.target_data, "target_data")
    skipped = engine.featurize_targets(
        store,
        config.exp_name,
        model_id,
        lambda: build_featurizer(config, checkpoint, store),
        lambda a, b: [t[a:b] for t in data],
        config.batch_size,
    )
    progress.advance("targets", 1)
    return TargetsManifest.timed(t0, skipped, model_id=model_id, exp_name=config.exp_name)


def prepare_scores(config: AttributeConfig, model_ids: list[int]) -> ScorePlan:
    """Which checkpoints are combined (each one's G·A written once, :func:`trak_core.engine.prepare_scores`) and
    the score blocks (:func:`score_ranges`). Call once, before fanning out score_block."""
    store = open_store(config)
    used = engine.prepare_scores(store, config.exp_name, model_ids)
    return ScorePlan(model_ids=tuple(used), blocks=score_ranges(config, store, used))


def score_ranges(config: AttributeConfig, store: RunStore, used: list[int]) -> tuple[tuple[int, int], ...]:
    """The train-row ranges of the score tasks (:func:`trak_core.scoring.streaming.score_task_ranges` for this run)."""
    meta, m = store.meta, store.num_targets(config.exp_name)
    return score_task_ranges(
        meta.train_set_size, meta.rows_per_shard, meta.proj_dim, m, len(used), config.score_task_rows, config.task_slots
    )


def score_block(config: AttributeConfig, model_ids: list[int], a: int, b: int) -> ScoreBlockManifest:
    """Combined scores of train rows [a, b) against all targets: the rows not yet marked done (a rerun after a
    crash inside the block computes only its shards that were not finished)."""
    t0 = time.perf_counter()
    with memory_limit(config.max_memory):
        skipped = engine.score_block(
            open_store(config), config.exp_name, model_ids, a, b, progress=lambda n: progress.advance("score", n)
        )
    return ScoreBlockManifest.timed(t0, skipped, rows=(a, b))


# ---------------------------------------------------------------------------- nothing to do?
def up_to_date(config: AttributeConfig) -> Plan | None:
    """The plan when the store already holds everything ``config`` asks for — every checkpoint finalized,
    every target gradient written, every score row combined from all checkpoints, the report's table on
    disk — else None. Runs the plan's checks first (a store that does not match the config still raises,
    naming the field) and writes nothing: the CLI answers a no-op run without starting Prefect."""
    if plan.stored_meta(config.store, config.storage_options) is None:
        return None
    inputs = validate_inputs(config)
    plan.check_against_store(config.store, inputs, config.settings, config.exp_name, config.storage_options)
    if not plan.run_complete(config.store, inputs, config.exp_name, config.storage_options):
        return None
    if (
        config.report_targets
        and config.report_dir
        and not (Path(config.report_dir) / f"{config.exp_name}_top_k.md").exists()
    ):
        return None
    return _plan_of(config, inputs)
