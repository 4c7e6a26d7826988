"""Usage mistakes and unclear cases of the ``trakflow`` commands: each is one ``error:`` line naming the cause, exit 2
for bad input (an unknown option or command, a missing or extra argument, ``--top-k`` beyond the store's rows, a
file given as a store) and 1 otherwise (a triggered run that nothing starts); ``trigger --wait`` prints a run's
parameter errors whole; ``trigger query/... --inputs FILE`` (or ``--config``) sets a query run's inputs; int32 labels
in an ``.npz`` give ``trakflow query`` the int64 answers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from examples import tiny
from trakflow_cli.main import app

ENV = {"COLUMNS": "200", "NO_COLOR": "1", "TRAKFLOW_DEBUG": ""}
runner = CliRunner()


def invoke(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env={**ENV, **(env or {})})


def error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("error:")]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A TRAKer store of examples.tiny (64 rows, one checkpoint, experiment 'e'), its checkpoint file and inputs."""
    from trak_core import TRAKer

    tmp = tmp_path_factory.mktemp("usage")
    x, y = tiny.train_data()
    xt, yt = tiny.target_data()
    loc = str(tmp / "store.zarr")
    state = tiny.make_model().state_dict()
    tr = TRAKer(tiny.make_model(), "image_classification", tiny.NUM_TRAIN, save_dir=loc, device="cpu", proj_dim=8)
    tr.load_checkpoint(state, 0)
    tr.featurize((x, y), num_samples=tiny.NUM_TRAIN)
    tr.finalize_features()
    tr.start_scoring_checkpoint("e", state, 0, tiny.NUM_TARGETS)
    tr.score((xt, yt), num_samples=tiny.NUM_TARGETS)
    tr.finalize_scores("e")
    torch.save(state, tmp / "model_0.pt")
    torch.save((xt, yt), tmp / "new.pt")
    return tmp, loc


# ---------------------------------------------------------------------------------------------- usage
@pytest.mark.parametrize(
    "args, line",
    [
        (["show", "--nope", "s.zarr"], "error: trakflow show: No such option: --nope"),
        (["shwo", "s.zarr"], "error: trakflow: No such command 'shwo'. Did you mean 'show'?"),
        (["--nope", "show"], "error: trakflow: No such option: --nope"),
        (["show"], "error: trakflow show: Missing argument 'store'."),
        (
            ["query", "s.zarr", "--inputs", "x.pt", "--checkpoint", "a.pt", "b.pt", "c.pt"],
            "error: trakflow query: Got unexpected extra argument(s) (b.pt c.pt) (an option taking several values "
            "is repeated: --checkpoint A --checkpoint B)",
        ),
    ],
    ids=["unknown-option", "misspelt-command", "root-option", "missing-argument", "checkpoint-list"],
)
def test_usage_mistakes_are_one_line_exit_2(args, line):
    res = invoke(*args)
    assert res.exit_code == 2, res.output
    lines = error_lines(res.output)
    assert len(lines) == 1 and lines[0].startswith(line) and lines[0].endswith("--help`)"), res.output
    assert "unexpected error" not in res.output and "╭" not in res.output, res.output


def test_show_top_k_zero_is_a_plain_message(store):
    res = invoke("show", store[1], "--target", 0, "--top-k", 0)
    assert res.exit_code == 2, res.output
    assert error_lines(res.output) == [
        "error: trakflow show: Invalid value for '--top-k': Input should be greater than or equal to 1 "
        "(see `trakflow show --help`)"
    ], res.output
    assert "constrained" not in res.output


def test_show_and_query_refuse_k_beyond_the_rows_alike(store):
    tmp, loc = store
    res = invoke("show", loc, "--target", 0, "--top-k", 99999)
    assert res.exit_code == 2, res.output
    assert error_lines(res.output) == ["error: --top-k 99999: must be an integer from 1 to the store's 64 train rows"]
    assert "checkpoints" not in res.output  # refused before the tables
    model = ("--model", "examples.tiny:make_model", "--checkpoint", tmp / "model_0.pt")
    q = invoke("query", loc, "--inputs", tmp / "new.pt", *model, "--k", 99999)
    assert q.exit_code == 2, q.output
    assert error_lines(q.output) == ["error: k=99999: must be an integer from 1 to the store's 64 train rows"]
    assert invoke("show", loc, "--target", 0, "--top-k", 64).exit_code == 0  # all rows: accepted


def test_verify_a_file_is_one_line(tmp_path):
    f = tmp_path / "README.md"
    f.write_text("# not a store\n")
    for cmd in ("verify", "show"):
        res = invoke(cmd, f)
        assert res.exit_code == 2, res.output
        assert error_lines(res.output) == [f"error: store: {f} is a file, not a trakflow store (a store is a folder)"]


