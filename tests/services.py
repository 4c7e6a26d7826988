"""Real services for the tests that must not be mocked: a `prefect server start` process (SQLite, its own
PREFECT_HOME, a free port on 127.0.0.1) and a Dask cluster of separate `dask scheduler` / `dask worker`
processes. Every process is started in its own process group, bounded in time, and killed on exit."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def pythonpath_for_tests() -> list[str]:
    """tests/ and each of its subfolders: a config that names a function of a test module (``test_x:fn``)
    imports it in the processes the tests start."""
    tests = REPO / "tests"
    return [str(tests), *sorted(str(d) for d in tests.rglob("*") if d.is_dir() and d.name != "__pycache__")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str, poll: float = 0.5, proc: subprocess.Popen | None = None):
    """Poll ``predicate`` until it returns a truthy value; fail naming ``what`` (and a dead process's log)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {proc.returncode} before it was ready")
        time.sleep(poll)
    raise TimeoutError(f"{what}: not ready within {timeout:g} s")


def start(cmd: list[str], log: Path, env: dict, cwd: Path = REPO) -> subprocess.Popen:
    """A background process in its own session (so its children die with it), output to ``log``."""
    fh = open(log, "wb")  # noqa: SIM115 - closed by stop()
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
    proc._log = fh  # type: ignore[attr-defined]
    return proc


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL what is left after ``grace`` seconds; then SIGKILL what is left
    of the processes it had started in sessions of their own (a worker's flow runs)."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(grace)
    else:  # the leader is gone; its group may not be
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    for p in descendants:
        with contextlib.suppress(psutil.Error):
            p.kill()
    getattr(proc, "_log", None) and proc._log.close()  # type: ignore[attr-defined]


def _healthy(url: str, auth_string: str | None = None) -> bool:
    req = urllib.request.Request(url)
    if auth_string:
        import base64

        req.add_header("Authorization", "Basic " + base64.b64encode(auth_string.encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@dataclass
class PrefectServer:
    """A running `prefect server start`; ``env`` points a client (or a subprocess) at it."""

    home: Path
    port: int
    proc: subprocess.Popen
    log: Path
    env: dict = field(default_factory=dict)
    children: list[subprocess.Popen] = field(default_factory=list)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def spawn(self, cmd: list[str], name: str, cwd: Path = REPO, **extra_env: str) -> subprocess.Popen:
        """A process that talks to this server (stopped with the server)."""
        p = start(cmd, self.home / f"{name}.log", {**self.env, **extra_env}, cwd)
        self.children.append(p)
        return p

    def read_log(self, name: str = "server") -> str:
        path = self.log if name == "server" else self.home / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def prefect_env(home: Path, api_url: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_LOGGING_LEVEL="INFO",
        PYTHONPATH=os.pathsep.join([str(REPO), *pythonpath_for_tests(), env.get("PYTHONPATH", "")]),
    )
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


@contextlib.contextmanager
def prefect_server(
    home: Path, scheduler_loop_seconds: float = 2.0, timeout: float = 300.0, auth_string: str | None = None
) -> Iterator[PrefectServer]:
    """`prefect server start` on a free port with its own SQLite database under ``home``; the scheduler
    service polls every ``scheduler_loop_seconds`` so a schedule fires within seconds. With ``auth_string``
    ("user:password") the server requires it (PREFECT_SERVER_API_AUTH_STRING) and ``server.env`` carries it
    for clients (PREFECT_API_AUTH_STRING); drop that variable to act as a client without it."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = prefect_env(home)
    env.update(
        PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS=str(scheduler_loop_seconds),
        PREFECT_SERVER_API_HOST="127.0.0.1",
        PREFECT_UI_API_URL=f"http://127.0.0.1:{port}/api",  # the UI's pages call this port, not 4200
    )
    if auth_string:
        env["PREFECT_SERVER_API_AUTH_STRING"] = auth_string
    log = home / "server.log"
    proc = start([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)], log, env)
    server = PrefectServer(home, port, proc, log, prefect_env(home, f"http://127.0.0.1:{port}/api"))
    if auth_string:
        server.env["PREFECT_API_AUTH_STRING"] = auth_string
    try:
        wait_for(lambda: _healthy(f"{server.api_url}/health", auth_string), timeout, "prefect server", proc=proc)
        yield server
    finally:
        for p in reversed(server.children):
            stop(p)
        stop(proc, grace=20)


def make_slow_tiny_model():
    """examples.tiny's model (same parameter names, same outputs) whose forward pass takes 0.3 s longer: a
    featurize task then lasts long enough for a test to act while it runs."""
    import torch

    from examples import tiny

    class Slow(torch.nn.Sequential):
        def forward(self, x):
            time.sleep(0.3)
            return super().forward(x)

    return Slow(*tiny.make_model())


@dataclass
class DaskCluster:
    address: str
    scheduler: subprocess.Popen
    workers: list[subprocess.Popen]


@contextlib.contextmanager
def dask_cluster(home: Path, env: dict, n_workers: int = 2, timeout: float = 300.0) -> Iterator[DaskCluster]:
    """`dask scheduler` and ``n_workers`` `dask worker` processes (one thread each, no nanny, so killing a
    worker's process kills the worker) on 127.0.0.1."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    dash = free_port()
    sched = start(
        [
            str(BIN / "dask"),
            "scheduler",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dashboard-address",
            f"127.0.0.1:{dash}",
        ],
        home / "scheduler.log",
        env,
    )
    workers: list[subprocess.Popen] = []
    try:
        from distributed import Client

        def up(count: int) -> bool:
            try:
                with Client(address, timeout=3) as c:
                    return len(c.scheduler_info(n_workers=-1)["workers"]) >= count
            except OSError:
                return False

        wait_for(lambda: up(0), timeout, "dask scheduler", poll=1.0, proc=sched)
        for i in range(n_workers):
            workers.append(
                start(
                    [
                        str(BIN / "dask"),
                        "worker",
                        address,
                        "--nthreads",
                        "1",
                        "--no-nanny",
                        "--name",
                        f"w{i}",
                        "--host",
                        "127.0.0.1",
                        "--dashboard-address",
                        ":0",
                        "--local-directory",
                        str(home / f"w{i}"),
                    ],
                    home / f"worker{i}.log",
                    env,
                )
            )
        wait_for(lambda: up(n_workers), timeout, f"{n_workers} dask workers", poll=1.0)
        yield DaskCluster(address, sched, workers)
    finally:
        for p in workers:
            stop(p)
        stop(sched)
