"""Inputs that used to fail with a misleading or raw error: int32 labels and token ids (accepted, with int64's
answers), causal_lm input ids outside the vocabulary, a model whose forward takes no attention_mask, a batch on the
meta device (each a one-line BadInputError naming the cause), and a TRAKer whose relative save_dir outlives an
os.chdir."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from trak_fixtures import make_data, make_model

from examples import tiny
from trak_core import TRAKer, TrakIndex
from trak_core.errors import BadInputError
from trak_core.featurize.lm import causal_lm_batch
from trak_core.featurize.modelout import resolve_task
from trak_core.plan import check_batch


def traker(save_dir, model=None, task="image_classification", n=16, **kw):
    return TRAKer(
        model if model is not None else make_model(),
        task,
        n,
        save_dir=str(save_dir),
        device="cpu",
        proj_dim=kw.pop("proj_dim", 8),
        logging_level=logging.ERROR,
        **kw,
    )


def features(tr, model_id=0) -> np.ndarray:
    return tr.store.model(model_id).grads[:]


# ---------------------------------------------------------------------------------------------- int32
def test_int32_labels_give_the_int64_answers(tmp_path):
    """TRAKer, the pipeline's input check and a TrakIndex query take int32 labels (in range) as they take int64
    ones: the same stored rows, the same top-k; a negative int32 label is still refused, naming its position."""
    x, y, xt, yt = make_data(n=16, m=5)
    stores, feats = {}, {}
    for dt in (torch.int64, torch.int32):
        tr = traker(tmp_path / str(dt))
        tr.load_checkpoint(make_model(1).state_dict(), 0)
        tr.featurize((x, y.to(dt)), num_samples=16)
        tr.finalize_features()
        stores[dt], feats[dt] = tr.save_dir, features(tr)
        tr._close()  # the lock released now, not at garbage collection
    np.testing.assert_array_equal(feats[torch.int64], feats[torch.int32])
    check_batch(resolve_task("image_classification"), (x, y.int()), "train_data", rows=8)  # the pipeline's check
    index = TrakIndex(stores[torch.int64], model=make_model(), checkpoints=[make_model(1).state_dict()], device="cpu")
    r64, r32 = index.query((xt, yt), k=4), index.query((xt, yt.int()), k=4)
    np.testing.assert_array_equal(r64.indices, r32.indices)
    np.testing.assert_array_equal(r64.scores, r32.scores)
    bad = yt.int().clone()
    bad[2] = -1
    with pytest.raises(
        BadInputError, match=r"labels out of range \[0, number of classes\) at batch positions \[2\]"
    ) as e:
        index.query((xt, bad), k=4)
    assert "4611686018427387904" not in str(e.value)


# ---------------------------------------------------------------------------------------------- causal_lm
VOCAB = 24


class TinyLM(torch.nn.Module):
    """An embedding and a linear head: logits (B, T, V) from model(input_ids=, attention_mask=)."""

    def __init__(self, takes_mask: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 6)
        self.head = torch.nn.Linear(6, VOCAB)

    def forward(self, input_ids, attention_mask=None):
        return self.head(torch.tanh(self.emb(input_ids)))


class NoMaskLM(TinyLM):
    def forward(self, input_ids):
        return self.head(torch.tanh(self.emb(input_ids)))


SEQS = [[1, 2, 3, 4], [5, 6, 7], [3, 4, 5, 6, 7], [9, 8, 7, 6]]


def lm_traker(tmp_path, name, model=None):
    tr = traker(tmp_path / name, model if model is not None else TinyLM(), task="causal_lm", n=len(SEQS), proj_dim=4)
    tr.load_checkpoint(tr.model.state_dict(), 0)
    return tr


def test_causal_lm_int32_token_ids_give_the_int64_features(tmp_path):
    batch = causal_lm_batch(SEQS)
    want = lm_traker(tmp_path, "64")
    want.featurize(batch, num_samples=len(SEQS))
    got = lm_traker(tmp_path, "32")
    got.featurize(tuple(t.int() for t in batch), num_samples=len(SEQS))
    want.finalize_features()
    got.finalize_features()
    np.testing.assert_array_equal(features(want), features(got))


@pytest.mark.parametrize("value, match", [(VOCAB + 6, r"input_ids must be in \[0, 24\)"), (-2, r"rows \[1\]")])
def test_causal_lm_ids_outside_the_vocabulary_are_one_line(tmp_path, value, match):
    ids, mask, labels = causal_lm_batch(SEQS)
    ids[1, 1] = value
    tr = lm_traker(tmp_path, "s")
    with pytest.raises(BadInputError, match=match) as e:
        tr.featurize((ids, mask, labels), num_samples=len(SEQS))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "s" / "zarr.json").exists()  # refused before the store was made


def test_causal_lm_ids_outside_the_vocabulary_name_the_rows_outside_vmap():
    ids, mask, labels = causal_lm_batch(SEQS)
    ids[2, 0] = VOCAB
    model = TinyLM()
    task = resolve_task("causal_lm")
    weights = {k: v.detach() for k, v in model.named_parameters()}
    with pytest.raises(BadInputError, match=r"input_ids must be in \[0, 24\).*rows \[2\] hold such ids"):
        task.get_out_to_loss_grad(model, weights, {}, (ids, mask, labels))


def test_a_models_own_index_error_is_not_blamed_on_the_ids():
    class Buggy(TinyLM):
        def forward(self, input_ids, attention_mask=None):
            return [self.head(self.emb(input_ids))][1]

    task, model = resolve_task("causal_lm"), Buggy()
    weights = {k: v.detach() for k, v in model.named_parameters()}
    with pytest.raises(IndexError, match="list index out of range"):
        task.get_out_to_loss_grad(model, weights, {}, causal_lm_batch(SEQS))


def test_causal_lm_forward_without_attention_mask_is_one_line(tmp_path):
    tr = lm_traker(tmp_path, "s", NoMaskLM())
    with pytest.raises(BadInputError, match=r"NoMaskLM.forward\(input_ids\) takes no attention_mask argument"):
        tr.featurize(causal_lm_batch(SEQS), num_samples=len(SEQS))
    assert not (tmp_path / "s" / "zarr.json").exists()


def test_batch_on_the_meta_device_is_one_line(tmp_path):
    tr = lm_traker(tmp_path, "s")
    meta = tuple(t.to("meta") for t in causal_lm_batch(SEQS))
    with pytest.raises(BadInputError, match="batch element 0 is on the meta device: it holds no values"):
        tr.featurize(meta, num_samples=len(SEQS))
    x, y = tiny.train_data()
    with pytest.raises(BadInputError, match="batch element 1 is on the meta device"):
        resolve_task("image_classification").validate_batch((x, y.to("meta")))


# ---------------------------------------------------------------------------------------------- save_dir
def test_relative_save_dir_survives_chdir(tmp_path, monkeypatch):
    """The store stays where save_dir named it when the TRAKer was made; a later os.chdir moves nothing (the run
    lock is found again, no LockLostError)."""
    monkeypatch.chdir(tmp_path)
    x, y = tiny.train_data()
    xt, yt = tiny.target_data()
    tr = TRAKer(tiny.make_model(), "image_classification", tiny.NUM_TRAIN, save_dir="rel", device="cpu", proj_dim=8)
    assert tr.save_dir == str(tmp_path / "rel")
    tr.load_checkpoint(tiny.make_model().state_dict(), 0)
    tr.featurize((x[:32], y[:32]), num_samples=32)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    tr.featurize((x[32:], y[32:]), num_samples=32)
    tr.finalize_features()
    tr.start_scoring_checkpoint("e", tiny.make_model().state_dict(), 0, tiny.NUM_TARGETS)
    tr.score((xt, yt), num_samples=tiny.NUM_TARGETS)
    scores = tr.finalize_scores("e")
    assert scores.shape == (tiny.NUM_TRAIN, tiny.NUM_TARGETS)
    assert list((tmp_path / "elsewhere").iterdir()) == []
