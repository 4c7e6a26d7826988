"""The rules a run's inputs must follow, checked before anything is computed or written: one set for every front
door. The pipeline's plan checks its whole data once (:mod:`trak_core.plan`); TRAKer checks each batch as it is
given, and each checkpoint as it is loaded. The same bad input gets the same message either way: it names the field
(``train_data``, ``target_data``, ``checkpoints[i]``, ``proj_dim``, ``projector``) and the example indices, tensor
or parameter names. Plain values in, :class:`~trak_core.errors.BadInputError` out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from .adapters import load_state, read_state_file
from .errors import BadInputError
from .projectors import projector_traits

#: rows per block of the NaN/inf scan: its temporaries stay O(block), not O(n)
FINITE_CHECK_ROWS = 65_536


def prefixed(field: str, e: Exception) -> BadInputError:
    """``e`` as a BadInputError whose message starts with ``field``."""
    msg = str(e)
    return BadInputError(msg if msg.startswith(field) else f"{field}: {msg}")


def check_batch(task, data: Sequence, field: str, rows: int | None = None) -> None:
    """The task's own checks (:meth:`~trak_core.modelout.AbstractModelOutput.validate_batch`: the batch's form,
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


def check_projection(kind: str, proj_dim: int, train_set_size: int, lambda_setting) -> None:
    """Refuse a projection of ``proj_dim`` ≥ the number of train examples with no damping (``lambda_setting`` 0,
    :attr:`trak_core.damping.LambdaRule.setting`): XᵀX is then singular and the scores noise."""
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
    """The state_dict in the file ``path`` (a torch file or safetensors, :func:`trak_core.adapters.read_state_file`),
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
