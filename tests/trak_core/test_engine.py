"""trak_core.engine: both front doors (the pipeline's steps, TRAKer) drive the same engine functions, and TRAKer
gets the engine's checks: the store's run lock, bounds before anything is created, one checkpoint per model id."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from trak_fixtures import REPO_ROOT, tiny_attribute_config

from examples import tiny
from tasks.config import AttributeConfig
from trak_core import engine
from trak_core.compat.traker import TRAKer
from trak_core.errors import BadInputError, StoreLockedError, StoreMismatchError

REPO = REPO_ROOT
SHARD = 16


def _traker(save_dir, **kw) -> TRAKer:
    kw = {"proj_dim": 16, "lambda_reg": 1e-3, "chunk_rows": 8, "shard_rows": SHARD, **kw}
    return TRAKer(
        model=tiny.make_model(),
        task="image_classification",
        train_set_size=tiny.NUM_TRAIN,
        save_dir=str(save_dir),
        device="cpu",
        logging_level=100,
        **kw,
    )


def _traker_run(t: TRAKer, state: dict) -> np.ndarray:
    x, y = tiny.train_data()
    t.load_checkpoint(state, model_id=0)
    for a in range(0, tiny.NUM_TRAIN, 8):
        t.featurize((x[a : a + 8], y[a : a + 8]), num_samples=8)
    t.finalize_features()
    tx, ty = tiny.target_data()
    t.start_scoring_checkpoint("tiny", state, model_id=0, num_targets=tiny.NUM_TARGETS)
    t.score((tx, ty), num_samples=tiny.NUM_TARGETS)
    return t.finalize_scores("tiny")


def _pipeline_run(cfg: AttributeConfig) -> None:
    from tasks import core

    plan = core.make_plan(cfg)
    for m, shard in plan.featurize_jobs():
        core.featurize_shard(cfg, m.model_id, m.checkpoint, shard)
    for m in plan.models:
        core.finalize_checkpoint(cfg, m.model_id)
        core.featurize_targets(cfg, m.model_id, m.checkpoint)
    sp = core.prepare_scores(cfg, plan.model_ids)
    for a, b in sp.blocks:
        core.score_block(cfg, list(sp.model_ids), a, b)


STEPS = (
    "store_metadata",
    "open_run",
    "check_memory",
    "check_featurize_memory",
    "check_finalize_memory",
    "plan_model",
    "check_model",
    "write_rows",
    "complete_shard",
    "shard_partials",
    "finalize",
    "plan_experiment",
    "target_rows",
    "featurize_targets",
    "featurize_shard",
    "prepare_scores",
    "score_block",
    "score_all",
)


def _count_calls(monkeypatch) -> dict[str, int]:
    from trak_core.featurize import row_sink

    calls: dict[str, int] = {}
    for name in STEPS:
        # the engine's steps; those the row sink runs for TRAKer (write_rows, complete_shard) are its own names
        for module in (engine, row_sink) if hasattr(row_sink, name) else (engine,):
            real = getattr(module, name)

            def counted(*a, _real=real, _name=name, **k):
                calls[_name] = calls.get(_name, 0) + 1
                return _real(*a, **k)

            monkeypatch.setattr(module, name, counted)
    return calls


def test_both_front_doors_drive_the_engine(tmp_path, monkeypatch):
    """The steps each front door runs are engine functions; the shared ones are the same for both."""
    paths = tiny.save_checkpoints(tmp_path / "ck", seeds=(0,))
    calls = _count_calls(monkeypatch)
    _pipeline_run(
        AttributeConfig.model_validate(
            tiny_attribute_config(tmp_path / "p", paths, projector="dense", shard_size=SHARD)
        )
    )
    pipeline = set(calls)
    calls.clear()
    _traker_run(_traker(tmp_path / "t"), torch.load(paths[0], weights_only=True))
    traker = set(calls)
    shared = {"store_metadata", "open_run", "check_finalize_memory", "plan_model", "check_model", "write_rows"}
    shared |= {"finalize", "plan_experiment"}
    assert shared - pipeline == set() and shared - traker == set()
    # a shard's partial: the pipeline's featurize task computes and stores it; TRAKer on a CPU leaves it to finalize
    assert {"featurize_shard", "shard_partials", "featurize_targets", "prepare_scores", "score_block"} <= pipeline
    assert {"check_featurize_memory", "target_rows", "score_all"} <= traker
    assert "check_memory" in pipeline  # the plan's bounds: featurize and finalize tasks of the config's sizes


def test_traker_and_pipeline_give_the_same_scores(tmp_path):
    """Same settings, one checkpoint: the two front doors store the same scores, bit for bit; and TRAKer's default
    projector, probed on the same 64 rows, is the one the pipeline's plan recorded."""
    from trak_core.projection.energy import PROBE_ROWS
    from trak_core.projection.projectors import make_projector, rebuild_kwargs
    from trak_core.store import TrakStore

    paths = tiny.save_checkpoints(tmp_path / "ck", seeds=(0,))
    cfg = AttributeConfig.model_validate(
        tiny_attribute_config(tmp_path / "p", paths, projector="factored", shard_size=SHARD, dtype="float16")
    )
    _pipeline_run(cfg)
    meta = TrakStore.open(cfg.store, mode="r").meta
    assert meta.projector_params["split"] == "energy"
    model = tiny.make_model()
    kw = rebuild_kwargs("factored", meta.projector_params)
    proj = make_projector("factored", meta.grad_dim, 16, 0, device="cpu", model=model, **kw)
    t = _traker(tmp_path / "t", projector=proj)
    got = _traker_run(t, torch.load(paths[0], weights_only=True))
    want = TrakStore.open(cfg.store, mode="r").scores("tiny")[:]
    np.testing.assert_array_equal(got, want)
    assert tiny.NUM_TRAIN == PROBE_ROWS  # the default's first featurize call of all rows probes the plan's rows
    d = _traker(tmp_path / "d")
    d.load_checkpoint(torch.load(paths[0], weights_only=True), model_id=0)
    d.featurize(tiny.train_data(), num_samples=tiny.NUM_TRAIN)
    # the two probes block their sums differently (TRAKer's passes of proj_max_batch_size, the plan's of
    # batch_size): equal to the energies' rounding, which is what decides the split
    mine, theirs = dict(d.store.meta.projector_params), dict(meta.projector_params)
    assert mine.pop("energies") == pytest.approx(theirs.pop("energies"), rel=5e-3)
    mine.pop("layout"), theirs.pop("layout")
    assert mine == theirs


