"""A store built from a folder of train files (``trakflow_demo_data.folder_data:train_folder``) records the folder;
a later route on the same config in a fresh process (no TRAKFLOW_TRAIN_DIR, the demo folder elsewhere: another
shell than the one that served the nightly deployment) reads the recorded folder instead of failing, and a folder
this process is told of explicitly still wins. In-process, no Prefect (the plan stage of ``trakflow run``)."""

from __future__ import annotations

import os

import pytest
from trak_fixtures import tiny_attribute_config

from examples import tiny
from tasks import core
from tasks.common import adopt_train_source, clear_data_cache
from tasks.config import AttributeConfig
from trak_core.errors import BadInputError, StoreMismatchError
from trak_core.store import TrakStore
from trakflow_demo_data import folder_data

ENV = folder_data.TRAIN_DIR_ENV


def test_a_fresh_process_reads_the_folder_the_store_recorded(tmp_path, monkeypatch):
    folder = tmp_path / "train"
    x, y = tiny.train_data()
    folder_data.save_part(folder, (x[:40], y[:40]), 0)
    folder_data.save_part(folder, (x[40:], y[40:]), 1)
    paths = tiny.save_checkpoints(tmp_path / "ck", seeds=(0,))
    cfg = AttributeConfig.model_validate(
        tiny_attribute_config(tmp_path / "store.zarr", paths, train_data="trakflow_demo_data.folder_data:train_folder")
    )
    monkeypatch.setenv("TRAKFLOW_DEMO_DIR", str(tmp_path / "no-demo"))  # its train folder holds nothing
    monkeypatch.setenv(ENV, str(folder))  # the nightly's process: told its folder
    clear_data_cache()
    plan = core.make_plan(cfg)
    assert TrakStore.open(cfg.store, mode="r").pipeline_info()["train_source"]["train_dir"] == str(folder)

    monkeypatch.delenv(ENV)  # a fresh process: nothing says where the train files are but the store
    clear_data_cache()
    with pytest.raises(BadInputError, match=f"set {ENV}"):  # the data callable alone cannot know
        folder_data.train_folder()
    assert core.make_plan(cfg) == plan  # trakflow run's plan check reads the recorded folder
    assert os.environ[ENV] == str(folder)

    other = tmp_path / "other"  # told another folder (other rows): that one is read, and the store refuses it
    folder_data.save_part(other, (x[:40], y[:40]), 0)
    monkeypatch.setenv(ENV, str(other))
    clear_data_cache()
    adopt_train_source(cfg)
    assert os.environ[ENV] == str(other)
    with pytest.raises((BadInputError, StoreMismatchError)):
        core.make_plan(cfg)

    monkeypatch.delenv(ENV)  # a config of other train data on the same store is not pointed at the folder
    clear_data_cache()
    adopt_train_source(cfg.model_copy(update={"train_data": "examples.tiny:train_data"}))
    assert ENV not in os.environ
