"""The demo's routes after nightly appends, end to end against a real Prefect server (the session's, from
tests/pipeline/conftest.py): the demo's ``digits-demo/nightly`` and ``query/digits`` deployments (built by
deployments/serve.py; a small nightly: one checkpoint, one epoch) served by a separate process. A first nightly run
(called directly) builds the store. After a new train file, the nightly deployment on a schedule due in a few
seconds: the server's scheduler creates the run and the serving process appends the rows, without writing the old
rows' chunk files again. After another file, the nightly deployment's run, started through the server as a user does
it (``trakflow trigger --wait``), appends its rows. Then every route that reads the grown store works and shows new
rows with their own labels: the ``query/digits`` deployment's run (its table artifact), and ``trakflow run``,
``show`` and ``query`` of the demo's attribute.yaml in fresh processes (no TRAKFLOW_TRAIN_DIR, no TRAKFLOW_DEMO_DIR,
another working directory)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
from services import REPO, wait_for

from trak_core.store import TrakStore
from trakflow_demo_data import digits, folder_data

pytestmark = pytest.mark.services

NEW = 12  # rows the triggered nightly run appends
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
SMALL = dict(num_models=1, epochs=1, proj_dim=64, lambda_reg=1.0)
TRAKFLOW = str(Path(sys.executable).parent / "trakflow")
NO_FOLDER = {folder_data.TRAIN_DIR_ENV: ""}  # empty: unset (this process's tests may have set it)


def _api(server):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    return temporary_settings({PREFECT_API_URL: server.api_url})


def _served_params(server, name: str) -> dict | None:
    from prefect.exceptions import ObjectNotFound

    from trakflow_cli.prefect_api import read_deployment

    with _api(server):
        try:
            return read_deployment(name).parameters
        except ObjectNotFound:
            return None


def _cli_env(server) -> dict:
    """A fresh process's environment pointed at the server (output 200 columns wide), without the train folder
    variable (a nightly run sets it in its own process only) or the demo folder's."""
    env = {k: v for k, v in server.env.items() if k not in (folder_data.TRAIN_DIR_ENV, "TRAKFLOW_DEMO_DIR")}
    env["COLUMNS"] = "200"
    return env


