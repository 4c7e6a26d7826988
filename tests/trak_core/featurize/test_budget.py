"""Memory by budget (trak_core.featurize.budget): sizes parsed, a budget keeps a measured peak under it, a too-small
one is
refused before any compute, and the pipeline's config, TRAKer and the engine's shard loop use it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import psutil
import pytest
from trak_fixtures import REPO_ROOT, make_data, make_model, run_traker

from examples import tiny
from tasks.config import AttributeConfig
from trak_core import TRAKer
from trak_core.errors import BadInputError
from trak_core.featurize.budget import (
    MAX_BUDGET_ROWS,
    SAFETY,
    MemoryFit,
    fit_memory,
    headroom,
    memory_limit,
    parse_bytes,
    process_rss,
    release_free_memory,
)
from trak_core.store import TrakStore

CHILD = os.path.join(os.path.dirname(__file__), "budget_child.py")


@pytest.mark.parametrize(
    ("text", "n"),
    [
        (4096, 4096),
        ("4GB", 4 * 10**9),
        ("4 gb", 4 * 10**9),
        ("3.5GiB", int(3.5 * 2**30)),
        ("512MiB", 512 * 2**20),
        ("800M", 800 * 10**6),
        ("2e9", 2 * 10**9),
        (None, None),
    ],
)
def test_sizes_parse(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("bad", ["4 parsecs", "-1GB", "0", 0, -5, "GB", True, [1]])
def test_a_bad_size_names_max_memory(bad):
    with pytest.raises(BadInputError, match="max_memory"):
        parse_bytes(bad)


# starts the child and reports, on its last stderr line, the child's peak resident memory over its whole life as the
# kernel kept it (wait4's ru_maxrss: every transient counted, none missed between samples, no core spent sampling).
# Through this small launcher, not from the test's process: a started process carries its parent's high-water mark
# into its own, which from here would be this (large) process's
LAUNCH = (
    "import os, subprocess, sys\n"
    "p = subprocess.Popen(sys.argv[1:])\n"
    "_, status, ru = os.wait4(p.pid, 0)\n"
    "print('MAXRSS_KIB', ru.ru_maxrss, file=sys.stderr)\n"
    "sys.exit(os.waitstatus_to_exitcode(status))\n"
)


def _child(store: str, rows: int, width: int, budget) -> tuple[dict, int]:
    """Run budget_child.py; (its report, the largest resident memory it had over its whole life, as the kernel
    measured it: :data:`LAUNCH`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", LAUNCH, sys.executable, CHILD, store, str(rows), str(width), str(budget)],
        capture_output=True,
        env=env,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    key, kib = proc.stderr.strip().splitlines()[-1].split()
    assert key == "MAXRSS_KIB", proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), int(kib) * 1024


@pytest.mark.slow
def test_a_budget_keeps_the_measured_peak_under_it(tmp_path):
    """One batch of an MLP (64-1024-1024-10) in a fresh process (TRAKer): without a budget its resident memory grows
    by 100-250 MB while featurizing 4,096 rows, depending on the machine's allocator, so the rows double until it
    grows by more than 250 MB (half of that leaves room for the ~50 MiB a budget keeps beside). With a budget half
    of that above its memory before featurizing, the peak (its own high-water mark over the featurize, and the
    peak resident memory over its whole life, as the kernel kept it) stays under the budget, and the rows equal the
    unbudgeted run's."""
    width = 1024
    for rows in (4096, 8192, 16384, 32768):
        free, free_sampled = _child(str(tmp_path / f"free{rows}"), rows, width, "-")
        grew = free["peak"] - free["before"]
        if grew > 250e6:  # a batch that needs memory, so that the budget binds
            break
    assert grew > 250e6, free
    budget = free["before"] + grew // 2
    assert free["peak"] > budget and free_sampled > budget  # the same batch at once exceeds it
    kept, sampled = _child(str(tmp_path / "kept"), rows, width, budget)
    assert "error" not in kept, kept
    assert kept["peak"] <= budget, (kept, budget)
    assert sampled <= budget, (sampled, budget)
    assert 1 <= kept["budget_rows"] < rows
    assert kept["featurized"] == rows
    np.testing.assert_allclose(kept["x"], free["x"], rtol=1e-3, atol=1e-4)


