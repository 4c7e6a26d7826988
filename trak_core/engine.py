"""The algorithm over a store, written once: plan → featurize → finalize a model → targets → scores.

Both front doors call these functions and nothing else for a step: the pipeline's tasks (tasks/core.py, one
step per task, fanned out) and :class:`~trak_core.compat.traker.TRAKer` (one step per method call, batch by
batch). Each step's checks (what the store must hold first, what it must not contradict) and records (what it
writes besides arrays) live here; the math is in :mod:`trak_core.solve.reduce` and :mod:`trak_core.scoring.streaming`.
The
plan step (the projector choice, the store's records created once) is in :mod:`trak_core.plan`; the rules of a run's
inputs and of an existing store's projector, which both use, are in :mod:`trak_core.rules` and exposed here.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from trak_core import checkpoints, rules
from trak_core.featurize.budget import check_budget as check_budget  # the front doors' memory budget
from trak_core.featurize.budget import memory_limit as memory_limit
from trak_core.featurize.featurizer import Featurizer
from trak_core.featurize.row_sink import RowSink as RowSink  # TRAKer's rows on their way into the store
from trak_core.featurize.row_sink import complete_shard, write_rows
from trak_core.projection.base import AbstractProjector
from trak_core.projection.energy import PROBE_ROWS, quantize_energies, sketched_energies
from trak_core.solve import kfac, kfac_record
from trak_core.solve.damping import CURVATURES, check_lambda
from trak_core.solve.reduce import (
    GramBuffers,
    features_rows,
    finalize_model,
    finalize_scores,
    finalized_settings,
    host_empty,
    load_solved,
    score_rows,
    shard_partials,
    solve_targets,
    unscored_ranges,
    usable_models,
)

from .errors import BadInputError, NonFiniteGradientError, StateError, StoreMismatchError
from .lds import array_fingerprint
from .memory import TaskMemory, Term, check_task_memory, estimate_task_memory, format_bytes
from .store import RunStore, StoreMetadata, create_or_open_store, model_array, open_store, store_exists
from .store.chunkio import stack_dtype
from .store.location import check_new_location
from .store.lock import acquire_run_lock, release_run_lock

Progress = Callable[[int], None] | None


def _advance(progress: Progress, n: int) -> None:
    if progress is not None and n:
        progress(n)


# ---------------------------------------------------------------------------------------------- plan
def store_metadata(
    projector: AbstractProjector,
    *,
    train_set_size: int,
    dtype: str,
    task,
    chunk_rows: int | None = None,
    shard_rows: int | None = None,
    curvature: str = "xtx",
) -> StoreMetadata:
    """The store's metadata for a run of ``projector`` over ``train_set_size`` rows.

    Args:
        projector: its ``spec()`` identifies the projection in the store.
        dtype: storage dtype of the projected gradients, ``"float16"`` or ``"float32"``.
        task: the model output function (its class name is recorded).
    Returns:
        The :class:`StoreMetadata` that creates or validates the store.
    """
    return StoreMetadata.from_projector(
        projector.spec(),
        train_set_size=int(train_set_size),
        dtype=dtype,
        chunk_rows=chunk_rows,
        shard_rows=shard_rows,
        task=type(task).__name__,
        curvature=curvature,
    )


def probe_split(
    model, task, rows: Sequence[torch.Tensor], grad_wrt=None, chunk_rows: int | None = None, skip_nonfinite=True
) -> dict:
    """The split keywords of a new store's default (factored) projector: proj_dim ∝ each block's gradient energy,
    probed on ``rows`` (the first ≤ :data:`~trak_core.projection.energy.PROBE_ROWS` train rows a run is given, in
    order, at its
    first checkpoint; :class:`ProbeRows` gathers them across featurize calls) in passes of ``chunk_rows``. With
    ``skip_nonfinite``, rows whose gradient is not finite are left out (featurizing them names them). The
    energies are rounded (:func:`~trak_core.projection.energy.quantize_energies`) and recorded: every later step
    rebuilds the
    projector from the store's record and never probes again, so a store that grows keeps the split it was created
    with."""
    energies = sketched_energies(
        model, task, rows, PROBE_ROWS, grad_wrt, skip_nonfinite=skip_nonfinite, chunk_rows=chunk_rows
    )
    return {"split": "energy", "energies": quantize_energies(energies)}


class ProbeRows:
    """The train rows a run is given before its default projector exists, held (inputs only, at most the rows of
    the calls that reach ``want`` rows) until they number ``want`` = min(PROBE_ROWS, train rows), or until the
    run moves on to another step; then :meth:`rows` are the first ``want`` of them in the order given, whatever the
    batches were, and :meth:`take` hands every held batch back to be featurized with the projector they decide."""

    def __init__(self, want: int):
        self.want = max(1, min(int(want), PROBE_ROWS))
        self.held: list[tuple[int, list[torch.Tensor], np.ndarray]] = []
        self.count = 0

    def add(self, model_id: int, batch: Sequence[torch.Tensor], inds: np.ndarray) -> None:
        """Hold (a copy of) one featurize call's batch of model ``model_id`` (rows ``inds``): a caller may reuse its
        buffers."""
        self.held.append((int(model_id), [t.detach().clone() for t in batch], np.asarray(inds)))
        self.count += int(np.asarray(inds).size)

    def drop_last(self) -> None:
        """Forget the batch added last (one that could not be featurized)."""
        _, _, inds = self.held.pop()
        self.count -= int(inds.size)

    @property
    def full(self) -> bool:
        return self.count >= self.want

    def rows(self) -> list[torch.Tensor]:
        """The first ≤ ``want`` rows held, as one batch."""
        parts, left = [], self.want
        for _, batch, inds in self.held:
            take = min(left, int(inds.size))
            if take:
                parts.append([t[:take] for t in batch])
                left -= take
        return [torch.cat(cols) for cols in zip(*parts, strict=True)]

    def take(self) -> list[tuple[int, list[torch.Tensor], np.ndarray]]:
        """The held batches, in order, and nothing held any more."""
        held, self.held, self.count = self.held, [], 0
        return held


def check_solve_settings(lambda_reg, curvature: str) -> None:
    """Refuse (BadInputError naming the setting) a damping or curvature the solve does not know, before anything
    is created (:func:`trak_core.solve.damping.check_lambda`)."""
    try:
        check_lambda(lambda_reg)
    except ValueError as e:
        raise BadInputError(str(e)) from None
    if curvature not in CURVATURES:
        raise BadInputError(f"curvature={curvature!r}: expected one of {CURVATURES}")


# the front doors' input rules and an existing store's projector (trak_core.rules, the plan's too)
check_batch_rows = rules.check_batch_rows  # a batch given batch by batch: the task's checks, NaN/inf, dtypes
check_state_finite = checkpoints.check_state_finite  # a checkpoint: no NaN or inf
check_projection = rules.check_projection  # proj_dim ≥ n with no damping: refused
lambda_setting = rules.lambda_setting
stored_split = rules.stored_split  # whether a store is at a location, the projector split it records
rebuild_projector = rules.rebuild_projector  # a projector with a store's recorded split
recorded_projector = rules.recorded_projector  # the projector a store's metadata records, of any kind

# Kronecker-factored curvature ("kfac" / "ekfac" / "kfac-eigen"): each checkpoint's factors, recorded in the store
KFAC_CURVATURES, DEFAULT_DAMPING, check_damping = kfac.KFAC_CURVATURES, kfac.DEFAULT_DAMPING, kfac.check_damping
KroneckerFactors = kfac.KroneckerFactors
#: fit and record a checkpoint's factors (a checkpoint that has them keeps them)
fit_curvature = kfac_record.fit_step
needs_curvature = kfac_record.wants_factors  # whether a checkpoint of the store has factors to fit
#: whether a run fits the factors before the rows (and the fit's rows); else "kfac"/"ekfac" sum them per shard,
#: reduced and recorded once all are featurized (record_folded; at finalize where not done before)
fit_first, curvature_batches = kfac_record.fit_first, kfac_record.curvature_batches
record_folded = kfac_record.record_folded
#: factors fitted before the store exists (TRAKer's default projector waits for its first rows), then recorded
fit_factors, record_curvature = kfac.fit_factors, kfac_record.record_factors
#: "kfac" / "ekfac" without a fit: the factors of the rows a TRAKer featurizes, summed as it featurizes them
FactorFold = kfac.FactorFold
featurize_folded = kfac.featurize_folded
#: "kfac-eigen": rows projected in each checkpoint's factor eigenbasis, so its factors come before its rows
FIT_BEFORE_FEATURIZE, default_damping = kfac.FIT_BEFORE_FEATURIZE, kfac.default_damping
FOLDED_CURVATURES = kfac.FOLDED_CURVATURES
bind_eigen, current_factors = kfac.bind_eigen, kfac_record.current_factors
SpectraMemo = kfac.SpectraMemo  # the split's factor reductions, kept for the sides of model 0
bind_recorded_eigen = kfac_record.bind_recorded  # a store's rows: the eigenbasis of the factors it records


def eigen_split(split: dict, pre: KroneckerFactors, proj_dim: int, spectra: SpectraMemo | None = None) -> dict:
    """A new ``"kfac-eigen"`` store's split keywords: the probe's ``split`` (:func:`probe_split`) with its Kronecker
    layers' share of proj_dim spread as model 0's fitted factors ``pre`` say (:func:`kfac.eigen_energies`), rounded as
    every recorded split is; TRAKer and the pipeline's plan both call it. ``spectra`` keeps the factors' reductions
    for this process's sides (:func:`bind_eigen`); the split is the same bits with or without it."""
    return {**split, "energies": quantize_energies(kfac.eigen_energies(pre, split["energies"], proj_dim, spectra))}


