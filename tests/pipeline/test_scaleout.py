"""Scale-out and fault tolerance: Dask and process-pool runners, resume after SIGKILL, retries, the run
lock, fsspec stores. Tiny data (examples.tiny), few subprocesses: each Prefect/torch start costs seconds."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from trak_fixtures import REPO_ROOT, set_gpu_limit, tiny_attribute_config

from examples import tiny
from tasks.config import AttributeConfig
from trak_core.errors import BadInputError, StoreLockedError
from trak_core.featurize.featurizer import Featurizer
from trak_core.store import StoreLock, TrakStore

pytestmark = pytest.mark.usefixtures("prefect_harness")

REPO = REPO_ROOT
N, M, SHARD = tiny.NUM_TRAIN, tiny.NUM_TARGETS, 16
SHARDS = N // SHARD
MODELS = 2


def config(store, ckpts, **over) -> AttributeConfig:
    return AttributeConfig.model_validate(tiny_attribute_config(store, ckpts, **over))


def bad_label_train_data():
    """tiny's train data with label 7 (3 classes) in row 20 (shard 1): passes the plan (which cannot know
    the number of classes without the model's outputs), fails inside featurize-shard."""
    x, y = tiny.train_data()
    y = y.clone()
    y[20] = 7
    return x, y


def nan_train_data():
    x, y = tiny.train_data()
    x = x.clone()
    x[[20, 41], 3] = float("nan")
    return x, y


def file_mtimes(root) -> dict[str, int]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            out[os.path.join(d, f)] = os.stat(os.path.join(d, f)).st_mtime_ns
    return out


def scores_of(location: str) -> np.ndarray:
    return TrakStore.open(location, mode="r").scores("tiny")[:]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The uninterrupted single-process run (thread runner): checkpoints and reference scores."""
    from flows import attribute

    tmp = tmp_path_factory.mktemp("scaleout")
    ckpts = tiny.save_checkpoints(tmp / "ck", seeds=(0, 1))
    cfg = config(tmp / "ref.zarr", ckpts)
    attribute(cfg)
    return tmp, ckpts, cfg, scores_of(cfg.store)


def _api_url() -> str:
    from prefect.settings import get_current_settings

    return str(get_current_settings().api.url)


#: run by the killed subprocess: wraps a step of tasks.core so that the process SIGKILLs itself (no cleanup)
#: right after its N-th computed (not skipped) result, then runs `trakflow run <config>` (thread runner: the
#: tasks call tasks.core in this process)
CRASH_HOOK = """
import os, signal, sys, threading

import tasks.core as core
from trakflow_cli.main import app

step, limit, config = sys.argv[1], int(sys.argv[2]), sys.argv[3]
original, lock, done = getattr(core, step), threading.Lock(), [0]


def crashing(*args, **kwargs):
    out = original(*args, **kwargs)
    if not out.skipped:
        with lock:
            done[0] += 1
            if done[0] >= limit:
                os.kill(os.getpid(), signal.SIGKILL)
    return out


