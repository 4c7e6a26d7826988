"""The nightly demo over a folder of train files appends a new file's rows: the next run featurizes only them,
solves the checkpoint again and refreshes the report, and one with nothing new featurizes nothing. After the
append, every route that reads the demo's store sees the same train data as the run that grew it: the demo
(``make demo``), ``trakflow run`` of the demo's attribute.yaml, ``trakflow show`` and ``trakflow query`` of it, and
the ``query/digits`` deployment's request, each in a fresh environment (no ``TRAKFLOW_TRAIN_DIR``), the queries
showing new rows with their own labels. In-process under the session's Prefect harness (the nightly's schedule
itself is run by a real server in test_real_services.py)"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from examples import digits, folder_data
from tasks.common import clear_data_cache
from trak_core.store import TrakStore
from trak_core.store.verify import verify_store

pytestmark = pytest.mark.usefixtures("prefect_harness")

NEW = 20  # rows the nightly run appends


def _fresh(monkeypatch, demo):
    """A new process's environment: the demo dir as the deployments name it, no train folder variable."""
    monkeypatch.delenv(folder_data.TRAIN_DIR_ENV, raising=False)
    monkeypatch.setenv("TRAKFLOW_DEMO_DIR", str(demo))
    clear_data_cache()


@pytest.mark.slow
def test_every_demo_route_works_after_a_nightly_append(tmp_path, monkeypatch):
    from deployments.serve import query_request
    from examples.digits import demo_configs
    from flows import digits_demo
    from flows.query import query
    from trakflow_cli.main import app

    demo = tmp_path / "demo"
    params = dict(demo_dir=str(demo), num_models=1, epochs=1, proj_dim=32, lambda_reg=1.0)
    _fresh(monkeypatch, demo)
    first = digits_demo(**params, train_folder=True)["attribute"]  # the nightly: seeds the folder
    assert first["plan"].train_set_size == digits.NUM_TRAIN  # the folder seeded with the digits train set
    report = demo / "report" / "digits_top_k.md"
    before = report.read_text()
    store = TrakStore.open(str(demo / "store.zarr"), mode="r")
    old_rows, old_scores = store.model(0).grads[:].copy(), store.scores("digits")[:].copy()
    x, y = digits.heldout_data()
    new_x, new_y = x[digits.NUM_TARGETS : digits.NUM_TARGETS + NEW], y[digits.NUM_TARGETS : digits.NUM_TARGETS + NEW]
    folder_data.save_part(demo / "train", (new_x, new_y), 1)
    _fresh(monkeypatch, demo)
    second = digits_demo(**params, train_folder=True)  # the next nightly: appends
    grown = second["attribute"]
    n = digits.NUM_TRAIN + NEW
    assert second["train"] is None  # the checkpoints were kept
    assert grown["plan"].train_set_size == n and grown["plan"].grown_from == digits.NUM_TRAIN
    assert grown["featurize"]["computed"] == 1 and grown["featurize"]["skipped"] == 3  # the new shard only
    assert grown["finalize"]["computed"] == 1
    store = TrakStore.open(str(demo / "store.zarr"), mode="r")
    assert store.pipeline_info()["train_source"]["train_dir"] == str((demo / "train").absolute())
    np.testing.assert_array_equal(store.model(0).grads[: digits.NUM_TRAIN], old_rows)
    scores = store.scores("digits")[:]
    assert scores.shape == (n, digits.NUM_TARGETS) and not np.array_equal(scores[: digits.NUM_TRAIN], old_scores)
    assert verify_store(store).ok
    assert report.read_text() != before  # the report was refreshed from the new scores

    _fresh(monkeypatch, demo)
    third = digits_demo(**params, train_folder=True)["attribute"]  # nothing new arrived: nothing featurized
    assert third["plan"].grown_from is None and third["featurize"]["computed"] == 0

    # make demo / trakflow demo: the demo without the nightly's flag reads the train folder the store grew from
    _fresh(monkeypatch, demo)
    again = digits_demo(**params)["attribute"]
    assert again["plan"].train_set_size == n and again["featurize"]["computed"] == 0

    # trakflow run / show / query of the demo's attribute.yaml, in a fresh environment
    yaml_path = demo / "attribute.yaml"
    queries = demo / "query.pt"
    torch.save((new_x[:3], new_y[:3]), queries)  # new rows as inputs: each is its own top proponent
    runner = CliRunner()
    for args in (["run", yaml_path], ["show", yaml_path, "--target", 0], ["query", yaml_path, "--inputs", queries]):
        _fresh(monkeypatch, demo)
        out = runner.invoke(app, [str(a) for a in args])
        assert out.exit_code == 0, (args, out.output)
        if args[0] == "query":  # new rows among the proponents, each with its own label
            shown = {int(i): int(lab) for i, lab in re.findall(r"#(\d+) y=(\d+)", out.output)}
            new = {i: lab for i, lab in shown.items() if i >= digits.NUM_TRAIN}
            assert new and all(lab == int(new_y[i - digits.NUM_TRAIN]) for i, lab in new.items()), out.output

    # the query/digits deployment's request (the store's recorded train data), top-k holding new rows
    _fresh(monkeypatch, demo)
    _, attr = demo_configs(demo)
    request = {**query_request(attr), "inputs": str(queries), "report_dir": None}
    answer = query(request)
    entries = [e for r in answer["rows"] for e in r["proponents"] + r["opponents"]]
    new = [e for e in entries if e["index"] >= digits.NUM_TRAIN]
    assert new and all(e["label"] == int(new_y[e["index"] - digits.NUM_TRAIN]) for e in new)
    assert all(e["label"] == int(digits.train_data()[1][e["index"]]) for e in entries if e not in new)
