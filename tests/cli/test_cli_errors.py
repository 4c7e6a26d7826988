"""Errors reach the user as one line: a task's failure is one ``error:`` line naming its root
cause (Prefect's tracebacks only with -v); a full disk (ENOSPC) names the path and is not retried; SIGINT and
SIGTERM leave no process behind (the ephemeral Prefect server included), and neither does SIGKILL."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from services import pythonpath_for_tests
from trak_fixtures import REPO_ROOT, TESTS_ROOT, tiny_attribute_config
from typer.testing import CliRunner

from examples import tiny
from tasks.common import should_retry
from trak_core.errors import BadInputError, StoreDamageError
from trakflow_cli import lifecycle
from trakflow_cli.main import app

REPO = REPO_ROOT
TESTS = TESTS_ROOT
ENV = {"COLUMNS": "200", "NO_COLOR": "1"}


def bad_label_train_data():
    """tiny's train data with label 7 (3 classes) in row 20: passes the plan, fails inside featurize-shard."""
    x, y = tiny.train_data()
    y = y.clone()
    y[20] = 7
    return x, y


def write_config(tmp: Path, **over) -> Path:
    paths = tiny.save_checkpoints(tmp / "ck", seeds=(0, 1))
    cfg = tiny_attribute_config(tmp / "store.zarr", paths, **{"exp_name": "default", **over})
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("error:")]


def cli_env(home: Path, api_url: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        ENV,
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), *pythonpath_for_tests(), os.environ.get("PYTHONPATH")])),
    )
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def harness_api_url() -> str:
    from prefect.settings import get_current_settings

    return str(get_current_settings().api.url)


# ---------------------------------------------------------------------------------------------- the line
def test_error_line_unwraps_to_the_root_cause():
    from prefect.exceptions import FailedRun

    bad = BadInputError("train_data rows 16..23 (model_id=0): label 7 out of range")
    try:
        try:
            raise bad
        except BadInputError as e:
            raise FailedRun("Flow run encountered an exception") from e
    except FailedRun as e:
        wrapped = e
    assert lifecycle.root_cause(wrapped) is bad
    assert lifecycle.error_line(wrapped) == "BadInputError: train_data rows 16..23 (model_id=0): label 7 out of range"
    assert lifecycle.error_line(ExceptionGroup("tasks failed", [bad])).startswith("BadInputError: train_data rows")
    # an explicit cause is the root; the error it was raised as stays on the line
    try:
        try:
            raise ConnectionResetError(104, "Connection reset by peer")
        except OSError as e:
            raise RuntimeError("uploading chunk c/0/0 failed\nafter 3 attempts") from e
    except RuntimeError as e:
        line = lifecycle.error_line(e)
    assert line == (
        "ConnectionResetError: [Errno 104] Connection reset by peer (raised as RuntimeError: uploading "
        "chunk c/0/0 failed after 3 attempts)"
    )
    # trakflow's own errors name their cause: not unwrapped further
    try:
        try:
            raise ValueError("cannot reshape array of size 3")
        except ValueError as e:
            raise StoreDamageError("store s.zarr: array models/0/features, chunk c/0/0 fails its checksum") from e
    except StoreDamageError as e:
        assert lifecycle.error_line(e).startswith("StoreDamageError: store s.zarr: array models/0/features")
    full = OSError(errno.ENOSPC, "No space left on device", "/data/s.zarr/models/0/grads/c/1/0")
    line = lifecycle.error_line(full)
    assert line.startswith("OSError: [Errno 28] No space left on device: '/data/s.zarr/models/0/grads/c/1/0'")
    assert "disk is full writing /data/s.zarr/models/0/grads/c/1/0" in line and "\n" not in line


def test_full_disk_is_not_retried():
    assert not should_retry(OSError(errno.ENOSPC, "No space left on device", "/x"))
    assert not should_retry(OSError(errno.EDQUOT, "Disk quota exceeded", "/x"))
    assert should_retry(OSError(errno.EIO, "Input/output error", "/x"))
    assert should_retry(TimeoutError("read timed out"))
    assert not should_retry(BadInputError("x"))


