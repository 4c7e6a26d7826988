"""The attribution steps of the pipeline as plain functions (no Prefect import; tasks/attribution.py wraps
them): each reads its inputs from the config, then calls the engine step (trak_core.engine) that TRAKer calls
too, and returns a manifest. Every step returns ``skipped=True`` when the store already holds its output.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from trak_core import engine
from trak_core.adapters import load_state
from trak_core.budget import memory_limit
from trak_core.checkpoints import record_of, state_digest
from trak_core.energy import PROBE_ROWS
from trak_core.errors import BadInputError, StoreMismatchError
from trak_core.featurize import Featurizer
from trak_core.gradients import FunctionalGradientComputer, grad_dim_of
from trak_core.lds import array_fingerprint
from trak_core.projectors import make_projector, projector_traits, rebuild_kwargs
from trak_core.store import RunStore, StoreMetadata, store_exists
from trak_core.store import open_store as open_location
from trak_core.store.verify import repair_store, verify_store
from trak_core.streaming import score_task_ranges

from . import progress
from .common import cached_data, load_checkpoint, open_store
from .config import AttributeConfig, load_object
from .plan import FinalizeManifest, Plan, PlannedModel, ScoreBlockManifest, ScorePlan, ShardManifest, TargetsManifest


# ---------------------------------------------------------------------------- helpers
def _prefixed(field: str, e: Exception) -> BadInputError:
    msg = str(e)
    return BadInputError(msg if msg.startswith(field) else f"{field}: {msg}")


def build_projector(
    config: AttributeConfig, grad_dim: int, device: str, model: torch.nn.Module, split: dict | None = None
):
    """The projector of the config (``factored`` takes its blocks from the model's layers; ``split``: its split
    keywords, :func:`factored_split` or the store's record, :func:`split_of`; None: the equal split)."""
    st = config.settings
    try:
        return make_projector(
            st.projector,
            grad_dim,
            st.proj_dim,
            st.proj_seed,
            st.proj_type,
            device=device,
            model=model,
            grad_wrt=st.grad_wrt,
            **((split or {}) if projector_traits(st.projector).splits_by_layer else {}),
        )
    except BadInputError as e:
        raise _prefixed("projector", e) from None


def split_of(meta: StoreMetadata) -> dict | None:
    """The factored projector's split keywords a store's metadata records (None: another projector)."""
    if not projector_traits(meta.projector).splits_by_layer:
        return None
    try:
        return rebuild_kwargs(meta.projector, dict(meta.projector_params))
    except BadInputError as e:
        raise StoreMismatchError(f"projector_params: the store cannot be read here ({e})") from None


def factored_split(config: AttributeConfig, model: torch.nn.Module, task, train: tuple, checkpoint: str) -> dict:
    """The split keywords of a new store's factored projector (:func:`trak_core.engine.probe_split`), probed on
    the first :data:`~trak_core.energy.PROBE_ROWS` train rows at ``checkpoint`` (the first), on the CPU. Computed
    once, by the plan: the store records them and every task rebuilds the projector from that record."""
    load_state(model, load_checkpoint(checkpoint, "cpu", field="checkpoints[0]"))
    try:
        rows = [t[:PROBE_ROWS] for t in train]
        return engine.probe_split(model, task, rows, config.grad_wrt, config.batch_size, skip_nonfinite=False)
    except BadInputError as e:
        raise _prefixed("checkpoints[0]", e) from None


def build_metadata(
    config: AttributeConfig, train_set_size: int, model: torch.nn.Module, task, split: dict | None = None
) -> StoreMetadata:
    """The store metadata of the run (:func:`trak_core.engine.store_metadata`, as TRAKer builds it; ``split``: see
    :func:`build_projector`)."""
    try:
        grad_dim = grad_dim_of(model, config.grad_wrt)
    except BadInputError as e:
        raise _prefixed("grad_wrt", e) from None
    return engine.store_metadata(
        build_projector(config, grad_dim, "cpu", model, split),
        train_set_size=train_set_size,
        dtype=config.dtype,
        task=task,
        chunk_rows=config.chunk_rows,
        shard_rows=config.shard_size,
        curvature=config.curvature,
    )


def task_projector(config: AttributeConfig, meta: StoreMetadata, device: str, model: torch.nn.Module):
    """The projector of a featurize task: rebuilt from the store's metadata ``meta`` for ``model``."""
    return build_projector(config, meta.grad_dim, device, model, split_of(meta))


def build_featurizer(config: AttributeConfig, checkpoint: str, meta: StoreMetadata) -> Featurizer:
    """The featurizer of a task: the projector rebuilt from the store's metadata ``meta`` (never probed again)."""
    device = config.resolved_device()
    model = config.build_model().to(device)
    feat = Featurizer(
        model,
        config.build_task(),
        build_projector(config, meta.grad_dim, device, model, split_of(meta)),
        FunctionalGradientComputer,
        config.grad_wrt,
        device,
        stored_dtype=torch.float16 if meta.dtype == "float16" else torch.float32,
        max_memory=config.max_memory,
    )
    feat.load_state(load_checkpoint(checkpoint, device))
    return feat


def _check_batch(task, data: tuple, rows: int, field: str) -> None:
    try:
        task.validate_batch([t[:rows] for t in data])
    except BadInputError as e:
        raise _prefixed(field, e) from None


#: rows per block of the NaN/inf check: its temporaries stay O(block), not O(n)
FINITE_CHECK_ROWS = 65_536


def _check_finite(data: tuple, field: str) -> None:
    """NaN/inf anywhere in the inputs is refused by the plan (before anything is written), naming rows."""
    for i, t in enumerate(data):
        if t.is_floating_point() or t.is_complex():
            flat = t.reshape(t.shape[0], -1)
            bad: list[int] = []
            for a in range(0, flat.shape[0], FINITE_CHECK_ROWS):
                block = flat[a : a + FINITE_CHECK_ROWS]
                bad += (a + (~torch.isfinite(block).all(dim=1)).nonzero().reshape(-1)).tolist()
            if bad:
                more = f" (and {len(bad) - 20} more)" if len(bad) > 20 else ""
                raise BadInputError(
                    f"{field}: NaN or inf in tensor {i} at example indices {bad[:20]}{more}; nothing was written"
                )


# ---------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class CheckedInputs:
    """What :func:`validate_inputs` established (nothing written yet)."""

    meta: StoreMetadata
    checkpoints: tuple[str, ...]
    train: tuple
    targets: tuple
    state_digests: tuple[str, ...] = ()  # each checkpoint's trak_core.checkpoints.state_digest

    @property
    def num_targets(self) -> int:
        return int(self.targets[0].shape[0])


@dataclass(frozen=True)
class Fingerprints:
    """Content fingerprints (sha256) the store records, so other inputs are refused on a rerun."""

    train_data: str
    target_data: str
    checkpoints: tuple[dict, ...]  # per model_id: trak_core.checkpoints.record_of its file
    train_rows: engine.RowsPrint | None = None  # the fingerprint of train rows [a, b): names changed rows


def _check_dtypes(model: torch.nn.Module, data: tuple, field: str) -> None:
    """Floating inputs of another dtype than the model's parameters (float64 data, float32 model) would fail
    inside every featurize task: refused here, before the store is created."""
    model_dt = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(model_dt) != 1:
        return  # mixed-precision models: left to the forward pass
    (want,) = model_dt
    for i, t in enumerate(data):
        if torch.is_tensor(t) and t.is_floating_point() and t.dtype != want:
            raise BadInputError(
                f"{field}: tensor {i} is {t.dtype} but the model's parameters are {want}: cast the data "
                f"(x.to({want})) or the model (model.to({t.dtype})); nothing was written"
            )


def validate_inputs(config: AttributeConfig) -> CheckedInputs:
    """Check everything that can be checked without computing gradients: model, task, data (batches, NaN/inf),
    the projection against n, and that every checkpoint fits the model. Raises BadInputError naming the field."""
    model = config.build_model()
    task = config.build_task()
    train = cached_data(config.train_data, "train_data")
    targets = cached_data(config.target_data, "target_data")
    _check_batch(task, train, config.batch_size, "train_data")
    _check_batch(task, targets, config.batch_size, "target_data")
    _check_finite(train, "train_data")
    _check_finite(targets, "target_data")
    _check_dtypes(model, train, "train_data")
    _check_dtypes(model, targets, "target_data")
    n = int(train[0].shape[0])
    stored = _stored_meta(config)
    split = split_of(stored) if stored is not None else None  # a store's own split, never probed again
    meta = _stored_layout(config, build_metadata(config, n, model, task, split), stored)
    if meta.proj_dim >= n and config.settings.lambda_rule.setting == 0:
        if projector_traits(config.projector).is_identity:
            raise BadInputError(
                f"projector: '{config.projector}' keeps all {meta.proj_dim} gradient dimensions, ≥ the number of "
                f"train examples n={n}: XᵀX is singular with lambda_reg=0 (scores would be noise); "
                "give an absolute lambda_reg > 0, or a projection with proj_dim well below n"
            )
        raise BadInputError(
            f"proj_dim: {meta.proj_dim} ≥ number of train examples n={n} makes XᵀX singular "
            "(scores would be noise); use a proj_dim well below n, or lambda_reg > 0"
        )
    engine.check_memory(
        meta,
        model,
        batch_size=config.batch_size,
        num_targets=int(targets[0].shape[0]),
        projector=config.projector,
        available=config.max_memory,
    )
    checkpoints = config.checkpoint_paths
    digests = []
    for i, path in enumerate(checkpoints):
        sd = load_checkpoint(path, "cpu", field=f"checkpoints[{i}]")
        digests.append(state_digest(sd))
        try:
            load_state(model, sd)
        except RuntimeError as e:
            raise BadInputError(f"checkpoints[{i}]: {path} does not fit the model {config.model!r}: {e}") from None
        bad = [k for k, v in sd.items() if torch.is_tensor(v) and v.is_floating_point() and not torch.isfinite(v).all()]
        if bad:
            raise BadInputError(f"checkpoints[{i}]: {path} has NaN or inf in {bad[:5]}; nothing was written")
    # a new store of a projector split by layer: the split follows the gradient energy
    if projector_traits(config.projector).splits_by_layer and stored is None:
        split = factored_split(config, model, task, train, checkpoints[0])
        meta = _stored_layout(config, build_metadata(config, n, model, task, split), stored)
    return CheckedInputs(
        meta=meta, checkpoints=tuple(checkpoints), train=train, targets=targets, state_digests=tuple(digests)
    )


def _stored_meta(config: AttributeConfig) -> StoreMetadata | None:
    """The metadata of the config's store (None: no store yet)."""
    if not store_exists(config.store, config.storage_options):
        return None
    return open_location(config.store, config.storage_options, mode="r", check_arrays=False).meta


def _stored_layout(config: AttributeConfig, meta: StoreMetadata, stored: StoreMetadata | None) -> StoreMetadata:
    """``meta`` with the chunk and shard rows of the existing store (``stored``) where the config leaves them to be
    chosen (they are chosen by the number of rows: a store that grows keeps its own)."""
    if (config.chunk_rows is not None and config.shard_size is not None) or stored is None:
        return meta
    if stored.train_set_size >= meta.train_set_size:
        return meta
    layout = {"chunk_rows": config.chunk_rows or stored.chunk_rows}
    layout["shard_rows"] = config.shard_size or stored.shard_rows
    return StoreMetadata.model_validate({**meta.model_dump(), **layout})


def fingerprint_inputs(inputs: CheckedInputs) -> Fingerprints:
    return Fingerprints(
        train_data=array_fingerprint(inputs.train),
        target_data=array_fingerprint(inputs.targets),
        checkpoints=tuple(
            record_of(p, digest=d) for p, d in zip(inputs.checkpoints, inputs.state_digests, strict=True)
        ),
        train_rows=engine.train_rows_print(inputs.train),
    )


def check_against_store(config: AttributeConfig, inputs: CheckedInputs, prints: Fingerprints) -> None:
    """Refuse (StoreMismatchError / BadInputError, naming the field) an existing store made with other
    settings, data, checkpoints, λ or targets, before anything is written. No store: nothing to check."""
    if not store_exists(config.store, config.storage_options):
        return
    store = open_location(config.store, config.storage_options)
    store.validate(inputs.meta, grow=True)  # more train rows than the store: the plan appends them
    engine.check_run(store, **_run_records(config, inputs, prints))


def _run_records(config: AttributeConfig, inputs: CheckedInputs, prints: Fingerprints) -> dict:
    """What the engine checks an existing store against, and records in a new one."""
    return dict(
        train_data=prints.train_data,
        checkpoints=prints.checkpoints,
        lambda_setting=config.settings.lambda_rule.setting,
        rescale=config.rescale_inverse,
        exp_name=config.exp_name,
        num_targets=inputs.num_targets,
        target_data=prints.target_data,
        train_set_size=inputs.meta.train_set_size,
        train_rows=prints.train_rows,
    )


def create_plan(config: AttributeConfig, inputs: CheckedInputs, prints: Fingerprints) -> Plan:
    """Create (or complete) the store's arrays and records, once, before any fan-out; return the plan."""
    store = engine.open_run(config.store, inputs.meta, config.storage_options, grow=True)
    before = store.meta.train_set_size
    engine.plan_run(store, **_run_records(config, inputs, prints))
    record_train_source(store, config)
    check_chunks(store)
    grown = before if before < inputs.meta.train_set_size else None
    return _plan_of(config, inputs, grown_from=grown)


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


def _plan_of(config: AttributeConfig, inputs: CheckedInputs, grown_from: int | None = None) -> Plan:
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


def check_chunks(store: RunStore) -> None:
    """The cheap part of ``trakflow verify`` (one listing per array, no chunk read), before any step skips work:
    a chunk of rows marked done that has vanished is unflagged with what depends on it (one warning naming the
    arrays and chunks), so this run recomputes those rows instead of reading zeros. Chunks that fail their
    checksum are found when read (StoreDamageError, not retried) or by ``trakflow verify``."""
    report = verify_store(store, read_chunks=False)
    if report.ok:
        return
    done = repair_store(store, report)
    warnings.warn(f"{report.summary()}; recomputing: {'; '.join(done.actions)}", stacklevel=2)


def make_plan(config: AttributeConfig) -> Plan:
    """validate → fingerprint → check the existing store → create its arrays.

    Raises (BadInputError / StoreMismatchError, naming the field) before writing anything when the model,
    data, task, checkpoints or an existing store do not fit together.
    """
    inputs = validate_inputs(config)
    prints = fingerprint_inputs(inputs)
    check_against_store(config, inputs, prints)
    return create_plan(config, inputs, prints)


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
        lambda: build_featurizer(config, checkpoint, store.meta),
        lambda a, b: [t[a:b] for t in data],
        config.batch_size,
        device=config.resolved_device(),
        progress=lambda n: progress.advance("featurize", n),
    )
    return ShardManifest.timed(t0, skipped, model_id=model_id, shard=shard, rows=store.meta.shard_range(shard))


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
        lambda: build_featurizer(config, checkpoint, store.meta),
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
    """The train-row ranges of the score tasks (:func:`trak_core.streaming.score_task_ranges` for this run)."""
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
    if not store_exists(config.store, config.storage_options):
        return None
    inputs = validate_inputs(config)
    prints = fingerprint_inputs(inputs)
    check_against_store(config, inputs, prints)
    store = open_location(config.store, config.storage_options, mode="r")
    exp = config.exp_name
    if store.meta.train_set_size != inputs.meta.train_set_size:  # new train rows: the plan appends them
        return None
    if not engine.is_complete(store, exp, list(range(len(inputs.checkpoints)))):
        return None
    if not verify_store(store, read_chunks=False).ok:  # a chunk gone since: the plan recomputes it
        return None
    if config.report_targets and config.report_dir and not (Path(config.report_dir) / f"{exp}_top_k.md").exists():
        return None
    return _plan_of(config, inputs)
