"""TRAKer's default projector splits proj_dim by the gradient energy of the first min(64, train rows) rows
featurized, whatever the batches: the projector and the store wait for those rows; a reopened store rebuilds the
identical projector from its metadata alone; a version-4 store (equal split) still opens; nothing needs the
projector before it exists."""

import logging

import numpy as np
import pytest
import torch

from trak_core import TRAKer
from trak_core.compat.errors import ModelIDException
from trak_core.errors import StateError, StoreMismatchError
from trak_core.projection.energy import quantize_energies, sketched_energies
from trak_core.projection.factored import FactoredProjector
from trak_core.scoring.index import TrakIndex
from trak_core.store import TrakStore

N, P = 24, 32


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(10, 24), torch.nn.ReLU(), torch.nn.Linear(24, 24), torch.nn.ReLU(), torch.nn.Linear(24, 3)
    )


def data(n: int = N, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 10, generator=g), torch.randint(0, 3, (n,), generator=g)


def traker(path, model=None, **kw) -> TRAKer:
    kw = {"proj_dim": P, "lambda_reg": 1e-2, "use_half_precision": False, "chunk_rows": 8, **kw}
    return TRAKer(
        model if model is not None else make_model(),
        "image_classification",
        N,
        save_dir=str(path),
        device="cpu",
        logging_level=logging.ERROR,
        **kw,
    )


def test_projector_waits_for_the_first_featurize_then_a_reopened_store_rebuilds_it(tmp_path):
    model = make_model()
    x, y = data()
    tr = traker(tmp_path / "s", model)
    assert tr.projector is None and tr.metadata is None
    assert not (tmp_path / "s" / "zarr.json").exists()
    # what needs the store before anything was featurized says so
    with pytest.raises(StateError, match="once the first rows are featurized"):
        tr.start_scoring_checkpoint("e", model.state_dict(), 0, num_targets=4)
    with pytest.raises(ModelIDException, match="nothing was featurized"):
        tr.finalize_features()
    with pytest.raises(StateError, match="once the first rows are featurized"):
        tr.features(0)
    tr.load_checkpoint(model.state_dict(), model_id=0)
    assert not (tmp_path / "s" / "zarr.json").exists()  # load_checkpoint's record waits for the store too
    tr.featurize((x[:16], y[:16]), num_samples=16)
    assert tr.projector is None  # 16 of the 24 rows the probe takes: held
    tr.featurize((x[16:], y[16:]), num_samples=8)
    spec = tr.projector.spec()
    energies = quantize_energies(sketched_energies(model, "image_classification", (x, y)))  # the first 24 rows
    assert spec["split"] == "energy" and spec["energies"] == energies
    assert tr.store.meta.projector_params["layout"] == spec["layout"]
    assert tr.store.checkpoint_record(0) is not None  # the load_checkpoint before the store, recorded
    tr._flush_rows()
    stored = np.asarray(tr.store.model(0).grads[:])
    del tr

    # reopened with another model object and no data: rebuilt at once; model 0 started over (traker's
    # load_from_save_dir=False) gets the same features for the same batch
    again = traker(tmp_path / "s", make_model(5), load_from_save_dir=False)
    assert again.projector is not None and again.projector.spec() == spec
    again.load_checkpoint(model.state_dict(), model_id=0)
    assert not again.store.model(0).featurized[:].any()
    again.featurize((x, y), num_samples=N)
    again._flush_rows()
    np.testing.assert_allclose(np.asarray(again.store.model(0).grads[:]), stored, rtol=1e-5, atol=1e-6)
    # the query path rebuilds the same projector from the metadata (it refuses one that differs)
    again.finalize_features()
    index = TrakIndex(str(tmp_path / "s"), model=make_model(), checkpoints=[model.state_dict()], device="cpu")
    assert index.projector.spec() == spec
    # another proj_dim on the same store is refused by the metadata, naming the field
    with pytest.raises(StoreMismatchError, match="proj_dim"):
        traker(tmp_path / "s", proj_dim=16)


def test_a_version_4_store_reopens_with_its_equal_split(tmp_path):
    model = make_model()
    x, y = data()
    v4 = FactoredProjector.from_model(model, P, layout_version=4)
    tr = traker(tmp_path / "v4", model, projector=v4)  # a store as version 4 wrote it
    tr.load_checkpoint(model.state_dict(), model_id=0)
    tr.featurize((x, y), num_samples=N)
    tr._flush_rows()
    params = tr.store.meta.projector_params
    assert params["layout_version"] == 4 and "split" not in params
    del tr
    again = traker(tmp_path / "v4", model)
    assert again.projector.spec() == v4.spec()  # no probe: the store's own (equal) split
    again.load_checkpoint(model.state_dict(), model_id=0)
    again.featurize((x, y), num_samples=N)  # flagged rows: nothing to do
    again.finalize_features()


def test_explicit_projectors_are_unchanged(tmp_path):
    model = make_model()
    tr = traker(tmp_path / "d", model, projector=FactoredProjector.from_model(model, P))
    assert tr.projector.spec()["split"] == "layer"  # used as given, the store created at once
    assert (tmp_path / "d" / "zarr.json").exists()


def test_a_failing_first_batch_creates_nothing(tmp_path):
    model = make_model()
    x, y = data()
    tr = traker(tmp_path / "s", model)
    tr.load_checkpoint(model.state_dict(), model_id=0)
    bad = x[:8].clone()
    bad[3, 0] = float("nan")
    with pytest.raises(Exception, match=r"train_data: NaN or inf in tensor 0 at example indices \[3\]"):
        tr.featurize((bad, y[:8]), inds=np.arange(8))
    assert tr.projector is None and not TrakStore.exists(str(tmp_path / "s"))
    tr.featurize((x[:8], y[:8]), inds=np.arange(8))  # a good batch is held; the rows that complete the probe
    assert tr.projector is None  # create the store
    tr.featurize((x[8:], y[8:]), inds=np.arange(8, N))
    assert tr.store.meta.projector_params["split"] == "energy"
    tr.finalize_features()
    assert tr.store.featurized_mask(0).all()