def check_new_store(location: str, storage_options: dict | None = None) -> None:
    """Refuse now what creating a store at ``location`` later in the run would refuse: arrays without root metadata
    (StoreDamageError) and a local folder this process cannot write."""
    check_new_location(location, storage_options)


def check_memory(
    meta: StoreMetadata,
    model: torch.nn.Module,
    *,
    batch_size: int,
    num_targets: int = 0,
    projector: str = "",
    available: int | None = None,
) -> None:
    """Refuse (BadInputError naming the field and the estimate), before the store is created, settings whose
    featurize or finalize step cannot fit in the available memory (:mod:`trak_core.memory`), or in ``available``
    bytes, a memory budget (named ``max_memory``; its featurize batch is chosen within it, one row at least)."""
    params = list(model.parameters())
    itemsize = meta.np_dtype.itemsize
    estimates = estimate_task_memory(
        train_set_size=meta.train_set_size,
        grad_dim=meta.grad_dim,
        proj_dim=meta.proj_dim,
        num_params=sum(p.numel() for p in params),
        batch_size=batch_size if available is None else 1,
        shard_rows=meta.rows_per_shard,
        dtype_bytes=itemsize,
        chunk_bytes=math.prod(meta.row_chunks(meta.proj_dim, itemsize)) * itemsize,
        model_bytes=max((p.element_size() for p in params), default=4),
        num_targets=num_targets,
        curvature=meta.curvature,
    )
    try:
        check_task_memory(estimates, available, projector=projector)
    except BadInputError as e:
        if available is None:
            raise
        raise BadInputError(f"max_memory: {format_bytes(available)} cannot hold a task's buffers ({e})") from None


