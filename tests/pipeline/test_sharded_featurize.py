"""The featurize task of one (checkpoint, shard) run by 2 processes with the model sharded across them (FSDP2, gloo on
the CPU; tasks/sharded.py): the scores equal the unsharded run's within float32 rounding, and a run whose rank 1 dies
in the second shard leaves the first shard complete and the second unmarked; the rerun skips the first and completes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

pytest.importorskip("transformers")
pytest.importorskip("torch.distributed.fsdp")

import sharded_models as sm  # noqa: E402
from trak_fixtures import tiny_attribute_config  # noqa: E402

from tasks import core  # noqa: E402
from tasks.config import AttributeConfig  # noqa: E402
from trak_core.store import TrakStore  # noqa: E402

SHARD = 16  # 32 train rows: 2 shards


def _config(tmp_path, name: str, **over) -> AttributeConfig:
    ck = tmp_path / "ck.pt"
    if not ck.exists():
        torch.save(sm.make_model().state_dict(), ck)
    fields = dict(
        model="sharded_models:make_model",
        train_data="sharded_models:train_data",
        target_data="sharded_models:target_data",
        exp_name="s",
        proj_dim=24,
        lambda_reg=1e-2,
        batch_size=4,
        shard_size=SHARD,
        projector="factored",
        dtype="float32",  # rows compared within float32 rounding (float16 storage would round them apart)
    )
    cfg = tiny_attribute_config(tmp_path / name, [str(ck)], **{**fields, **over})
    return AttributeConfig.model_validate(cfg)


def _featurize(cfg: AttributeConfig) -> list[bool]:
    plan = core.make_plan(cfg)
    return [core.featurize_shard(cfg, m.model_id, m.checkpoint, s).skipped for m, s in plan.featurize_jobs()]


def _finish(cfg: AttributeConfig) -> np.ndarray:
    core.finalize_checkpoint(cfg, 0)
    core.featurize_targets(cfg, 0, cfg.checkpoint_paths[0])
    sp = core.prepare_scores(cfg, [0])
    for a, b in sp.blocks:
        core.score_block(cfg, list(sp.model_ids), a, b)
    return TrakStore.open(cfg.store, mode="r").scores("s")[:]


def test_sharded_featurize_task_matches_unsharded_and_resumes_after_a_rank_dies(tmp_path, monkeypatch):
    ref_cfg = _config(tmp_path, "ref")
    _featurize(ref_cfg)
    want = _finish(ref_cfg)

    cfg = _config(tmp_path, "sharded", processes_per_task=2, model="sharded_models:make_dying_model")
    die = tmp_path / "die"
    die.write_text(str(SHARD + 5))  # a row of rank 1 in the second shard's first step
    monkeypatch.setenv(sm.DIE_AT_ROW_ENV, str(die))
    with pytest.raises(RuntimeError, match="its 2 processes stopped.*rerun to resume"):
        _featurize(cfg)
    store = TrakStore.open(cfg.store, mode="r")
    flags = store.model(0).featurized[:].astype(bool)
    assert flags[:SHARD].all() and not flags[SHARD:].any()  # the first shard complete, the second not marked
    die.unlink()
    assert _featurize(cfg) == [True, False]  # the rerun skips the complete shard
    x_ref = TrakStore.open(ref_cfg.store, mode="r").read_train_rows(0, 0, 2 * SHARD)
    x_got = TrakStore.open(cfg.store, mode="r").read_train_rows(0, 0, 2 * SHARD)
    np.testing.assert_allclose(x_got[0], x_ref[0], rtol=1e-4, atol=1e-5 * np.abs(x_ref[0]).max())
    np.testing.assert_allclose(x_got[1], x_ref[1], rtol=1e-5, atol=1e-7)
    got = _finish(cfg)
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())


def test_sharded_featurize_refuses_a_vmap_projector_before_anything(tmp_path):
    with pytest.raises(ValidationError, match="needs projector 'factored': projector 'dense'"):
        _config(tmp_path, "d", processes_per_task=2, projector="dense")
    assert not (tmp_path / "d").exists()
