"""The plan step of a run, before anything is computed: which projector (a new store's default split by the gradient
energy, probed once; an existing store's rebuilt from its record), the store's metadata and layout, every input
checked against the settings and the existing store, then the store's arrays and records created once, before any
fan-out. Plain values in (the algorithm's :class:`~trak_core.settings.TrakSettings`, a model, a task, tensors, paths):
the pipeline's plan task calls these functions, and the featurize tasks rebuild their projector here from the store's
record. The rules every input must follow (one set for every front door) are in :mod:`trak_core.rules`, re-exported
here; TRAKer and TrakIndex reach them through :mod:`trak_core.engine`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trak_core.featurize.featurizer import Featurizer
from trak_core.featurize.gradients import FunctionalGradientComputer, grad_dim_of
from trak_core.projection.base import AbstractProjector
from trak_core.projection.energy import PROBE_ROWS
from trak_core.projection.projectors import make_projector, projector_traits

from . import engine
from .checkpoints import check_state as check_state
from .checkpoints import check_state_finite as check_state_finite
from .checkpoints import read_checkpoint as read_checkpoint
from .checkpoints import record_of, state_digest
from .errors import BadInputError, StateError
from .lds import array_fingerprint
from .rules import FINITE_CHECK_ROWS as FINITE_CHECK_ROWS
from .rules import check_batch as check_batch
from .rules import check_dtypes as check_dtypes
from .rules import check_finite as check_finite
from .rules import check_projection as check_projection
from .rules import lambda_setting as lambda_setting
from .rules import prefixed as prefixed
from .rules import rebuild_projector as rebuild_projector
from .rules import split_of as split_of
from .rules import stored_meta as stored_meta
from .rules import stored_split as stored_split
from .settings import TrakSettings
from .store import RunStore, StoreMetadata, open_store, store_exists
from .store.verify import repair_store, verify_store


# ---------------------------------------------------------------------------------------------- the projector
def build_projector(
    kind: str,
    grad_dim: int,
    proj_dim: int,
    seed: int,
    proj_type: str,
    *,
    model: torch.nn.Module,
    grad_wrt=None,
    device="cpu",
    split: dict | None = None,
) -> AbstractProjector:
    """The projector ``kind`` (a kind split by layer takes its blocks from ``model`` and its split keywords from
    ``split``: :func:`split_of` a store's record, or a new store's probe; None: the equal split). Refused
    (BadInputError starting with ``projector:``) when it cannot be built for these sizes or this model."""
    try:
        return make_projector(
            kind,
            grad_dim,
            proj_dim,
            seed,
            proj_type,
            device=device,
            model=model,
            grad_wrt=grad_wrt,
            **((split or {}) if projector_traits(kind).splits_by_layer else {}),
        )
    except BadInputError as e:
        raise prefixed("projector", e) from None


def stored_projector(
    location: str, model, grad_wrt=None, device: str = "cpu", storage_options: dict | None = None
) -> AbstractProjector:
    """The factored projector a store at ``location`` records, rebuilt from its record and ``model``: hand it to a
    new run (``TRAKer(projector=...)``) to project with the split that store was created with."""
    meta = stored_meta(location, storage_options)
    split = None if meta is None else split_of(meta, location)
    if meta is None or split is None:
        what = "no store" if meta is None else "a store of another projector than 'factored'"
        raise BadInputError(f"projector: {location} holds {what}; there is no recorded split to rebuild")
    return rebuild_projector(
        "factored", meta.grad_dim, meta.proj_dim, meta.proj_seed, meta.proj_type, split, model, grad_wrt, device
    )


def run_metadata(
    settings: TrakSettings,
    model: torch.nn.Module,
    task,
    train_set_size: int,
    *,
    chunk_rows: int | None = None,
    shard_rows: int | None = None,
    split: dict | None = None,
) -> StoreMetadata:
    """The store metadata of a run of ``settings`` (:func:`trak_core.engine.store_metadata`, as TRAKer builds it;
    ``split``: see :func:`build_projector`)."""
    try:
        grad_dim = grad_dim_of(model, settings.grad_wrt)
    except BadInputError as e:
        raise prefixed("grad_wrt", e) from None
    s = settings
    projector = build_projector(
        s.projector, grad_dim, s.proj_dim, s.proj_seed, s.proj_type, model=model, grad_wrt=s.grad_wrt, split=split
    )
    return engine.store_metadata(
        projector,
        train_set_size=train_set_size,
        dtype=s.dtype,
        task=task,
        chunk_rows=chunk_rows,
        shard_rows=shard_rows,
        curvature=s.curvature,
    )


def stored_layout(
    meta: StoreMetadata, stored: StoreMetadata | None, chunk_rows: int | None, shard_rows: int | None
) -> StoreMetadata:
    """``meta`` with the chunk and shard rows of the existing store (``stored``) where the caller leaves them to be
    chosen (None): they are chosen by the number of rows, and a store that grows keeps its own."""
    if (chunk_rows is not None and shard_rows is not None) or stored is None:
        return meta
    if stored.train_set_size >= meta.train_set_size:
        return meta
    layout = {"chunk_rows": chunk_rows or stored.chunk_rows, "shard_rows": shard_rows or stored.shard_rows}
    return StoreMetadata.model_validate({**meta.model_dump(), **layout})


def probe_split(model: torch.nn.Module, task, train: Sequence[torch.Tensor], grad_wrt, batch_size: int) -> dict:
    """The split keywords of a new store's projector split by layer (:func:`trak_core.engine.probe_split`), probed
    on the first :data:`~trak_core.projection.energy.PROBE_ROWS` train rows with ``model`` at the first checkpoint, on
    the CPU.
    Computed once, by the plan: the store records them and every task rebuilds the projector from that record."""
    try:
        rows = [t[:PROBE_ROWS] for t in train]
        return engine.probe_split(model, task, rows, grad_wrt, batch_size, skip_nonfinite=False)
    except BadInputError as e:
        raise prefixed("checkpoints[0]", e) from None


def task_projector(
    settings: TrakSettings, meta: StoreMetadata, device, model: torch.nn.Module, store: RunStore | None = None
) -> AbstractProjector:
    """The projector of a featurize task: rebuilt from the store's metadata ``meta`` for ``model`` (never probed); of
    a ``"kfac-eigen"`` store, bound to the factors ``store`` records (:func:`trak_core.engine.bind_recorded_eigen`)."""
    s = settings
    projector = build_projector(
        s.projector,
        meta.grad_dim,
        s.proj_dim,
        s.proj_seed,
        s.proj_type,
        model=model,
        grad_wrt=s.grad_wrt,
        device=device,
        split=split_of(meta),
    )
    if meta.curvature in engine.FIT_BEFORE_FEATURIZE:
        if store is None:
            raise StateError(f"curvature={meta.curvature!r}: the projector needs the store its factors are recorded in")
        engine.bind_recorded_eigen(projector, store)
    return projector


def task_featurizer(
    settings: TrakSettings,
    meta: StoreMetadata,
    model: torch.nn.Module,
    task,
    state_dict: dict,
    device,
    max_memory: int | None = None,
    store: RunStore | None = None,
) -> Featurizer:
    """The featurizer of a task at checkpoint ``state_dict``, its projector rebuilt from the store's ``meta`` (and
    ``store``: :func:`task_projector`)."""
    model = model.to(device)
    feat = Featurizer(
        model,
        task,
        task_projector(settings, meta, device, model, store),
        FunctionalGradientComputer,
        settings.grad_wrt,
        device,
        stored_dtype=torch.float16 if meta.dtype == "float16" else torch.float32,
        max_memory=max_memory,
    )
    feat.load_state(state_dict)
    return feat


# ---------------------------------------------------------------------------------------------- the inputs
@dataclass(frozen=True)
class CheckedInputs:
    """What :func:`check_inputs` established (nothing written yet)."""

    meta: StoreMetadata
    checkpoints: tuple[str, ...]
    train: tuple
    targets: tuple
    state_digests: tuple[str, ...] = ()  # each checkpoint's trak_core.checkpoints.state_digest
    #: a new "kfac-eigen" store: model 0's factors, fitted to split its projection (:func:`eigen_fit`), recorded
    factors: engine.KroneckerFactors | None = None

    @property
    def num_targets(self) -> int:
        return int(self.targets[0].shape[0])


def check_inputs(
    settings: TrakSettings,
    model: torch.nn.Module,
    task,
    train: tuple,
    targets: tuple,
    checkpoints: Sequence[str],
    *,
    location: str,
    storage_options: dict | None = None,
    batch_size: int,
    chunk_rows: int | None = None,
    shard_rows: int | None = None,
    max_memory: int | None = None,
    model_name: str = "",
    curvature_rows: int | None = None,
    device="cpu",
) -> CheckedInputs:
    """Check everything that can be checked without computing gradients: the task's batches, NaN/inf and dtypes of
    the data, the projection against the number of train rows (:func:`check_projection`), the
    memory of a task, that every checkpoint fits the model and is finite; a new store of a projector split by layer
    probes its split at the first checkpoint. Raises BadInputError naming the field; nothing is written.

    Args:
        checkpoints: their paths (model_id i is ``checkpoints[i]``, the field its errors name).
        location: the store's (an existing store keeps its own split and, when it grows, its layout).
        curvature_rows, device: a new ``"kfac-eigen"`` store's fit of model 0 (:func:`eigen_fit`).
    """
    named = ((train, "train_data"), (targets, "target_data"))
    for data, field in named:
        check_batch(task, data, field, rows=batch_size)
    for data, field in named:
        check_finite(data, field)
    for data, field in named:
        check_dtypes(model, data, field)
    n = int(train[0].shape[0])
    lam, curvature = settings.lambda_rule.setting, settings.curvature
    check_projection(
        settings.projector, settings.proj_dim, n, lam, curvature, model=model, grad_wrt=settings.grad_wrt, task=task
    )
    stored = stored_meta(location, storage_options)
    split = split_of(stored) if stored is not None else None  # a store's own split, never probed again
    probe = stored is None and projector_traits(settings.projector).splits_by_layer  # a new store's split

    def metadata(split):
        meta = run_metadata(settings, model, task, n, chunk_rows=chunk_rows, shard_rows=shard_rows, split=split)
        return stored_layout(meta, stored, chunk_rows, shard_rows)

    meta = metadata(split)
    engine.check_memory(
        meta,
        model,
        batch_size=batch_size,
        num_targets=int(targets[0].shape[0]),
        projector=settings.projector,
        available=max_memory,
    )
    digests, factors, first = [], None, None
    for i, path in enumerate(checkpoints):
        sd = read_checkpoint(path, "cpu", field=f"checkpoints[{i}]")
        digests.append(state_digest(sd))
        check_state(model, sd, f"checkpoints[{i}]", path, model_name)
        if probe and i == 0:  # the model holds the first checkpoint: the split follows its gradient energy
            probed, first = probe_split(model, task, train, settings.grad_wrt, batch_size), sd
            meta = metadata(probed)
    if first is not None and settings.curvature in engine.FIT_BEFORE_FEATURIZE:  # every input checked: fit model 0
        factors = eigen_fit(settings, meta, model, task, first, train, batch_size, curvature_rows, device)
        meta = metadata(engine.eigen_split(probed, factors, settings.proj_dim))  # ... and spread as its factors say
    return CheckedInputs(
        meta=meta,
        checkpoints=tuple(checkpoints),
        train=train,
        targets=targets,
        state_digests=tuple(digests),
        factors=factors,
    )


def eigen_fit(
    settings: TrakSettings,
    meta: StoreMetadata,
    model: torch.nn.Module,
    task,
    state_dict: dict,
    train: Sequence[torch.Tensor],
    batch_size: int,
    rows: int | None,
    device="cpu",
) -> engine.KroneckerFactors:
    """Model 0's Kronecker factors at ``state_dict`` (the fit the pipeline's fit step would make: ``rows`` of
    ``train`` evenly spaced, or all), fitted by the plan of a new ``"kfac-eigen"`` store: its projection's split
    between layers is theirs (:func:`trak_core.engine.eigen_split`, as TRAKer's), and they are recorded with it."""
    plain = meta.model_copy(update={"curvature": "xtx"})  # the fit projects nothing: no eigenbasis to bind yet
    feat = task_featurizer(settings, plain, model, task, state_dict, device)
    batches = engine.curvature_batches(train, rows, batch_size)
    try:
        return engine.fit_factors(feat, batches, settings.curvature, settings.curvature_damping, settings.grad_wrt)
    except BadInputError as e:
        raise prefixed("checkpoints[0]", e) from None


@dataclass(frozen=True)
class Fingerprints:
    """Content fingerprints (sha256) the store records, so other inputs are refused on a rerun."""

    train_data: str
    target_data: str
    checkpoints: tuple[dict, ...]  # per model_id: trak_core.checkpoints.record_of its file
    train_rows: engine.RowsPrint | None = None  # the fingerprint of train rows [a, b): names changed rows


def fingerprints(inputs: CheckedInputs) -> Fingerprints:
    return Fingerprints(
        train_data=array_fingerprint(inputs.train),
        target_data=array_fingerprint(inputs.targets),
        checkpoints=tuple(
            record_of(p, digest=d) for p, d in zip(inputs.checkpoints, inputs.state_digests, strict=True)
        ),
        train_rows=engine.train_rows_print(inputs.train),
    )


def run_records(inputs: CheckedInputs, prints: Fingerprints, settings: TrakSettings, exp_name: str) -> dict[str, Any]:
    """What the engine checks an existing store against (:func:`trak_core.engine.check_run`), and records in a new
    one (:func:`trak_core.engine.plan_run`)."""
    return dict(
        train_data=prints.train_data,
        checkpoints=prints.checkpoints,
        lambda_setting=settings.lambda_rule.setting,
        rescale=settings.rescale_inverse,
        exp_name=exp_name,
        num_targets=inputs.num_targets,
        target_data=prints.target_data,
        train_set_size=inputs.meta.train_set_size,
        train_rows=prints.train_rows,
    )


# ---------------------------------------------------------------------------------------------- the store
def check_against_store(
    location: str, inputs: CheckedInputs, settings: TrakSettings, exp_name: str, storage_options: dict | None = None
) -> None:
    """Refuse (StoreMismatchError / BadInputError, naming the field) an existing store made with other settings,
    data, checkpoints, λ or targets (:func:`run_records`), before anything is written. No store: nothing to check.
    More train rows than the store holds pass: :func:`create_run` appends them."""
    if not store_exists(location, storage_options):
        return
    store = open_store(location, storage_options)
    store.validate(inputs.meta, grow=True)
    engine.check_run(store, **run_records(inputs, fingerprints(inputs), settings, exp_name))


def create_run(
    location: str, inputs: CheckedInputs, settings: TrakSettings, exp_name: str, storage_options: dict | None = None
) -> tuple[RunStore, int | None]:
    """Create (or complete, or grow) the store's arrays and records once, before any fan-out, then make sure no
    chunk of rows marked done has vanished (:func:`check_chunks`). An existing store is checked first, as
    :func:`check_against_store` checks it: one that contradicts the run is refused before anything is written.
    Returns the store and the number of train rows it had when this run grows it (None otherwise)."""
    records = run_records(inputs, fingerprints(inputs), settings, exp_name)
    store = engine.open_run(location, inputs.meta, storage_options, grow=True)
    before = store.meta.train_set_size
    engine.plan_run(store, **records)
    if inputs.factors is not None and not engine.current_factors(store, 0):  # fitted by the plan (eigen_fit)
        engine.record_curvature(store, 0, inputs.factors)
    check_chunks(store)
    return store, before if before < inputs.meta.train_set_size else None


def check_chunks(store: RunStore) -> None:
    """The cheap part of ``trakflow verify`` (one listing per array, no chunk read), before any step skips work: a
    chunk of rows marked done that has vanished is unflagged with what depends on it (one warning naming the arrays
    and chunks), so the run recomputes those rows instead of reading zeros. Chunks that fail their checksum are found
    when read (StoreDamageError, not retried) or by ``trakflow verify``."""
    report = verify_store(store, read_chunks=False)
    if report.ok:
        return
    done = repair_store(store, report)  # type: ignore[arg-type]
    warnings.warn(f"{report.summary()}; recomputing: {'; '.join(done.actions)}", stacklevel=2)


def run_complete(location: str, inputs: CheckedInputs, exp_name: str, storage_options: dict | None = None) -> bool:
    """Whether the store at ``location`` holds every result the checked run asks for: no new train rows, every
    checkpoint finalized with its targets, every score row combined from all of them, no chunk gone. Reads only."""
    if not store_exists(location, storage_options):
        return False
    store = open_store(location, storage_options, mode="r")
    if store.meta.train_set_size != inputs.meta.train_set_size:
        return False
    if not engine.is_complete(store, exp_name, list(range(len(inputs.checkpoints)))):
        return False
    return verify_store(store, read_chunks=False).ok
