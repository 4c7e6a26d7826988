"""TrakIndex on TRAKer-built stores: top-k (both ends) equal to finalize_scores' on the same inputs, bit for
bit; ties ranked by the lower train index; bad input refused in one line; a store held by a run."""

from __future__ import annotations

import gc
import json
import os
import socket

import numpy as np
import pytest
import torch
from trak_fixtures import checkpoints, make_data, make_model, run_traker

from trak_core import TRAKer, TrakIndex
from trak_core.errors import BadInputError, StateError, StoreMismatchError
from trak_core.scoring.index import RunningTopK
from trak_core.store import StoreLock, TrakStore

N, M = 300, 9


def ranked(scores: np.ndarray, opponents: bool = False) -> np.ndarray:
    """(m, n) train rows per target by score (descending; ascending for opponents), ties by the lower row."""
    rows = np.arange(scores.shape[0])
    return np.stack([np.lexsort((rows, scores[:, j] if opponents else -scores[:, j])) for j in range(scores.shape[1])])


@pytest.fixture(scope="module", params=[True, False], ids=["float16", "float32"])
def built(request, tmp_path_factory):
    """A TRAKer store of 2 checkpoints, its finalize_scores and the targets it scored."""
    d = tmp_path_factory.mktemp("idx")
    data = make_data(n=N, m=M)
    ck = checkpoints(2)
    _, tr = run_traker(TRAKer, d / "s.zarr", ck, data, half=request.param, lambda_reg=1e-2, proj_dim=32)
    return d / "s.zarr", ck, data, np.asarray(tr.scores)


def open_index(built, **kw) -> TrakIndex:
    store, ck, _, _ = built
    return TrakIndex(store, model=make_model(), checkpoints=ck, task="image_classification", device="cpu", **kw)


@pytest.mark.parametrize("k", [1, 10, N])
def test_query_equals_finalize_scores_top_k_both_ends(built, k):
    _, _, (_, _, xt, yt), scores = built
    index = open_index(built)
    top = index.query((xt, yt), k=k)
    low = index.query((xt, yt), k=k, opponents=True)
    for res, opp in ((top, False), (low, True)):
        want = ranked(scores, opp)[:, :k]
        assert res.indices.shape == res.scores.shape == (M, k)
        np.testing.assert_array_equal(res.indices, want)
        np.testing.assert_array_equal(res.scores, np.take_along_axis(scores.T, want, 1))  # the same bits
        assert res.opponents is opp and res.model_ids == (0, 1)
    assert (np.diff(top.scores, axis=1) <= 0).all() and (np.diff(low.scores, axis=1) >= 0).all()


def test_query_is_per_input(built):
    """An input's answer does not depend on the other inputs of the batch (up to float32 rounding: one input is
    a matrix-vector product, several a GEMM, which sum in another order)."""
    _, _, (_, _, xt, yt), scores = built
    index = open_index(built)
    one = index.query((xt[3:4], yt[3:4]), k=7)
    np.testing.assert_array_equal(one.indices[0], ranked(scores)[3, :7])
    np.testing.assert_allclose(one.scores[0], scores[ranked(scores)[3, :7], 3], rtol=2e-4)


def test_one_checkpoint_of_the_store(built, tmp_path):
    """model_ids= picks checkpoints: the same as finalize_scores over that checkpoint alone."""
    import shutil

    from trak_core.solve.reduce import finalize_scores

    store, ck, (_, _, xt, yt), _ = built
    shutil.copytree(store, tmp_path / "c.zarr")
    ref = finalize_scores(TrakStore.open(str(tmp_path / "c.zarr")), "exp", [1])
    index = TrakIndex(store, model=make_model(), checkpoints=[ck[1]], model_ids=[1], device="cpu")
    res = index.query((xt, yt), k=5)
    np.testing.assert_array_equal(res.indices, ranked(ref)[:, :5])
    np.testing.assert_array_equal(res.scores, np.take_along_axis(ref.T, res.indices, 1))


