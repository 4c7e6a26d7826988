"""The plan step of a run, before anything is computed: the rules every input must follow (one set for every front
door), which projector (a new store's default split by the gradient energy, probed once; an existing store's rebuilt
from its record), the store's metadata and layout, every input checked against the settings and the existing store,
then the store's arrays and records created once, before any fan-out. Plain values in (the algorithm's
:class:`~trak_core.settings.TrakSettings`, a model, a task, tensors, paths): the pipeline's plan task, TRAKer and
TrakIndex call these functions, and the featurize tasks rebuild their projector here from the store's record.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trak_core.featurize.adapters import load_state, read_state_file
from trak_core.featurize.featurizer import Featurizer
from trak_core.featurize.gradients import FunctionalGradientComputer, grad_dim_of
from trak_core.projection.base import AbstractProjector
from trak_core.projection.energy import PROBE_ROWS
from trak_core.projection.projectors import make_projector, projector_traits, rebuild_kwargs
from trak_core.solve.damping import parse_lambda_reg
from trak_core.solve.kfac import KFAC_CURVATURES

from . import engine
from .checkpoints import record_of, state_digest
from .errors import BadInputError, StoreMismatchError
from .lds import array_fingerprint
from .settings import TrakSettings
from .store import RunStore, StoreMetadata, open_store, store_exists
from .store.verify import repair_store, verify_store

# ---------------------------------------------------------------------------------------------- input rules
# One set for every front door: the pipeline's plan checks its whole data once (:func:`check_inputs`); TRAKer checks
# each batch as it is given and each checkpoint as it is loaded; TrakIndex each query batch. The same bad input gets
# the same message either way: it names the field (``train_data``, ``target_data``, ``checkpoints[i]``,
# ``proj_dim``, ``projector``) and the example indices, tensor or parameter names.
#: rows per block of the NaN/inf scan: its temporaries stay O(block), not O(n)
FINITE_CHECK_ROWS = 65_536


def prefixed(field: str, e: Exception) -> BadInputError:
    """``e`` as a BadInputError whose message starts with ``field``."""
    msg = str(e)
    return BadInputError(msg if msg.startswith(field) else f"{field}: {msg}")


def check_batch(task, data: Sequence, field: str, rows: int | None = None) -> None:
    """The task's own checks (:meth:`~trak_core.featurize.modelout.AbstractModelOutput.validate_batch`: the batch's
    form,
    the labels' dtype and range) of ``data``, or of its first ``rows`` rows, named by ``field``."""
    try:
        task.validate_batch(data if rows is None else [t[:rows] for t in data])
    except BadInputError as e:
        raise prefixed(field, e) from None


def _all_finite(t: torch.Tensor) -> bool:
    """One reduction proves a tensor finite (a NaN or inf makes its sum non-finite); a non-finite sum (which may
    be an overflow of finite entries) is decided entry by entry."""
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


def check_finite(data: Sequence, field: str, indices: Sequence[int] | None = None) -> None:
    """Refuse NaN or inf anywhere in the floating tensors of ``data``, naming the example indices (``indices``:
    the example index of each row, e.g. a batch's rows in the data set; by default the row positions)."""
    for i, t in enumerate(data):
        if not torch.is_tensor(t) or not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
            continue
        flat = t.reshape(t.shape[0], -1)
        bad: list[int] = []
        for a in range(0, flat.shape[0], FINITE_CHECK_ROWS):
            block = flat[a : a + FINITE_CHECK_ROWS]
            if t.is_complex() or not _all_finite(block):
                bad += (a + (~torch.isfinite(block).all(dim=1)).nonzero().reshape(-1)).tolist()
        if bad:
            if indices is not None:
                bad = [int(indices[j]) for j in bad]
            more = f" (and {len(bad) - 20} more)" if len(bad) > 20 else ""
            raise BadInputError(
                f"{field}: NaN or inf in tensor {i} at example indices {bad[:20]}{more}; nothing was written"
            )