@pytest.mark.usefixtures("prefect_harness")
def test_enospc_in_a_task_names_the_path_once_not_retried(tmp_path, monkeypatch):
    """A store write inside featurize-shard fails with ENOSPC: each task runs once (no retry), the CLI prints
    one error line naming the path and exits 1."""
    from trak_core.store import TrakStore

    calls: list[tuple[int, int]] = []

    def full_disk(self, model_id, rows, grads, out_to_loss, *rest, **kw):
        calls.append((model_id, rows.start))
        raise OSError(errno.ENOSPC, "No space left on device", f"{tmp_path}/store.zarr/models/{model_id}/grads/c/0/0")

    monkeypatch.setattr(TrakStore, "write_train_rows", full_disk)
    # earlier CliRunner invocations of the session closed the stream Prefect's console handler still holds:
    # logging's "--- Logging error ---" report of that would read as a traceback in this output
    monkeypatch.setattr(logging, "raiseExceptions", False)
    path = write_config(tmp_path)
    res = CliRunner().invoke(app, ["run", str(path)], env=ENV)
    assert res.exit_code == 1, res.output
    lines = error_lines(res.output)
    assert len(lines) == 1, res.output
    assert "OSError: [Errno 28] No space left on device" in lines[0]
    assert f"disk is full writing {tmp_path}/store.zarr/models/" in lines[0] and "not retried" in lines[0]
    assert calls and len(calls) == len(set(calls)), f"a shard was attempted more than once: {calls}"
    assert "Traceback" not in res.output and "rerun with -v" in res.output


