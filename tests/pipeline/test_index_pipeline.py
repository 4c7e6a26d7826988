"""TrakIndex on a pipeline-built store (the attribute flow on examples.tiny): top-k equal to the stored scores',
checkpoint fingerprints, and the places users ask — ``trakflow query``, the ``query`` flow, the report."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from trak_fixtures import REPO_ROOT, tiny_attribute_config
from typer.testing import CliRunner

from examples import tiny
from tasks.config import AttributeConfig
from trak_core import TrakIndex
from trak_core.errors import StoreMismatchError
from trak_core.store import TrakStore

pytestmark = pytest.mark.usefixtures("prefect_harness")

K = 5


def ranked(scores: np.ndarray, opponents: bool = False) -> np.ndarray:
    rows = np.arange(scores.shape[0])
    return np.stack([np.lexsort((rows, scores[:, j] if opponents else -scores[:, j])) for j in range(scores.shape[1])])


@pytest.fixture(scope="module")
def attributed(tmp_path_factory):
    """An attribute run on 2 checkpoints, its config as YAML, its stored scores and an inputs file (the targets)."""
    from flows import attribute

    tmp = tmp_path_factory.mktemp("q")
    tiny.save_checkpoints(tmp / "ck", seeds=(0, 1))
    raw = tiny_attribute_config(tmp / "store.zarr", str(tmp / "ck" / "model_*.pt"), show="examples.tiny:as_image")
    cfg = AttributeConfig.model_validate(raw)
    attribute(cfg)
    (tmp / "attr.yaml").write_text(yaml.safe_dump(raw))
    torch.save(tiny.target_data(), tmp / "new.pt")
    scores = TrakStore.open(cfg.store, mode="r").scores("tiny")[:]
    return tmp, cfg, scores


def test_from_config_equals_the_stored_scores(attributed):
    tmp, cfg, scores = attributed
    index = TrakIndex.from_config(cfg)
    top, low = index.query_both(tiny.target_data(), K)
    for res, opp in ((top, False), (low, True)):
        want = ranked(scores, opp)[:, :K]
        np.testing.assert_array_equal(res.indices, want)
        np.testing.assert_array_equal(res.scores, np.take_along_axis(scores.T, want, 1))
    again = index.query(tiny.target_data(), k=K, opponents=True)
    np.testing.assert_array_equal(again.indices, low.indices)
    np.testing.assert_array_equal(again.scores, low.scores)


def test_from_config_file(attributed):
    import tasks.query  # noqa: F401  (registers the pipeline's config reader)

    tmp, _, scores = attributed
    res = TrakIndex.from_config(str(tmp / "attr.yaml")).query(tiny.target_data(), k=2)
    np.testing.assert_array_equal(res.indices, ranked(scores)[:, :2])


def test_checkpoint_that_is_not_the_stores_is_refused(attributed):
    tmp, cfg, _ = attributed
    other = tiny.save_checkpoints(tmp / "other", seeds=(7,))[0]
    paths = cfg.checkpoint_paths
    refused = r"checkpoints\[1\]: .*model_007.pt is not the checkpoint model_id=1"
    with pytest.raises(StoreMismatchError, match=refused) as e:
        TrakIndex.from_config(cfg, checkpoints=[paths[0], other])
    assert "\n" not in str(e.value)
    wrong = torch.load(other, weights_only=True)
    with pytest.raises(StoreMismatchError, match=r"checkpoints\[0\]: the state dict is not the checkpoint model_id=0"):
        TrakIndex.from_config(cfg, checkpoints=[wrong, paths[1]])
    same = [torch.load(p, weights_only=True) for p in paths]  # the recorded files' contents: accepted
    assert TrakIndex.from_config(cfg, checkpoints=same).query(tiny.target_data(), k=1).indices.shape == (8, 1)


# ---------------------------------------------------------------------------- trakflow query
def cli(*args):
    from trakflow_cli.main import app

    return CliRunner().invoke(app, ["query", *map(str, args)])


def test_cli_table_and_json(attributed):
    tmp, cfg, scores = attributed
    out = cli(tmp / "attr.yaml", "--inputs", tmp / "new.pt", "--k", K)
    assert out.exit_code == 0, out.output
    assert "input 7, label" in out.output and "proponent" in out.output
    top = int(ranked(scores)[0, 0])
    assert f"#{top} y=" in out.output
    js = cli(tmp / "attr.yaml", "--inputs", tmp / "new.pt", "--k", K, "--json")
    assert js.exit_code == 0, js.output
    ans = json.loads(js.output)
    assert [[e["index"] for e in r["proponents"]] for r in ans["rows"]] == ranked(scores)[:, :K].tolist()
    assert [[e["index"] for e in r["opponents"]] for r in ans["rows"]] == ranked(scores, True)[:, :K].tolist()
    assert ans["model_ids"] == [0, 1] and ans["rows"][0]["label"] == int(tiny.target_data()[1][0])


def test_cli_store_with_model_and_npz_inputs(attributed, tmp_path):
    """A store (not a config): the model's import path, the checkpoints from the store's records; .npz inputs."""
    tmp, cfg, scores = attributed
    x, y = tiny.target_data()
    np.savez(tmp_path / "new.npz", x.numpy(), y.numpy())
    out = cli(cfg.store, "--inputs", tmp_path / "new.npz", "--k", 3, "--model", "examples.tiny:make_model", "--json")
    assert out.exit_code == 0, out.output
    ans = json.loads(out.output)
    assert [[e["index"] for e in r["proponents"]] for r in ans["rows"]] == ranked(scores)[:, :3].tolist()


@pytest.mark.parametrize(
    "args, match",
    [
        (["--k", 65], "k=65: must be an integer from 1 to the store's 64 train rows"),
        (["--k", 0], "k: Input should be greater than or equal to 1"),
        (["--inputs-file", "bad.txt"], "inputs: .* must be a .pt, .pth or .npz file"),
        (["--inputs-file", "wide.pt"], r"query batch of shapes \[\(8, 5\), \(8,\)\]: the model cannot take it"),
        (["--inputs-file", "double.pt"], "query batch: tensor 0 is torch.float64 but the model's parameters"),
        (["--inputs-file", "ragged.pt"], "inputs: the tensors in .* need one number of rows"),
        (["--store-only"], "model: querying the store .* needs the model's import path"),
    ],
)
def test_cli_bad_input_one_line(attributed, tmp_path, args, match):
    import re

    tmp, cfg, _ = attributed
    x, y = tiny.target_data()
    (tmp_path / "bad.txt").write_text("x")
    torch.save((x[:, :5], y), tmp_path / "wide.pt")
    torch.save((x.double(), y), tmp_path / "double.pt")
    torch.save((x, y[:3]), tmp_path / "ragged.pt")
    target, inputs, extra = tmp / "attr.yaml", tmp / "new.pt", []
    for a, b in zip(args[::2], [*args[1::2], None][: len(args[::2])], strict=True):
        if a == "--inputs-file":
            inputs = tmp_path / b
        elif a == "--store-only":
            target = cfg.store
        else:
            extra += [a, b]
    out = cli(target, "--inputs", inputs, *extra)
    assert out.exit_code == 2, out.output
    lines = [ln for ln in out.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.output
    assert re.search(match, lines[0]), lines[0]


# ---------------------------------------------------------------------------- the flow and the report
def test_query_flow_writes_table_and_images(attributed, tmp_path):
    from prefect.client.orchestration import get_client

    from flows.query import query
    from tasks.report import store_artifact_key

    tmp, cfg, scores = attributed
    out = query({"store": str(tmp / "attr.yaml"), "inputs": str(tmp / "new.pt"), "k": 3, "report_dir": str(tmp_path)})
    assert [[e["index"] for e in r["proponents"]] for r in out["rows"]] == ranked(scores)[:, :3].tolist()
    names = sorted(Path(f).name for f in out["files"])
    assert names == [f"new_input_{j}.png" for j in range(8)] + ["new_query.md"]
    md = (tmp_path / "new_query.md").read_text()
    assert "| input | label |" in md and f"#{int(ranked(scores)[0, 0])}" in md
    assert (tmp_path / "new_input_0.png").read_bytes()[:4] == b"\x89PNG"

    async def read(key):
        async with get_client() as client:
            return await client.read_latest_artifacts()

    key = store_artifact_key(cfg.store, "query", "new")
    arts = {a.key: a for a in asyncio.run(read(key))}
    assert arts[key].type == "table"
    table = json.loads(arts[key].data) if isinstance(arts[key].data, str) else arts[key].data
    assert len(table) == 8 * 3 and table[0]["proponent"] == int(ranked(scores)[0, 0])
    assert arts[f"{key}-input-0"].type == "markdown"


def test_query_flow_refuses_bad_request_before_compute(attributed):
    from prefect.exceptions import ParameterTypeError

    from flows.query import query

    tmp, _, _ = attributed
    with pytest.raises(ParameterTypeError, match=r"request.inputs: .*missing.pt' is not a file"):
        query({"store": str(tmp / "attr.yaml"), "inputs": str(tmp / "missing.pt")})


def test_query_deployment_form_is_a_valid_request(tmp_path):
    """serve.py's query/digits form names only QueryConfig's fields, and a run of it validates once the inputs
    file is there."""
    from deployments.serve import build_deployments
    from tasks.query import QueryConfig

    dep = next(d for d in build_deployments(str(tmp_path)) if d.flow_name == "query")
    req = dep.parameters["request"]
    assert set(req) <= set(QueryConfig.model_fields)
    torch.save(tiny.target_data(), req["inputs"])
    assert QueryConfig.model_validate(req).k == 5
    spec = yaml.safe_load((REPO_ROOT / "deployments" / "prefect.yaml").read_text())
    (entry,) = [d for d in spec["deployments"] if d["entrypoint"] == "flows/query.py:query"]
    assert set(entry["parameters"]["request"]) <= set(QueryConfig.model_fields)