def check_dtypes(model: torch.nn.Module, data: Sequence, field: str) -> None:
    """Refuse floating inputs of another dtype than the model's parameters (float64 data, float32 model), which
    would fail inside the forward pass. A mixed-precision model is left to its forward pass."""
    model_dt = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(model_dt) != 1:
        return
    (want,) = model_dt
    for i, t in enumerate(data):
        if torch.is_tensor(t) and t.is_floating_point() and t.dtype != want:
            raise BadInputError(
                f"{field}: tensor {i} is {t.dtype} but the model's parameters are {want}: cast the data "
                f"(x.to({want})) or the model (model.to({t.dtype})); nothing was written"
            )


def lambda_setting(lambda_reg):
    """The setting of a ``lambda_reg`` value (a number, or the name of a rule): what :func:`check_projection`
    compares with 0."""
    return parse_lambda_reg(lambda_reg).setting


def check_projection(kind: str, proj_dim: int, train_set_size: int, lambda_setting, curvature: str = "xtx") -> None:
    """Refuse a projection of ``proj_dim`` ≥ the number of train examples with no damping (``lambda_setting`` 0,
    :attr:`trak_core.solve.damping.LambdaRule.setting`): XᵀX is then singular and the scores noise. A Kronecker-factored
    ``curvature`` damps each block of its own (nothing to refuse there) but needs the factored projection, whose blocks
    are the layers."""
    if curvature in KFAC_CURVATURES:
        if kind != "factored":
            raise BadInputError(
                f"curvature={curvature!r} needs the factored projector (its blocks are the layers that the Kronecker "
                f"factors curve), not {kind!r}: use the default projector"
            )
        return
    n = int(train_set_size)
    if proj_dim < n or lambda_setting != 0:
        return
    if projector_traits(kind).is_identity:
        raise BadInputError(
            f"projector: {kind!r} keeps all {proj_dim} gradient dimensions, ≥ the number of "
            f"train examples n={n}: XᵀX is singular with lambda_reg=0 (scores would be noise); "
            "give an absolute lambda_reg > 0, or a projection with proj_dim well below n"
        )
    raise BadInputError(
        f"proj_dim: {proj_dim} ≥ number of train examples n={n} makes XᵀX singular "
        "(scores would be noise); use a proj_dim well below n, or lambda_reg > 0"
    )