setattr(core, step, crashing)
app(["run", config])
"""


def run_cli_killed(tmp: Path, cfg: AttributeConfig, step: str, after: int) -> subprocess.CompletedProcess:
    """`trakflow run cfg.yaml` in a subprocess against the test's Prefect server, killed (SIGKILL) right after
    ``after`` computed calls of ``tasks.core.<step>`` (the hook is installed by the script, not the code)."""
    path = tmp / f"{Path(cfg.store).stem}.yaml"
    path.write_text(cfg.to_yaml())
    hook = tmp / "crash_hook.py"
    hook.write_text(CRASH_HOOK)
    full = {
        **os.environ,
        "PREFECT_API_URL": _api_url(),
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, str(hook), step, str(after), str(path)],
        cwd=REPO,
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
    )


# ---------------------------------------------------------------------------------------------- runners
def test_config_task_runner_fields(ref):
    tmp, ckpts, _, _ = ref
    assert config(tmp / "s", ckpts).task_runner == "thread"
    ok = config(tmp / "s", ckpts, task_runner="process", gpus=["0", "1"])
    assert ok.gpus == ["0", "1"]
    assert config(tmp / "s", ckpts, task_runner="dask", dask_address="tcp://10.0.0.5:8786").dask_address
    bad = [
        (dict(task_runner="slurm"), "task_runner"),
        (dict(gpus=["0"]), "gpus: needs task_runner"),
        (dict(task_runner="process", gpus=["0", "0"]), "listed twice"),
        (dict(task_runner="process", gpus=["0,1"]), "gpus"),
        (dict(task_runner="process", gpus=[]), "gpus"),
        (dict(dask_address="tcp://h:8786"), "dask_address: needs task_runner 'dask'"),
        (dict(task_runner="dask", dask_address="not an address"), "dask_address"),
        (dict(task_runner="dask", dask_address="tcp://h:8786", gpus=["0"]), "gpus"),
        (dict(task_runner="dask", store="memory://x/s.zarr"), "memory of one process"),
        (dict(task_runner="process", store="memory://x/s.zarr"), "memory of one process"),
    ]
    from pydantic import ValidationError

    for over, msg in bad:
        with pytest.raises(ValidationError, match=msg):
            config(over.pop("store", tmp / "s"), ckpts, **over)
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect_dask import DaskTaskRunner

    from flows.runners import GPUProcessPoolTaskRunner, make_task_runner

    assert isinstance(make_task_runner(config(tmp / "s", ckpts, max_workers=3)), ThreadPoolTaskRunner)
    r = make_task_runner(ok)
    assert isinstance(r, GPUProcessPoolTaskRunner) and r._max_workers == 2 and r.duplicate() == r
    d = make_task_runner(config(tmp / "s", ckpts, task_runner="dask", dask_n_workers=3))
    assert isinstance(d, DaskTaskRunner) and d.cluster_kwargs["n_workers"] == 3
    assert (
        make_task_runner(config(tmp / "s", ckpts, task_runner="dask", dask_address="tcp://h:1")).address == "tcp://h:1"
    )
    assert not os.path.exists(tmp / "s")


def test_existing_dask_cluster_checks(ref):
    """dask_address: an unreachable scheduler and a missing Prefect server fail before any work."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.runners import check_dask_scheduler, worker_api

    tmp, ckpts, _, _ = ref
    with pytest.raises(BadInputError, match="dask_address: cannot reach a Dask scheduler"):
        check_dask_scheduler("tcp://127.0.0.1:1", timeout=0.5)
    cfg = config(tmp / "s", ckpts, task_runner="dask", dask_address="tcp://127.0.0.1:1")
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        with pytest.raises(BadInputError, match="PREFECT_API_URL is not set"):
            with worker_api(cfg):
                pass


def test_dask_local_cluster_two_worker_processes_equal_scores(ref, tmp_path, monkeypatch):
    """task_runner: dask — a LocalCluster of 2 worker processes (shared by the three stages), a file://
    store; the scores equal the thread runner's bit for bit, and no gradient is computed in this process."""
    from distributed.diagnostics.task_stream import TaskStreamPlugin

    import flows.runners as runners
    from flows import attribute

    _, ckpts, _, expected = ref
    clusters = []
    start = runners.start_local_cluster

    def recording(*a, **k):
        cluster = start(*a, **k)
        plugin = TaskStreamPlugin(cluster.scheduler)
        cluster.scheduler.add_plugin(plugin)
        clusters.append((cluster, plugin, a, k))
        return cluster

    monkeypatch.setattr(runners, "start_local_cluster", recording)
    monkeypatch.setattr(Featurizer, "featurize", lambda *a, **k: pytest.fail("featurized in the flow's process"))
    cfg = config(f"file://{tmp_path}/dask.zarr", ckpts, task_runner="dask", dask_n_workers=2)
    result = attribute(cfg)

    assert len(clusters) == 1  # one cluster for featurize, finalize and score
    cluster, plugin, args, kwargs = clusters[0]
    assert args[:2] == (2, 1) and kwargs.get("processes") is not False  # 2 worker processes, 1 thread each
    used = {rec["worker"] for rec in plugin.buffer}
    assert len(used) == 2, used  # both worker processes ran tasks
    assert result["featurize"]["computed"] == MODELS * SHARDS
    assert TrakStore.open(cfg.store).lock.holder() is None
    np.testing.assert_array_equal(scores_of(cfg.store), expected)


def test_local_dask_cluster_pins_one_gpu_per_worker():
    from distributed import Client

    from flows.runners import GPU_ENV, start_local_cluster

    with start_local_cluster(gpus=["0", "1"]) as cluster, Client(cluster) as client:
        seen = client.run(lambda: os.environ.get(GPU_ENV))
        names = {w["name"] for w in client.scheduler_info()["workers"].values()}
    assert sorted(seen.values()) == ["0", "1"] and names == {"gpu-0", "gpu-1"}