def test_running_top_k_ties_and_order():
    """Equal scores rank by the lower row whatever order the blocks come in; -0.0 equals 0.0."""
    rng = np.random.default_rng(0)
    scores = rng.integers(-3, 4, size=(200, 5)).astype(np.float32)  # many ties
    scores[scores == 0] = -0.0
    scores[::7] = 0.0
    for k in (1, 4, 200):
        for opp in (False, True):
            want = ranked(scores + 0.0, opp)[:, :k]
            blocks = [(a, min(a + 33, 200)) for a in range(0, 200, 33)]
            for order in (blocks, blocks[::-1], [blocks[i] for i in rng.permutation(len(blocks))]):
                t = RunningTopK(5, k, opp)
                for a, b in order:
                    t.add(a, scores[a:b])
                idx, val = t.result()
                np.testing.assert_array_equal(idx, want)
                np.testing.assert_array_equal(val, np.take_along_axis((scores + 0.0).T, want, 1))
    t = RunningTopK(1, 2)
    t.add(0, np.array([[np.float32(-1e30)], [np.float32(3.5)], [np.float32(-np.inf)]]))
    assert t.result()[0].tolist() == [[1, 0]] and t.result()[1].tolist() == [[3.5, np.float32(-1e30)]]


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "make_batch, match",
    [
        (lambda xt, yt: (xt[:, :5], yt), "the model cannot take it"),
        (lambda xt, yt: (xt.double(), yt), "torch.float64 but the model's parameters are torch.float32"),
        (lambda xt, yt: (xt, yt.float()), "labels must be a 1-d integer tensor"),
        (lambda xt, yt: (xt, yt[:3]), "different batch sizes"),
        (lambda xt, yt: xt, "list or tuple of tensors"),
        (lambda xt, yt: (xt.clone().index_fill_(0, torch.tensor([2]), float("nan")), yt), r"NaN or inf .* \[2\]"),
    ],
)
def test_bad_query_batch_one_line(built, make_batch, match):
    _, _, (_, _, xt, yt), _ = built
    index = open_index(built)
    with pytest.raises(BadInputError, match=match) as e:
        index.query(make_batch(xt, yt), k=3)
    assert "\n" not in str(e.value) and str(e.value).startswith("query batch")


@pytest.mark.parametrize("k", [0, -1, N + 1, 2.5, True, "3"])
def test_bad_k(built, k):
    _, _, (_, _, xt, yt), _ = built
    with pytest.raises(BadInputError, match=rf"k=.*from 1 to the store's {N} train rows"):
        open_index(built).query((xt, yt), k=k)


def test_bad_checkpoints_and_settings(built):
    store, ck, _, _ = built
    with pytest.raises(BadInputError, match=r"checkpoints: 1 given for the store's 2 checkpoints"):
        TrakIndex(store, model=make_model(), checkpoints=ck[:1], device="cpu")
    with pytest.raises(BadInputError, match="model_ids: 5 is not in the store"):
        TrakIndex(store, model=make_model(), checkpoints=ck[:1], model_ids=[5], device="cpu")
    with pytest.raises(StoreMismatchError, match="task: the store .* ImageClassificationModelOutput"):
        TrakIndex(store, model=make_model(), checkpoints=ck, task="text_classification", device="cpu")
    wide = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    with pytest.raises(StoreMismatchError, match="grad_dim="):
        TrakIndex(store, model=wide, checkpoints=[wide.state_dict()] * 2, device="cpu")
    # not the recorded checkpoint's content (checked before it is loaded into the model)
    with pytest.raises(StoreMismatchError, match=r"checkpoints\[0\]: the state dict is not the checkpoint model_id=0"):
        TrakIndex(store, model=make_model(), checkpoints=[{"0.weight": torch.zeros(4, 8)}] * 2, device="cpu")
    from trak_core.featurize.gradients import grad_dim_of
    from trak_core.projection.projectors import make_projector

    other = make_projector("factored", grad_dim_of(make_model()), 32, 7, model=make_model())
    with pytest.raises(StoreMismatchError, match="projector: proj_seed=7, but the store .* proj_seed=0"):
        TrakIndex(store, model=make_model(), checkpoints=ck, projector=other, device="cpu")


