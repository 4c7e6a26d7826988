"""Every bad input: a clear exception naming what is wrong, raised before writing; the store unchanged."""

import hashlib
import logging
import os

import numpy as np
import pytest
import torch
from trak_fixtures import make_data, make_model

import trak_core
from trak_core.errors import BadInputError, StateError, StoreMismatchError


def snapshot(path) -> dict:
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            full = os.path.join(root, f)
            with open(full, "rb") as fh:
                out[os.path.relpath(full, path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def new_traker(tmp_path, n=40, **kw):
    kw.setdefault("proj_dim", 16)
    return trak_core.TRAKer(
        model=make_model(),
        task="image_classification",
        train_set_size=n,
        save_dir=str(tmp_path / "store"),
        device="cpu",
        logging_level=logging.ERROR,
        chunk_rows=8,
        **kw,
    )


@pytest.fixture
def loaded(tmp_path):
    tr = new_traker(tmp_path)
    tr.load_checkpoint(make_model(1).state_dict(), model_id=0)
    x, y, _, _ = make_data(n=40)
    tr.featurize((x[:8], y[:8]), num_samples=8)  # some real content in the store
    tr._flush_rows()  # held until the default projector's probe has its rows (or the next step): written now
    return tr, tmp_path / "store", (x, y)


def test_wrong_batch_shapes(loaded):
    tr, store, (x, y) = loaded
    before = snapshot(store)
    with pytest.raises(BadInputError, match="different batch sizes"):
        tr.featurize((x[8:16], y[8:15]), inds=np.arange(8, 16))
    with pytest.raises(BadInputError, match="batch has 8 examples but 5 indices"):
        tr.featurize((x[8:16], y[8:16]), inds=np.arange(8, 13))
    with pytest.raises(BadInputError, match="batch must have 2 elements"):
        tr.featurize((x[8:16],), inds=np.arange(8, 16))
    with pytest.raises(BadInputError, match=r"out of range \[0, 40\)"):
        tr.featurize((x[8:16], y[8:16]), inds=np.arange(36, 44))
    with pytest.raises(BadInputError, match="(?i)exactly one of (inds and num_samples|num_samples and inds)"):
        tr.featurize((x[8:16], y[8:16]))
    assert snapshot(store) == before


def test_labels_out_of_range(loaded):
    tr, store, (x, y) = loaded
    before = snapshot(store)
    bad = y[8:16].clone()
    bad[3] = 7  # the model has 3 classes
    with pytest.raises(BadInputError, match=r"labels out of range \[0, 3\) at batch positions \[3\]"):
        tr.featurize((x[8:16], bad), inds=np.arange(8, 16))
    bad[3] = -1
    with pytest.raises(BadInputError, match="labels out of range"):
        tr.featurize((x[8:16], bad), inds=np.arange(8, 16))
    with pytest.raises(BadInputError, match="1-d integer tensor"):
        tr.featurize((x[8:16], y[8:16].float()), inds=np.arange(8, 16))
    assert snapshot(store) == before


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_inputs_name_the_indices(loaded, value):
    """Refused before their gradients, as the pipeline's plan refuses them (trak_core.plan.check_finite)."""
    tr, store, (x, y) = loaded
    before = snapshot(store)
    xb = x[8:16].clone()
    xb[2, 0] = value
    xb[5, 3] = value
    with pytest.raises(
        BadInputError, match=r"^train_data: NaN or inf in tensor 0 at example indices \[10, 13\]; nothing was written$"
    ):
        tr.featurize((xb, y[8:16]), inds=np.arange(8, 16))
    assert snapshot(store) == before
    assert not tr.store.model(0).featurized[8:16].any()


def test_non_finite_weights_are_refused_by_load_checkpoint(tmp_path):
    tr = new_traker(tmp_path)
    ck = make_model(1).state_dict()
    ck["2.weight"][0, 0] = float("nan")
    before = snapshot(tmp_path / "store")
    with pytest.raises(BadInputError, match=r"the state_dict of model_id=4 has NaN or inf in \['2.weight'\]"):
        tr.load_checkpoint(ck, model_id=4)
    assert snapshot(tmp_path / "store") == before


def test_featurize_after_finalize_skips_the_stored_rows(tmp_path):
    """As traker: a finalized model's rows are all stored, so featurizing them again does nothing (the same
    checkpoint; another one is refused by load_checkpoint)."""
    tr = new_traker(tmp_path, n=24, lambda_reg=1e-3)
    tr.load_checkpoint(make_model(1).state_dict(), model_id=0)
    x, y, _, _ = make_data(n=24)
    tr.featurize((x, y), num_samples=24)
    tr.finalize_features()
    before = snapshot(tmp_path / "store")
    tr.load_checkpoint(make_model(1).state_dict(), model_id=0)
    tr.featurize((x[:8], y[:8]), inds=np.arange(8))
    tr.finalize_features()
    assert snapshot(tmp_path / "store") == before
    with pytest.raises(StoreMismatchError, match="model_id=0"):
        tr.load_checkpoint(make_model(2).state_dict(), model_id=0)


def test_finalize_before_all_rows_featurized(loaded):
    tr, store, _ = loaded
    before = snapshot(store)
    with pytest.raises(StateError, match="32 of 40 rows missing"):
        tr.finalize_features()
    assert snapshot(store) == before


def test_unknown_exp_name(tmp_path):
    tr = new_traker(tmp_path, n=24, lambda_reg=1e-3)
    tr.load_checkpoint(make_model(1).state_dict(), model_id=0)
    x, y, xt, yt = make_data(n=24)
    tr.featurize((x, y), num_samples=24)
    tr.finalize_features()
    before = snapshot(tmp_path / "store")
    with pytest.raises(BadInputError, match="unknown experiment 'nope'"):
        tr.finalize_scores("nope")
    assert snapshot(tmp_path / "store") == before


def test_score_before_start_and_unfinalized_checkpoint(loaded):
    tr, store, (x, y) = loaded
    before = snapshot(store)
    with pytest.raises(StateError, match="start_scoring_checkpoint"):
        tr.score((x[:4], y[:4]), num_samples=4)
    with pytest.raises(StateError, match="model_id=0 is not finalized"):
        tr.start_scoring_checkpoint("exp", make_model(1).state_dict(), 0, 4)
    assert snapshot(store) == before


def test_reopen_with_another_proj_dim(tmp_path):
    tr = new_traker(tmp_path, proj_dim=16)
    tr.load_checkpoint(make_model(1).state_dict(), model_id=0)
    x, y, _, _ = make_data(n=40)
    tr.featurize((x[:8], y[:8]), num_samples=8)  # the default projector's store: created once its probe's rows
    tr._flush_rows()  # are here, or by the next step
    before = snapshot(tmp_path / "store")
    with pytest.raises(StoreMismatchError, match=r"proj_dim=16.*proj_dim=32"):
        new_traker(tmp_path, proj_dim=32)
    with pytest.raises(StoreMismatchError, match="dtype='float16'"):
        new_traker(tmp_path, proj_dim=16, use_half_precision=False)
    with pytest.raises(StoreMismatchError, match="train_set_size"):
        new_traker(tmp_path, n=41, proj_dim=16)
    assert snapshot(tmp_path / "store") == before
    new_traker(tmp_path, proj_dim=16)  # the same settings reopen fine


def test_checkpoint_that_does_not_fit(tmp_path):
    tr = new_traker(tmp_path)
    with pytest.raises(BadInputError, match="checkpoint does not fit the model"):
        tr.load_checkpoint(torch.nn.Linear(3, 3).state_dict(), model_id=0)


def test_constructor_arguments(tmp_path):
    with pytest.raises(BadInputError, match="train_set_size"):
        new_traker(tmp_path, n=0)
    with pytest.raises(BadInputError, match="proj_dim"):
        new_traker(tmp_path, proj_dim=0)
    with pytest.raises(BadInputError, match="lambda_reg"):
        new_traker(tmp_path, lambda_reg=-1.0)
    with pytest.raises(BadInputError, match="grad_wrt names parameters the model does not have: \\['nope'\\]"):
        new_traker(tmp_path, grad_wrt=["nope"])
    with pytest.raises(BadInputError, match="unknown task"):
        trak_core.TRAKer(
            model=make_model(), task="regression", train_set_size=4, save_dir=str(tmp_path / "t"), device="cpu"
        )
    assert not (tmp_path / "store").exists() and not (tmp_path / "t").exists()


def test_unwritable_store_location(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(BadInputError, match="not a directory|not writable"):
        trak_core.TRAKer(
            model=make_model(),
            task="image_classification",
            train_set_size=4,
            save_dir=str(blocker),
            device="cpu",
            proj_dim=4,
        )
    assert blocker.read_text() == "x"


def test_store_under_a_file_is_refused(tmp_path):
    from trak_core.store import check_writable

    blocker = tmp_path / "f"
    blocker.write_text("x")
    with pytest.raises(BadInputError, match="not a directory"):
        check_writable(str(blocker / "sub" / "store"))
    check_writable(str(tmp_path / "new" / "store"))  # creatable: fine, and nothing left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_reopen_with_other_projector_parameters_is_refused(tmp_path):
    from trak_core.projection.sjlt import SJLTProjector

    base = dict(
        model=make_model(),
        task="image_classification",
        train_set_size=40,
        save_dir=str(tmp_path / "s"),
        device="cpu",
        logging_level=logging.ERROR,
    )
    trak_core.TRAKer(projector=SJLTProjector(51, 16, 0, c=4), **base)
    with pytest.raises(StoreMismatchError, match="projector_params"):
        trak_core.TRAKer(projector=SJLTProjector(51, 16, 0, c=2), **base)


def test_default_projector_is_factored_also_for_non_linear_parameters(tmp_path):
    tr = new_traker(tmp_path)
    assert tr.projector is None  # built from the gradient energy of the first rows featurized
    tr.load_checkpoint(make_model(1).state_dict(), model_id=0)
    x, y, _, _ = make_data(n=40)
    tr.featurize((x, y), num_samples=40)
    assert tr.projector.spec()["kind"] == "factored" and tr.projector.spec()["split"] == "energy"

    class Bag(torch.nn.Module):  # an embedding: its own factored block (layout version 2; before, the dense one)
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 3)

        def forward(self, ids):
            return self.head(self.emb(ids).mean(1))

    other = trak_core.TRAKer(
        model=Bag(),
        task="image_classification",
        train_set_size=8,
        proj_dim=12,
        save_dir=str(tmp_path / "o"),
        device="cpu",
        logging_level=logging.ERROR,
    )
    other.load_checkpoint(Bag().state_dict(), model_id=0)
    other.featurize((torch.randint(0, 5, (8, 4)), torch.randint(0, 3, (8,))), num_samples=8)
    layout = other.projector.spec()["layout"]
    assert [b[1] for b in layout] == ["embedding", "linear"]
    assert other.store.model(0).featurized[:].all()


# ---------------------------------------------------------------------------- more bad input
def test_empty_save_dir_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for save_dir in ("", "   ", None):
        with pytest.raises(BadInputError, match="save_dir must be a non-empty path"):
            trak_core.TRAKer(
                model=make_model(),
                task="image_classification",
                train_set_size=10,
                save_dir=save_dir,
                device="cpu",
                proj_dim=4,
            )
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused_at_construction(tmp_path):
    for device in ("cuda", "cuda:0", torch.device("cuda"), "gpu"):
        with pytest.raises(BadInputError, match="CUDA is not available|is not a torch device"):
            trak_core.TRAKer(model=make_model(), device=device, proj_dim=4, **_kw(tmp_path))
    assert not (tmp_path / "store").exists()


def _kw(tmp_path, **kw):
    return dict(
        task="image_classification",
        train_set_size=40,
        save_dir=str(tmp_path / "store"),
        logging_level=logging.ERROR,
        chunk_rows=8,
        **kw,
    )


def test_unsafe_exp_name_is_refused_before_writing(loaded):
    tr, store, (x, y) = loaded
    before = snapshot(store)
    for name in ("..", "a/b", "new\\sub", ".x"):
        with pytest.raises(BadInputError, match="not a safe experiment name"):
            tr.store.init_experiment(name, 4)
    assert snapshot(store) == before


@pytest.mark.parametrize("kind", ["dense", "sjlt", "factored", "noop"])
def test_float64_model_and_inputs_work_with_every_projector(tmp_path, kind):
    """A float64 model on float64 inputs featurizes with each projector, and gives the features of the same
    model in float32 (up to float32 rounding)."""
    from trak_core.projection.projectors import make_projector

    x, y, _, _ = make_data(n=40)
    out = {}
    for dt in (torch.float32, torch.float64):
        model = make_model(1).to(dt)
        g = sum(p.numel() for p in model.parameters())
        proj = make_projector(kind, g, 8 if kind != "noop" else g, 0, "rademacher", device="cpu", model=model)
        tr = trak_core.TRAKer(
            model=model, device="cpu", projector=proj, use_half_precision=False, **_kw(tmp_path / str(dt))
        )
        tr.load_checkpoint(model.state_dict(), model_id=0)
        tr.featurize((x.to(dt), y), num_samples=40)
        out[dt] = tr.store.model(0).grads[:]
    np.testing.assert_allclose(out[torch.float64], out[torch.float32], rtol=1e-3, atol=1e-5)


def test_float64_inputs_to_a_float32_model_get_a_clear_error(tmp_path):
    x, y, _, _ = make_data(n=40)
    tr = new_traker(tmp_path, projector=None)
    tr.load_checkpoint(make_model(1).state_dict(), model_id=0)
    before = snapshot(tmp_path / "store")
    with pytest.raises(
        BadInputError,
        match=r"^train_data: tensor 0 is torch.float64 but the model's parameters are torch.float32: cast the data",
    ):
        tr.featurize((x[:8].double(), y[:8]), num_samples=8)
    assert snapshot(tmp_path / "store") == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_bad_rows_by_one_sum_equal_the_entry_by_entry_check(dtype):
    """The finiteness check by one sum names exactly the rows an entry-by-entry check names, also where finite
    entries sum to an overflow, where +inf and -inf would cancel to NaN, and with no bad row at all."""
    from trak_core.featurize.featurizer import _all_finite, _bad_rows

    big = torch.finfo(dtype).max
    g = torch.Generator().manual_seed(0)
    cases = []
    for bad in ([], [1], [0, 5], [7]):
        t = torch.randn(8, 3, 4, generator=g).to(dtype)
        cases.append((t, bad))
    cases[0][0][:, 0, 0] = big  # finite, but the sum overflows: no bad row
    cases[1][0][1, 2, 3] = float("nan")
    cases[2][0][0, 0, 1], cases[2][0][5, 1, 1] = float("inf"), float("-inf")  # the sum: NaN
    cases[3][0][:, 0, 0] = big  # an overflowing sum beside a real infinity
    cases[3][0][7, 1, 0] = float("inf")
    for t, bad in cases:
        ref = [i for i in range(t.shape[0]) if not bool(torch.isfinite(t[i]).all())]
        assert ref == bad
        assert _bad_rows(t) == bad
        assert _all_finite(t) == (not bad)
        assert _all_finite(t.reshape(-1)[:0])  # empty
