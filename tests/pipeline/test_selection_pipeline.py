"""Data selection on a pipeline-built store (the attribute flow on examples.tiny): the summed influence equals the
sum of the stored scores' columns, and the places users ask — ``trakflow select``, the ``select`` flow and its
artifact, the deployment form — write the selected indices, scores and rows."""

from __future__ import annotations

import asyncio
import csv
import json
import re

import numpy as np
import pytest
import torch
import yaml
from trak_fixtures import REPO_ROOT, tiny_attribute_config
from typer.testing import CliRunner

from examples import tiny
from tasks.config import AttributeConfig
from tasks.selection import SelectConfig, run_select
from trak_core import TrakIndex
from trak_core.scoring.selection import select
from trak_core.store import TrakStore

pytestmark = pytest.mark.usefixtures("prefect_harness")


def ranked(col: np.ndarray, opponents: bool = False) -> np.ndarray:
    rows = np.arange(col.shape[0])
    return np.lexsort((rows, col if opponents else -col))


@pytest.fixture(scope="module")
def attributed(tmp_path_factory):
    """An attribute run on 2 checkpoints, its config as YAML, its stored scores' row sums and an inputs file (the
    targets it scored)."""
    from flows import attribute

    tmp = tmp_path_factory.mktemp("sel")
    tiny.save_checkpoints(tmp / "ck", seeds=(0, 1))
    raw = tiny_attribute_config(tmp / "store.zarr", str(tmp / "ck" / "model_*.pt"))
    cfg = AttributeConfig.model_validate(raw)
    attribute(cfg)
    (tmp / "attr.yaml").write_text(yaml.safe_dump(raw))
    torch.save(tiny.target_data(), tmp / "val.pt")
    scores = TrakStore.open(cfg.store, mode="r").scores("tiny")[:]
    return tmp, cfg, scores.astype(np.float64).sum(axis=1)


def test_summed_influence_equals_the_stored_scores_summed(attributed):
    _, cfg, summed = attributed
    sel = select(TrakIndex.from_config(cfg), tiny.target_data(), fraction=0.25)
    scale = np.abs(summed).max()
    assert np.abs(sel.row_scores - summed).max() <= 1e-4 * scale  # float32 rounding
    assert sel.k == 16 == round(0.25 * summed.shape[0])
    np.testing.assert_array_equal(sel.indices, ranked(summed)[:16])
    low = select(TrakIndex.from_config(cfg), tiny.target_data(), k=5, opponents=True)
    np.testing.assert_array_equal(low.indices, ranked(summed, True)[:5])


def test_run_select_writes_indices_scores_and_rows(attributed, tmp_path):
    tmp, cfg, summed = attributed
    out = run_select(SelectConfig(store=str(tmp / "attr.yaml"), inputs=str(tmp / "val.pt"), k=6, out_dir=str(tmp_path)))
    want = ranked(summed)[:6]
    assert [r["index"] for r in out["rows"]] == want.tolist() and out["k"] == 6 and out["num_targets"] == 8
    idx = np.load(tmp_path / "selected_indices.npy")
    np.testing.assert_array_equal(idx, want)
    scores = np.load(tmp_path / "selected_scores.npy")
    row_scores = np.load(tmp_path / "summed_influence.npy")
    assert row_scores.shape == summed.shape and scores.dtype == np.float32
    np.testing.assert_array_equal(scores, row_scores[want])
    x, y = tiny.train_data()
    sx, sy = torch.load(tmp_path / "selected_rows.pt", weights_only=True)
    assert torch.equal(sx, x[want]) and torch.equal(sy, y[want])
    with open(tmp_path / "selection.csv") as fh:
        table = list(csv.DictReader(fh))
    assert [int(r["index"]) for r in table] == want.tolist()
    assert [int(r["label"]) for r in table] == y[want].tolist()
    assert [float(r["score"]) for r in table] == scores.tolist()  # written in full precision
    doc = json.loads((tmp_path / "selection.json").read_text())
    assert doc["k"] == 6 and doc["n"] == 64 and doc["model_ids"] == [0, 1] and doc["store"] == cfg.store
    assert sorted(doc["files"]) == sorted(out["files"])
    # the same folder again, without train data: no rows file of the earlier selection is left behind
    out = run_select(SelectConfig(store=cfg.store, inputs=str(tmp / "val.pt"), k=3, out_dir=str(tmp_path),
                                  model="examples.tiny:make_model"))  # fmt: skip
    assert not (tmp_path / "selected_rows.pt").exists() and np.load(tmp_path / "selected_indices.npy").shape == (3,)


# ---------------------------------------------------------------------------- trakflow select
def cli(*args):
    from trakflow_cli.main import app

    return CliRunner().invoke(app, ["select", *map(str, args)])


