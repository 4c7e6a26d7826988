"""Every failure of a ``trakflow`` command is one ``error:`` line naming what is wrong (trakflow_cli.errors):
config errors as ``field.path: message`` (one line each, no pydantic input dump or link), an unknown
experiment, a store with malformed metadata, an unreachable or absent Prefect server, and any exception a
command lets out; ``--debug`` (or TRAKFLOW_DEBUG=1) shows the traceback instead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
import zarr
from services import free_port, pythonpath_for_tests
from trak_fixtures import REPO_ROOT, TESTS_ROOT, tiny_attribute_config
from typer.testing import CliRunner

from examples import tiny
from trak_core.errors import BadInputError, StoreDamageError
from trakflow_cli import errors
from trakflow_cli.main import app

REPO = REPO_ROOT
TESTS = TESTS_ROOT
ENV = {"COLUMNS": "200", "NO_COLOR": "1", "TRAKFLOW_DEBUG": ""}
runner = CliRunner()


def invoke(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env={**ENV, **(env or {})})


def error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("error:")]


def no_dump(text: str) -> None:
    for junk in ("Traceback", "input_value", "pydantic.dev", "[type=", "validation error"):
        assert junk not in text, text


def cli_env(home: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "TRAKFLOW_"))}
    env.update(
        ENV,
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), *pythonpath_for_tests(), os.environ.get("PYTHONPATH")])),
        **extra,
    )
    return env


def trakflow(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    code = "import sys\nfrom trakflow_cli.main import app\napp(sys.argv[1:])\n"
    return subprocess.run(
        [sys.executable, "-c", code, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


# ---------------------------------------------------------------------------------------------- pydantic
@pytest.fixture(scope="module")
def good_config(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("cfg")
    paths = tiny.save_checkpoints(tmp / "ck", seeds=(0, 1))
    return tiny_attribute_config(tmp / "store.zarr", paths, exp_name="default")


def write(tmp: Path, name: str, data: dict) -> Path:
    path = tmp / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_validation_lines_name_each_field():
    from pydantic import BaseModel, Field, ValidationError, field_validator

    class Inner(BaseModel):
        size: int = Field(gt=0)

    class Outer(BaseModel, extra="forbid"):
        inner: Inner
        items: list[Inner] = []
        path: str = "x"
        either: list[int] | str = "a"

        @field_validator("path")
        @classmethod
        def _path(cls, v):
            if v.startswith("/"):
                raise ValueError(f"path: {v!r} must be relative")
            return v

    with pytest.raises(ValidationError) as ei:
        Outer.model_validate(
            {"inner": {"size": 0}, "items": [{"size": 1}, {"size": "x"}], "path": "/a", "either": 5, "typo": 1}
        )
    lines = errors.validation_lines(ei.value, "invalid config c.yaml: ")
    assert lines == [
        "invalid config c.yaml: inner.size: Input should be greater than 0 (got 0)",
        "invalid config c.yaml: items[1].size: Input should be a valid integer, unable to parse string as an "
        "integer (got 'x')",
        "invalid config c.yaml: path: '/a' must be relative",
        "invalid config c.yaml: either: Input should be a valid list or Input should be a valid string (got 5)",
        "invalid config c.yaml: typo: Extra inputs are not permitted (got 1)",
    ]


def test_bad_config_is_one_line_per_field_in_every_command(tmp_path, good_config):
    """run, train, evaluate, show --config and trigger --config: one `field: message` line per error."""
    bad = {**good_config, "proj_dim": 0, "projdim": 3, "model": "examples.tiny:nope"}
    attr = write(tmp_path, "attr.yaml", bad)
    ev = write(tmp_path, "ev.yaml", {"attribute": bad, "num_subsets": 5})
    train = write(tmp_path, "train.yaml", {"model": "examples.tiny:nope", "epochs": 0})
    cases = [
        (("run", attr), attr, ("proj_dim", "projdim", "model")),
        (("show", attr), attr, ("proj_dim", "projdim", "model")),
        (("show", tmp_path / "s.zarr", "--config", attr), attr, ("proj_dim", "projdim", "model")),
        (("trigger", "attribute/x", "--config", attr), attr, ("proj_dim", "projdim", "model")),
        (("evaluate", ev), ev, ("attribute.proj_dim", "attribute.projdim", "attribute.model")),
        (("train", train), train, ("model",)),
    ]
    for args, path, fields in cases:
        res = invoke(*args)
        assert res.exit_code == 2, (args, res.output)
        no_dump(res.output)
        lines = error_lines(res.output)
        assert lines and all(ln.startswith(f"error: invalid config {path}: ") for ln in lines), res.output
        named = [ln.split(": ")[2] for ln in lines]
        for f in fields:
            assert f in named, (args, res.output)
    res = invoke("run", attr)
    assert "error: invalid config" in res.output and "proj_dim: Input should be greater than 0 (got 0)" in res.output


def test_a_model_validator_message_keeps_its_field(tmp_path, good_config):
    path = write(tmp_path, "gpus.yaml", {**good_config, "task_runner": "process", "gpus": ["0", "0"]})
    res = invoke("run", path)
    assert res.exit_code == 2
    no_dump(res.output)
    assert error_lines(res.output) == [f"error: invalid config {path}: gpus: a GPU is listed twice in ['0', '0']"]


# ---------------------------------------------------------------------------------------------- stores
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from trak_core import TRAKer

    tmp = tmp_path_factory.mktemp("store")
    x, y = tiny.train_data()
    xt, yt = tiny.target_data()
    loc = str(tmp / "store.zarr")
    tr = TRAKer(tiny.make_model(), "image_classification", tiny.NUM_TRAIN, save_dir=loc, device="cpu", proj_dim=8)
    tr.load_checkpoint(tiny.make_model().state_dict(), 0)
    tr.featurize((x, y), num_samples=tiny.NUM_TRAIN)
    tr.finalize_features()
    for exp in ("alpha", "beta"):
        tr.start_scoring_checkpoint(exp, tiny.make_model().state_dict(), 0, tiny.NUM_TARGETS)
        tr.score((xt, yt), num_samples=tiny.NUM_TARGETS)
        tr.finalize_scores(exp)
    return loc


def test_show_unknown_experiment_lists_the_existing_ones(store):
    for args in (("--exp", "nope"), ("--exp", "nope", "--target", "0")):
        res = invoke("show", store, *args)
        assert res.exit_code == 2, res.output
        assert error_lines(res.output) == [
            f"error: --exp 'nope': store {store} has no experiment 'nope'; its experiments: 'alpha', 'beta'"
        ], res.output
        assert "checkpoints" not in res.output  # refused before the status tables
    assert invoke("show", store, "--exp", "beta", "--target", "1").exit_code == 0


@pytest.mark.parametrize(
    "attrs", [{"proj_dim": "many", "train_set_size": "x"}, "not a mapping", {}], ids=["field", "type", "empty"]
)
def test_malformed_store_metadata_is_one_line(tmp_path, attrs):
    """A Zarr group whose `trakflow` attributes were not written by trakflow (no seal, no sealed copy): verify and
    show say in one line that the root metadata cannot be trusted and what to do."""
    loc = tmp_path / "bad.zarr"
    zarr.open_group(str(loc), mode="w").attrs["trakflow"] = attrs
    for cmd in ("verify", "show"):
        res = invoke(cmd, loc)
        assert res.exit_code != 0, res.output
        no_dump(res.output)
        lines = error_lines(res.output)
        assert len(lines) == 1, res.output
        assert lines[0].startswith(f"error: store {loc}: the root metadata fails its seal"), res.output
        assert "no intact copy is left" in lines[0], res.output


# ---------------------------------------------------------------------------------------------- any command
@pytest.mark.parametrize(
    "exc,code,text",
    [
        (BadInputError("store: bad thing at rows 3..4"), 2, "error: BadInputError: store: bad thing at rows 3..4"),
        (
            StoreDamageError("models/0/grads c/1/0: missing"),
            1,
            "error: StoreDamageError: models/0/grads c/1/0: missing",
        ),
        (RuntimeError("boom\nsecond line"), 1, "error: RuntimeError: boom second line"),
    ],
)
def test_any_exception_of_a_command_is_one_line(monkeypatch, tmp_path, exc, code, text):
    """An exception a command does not catch itself (here: unlock reading the lock file) is one line; a bug
    (not one of trakflow's errors) offers --debug; with --debug or TRAKFLOW_DEBUG=1 it propagates."""
    from trak_core.store import StoreLock

    def raise_(*a, **k):
        raise exc

    monkeypatch.setattr(StoreLock, "holder", raise_)
    res = invoke("unlock", tmp_path)
    assert res.exit_code == code, res.output
    assert error_lines(res.output) == [text], res.output
    assert ("--debug" in res.output) == (type(exc) is RuntimeError), res.output  # a bug offers the traceback
    assert invoke("--debug", "unlock", tmp_path).exception is exc
    assert invoke("unlock", tmp_path, env={"TRAKFLOW_DEBUG": "1"}).exception is exc


def test_validation_errors_outside_a_config():
    from pydantic import ValidationError

    from trak_core.store import StoreMetadata

    with pytest.raises(ValidationError) as ei:
        StoreMetadata.model_validate({"proj_dim": "many"})
    d = errors.describe(ei.value)
    assert d.code == 1 and d.expected
    assert "a store's trakflow metadata is malformed (root zarr.json, attribute 'trakflow'): proj_dim: " in d.lines[-1]
    with pytest.raises(ValidationError) as ei:
        from tasks.config import TrainConfig

        TrainConfig.model_validate({"epochs": -1, "nope": 1})
    d = errors.describe(RuntimeError("in a task"))
    assert not d.expected
    d = errors.describe(ei.value)
    assert d.code == 2 and all(ln.startswith("invalid TrainConfig: ") for ln in d.lines), d.lines
    assert any(ln.startswith("invalid TrainConfig: nope: Extra inputs are not permitted") for ln in d.lines)


def test_httpx_errors_name_the_api(monkeypatch):
    import httpx

    monkeypatch.setenv("PREFECT_API_URL", "http://10.0.0.9:4200/api")
    req = httpx.Request("GET", "http://10.0.0.9:4200/api/deployments/name/a/b")
    inner = OSError(111, "Connection refused")
    try:
        try:
            raise inner
        except OSError as e:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=req) from e
    except httpx.ConnectError as e:
        d = errors.describe(e)
    assert d.code == 1 and d.expected and len(d.lines) == 1
    assert d.lines[0].startswith("the Prefect API at http://10.0.0.9:4200/api cannot be reached (ConnectError")
    resp = httpx.Response(401, request=req)
    d = errors.describe(httpx.HTTPStatusError("401", request=req, response=resp))
    assert "401 Unauthorized" in d.lines[0] and "PREFECT_API_AUTH_STRING" in d.lines[0]


