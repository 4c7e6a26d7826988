"""The pipeline's factored projector: the plan probes the gradient energy once (checkpoint 0, the first 64 train
rows); the store records it and every task rebuilds the identical projector from that record, never probing again."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from trak_fixtures import tiny_attribute_config

from examples import tiny
from tasks import core
from tasks.config import AttributeConfig
from trak_core import engine
from trak_core import plan as trak_plan
from trak_core.errors import StoreMismatchError
from trak_core.projection.energy import PROBE_ROWS, quantize_energies, sketched_energies
from trak_core.projection.factored import FactoredProjector
from trak_core.store import StoreMetadata, TrakStore


def _config(tmp_path, paths, **over) -> AttributeConfig:
    return AttributeConfig.model_validate(tiny_attribute_config(tmp_path / "store.zarr", paths, **over))


def test_plan_probes_once_and_workers_rebuild_the_same_projector(tmp_path, monkeypatch):
    paths = tiny.save_checkpoints(tmp_path / "ck", seeds=(0, 1))
    cfg = _config(tmp_path, paths, projector="factored")
    calls = []
    real = engine.sketched_energies
    monkeypatch.setattr(engine, "sketched_energies", lambda *a, **k: calls.append(1) or real(*a, **k))
    plan = core.make_plan(cfg)
    assert calls == [1]
    store = TrakStore.open(cfg.store, mode="r")
    meta = store.meta
    record = meta.projector_params
    assert record["layout_version"] == 5 and record["split"] == "energy"
    # the energies of checkpoint 0 (sorted checkpoints: model_id 0) on the first 64 train rows
    model = tiny.make_model()
    model.load_state_dict(torch.load(sorted(paths)[0], weights_only=True))
    want = sketched_energies(model, "image_classification", [t[:PROBE_ROWS] for t in tiny.train_data()])
    # recorded rounded; the test's probe (another batching) agrees to that rounding, not bit for bit
    assert record["energies"] == quantize_energies(record["energies"])
    assert record["energies"] == pytest.approx(want, rel=5e-3)

    # featurize tasks (two workers of one checkpoint, one of another) and targets: the store's record, no probe
    def refuse(*a, **k):
        raise AssertionError("a task probed the gradient energy again")

    monkeypatch.setattr(engine, "sketched_energies", refuse)
    specs = [core.build_featurizer(cfg, m.checkpoint, store).projector.spec() for m in (*plan.models, plan.models[0])]
    got = StoreMetadata.from_projector(specs[0], train_set_size=meta.train_set_size).projector_params
    assert all(s == specs[0] for s in specs) and got == record
    for m, shard in plan.featurize_jobs():
        core.featurize_shard(cfg, m.model_id, m.checkpoint, shard)
    for m in plan.models:
        core.featurize_targets(cfg, m.model_id, m.checkpoint)
    # a rerun's plan takes the store's record too (no probe: another device's bits could differ)
    again = core.make_plan(cfg)
    assert again.models == plan.models
    assert core.up_to_date(cfg) is None  # nothing finalized yet; checked without a probe either


def test_a_version_4_store_keeps_its_equal_split_and_another_proj_dim_is_refused(tmp_path, monkeypatch):
    paths = tiny.save_checkpoints(tmp_path / "ck", seeds=(0,))
    cfg = _config(tmp_path, paths, projector="factored")
    v4 = FactoredProjector.from_model(tiny.make_model(), cfg.proj_dim, layout_version=4)
    rows = dict(chunk_rows=cfg.chunk_rows, shard_rows=cfg.shard_size)
    model, task, split = tiny.make_model(), cfg.build_task(), {"layout_version": 4}
    meta = trak_plan.run_metadata(cfg.settings, model, task, tiny.NUM_TRAIN, **rows, split=split)
    assert meta.projector_params == StoreMetadata.from_projector(v4.spec(), train_set_size=1).projector_params
    TrakStore.create_or_open(cfg.store, meta)  # a store as version 4's plan created it
    monkeypatch.setattr(engine, "sketched_energies", lambda *a, **k: (_ for _ in ()).throw(AssertionError("probed")))
    plan = core.make_plan(cfg)
    store = TrakStore.open(cfg.store, mode="r")
    assert store.meta.projector_params["layout_version"] == 4
    core.featurize_shard(cfg, 0, plan.models[0].checkpoint, 0)
    assert np.asarray(TrakStore.open(cfg.store, mode="r").model(0).featurized[: plan.shard_rows]).all()
    with pytest.raises(StoreMismatchError, match="proj_dim"):
        core.make_plan(_config(tmp_path, paths, projector="factored", proj_dim=8))
