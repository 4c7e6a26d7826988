"""Task runners selected by the config, and the run lock every flow holds on its store.

Every flow is declared with ``@flow(task_runner=ConfigTaskRunner())``: its tasks run on the runner its
``config`` parameter asks for (:func:`make_task_runner`), however the flow is started — called directly,
from the CLI, a deployment (``deployments/serve.py``, ``deployments/prefect.yaml``) or as a subflow.
``flow.with_options(task_runner=...)`` still overrides it (the attribute flow hands its stages one shared
Dask cluster, :func:`stage_runners`).

``task_runner`` in the config picks where the tasks of a flow run:

* ``thread`` (default): Prefect's ``ThreadPoolTaskRunner(max_workers)`` in the flow's process.
* ``process``: Prefect's ``ProcessPoolTaskRunner``. With ``gpus: ["0", "1", ...]`` it starts one worker
  process per entry and each worker sees only its GPU (``CUDA_VISIBLE_DEVICES`` is set in the worker
  before it imports torch, and the parent's value is not forwarded to the tasks); without ``gpus``,
  ``max_workers`` processes.
* ``dask``: prefect-dask's ``DaskTaskRunner``: the scheduler at ``dask_address`` (an existing cluster,
  e.g. many nodes), or a ``distributed.LocalCluster`` of ``dask_n_workers`` worker processes
  (``dask_threads_per_worker`` threads each; with ``gpus``, one worker per GPU pinned with
  ``CUDA_VISIBLE_DEVICES``). The ``attribute`` flow starts that local cluster once and its three
  stages share it.

Workers of one run write disjoint, chunk-aligned parts of the store and take no lock. The parent flow
holds the store's run lock (:func:`run_lock`) for the whole run. Against a Prefect server a second run on
the same store first waits its turn in the store's queue (:func:`store_queue`, a global concurrency limit
of one slot named after the store); the lock stays as the last line of defence and refuses a second run
with :class:`~trak_core.errors.StoreLockedError` where no queue exists (Prefect's per-process ephemeral
server).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prefect.futures import wait
from prefect.task_runners import ProcessPoolTaskRunner, TaskRunner, ThreadPoolTaskRunner

from trak_core.store import StoreLock
from trak_core.store.lock import acquire_run_lock, reenter_run_lock, release_run_lock

GPU_ENV = "CUDA_VISIBLE_DEVICES"
#: set in each pinned worker to the GPU it was given (what ``CUDA_VISIBLE_DEVICES`` was set to)
WORKER_GPU_ENV = "TRAKFLOW_WORKER_GPU"


# ---------------------------------------------------------------------------------------------- process pool
def _pin_gpu(devices: Any) -> None:
    """Process-pool initializer: take one GPU from the queue and make it the only one this worker sees."""
    import queue

    try:
        gpu = devices.get(timeout=120)
    except queue.Empty:  # pragma: no cover - more workers than GPUs cannot happen (max_workers = len(gpus))
        raise RuntimeError("trakflow: no GPU left for this worker process") from None
    os.environ[GPU_ENV] = gpu
    os.environ[WORKER_GPU_ENV] = gpu


class GPUProcessPoolTaskRunner(ProcessPoolTaskRunner):
    """Prefect's process pool with one worker process per GPU, each seeing only its own GPU.

    ``GPUProcessPoolTaskRunner(gpus=["0", "1"])`` starts (on demand) two worker processes; the first
    gets ``CUDA_VISIBLE_DEVICES=0``, the second ``1``, so ``device="cuda"`` (``cuda:0`` in the worker)
    is a different GPU in each. Without ``gpus`` it is a plain ``ProcessPoolTaskRunner(max_workers)``.
    """

    def __init__(self, gpus: Sequence[str] | None = None, max_workers: int | None = None):
        self.gpus = [str(g) for g in gpus] if gpus else None
        super().__init__(max_workers=len(self.gpus) if self.gpus else max_workers)

    def duplicate(self) -> GPUProcessPoolTaskRunner:
        return type(self)(gpus=self.gpus, max_workers=None if self.gpus else self._max_workers)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, GPUProcessPoolTaskRunner)
            and other.gpus == self.gpus
            and other._max_workers == self._max_workers
        )

    def __enter__(self):
        if self.gpus:
            devices = multiprocessing.get_context("spawn").Queue()
            for g in self.gpus:
                devices.put(g)
            self._initializer, self._initargs = _pin_gpu, (devices,)
        return super().__enter__()

    def _resolve_futures_and_submit(self, *args, env: dict[str, str], **kwargs):
        # Prefect copies the parent's environment into the worker before each task; a parent
        # CUDA_VISIBLE_DEVICES would undo the worker's pinning.
        if self.gpus:
            env = {k: v for k, v in env.items() if k != GPU_ENV}
        return super()._resolve_futures_and_submit(*args, env=env, **kwargs)


# ---------------------------------------------------------------------------------------------- dask
def start_local_cluster(n_workers: int = 2, threads_per_worker: int = 1, gpus: Sequence[str] | None = None, **kwargs):
    """A ``distributed.LocalCluster`` of worker processes (a nanny each). With ``gpus``, one worker per
    entry, started with ``CUDA_VISIBLE_DEVICES`` set to it. Use it as a context manager."""
    from distributed import LocalCluster

    _quiet_distributed()
    kwargs.setdefault("dashboard_address", ":0")
    kwargs.setdefault("processes", True)
    if not gpus:
        return LocalCluster(n_workers=n_workers, threads_per_worker=threads_per_worker, **kwargs)
    cluster = LocalCluster(n_workers=0, threads_per_worker=threads_per_worker, **kwargs)
    try:
        base = cluster.new_spec
        for g in gpus:
            opts = dict(base["options"])
            opts["env"] = {**(opts.get("env") or {}), GPU_ENV: str(g), WORKER_GPU_ENV: str(g)}
            cluster.worker_spec[f"gpu-{g}"] = {"cls": base["cls"], "options": opts}
        cluster.scale(len(gpus))
        cluster.wait_for_workers(len(gpus), timeout=300)
    except BaseException:
        cluster.close()
        raise
    return cluster


def _dask_runner(config, address: str | None = None):
    from prefect_dask import DaskTaskRunner

    _quiet_distributed()
    address = address or getattr(config, "dask_address", None)
    if address:
        return DaskTaskRunner(address=address)
    gpus = getattr(config, "gpus", None)
    n = getattr(config, "dask_n_workers", 2)
    t = getattr(config, "dask_threads_per_worker", 1)
    if gpus:
        from functools import partial

        return DaskTaskRunner(
            cluster_class=partial(start_local_cluster, gpus=list(gpus)), cluster_kwargs={"threads_per_worker": t}
        )
    return DaskTaskRunner(
        cluster_class="distributed.LocalCluster",
        cluster_kwargs={"n_workers": n, "processes": True, "threads_per_worker": t, "dashboard_address": ":0"},
    )


# ---------------------------------------------------------------------------------------------- selection
class ConfigTaskRunner(TaskRunner):
    """The task runner the flow run's ``config`` parameter asks for (:func:`make_task_runner`).

    Prefect enters a flow's task runner before the flow run's parameters are in its context, so the
    runner is built (and entered) on the first submitted task, from the validated ``config`` of the flow
    run that submits it, and exited with this one. A flow that submits no task starts none (an attribute
    run on Dask starts no cluster of its own). Without a ``config`` parameter: Prefect's default thread pool.
    """

    def __init__(self, parameter: str = "config"):
        super().__init__()
        self.parameter = parameter
        self._runner: TaskRunner | None = None
        self._lock = threading.Lock()

    def duplicate(self) -> ConfigTaskRunner:
        return type(self)(self.parameter)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ConfigTaskRunner) and other.parameter == self.parameter

    def __getstate__(self) -> dict:  # the flow (and this runner with it) is pickled to process/Dask workers
        return {"parameter": self.parameter}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["parameter"])

    @property
    def runner(self) -> TaskRunner:
        """The configured runner (built and entered on first use)."""
        with self._lock:
            if self._runner is None:
                from prefect.context import FlowRunContext

                ctx = FlowRunContext.get()
                config = (ctx.parameters or {}).get(self.parameter) if ctx is not None else None
                runner = make_task_runner(config) if config is not None else ThreadPoolTaskRunner()
                runner.__enter__()
                self._runner = runner
            return self._runner

    def submit(self, task, parameters, wait_for=None, dependencies=None):
        return self.runner.submit(task, parameters, wait_for, dependencies)

    def __exit__(self, *exc_info) -> None:
        with self._lock:
            runner, self._runner = self._runner, None
        try:
            if runner is not None:
                runner.__exit__(*exc_info)
        finally:
            super().__exit__(*exc_info)


def make_task_runner(config) -> TaskRunner:
    """The task runner the config asks for (``task_runner``: thread | process | dask).

    Works for any config with a ``task_runner`` field (AttributeConfig, TrainConfig); the process/dask
    fields default when a config lacks them."""
    kind = getattr(config, "task_runner", "thread")
    max_workers = getattr(config, "max_workers", 2)
    if kind == "thread":
        return ThreadPoolTaskRunner(max_workers=max_workers)
    if kind == "process":
        return GPUProcessPoolTaskRunner(gpus=getattr(config, "gpus", None), max_workers=max_workers)
    if kind == "dask":
        return _dask_runner(config)
    raise ValueError(f"task_runner: unknown task runner {kind!r}")  # pragma: no cover (the config refuses it)


def check_dask_scheduler(address: str, timeout: float = 10.0) -> None:
    """Fail fast (before anything is written) when the scheduler at ``address`` cannot be reached."""
    from distributed import Client

    from trak_core.errors import BadInputError

    try:
        with Client(address, timeout=timeout, set_as_default=False) as client:
            n = len(client.scheduler_info().get("workers", {}))
    except OSError as e:  # distributed raises OSError (incl. TimeoutError) for an unreachable scheduler
        raise BadInputError(
            f"dask_address: cannot reach a Dask scheduler at {address!r} within {timeout:g} s ({type(e).__name__}: {e})"
        ) from None
    if n == 0:  # not an error: workers may join later (adaptive clusters); tasks wait for them
        import logging

        logging.getLogger("trakflow").warning("the Dask scheduler at %s has no workers yet", address)


@contextlib.contextmanager
def stage_runners(config) -> Iterator[Callable[[], TaskRunner]]:
    """Yield a factory of task runners for the stages (subflows) of one run.

    For ``dask`` without ``dask_address`` the local cluster is started on the first call, once, and
    every stage connects to it (instead of each stage starting and stopping its own cluster); it is
    closed when the block ends."""
    if getattr(config, "task_runner", "thread") != "dask":
        yield lambda: make_task_runner(config)
        return
    if getattr(config, "dask_address", None):  # checked by worker_api, entered before
        yield lambda: _dask_runner(config)
        return
    with contextlib.ExitStack() as stack:
        address: list[str] = []

        def runner() -> TaskRunner:
            if not address:
                cluster = stack.enter_context(
                    start_local_cluster(
                        getattr(config, "dask_n_workers", 2),
                        getattr(config, "dask_threads_per_worker", 1),
                        getattr(config, "gpus", None),
                    )
                )
                address.append(cluster.scheduler_address)
            return _dask_runner(config, address[0])

        yield runner


@contextlib.contextmanager
def worker_api(config) -> Iterator[None]:
    """Make task runs in other processes report to this flow's Prefect server.

    Without ``PREFECT_API_URL`` Prefect runs an ephemeral server in the flow's process; a process-pool
    or Dask worker would start one more server of its own per process (slow, and they all write the
    same SQLite file). For the ``process`` and ``dask`` runners this starts (or reuses) the flow's
    ephemeral server and hands its URL to the tasks' context. With a real server (``PREFECT_API_URL``
    set, e.g. for a multi-node cluster) it does nothing. An existing cluster (``dask_address``) needs a
    real server (its long-lived workers keep Prefect clients of the first server they saw), and its
    scheduler must answer: both are checked here, before the flow writes anything."""
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    settings = get_current_settings()
    if getattr(config, "dask_address", None) and not settings.api.url:
        from trak_core.errors import BadInputError

        raise BadInputError(
            "dask_address: the workers of an existing Dask cluster outlive this run and must report to a Prefect "
            "server they can reach, but PREFECT_API_URL is not set (this run would use a throw-away local "
            "server). Start one (`prefect server start --host 0.0.0.0`) and set "
            "PREFECT_API_URL=http://<that host>:4200/api here and on the workers."
        )
    if getattr(config, "dask_address", None):
        check_dask_scheduler(config.dask_address)  # before the plan writes anything
    if (
        getattr(config, "task_runner", "thread") == "thread"
        or settings.api.url
        or not settings.server.ephemeral.enabled
    ):
        yield
        return
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # the same instance the flow's own client started
    server.start()
    with temporary_settings({PREFECT_API_URL: server.api_url}):
        yield


def _quiet_distributed() -> None:
    """Dask's own loggers follow Prefect's logging level (the CLI hides INFO unless -v)."""
    import logging

    from prefect.settings import get_current_settings

    level = logging.getLevelName(str(get_current_settings().logging.level).upper())
    if isinstance(level, int) and level > logging.INFO:
        logging.getLogger("distributed").setLevel(level)


def _tasks_run_here() -> bool:
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    runner = getattr(ctx, "task_runner", None)
    if isinstance(runner, ConfigTaskRunner):
        runner = runner.runner
    return ctx is None or isinstance(runner, ThreadPoolTaskRunner)


def gather(futures, stage: str | None = None, amount: Callable[[dict], float] | None = None) -> list:
    """Wait for all futures, then return their results (raising the first failure).

    With ``stage`` and ``amount(manifest)``: when the tasks run in other processes (process or Dask
    runner), whose progress events stay there, advance this process's progress bars as they complete."""
    if stage is not None and amount is not None and not _tasks_run_here():
        from prefect.futures import as_completed

        from tasks import progress

        for f in as_completed(futures):
            try:
                m = f.result()
            except BaseException:
                continue  # raised below, in order
            progress.advance(stage, amount(m))
    wait(futures)
    return [f.result() for f in futures]


