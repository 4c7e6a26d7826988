"""What the CLI does around a flow run (no Prefect import at module level).

- A failure prints one line naming its cause: :func:`~trakflow_cli.errors.error_line` unwraps Prefect's
  wrappers and exception chains to the error the code raised. Prefect's own ERROR records (the failed task
  and flow runs, with their tracebacks) stay off the console unless ``-v``; they still reach the API (the
  UI shows them).
- SIGINT and SIGTERM stop the run and every process it started (Prefect's ephemeral server, process-pool
  workers, a local Dask cluster), then exit with 128 + the signal's number. The flow unwinds first (its
  runs are marked crashed; Prefect waits for the running task to return); a second signal, or a run that
  has not unwound within :data:`GRACE_SECONDS`, exits at once after killing them.
- Prefect's ephemeral server is started by the CLI (in the main thread, before the flow) so that it dies
  with the CLI even after SIGKILL (Linux: ``PR_SET_PDEATHSIG``), and its pid is recorded under
  PREFECT_HOME: the next run stops a server whose CLI is gone (where the death signal is not available).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from trakflow_cli.errors import error_line, root_cause  # noqa: F401  (the CLI's one-line errors)

#: seconds a signalled run may take to unwind (mark its flow run crashed, stop its task runner) before the
#: CLI kills what it started and exits anyway
GRACE_SECONDS = 10.0
#: marks the ephemeral server's command line (and the pid files that record it)
SERVER_MARK = "prefect.server.api.server:create_app"
PIDFILE_GLOB = "trakflow-ephemeral-server-*.json"
#: the ephemeral server's own output (uvicorn and the database's errors, e.g. a query cut short when the server
#: is stopped), appended under PREFECT_HOME rather than printed between the CLI's lines
SERVER_LOG = "trakflow-ephemeral-server.log"
#: seconds the ephemeral server may take to answer its first request: Prefect's default (20 s) is exceeded on a
#: busy 2-core machine; PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, when set, is used instead
EPHEMERAL_STARTUP_SECONDS = 120


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the CLI (raised in the main thread by its signal handler)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


# ------------------------------------------------------------------------------------------ error line
class _DropPrefectErrors(logging.Filter):
    """Drops Prefect's ERROR records (failed/crashed task and flow runs, their tracebacks) from the
    console: the CLI prints the failure's cause as one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.name.startswith("prefect"))


@contextlib.contextmanager
def quiet_prefect_errors(enabled: bool) -> Iterator[None]:
    handlers = list(logging.getLogger().handlers) if enabled else []
    flt = _DropPrefectErrors()
    for h in handlers:
        h.addFilter(flt)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(flt)


# ------------------------------------------------------------------------------------------ processes
def child_pids() -> set[int]:
    import psutil

    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:  # pragma: no cover
        return set()


def stop_children(keep: set[int], grace: float = 3.0) -> list[int]:
    """SIGTERM this process's descendants not in ``keep`` (the ones started since), SIGKILL those left after
    ``grace`` seconds; returns their pids. Prefect's log worker, which would report (on stderr, between the
    CLI's lines) each batch it can no longer send to the stopped server, is silenced first: the run is over."""
    import psutil

    logging.raiseExceptions = False  # Prefect's APILogWorker writes its send errors only while this is set

    try:
        procs = [p for p in psutil.Process().children(recursive=True) if p.pid not in keep]
    except psutil.Error:  # pragma: no cover
        return []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=grace)
    return [p.pid for p in procs]


class Signals:
    """SIGINT/SIGTERM handlers for the duration of a command (main thread only)."""

    def __init__(self, keep: set[int], on_force: Callable[[int], None]) -> None:
        self.keep, self.on_force = keep, on_force
        self.signum: int | None = None
        self.old: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s in (signal.SIGINT, signal.SIGTERM):
            self.old[s] = signal.signal(s, self._handle)

    def restore(self) -> None:
        for s, h in self.old.items():
            signal.signal(s, h)
        self.old.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:  # a second signal: no more waiting
            self.force(signum, grace=0.5)
        self.signum = signum
        threading.Thread(target=self._watchdog, args=(signum,), daemon=True, name="trakflow-interrupt").start()
        raise Interrupted(signum)

    def _watchdog(self, signum: int) -> None:
        time.sleep(GRACE_SECONDS)
        self.force(signum, grace=1.0)

    def force(self, signum: int, grace: float) -> None:
        self.on_force(signum)
        stop_children(self.keep, grace=grace)
        exit_now(128 + signum)


def exit_now(code: int) -> None:
    """Exit without Python's exit hooks: after a signal, Prefect's would wait for the running tasks' threads
    and try to flush logs and events to the server that was just stopped."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


# ------------------------------------------------------------------------------------------ ephemeral server
def _pdeathsig_preexec() -> Callable[[], None] | None:
    """A preexec_fn asking the kernel to SIGTERM the child when the thread that started it dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _pidfiles(home: Path) -> list[Path]:
    return sorted(home.glob(PIDFILE_GLOB)) if home.is_dir() else []


