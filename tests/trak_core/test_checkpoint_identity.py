"""One content record per checkpoint, made and checked the same way by every front door: TrakIndex on a store
written by TRAKer refuses checkpoints in swapped order, another seed's state dict and swapped files, naming the
model id; the record of a file and of the state dict it holds are the same."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from trak_fixtures import checkpoints, make_data, make_model, run_traker

from trak_core import TRAKer, TrakIndex
from trak_core.checkpoints import check_record, record_of, same_checkpoint, state_digest
from trak_core.errors import StoreMismatchError
from trak_core.store import TrakStore


@pytest.fixture(scope="module")
def traker_store(tmp_path_factory):
    d = tmp_path_factory.mktemp("ident")
    data = make_data(n=64, m=5)
    ck = checkpoints(2)
    _, tr = run_traker(TRAKer, d / "s.zarr", ck, data, lambda_reg=1e-2, proj_dim=16)
    scores = np.asarray(tr.scores)
    del tr
    gc.collect()
    files = []
    for i, sd in enumerate(ck):
        torch.save(sd, d / f"model_{i}.pt")
        files.append(str(d / f"model_{i}.pt"))
    return d / "s.zarr", ck, files, data, scores


def _index(store, ck):
    return TrakIndex(store, model=make_model(), checkpoints=ck, device="cpu")


def test_file_and_state_dict_have_one_content_record(tmp_path):
    sd = make_model(3).state_dict()
    torch.save(sd, tmp_path / "a.pt")
    f, s = record_of(tmp_path / "a.pt"), record_of(sd)
    assert f["state_sha256"] == s["state_sha256"] == state_digest(sd) and "sha256" in f and "sha256" not in s
    assert same_checkpoint(f, s) and same_checkpoint(s, f)
    other = record_of(make_model(4).state_dict())
    assert same_checkpoint(f, other) is False
    with pytest.raises(
        StoreMismatchError, match=r"^checkpoints\[2\]: the state dict is not the checkpoint model_id=7 in"
    ):
        check_record(f, other, 7, "somewhere", "checkpoints[2]")


def test_traker_store_accepts_its_checkpoints_as_dicts_and_files(traker_store):
    store, ck, files, (_, _, xt, yt), scores = traker_store
    want = np.argsort(-scores[:, 0], kind="stable")[:3]
    for given in (ck, files):
        res = _index(store, given).query((xt[:1], yt[:1]), k=3)
        np.testing.assert_array_equal(res.indices[0], want)


def test_traker_store_refuses_swapped_order(traker_store):
    store, ck, _, _, _ = traker_store
    with pytest.raises(StoreMismatchError, match=r"^checkpoints\[0\]: the state dict is not the checkpoint model_id=0"):
        _index(store, [ck[1], ck[0]])


def test_traker_store_refuses_another_seeds_state_dict(traker_store):
    store, ck, _, _, _ = traker_store
    with pytest.raises(StoreMismatchError, match=r"^checkpoints\[1\]: the state dict is not the checkpoint model_id=1"):
        _index(store, [ck[0], make_model(7).state_dict()])


def test_traker_store_refuses_swapped_files(traker_store):
    store, _, files, _, _ = traker_store
    with pytest.raises(StoreMismatchError, match=r"^checkpoints\[0\]: .*model_1.pt is not the checkpoint model_id=0"):
        _index(store, [files[1], files[0]])


def test_traker_refuses_a_file_content_other_than_recorded(traker_store, tmp_path):
    """TRAKer and the index check the same record: a rerun TRAKer on the store refuses another state dict for
    model_id 0 with the message the index gives."""
    import shutil

    store, ck, _, _, _ = traker_store
    shutil.copytree(store, tmp_path / "c.zarr")
    tr = TRAKer(
        model=make_model(),
        task="image_classification",
        train_set_size=64,
        save_dir=str(tmp_path / "c.zarr"),
        device="cpu",
        proj_dim=16,
        lambda_reg=1e-2,
        use_half_precision=False,
    )
    with pytest.raises(StoreMismatchError, match=r"the state dict is not the checkpoint model_id=0"):
        tr.load_checkpoint(ck[1], model_id=0)
    del tr
    gc.collect()
    assert TrakStore.open(str(tmp_path / "c.zarr"), mode="r").checkpoint_record(0)["state_sha256"] == state_digest(
        ck[0]
    )