# ---------------------------------------------------------------------------------------------- run lock
def _current_run() -> tuple[str, str]:
    """(root flow run id, "flow/run-name") of the calling flow run (a thread id outside flows)."""
    try:
        from prefect.runtime import flow_run

        run_id, name, flow = flow_run.id, flow_run.name, flow_run.flow_name
        if run_id:
            root = flow_run.root_flow_run_id or run_id
            return str(root), f"{flow}/{name}" if flow else str(name)
    except Exception:  # pragma: no cover
        pass
    return f"thread-{threading.get_ident()}", f"pid-{os.getpid()}"


#: seconds a queue slot outlives a run that died without releasing it (the lease is renewed while it runs)
QUEUE_LEASE_SECONDS = 60


def queue_name(location: str) -> str:
    from tasks.common import store_identity

    return f"trakflow-store-{store_identity(location)}"


@contextlib.contextmanager
def store_queue(location: str) -> Iterator[None]:
    """Wait for the store's turn: one slot of a Prefect global concurrency limit named after the store
    (created on first use). Two runs on one store — a UI click during a scheduled run, two triggers —
    then run one after the other instead of the second failing. Only with a real server
    (``PREFECT_API_URL``): Prefect's ephemeral server belongs to one process, so there is nothing to queue
    behind and the store lock decides. Outside a flow run (a plain ``run_lock`` call) there is no queue."""
    from prefect.context import FlowRunContext
    from prefect.settings import get_current_settings

    if not get_current_settings().api.url or FlowRunContext.get() is None:  # no server, or not in a flow run
        yield
        return
    from prefect import get_run_logger
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency

    name = queue_name(location)
    with get_client(sync_client=True) as client:
        busy = _ensure_queue(client, name)
        if busy and _crashed_holder(location):
            # the slot's run died without releasing it (its lock file names a dead process of this host):
            # start the queue afresh rather than wait for the lease to expire
            client.delete_global_concurrency_limit_by_name(name)
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
            busy = 0
    if busy:
        get_run_logger().info("store %s is in use by another run: queued (global concurrency limit %r)", location, name)
    with concurrency(name, occupy=1, strict=True, lease_duration=QUEUE_LEASE_SECONDS):
        yield


