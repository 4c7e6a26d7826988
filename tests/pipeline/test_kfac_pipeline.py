"""``curvature: kfac`` / ``ekfac`` / ``kfac-eigen`` through the pipeline (a fit task per checkpoint before its
shards, then the usual featurize/finalize/score) = TRAKer (``kfac``: the factors summed while it featurizes, no fit;
``kfac-eigen``: ``fit_curvature`` on the same rows in other batches); the query index
reads the recorded factors; bad settings are refused by the config, naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from trak_fixtures import tiny_attribute_config

from examples import tiny
from tasks.config import AttributeConfig
from trak_core import TRAKer, TrakIndex
from trak_core.solve import kfac_record
from trak_core.store import TrakStore

pytestmark = pytest.mark.usefixtures("prefect_harness")

N, M, BATCH, PROJ = tiny.NUM_TRAIN, tiny.NUM_TARGETS, 8, 16


def config(tmp, ckpts, **over) -> AttributeConfig:
    return AttributeConfig.model_validate(tiny_attribute_config(tmp / "store.zarr", ckpts, **over))


def first_48():
    return tuple(t[:48] for t in tiny.train_data())


def _reduce_upstreams() -> dict[str, set[str]]:
    """{reduce task run name: the names of the task runs it waited for}, of the last run's reduce-curvature tasks."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterId, TaskRunFilterName

    async def read():
        async with get_client() as client:
            names = [f"curvature-sums-m{mid}" for mid in (0, 1)]
            runs = await client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=names)))
            last = {}
            for r in sorted(runs, key=lambda r: r.created):
                last[r.name] = r
            ids = {str(i.id): name for name, r in last.items() for i in r.task_inputs.get("wait_for", [])}
            ups = await client.read_task_runs(task_run_filter=TaskRunFilter(id=TaskRunFilterId(any_=list(ids))))
            by_id = {str(u.id): u.name for u in ups}
            return {name: {by_id[i] for i, n in ids.items() if n == name} for name in last}

    return asyncio.run(read())


def traker_scores(tmp, paths, curvature: str, meta=None, fit_batch=BATCH, fit_rows=N) -> np.ndarray:
    """TRAKer's scores with the projector the pipeline's store ``meta`` records (its energy split; None: TRAKer's own
    default projector), the factors fitted on the first ``fit_rows`` rows in batches of ``fit_batch`` (None: no fit,
    the factors of the rows featurized)."""
    x, y = tiny.train_data()
    xt, yt = tiny.target_data()
    from trak_core import engine

    model = tiny.make_model()
    proj = None if meta is None else engine.recorded_projector(meta, model)
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
        curvature=curvature,
        **({} if proj is None else {"projector": proj}),
    )
    sds = [torch.load(p, weights_only=True) for p in sorted(paths)]
    step = fit_batch or N
    batches = [(x[a : a + step], y[a : a + step]) for a in range(0, fit_rows, step)]
    for mid, sd in enumerate(sds):
        tr.load_checkpoint(sd, mid)
        if fit_batch is not None:
            tr.fit_curvature(batches)
        for a in range(0, N, BATCH):
            tr.featurize((x[a : a + BATCH], y[a : a + BATCH]), inds=np.arange(a, a + BATCH))
    tr.finalize_features()
    for mid, sd in enumerate(sds):
        tr.start_scoring_checkpoint("tiny", sd, mid, M)
        tr.score((xt, yt), inds=np.arange(M))
    return np.asarray(tr.finalize_scores("tiny")), tr.store.meta


@pytest.fixture(scope="module")
def kfac_run(tmp_path_factory, prefect_harness):
    """One ``kfac`` pipeline run on tiny's checkpoints of seeds 0 and 1 (shared by the tests that need its scores):
    its checkpoints and config."""
    from flows import attribute

    tmp = tmp_path_factory.mktemp("kfac")
    paths = tiny.save_checkpoints(tmp / "ck", seeds=(0, 1))
    cfg = config(tmp, paths, curvature="kfac", projector="factored", report_targets=0)
    attribute(cfg)
    return paths, cfg