def test_a_budget_below_what_the_process_holds_is_refused_before_anything(tmp_path):
    small = process_rss() // 2
    with pytest.raises(BadInputError, match="max_memory: .* is below what this process holds"):
        TRAKer(
            model=make_model(),
            task="image_classification",
            train_set_size=8,
            save_dir=str(tmp_path / "s"),
            device="cpu",
            proj_dim=4,
            max_memory=small,
        )
    assert not TrakStore.exists(str(tmp_path / "s"))
    assert not (tmp_path / "s").exists()


def test_a_budget_below_one_row_is_refused_before_any_compute():
    """A budget just above what the process holds, with buffers kept beside that do not fit: refused before the
    probe computes anything."""
    calls = []
    release_free_memory()  # what fit_memory does first: a long-lived process may give back more than the reserve
    with pytest.raises(BadInputError, match="max_memory: .* below what featurizing needs before any row"):
        fit_memory(lambda r: calls.append(r), "cpu", process_rss() + (1 << 20), reserve=256 << 20)
    assert calls == []


def test_the_probe_takes_the_largest_measured_batch_that_fits():
    """A computation whose peak grows by 1 MiB a row (real allocations): the rows chosen are a measured power of
    two whose growth fits in the budget's share, and one more doubling would not."""
    held = []

    def run(rows: int) -> None:
        held.append(np.ones((rows, 1 << 17)))  # 1 MiB a row, touched
        held.clear()

    budget = process_rss() + (40 << 20)
    fit = fit_memory(run, "cpu", budget)
    rows = fit.rows_within(budget)
    room = SAFETY * (budget - fit.base)  # ~32 MiB
    assert 8 <= rows <= 32 and rows * (1 << 20) * 0.95 <= room < 2 * rows * (1 << 20) * 1.05
    assert fit.points[-1][1] >= fit.points[-1][0] * (1 << 20) * 0.9, fit.points  # not hidden by reused pages
    assert fit.rows_within(budget, reserve=budget) == 0
    assert MemoryFit(base=0, points=((1, 10), (2, 20))).rows_within(10**9, cap=1) == 1
    assert rows <= MAX_BUDGET_ROWS


def test_traker_with_a_budget_scores_as_without(tmp_path):
    """A generous budget (pieces of the measured size) changes no score: the same rows, finalized and scored."""
    data = make_data(n=64, m=5)
    ckpts = [make_model(100).state_dict()]
    free, _ = run_traker(TRAKer, tmp_path / "a", ckpts, data, batch=64, proj_dim=8)
    kept, tr = run_traker(TRAKer, tmp_path / "b", ckpts, data, batch=64, proj_dim=8, max_memory=process_rss() + 2**30)
    assert tr.featurizer.budget_rows is not None and tr.featurizer.memory_fit is not None
    np.testing.assert_allclose(kept, free, rtol=1e-5, atol=1e-6)