def read_checkpoint(path: str, device="cpu", field: str = "checkpoints") -> dict:
    """The state_dict in the file ``path`` (a torch file or safetensors,
    :func:`trak_core.featurize.adapters.read_state_file`),
    or BadInputError naming ``field`` and the file when it is missing or holds no state_dict."""
    try:
        sd = read_state_file(path, device)
    except FileNotFoundError:
        raise BadInputError(f"{field}: checkpoint {path} does not exist") from None
    except Exception as e:
        raise BadInputError(
            f"{field}: cannot load checkpoint {path} as a state_dict ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(sd, dict):
        raise BadInputError(f"{field}: {path} holds a {type(sd).__name__}, not a state_dict")
    return sd


def check_state_finite(state_dict: Mapping, field: str, source: str) -> None:
    """Refuse a checkpoint (``source``: its file, or what gave it) with NaN or inf in a floating entry."""
    bad = [
        k
        for k, v in state_dict.items()
        if torch.is_tensor(v) and v.is_floating_point() and v.numel() and not _all_finite(v)
    ]
    if bad:
        raise BadInputError(f"{field}: {source} has NaN or inf in {bad[:5]}; nothing was written")


def check_state(model: torch.nn.Module, state_dict: Mapping, field: str, source: str, model_name: str = "") -> None:
    """Load ``state_dict`` into ``model`` (refused, naming ``source``, when it does not fit) and refuse it when it is
    not finite (:func:`check_state_finite`)."""
    try:
        load_state(model, dict(state_dict))
    except RuntimeError as e:
        named = f" {model_name!r}" if model_name else ""
        raise BadInputError(f"{field}: {source} does not fit the model{named}: {e}") from None
    check_state_finite(state_dict, field, source)


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


def split_of(meta: StoreMetadata, location: str | None = None) -> dict | None:
    """The split keywords of the projector a store's metadata ``meta`` records (None: a kind not split by layer).
    A record of a layout this code does not build is refused (StoreMismatchError)."""
    if not projector_traits(meta.projector).splits_by_layer:
        return None
    try:
        return rebuild_kwargs(meta.projector, dict(meta.projector_params))
    except BadInputError as e:
        at = f" at {location}" if location else ""
        raise StoreMismatchError(f"projector_params: the store{at} cannot be read here ({e})") from None


def stored_meta(location: str, storage_options: dict | None = None) -> StoreMetadata | None:
    """The metadata of the store at ``location`` (None: no store there yet)."""
    if not store_exists(location, storage_options):
        return None
    return open_store(location, storage_options, mode="r", check_arrays=False).meta


def stored_split(location: str, storage_options: dict | None = None) -> tuple[bool, dict | None]:
    """(whether a store is at ``location``, the split keywords its metadata records or None): what rebuilds the
    store's projector from the model alone."""
    meta = stored_meta(location, storage_options)
    return meta is not None, None if meta is None else split_of(meta, location)


def rebuild_projector(
    kind: str, grad_dim: int, proj_dim: int, seed: int, proj_type: str, split: dict, model, grad_wrt, device
) -> AbstractProjector:
    """The projector ``kind`` with a store's recorded keywords ``split`` (:func:`stored_split`); a store of other
    sizes or seed is then refused by its metadata, naming the field."""
    try:
        return make_projector(
            kind, grad_dim, proj_dim, seed, proj_type, device=device, model=model, grad_wrt=grad_wrt, **split
        )
    except BadInputError as e:
        raise BadInputError(f"projector: cannot rebuild the store's {kind!r} projection ({e})") from None


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


def task_projector(settings: TrakSettings, meta: StoreMetadata, device, model: torch.nn.Module) -> AbstractProjector:
    """The projector of a featurize task: rebuilt from the store's metadata ``meta`` for ``model`` (never probed)."""
    s = settings
    return build_projector(
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


def task_featurizer(
    settings: TrakSettings,
    meta: StoreMetadata,
    model: torch.nn.Module,
    task,
    state_dict: dict,
    device,
    max_memory: int | None = None,
) -> Featurizer:
    """The featurizer of a task at checkpoint ``state_dict``, its projector rebuilt from the store's ``meta``."""
    model = model.to(device)
    feat = Featurizer(
        model,
        task,
        task_projector(settings, meta, device, model),
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
) -> CheckedInputs:
    """Check everything that can be checked without computing gradients: the task's batches, NaN/inf and dtypes of
    the data, the projection against the number of train rows (:func:`check_projection`), the
    memory of a task, that every checkpoint fits the model and is finite; a new store of a projector split by layer
    probes its split at the first checkpoint. Raises BadInputError naming the field; nothing is written.

    Args:
        checkpoints: their paths (model_id i is ``checkpoints[i]``, the field its errors name).
        location: the store's (an existing store keeps its own split and, when it grows, its layout).
    """
    named = ((train, "train_data"), (targets, "target_data"))
    for data, field in named:
        check_batch(task, data, field, rows=batch_size)
    for data, field in named:
        check_finite(data, field)
    for data, field in named:
        check_dtypes(model, data, field)
    n = int(train[0].shape[0])
    stored = stored_meta(location, storage_options)
    split = split_of(stored) if stored is not None else None  # a store's own split, never probed again
    probe = stored is None and projector_traits(settings.projector).splits_by_layer  # a new store's split

    def metadata(split):
        meta = run_metadata(settings, model, task, n, chunk_rows=chunk_rows, shard_rows=shard_rows, split=split)
        return stored_layout(meta, stored, chunk_rows, shard_rows)

    meta = metadata(split)
    check_projection(settings.projector, meta.proj_dim, n, settings.lambda_rule.setting, settings.curvature)
    engine.check_memory(
        meta,
        model,
        batch_size=batch_size,
        num_targets=int(targets[0].shape[0]),
        projector=settings.projector,
        available=max_memory,
    )
    digests = []
    for i, path in enumerate(checkpoints):
        sd = read_checkpoint(path, "cpu", field=f"checkpoints[{i}]")
        digests.append(state_digest(sd))
        check_state(model, sd, f"checkpoints[{i}]", path, model_name)
        if probe and i == 0:  # the model holds the first checkpoint: the split follows its gradient energy
            meta = metadata(probe_split(model, task, train, settings.grad_wrt, batch_size))
    return CheckedInputs(
        meta=meta, checkpoints=tuple(checkpoints), train=train, targets=targets, state_digests=tuple(digests)
    )


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