def test_store_that_is_not_finalized(tmp_path):
    x, y, _, _ = make_data(n=40)
    tr = TRAKer(make_model(), "image_classification", 40, save_dir=str(tmp_path / "s"), device="cpu", proj_dim=8)
    tr.load_checkpoint(checkpoints(1)[0], model_id=0)
    tr.featurize((x, y), num_samples=40)
    tr._flush_rows()
    # the TRAKer holds the store while it lives: the error names it
    with pytest.raises(StateError, match=r"model_id=0 in .* is not finalized \(run TRAKer .*holds the store\)"):
        TrakIndex(tmp_path / "s", model=make_model(), checkpoints=checkpoints(1), device="cpu")
    del tr
    gc.collect()
    with pytest.raises(StateError, match=r"model_id=0 in .* is not finalized: finalize it"):
        TrakIndex(tmp_path / "s", model=make_model(), checkpoints=checkpoints(1), device="cpu")
    hold_lock(tmp_path / "s", os.getppid())  # a run is featurizing it: the error says which
    with pytest.raises(StateError, match=r"is not finalized \(run nightly-42, pid \d+ on .*, holds the store\)"):
        TrakIndex(tmp_path / "s", model=make_model(), checkpoints=checkpoints(1), device="cpu")


# ---------------------------------------------------------------------------- a run holds the store
def hold_lock(store, pid: int) -> None:
    holder = {"host": socket.gethostname(), "pid": pid, "run": "nightly-42", "since": 0, "token": "t"}
    (store / StoreLock.NAME).write_text(json.dumps(holder))


def test_locked_store_reads_a_consistent_snapshot(built):
    """A live run holds the lock: the finalized checkpoints are queried as they are (the same answer)."""
    store, _, (_, _, xt, yt), scores = built
    hold_lock(store, os.getppid())
    try:
        res = open_index(built).query((xt, yt), k=4)
        np.testing.assert_array_equal(res.indices, ranked(scores)[:, :4])
    finally:
        (store / StoreLock.NAME).unlink()


def test_locked_store_changing_during_a_query_is_refused(built, tmp_path, monkeypatch):
    """A run that clears a checkpoint's finalize record while a query reads it: the query says so."""
    import shutil

    store = tmp_path / "copy.zarr"
    shutil.copytree(built[0], store)
    _, ck, (_, _, xt, yt), _ = built
    index = TrakIndex(store, model=make_model(), checkpoints=ck, device="cpu")
    hold_lock(store, os.getppid())
    add = RunningTopK.add
    info = TrakStore.open(str(store), mode="r").finalize_info(1)

    def run_refinalizes(self, a, s):
        TrakStore.open(str(store)).model(1).group.attrs["finalize"] = {**info, "lambda": 0.5}
        return add(self, a, s)

    monkeypatch.setattr(RunningTopK, "add", run_refinalizes)
    with pytest.raises(StateError, match=r"changed during the query \(model_ids \[1\]\) \(run nightly-42") as e:
        index.query((xt, yt), k=3)
    assert "\n" not in str(e.value)
    monkeypatch.setattr(RunningTopK, "add", add)
    with pytest.raises(StateError, match="changed since the index was opened"):
        index.query((xt, yt), k=3)
    res = TrakIndex(store, model=make_model(), checkpoints=ck, device="cpu").query((xt, yt), k=3)
    assert res.indices.shape == (M, 3)


def test_index_opens_the_store_read_only(built):
    store = built[0]
    before = {p: p.stat().st_mtime_ns for p in store.rglob("*") if p.is_file()}
    _, _, (_, _, xt, yt), _ = built
    open_index(built).query((xt, yt), k=2)
    assert {p: p.stat().st_mtime_ns for p in store.rglob("*") if p.is_file()} == before


def test_query_both_is_one_pass_of_both_ends(built, monkeypatch):
    """query_both: the two queries' answers from one featurization and one pass over the rows."""
    import trak_core.scoring.index as index_mod

    _, _, (_, _, xt, yt), _ = built
    index = open_index(built)
    calls = []
    real = index_mod.stream_scores
    monkeypatch.setattr(index_mod, "stream_scores", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    top, low = index.query_both((xt, yt), k=6)
    assert len(calls) == 1
    for res, opp in ((top, False), (low, True)):
        one = index.query((xt, yt), k=6, opponents=opp)
        np.testing.assert_array_equal(res.indices, one.indices)
        np.testing.assert_array_equal(res.scores, one.scores)