# ---------------------------------------------------------------------------------------------- trigger
def test_trigger_unreachable_server_is_one_line(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/api"
    res = trakflow("trigger", "attribute/digits", env=cli_env(tmp_path / "home", PREFECT_API_URL=url))
    assert res.returncode == 1, res.stdout + res.stderr
    no_dump(res.stderr)
    assert error_lines(res.stderr) == [
        f"error: the Prefect API at {url} cannot be reached (ConnectionRefusedError: [Errno 111] Connection "
        "refused): start the server (`prefect server start`) or set PREFECT_API_URL to one that answers"
    ], res.stderr


def test_trigger_without_a_server_fails_fast_and_starts_none(tmp_path, monkeypatch):
    """No PREFECT_API_URL and no local server: one line saying so; Prefect's ephemeral server (which
    would hold no deployment) is never started."""
    from prefect.server.api import server as prefect_server_api

    started = []
    monkeypatch.setattr(prefect_server_api.SubprocessASGIServer, "start", lambda self, *a, **k: started.append(1))
    port = free_port()
    for k in [k for k in os.environ if k.startswith("PREFECT_API_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("PREFECT_SERVER_API_PORT", str(port))
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        res = invoke("trigger", "attribute/digits")
    assert res.exit_code == 1, res.output
    assert error_lines(res.output) == [
        f"error: no Prefect server to trigger 'attribute/digits' on: PREFECT_API_URL is not set and no server "
        f"answers at http://127.0.0.1:{port}/api. Start one (`prefect server start`), serve the deployments on it "
        f"(`PREFECT_API_URL=http://127.0.0.1:{port}/api trakflow serve`), then trigger (or set PREFECT_API_URL to "
        "your server)"
    ], res.output
    assert started == []


def test_help_documents_debug():
    res = invoke("--help")
    assert res.exit_code == 0 and "--debug" in res.output and "TRAKFLOW_DEBUG" in res.output
