"""The pipeline's scoring steps (the tasks' bodies, in the score flow's order: plan, targets per checkpoint,
prepare, score blocks) killed at every write resume with the same run and give an uninterrupted run's scores bit
for bit. A rerun here reads the flags it finds (it skips the targets and score rows marked done), so a flag
chunk written but not yet sealed for its place is read back: it must be taken for an interrupted write, not for
a moved chunk."""

from __future__ import annotations

import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from trak_fixtures import tiny_attribute_config

from examples import tiny
from tasks import core
from tasks.config import AttributeConfig
from trak_core.store import TrakStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trak_core" / "store"))
from test_scoring_kills import Killed, Writes  # noqa: E402


def first_48():
    """tiny's first 48 train rows: 3 shards of 16."""
    return tuple(t[:48] for t in tiny.train_data())


def _config(store) -> AttributeConfig:
    ck = Path(store).parent / "ck"
    # 2 score tasks: one of 2 shards (a kill between them leaves the task half done), one of 1 shard (a kill there
    # finds the first task whole): every state and kind of write of the scoring steps, in fewer writes than 64 rows
    raw = tiny_attribute_config(
        store, str(ck / "model_*.pt"), train_data="test_scoring_kills_pipeline:first_48", score_task_rows=32
    )
    return AttributeConfig.model_validate(raw)


def _featurize(cfg: AttributeConfig) -> None:
    plan = core.make_plan(cfg)
    for m, s in plan.featurize_jobs():
        core.featurize_shard(cfg, m.model_id, m.checkpoint, s)
    for mid in plan.model_ids:
        core.finalize_checkpoint(cfg, mid)


def _score(cfg: AttributeConfig) -> np.ndarray:
    plan = core.make_plan(cfg)
    for m in plan.models:
        core.featurize_targets(cfg, m.model_id, m.checkpoint)
    prep = core.prepare_scores(cfg, plan.model_ids)
    for a, b in prep.blocks:
        core.score_block(cfg, list(prep.model_ids), a, b)
    return np.asarray(TrakStore.open(cfg.store, mode="r").scores(cfg.exp_name)[:])


@pytest.fixture(scope="module")
def featurized(tmp_path_factory):
    d = tmp_path_factory.mktemp("pkills")
    tiny.save_checkpoints(d / "ck", seeds=(0,))
    _featurize(_config(d / "base.zarr"))
    shutil.copytree(d / "base.zarr", d / "ref.zarr")
    return d, _score(_config(d / "ref.zarr"))


@pytest.mark.slow
def test_a_kill_at_every_write_of_the_pipelines_scoring_resumes_bit_for_bit(featurized, monkeypatch):
    d, want = featurized
    with monkeypatch.context() as m:
        counter = Writes(m)
        shutil.copytree(d / "base.zarr", d / "count.zarr")
        np.testing.assert_array_equal(_score(_config(d / "count.zarr")), want)
    total = counter.count
    assert total > 20
    for at in range(1, total + 1):
        run = d / f"k{at}.zarr"
        shutil.copytree(d / "base.zarr", run)
        cfg = _config(run)
        with monkeypatch.context() as m:
            Writes(m, at)
            with pytest.raises(Killed):
                _score(cfg)
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                got = _score(cfg)  # the same run again
        except Exception as e:
            raise AssertionError(f"killed at write {at} of {total}: the rerun fails") from e
        assert got.tobytes() == want.tobytes(), f"killed at write {at} of {total}"
        damage = [
            str(w.message) for w in seen if "does not belong" in str(w.message) or "place record" in str(w.message)
        ]
        assert not damage, f"killed at write {at} of {total}: the crash was taken for damage: {damage[0]}"
        shutil.rmtree(run)