def stop_stale_servers(home: Path) -> list[int]:
    """Stop ephemeral servers recorded under ``home`` whose CLI is gone (a SIGKILLed run on a platform
    without PR_SET_PDEATHSIG); drop their pid files. Returns the pids stopped."""
    import psutil

    stopped = []
    for f in _pidfiles(home):
        try:
            rec = json.loads(f.read_text())
            owner, pid, started = int(rec["cli_pid"]), int(rec["pid"]), float(rec["create_time"])
        except (OSError, ValueError, KeyError, TypeError):
            f.unlink(missing_ok=True)
            continue
        if owner != os.getpid() and psutil.pid_exists(owner):
            continue  # another live CLI's server
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if abs(p.create_time() - started) < 1.0 and SERVER_MARK in " ".join(p.cmdline()):
                p.terminate()
                try:
                    p.wait(5)
                except psutil.TimeoutExpired:
                    p.kill()
                stopped.append(pid)
        f.unlink(missing_ok=True)
    return stopped


def start_ephemeral_server() -> None:
    """Start Prefect's ephemeral server now, from the main thread, when no API URL is set (Prefect would
    start the same one on the flow's first API call): its process gets the parent-death signal, its output goes
    to :data:`SERVER_LOG` under PREFECT_HOME, and its pid is recorded (removed again at exit) after stopping
    servers left by CLIs that are gone."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME

    if PREFECT_API_URL.value():
        return
    server = SubprocessASGIServer()
    if server.running:
        return
    home = Path(PREFECT_HOME.value()).expanduser()
    stop_stale_servers(home)
    preexec = _pdeathsig_preexec() if threading.current_thread() is threading.main_thread() else None
    home.mkdir(parents=True, exist_ok=True)
    log = open(home / SERVER_LOG, "ab")  # noqa: SIM115  (closed once the server answers)
    original = server._run_uvicorn_command

    def run_uvicorn():  # Prefect's own command: its output to the log, the death signal set in the child
        popen = subprocess.Popen

        def popen_logged(*args, **kwargs):
            kwargs.setdefault("stdout", log)
            kwargs.setdefault("stderr", subprocess.STDOUT)
            if preexec is not None:
                kwargs.setdefault("preexec_fn", preexec)
            return popen(*args, **kwargs)

        subprocess.Popen = popen_logged  # type: ignore[misc]
        try:
            return original()
        finally:
            subprocess.Popen = popen  # type: ignore[misc]

    server._run_uvicorn_command = run_uvicorn  # type: ignore[method-assign]
    chosen = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" in os.environ
    try:
        server.start(timeout=None if chosen else EPHEMERAL_STARTUP_SECONDS)
    except RuntimeError as e:
        raise RuntimeError(f"{e} The server's output is in {home / SERVER_LOG}") from e
    finally:
        log.close()  # the server process holds its own copy
    proc = server.server_process
    if proc is None:  # pragma: no cover
        return
    import atexit

    import psutil

    with contextlib.suppress(OSError, psutil.Error):
        f = home / PIDFILE_GLOB.replace("*", str(os.getpid()))
        started = psutil.Process(proc.pid).create_time()
        record = {"cli_pid": os.getpid(), "pid": proc.pid, "create_time": started, "port": server.port}
        f.write_text(json.dumps(record))
        atexit.register(f.unlink, missing_ok=True)


# ------------------------------------------------------------------------------------------ long-lived children
#: seconds a supervised serve loop or worker has, after SIGINT/SIGTERM, before the processes it started get
#: SIGTERM too (whatever is left is killed at :func:`supervise`'s ``grace``, 6 s: the CLI exits within 10 s)
HANDOVER_SECONDS = 3.0


def supervise(cmd: list[str], grace: float = GRACE_SECONDS - 4) -> int:
    """Run ``cmd`` (a long-lived serve loop or worker) as a child process until it exits or a signal comes.

    SIGINT/SIGTERM are passed on to the child (Prefect's serve loop and worker then stop their runs); what
    is left of it and of every process it started (flow runs, in their own sessions too) gets SIGTERM after
    :data:`HANDOVER_SECONDS` and SIGKILL after ``grace`` seconds. The child also dies with this process
    (Linux: ``PR_SET_PDEATHSIG``). Returns the child's exit code, or 128 + the signal's number.

    Args:
        cmd: the command line.
        grace: seconds from the signal until everything left is killed.
    Returns:
        The exit code for the CLI.
    """
    import psutil

    got: list[int] = []
    proc = subprocess.Popen(cmd, preexec_fn=_pdeathsig_preexec())
    old = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not got:
            try:
                return proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
        signum = got[0]
        family = _family(proc.pid)
        with contextlib.suppress(OSError):
            proc.send_signal(signum)
        _, alive = psutil.wait_procs(family, timeout=min(HANDOVER_SECONDS, grace))
        alive = list({p.pid: p for p in alive + _family(proc.pid)}.values())  # started meanwhile, too
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(alive, timeout=max(grace - HANDOVER_SECONDS, 0.5))
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=1.0)
        proc.poll()
        return 128 + signum
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _family(pid: int) -> list:
    """The process ``pid`` and its descendants now (those that still run)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []
