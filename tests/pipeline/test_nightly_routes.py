"""The nightly demo over a folder of train files appends a new file's rows: the next run featurizes only them,
solves the checkpoint again and refreshes the report; the demo (``make demo``, without the nightly's flag) then reads
the train folder the store grew from, with nothing new to append or featurize. In-process under the
session's Prefect harness (the nightly's schedule itself is run by a real server in test_nightly_real_server.py).
The routes that read the grown store (``trakflow run``, ``show`` and ``query`` of the demo's attribute.yaml and the
``query/digits`` deployment's request, new rows shown with their own labels) are asserted in fresh processes
against a real server, after a served nightly append, in test_nightly_real_server.py."""

from __future__ import annotations

import numpy as np
import pytest

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
def test_nightly_appends_then_the_demo_reads_the_grown_folder(tmp_path, monkeypatch):
    from flows import digits_demo

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

    # make demo / trakflow demo: the demo without the nightly's flag reads the train folder the store grew from;
    # nothing new arrived since the append, so nothing is appended or featurized. (A nightly run now would be this
    # same run: digits_demo reads the folder when the flag is set or the folder holds files, and the flag does
    # nothing else.)
    _fresh(monkeypatch, demo)
    again = digits_demo(**params)["attribute"]
    assert again["plan"].train_set_size == n and again["plan"].grown_from is None
    assert again["featurize"]["computed"] == 0