def test_query_inputs_error_names_its_field_once(store, tmp_path):
    res = invoke("query", store[1], "--inputs", tmp_path / "nope.pt", "--model", "examples.tiny:make_model")
    assert res.exit_code == 2, res.output
    assert error_lines(res.output) == [f"error: inputs: '{tmp_path / 'nope.pt'}' is not a file"], res.output


def test_query_npz_int32_labels_give_the_int64_answer(store, tmp_path):
    tmp, loc = store
    x, y = tiny.target_data()
    answers = []
    for dt in (np.int64, np.int32):
        np.savez(tmp_path / f"new_{dt.__name__}.npz", x.numpy(), y.numpy().astype(dt))
        res = invoke(
            "query", loc, "--inputs", tmp_path / f"new_{dt.__name__}.npz", "--model", "examples.tiny:make_model",
            "--checkpoint", tmp / "model_0.pt", "--k", 3, "--json",
        )  # fmt: skip
        assert res.exit_code == 0, res.output
        answers.append(json.loads(res.output)["rows"])
    assert answers[0] == answers[1]
    assert [r["label"] for r in answers[1]] == y.tolist()


# ---------------------------------------------------------------------------------------------- trigger
def test_trigger_wait_shows_the_whole_parameter_error():
    """A run refused by its flow's parameter validation: every field on the line, each named once, exit 2."""
    from prefect.states import exception_to_failed_state

    from flows.query import query
    from trakflow_cli.prefect_api import failure_line, is_parameter_failure

    with pytest.raises(Exception) as e:
        query.validate_parameters({"request": {"store": "s.zarr", "inputs": "/nope/q.pt", "k": 0}})
    state = asyncio.run(exception_to_failed_state(e.value, message="Validation of flow parameters failed with error:"))
    assert "\n" in state.message  # Prefect's message: the causes on the lines after the first
    assert is_parameter_failure(state)
    assert failure_line(state) == (
        "invalid flow parameters: request.inputs: '/nope/q.pt' is not a file; "
        "request.k: Input should be greater than or equal to 1"
    )


@pytest.mark.usefixtures("prefect_harness")
def test_trigger_wait_with_nothing_serving_says_so(tmp_path):
    """Nothing serves the deployment: --wait says what it waits for, then gives up after --start-timeout with one
    line (exit 1); the run stays scheduled."""
    from deployments.serve import build_deployments

    dep = next(d for d in build_deployments(str(tmp_path / "demo")) if d.flow_name == "train")
    dep.apply()
    res = invoke("trigger", "train/digits", "--wait", "--start-timeout", 0)
    assert res.exit_code == 1, res.output
    assert "waiting for a process serving 'train/digits'" in res.output
    lines = error_lines(res.output)
    assert len(lines) == 1 and "of 'train/digits' was not started within 0 s: no process serves" in lines[0], lines
    assert "The run stays scheduled" in lines[0]


@pytest.mark.usefixtures("prefect_harness")
def test_trigger_query_inputs_and_config(tmp_path, monkeypatch):
    """`trigger query/digits --inputs FILE` sends the deployment's request with that file (absolute, validated
    here); --config takes a whole QueryConfig; a missing file is refused before anything is sent."""
    from prefect.client.orchestration import get_client

    from deployments.serve import build_deployments

    dep = next(d for d in build_deployments(str(tmp_path / "demo")) if d.flow_name == "query")
    dep.apply()
    monkeypatch.chdir(tmp_path)
    torch.save(tiny.target_data(), tmp_path / "mine.pt")

    def parameters(output: str) -> dict:
        run_id = output.split("(", 1)[1].split(")", 1)[0]

        async def read():
            async with get_client() as client:
                return await client.read_flow_run(run_id)

        return asyncio.run(read()).parameters

    res = invoke("trigger", "query/digits", "--inputs", "mine.pt")
    assert res.exit_code == 0, res.output
    req = parameters(res.output)["request"]
    assert req["inputs"] == str(tmp_path / "mine.pt")
    assert req["model"] == dep.parameters["request"]["model"] and req["k"] == 5  # the rest is the deployment's

    cfg = tmp_path / "q.yaml"
    cfg.write_text(yaml.safe_dump({"store": "s.zarr", "inputs": str(tmp_path / "mine.pt"), "k": 2}))
    res = invoke("trigger", "query/digits", "--config", cfg)
    assert res.exit_code == 0, res.output
    assert parameters(res.output)["request"] == {"store": "s.zarr", "inputs": str(tmp_path / "mine.pt"), "k": 2}

    res = invoke("trigger", "query/digits", "--inputs", "gone.pt")
    assert res.exit_code == 2, res.output
    assert error_lines(res.output) == [
        f"error: --inputs FILE: the query's request: inputs: '{Path(tmp_path / 'gone.pt')}' is not a file"
    ]
    res = invoke("trigger", "train/digits", "--inputs", "mine.pt")
    assert res.exit_code == 2 and "only query deployments take an inputs file" in res.output, res.output