@pytest.mark.parametrize("curvature", ["kfac"])  # (EK-FAC through TRAKer and the index: test_kfac_store)
def test_pipeline_equals_traker_and_index(tmp_path, curvature, kfac_run):
    from flows import attribute

    paths, cfg = kfac_run
    assert cfg.curvature == curvature
    store = TrakStore.open(cfg.store, mode="r")
    assert store.meta.curvature == curvature
    assert [m for m in (0, 1, 2) if kfac_record.has_factors(store, m)] == [0, 1]
    assert kfac_record.RECORD_KEY not in store.pipeline_info()  # each model's record is its own
    # no fit pass: each shard summed its rows' factors, reduced once all were featurized
    assert all(store.read_factor_partial(m, s) is not None for m in (0, 1) for s in range(store.meta.num_shards))
    assert all(store.finalize_info(mid)["curvature"] == curvature for mid in (0, 1))
    # each checkpoint's reduce task waits for its own shards only (not for the other checkpoint's, or its reduce)
    shards = store.meta.num_shards
    assert _reduce_upstreams() == {
        f"curvature-sums-m{mid}": {f"featurize-m{mid}-s{s}" for s in range(shards)} for mid in (0, 1)
    }
    ours = np.asarray(store.scores("tiny")[:])
    want, _ = traker_scores(tmp_path, paths, curvature, store.meta, fit_batch=None)  # TRAKer: no fit
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    # not the scores without the curvature
    plain = config(tmp_path / "plain", paths, projector="factored", report_targets=0, lambda_reg=0.0)
    attribute(plain)
    assert not np.allclose(ours, TrakStore.open(plain.store, mode="r").scores("tiny")[:], rtol=1e-2)
    index = TrakIndex.from_config(cfg)
    xt, yt = tiny.target_data()
    res = index.query((xt, yt), k=N)
    np.testing.assert_allclose(res.scores, np.take_along_axis(ours.T, res.indices, 1), rtol=1e-5, atol=1e-6)


def test_eigen_pipeline_equals_traker_default_projector_and_index(tmp_path, kfac_run):
    """``kfac-eigen``: the plan fits model 0's factors and splits proj_dim by them as TRAKer's default projector does
    (one engine rule), so the pipeline and a TRAKer left to its defaults (fitting in batches of another size) lay
    out the same projection and give the same scores; the index answers in the recorded eigenbasis."""
    from flows import attribute
    from trak_core import engine
    from trak_core.projection.energy import PROBE_ROWS

    paths, kfac_cfg = kfac_run  # the same checkpoints, and their kfac run's scores
    cfg = config(tmp_path, paths, curvature="kfac-eigen", projector="factored")
    attribute(cfg)
    store = TrakStore.open(cfg.store, mode="r")
    assert [m for m in (0, 1, 2) if kfac_record.has_factors(store, m)] == [0, 1]
    assert kfac_record.RECORD_KEY not in store.pipeline_info()  # each model's record is its own
    # fitted first, not summed per shard
    assert all(store.read_factor_partial(m, s) is None for m in (0, 1) for s in range(store.meta.num_shards))
    assert all(store.finalize_info(mid)["curvature"] == "kfac-eigen" for mid in (0, 1))
    model = tiny.make_model()
    model.load_state_dict(torch.load(sorted(paths)[0], weights_only=True))
    probed = engine.probe_split(model, "image_classification", [t[:PROBE_ROWS] for t in tiny.train_data()])
    split = engine.eigen_split(probed, kfac_record.load_factors(store, 0), PROJ)
    assert store.meta.projector_params["energies"] == split["energies"] != probed["energies"]
    ours = np.asarray(store.scores("tiny")[:])
    want, meta = traker_scores(tmp_path, paths, "kfac-eigen", fit_batch=32)
    assert meta.projector_params == store.meta.projector_params
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    # not the scores of the random sides
    assert not np.allclose(ours, TrakStore.open(kfac_cfg.store, mode="r").scores("tiny")[:], rtol=1e-2)
    res = TrakIndex.from_config(cfg).query(tiny.target_data(), k=N)
    np.testing.assert_allclose(res.scores, np.take_along_axis(ours.T, res.indices, 1), rtol=1e-5, atol=1e-6)