def check_featurize_memory(
    meta: StoreMetadata, model: torch.nn.Module, *, rows_held: int, partials: bool, projector: str = ""
) -> None:
    """Refuse (BadInputError naming proj_dim and the estimate), before the store is created, a projection whose
    featurizing cannot fit in the available memory, for a caller that holds ``rows_held`` projected rows at once
    and, with ``partials``, computes each shard's XᵀX partial while featurizing (TRAKer, batch by batch)."""
    params = list(model.parameters())
    p, itemsize = meta.proj_dim, meta.np_dtype.itemsize
    terms = [
        Term("model and its state_dict", "model", 3 * sum(x.numel() * x.element_size() for x in params)),
        Term(f"projected rows held ({rows_held} × proj_dim={p})", "proj_dim", rows_held * p * (8 + itemsize)),
        Term("Zarr chunk buffers", "chunk_rows", 2 * math.prod(meta.row_chunks(p, itemsize)) * itemsize),
    ]
    if partials:
        terms.append(Term(f"XᵀX partial (proj_dim² = {p}² float64)", "proj_dim", 2 * p * p * 8))
    check_task_memory([TaskMemory("featurize", tuple(terms))], projector=projector)


def check_finalize_memory(meta: StoreMetadata, num_targets: int = 0) -> None:
    """Refuse (BadInputError naming the field) a finalize step that cannot fit in the available memory."""
    itemsize = meta.np_dtype.itemsize
    _, fin = estimate_task_memory(
        train_set_size=meta.train_set_size,
        grad_dim=meta.grad_dim,
        proj_dim=meta.proj_dim,
        num_params=0,
        batch_size=1,
        shard_rows=meta.rows_per_shard,
        dtype_bytes=itemsize,
        chunk_bytes=math.prod(meta.row_chunks(meta.proj_dim, itemsize)) * itemsize,
        num_targets=num_targets,
        curvature=meta.curvature,
    )
    check_task_memory([fin], projector=meta.projector)


def open_run(location: str, meta: StoreMetadata, storage_options: dict | None = None, grow: bool = False) -> RunStore:
    """The store at ``location`` checked against ``meta``, created when there is none. With ``grow``, a store of
    fewer train rows than ``meta`` passes (:func:`plan_run` grows it)."""
    if grow and store_exists(location, storage_options):
        store = open_store(location, storage_options)
        store.validate(meta, grow=True)
        return store
    return create_or_open_store(location, meta, storage_options)


def acquire_store(location: str, run: str) -> None:
    """Take the run lock of the store at ``location`` for this process's holders that share it (TRAKers), or raise
    StoreLockedError naming the live holder (:func:`trak_core.store.lock.acquire_run_lock`, the one registry of
    the locks this process holds, which the pipeline's flows use too). Counted: :func:`release_store` removes it
    after the last holder. A new local store's folder is created for the lock file (and removed by
    :func:`release_store` when the store was never created)."""
    acquire_run_lock(location, run)


