"""Every way a run starts, against the real services (marked ``services``; they run in ``make test``):

* a schedule: a real ``prefect server start`` whose scheduler service creates the run of a served
  deployment, which completes with the expected scores;
* the work-pool route: ``prefect deploy`` + ``prefect worker start``, a run created through the API with
  the JSON parameters the UI's form sends;
* a real Dask cluster (``dask scheduler`` + two ``dask worker`` processes) through ``dask_address``, with
  and without one worker SIGKILLed in the middle of featurization.

Each compares the stored scores with a programmatic call of the attribute flow (thread runner) against the
same server. Tiny data (examples.tiny); each process start costs seconds on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from services import REPO, dask_cluster, stop, wait_for
from trak_fixtures import tiny_attribute_config

from examples import tiny
from trak_core.store import TrakStore

pytestmark = pytest.mark.services

TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def tiny_config(tmp: Path, ckpt_dir: Path, name: str, **over) -> dict:
    """An attribute config as the UI's form sends it: plain JSON values."""
    cfg = tiny_attribute_config(tmp / f"{name}.zarr", str(ckpt_dir / "model_*.pt"), **{"projector": "dense", **over})
    return json.loads(json.dumps(cfg))


def scores(cfg: dict) -> np.ndarray:
    return TrakStore.open(cfg["store"], mode="r").scores(cfg["exp_name"])[:]


def run_script(server, tmp: Path, cfg: dict, name: str) -> subprocess.CompletedProcess:
    """A programmatic call of the attribute flow in a fresh process that reports to ``server``."""
    cfg_file = tmp / f"{name}.json"
    cfg_file.write_text(json.dumps(cfg))
    code = (
        "import json, sys\nfrom flows import attribute\n"
        "out = attribute(config=json.load(open(sys.argv[1])))\nprint('RESULT', out['store'])\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(cfg_file)],
        env=server.env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
    )


def flow_runs(server, deployment_name: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.api_url}), get_client(sync_client=True) as client:
        return client.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment_name]))
        )


def wait_terminal(server, deployment_name: str, timeout: float, proc=None, run_id=None):
    """The first flow run of the deployment (or its run ``run_id``) once it is in a terminal state."""

    def done():
        runs = [
            r
            for r in flow_runs(server, deployment_name)
            if r.state_type and r.state_type.value in TERMINAL and run_id in (None, r.id)
        ]
        return runs[0] if runs else None

    return wait_for(done, timeout, f"a finished run of deployment {deployment_name!r}", poll=0.5, proc=proc)


def bad_label_train_data():
    """tiny's train data with label 7 (3 classes) in row 20: passes validation, fails inside a task."""
    x, y = tiny.train_data()
    y = y.clone()
    y[20] = 7
    return x, y


@pytest.fixture(scope="module")
def setup(tmp_path_factory, real_prefect_server):
    """The session's real Prefect server (tests/pipeline/conftest.py), tiny checkpoints and the reference scores
    from a programmatic run (thread runner) against that server."""
    tmp = tmp_path_factory.mktemp("services")
    ckpt_dir = tmp / "ck"
    tiny.save_checkpoints(ckpt_dir, seeds=(0, 1))
    server = real_prefect_server
    ref_cfg = tiny_config(tmp, ckpt_dir, "reference")
    res = run_script(server, tmp, ref_cfg, "reference")
    assert res.returncode == 0, res.stderr[-3000:]
    return server, tmp, ckpt_dir, scores(ref_cfg)


def test_second_run_on_a_store_logs_no_conflict(setup):
    """A second run on a store finds the store's queue (a global concurrency limit) and does not create it
    again: neither the server nor the run logs an IntegrityError."""
    server, tmp, ckpt_dir, ref = setup
    cfg = tiny_config(tmp, ckpt_dir, "reference")  # the store of the module's first run (the setup's)
    res = run_script(server, tmp, cfg, "twice")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "IntegrityError" not in res.stdout + res.stderr, res.stderr[-3000:]
    assert "IntegrityError" not in server.read_log(), server.read_log()[-3000:]
    np.testing.assert_array_equal(scores(cfg), ref)


