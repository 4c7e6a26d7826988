"""The stored projection depends on the rows and the store's record, never on how the rows were batched or when
the store was created: TRAKer's default projector is probed on the first min(64, n) rows featurized whatever the
batches (bit-identical stores for batches of 1, 4, 5, 32 and 100); a pipeline store created with ≥ 64 rows and
grown later equals one built at once; a store created with fewer keeps the split of those rows, and a new run
given that split (``plan.stored_projector``) reproduces it bit for bit."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from trak_fixtures import tiny_attribute_config

from examples import tiny
from tasks.common import clear_data_cache
from tasks.config import AttributeConfig
from trak_core import TRAKer, plan
from trak_core.errors import BadInputError
from trak_core.store import TrakStore

N, M, P = 100, 6, 32


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(10, 24), torch.nn.ReLU(), torch.nn.Linear(24, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )


def _data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 10, generator=g), torch.randint(0, 3, (n,), generator=g)


def _run(path, batch: int, projector=None):
    model = _model()
    ckpt = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = _data(N, 0)
    xt, yt = _data(M, 1)
    tr = TRAKer(
        model, "image_classification", N, save_dir=str(path), device="cpu", proj_dim=P, projector=projector,
        use_half_precision=False, chunk_rows=8, logging_level=logging.ERROR,
    )  # fmt: skip
    tr.load_checkpoint(ckpt, model_id=0)
    for a in range(0, N, batch):
        tr.featurize((x[a : a + batch], y[a : a + batch]), num_samples=len(x[a : a + batch]))
    tr.finalize_features()
    tr.start_scoring_checkpoint("t", ckpt, model_id=0, num_targets=M)
    tr.score((xt, yt), num_samples=M)
    scores = tr.finalize_scores("t")
    store = tr.store
    return store.meta.projector_params, np.asarray(store.model(0).grads[:]), scores


def test_traker_stores_are_bit_identical_for_any_batch_size(tmp_path):
    params, grads, scores = _run(tmp_path / "b100", 100)
    assert params["split"] == "energy"
    for batch in (1, 4, 5, 32):
        p, g, s = _run(tmp_path / f"b{batch}", batch)
        assert p == params, batch
        np.testing.assert_array_equal(g, grads, err_msg=f"batch {batch}")
        np.testing.assert_array_equal(s, scores, err_msg=f"batch {batch}")


def test_a_run_given_a_stores_projector_reproduces_it(tmp_path):
    params, grads, scores = _run(tmp_path / "a", 7)
    given = plan.stored_projector(str(tmp_path / "a"), _model())
    p, g, s = _run(tmp_path / "b", 50, projector=given)
    assert p == params
    np.testing.assert_array_equal(g, grads)
    np.testing.assert_array_equal(s, scores)
    with pytest.raises(BadInputError, match="no store"):
        plan.stored_projector(str(tmp_path / "nothing"), _model())


def test_row_slots_put_each_row_at_its_index_place_in_a_block():
    from trak_core.featurize.featurizer import ROW_BLOCK, row_slots

    assert row_slots(range(5)) == (ROW_BLOCK, [0, 1, 2, 3, 4])
    rows, slots = row_slots(range(21, 21 + 30))  # 30 rows from 21: two blocks, no place taken twice
    assert rows == 2 * ROW_BLOCK and slots[:3] == [5, 6, 7] and slots[11] == 0
    assert [s % ROW_BLOCK for s in slots] == [i % ROW_BLOCK for i in range(21, 51)] and len(set(slots)) == 30
    rows, slots = row_slots([7, 23, 39, 2])  # three rows share a place: three blocks
    assert (rows, slots) == (3 * ROW_BLOCK, [7, 23, 39, 2])


@pytest.mark.parametrize("batch", [1, 5, 7, 100])
def test_traker_computes_each_row_at_its_index_place_whatever_the_batch(tmp_path, batch, monkeypatch):
    """Where a CPU's BLAS computes a row by its place among the rows (MKL on AMD EPYC does, in blocks of 16), a
    row's bits stay the same only if it is computed at the same place in every batch: its index in the store mod
    ROW_BLOCK. Each train row's place in the padded batches the featurizer computes is checked against its index."""
    from trak_core.featurize import featurizer

    x = _data(N, 0)[0]
    places: dict[int, set[int]] = {}
    real_place = featurizer._place

    def spy(batch_, indices, rows, slots):
        out, _ = real_place(batch_, indices, rows, slots)
        for s in slots:
            hit = torch.nonzero((x == out[0][s]).all(dim=1)).reshape(-1).tolist()  # the train row it is (if any)
            for i in hit:
                places.setdefault(i, set()).add(s % featurizer.ROW_BLOCK)
        return out, _

    monkeypatch.setattr(featurizer, "_place", spy)
    _run(tmp_path / "s", batch)
    assert sorted(places) == list(range(N))
    assert all(p == {i % featurizer.ROW_BLOCK} for i, p in places.items()), places