def release_store(location: str) -> None:
    """Release one :func:`acquire_store` of this process (the lock file is removed after the last)."""
    release_run_lock(location)


def state_fingerprint(state_dict: dict) -> str:
    """sha256 of a state_dict's tensors (names, dtypes, shapes, values), the identity of a checkpoint given
    as an object rather than a file (:func:`trak_core.checkpoints.state_digest`)."""
    return checkpoints.state_digest(state_dict)


#: fingerprints of row ranges of the train data: ``rows(a, b)`` is the sha256 of rows [a, b) of every tensor
RowsPrint = Callable[[int, int], str]


def train_rows_print(data: Sequence) -> RowsPrint:
    """``rows(a, b)``: sha256 over dtype, shape and bytes of rows [a, b) of each tensor of ``data``; rows [0, n)
    of all n rows give the fingerprint of the whole data (``trak_core.lds.array_fingerprint``)."""
    return lambda a, b: array_fingerprint([t[a:b] for t in data])


def check_train_data(
    store: RunStore, fingerprint: str, train_set_size: int | None = None, rows: RowsPrint | None = None
) -> None:
    """Refuse (StoreMismatchError naming the rows) train data other than the store's: the rows the store holds
    must be unchanged; rows beyond them (``train_set_size`` more than the store's) are new rows to append.

    Args:
        fingerprint: the whole train data's fingerprint.
        train_set_size: its number of rows (None: the store's).
        rows: the fingerprint of a row range (:func:`train_rows_print`): names the changed rows, and checks the
            old rows of a longer data set (required when ``train_set_size`` exceeds the store's).
    """
    info = store.pipeline_info()
    recorded = info.get("train_data_sha256")
    n_old = store.meta.train_set_size
    n = n_old if train_set_size is None else int(train_set_size)
    if n < n_old:
        raise StoreMismatchError(
            f"train_data: {n} rows, but the store at {store.location} holds {n_old}; a store only grows (use a new "
            "store for fewer rows)"
        )
    if recorded is None or (n == n_old and recorded == fingerprint):
        return
    if rows is None:
        if n == n_old:
            raise StoreMismatchError(
                f"train_data: the store at {store.location} was featurized with different train data "
                "(its fingerprint differs); use a new store"
            )
        raise BadInputError(f"train_data: checking the {n_old} stored rows of {n} needs their row fingerprints")
    ranges = info.get("train_data_rows")
    if not ranges:  # a store recorded by the whole data only: its rows [0, n_old) as one range
        ranges = [[0, n_old, recorded]]
    changed = [(a, b) for a, b, sha in ranges if b > n or rows(a, b) != sha]
    if changed:
        named = ", ".join(f"{a}..{b - 1}" for a, b in changed[:5]) + (" and more" if len(changed) > 5 else "")
        raise StoreMismatchError(
            f"train_data: rows {named} differ from the rows the store at {store.location} was featurized with; "
            "only rows after the stored ones may be added (use a new store for changed data)"
        )


def record_train_data(store: RunStore, fingerprint: str, rows: RowsPrint | None = None) -> None:
    """Record the train data's fingerprint (first time, or after the store grew) and, with ``rows``, each
    shard's (so a changed row is named when new rows are added); or refuse other data."""
    check_train_data(store, fingerprint, rows=rows)
    info = store.pipeline_info()
    if info.get("train_data_sha256") == fingerprint and (rows is None or "train_data_rows" in info):
        return
    info["train_data_sha256"] = fingerprint
    if rows is not None:
        shards = (store.meta.shard_range(s) for s in range(store.meta.num_shards))
        info["train_data_rows"] = [[a, b, rows(a, b)] for a, b in shards]
    store.set_pipeline_info(info)


def grow_run(store: RunStore, train_set_size: int) -> int:
    """Grow the store to ``train_set_size`` train rows (:meth:`~trak_core.store.RowAccess.grow_train_rows`): the stored
    rows, flags, partials and place records kept; every checkpoint's inverse and every experiment's scores marked
    to be computed again. Returns the number of rows the store had (the same when it had them all)."""
    return store.grow_train_rows(train_set_size)


def check_model_id(model_id) -> None:
    """Refuse (BadInputError) a model id that is not a non-negative integer."""
    if not isinstance(model_id, (int, np.integer)) or isinstance(model_id, bool) or model_id < 0:
        raise BadInputError(f"model_id must be a non-negative integer, got {model_id!r}")