def test_schedule_fires_and_completes(setup, served):
    """A served deployment with a schedule due in a few seconds (the ``served`` fixture's 'attribute/scheduled'):
    the server's scheduler creates the run (auto_scheduled), the serving process runs it, and the store holds the
    reference scores."""
    server, tmp, ckpt_dir, ref = setup
    cfg = tiny_config(tmp, ckpt_dir, "scheduled")  # the config the fixture gave the deployment
    run = wait_terminal(server, "scheduled", timeout=480, proc=served)
    assert run.auto_scheduled, "the run was not created by the scheduler"
    assert run.state_type.value == "COMPLETED", server.read_log("serve-attribute")[-3000:]
    np.testing.assert_array_equal(scores(cfg), ref)


@pytest.fixture(scope="module")
def pool(setup):
    """`prefect work-pool create` + `prefect deploy` (a prefect.yaml): deployment 'attribute/pool' on the process
    work pool 'test-pool', for the tests that start a worker on it (each stops its worker before it returns)."""
    server, tmp, _, _ = setup
    prefect_yaml = tmp / "prefect.yaml"
    prefect_yaml.write_text(
        json.dumps(
            {  # JSON is YAML
                "name": "trakflow-test",
                "build": None,
                "push": None,
                "pull": [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}],
                "deployments": [
                    {
                        "name": "pool",
                        "entrypoint": "flows/attribute.py:attribute",
                        "parameters": {},
                        "work_pool": {"name": "test-pool", "work_queue_name": "default"},
                    }
                ],
            }
        )
    )
    prefect = str(Path(sys.executable).parent / "prefect")
    for cmd in (
        [prefect, "work-pool", "create", "test-pool", "--type", "process"],
        [prefect, "--no-prompt", "deploy", "--prefect-file", str(prefect_yaml), "--all"],
    ):
        res = subprocess.run(cmd, env=server.env, cwd=REPO, capture_output=True, text=True, timeout=400)
        assert res.returncode == 0, f"{cmd[1:3]}: {res.stdout[-2000:]}{res.stderr[-2000:]}"
    return "attribute/pool"


def test_work_pool_route_with_ui_parameters(setup, pool):
    """prefect deploy (a prefect.yaml) + prefect worker start; the run is created through the API with the
    JSON parameters of the UI's form, and completes with the reference scores."""
    server, tmp, ckpt_dir, ref = setup
    cfg = tiny_config(tmp, ckpt_dir, "pool")
    prefect = str(Path(sys.executable).parent / "prefect")
    worker = server.spawn([prefect, "worker", "start", "--pool", "test-pool", "--limit", "1"], "worker")
    try:
        from prefect.deployments import run_deployment
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: server.api_url}):
            created = run_deployment(pool, parameters={"config": cfg}, timeout=0)
        run = wait_terminal(server, "pool", timeout=480, proc=worker, run_id=created.id)
        assert run.state_type.value == "COMPLETED", server.read_log("worker")[-3000:]
        np.testing.assert_array_equal(scores(cfg), ref)
    finally:
        stop(worker)  # the pool's next run is for another test's worker


