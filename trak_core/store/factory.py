"""Opening a run's store by its location, without naming the backend: the engine, the index, TRAKer and the
pipeline call these and talk to the :class:`~trak_core.store.RunStore` they return. A location starting with
:data:`~trak_core.store.memory.MEMORY_PREFIX` is an in-memory store (:class:`~trak_core.store.memory.MemoryStore`),
any other one a Zarr store (:class:`~trak_core.store.TrakStore`)."""

from __future__ import annotations

from typing import Literal

from .memory import MEMORY_PREFIX, MemoryStore
from .protocol import RunStore
from .schema import StoreMetadata
from .zarr_store import TrakStore


def store_exists(location: str, storage_options: dict | None = None) -> bool:
    """Whether a trakflow store is at ``location``."""
    return _backend(location).exists(location, storage_options)


def open_store(
    location: str,
    storage_options: dict | None = None,
    mode: str = "r+",
    check_arrays: bool | Literal["on_use"] = True,
) -> RunStore:
    """Open the existing store at ``location`` (BadInputError when there is none); see :meth:`TrakStore.open`."""
    return _backend(location).open(location, storage_options, mode=mode, check_arrays=check_arrays)


def create_or_open_store(
    location: str, meta: StoreMetadata, storage_options: dict | None = None, allow_existing: bool = True
) -> RunStore:
    """Open the store at ``location`` checking it matches ``meta``, or create it."""
    return _backend(location).create_or_open(location, meta, storage_options, allow_existing=allow_existing)


def _backend(location: str) -> type[TrakStore] | type[MemoryStore]:
    return MemoryStore if str(location).startswith(MEMORY_PREFIX) else TrakStore