def rendezvous(folder: str, peers: int) -> dict:
    """Check in, then wait until `peers` distinct processes have checked in (so every worker runs one)."""
    from flows.runners import GPU_ENV

    Path(folder, str(os.getpid())).write_text(os.environ.get(GPU_ENV, ""))
    deadline = time.time() + 120
    while len(os.listdir(folder)) < peers and time.time() < deadline:
        time.sleep(0.05)
    return {"pid": os.getpid(), "gpu": os.environ.get(GPU_ENV)}


def test_process_runner_one_worker_per_gpu(ref, tmp_path, monkeypatch):
    """task_runner: process with gpus — one worker process per GPU, each with its own
    CUDA_VISIBLE_DEVICES (the parent's value is not forwarded); the same pool featurizes the shards and
    the gradients equal the thread runner's."""
    from prefect import flow, task

    from flows.runners import gather, make_task_runner
    from tasks.attribution import featurize_shard, plan_attribution

    _, ckpts, ref_cfg, _ = ref
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    cfg = config(tmp_path / "proc.zarr", ckpts, task_runner="process", gpus=["0", "1"])
    meet = tmp_path / "meet"
    meet.mkdir()
    probe = task(rendezvous, name="rendezvous")

    @flow(name="process-pool-probe")
    def pool_flow(config: AttributeConfig):
        plan = plan_attribution(config)
        seen = gather([probe.submit(str(meet), 2) for _ in range(2)])
        shards = gather([featurize_shard.submit(config, m.model_id, m.checkpoint, s) for m, s in plan.featurize_jobs()])
        return seen, shards

    seen, shards = pool_flow.with_options(task_runner=make_task_runner(cfg))(cfg)
    assert os.getpid() not in {s["pid"] for s in seen}
    assert sorted(s["gpu"] for s in seen) == ["0", "1"] and len({s["pid"] for s in seen}) == 2
    assert sum(not m.skipped for m in shards) == MODELS * SHARDS
    got, want = TrakStore.open(cfg.store, mode="r"), TrakStore.open(ref_cfg.store, mode="r")
    for mid in range(MODELS):
        np.testing.assert_array_equal(got.model(mid).grads[:], want.model(mid).grads[:])
        np.testing.assert_array_equal(got.model(mid).xtx_partials[:], want.model(mid).xtx_partials[:])


def test_gpu_tag_concurrency_limit_caps_featurize_tasks(ref, tmp_path, monkeypatch):
    """`prefect concurrency-limit create trakflow-gpu 1`: featurize tasks (tagged) never overlap, even
    with two threads."""

    import tasks.core as core
    from flows import featurize

    _, ckpts, _, _ = ref
    intervals, orig = [], core.featurize_shard

    def timed(*a, **k):
        t0 = time.perf_counter()
        out = orig(*a, **k)
        intervals.append((t0, time.perf_counter()))
        return out

    monkeypatch.setattr(core, "featurize_shard", timed)

    set_gpu_limit(1)
    # Prefect remembers for 5 s that a set of tags had no limit; a tagged run of an earlier test in this process
    # (under a limit it deleted since) may have filled that cache
    from prefect.concurrency import services as concurrency_services

    concurrency_services._no_limits_cache.clear()
    try:
        featurize(config(tmp_path / "limited.zarr", ckpts[:1], max_workers=2))
    finally:
        set_gpu_limit(None)
    intervals.sort()
    assert len(intervals) == SHARDS
    assert all(b[0] >= a[1] for a, b in zip(intervals, intervals[1:])), intervals


# ---------------------------------------------------------------------------------------------- resume
def test_sigkill_during_featurize_then_resume(ref, tmp_path):
    """The flow process is SIGKILLed after its 3rd complete shard; the rerun skips the complete shards,
    takes over the dead run's lock, and the scores equal the uninterrupted run's bit for bit."""
    from flows import attribute

    _, ckpts, _, expected = ref
    cfg = config(tmp_path / "killed.zarr", ckpts)
    proc = run_cli_killed(tmp_path, cfg, "featurize_shard", 3)
    assert proc.returncode == -9, proc.stderr[-3000:]
    store = TrakStore.open(cfg.store)
    complete = {(mid, s) for mid in range(MODELS) for s in range(SHARDS) if store.shard_featurized(mid, s)}
    assert 3 <= len(complete) < MODELS * SHARDS
    # (a shard of the other thread may be complete without its XᵀX partial: the rerun adds it, skipping the rows)
    holder = store.lock.holder()
    assert holder is not None and holder["pid"] != os.getpid()  # left behind by the killed run
    assert not any(store.is_finalized(mid) for mid in range(MODELS))

    result = attribute(cfg)

    skipped = {(m.model_id, m.shard) for m in result["featurize"]["manifests"] if m.skipped}
    assert skipped == complete
    assert result["featurize"]["computed"] == MODELS * SHARDS - len(complete)
    assert store.lock.holder() is None
    np.testing.assert_array_equal(scores_of(cfg.store), expected)


