"""Where a store lives: a local path (opened by its absolute path) or an fsspec URL; checks before creating."""

from __future__ import annotations

import os
import tempfile
from typing import Literal
from urllib.parse import urlparse

import zarr

from ..errors import BadInputError, StoreDamageError


def _is_url(location: str) -> bool:
    return "://" in str(location)


def check_writable(location: str) -> None:
    """Fail before any compute when a local store location cannot be created or written.

    Walks up to the first existing ancestor, which must be a directory in which a probe directory can be
    created and removed (works as root too, where permission bits do not tell). Leaves nothing behind.
    """
    if _is_url(location) and not str(location).startswith("file://"):
        return  # remote stores are checked by the first write
    path = urlparse(str(location)).path if str(location).startswith("file://") else str(location)
    path = os.path.abspath(path)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise BadInputError(f"store: {path} exists and is not a directory")
    probe = path
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise BadInputError(f"store: {path} cannot be created: {probe} exists and is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".trakflow-probe-", dir=probe))
    except OSError as e:
        raise BadInputError(f"store: {path} is not writable ({probe}: {e.strerror or e})") from None


def _open_zarr(
    location: str, mode: Literal["r", "r+", "a", "w", "w-"], storage_options: dict | None = None
) -> zarr.Group:
    if str(location).startswith("file://"):  # fsspec's local files do not create parents: use zarr's LocalStore
        location = urlparse(str(location)).path
    if not _is_url(location):  # zarr's LocalStore strips a relative root from keys by str.replace (`s/` in `models/`)
        location = os.path.abspath(location)
    options = storage_options if storage_options and _is_url(location) else None  # None: zarr's default
    return zarr.open_group(store=str(location), mode=mode, zarr_format=3, storage_options=options)


def _refuse_orphan_arrays(location: str, storage_options: dict | None = None) -> None:
    """Refuse (:class:`StoreDamageError`) a location that holds a store's arrays but no root metadata (its
    root zarr.json deleted or rewritten): creating a store there would adopt arrays made with other settings."""
    loc = str(location)
    if loc.startswith("file://"):
        loc = urlparse(loc).path
    try:
        if _is_url(loc):
            from fsspec.core import url_to_fs

            fs, path = url_to_fs(loc, **(storage_options or {}))
            names = [n.rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(path, detail=False)]
        else:
            names = os.listdir(loc)
    except (FileNotFoundError, NotADirectoryError):
        return
    found = sorted(n for n in names if n in ("models", "experiments"))
    if found:
        raise StoreDamageError(
            f"store {location}: it holds a store's arrays ({', '.join(n + '/' for n in found)}) but no root metadata "
            "(its root zarr.json is missing or has no trakflow metadata), so the settings its arrays were made "
            "with cannot be checked; refusing to create a store over them. Restore the root zarr.json (e.g. from a "
            "backup), or use a new store location."
        )


def check_new_location(location: str, storage_options: dict | None = None) -> None:
    """Refuse, before a store is created at ``location`` later in the run, what creating it would refuse then: arrays
    without root metadata (:class:`StoreDamageError`) and a local folder this process cannot write."""
    _refuse_orphan_arrays(location, storage_options)
    check_writable(location)
