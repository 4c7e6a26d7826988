"""What every pipeline task shares: retry policy, tags, store access, cached data (no Prefect import).
The plan and the manifests the tasks return are in tasks.plan."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import threading
from typing import Any

import torch

from trak_core.errors import BadInputError, StateError, StoreDamageError, StoreMismatchError, TrakError
from trak_core.store import RunStore
from trak_core.store import open_store as open_location

from .config import AttributeConfig, EvaluateConfig, TrainConfig, load_data, load_object

#: tag of tasks that run model code on the device, given by the flows where a limit on it exists
#: (`prefect concurrency-limit create trakflow-gpu 1`; tasks.attribution.on_gpu)
GPU_TAG = "trakflow-gpu"
#: errors that a retry cannot fix (bad config/data, wrong order, mismatching or damaged store: a chunk that fails
#: its checksum fails again)
NOT_RETRIED: tuple[type[BaseException], ...] = (BadInputError, StateError, StoreMismatchError, StoreDamageError)


def store_identity(location: str) -> str:
    """A short, stable name of a store (its absolute path or URL hashed): names the Prefect objects that
    belong to one store — its queue (a global concurrency limit) and its artifacts' keys."""
    loc = str(location)
    if loc.startswith("file://"):
        loc = loc[len("file://") :]
    if "://" not in loc:
        loc = os.path.realpath(loc)
    return hashlib.sha256(loc.encode()).hexdigest()[:10]


#: OSError errnos that a retry a few seconds later cannot fix: a full disk or quota (the task would write
#: again into the same full filesystem), a read-only filesystem
NOT_RETRIED_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


def should_retry(exc: BaseException | None) -> bool:
    """Retry transient failures (I/O, OOM, a lost worker), never bad input nor a full disk (ENOSPC)."""
    if exc is None:
        return True
    if isinstance(exc, OSError) and exc.errno in NOT_RETRIED_ERRNOS:
        return False
    try:
        from pydantic import ValidationError

        if isinstance(exc, ValidationError):
            return False
    except ImportError:  # pragma: no cover
        pass
    return not isinstance(exc, NOT_RETRIED)


_data_lock = threading.Lock()
_data_cache: dict[str, tuple] = {}


def cached_data(path: str, field: str) -> tuple:
    """The data tuple of an import path, loaded once per process and shared by the tasks' threads."""
    with _data_lock:
        if path not in _data_cache:
            if len(_data_cache) >= 4:
                _data_cache.pop(next(iter(_data_cache)))
            _data_cache[path] = load_data(path, field)
        return _data_cache[path]


def clear_data_cache() -> None:
    with _data_lock:
        _data_cache.clear()


def adopt_train_source(config: AttributeConfig) -> None:
    """Where the config's train data is a callable told its source at run time (its ``adopt_source``, e.g. the
    folder of ``trakflow_demo_data.folder_data:train_folder``) and the config's store was built from that callable,
    tell it the source the store recorded (``train_source``), unless this process was told another: every route
    that reads the store (a rerun, the report, ``trakflow show``, a query) sees the rows that grew it."""
    try:
        adopt = getattr(load_object(config.train_data, "train_data", config.import_roots), "adopt_source", None)
    except BadInputError:  # the check that loads the data says what is wrong
        return
    if not callable(adopt):
        return
    try:
        info = open_location(config.store, config.storage_options, mode="r").pipeline_info()
    except (TrakError, OSError, ValueError):  # no store yet, or one the plan refuses with its own message
        return
    source = info.get("train_source") or {}
    if source.get("train_data") == config.train_data and adopt(source):
        clear_data_cache()


def open_store(config: AttributeConfig, mode: str = "r+") -> RunStore:
    """The store of a pipeline task: each array's zarr.json is checked as the task opens it (the run's plan
    checked every array; re-reading all of them per task costs ~1 ms an array, hundreds in a store of many
    checkpoints and experiments)."""
    return open_location(config.store, config.storage_options, mode=mode, check_arrays="on_use")


def cores() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_per_task(config: AttributeConfig | TrainConfig | EvaluateConfig, tasks: int) -> int | None:
    """The torch and BLAS threads for one task of a stage of ``tasks`` tasks: this machine's cores divided by the
    tasks the runner executes at once (min(``config.task_slots``, ``tasks``)), so concurrent tasks do not
    oversubscribe the cores (two tasks of two OpenMP threads each on two cores spin at each other's barriers).
    None — the libraries' own defaults — on an existing Dask cluster, whose size the config does not say."""
    slots = config.task_slots
    if slots is None:
        return None
    return max(1, cores() // max(1, min(slots, tasks)))


class _BlasLimit:
    """OpenBLAS's process-wide limit while pipeline tasks run: how many are inside :func:`torch_threads`, and
    the limits the first one set (restored by the last one out)."""

    lock = threading.Lock()
    users = 0
    first: Any = None


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run the block with ``n`` torch threads in this thread and ``n`` threads in numpy's BLAS (OpenBLAS: the
    stored XᵀX partials' syrk), then restore both (None: leave them as they are).

    torch's count is this thread's (torch also makes it the default of threads started meanwhile); OpenBLAS's
    is process-wide, so concurrent tasks share it: the first task in sets it, the last one out restores what it
    was (tasks of one stage ask for the same count)."""
    if n is None:
        yield
        return
    from threadpoolctl import threadpool_limits

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    with _BlasLimit.lock:
        limits = threadpool_limits(limits=n, user_api="blas")
        if _BlasLimit.users == 0:
            _BlasLimit.first = limits
        _BlasLimit.users += 1
    try:
        yield
    finally:
        with _BlasLimit.lock:
            _BlasLimit.users -= 1
            if _BlasLimit.users == 0 and _BlasLimit.first is not None:
                _BlasLimit.first.restore_original_limits()
                _BlasLimit.first = None
        torch.set_num_threads(before)