def test_concurrent_traker_on_one_save_dir_is_refused(tmp_path):
    """A second process's TRAKer on a save_dir a live TRAKer uses gets one StoreLockedError line; once the first
    is gone, it proceeds."""
    save_dir = tmp_path / "s"
    first = _traker(save_dir)
    assert (save_dir / "trakflow.lock").exists()
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}, {str(Path(__file__).parent)!r}]
        from test_engine import _traker
        from trak_core.errors import StoreLockedError
        try:
            _traker({str(save_dir)!r})
        except StoreLockedError as e:
            print("refused:", e)
            sys.exit(3)
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    refused = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert refused.returncode == 3, refused.stderr[-2000:]
    (line,) = refused.stdout.strip().splitlines()
    assert "in use by run TRAKer" in line and str(os.getpid()) in line, line
    # a second TRAKer of the same process shares the lock; the lock goes with the last of them
    second = _traker(save_dir)
    del first
    gc.collect()
    assert (save_dir / "trakflow.lock").exists()
    del second
    gc.collect()
    assert not (save_dir / "trakflow.lock").exists()
    after = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert after.returncode == 0 and after.stdout.strip() == "ok", after.stderr[-2000:]


def test_the_lock_check_can_fail_on_a_live_holder(tmp_path):
    """A live holder of another process (here: a lock file naming this machine's pid 1) refuses a TRAKer."""
    from trak_core.store import StoreLock

    save_dir = tmp_path / "s"
    save_dir.mkdir()
    (save_dir / StoreLock.NAME).write_text(
        json.dumps({"host": socket.gethostname(), "pid": 1, "run": "other", "since": 0, "token": "t"})
    )
    with pytest.raises(StoreLockedError, match="in use by run other"):
        _traker(save_dir)


def test_bounds_before_allocation(tmp_path):
    """proj_dim=10**9: refused naming proj_dim and the estimate, before anything is created."""
    save_dir = tmp_path / "deep" / "s"
    with pytest.raises(BadInputError, match=r"^proj_dim: a featurize task would need about .* of memory"):
        _traker(save_dir, proj_dim=10**9)
    assert not (tmp_path / "deep").exists()


def test_other_checkpoint_for_an_existing_model_id_is_refused(tmp_path):
    paths = tiny.save_checkpoints(tmp_path / "ck", seeds=(0, 1))
    a, b = (torch.load(p, weights_only=True) for p in paths)
    save_dir = tmp_path / "s"
    t = _traker(save_dir)
    x, y = tiny.train_data()
    t.load_checkpoint(a, model_id=0)
    t.featurize((x[:8], y[:8]), num_samples=8)
    t.load_checkpoint({k: v.clone() for k, v in a.items()}, model_id=0)  # the same checkpoint: fine
    with pytest.raises(
        StoreMismatchError, match=r"^checkpoints: the state dict is not the checkpoint model_id=0 .*content differs"
    ):
        t.load_checkpoint(b, model_id=0)
    t.load_checkpoint(b, model_id=1)  # another id: fine
    del t
    gc.collect()
    with pytest.raises(StoreMismatchError, match="model_id=0"):  # a rerun in a new TRAKer too
        _traker(save_dir).load_checkpoint(b, model_id=0)
    gc.collect()
    fresh = _traker(save_dir, load_from_save_dir=False)  # starting over: the new checkpoint replaces the old
    fresh.load_checkpoint(b, model_id=0)
    assert fresh.store.checkpoint_record(0)["state_sha256"] == engine.state_fingerprint(b)


def test_state_fingerprint_sees_names_dtypes_shapes_and_values():
    sd = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(2)}
    base = engine.state_fingerprint(sd)
    assert engine.state_fingerprint({k: v.clone() for k, v in reversed(sd.items())}) == base
    for other in (
        {"w": sd["w"].double(), "b": sd["b"]},
        {"w": sd["w"].reshape(3, 2), "b": sd["b"]},
        {"w2": sd["w"], "b": sd["b"]},
        {"w": sd["w"] + 1e-7, "b": sd["b"]},
    ):
        assert engine.state_fingerprint(other) != base