def test_eigen_plan_checks_every_checkpoint_before_its_fit(tmp_path, monkeypatch):
    """The plan fits model 0's factors only once every input is checked: a bad later checkpoint is refused, naming
    it, before that pass over the rows, and nothing is written."""
    from tasks import core
    from trak_core import engine
    from trak_core.errors import BadInputError

    paths = sorted(tiny.save_checkpoints(tmp_path / "ck", seeds=(0, 1)))
    sd = torch.load(paths[1], weights_only=True)
    name = next(iter(sd))
    sd[name] = torch.full_like(sd[name], float("nan"))
    torch.save(sd, paths[1])
    monkeypatch.setattr(engine, "fit_factors", lambda *a, **k: pytest.fail("fitted before every input was checked"))
    with pytest.raises(BadInputError, match=r"checkpoints\[1\]"):
        core.make_plan(config(tmp_path, paths, curvature="kfac-eigen", projector="factored"))
    assert not (tmp_path / "store.zarr").exists()


def test_eigen_store_grows_with_its_recorded_factors(tmp_path):
    """Rows appended to a ``kfac-eigen`` store are projected with the factors it recorded (fitted on the first 48
    rows): the grown store's scores are TRAKer's with those factors over all rows, its old rows untouched."""
    from flows import attribute
    from tasks.common import clear_data_cache

    paths = tiny.save_checkpoints(tmp_path / "ck", seeds=(0, 1))
    over = dict(curvature="kfac-eigen", projector="factored")
    clear_data_cache()
    attribute(config(tmp_path, paths, train_data="test_kfac_pipeline:first_48", **over))
    before = TrakStore.open(str(tmp_path / "store.zarr"), mode="r")
    kept = {mid: np.asarray(before.model(mid).grads[:]).copy() for mid in (0, 1)}
    factors = {m: kfac_record.factor_record(before, m)["sha256"] for m in (0, 1)}
    clear_data_cache()
    out = attribute(config(tmp_path, paths, **over))
    assert out["plan"].grown_from == 48
    grown = TrakStore.open(str(tmp_path / "store.zarr"), mode="r")
    assert {m: kfac_record.factor_record(grown, m)["sha256"] for m in (0, 1)} == factors
    for mid in (0, 1):
        np.testing.assert_array_equal(grown.model(mid).grads[:48], kept[mid])
    want, _ = traker_scores(tmp_path / "t", paths, "kfac-eigen", grown.meta, fit_rows=48)
    ours = np.asarray(grown.scores("tiny")[:])
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"curvature": "kfacc"}, "curvature"),
        ({"curvature": "kfac", "curvature_damping": 0}, "curvature_damping"),
        ({"curvature": "kfac", "curvature_damping": float("inf")}, "curvature_damping"),
        ({"curvature": "ekfac", "processes_per_task": 2}, "curvature='ekfac'.*processes_per_task"),
        ({"curvature": "kfac", "projector": "dense"}, "needs the factored projector"),
        ({"curvature": "kfac-eigen", "projector": "dense"}, "needs the factored projector"),
        ({"curvature": "kfac-eigen", "processes_per_task": 2}, "curvature='kfac-eigen'.*processes_per_task"),
    ],
)
def test_bad_settings_named_by_the_config(tmp_path, over, field):
    paths = tiny.save_checkpoints(tmp_path / "ck", seeds=(0,))
    with pytest.raises(ValidationError, match=field):
        config(tmp_path, paths, **over)
    assert not (tmp_path / "store.zarr").exists()
