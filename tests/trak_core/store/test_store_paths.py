"""A store opened through a relative path (``s``, ``e``, ``ts``, ``./x``) works as one opened by its absolute
path: zarr's LocalStore must be given the absolute root, or keys such as ``models/`` lose their ``s/``."""

from __future__ import annotations

import os

import numpy as np
import pytest
from test_store_damage import config, run_steps, traker_run

from examples import tiny


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tiny.save_checkpoints(tmp_path_factory.mktemp("ck") / "ck", seeds=(0, 1))


@pytest.fixture(scope="module")
def absolute(ckpts, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("abs")
    return {
        "traker": traker_run(tmp / "t", ckpts),
        "pipeline": run_steps(config(tmp / "p", ckpts)),
    }


@pytest.mark.parametrize("rel", ["s", "e", "ts", "./x"])
def test_traker_in_a_relative_save_dir_gives_the_absolute_scores(rel, ckpts, absolute, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scores = traker_run(rel, ckpts)
    assert os.path.isdir(tmp_path / rel / "models" / "0" / "grads")
    np.testing.assert_array_equal(scores, absolute["traker"])


@pytest.mark.parametrize("rel", ["s", "ts"])
def test_pipeline_in_a_relative_store_gives_the_absolute_scores(rel, ckpts, absolute, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scores = run_steps(config(rel, ckpts))
    np.testing.assert_array_equal(scores, absolute["pipeline"])