@pytest.mark.usefixtures("prefect_harness")
def test_task_failure_is_one_line_traceback_only_with_verbose(tmp_path):
    """A BadInputError inside a task: one `error:` line, nothing of Prefect's (a real process: Prefect logs to
    the process's stderr); with -v the traceback and Prefect's error logs are there."""
    # the run with and the one without -v at once, each on its own store
    paths = [write_config(tmp_path / d, train_data="test_cli_errors:bad_label_train_data") for d in ("q", "v")]
    cmds = [[sys.executable, "-m", "trakflow_cli.main", "run", str(p)] for p in paths]
    procs = [
        subprocess.Popen(
            cmd,
            cwd=REPO,
            env=cli_env(p.parent / "home", harness_api_url()),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for cmd, p in zip((cmds[0], cmds[1] + ["-v"]), paths, strict=True)
    ]
    try:
        (quiet, quiet_err), (verbose, verbose_err) = (p.communicate(timeout=300) for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = quiet + quiet_err
    assert procs[0].returncode == 1, out
    lines = error_lines(out)
    assert len(lines) == 1, out
    assert lines[0].startswith("error: BadInputError: train_data rows 16..23 (model_id="), out
    assert lines[0].endswith("labels out of range [0, 3) at batch positions [4] (values [7])"), out
    assert "Traceback" not in out and "Finished in state Failed" not in out and "| ERROR" not in out, out
    assert "rerun with -v" in out
    out = verbose + verbose_err
    assert procs[1].returncode == 1 and len(error_lines(out)) == 1, out
    assert "Traceback" in out and "tasks/core.py" in out, out


# ---------------------------------------------------------------------------------------------- processes
def _process_group(pgid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.Error, OSError):
            pass
    return out


def _cmdline(p: psutil.Process) -> str:
    """A child's command line, or "" once it has exited (short-lived children come and go while we look)."""
    try:
        return " ".join(p.cmdline())
    except (psutil.Error, OSError):
        return ""


def _alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {_cmdline(p)[:120]}")
        except (psutil.Error, OSError):
            pass
    return out


def _featurizing(store: Path) -> bool:
    """A featurize shard has written its rows (the slowed model leaves the rest of the stage to run)."""
    grads = store / "models" / "0" / "grads" / "c"
    return grads.is_dir() and any(grads.rglob("*"))


@pytest.fixture(scope="module")
def signal_home(tmp_path_factory):
    """One PREFECT_HOME for the signal tests: the ephemeral server's database is created (all its migrations) by
    the first run only; each later run also finds the pid file of the run signalled before it (gone) and drops it."""
    return tmp_path_factory.mktemp("signal-home")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_signal_leaves_no_process_behind(tmp_path, signal_home, sig):
    """`trakflow run` with Prefect's ephemeral server (no PREFECT_API_URL) and a slowed model, signalled once
    featurization has started: SIGINT/SIGTERM end it within seconds with one `error: interrupted` line; after
    any of them (SIGKILL included) none of the processes it started, nor of its process group, is left.
    The dense projector: no split probe in the plan (32 more slowed forward passes before featurization)."""
    home = signal_home
    path = write_config(tmp_path, model="services:make_slow_tiny_model", projector="dense", batch_size=2, max_workers=1)
    log = tmp_path / "cli.log"
    with open(log, "wb") as fh:  # a file, not a pipe: a surviving child would hold a pipe open
        proc = subprocess.Popen(
            [sys.executable, "-m", "trakflow_cli.main", "run", str(path)],
            cwd=REPO,
            env=cli_env(home),
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    seen: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + 480
        while not _featurizing(tmp_path / "store.zarr"):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "featurization did not start: " + log.read_text()
            for c in psutil.Process(proc.pid).children(recursive=True):
                seen.setdefault(c.pid, c)
            time.sleep(0.1)
        for c in psutil.Process(proc.pid).children(recursive=True):
            seen.setdefault(c.pid, c)
        server = [p for p in seen.values() if lifecycle.SERVER_MARK in _cmdline(p)]
        assert server, f"the ephemeral server was not among the CLI's children: {_alive(list(seen.values()))}"
        recorded = list(home.glob(lifecycle.PIDFILE_GLOB))
        assert [json.loads(f.read_text())["pid"] for f in recorded] == [server[0].pid]
        if Path(f"/proc/{server[0].pid}/fd/2").exists():  # its errors (after the signal) go to its log
            assert os.readlink(f"/proc/{server[0].pid}/fd/2") == str(home / lifecycle.SERVER_LOG)
        t0 = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(timeout=30)
        took = time.monotonic() - t0
        out = log.read_text()
        if sig == signal.SIGKILL:
            assert rc == -signal.SIGKILL
        else:
            assert rc == 128 + sig, out
            assert took < lifecycle.GRACE_SECONDS + 5, f"exit took {took:.1f} s"
            lines = error_lines(out)
            assert len(lines) == 1 and lines[0].startswith(f"error: interrupted by {sig.name}"), out
            assert "Traceback" not in out, out
        deadline = time.monotonic() + 5
        while (_alive(list(seen.values())) or _process_group(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(list(seen.values())), f"children left after {sig.name}: {_alive(list(seen.values()))}"
        assert not _process_group(proc.pid), f"process group left after {sig.name}"
        print(
            f"{sig.name}: children while running {len(seen)} ({[p.pid for p in seen.values()]}), left 0; "
            f"exit {rc} in {took:.1f} s"
        )
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in seen.values():
            try:
                p.kill()
            except psutil.Error:
                pass


def test_next_run_stops_a_server_left_by_a_killed_cli(tmp_path):
    """Where the parent-death signal is unavailable, the pid file under PREFECT_HOME lets the next run stop
    the server of a CLI that is gone; a live CLI's server is left alone."""
    code = "import time; time.sleep(120)"
    orphan = subprocess.Popen([sys.executable, "-c", code, lifecycle.SERVER_MARK])
    other = subprocess.Popen([sys.executable, "-c", code, lifecycle.SERVER_MARK])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        for name, owner, p in (("a", gone.pid, orphan), ("b", os.getppid(), other)):
            rec = {"cli_pid": owner, "pid": p.pid, "create_time": psutil.Process(p.pid).create_time(), "port": 1}
            (tmp_path / lifecycle.PIDFILE_GLOB.replace("*", name)).write_text(json.dumps(rec))
        (tmp_path / lifecycle.PIDFILE_GLOB.replace("*", "torn")).write_text("{")
        assert lifecycle.stop_stale_servers(tmp_path) == [orphan.pid]
        assert orphan.wait(10) is not None and other.poll() is None
        assert sorted(f.name for f in tmp_path.iterdir()) == [lifecycle.PIDFILE_GLOB.replace("*", "b")]
    finally:
        for p in (orphan, other):
            p.kill()
            p.wait()


STUBBORN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if sys.argv[1] == "parent":
    child = subprocess.Popen([sys.executable, sys.argv[0], "child"], start_new_session=True)
    open(sys.argv[2], "w").write(f"{os.getpid()} {child.pid}")
time.sleep(300)
"""


def test_supervised_command_and_its_runs_stop_within_10_s(tmp_path):
    """lifecycle.supervise (trakflow serve / worker): a child that ignores SIGTERM and has started a process in
    a session of its own (as Prefect starts flow runs) — SIGTERM to the CLI ends all three within 10 s."""
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    pids = tmp_path / "pids"
    code = (
        "import sys\nfrom trakflow_cli.lifecycle import supervise\n"
        f"sys.exit(supervise([sys.executable, {str(script)!r}, 'parent', {str(pids)!r}]))\n"
    )
    cli = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=cli_env(tmp_path / "home"))
    procs: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300
        while not (pids.exists() and pids.read_text()):
            assert cli.poll() is None and time.monotonic() < deadline, "the supervised child did not start"
            time.sleep(0.1)
        procs = [psutil.Process(int(p)) for p in pids.read_text().split()]
        t0 = time.monotonic()
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(10) == 128 + signal.SIGTERM
        print(f"supervised command exited {time.monotonic() - t0:.1f} s after SIGTERM")
        _, alive = psutil.wait_procs(procs, timeout=max(0.1, 10 - (time.monotonic() - t0)))
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], "processes left after SIGTERM"
    finally:
        if cli.poll() is None:
            cli.kill()
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass


@pytest.mark.parametrize("env_timeout", [None, "7"])
def test_ephemeral_server_gets_a_startup_timeout_a_busy_machine_meets(tmp_path, monkeypatch, env_timeout):
    """The CLI waits up to EPHEMERAL_STARTUP_SECONDS for Prefect's ephemeral server (Prefect's own 20 s are
    exceeded on a loaded 2-core machine), unless PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS is set, in
    which case Prefect's setting decides."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, temporary_settings

    seen = []

    def fake_start(self, timeout=None):
        seen.append(timeout)
        self.server_process = None

    monkeypatch.setattr(SubprocessASGIServer, "start", fake_start)
    monkeypatch.setattr(SubprocessASGIServer, "_instances", {})  # not the session's test server (a singleton)
    if env_timeout is None:
        monkeypatch.delenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", raising=False)
    else:
        monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", env_timeout)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        lifecycle.start_ephemeral_server()
    assert lifecycle.EPHEMERAL_STARTUP_SECONDS > 20
    assert seen == [lifecycle.EPHEMERAL_STARTUP_SECONDS if env_timeout is None else None]


def test_ephemeral_server_output_goes_to_its_log_not_between_the_cli_lines(tmp_path, monkeypatch, capfd):
    """What the ephemeral server prints (uvicorn's and the database's errors, e.g. when it is stopped mid-query
    after a signal) is appended to SERVER_LOG under PREFECT_HOME, not to the CLI's console; a server that does
    not come up is reported with that log's path."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    def fake_uvicorn(self):  # Prefect's command, stood in by a child that writes to both streams
        code = "import sys; print('server out'); print('Traceback: server err', file=sys.stderr)"
        return subprocess.Popen([sys.executable, "-c", code])

    def fake_start(self, timeout=None):
        self._run_uvicorn_command().wait(timeout=60)
        self.server_process = None

    monkeypatch.setattr(SubprocessASGIServer, "_run_uvicorn_command", fake_uvicorn)
    monkeypatch.setattr(SubprocessASGIServer, "start", fake_start)
    monkeypatch.setattr(SubprocessASGIServer, "_instances", {})
    home = temporary_settings(updates={PREFECT_HOME: str(tmp_path)}, restore_defaults={PREFECT_API_URL})
    with home:
        lifecycle.start_ephemeral_server()
    out, err = capfd.readouterr()
    assert "server" not in out + err
    logged = (tmp_path / lifecycle.SERVER_LOG).read_text()
    assert "server out" in logged and "Traceback: server err" in logged
    assert subprocess.Popen.__name__ == "Popen"  # the stand-in is gone again

    def failed_start(self, timeout=None):
        raise RuntimeError("Timed out while attempting to connect to ephemeral Prefect API server.")

    monkeypatch.setattr(SubprocessASGIServer, "start", failed_start)
    home = temporary_settings(updates={PREFECT_HOME: str(tmp_path)}, restore_defaults={PREFECT_API_URL})
    with home, pytest.raises(RuntimeError) as e:
        lifecycle.start_ephemeral_server()
    assert str(tmp_path / lifecycle.SERVER_LOG) in str(e.value)


def test_stopping_the_run_silences_prefects_log_sends_to_the_stopped_server(monkeypatch, capfd):
    """After a signal the CLI stops the server; Prefect's log worker would then write `--- Error logging to API
    ---` and the connection error (with no newline) onto stderr, ahead of the CLI's one error line."""
    import asyncio

    from prefect.logging.handlers import APILogWorker

    class Gone:
        async def create_logs(self, items):
            raise ConnectionError("All connection attempts failed")

    worker = APILogWorker.__new__(APILogWorker)  # only _handle_batch is exercised: no thread, no client
    worker._client = Gone()
    monkeypatch.setattr(logging, "raiseExceptions", True)
    asyncio.run(worker._handle_batch([{"message": "m"}]))
    assert "Error logging to API" in capfd.readouterr().err  # what a user saw before
    lifecycle.stop_children(keep=lifecycle.child_pids())
    asyncio.run(worker._handle_batch([{"message": "m"}]))
    assert capfd.readouterr().err == ""