def test_real_dask_cluster_and_worker_kill(setup):
    """dask_address → a `dask scheduler` with two `dask worker` processes, one of them SIGKILLed after the first
    featurized shard: the run completes with the reference scores."""
    server, tmp, ckpt_dir, ref = setup
    with dask_cluster(tmp / "dask", server.env) as cluster:
        # the tiny model, each forward pass slowed down, so the kill lands while shards are in flight
        cfg = tiny_config(
            tmp,
            ckpt_dir,
            "dask_kill",
            task_runner="dask",
            dask_address=cluster.address,
            model="services:make_slow_tiny_model",
        )
        cfg_file = tmp / "dask_kill.json"
        cfg_file.write_text(json.dumps(cfg))
        code = "import json, sys\nfrom flows import attribute\nattribute(config=json.load(open(sys.argv[1])))\n"
        run = subprocess.Popen(
            [sys.executable, "-c", code, str(cfg_file)],
            env=server.env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

        def first_shard_done():
            try:
                mask = TrakStore.open(cfg["store"], mode="r").featurized_mask(0)
            except Exception:
                return False
            return bool(mask.any())

        wait_for(first_shard_done, 480, "the first featurized shard", poll=0.2, proc=run)
        victim = cluster.workers[0]
        os.kill(victim.pid, signal.SIGKILL)
        status = TrakStore.open(cfg["store"], mode="r")
        done = sum(int(status.featurized_mask(m).sum()) for m in (0, 1))
        assert done < 2 * tiny.NUM_TRAIN, "featurization had finished before the kill"
        out, _ = run.communicate(timeout=400)
        assert victim.wait(10) == -signal.SIGKILL
        assert run.returncode == 0, out[-3000:]
        np.testing.assert_array_equal(scores(cfg), ref)


@pytest.fixture(scope="module")
def served(setup):
    """One serving process (like `trakflow serve`) for two deployments of the attribute flow: 'attribute/served'
    (no schedule) and 'attribute/scheduled' (the config of the store "scheduled", on a schedule whose first run is
    due 8 s after the deployments are registered)."""
    server, tmp, ckpt_dir, _ = setup
    (tmp / "scheduled.json").write_text(json.dumps(tiny_config(tmp, ckpt_dir, "scheduled")))
    script = tmp / "serve_attribute.py"
    script.write_text(
        textwrap.dedent("""
        import json, sys
        from datetime import datetime, timedelta, timezone
        from prefect import serve
        from prefect.schedules import Interval
        from flows import attribute

        cfg = json.load(open(sys.argv[1]))
        first = datetime.now(timezone.utc) + timedelta(seconds=8)
        serve(
            attribute.to_deployment(name="served"),
            attribute.to_deployment(name="scheduled", parameters={"config": cfg},
                                    schedule=Interval(timedelta(hours=1), anchor_date=first)),
        )
    """)
    )
    # its runner polls for runs every second (Prefect's default: 10 s, which each run would wait half of)
    proc = server.spawn(
        [sys.executable, str(script), str(tmp / "scheduled.json")], "serve-attribute", PREFECT_RUNNER_POLL_FREQUENCY="1"
    )
    wait_for(lambda: "attribute/served" in _names(server), 300, "deployment attribute/served", poll=1.0, proc=proc)
    return proc


def _names(server) -> list[str]:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from trakflow_cli.prefect_api import deployment_names

    with temporary_settings({PREFECT_API_URL: server.api_url}):
        return deployment_names()


def _logs(server, flow_run_id) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.api_url}), get_client(sync_client=True) as client:
        return "\n".join(
            x.message for x in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        )


def test_busy_store_queues(setup, served):
    """Two runs on one store at once (a UI click during a scheduled run): the second waits in the store's
    queue (a global concurrency limit) instead of failing on the lock; both complete, scores as reference."""
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    server, tmp, ckpt_dir, ref = setup
    cfg = tiny_config(tmp, ckpt_dir, "queued")
    with temporary_settings({PREFECT_API_URL: server.api_url}):
        runs = [run_deployment("attribute/served", parameters={"config": cfg}, timeout=0) for _ in range(2)]

    def finished():
        states = [r.state_type.value for r in flow_runs(server, "served") if r.id in {x.id for x in runs}]
        return len(states) == 2 and all(s in TERMINAL for s in states) and states

    states = wait_for(finished, 600, "both queued runs", poll=0.5, proc=served)
    assert states == ["COMPLETED", "COMPLETED"], server.read_log("serve-attribute")[-3000:]
    assert any("queued" in _logs(server, r.id) for r in runs), "no run waited in the store's queue"
    np.testing.assert_array_equal(scores(cfg), ref)