def check_model(
    store: RunStore,
    model_id: int,
    *,
    checkpoint: dict | None = None,
    lambda_setting=None,
    rescale: bool | None = None,
) -> None:
    """Refuse (StoreMismatchError naming the field and ``model_id``) a checkpoint, λ or rescale other than the
    ones ``model_id`` was planned, featurized or finalized with. A model the store does not hold passes.

    Args:
        checkpoint: the checkpoint's record (:func:`trak_core.checkpoints.record_of`: ``state_sha256``, and
            ``sha256`` for a file), checked by :func:`trak_core.checkpoints.check_record` (None: not checked).
        lambda_setting: the λ rule's setting (``parse_lambda_reg(x).setting``; None: not checked).
        rescale: traker's rescale of the inverse (checked with ``lambda_setting``).
    """
    check_model_id(model_id)
    if not store.has_model(model_id):
        return
    if lambda_setting is not None:
        store.check_feature_settings(model_id, lambda_setting, bool(rescale))
        had_lambda, had_rescale = finalized_settings(store.finalize_info(model_id))
        for field, want, have in (
            ("lambda_reg", lambda_setting, had_lambda),
            ("rescale_inverse", rescale, had_rescale),
        ):
            if have is not None and have != want:
                raise StoreMismatchError(
                    f"{field}: model_id={model_id} in {store.location} was finalized with {field}={have!r}, not "
                    f"{want!r}; use a new store (or the same {field})"
                )
    if checkpoint is not None:
        checkpoints.check_record(store.checkpoint_record(model_id), checkpoint, model_id, store.location)


def plan_model(
    store: RunStore,
    model_id: int,
    *,
    checkpoint: dict | None = None,
    lambda_setting=None,
    rescale: bool | None = None,
    start_over: bool = False,
) -> None:
    """Create ``model_id``'s arrays and record its checkpoint and settings (see :func:`check_model`).

    Args:
        start_over: forget everything the store holds for ``model_id`` first (traker's
            ``load_from_save_dir=False``).
    """
    if not start_over:
        check_model(store, model_id, checkpoint=checkpoint, lambda_setting=lambda_setting, rescale=rescale)
    store.init_model(model_id)
    if start_over:
        store.reset_model(model_id)
    if checkpoint is not None:
        old = store.checkpoint_record(model_id)
        if old is None:
            store.set_checkpoint_record(model_id, checkpoint)
        elif "state_sha256" not in old and "state_sha256" in checkpoint:  # a record made before state digests
            store.set_checkpoint_record(model_id, {**checkpoint, **old, "state_sha256": checkpoint["state_sha256"]})
    if lambda_setting is not None:
        store.record_feature_settings(model_id, lambda_setting, bool(rescale))


def check_experiment(store: RunStore, exp_name: str, num_targets: int, target_data: str | None = None) -> None:
    """Refuse (StoreMismatchError) an existing experiment ``exp_name`` made with other targets: another count,
    or another recorded fingerprint ``target_data``."""
    if exp_name not in store.experiments():
        return
    have, recorded = store.num_targets(exp_name), store.target_data_sha256(exp_name)
    if have != num_targets or (target_data is not None and recorded is not None and recorded != target_data):
        raise StoreMismatchError(
            f"exp_name: experiment {exp_name!r} in {store.location} was made with other targets "
            f"(num_targets={have}, given {num_targets}); choose a new exp_name"
        )


def plan_experiment(
    store: RunStore, exp_name: str, num_targets: int, model_ids: Iterable[int], target_data: str | None = None
) -> None:
    """Create experiment ``exp_name``'s arrays (target gradients of ``model_ids``, scores) and record its
    targets' fingerprint."""
    check_experiment(store, exp_name, num_targets, target_data)
    store.init_experiment(exp_name, num_targets)
    if target_data is not None and store.target_data_sha256(exp_name) is None:
        store.set_target_data_sha256(exp_name, target_data)
    for mid in model_ids:
        store.init_experiment_model(exp_name, mid)
    store.init_scores(exp_name)


def check_run(
    store: RunStore,
    *,
    train_data: str,
    checkpoints: Sequence[dict],
    lambda_setting,
    rescale: bool,
    exp_name: str,
    num_targets: int,
    target_data: str,
    train_set_size: int | None = None,
    train_rows: RowsPrint | None = None,
) -> None:
    """Refuse an existing store whose records contradict a run (StoreMismatchError naming the field): other
    train data (changed stored rows: ``train_rows`` names them; rows beyond the store's, up to ``train_set_size``,
    are new rows the plan appends), another checkpoint for a model id (``checkpoints[i]`` is model i's
    ``{"path", "sha256"}``), another λ or rescale, other targets for the experiment. Reads only."""
    check_train_data(store, train_data, train_set_size, train_rows)
    for mid, rec in enumerate(checkpoints):
        check_model(store, mid, checkpoint=rec, lambda_setting=lambda_setting, rescale=rescale)
    check_experiment(store, exp_name, num_targets, target_data)