def test_sigkill_during_scoring_then_resume(ref, tmp_path):
    """Killed after the 2nd scored row block: the rerun recomputes nothing upstream, skips the scored
    blocks, and the scores equal the uninterrupted run's bit for bit."""
    from flows import attribute

    _, ckpts, _, expected = ref
    cfg = config(tmp_path / "killed.zarr", ckpts)
    proc = run_cli_killed(tmp_path, cfg, "score_block", 2)
    assert proc.returncode == -9, proc.stderr[-3000:]
    store = TrakStore.open(cfg.store)
    assert all(store.is_finalized(mid) and store.targets_complete("tiny", mid) for mid in range(MODELS))
    done = store.experiment("tiny").scores_done[:].reshape(SHARDS, SHARD)
    assert set(done.min(axis=1)) <= {0, 1} and (done.min(axis=1) == done.max(axis=1)).all()  # whole blocks
    blocks_done = {b for b in range(SHARDS) if done[b].all()}
    assert 2 <= len(blocks_done) < SHARDS
    with pytest.raises(Exception, match="not finalized"):
        scores_of(cfg.store)

    result = attribute(cfg)

    assert result["featurize"]["computed"] == 0 and result["finalize"]["computed"] == 0
    assert result["score"]["targets"]["computed"] == 0  # the killed run completed the target gradients
    blocks = result["score"]["blocks"]["manifests"]
    assert {m.rows[0] // SHARD for m in blocks if m.skipped} == blocks_done
    np.testing.assert_array_equal(scores_of(cfg.store), expected)


# ---------------------------------------------------------------------------------------------- retries
def _task_runs(flow_run_id, expect: int):
    """The task runs of a flow run once the server has recorded their final states."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read():
        async with get_client() as client:
            return await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))

    deadline = time.time() + 60
    while True:
        runs = asyncio.run(read())
        if (
            len(runs) >= expect and all(r.state is not None and r.state.is_final() for r in runs)
        ) or time.time() > deadline:
            return {r.name: r for r in runs}
        time.sleep(0.5)


def test_transient_failure_is_retried(ref, tmp_path, monkeypatch):
    from flows import featurize
    from tasks.attribution import featurize_shard

    _, ckpts, _, _ = ref
    cfg = config(tmp_path / "retry.zarr", ckpts[:1])
    calls = []
    orig = Featurizer.featurize

    def flaky(self, batch, model_id, inds):
        calls.append(inds[0])
        if inds[0] == 16 and calls.count(16) == 1:
            raise ConnectionError("storage node went away")
        return orig(self, batch, model_id, inds)

    monkeypatch.setattr(Featurizer, "featurize", flaky)
    monkeypatch.setattr(featurize_shard, "retry_delay_seconds", 0)  # (2 s in production)
    state = featurize(cfg, return_state=True)
    assert state.is_completed()
    assert state.result()["computed"] == SHARDS
    assert calls.count(16) == 2  # the failed first attempt and the retry
    runs = _task_runs(state.state_details.flow_run_id, SHARDS)
    assert runs["featurize-m0-s1"].run_count == 2 and runs["featurize-m0-s1"].state.is_completed()
    assert runs["featurize-m0-s0"].run_count == 1
    assert TrakStore.open(cfg.store).featurized_mask(0).all()


def test_bad_input_in_a_task_is_not_retried_and_reaches_the_caller(ref, tmp_path, monkeypatch):
    from flows import featurize

    _, ckpts, _, _ = ref
    cfg = config(tmp_path / "label.zarr", ckpts[:1], train_data="test_scaleout:bad_label_train_data")
    calls = []
    orig = Featurizer.featurize

    def counting(self, batch, model_id, inds):
        calls.append(inds[0])
        return orig(self, batch, model_id, inds)

    monkeypatch.setattr(Featurizer, "featurize", counting)
    state = featurize(cfg, return_state=True)
    assert state.is_failed()
    with pytest.raises(BadInputError, match=r"train_data rows 16..23 \(model_id=0\): labels out of range .*7"):
        state.result()
    assert calls.count(16) == 1  # not retried
    runs = _task_runs(state.state_details.flow_run_id, SHARDS)
    assert runs["featurize-m0-s1"].run_count == 1 and runs["featurize-m0-s1"].state.is_failed()
    store = TrakStore.open(cfg.store)
    assert not store.featurized_mask(0)[16:32].any()  # the shard with the bad row is not marked
    assert store.lock.holder() is None  # a failed run releases its lock


def test_non_finite_inputs_and_checkpoints_are_refused_by_the_plan(ref, tmp_path):
    """NaN anywhere in the data or a checkpoint fails before anything is written (not in a task)."""
    from flows import attribute

    _, ckpts, _, _ = ref
    sd = torch.load(ckpts[1], weights_only=True)
    sd["2.bias"][1] = float("inf")
    torch.save(sd, tmp_path / "inf.pt")
    cases = [
        (dict(train_data="test_scaleout:nan_train_data"), r"train_data: NaN or inf .* indices \[20, 41\]"),
        (
            dict(checkpoints=[ckpts[0], str(tmp_path / "inf.pt")]),
            r"checkpoints\[1\]: .*inf.pt has NaN or inf "
            r"in \['2.bias'\]",
        ),
    ]
    for over, msg in cases:
        cfg = config(tmp_path / "s.zarr", ckpts, **over)
        with pytest.raises(BadInputError, match=msg):
            attribute(cfg)
        assert not os.path.exists(cfg.store)


# ---------------------------------------------------------------------------------------------- lock, fsspec
def test_second_run_on_a_locked_store_is_refused(ref):
    """Another live process holds the store's lock: the run is refused naming it; the store is unchanged."""
    from flows import attribute

    _, _, cfg, _ = ref
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import sys
        from trak_core.store import TrakStore
        st = TrakStore.open({cfg.store!r})
        st.lock.acquire("attribute/other-run")
        print("locked", flush=True)
        sys.stdin.readline()
        st.lock.release()
        """),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = file_mtimes(cfg.store)
        with pytest.raises(StoreLockedError, match=rf"in use by run attribute/other-run \(pid {holder.pid} on"):
            attribute(cfg)
        assert file_mtimes(cfg.store) == before
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(timeout=300) == 0
    finally:
        holder.kill()
    assert TrakStore.open(cfg.store).lock.holder() is None


def test_two_runs_in_one_process_and_nested_flows(ref, tmp_path):
    """A run re-enters its own lock (attribute → featurize), another run in the same process is refused."""
    from flows.runners import run_lock

    _, ckpts, _, _ = ref
    cfg = config(tmp_path / "new" / "s.zarr", ckpts)
    errors = []
    with run_lock(cfg, "first"):
        assert StoreLock(cfg.store).holder()["run"] == "first"
        with run_lock(cfg):  # same thread = same run: re-entered, not released at exit
            pass
        assert StoreLock(cfg.store).holder()["run"] == "first"

        def other():
            try:
                with run_lock(cfg, "second"):
                    pass
            except StoreLockedError as e:
                errors.append(str(e))

        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert len(errors) == 1 and "in use by run first" in errors[0]
    assert not (tmp_path / "new").exists()  # nothing was written: the lock's folders are removed again


def test_memory_fsspec_store(ref):
    """A non-local fsspec filesystem (memory://) with the thread runner: same scores, lock released."""
    import fsspec

    from flows import attribute

    _, ckpts, _, expected = ref
    cfg = config("memory://trakflow-scaleout/store.zarr", ckpts)
    try:
        result = attribute(cfg)
        assert result["featurize"]["computed"] == MODELS * SHARDS
        np.testing.assert_array_equal(scores_of(cfg.store), expected)
        assert TrakStore.open(cfg.store).lock.holder() is None
    finally:
        fsspec.filesystem("memory").rm("/trakflow-scaleout", recursive=True)


def test_unlock_command(tmp_path):
    from typer.testing import CliRunner

    from trakflow_cli.main import app

    loc = tmp_path / "s.zarr"
    loc.mkdir()
    (loc / StoreLock.NAME).write_text(
        json.dumps({"host": "gpu-node-7", "pid": 4242, "run": "attribute/lost", "since": 0})
    )
    res = CliRunner().invoke(app, ["unlock", str(loc)])
    assert res.exit_code == 0, res.output
    assert "attribute/lost" in res.output and "gpu-node-7" in res.output
    assert not (loc / StoreLock.NAME).exists()
    assert "not locked" in CliRunner().invoke(app, ["unlock", str(loc)]).output
    # a live holder on this host is not removed without --yes
    (loc / StoreLock.NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "run": "me"}))
    res = CliRunner().invoke(app, ["unlock", str(loc)])
    assert res.exit_code != 0 and (loc / StoreLock.NAME).exists()
    assert CliRunner().invoke(app, ["unlock", str(loc), "--yes"]).exit_code == 0
    assert not (loc / StoreLock.NAME).exists()
