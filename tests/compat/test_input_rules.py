"""The same bad input gets the same error from TRAKer as from the pipeline's plan: both front doors apply the
engine's input rules (trak_core.plan) before anything is computed or written. Each case runs both routes on
examples.tiny and compares the messages."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from trak_fixtures import tiny_attribute_config

from examples import tiny
from tasks import core
from tasks.common import clear_data_cache
from tasks.config import AttributeConfig
from trak_core import TRAKer
from trak_core.errors import BadInputError
from trak_core.projection.projectors import NoOpProjector

NAN_ROWS = [13, 41]


def nan_train_data():
    x, y = tiny.train_data()
    x = x.clone()
    x[NAN_ROWS, 2] = float("nan")
    return x, y


def double_train_data():
    x, y = tiny.train_data()
    return x.double(), y


@pytest.fixture
def checkpoint(tmp_path):
    clear_data_cache()
    yield tiny.save_checkpoints(tmp_path / "ck", seeds=(0,))[0]
    clear_data_cache()


def pipeline_error(tmp_path, checkpoint, **over) -> str:
    """The plan's error (nothing written: no store)."""
    cfg = AttributeConfig.model_validate(tiny_attribute_config(tmp_path / "p.zarr", [checkpoint], **over))
    with pytest.raises(BadInputError) as e:
        core.make_plan(cfg)
    assert not os.path.exists(cfg.store)
    return str(e.value)


def traker(tmp_path, **kw) -> TRAKer:
    kw.setdefault("proj_dim", 16)
    kw.setdefault("lambda_reg", 1e-3)
    return TRAKer(
        tiny.make_model(),
        "image_classification",
        tiny.NUM_TRAIN,
        save_dir=str(tmp_path / "t"),
        device="cpu",
        logging_level=logging.ERROR,
        **kw,
    )


def traker_featurize_error(tmp_path, checkpoint, data, batch_size: int = 8) -> str:
    """TRAKer's error for ``data`` given in batches, as a traker script feeds them (nothing of the batch stored)."""
    tr = traker(tmp_path)
    tr.load_checkpoint(torch.load(checkpoint, weights_only=True), model_id=0)
    with pytest.raises(BadInputError) as e:
        for a in range(0, tiny.NUM_TRAIN, batch_size):
            tr.featurize([t[a : a + batch_size] for t in data], num_samples=min(batch_size, tiny.NUM_TRAIN - a))
    tr._close()
    return str(e.value)


@pytest.mark.parametrize("batch_size", [8, tiny.NUM_TRAIN])
def test_nan_in_train_rows(tmp_path, checkpoint, batch_size):
    want = f"train_data: NaN or inf in tensor 0 at example indices {NAN_ROWS}; nothing was written"
    assert pipeline_error(tmp_path, checkpoint, train_data="test_input_rules:nan_train_data") == want
    if batch_size < tiny.NUM_TRAIN:  # batch by batch: the first bad batch names its row
        want = f"train_data: NaN or inf in tensor 0 at example indices {NAN_ROWS[:1]}; nothing was written"
    assert traker_featurize_error(tmp_path, checkpoint, nan_train_data(), batch_size) == want


def test_inf_in_a_checkpoint(tmp_path, checkpoint):
    state = torch.load(checkpoint, weights_only=True)
    state["2.bias"][1] = float("inf")
    bad = str(tmp_path / "inf.pt")
    torch.save(state, bad)
    tail = "has NaN or inf in ['2.bias']; nothing was written"
    assert pipeline_error(tmp_path, bad) == f"checkpoints[0]: {bad} {tail}"
    tr = traker(tmp_path)
    with pytest.raises(BadInputError) as e:
        tr.load_checkpoint(state, model_id=0)
    assert str(e.value) == f"checkpoint: the state_dict of model_id=0 {tail}"
    tr._close()
    assert not (tmp_path / "t" / "zarr.json").exists()


def test_proj_dim_at_least_n_with_no_damping(tmp_path, checkpoint):
    want = (
        f"proj_dim: {tiny.NUM_TRAIN} ≥ number of train examples n={tiny.NUM_TRAIN} makes XᵀX singular "
        "(scores would be noise); use a proj_dim well below n, or lambda_reg > 0"
    )
    assert pipeline_error(tmp_path, checkpoint, proj_dim=tiny.NUM_TRAIN, lambda_reg=0) == want
    with pytest.raises(BadInputError) as e:
        traker(tmp_path, proj_dim=tiny.NUM_TRAIN, lambda_reg=0.0)
    assert str(e.value) == want
    traker(tmp_path, proj_dim=tiny.NUM_TRAIN, lambda_reg=1e-3)._close()  # damped: accepted by both
    # the identity projection (75 parameters ≥ 64 rows) names the projector instead
    identity = pipeline_error(tmp_path, checkpoint, projector="noop", lambda_reg=0)
    assert identity.startswith("projector: 'noop' keeps all 75 gradient dimensions")
    with pytest.raises(BadInputError) as e:
        traker(tmp_path, projector=NoOpProjector(), lambda_reg=0.0)
    assert str(e.value) == identity


@pytest.mark.parametrize(
    "data, want",
    [
        ("examples.tiny:bad_labels", "train_data: labels must be a 1-d integer tensor"),
        ("test_input_rules:double_train_data", "train_data: tensor 0 is torch.float64 but the model's parameters"),
    ],
)
def test_wrong_dtypes(tmp_path, checkpoint, data, want):
    message = pipeline_error(tmp_path, checkpoint, train_data=data)
    assert message.startswith(want)
    data = tiny.bad_labels() if data.endswith("bad_labels") else double_train_data()
    assert traker_featurize_error(tmp_path, checkpoint, data) == message