def plan_run(store: RunStore, **records) -> None:
    """Check the store against a run (:func:`check_run`, same arguments), grow it to ``train_set_size`` rows
    when the run has more, then create every array and record of it: its models, its experiment. Call once,
    before fanning out."""
    check_run(store, **records)
    if records.get("train_set_size") is not None:
        grow_run(store, records["train_set_size"])
    record_train_data(store, records["train_data"], records.get("train_rows"))
    for mid, rec in enumerate(records["checkpoints"]):
        plan_model(store, mid, checkpoint=rec, lambda_setting=records["lambda_setting"], rescale=records["rescale"])
    plan_experiment(
        store, records["exp_name"], records["num_targets"], range(len(records["checkpoints"])), records["target_data"]
    )


# ---------------------------------------------------------------------------------------------- featurize
def require_not_finalized(store: RunStore, model_id: int) -> None:
    """StateError when ``model_id`` is finalized (new rows would make its inverse stale)."""
    if store.is_finalized(model_id):
        raise StateError(
            f"model_id={model_id} is already finalized; featurizing it again would make its features "
            "stale. Use a new model_id or a new store."
        )


#: the most bytes of shard buffers a thread keeps between shards (proj_dim 2048, 8,192 rows: 32 MiB of float16 rows
#: and a 16 MiB packed partial); a larger shard's are new memory each time, as its task holds them anyway
SHARD_BUFFER_BYTES = 64 << 20


