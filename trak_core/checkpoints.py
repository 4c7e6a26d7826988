"""The identity of a checkpoint: one content record, made and checked the same way by every front door.

A store records, per model id, what it was featurized from: ``{"path", "state_sha256"}`` and, for a file,
``"sha256"`` (its bytes). ``state_sha256`` (:func:`state_digest`) is the digest of the state dict's tensors,
names, dtypes, shapes and values: the same for a file and for the state dict it holds, so a checkpoint given as
a file to one route (the pipeline, ``trakflow query``) and as a state dict to another (TRAKer, TrakIndex) is
recognized as the same. :func:`check_record` compares a given checkpoint with the recorded one on
``state_sha256`` where both have it (on ``sha256`` for a record made before the store kept state digests) and
raises :class:`StoreMismatchError` naming the model id.
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from trak_core.featurize.adapters import load_state as load_into_model
from trak_core.featurize.adapters import read_state_file

from .errors import BadInputError, StoreMismatchError

#: the ``path`` of a record made from a state dict given as an object
STATE_DICT = "a state dict given as an object"


def state_digest(state_dict: Mapping[str, Any]) -> str:
    """sha256 of a state dict's entries in name order: each tensor's name, dtype, shape and bytes (a non-tensor
    entry: its name and repr). Independent of the entries' order and of where the tensors live."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        v = state_dict[name]
        if torch.is_tensor(v):
            a = v.detach().cpu().contiguous()
            h.update(f"{name}|{a.dtype}|{tuple(a.shape)}|".encode())
            h.update(a.reshape(-1).view(torch.uint8).numpy().tobytes() if a.numel() else b"")
        else:
            h.update(f"{name}|{v!r}|".encode())
    return h.hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def load_state(path: str | os.PathLike, field: str = "checkpoints") -> dict:
    """The state dict a checkpoint file holds (``torch.save`` of a state dict), on the CPU; BadInputError naming
    ``field`` when it is not one."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise BadInputError(f"{field}: {path} is not a file")
    try:
        sd = read_state_file(path)  # torch.save's format, or .safetensors (what save_pretrained writes)
    except Exception as e:
        raise BadInputError(f"{field}: {path} is not a readable state dict ({type(e).__name__}: {e})") from None
    if not isinstance(sd, Mapping):
        raise BadInputError(f"{field}: {path} holds a {type(sd).__name__}, not a state dict")
    return dict(sd)


def record_of(
    checkpoint: Mapping[str, Any] | str | os.PathLike, *, digest: str | None = None, label: str | None = None
) -> dict:
    """The record of a checkpoint: a file → ``{"path", "sha256", "state_sha256"}`` (``digest``: the
    :func:`state_digest` of its contents when they were loaded already, else it is loaded); a state dict →
    ``{"path": label, "state_sha256"}``."""
    if isinstance(checkpoint, (str, os.PathLike)):
        path = os.path.abspath(os.fspath(checkpoint))
        digest = digest if digest is not None else state_digest(load_state(path))
        return {"path": path, "sha256": file_sha256(path), "state_sha256": digest}
    return {"path": label or STATE_DICT, "state_sha256": digest or state_digest(checkpoint)}


def _recorded_digest(recorded: Mapping[str, Any]) -> str | None:
    """The state digest of a record that has none (made before stores kept them), from its file when that is
    still the recorded one; None when it cannot be known."""
    path, sha = recorded.get("path"), recorded.get("sha256")
    if not path or not sha or not os.path.isfile(path) or file_sha256(path) != sha:
        return None
    try:
        return state_digest(load_state(path))
    except BadInputError:
        return None


def same_checkpoint(recorded: Mapping[str, Any], given: Mapping[str, Any]) -> bool | None:
    """Whether ``given`` is the checkpoint of ``recorded`` (both records of :func:`record_of`): compared on
    ``state_sha256``, else on ``sha256``; a state dict against an older file record through the recorded file.
    None: they cannot be compared (an older record whose file is gone or changed)."""
    if recorded.get("state_sha256") and given.get("state_sha256"):
        return recorded["state_sha256"] == given["state_sha256"]
    if recorded.get("sha256") and given.get("sha256"):
        return recorded["sha256"] == given["sha256"]
    if given.get("state_sha256") and recorded.get("sha256"):
        digest = _recorded_digest(recorded)
        return None if digest is None else digest == given["state_sha256"]
    return None


def check_record(
    recorded: Mapping[str, Any] | None,
    given: Mapping[str, Any],
    model_id: int,
    location: str,
    field: str = "checkpoints",
) -> None:
    """Refuse (StoreMismatchError naming ``field`` and ``model_id``) a checkpoint whose record ``given`` is not
    the one ``model_id`` of the store at ``location`` was featurized from (``recorded``; None: nothing recorded,
    nothing to check). A record that cannot be compared (:func:`same_checkpoint`) gives a warning."""
    if not recorded:
        return
    same = same_checkpoint(recorded, given)
    if same is None:
        warnings.warn(
            f"{field}: cannot check the checkpoint given for model_id={model_id} against the store at {location} "
            f"(its record names {recorded.get('path')}, which is gone or changed)",
            stacklevel=3,
        )
        return
    if not same:
        what = given["path"] if given.get("sha256") and given.get("path") else "the state dict"
        raise StoreMismatchError(
            f"{field}: {what} is not the checkpoint model_id={model_id} in {location} was featurized from "
            f"({recorded.get('path')}): its content differs; give each model id its own checkpoint (in model id "
            "order), or use a new model_id or a new store"
        )


__all__ = ["STATE_DICT", "check_record", "file_sha256", "load_state", "record_of", "same_checkpoint", "state_digest"]


# ---------------------------------------------------------------------------------------------- a checkpoint's rules
# (the same for every front door: the pipeline's plan, TRAKer's load_checkpoint, the index)
def all_finite(t: torch.Tensor) -> bool:
    """One reduction proves a tensor finite (a NaN or inf makes its sum non-finite); a non-finite sum (which may
    be an overflow of finite entries) is decided entry by entry."""
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


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
        if torch.is_tensor(v) and v.is_floating_point() and v.numel() and not all_finite(v)
    ]
    if bad:
        raise BadInputError(f"{field}: {source} has NaN or inf in {bad[:5]}; nothing was written")


def check_state(model: torch.nn.Module, state_dict: Mapping, field: str, source: str, model_name: str = "") -> None:
    """Load ``state_dict`` into ``model`` (refused, naming ``source``, when it does not fit) and refuse it when it is
    not finite (:func:`check_state_finite`)."""
    try:
        load_into_model(model, dict(state_dict))
    except RuntimeError as e:
        named = f" {model_name!r}" if model_name else ""
        raise BadInputError(f"{field}: {source} does not fit the model{named}: {e}") from None
    check_state_finite(state_dict, field, source)