def test_trigger_cli(setup, served):
    """`trakflow trigger`: a wrong name lists the deployments; a bad config is refused locally (no run is
    created); --wait prints a failed run's cause on one `error:` line and exits 1. The --wait command runs in a
    process of its own while the other two run in this one: the runs of the deployment afterwards are those
    before and the failing one."""
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from typer.testing import CliRunner

    from trakflow_cli.main import app

    server, tmp, ckpt_dir, _ = setup
    before = {str(r.id) for r in flow_runs(server, "served")}
    failing = tmp / "failing.yaml"
    failing.write_text(
        json.dumps(tiny_config(tmp, ckpt_dir, "failing", train_data="test_real_services:bad_label_train_data"))
    )
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "trakflow"),
            "trigger",
            "attribute/served",
            "--config",
            str(failing),
            "--wait",
        ],
        env={**server.env, "COLUMNS": "200"},  # the run's id on one line
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        env = {"COLUMNS": "200", "NO_COLOR": "1", "PREFECT_API_URL": server.api_url, "PREFECT_LOGGING_LEVEL": "WARNING"}
        with temporary_settings({PREFECT_API_URL: server.api_url}):
            res = CliRunner().invoke(app, ["trigger", "attribute/nope"], env=env)
            assert res.exit_code == 2 and "available:" in res.stderr and "attribute/served" in res.stderr, res.stderr

            bad = tmp / "typo.yaml"
            bad.write_text(json.dumps({**tiny_config(tmp, ckpt_dir, "typo"), "projdim": 3}))
            res = CliRunner().invoke(app, ["trigger", "attribute/served", "--config", str(bad)], env=env)
            assert res.exit_code == 2 and "projdim" in res.stderr, res.stderr

        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, out + err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "BadInputError" in errors[0] and "rows 16..23" in errors[0], err
    m = re.search(r"flow run \S+ \(([0-9a-f-]{36})\)", out)
    assert m, out + err
    assert {str(r.id) for r in flow_runs(server, "served")} == {*before, m.group(1)}


def test_flow_run_graph_shows_stage_order(setup):
    """The UI's flow-run graph (the server's graph-v2 endpoint) draws plan → featurize → finalize → score."""
    import httpx

    server = setup[0]
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.api_url}), get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["attribute"])))
    run = next(r for r in runs if r.parent_task_run_id is None and r.state_type.value == "COMPLETED")
    graph = httpx.get(f"{server.api_url}/flow_runs/{run.id}/graph-v2", timeout=30).json()
    nodes = [n[1] if isinstance(n, list) else n for n in graph["nodes"]]
    by_label = {n["label"].split(" ")[0].split("-")[0]: n for n in nodes}
    ids = {k: n["id"] for k, n in by_label.items()}
    parents = {k: {p["id"] for p in n["parents"]} for k, n in by_label.items()}
    assert ids["featurize"] in parents["finalize"], by_label.keys()
    assert ids["finalize"] in parents["score"]
    assert ids["plan"] in parents["featurize"]


def _featurizing(cfg: dict) -> bool:
    grads = Path(cfg["store"]) / "models" / "0" / "grads" / "c"
    return grads.is_dir() and any(grads.rglob("*"))


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_long_lived_commands_stop_on_sigterm(setup, command, request):
    """`trakflow serve` and `trakflow worker` while a run of theirs is featurizing: SIGTERM to the command
    ends it (exit 128 + 15) and every process it started (the run's too) within 10 s."""
    server, tmp, ckpt_dir, _ = setup
    cfg = tiny_config(
        tmp, ckpt_dir, f"sig-{command}", model="services:make_slow_tiny_model", batch_size=2, max_workers=1
    )
    if command == "serve":
        cmd, deployment = ["serve"], "attribute/digits"
    else:
        deployment = request.getfixturevalue("pool")
        cmd = ["worker", "--pool", "test-pool", "--limit", "1"]
    proc = server.spawn(
        [str(Path(sys.executable).parent / "trakflow"), *cmd], f"sig-{command}", TRAKFLOW_DEMO_DIR=str(tmp / "demo")
    )
    if command == "serve":
        wait_for(lambda: deployment in _names(server), 300, f"deployment {deployment}", poll=1.0, proc=proc)

    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.api_url}):
        run_deployment(deployment, parameters={"config": cfg}, timeout=0)
    wait_for(lambda: _featurizing(cfg), 480, f"a featurizing run of {deployment}", poll=0.2, proc=proc)
    family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    assert len(family) >= 3, [p.cmdline() for p in family]  # the command, Prefect's serve/worker, the run
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)  # to the command only, as a supervisor (systemd, k8s) sends it
    assert proc.wait(10) == 128 + signal.SIGTERM, server.read_log(f"sig-{command}")[-3000:]
    _, alive = psutil.wait_procs(family, timeout=max(0.1, 10 - (time.monotonic() - t0)))
    left = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [" ".join(p.cmdline()) for p in left]