def test_featurize_splits_a_batch_into_pieces_of_the_budget_rows(tmp_path, monkeypatch):
    """Under a budget whose probe allows 8 rows, a batch of 20 is computed as 8 + 8 + 4, and its X is the whole
    batch's."""
    from trak_core.featurize import featurizer as fz

    data = make_data(n=20, m=2)
    tr = TRAKer(
        model=make_model(),
        task="image_classification",
        train_set_size=20,
        save_dir=str(tmp_path / "s"),
        device="cpu",
        proj_dim=4,
        max_memory=process_rss() + 2**30,
    )
    feat = tr.featurizer
    feat.memory_fit = MemoryFit(base=process_rss(), points=((1, 1), (8, 8), (16, 2**40)))
    sizes = []
    real = fz.Featurizer._compute_rows

    def counted(self, batch, model_id, indices):
        sizes.append(batch[0].shape[0])
        return real(self, batch, model_id, indices)

    feat.load_state(make_model(3).state_dict())
    whole = feat.featurize((data[0], data[1]), 0)
    monkeypatch.setattr(fz.Featurizer, "_compute_rows", counted)
    pieces = feat.featurize((data[0], data[1]), 0)
    assert sizes == [8, 8, 4]
    feat.max_memory = None
    np.testing.assert_allclose(pieces[0], whole[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(pieces[1], whole[1])
    tr._close()


def test_scoring_buffers_take_a_share_of_what_the_budget_leaves():
    from trak_core.scoring.streaming import memory_bytes

    assert headroom() is None
    with memory_limit(process_rss() + (64 << 20)):
        room = headroom()
        assert room is not None and 0 < room <= 64 << 20
        assert memory_bytes() <= 64 << 20
    assert memory_bytes() > 64 << 20 or psutil.virtual_memory().available <= 64 << 20


def test_the_pipeline_config_takes_a_size(tmp_path):
    ckpts = tiny.save_checkpoints(tmp_path / "ck", seeds=(0,))
    from trak_fixtures import tiny_attribute_config

    cfg = AttributeConfig.model_validate(tiny_attribute_config(tmp_path / "s", ckpts, max_memory="12GiB"))
    assert cfg.max_memory == 12 * 2**30
    assert AttributeConfig.model_validate(tiny_attribute_config(tmp_path / "s", ckpts)).max_memory is None
    with pytest.raises(ValueError, match="max_memory"):
        AttributeConfig.model_validate(tiny_attribute_config(tmp_path / "s", ckpts, max_memory="lots"))


def test_the_pipeline_with_a_budget_writes_the_rows_without_one(tmp_path):
    """Plan and featurize every shard with and without a budget: the same rows (the budget chooses the batch);
    a budget below what the tasks' buffers need is refused by the plan, naming max_memory, before the store is
    created."""
    from trak_fixtures import tiny_attribute_config

    from tasks import core

    ckpts = tiny.save_checkpoints(tmp_path / "ck", seeds=(0,))
    rows = {}
    for name, budget in (("free", None), ("kept", process_rss() + 2**30)):
        cfg = AttributeConfig.model_validate(tiny_attribute_config(tmp_path / name, ckpts, max_memory=budget))
        plan = core.make_plan(cfg)
        for m, shard in plan.featurize_jobs():
            core.featurize_shard(cfg, m.model_id, m.checkpoint, shard)
        rows[name] = TrakStore.open(cfg.store, mode="r").model(0).grads[:].astype(np.float64)
    np.testing.assert_allclose(rows["kept"], rows["free"], rtol=1e-3, atol=1e-4)
    cfg = AttributeConfig.model_validate(
        tiny_attribute_config(tmp_path / "small", ckpts, max_memory=1000, projector="noop", lambda_reg=1.0)
    )
    with pytest.raises(BadInputError, match="max_memory"):
        core.make_plan(cfg)
    assert not TrakStore.exists(str(tmp_path / "small"))


def test_a_budget_chooses_the_featurize_batch_of_a_shard(tmp_path):
    """The engine's shard loop under a budget: the batch is the most measured rows that fit beside the shard's
    rows and partial (not the batch_size given), at most the shard's rows; without a budget, batch_size."""
    from trak_core import engine

    x, y, _, _ = make_data(n=32, m=1)
    tr = TRAKer(
        model=make_model(),
        task="image_classification",
        train_set_size=32,
        save_dir=str(tmp_path / "s"),
        device="cpu",
        proj_dim=4,
        shard_rows=32,
        chunk_rows=8,
        max_memory=process_rss() + 2**30,
    )
    feat = tr.featurizer
    meta = tr._metadata_of(feat.projector)  # (the store is created by the first featurize call)
    feat.memory_fit = MemoryFit(base=process_rss(), points=((1, 1), (4, 4), (8, 8), (16, 2**40)))
    assert engine._budget_batch(feat, meta, 32, [x[:4], y[:4]], 0, batch_size=2) == 8
    assert engine._budget_batch(feat, meta, 6, [x[:4], y[:4]], 0, batch_size=2) == 6
    assert feat.memory_reserve > 32 * 4 * 4  # the shard's rows and its partial are counted beside
    feat.max_memory = None
    assert engine._budget_batch(feat, meta, 32, [x[:4], y[:4]], 0, batch_size=2) == 2
    tr._close()


def test_an_index_with_a_budget_answers_as_without(tmp_path):
    """TrakIndex(max_memory=...) featurizes its query batch under the budget: the same top-k; a budget below what
    the process holds is refused when the index is opened."""
    from trak_core import TrakIndex

    data = make_data(n=64, m=6)
    ckpts = [make_model(100).state_dict()]
    run_traker(TRAKer, tmp_path / "s", ckpts, data, batch=64, proj_dim=8)
    kw = dict(model=make_model(), checkpoints=ckpts, task="image_classification", device="cpu")
    free = TrakIndex(str(tmp_path / "s"), **kw).query((data[2], data[3]), k=5)
    index = TrakIndex(str(tmp_path / "s"), **kw, max_memory=process_rss() + 2**30)
    kept = index.query((data[2], data[3]), k=5)
    assert index.featurizer is not None and index.featurizer.budget_rows is not None
    np.testing.assert_array_equal(kept.indices, free.indices)
    with pytest.raises(BadInputError, match="max_memory"):
        TrakIndex(str(tmp_path / "s"), **kw, max_memory=process_rss() // 2)