def _ensure_queue(client, name: str) -> int:
    """The busy slots of the global concurrency limit ``name``, created (one slot) if it does not exist.

    Read first, create only when missing: a create that conflicts makes the server log a long
    ``IntegrityError`` traceback. Runs of this host that start together take a file lock around the
    read-then-create, so only one of them creates; a run of another host that loses the race is told
    the limit exists (the server then logs that one conflict) and goes on."""
    import fcntl
    import tempfile

    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    def read() -> int | None:
        try:
            return client.read_global_concurrency_limit_by_name(name).active_slots
        except ObjectNotFound:
            return None

    busy = read()
    if busy is not None:
        return busy
    with open(os.path.join(tempfile.gettempdir(), f"{name}.create.lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        busy = read()
        if busy is None:
            with contextlib.suppress(ObjectAlreadyExists):
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
            busy = read() or 0
    return busy


def _crashed_holder(location: str) -> bool:
    """The store's lock file names a process of this host that is gone (a crashed run)."""
    import socket

    try:
        holder = StoreLock(location).holder()
    except Exception:  # a torn lock file: the lock itself reports it
        return False
    return bool(holder) and holder.get("host") == socket.gethostname() and not StoreLock.holder_alive(holder)


@contextlib.contextmanager
def run_lock(config, run: str | None = None) -> Iterator[None]:
    """Hold ``config.store``'s run lock around a flow's work (plan included).

    A second live run on the store (another process, another machine, or another flow run in this
    process) gets :class:`~trak_core.errors.StoreLockedError` naming the holder; a lock left by a dead
    process of this host (a crash) is stale and taken over. Subflows of the holding run (``attribute`` →
    ``featurize``) re-enter it. For a new local store the folder is created to hold the lock file and
    removed again if the run fails before writing anything into it, so bad input leaves no trace. Against
    a real Prefect server the outermost holder first waits in the store's queue (:func:`store_queue`). The holds
    are counted in the process's one registry of run locks (:func:`trak_core.store.lock.acquire_run_lock`), which
    TRAKer's locks are in too: a TRAKer and a flow run of one process on one store are refused as two runs."""
    location = str(config.store)
    root, name = _current_run()
    name = run or name
    if reenter_run_lock(location, root):  # a subflow of the run that holds it
        try:
            yield
        finally:
            release_run_lock(location)
        return
    with store_queue(location):  # the queue's slot is kept while the run holds the lock
        # the lock needs only the location (the store itself may not exist yet: the plan creates it)
        acquire_run_lock(location, name, owner=root)
        try:
            yield
        finally:
            release_run_lock(location)