def _cli(server, *args: str, cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess:
    """A trakflow command in a fresh process (:func:`_cli_env`)."""
    return subprocess.run(
        [TRAKFLOW, *args], env=_cli_env(server), cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def _all(server, commands: dict[str, list[str]], cwd: Path, timeout: float = 300) -> dict[str, tuple[int, str]]:
    """Several trakflow commands that only read the store, at once (each its own process): {name: (exit code,
    stdout + stderr)}."""
    procs = {
        name: subprocess.Popen(
            [TRAKFLOW, *args],
            env=_cli_env(server),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, args in commands.items()
    }
    return {name: (p.communicate(timeout=timeout)[0], p.returncode)[::-1] for name, p in procs.items()}


def _run_id(trigger_stdout: str) -> str:
    m = re.search(r"flow run \S+ \(([0-9a-f-]{36})\)", trigger_stdout)
    assert m, trigger_stdout
    return m.group(1)


def _table_rows(server, flow_run_id: str) -> list[dict]:
    """The rows of the table artifact the query run made."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType

    with _api(server), get_client(sync_client=True) as client:
        arts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), type=ArtifactFilterType(any_=["table"])
            )
        )
    assert len(arts) == 1, arts
    data = arts[0].data
    return json.loads(data) if isinstance(data, str) else data


def _schedule_soon(server, name: str, seconds: float):
    """Give the deployment ``name`` an hourly schedule whose first run is due in ``seconds``; returns the
    deployment's id and that first run's time."""

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.schedules import IntervalSchedule

    with _api(server), get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(name)
        first = datetime.now(UTC) + timedelta(seconds=seconds)
        client.create_deployment_schedules(
            dep.id, [(IntervalSchedule(interval=timedelta(hours=1), anchor_date=first), True)]
        )
    return dep.id, first


def _finished_scheduled_run(server, deployment_id, first):
    """The deployment's run that the server's scheduler created for ``first`` (or later), once it is in a terminal
    state (else None)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with _api(server), get_client(sync_client=True) as client:
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))
    done = [
        r
        for r in runs
        if r.auto_scheduled
        and r.expected_start_time is not None
        and r.expected_start_time >= first - timedelta(seconds=1)
        and r.state_type
        and r.state_type.value in TERMINAL
    ]
    return done[0] if done else None


def test_demo_routes_after_a_served_nightly_append(real_prefect_server, tmp_path):
    server = real_prefect_server
    demo = tmp_path / "demo"
    script = tmp_path / "serve_demo.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        from prefect import serve
        from deployments.serve import build_deployments

        deps = {{f"{{d.flow_name}}/{{d.name}}": d for d in build_deployments(sys.argv[1])}}
        nightly = deps["digits-demo/nightly"]
        nightly.parameters = {{**nightly.parameters, **{SMALL!r}}}
        if sys.argv[2:] == ["seed"]:  # the nightly's flow called once with its parameters: trains, seeds, attributes
            from flows import digits_demo
            digits_demo(**nightly.parameters)
        else:
            serve(nightly, deps["query/digits"])
    """)
    )
    # the serving process (its runner polls for runs every second; Prefect's default: 10 s) and, meanwhile, a first
    # nightly run called directly: the store of the digits train set, the train folder seeded with it
    proc = server.spawn(
        [sys.executable, str(script), str(demo)], "serve-demo", PREFECT_RUNNER_POLL_FREQUENCY="1", **NO_FOLDER
    )
    seed = server.spawn([sys.executable, str(script), str(demo), "seed"], "seed-demo", **NO_FOLDER)

    def registered() -> bool:  # by this process (another module's `trakflow serve` may have registered the names)
        params = [_served_params(server, n) for n in ("digits-demo/nightly", "query/digits")]
        return bool(
            params[0]
            and params[1]
            and params[0].get("demo_dir") == str(demo)
            and params[0].get("num_models") == 1
            and params[1]["request"]["store"] == str(demo.absolute() / "store.zarr")
        )

    wait_for(registered, 300, "the demo's deployments served", poll=0.5, proc=proc)
    assert seed.wait(300) == 0, server.read_log("seed-demo")[-3000:]
    store = str(demo / "store.zarr")
    old = TrakStore.open(store, mode="r")
    assert old.meta.train_set_size == digits.NUM_TRAIN
    log = lambda: server.read_log("serve-demo")[-3000:]  # noqa: E731

    # the nightly deployment on a schedule due in a few seconds, after a new train file (held-out digits not used
    # below): the server's scheduler creates the run, the serving process runs it, the store holds the new rows too
    # and the old rows' chunk files were not written again
    x, y = digits.heldout_data()
    later = list(range(digits.NUM_TARGETS + NEW - 1, len(y)))
    old_rows = old.model(0).grads[:].copy()
    chunk_files = sorted((demo / "store.zarr" / "models" / "0" / "grads" / "c").rglob("*"))
    mtimes = {p: p.stat().st_mtime_ns for p in chunk_files if p.is_file()}
    folder_data.save_part(demo / "train", (x[later], y[later]), 1)
    nightly_id, first = _schedule_soon(server, "digits-demo/nightly", seconds=8)
    run = wait_for(
        lambda: _finished_scheduled_run(server, nightly_id, first),
        300,
        "the scheduled nightly run",
        poll=1.0,
        proc=proc,
    )
    assert run.state_type.value == "COMPLETED", log()
    grown = TrakStore.open(store, mode="r")
    base = digits.NUM_TRAIN + len(later)
    assert grown.meta.train_set_size == base and bool(grown.featurized_mask(0).all())
    np.testing.assert_array_equal(grown.model(0).grads[: digits.NUM_TRAIN], old_rows)
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes  # the old rows' chunks were not written again
    assert grown.scores("digits")[:].shape == (base, digits.NUM_TARGETS)

    # another train file: target 0's own digit, then unseen held-out digits; the nightly deployment's run, started
    # through the server as a user does it (`trakflow trigger --wait`), appends it
    take = [0, *range(digits.NUM_TARGETS, digits.NUM_TARGETS + NEW - 1)]
    new_x, new_y = x[take], y[take]
    folder_data.save_part(demo / "train", (new_x, new_y), 2)
    res = _cli(server, "trigger", "digits-demo/nightly", "--wait")
    assert res.returncode == 0, res.stdout + res.stderr + log()
    grown = TrakStore.open(store, mode="r")
    n = base + NEW
    assert grown.meta.train_set_size == n and bool(grown.featurized_mask(0).all())
    assert grown.scores("digits")[:].shape == (n, digits.NUM_TARGETS)

    def label_of(i: int) -> int:
        if i >= base:
            return int(new_y[i - base])
        return int(y[later[i - digits.NUM_TRAIN]]) if i >= digits.NUM_TRAIN else int(digits.train_data()[1][i])

    # every route that reads the grown store, at once (none writes): the query/digits deployment on new rows as
    # inputs, and trakflow run / show / query of the demo's attribute.yaml, each in a fresh process, from another
    # folder than the repository's (whose trakflow_demo/ a user's own demo may fill)
    queries = tmp_path / "new_rows.pt"
    torch.save((new_x[1:4], new_y[1:4]), queries)
    yaml_path = str(demo / "attribute.yaml")
    out = _all(
        server,
        {
            "trigger": ["trigger", "query/digits", "--inputs", str(queries), "--wait"],
            "run": ["run", yaml_path],
            "show": ["show", yaml_path, "--target", "0"],
            "query": ["query", yaml_path, "--inputs", str(queries)],
        },
        cwd=tmp_path,
    )
    for name, (code, text) in out.items():
        assert code == 0, (name, text + (log() if name == "trigger" else ""))

    # the deployment's table: each input (new row 1 + j) among its own proponents; every row shown with its label
    rows = _table_rows(server, _run_id(out["trigger"][1]))
    shown = {(r["proponent"], r["proponent_label"]) for r in rows} | {
        (r["opponent"], r["opponent_label"]) for r in rows
    }
    assert all(lab == label_of(i) for i, lab in shown), rows
    for j in range(3):
        assert base + 1 + j in {r["proponent"] for r in rows if r["input"] == j}, rows

    assert f"({n} train rows" in out["run"][1], out["run"][1]  # complete: nothing to run
    text = out["show"][1]  # target 0's own digit, appended: among its proponents, with its label
    assert f"{n} train rows" in text and re.search(rf"#{base}\b\D*y={int(new_y[0])}", text), text
    text = out["query"][1]
    listed = {int(i): int(lab) for i, lab in re.findall(r"#(\d+) y=(\d+)", text)}
    assert {base + 1 + j for j in range(3)} <= set(listed), text
    assert all(lab == label_of(i) for i, lab in listed.items()), text