class _ShardBuffers(threading.local):
    """A thread's host buffers for the shard it featurizes, reused by its next one: the shard's rows as stored and
    its packed Gram partials (:class:`~trak_core.solve.reduce.GramBuffers`). Fresh memory for them every shard is a page
    fault per 4 KiB (1–2 µs a row at proj_dim 2048); kept only up to :data:`SHARD_BUFFER_BYTES`."""

    def __init__(self) -> None:
        self.rows_buf: np.ndarray | None = None
        self.device = "cpu"  # the device the kept rows buffer was made for
        self.grams = GramBuffers()

    def fit(self, meta: StoreMetadata) -> bool:
        """Whether a shard of ``meta`` fits the buffers kept (else its task gets new memory, the kept is dropped)."""
        p = meta.proj_dim
        grams = (2 if meta.curvature == "ggn" else 1) * 8 * (p * (p + 1) // 2)
        if meta.rows_per_shard * p * meta.np_dtype.itemsize + grams <= SHARD_BUFFER_BYTES:
            return True
        self.rows_buf, self.grams = None, GramBuffers()
        return False

    def rows(self, n: int, p: int, dtype: np.dtype, device="cpu") -> np.ndarray:
        """A C-ordered (n, p) buffer of ``dtype`` (a view of the kept one when it is large enough), page-locked when
        its rows go to a CUDA device for the partial."""
        kind = torch.device(device).type
        buf = self.rows_buf
        if buf is None or buf.dtype != dtype or buf.shape[1] != p or buf.shape[0] < n or self.device != kind:
            buf = self.rows_buf = host_empty((n, p), dtype, kind)
            self.device = kind
        return buf[:n]


_shard_buffers = _ShardBuffers()


def featurize_shard(
    store: RunStore,
    model_id: int,
    shard: int,
    featurizer: Callable[[], Featurizer],
    batch: Callable[[int, int], list],
    batch_size: int,
    device=None,
    progress: Progress = None,
    curvature_damping: float | None = None,
    grad_wrt=None,
) -> bool:
    """Featurize one shard of train rows in batches, write it at once and its XᵀX partial beside (computed on the
    featurizer's device, from the rows as stored), marked done once the rows are; a ``"kfac"`` / ``"ekfac"`` model
    without factors also sums them over the shard's rows, written before the rows (``curvature_damping``,
    ``grad_wrt``: the run's; :func:`trak_core.solve.kfac_record.record_folded` reduces them at finalize).

    Args:
        featurizer: builds the featurizer (only called when the shard is not in the store yet).
        batch: ``batch(a, b)`` is the batch of train examples [a, b).
        device: where a partial missing beside stored rows is computed.
        progress: called with the number of rows done.
    Returns:
        True when the store held the shard already (nothing featurized).
    """
    # the groups and arrays opened once for the shard (its task is their one writer; the flow created them)
    with store.pinned():
        a, b = store.meta.shard_range(shard)
        done = store.read_rows(model_array(model_id, "featurized"), slice(a, b)).astype(bool)  # read once
        if done.all():
            complete_shard(store, model_id, shard, device)
            _advance(progress, b - a)
            return True
        require_not_finalized(store, model_id)
        start = a + _featurized_prefix(done)  # a shard the store grew into keeps its stored rows
        feat = featurizer()
        batch_size = _budget_batch(
            feat, store.meta, b - a, batch(start, min(b, start + PROBE_SAMPLE_ROWS)), model_id, batch_size
        )
        xs, qs = [], []
        old_x, fold = None, kfac.FactorFold(b, grad_wrt) if kfac_record.folds(store, model_id) else None
        if start > a:
            old_x, old_q = store.read_train_rows(model_id, a, start)
            qs.append(old_q)
            _advance(progress, start - a)
        for s in range(start, b, batch_size):
            e = min(s + batch_size, b)
            try:
                rows = batch(s, e)
                x, q = kfac.featurize_folded(fold, feat, rows, model_id, range(s, e))  # the fold's sums beside
            except NonFiniteGradientError:
                raise  # names the example indices already
            except BadInputError as err:  # e.g. a label out of range: say which rows
                raise BadInputError(f"train_data rows {s}..{e - 1} (model_id={model_id}): {err}") from None
            xs.append(x)
            qs.append(q)
            _advance(progress, e - s)
        if fold is not None:  # before the rows: rows flagged featurized have their sums stored
            kfac_record.write_shard_sums(store, model_id, shard, fold, curvature_damping)
        q = np.concatenate(qs)
        n, p, dtype = b - a, store.meta.proj_dim, store.meta.np_dtype
        keep = _shard_buffers.fit(store.meta)
        x = _shard_buffers.rows(n, p, dtype, feat.device) if keep else np.empty((n, p), dtype)
        stack_dtype(xs, dtype, x[start - a :])  # the rows as stored, each batch converted straight into them
        if old_x is not None:
            x[: start - a] = old_x
        grams = _shard_buffers.grams if keep else None
        # the shard's partial computed (on the featurizer's device) and written beside its rows' write, marked after
        with ThreadPoolExecutor(1, thread_name_prefix="trakflow-partial") as beside:
            job = beside.submit(_write_partial_unmarked, store, model_id, shard, feat.device, x, q, grams)
            write_rows(store, model_id, slice(start, b), x[start - a :], q[start - a :])
            job.result()
        store.mark_partial(model_id, shard)
        return False


#: train rows handed to a memory budget's probe (repeated for its larger batches: memory, not values, is measured)
PROBE_SAMPLE_ROWS = 64


def _budget_batch(
    feat: Featurizer, meta: StoreMetadata, rows_held: int, sample: list, model_id: int, batch_size: int
) -> int:
    """The featurize batch: ``batch_size``, or under the featurizer's memory budget the most rows that fit beside
    ``rows_held`` projected rows and their XᵀX partial (probed on ``sample``, :mod:`trak_core.featurize.budget`)."""
    if getattr(feat, "max_memory", None) is None:  # (a stand-in featurizer may have no budget at all)
        return batch_size
    p, itemsize = meta.proj_dim, meta.np_dtype.itemsize
    grams = 2 if meta.curvature == "ggn" else 1
    chunk = math.prod(meta.row_chunks(p, itemsize)) * itemsize
    feat.memory_reserve = rows_held * p * (4 + itemsize) + (1 + grams) * p * p * 8 + 2 * chunk
    return min(rows_held, feat.rows_within_budget(sample, model_id))


def _write_partial_unmarked(store: RunStore, model_id: int, shard: int, device, x, q, buffers) -> None:
    """A shard's partials from its rows as stored, written but not marked done (its rows may still be in writing)."""
    with store.pinned():
        part, sums, ggn = shard_partials(store, model_id, shard, x, q, device, buffers)
        store.write_partial(model_id, shard, part, sums, ggn, mark=False)


def _featurized_prefix(done: np.ndarray) -> int:
    """How many leading rows of a shard are featurized (``done``: its flags) when exactly those are (the old rows
    of the last shard of a store that grew); 0 otherwise (the shard is featurized whole)."""
    k = int(np.argmin(done)) if not done.all() else len(done)
    return k if not done[k:].any() else 0


# ---------------------------------------------------------------------------------------------- finalize
def finalize(
    store: RunStore, model_id: int, lambda_reg, rescale: bool, device=None, known=None
) -> tuple[dict, bool, tuple[str, ...]]:
    """A = (XᵀX + λI)⁻¹ of ``model_id`` from its shard partials, written with its record (idempotent); ``known``:
    their running sum kept while storing them (:class:`~trak_core.solve.reduce.PartialSums`), else they are read.

    Returns:
        (the finalize record, whether it was there already, the texts of the warnings issued).
    """
    recorded = store.finalize_info(model_id) if store.has_model(model_id) else None  # as store.is_finalized
    if recorded is not None:
        return recorded, True, ()
    check_finalize_memory(store.meta)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kfac_record.record_folded(store, model_id)  # "kfac"/"ekfac": the factors of the shards' sums, where due
        info = finalize_model(store, model_id, lambda_reg, rescale, device=device, known=known)
    for w in caught:  # re-issued (the record hides them) and returned
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return info, False, tuple(str(w.message) for w in caught)


def require_finalized(store: RunStore, model_id: int) -> None:
    if not (store.has_model(model_id) and store.is_finalized(model_id)):
        raise StateError(f"model_id={model_id} is not finalized; call finalize_features first")


def features(store: RunStore, model_id: int, start: int = 0, stop: int | None = None) -> np.ndarray:
    """traker's features Φ = X A of train rows [start, stop) of a finalized model, (rows, p) float32."""
    require_finalized(store, model_id)
    return features_rows(store, model_id, start, stop)


# ---------------------------------------------------------------------------------------------- targets
def begin_targets(store: RunStore, exp_name: str, model_id: int, num_targets: int) -> None:
    """Make experiment ``exp_name`` ready for the target gradients of finalized ``model_id``."""
    require_finalized(store, model_id)
    plan_experiment(store, exp_name, num_targets, [model_id])


def target_rows(store: RunStore, featurizer: Featurizer, exp_name: str, model_id: int, batch, rows) -> None:
    """Project the gradients of a batch of targets (rows ``rows``) and write them. Rows stored already with the
    same bits (the same targets again: a rerun) are left as they are, and so are their solve and scores."""
    rows = np.asarray(rows)
    order = np.argsort(rows)
    g = featurizer.target_features(batch, model_id, rows)
    rows, g = rows[order], g[order]
    stored = store.stored_target_rows(exp_name, model_id, rows)
    if stored is not None and np.array_equal(stored, g.astype(store.meta.np_dtype, copy=False)):
        return
    store.write_target_rows(exp_name, model_id, rows, g)


def featurize_targets(
    store: RunStore,
    exp_name: str,
    model_id: int,
    featurizer: Callable[[], Featurizer],
    batch: Callable[[int, int], list],
    batch_size: int,
) -> bool:
    """All target gradients of ``exp_name`` for ``model_id``, in batches, written at once.

    Returns:
        True when the store held them already.
    """
    if store.targets_complete(exp_name, model_id):
        return True
    feat = featurizer()
    m = store.num_targets(exp_name)
    batch_size = _budget_batch(feat, store.meta, m, batch(0, min(m, PROBE_SAMPLE_ROWS)), model_id, batch_size)
    gs = [
        feat.target_features(batch(s, min(s + batch_size, m)), model_id, range(s, min(s + batch_size, m)))
        for s in range(0, m, batch_size)
    ]
    store.write_target_rows(exp_name, model_id, slice(0, m), np.concatenate(gs))
    return False


# ---------------------------------------------------------------------------------------------- scores
def prepare_scores(store: RunStore, exp_name: str, model_ids: Sequence[int] | None = None) -> list[int]:
    """The checkpoints the scores combine (finalized, targets complete), each one's G·A written once, and the
    score rows of another combination forgotten. Call once before :func:`score_block`."""
    used = usable_models(store, exp_name, model_ids)
    solve_targets(store, exp_name, used)
    store.begin_scores(exp_name, used)
    return used


def score_block(
    store: RunStore, exp_name: str, model_ids: list[int], a: int, b: int, progress: Progress = None
) -> bool:
    """Combined scores of train rows [a, b) not yet marked done. Returns True when all were done."""
    with store.pinned():  # this block's groups and arrays opened once
        todo = unscored_ranges(store, exp_name, a, b)
        _advance(progress, (b - a) - sum(e - s for s, e in todo))
        if not todo:
            return True
        right = load_solved(store, exp_name, model_ids)
        for s, e in todo:
            score_rows(store, exp_name, model_ids, s, e, right, progress=progress)
    return False


def score_all(
    store: RunStore, exp_name: str, model_ids: Iterable[int] | None = None, allow_skip: bool = False
) -> np.ndarray:
    """All rows' combined scores computed again in one pass (traker's ``finalize_scores``), (n, m) float32."""
    store.num_targets(exp_name)  # an unknown experiment: a clear error
    return finalize_scores(store, exp_name, model_ids, allow_skip)


def is_complete(store: RunStore, exp_name: str, model_ids: list[int]) -> bool:
    """Whether the store holds every result of a run: each model finalized with its targets, every score row
    combined from exactly ``model_ids``."""
    if exp_name not in store.experiments() or store.scored_with(exp_name) != model_ids:
        return False
    for mid in model_ids:
        if not (store.has_model(mid) and store.is_finalized(mid) and store.targets_complete(exp_name, mid)):
            return False
    return bool(store.scores_done_mask(exp_name).all())