def test_cli_table_json_and_files(attributed, tmp_path):
    tmp, cfg, summed = attributed
    out = cli(tmp / "attr.yaml", "--inputs", tmp / "val.pt", "--fraction", 0.1, "--out", tmp_path / "a")
    assert out.exit_code == 0, out.output
    want = ranked(summed)[:6]  # round(0.1 · 64)
    assert "6 of 64 train rows" in out.output and f"#{int(want[0])} y=" in out.output
    np.testing.assert_array_equal(np.load(tmp_path / "a" / "selected_indices.npy"), want)
    # a store (not a config) with the model's import path; .npz targets; no train data: no rows file
    x, y = tiny.target_data()
    np.savez(tmp_path / "val.npz", x.numpy(), y.numpy())
    js = cli(cfg.store, "--inputs", tmp_path / "val.npz", "--k", 4, "--opponents", "--out", tmp_path / "b",
             "--model", "examples.tiny:make_model", "--json")  # fmt: skip
    assert js.exit_code == 0, js.output
    ans = json.loads(js.output)
    assert [r["index"] for r in ans["rows"]] == ranked(summed, True)[:4].tolist() and ans["opponents"] is True
    assert not (tmp_path / "b" / "selected_rows.pt").exists() and (tmp_path / "b" / "selection.csv").is_file()


@pytest.mark.parametrize(
    "args, match",
    [
        ([], "fraction: give exactly one of fraction and k"),
        (["--fraction", 0.1, "--k", 3], "fraction: give exactly one of fraction and k"),
        (["--fraction", 1.5], "fraction: Input should be less than or equal to 1"),
        (["--fraction", 0], "fraction: Input should be greater than 0"),
        (["--fraction", 0.001], "fraction=0.001 of the store's 64 train rows selects no row"),
        (["--k", 65], "k=65: must be an integer from 1 to the store's 64 train rows"),
        (["--k", 3, "--inputs-file", "bad.txt"], "inputs: .* must be a .pt, .pth or .npz file"),
        (["--k", 3, "--inputs-file", "wide.pt"], r"query batch of shapes \[\(8, 5\), \(8,\)\]: the model cannot"),
        (["--k", 3, "--out-file"], "out_dir: .* exists and is not a folder"),
        (["--k", 3, "--store-only"], "model: querying the store .* needs the model's import path"),
        (["--k", 3, "--train-data", "examples.tiny:target_data"], "train_data: 8 rows, but the store .* has 64"),
    ],
)
def test_cli_bad_input_one_line_before_any_file(attributed, tmp_path, args, match):
    tmp, cfg, _ = attributed
    x, y = tiny.target_data()
    (tmp_path / "bad.txt").write_text("x")
    (tmp_path / "file").write_text("x")
    torch.save((x[:, :5], y), tmp_path / "wide.pt")
    target, inputs, out_dir, extra = tmp / "attr.yaml", tmp / "val.pt", tmp_path / "out", []
    it = iter(args)
    for a in it:
        if a == "--inputs-file":
            inputs = tmp_path / next(it)
        elif a == "--store-only":
            target = cfg.store
        elif a == "--out-file":
            out_dir = tmp_path / "file"
        else:
            extra += [a, next(it)]
    out = cli(target, "--inputs", inputs, "--out", out_dir, *extra)
    assert out.exit_code == 2, out.output
    lines = [ln for ln in out.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.output
    assert re.search(match, lines[0]), lines[0]
    assert not (tmp_path / "out").exists()  # nothing written


# ---------------------------------------------------------------------------- the flow and its deployment
def test_select_flow_writes_files_and_a_table_artifact(attributed, tmp_path):
    from prefect.client.orchestration import get_client

    from flows.selection import select as select_flow
    from tasks.report import store_artifact_key

    tmp, cfg, summed = attributed
    req = {"store": str(tmp / "attr.yaml"), "inputs": str(tmp / "val.pt"), "fraction": 0.25, "out_dir": str(tmp_path)}
    out = select_flow(req)
    want = ranked(summed)[:16]
    assert [r["index"] for r in out["rows"]] == want.tolist()
    np.testing.assert_array_equal(np.load(tmp_path / "selected_indices.npy"), want)

    async def read():
        async with get_client() as client:
            return await client.read_latest_artifacts()

    key = store_artifact_key(cfg.store, "select", "val")
    arts = {a.key: a for a in asyncio.run(read())}
    assert arts[key].type == "table"
    table = json.loads(arts[key].data) if isinstance(arts[key].data, str) else arts[key].data
    assert [r["index"] for r in table] == want.tolist() and table[0]["rank"] == 1
    assert table[0]["label"] == int(tiny.train_data()[1][want[0]])


def test_select_flow_refuses_bad_request_before_compute(attributed, tmp_path):
    from prefect.exceptions import ParameterTypeError

    from flows.selection import select as select_flow

    tmp, _, _ = attributed
    with pytest.raises(ParameterTypeError, match="give exactly one of fraction and k"):
        select_flow({"store": str(tmp / "attr.yaml"), "inputs": str(tmp / "val.pt"), "out_dir": str(tmp_path)})


def test_select_deployment_form_is_a_valid_request(tmp_path):
    from deployments.serve import build_deployments

    dep = next(d for d in build_deployments(str(tmp_path)) if d.flow_name == "select")
    req = dep.parameters["request"]
    assert set(req) <= set(SelectConfig.model_fields)
    torch.save(tiny.target_data(), req["inputs"])
    assert SelectConfig.model_validate(req).fraction == 0.1
    spec = yaml.safe_load((REPO_ROOT / "deployments" / "prefect.yaml").read_text())
    (entry,) = [d for d in spec["deployments"] if d["entrypoint"] == "flows/selection.py:select"]
    assert set(entry["parameters"]["request"]) <= set(SelectConfig.model_fields)
