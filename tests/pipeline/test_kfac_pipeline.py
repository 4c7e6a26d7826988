"""``curvature: kfac`` / ``ekfac`` through the pipeline (a fit task per checkpoint before its shards, then the usual
featurize/finalize/score) = TRAKer with ``fit_curvature`` on the same batches; the query index reads the recorded
factors; bad settings are refused by the config, naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from trak_fixtures import tiny_attribute_config

from examples import tiny
from tasks.config import AttributeConfig
from trak_core import TRAKer, TrakIndex
from trak_core.solve import kfac
from trak_core.store import TrakStore

pytestmark = pytest.mark.usefixtures("prefect_harness")

N, M, BATCH, PROJ = tiny.NUM_TRAIN, tiny.NUM_TARGETS, 8, 16


def config(tmp, ckpts, **over) -> AttributeConfig:
    return AttributeConfig.model_validate(tiny_attribute_config(tmp / "store.zarr", ckpts, **over))


def traker_scores(tmp, paths, curvature: str, meta) -> np.ndarray:
    """TRAKer's scores with the projector the pipeline's store ``meta`` records (its energy split)."""
    x, y = tiny.train_data()
    xt, yt = tiny.target_data()
    from trak_core import engine

    model = tiny.make_model()
    proj = engine.recorded_projector(meta, model)
    tr = TRAKer(
        model,
        "image_classification",
        N,
        save_dir=str(tmp / "traker.zarr"),
        device="cpu",
        proj_dim=PROJ,
        lambda_reg=1e-3,
        chunk_rows=8,
        shard_rows=16,
        projector=proj,
        curvature=curvature,
    )
    sds = [torch.load(p, weights_only=True) for p in sorted(paths)]
    batches = [(x[a : a + BATCH], y[a : a + BATCH]) for a in range(0, N, BATCH)]
    for mid, sd in enumerate(sds):
        tr.load_checkpoint(sd, mid)
        tr.fit_curvature(batches)
        for a in range(0, N, BATCH):
            tr.featurize((x[a : a + BATCH], y[a : a + BATCH]), inds=np.arange(a, a + BATCH))
    tr.finalize_features()
    for mid, sd in enumerate(sds):
        tr.start_scoring_checkpoint("tiny", sd, mid, M)
        tr.score((xt, yt), inds=np.arange(M))
    return np.asarray(tr.finalize_scores("tiny"))


@pytest.mark.parametrize("curvature", ["kfac"])  # (EK-FAC through TRAKer and the index: test_kfac_store)
def test_pipeline_equals_traker_and_index(tmp_path, curvature):
    from flows import attribute

    paths = tiny.save_checkpoints(tmp_path / "ck", seeds=(0, 1))
    cfg = config(tmp_path, paths, curvature=curvature, projector="factored", report_targets=0)
    attribute(cfg)
    store = TrakStore.open(cfg.store, mode="r")
    assert store.meta.curvature == curvature
    assert sorted(store.pipeline_info()[kfac.RECORD_KEY]) == ["0", "1"]
    assert all(store.finalize_info(mid)["curvature"] == curvature for mid in (0, 1))
    ours = np.asarray(store.scores("tiny")[:])
    want = traker_scores(tmp_path, paths, curvature, store.meta)
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    # not the scores without the curvature
    plain = config(tmp_path / "plain", paths, projector="factored", report_targets=0, lambda_reg=0.0)
    attribute(plain)
    assert not np.allclose(ours, TrakStore.open(plain.store, mode="r").scores("tiny")[:], rtol=1e-2)
    index = TrakIndex.from_config(cfg)
    xt, yt = tiny.target_data()
    res = index.query((xt, yt), k=N)
    np.testing.assert_allclose(res.scores, np.take_along_axis(ours.T, res.indices, 1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"curvature": "kfacc"}, "curvature"),
        ({"curvature": "kfac", "curvature_damping": 0}, "curvature_damping"),
        ({"curvature": "kfac", "curvature_damping": float("inf")}, "curvature_damping"),
        ({"curvature": "ekfac", "processes_per_task": 2}, "curvature='ekfac'.*processes_per_task"),
        ({"curvature": "kfac", "projector": "dense"}, "needs the factored projector"),
    ],
)
def test_bad_settings_named_by_the_config(tmp_path, over, field):
    paths = tiny.save_checkpoints(tmp_path / "ck", seeds=(0,))
    with pytest.raises(ValidationError, match=field):
        config(tmp_path, paths, **over)
    assert not (tmp_path / "store.zarr").exists()
