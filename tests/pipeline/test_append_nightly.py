"""The nightly demo over a folder of train files: a new file is appended to the store, and the next run
featurizes only its rows, solves each checkpoint again and refreshes the report (in-process, under the session's
Prefect harness; test_real_services.py runs it from a real server's schedule)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trak_core.errors import BadInputError
from trak_core.store import TrakStore
from trak_core.store.verify import verify_store
from trakflow_demo_data import digits, folder_data


def test_load_folder_concatenates_sorted_files(tmp_path):
    a = (torch.arange(6.0).reshape(3, 2), torch.tensor([0, 1, 2]))
    b = (torch.arange(6.0, 10.0).reshape(2, 2), torch.tensor([3, 4]))
    np.savez(tmp_path / "part_001.npz", b[0].numpy(), b[1].numpy())
    folder_data.save_part(tmp_path, a, 0)
    (tmp_path / "notes.txt").write_text("not data")
    x, y = folder_data.load_folder(tmp_path)
    torch.testing.assert_close(x, torch.cat([a[0], b[0]]))
    torch.testing.assert_close(y, torch.cat([a[1], b[1]]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInputError, match="no .pt or .npz files"):
        folder_data.load_folder(tmp_path / "empty")


@pytest.mark.usefixtures("prefect_harness")
def test_nightly_demo_appends_new_train_files(tmp_path, monkeypatch):
    from flows import digits_demo

    monkeypatch.delenv(folder_data.TRAIN_DIR_ENV, raising=False)
    demo = tmp_path / "demo"
    params = dict(demo_dir=str(demo), num_models=1, epochs=1, proj_dim=64, lambda_reg=1.0, train_folder=True)
    first = digits_demo(**params)["attribute"]
    assert first["plan"].train_set_size == digits.NUM_TRAIN  # the folder seeded with the digits train set
    report = demo / "report" / "digits_top_k.md"
    before = report.read_text()
    store = TrakStore.open(str(demo / "store.zarr"), mode="r")
    old_rows = store.model(0).grads[:].copy()
    old_scores = store.scores("digits")[:].copy()

    x, y = digits.heldout_data()
    folder_data.save_part(demo / "train", (x[digits.NUM_TARGETS :], y[digits.NUM_TARGETS :]), 1)  # new rows
    n = digits.NUM_TRAIN + len(y) - digits.NUM_TARGETS
    second = digits_demo(**params)
    out = second["attribute"]
    assert second["train"] is None  # the checkpoints were kept
    assert out["plan"].grown_from == digits.NUM_TRAIN and out["plan"].train_set_size == n
    assert out["featurize"]["computed"] == 1 and out["featurize"]["skipped"] == 3  # the new shard only
    assert out["finalize"]["computed"] == 1
    grown = TrakStore.open(str(demo / "store.zarr"), mode="r")
    np.testing.assert_array_equal(grown.model(0).grads[: digits.NUM_TRAIN], old_rows)
    scores = grown.scores("digits")[:]
    assert scores.shape == (n, digits.NUM_TARGETS) and not np.array_equal(scores[: digits.NUM_TRAIN], old_scores)
    assert verify_store(grown).ok
    assert report.read_text() != before  # the report was refreshed from the new scores

    third = digits_demo(**params)["attribute"]  # nothing new arrived: nothing featurized
    assert third["plan"].grown_from is None and third["featurize"]["computed"] == 0