# ------------------------------------------------------------------------------------------ the pipeline grows
def first_8():
    return tuple(t[:8] for t in tiny.train_data())


def rows_96():
    extra = tiny._make(32, 7)
    return tuple(torch.cat([a, b]) for a, b in zip(tiny.train_data(), extra, strict=True))


def _cfg(root, train):
    return AttributeConfig.model_validate(
        tiny_attribute_config(root / "s.zarr", str(root / "ck" / "model_*.pt"), train_data=train, projector="factored")
    )


def _grown_and_once(tmp_path, first: str, final: str):
    from flows import attribute

    grow, once = tmp_path / "grow", tmp_path / "once"
    for root in (grow, once):
        tiny.save_checkpoints(root / "ck", seeds=(0,))
    clear_data_cache()
    attribute(_cfg(grow, first))
    attribute(_cfg(grow, final))
    return grow, once


def _same_store(a, b) -> None:
    a, b = TrakStore.open(str(a / "s.zarr"), mode="r"), TrakStore.open(str(b / "s.zarr"), mode="r")
    assert a.meta.projector_params == b.meta.projector_params
    np.testing.assert_array_equal(a.model(0).grads[:], b.model(0).grads[:])
    np.testing.assert_array_equal(a.scores("tiny")[:], b.scores("tiny")[:])


@pytest.mark.usefixtures("prefect_harness")
def test_a_store_created_with_64_rows_grows_into_one_run(tmp_path):
    from flows import attribute

    grow, once = _grown_and_once(tmp_path, "examples.tiny:train_data", "test_same_rows_same_store:rows_96")
    attribute(_cfg(once, "test_same_rows_same_store:rows_96"))
    _same_store(grow, once)


@pytest.mark.usefixtures("prefect_harness")
def test_a_store_created_with_8_rows_keeps_their_split_and_a_run_given_it_matches(tmp_path):
    from flows import attribute

    grow, once = _grown_and_once(tmp_path, "test_same_rows_same_store:first_8", "examples.tiny:train_data")
    grown = TrakStore.open(str(grow / "s.zarr"), mode="r").meta
    # the from-scratch run probes 64 rows; given the grown store's split (its metadata created first, as the plan
    # of a new store would) it stores the same rows and scores
    cfg = _cfg(once, "examples.tiny:train_data")
    model, task = tiny.make_model(), cfg.build_task()
    split = plan.split_of(grown)
    rows = dict(chunk_rows=cfg.chunk_rows, shard_rows=cfg.shard_size)
    meta = plan.run_metadata(cfg.settings, model, task, tiny.NUM_TRAIN, **rows, split=split)
    TrakStore.create_or_open(cfg.store, meta)
    attribute(cfg)
    _same_store(grow, once)
    # a store probed on its own 64 rows has another split
    fresh = tmp_path / "fresh"
    tiny.save_checkpoints(fresh / "ck", seeds=(0,))
    attribute(_cfg(fresh, "examples.tiny:train_data"))
    assert (
        TrakStore.open(str(fresh / "s.zarr"), mode="r").meta.projector_params["energies"]
        != grown.projector_params["energies"]
    )
