"""The rules of a run, one set for every front door, below both halves of the executor (:mod:`trak_core.plan`, the
planning half, and :mod:`trak_core.engine`, its face, which exposes them to TRAKer and TrakIndex): what every input
must follow (a batch, a checkpoint, the projection against the number of train rows), and the projector an existing
store records, rebuilt from its record. Plain values in, an error naming the field out; nothing is written.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch

from trak_core.featurize.gradients import grad_dim_of
from trak_core.projection.base import AbstractProjector
from trak_core.projection.projectors import make_projector, projector_traits, rebuild_kwargs
from trak_core.solve.damping import parse_lambda_reg
from trak_core.solve.kfac import KFAC_CURVATURES

from .errors import BadInputError, StoreMismatchError
from .store import StoreMetadata, open_store, store_exists

# ---------------------------------------------------------------------------------------------- input rules
# One set for every front door: the pipeline's plan checks its whole data once (plan.check_inputs); TRAKer checks
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


def check_finite(data: Sequence, field: str, indices: Sequence[int] | np.ndarray | None = None) -> None:
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


def check_batch_rows(
    task, model: torch.nn.Module, data: Sequence, field: str, rows: Callable[[], np.ndarray]
) -> np.ndarray:
    """A featurize batch given by a front door batch by batch: the task's checks (:func:`check_batch`), then its
    example indices ``rows()`` (the front door's own rule of which rows the batch holds), NaN/inf naming them
    (:func:`check_finite`), the dtypes (:func:`check_dtypes`). Returns the indices."""
    check_batch(task, data, field)
    inds = rows()
    check_finite(data, field, inds)
    check_dtypes(model, data, field)
    return inds


def lambda_setting(lambda_reg):
    """The setting of a ``lambda_reg`` value (a number, or the name of a rule): what :func:`check_projection`
    compares with 0."""
    return parse_lambda_reg(lambda_reg).setting


def check_projection(
    kind: str,
    proj_dim: int,
    train_set_size: int,
    lambda_setting,
    curvature: str = "xtx",
    *,
    model=None,
    grad_wrt=None,
    task=None,
) -> None:
    """Refuse a projection of ``proj_dim`` ≥ the number of train examples with no damping (``lambda_setting`` 0,
    :attr:`trak_core.solve.damping.LambdaRule.setting`): XᵀX is then singular and the scores noise. A Kronecker-factored
    ``curvature`` damps each block of its own (nothing to refuse there) but needs the factored projection, whose blocks
    are the layers. With ``model`` (and its ``grad_wrt``), an identity projector keeps its gradient's dimension,
    whatever ``proj_dim`` says. ``curvature="ggn"`` with a causal LM's ``task`` is allowed with a warning: its weights
    r = Q(1 − Q) are about each sequence's probability, near 0 (docs/damping.md measures it below ``xtx``)."""
    from trak_core.featurize.modelout import CausalLMModelOutput

    if curvature == "ggn" and isinstance(task, CausalLMModelOutput):
        warnings.warn(
            "curvature='ggn' with task='causal_lm': each sequence's weight r = Q(1 − Q) is about its probability, "
            "near 0 for most sequences, so the curvature is set by a few rows; on the held-out language model it "
            "scored below curvature='xtx' (the default): see docs/damping.md",
            UserWarning,
            stacklevel=3,
        )
    if curvature in KFAC_CURVATURES:
        if kind != "factored":
            raise BadInputError(
                f"curvature={curvature!r} needs the factored projector (its blocks are the layers that the Kronecker "
                f"factors curve), not {kind!r}: use the default projector"
            )
        return
    if model is not None and projector_traits(kind).is_identity:  # it keeps every gradient dimension of ``model``
        proj_dim = grad_dim_of(model, grad_wrt)
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


# ---------------------------------------------------------------------------------------------- a store's projector
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


def recorded_projector(meta: StoreMetadata, model, grad_wrt=None, device="cpu") -> AbstractProjector:
    """The projector the store's metadata ``meta`` records, of any kind, rebuilt for ``model`` from its record
    (:func:`rebuild_projector`; BadInputError ``projector: cannot rebuild ...`` when it cannot be)."""
    try:
        split = rebuild_kwargs(meta.projector, dict(meta.projector_params))
    except BadInputError as e:
        raise BadInputError(f"projector: cannot rebuild the store's {meta.projector!r} projection ({e})") from None
    kind, seed = meta.projector, meta.proj_seed
    return rebuild_projector(kind, meta.grad_dim, meta.proj_dim, seed, meta.proj_type, split, model, grad_wrt, device)


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
