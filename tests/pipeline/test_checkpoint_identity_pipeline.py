"""TrakIndex on a pipeline-written store checks checkpoints by the same content record as on a TRAKer-written
one: swapped order (files or state dicts), another seed's state dict and swapped files are refused naming the
model id; the recorded files' contents, as files or as state dicts, are accepted. The pipeline's record holds
the same content digest TRAKer records."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from trak_fixtures import tiny_attribute_config

from examples import tiny
from tasks.config import AttributeConfig
from trak_core import TrakIndex
from trak_core.checkpoints import state_digest
from trak_core.errors import StoreMismatchError
from trak_core.store import TrakStore

pytestmark = pytest.mark.usefixtures("prefect_harness")


@pytest.fixture(scope="module")
def attributed(tmp_path_factory):
    from flows import attribute

    tmp = tmp_path_factory.mktemp("ident")
    tiny.save_checkpoints(tmp / "ck", seeds=(0, 1))
    cfg = AttributeConfig.model_validate(tiny_attribute_config(tmp / "store.zarr", str(tmp / "ck" / "model_*.pt")))
    attribute(cfg)
    return tmp, cfg


def test_pipeline_records_the_state_digest(attributed):
    _, cfg = attributed
    store = TrakStore.open(cfg.store, mode="r")
    for mid, path in enumerate(cfg.checkpoint_paths):
        rec = store.checkpoint_record(mid)
        assert rec["path"] == path and rec["state_sha256"] == state_digest(torch.load(path, weights_only=True))


def test_recorded_checkpoints_accepted_as_files_and_dicts(attributed):
    _, cfg = attributed
    files = cfg.checkpoint_paths
    dicts = [torch.load(p, weights_only=True) for p in files]
    a = TrakIndex.from_config(cfg).query(tiny.target_data(), k=3)
    b = TrakIndex.from_config(cfg, checkpoints=dicts).query(tiny.target_data(), k=3)
    np.testing.assert_array_equal(a.indices, b.indices)


def test_swapped_files_refused(attributed):
    _, cfg = attributed
    files = cfg.checkpoint_paths
    with pytest.raises(StoreMismatchError, match=r"^checkpoints\[0\]: .*model_001.pt is not the checkpoint model_id=0"):
        TrakIndex.from_config(cfg, checkpoints=files[::-1])


def test_swapped_state_dicts_refused(attributed):
    _, cfg = attributed
    dicts = [torch.load(p, weights_only=True) for p in cfg.checkpoint_paths]
    with pytest.raises(StoreMismatchError, match=r"^checkpoints\[0\]: the state dict is not the checkpoint model_id=0"):
        TrakIndex.from_config(cfg, checkpoints=dicts[::-1])


def test_another_seeds_state_dict_refused(attributed):
    tmp, cfg = attributed
    other = torch.load(tiny.save_checkpoints(tmp / "other", seeds=(9,))[0], weights_only=True)
    first = cfg.checkpoint_paths[0]
    with pytest.raises(StoreMismatchError, match=r"^checkpoints\[1\]: the state dict is not the checkpoint model_id=1"):
        TrakIndex.from_config(cfg, checkpoints=[first, other])
