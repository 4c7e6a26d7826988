"""Data selection (trak_core.scoring.selection) on TRAKer-built stores: each train row's summed influence equals the
sum of
``finalize_scores``' columns (both checked against float64), one streamed pass with one column, the checkpoints
combined as the index's scoring combines them (bit for bit), the ranking's ties, and bad sizes refused before any
compute."""

from __future__ import annotations

import numpy as np
import pytest
from trak_fixtures import checkpoints, make_data, make_model, run_traker

from trak_core import TRAKer, TrakIndex
from trak_core.errors import BadInputError, StateError
from trak_core.scoring.selection import rank_rows, select, target_sums
from trak_core.store import TrakStore

N, M = 300, 9


@pytest.fixture(scope="module", params=[True, False], ids=["float16", "float32"])
def built(request, tmp_path_factory):
    """A TRAKer store of 2 checkpoints, its finalize_scores and the targets it scored."""
    d = tmp_path_factory.mktemp("sel")
    data = make_data(n=N, m=M)
    ck = checkpoints(2)
    _, tr = run_traker(TRAKer, d / "s.zarr", ck, data, half=request.param, lambda_reg=1e-2, proj_dim=32)
    return d / "s.zarr", ck, data, np.asarray(tr.scores)


def open_index(built) -> TrakIndex:
    store, ck, _, _ = built
    return TrakIndex(store, model=make_model(), checkpoints=ck, task="image_classification", device="cpu")


def float64_sums(store_path) -> np.ndarray:
    """Σ_j S[:, j] in float64 from the stored X, Q, inverses and target gradients (traker's combination)."""
    store = TrakStore.open(str(store_path), mode="r")
    ids = store.model_ids()
    acc = np.zeros(N)
    q = np.zeros(N)
    for mid in ids:
        x = store.model(mid).grads[:].astype(np.float64)
        g = store.target_grads("exp", mid)[:].astype(np.float64)
        acc += x @ (store.inverse(mid).astype(np.float64) @ g.sum(axis=0))
        q += store.model(mid).out_to_loss[:].astype(np.float64).reshape(-1)
    return (acc / len(ids)) * (q / len(ids))


def ranked(col: np.ndarray, opponents: bool = False) -> np.ndarray:
    rows = np.arange(col.shape[0])
    return np.lexsort((rows, col if opponents else -col))


@pytest.mark.parametrize("opponents", [False, True])
def test_summed_influence_equals_the_sum_of_finalize_scores_columns(built, opponents):
    store, _, (_, _, xt, yt), scores = built
    sel = select(open_index(built), (xt, yt), fraction=0.1, opponents=opponents)
    brute = scores.astype(np.float64).sum(axis=1)  # the n × m array the selection never forms
    ref = float64_sums(store)
    scale = np.abs(ref).max()
    ours, theirs = np.abs(sel.row_scores - ref).max(), np.abs(brute - ref).max()
    # float32 rounding only (XᵀX + λI has a condition number of ~3e4 here): as close as the brute force is
    assert ours <= 3e-4 * scale and theirs <= 3e-4 * scale and ours <= 3 * theirs
    assert sel.k == 30 and sel.num_targets == M and sel.model_ids == (0, 1) and sel.opponents is opponents
    np.testing.assert_array_equal(sel.indices, ranked(brute, opponents)[:30])
    np.testing.assert_array_equal(sel.scores, sel.row_scores[sel.indices])
    assert (np.diff(sel.scores) >= 0).all() if opponents else (np.diff(sel.scores) <= 0).all()
    assert sel.fraction == pytest.approx(0.1)


def test_one_pass_of_one_column_combined_as_the_index_scores(built, monkeypatch):
    """One stream over the rows with ONE right-hand column per checkpoint, whose scores are those the index gives
    for one input with the summed gradients, bit for bit (the same stream, the same combination)."""
    import trak_core.scoring.selection as selection_mod

    _, _, (_, _, xt, yt), _ = built
    index = open_index(built)
    calls = []
    real = selection_mod.stream_scores

    def spy(store, exp, ids, a, b, targets, **kw):
        calls.append((type(kw["sink"]).__name__, tuple(kw["out"].shape), [tuple(t.shape) for t in targets.values()]))
        return real(store, exp, ids, a, b, targets, **kw)

    monkeypatch.setattr(selection_mod, "stream_scores", spy)
    sel = select(index, (xt, yt), k=N)
    assert calls == [("_IntoVector", (N, 1), [(32, 1), (32, 1)])]  # nothing written to the store
    sums, m = target_sums(index, (xt, yt))
    assert m == M
    one = index.query_vectors({mid: s.astype(np.float32)[None] for mid, s in sums.items()}, k=N)
    np.testing.assert_array_equal(one.indices[0], sel.indices)
    np.testing.assert_array_equal(one.scores[0], sel.scores)


def test_vectors_and_batches_of_targets_agree(built):
    _, _, (_, _, xt, yt), _ = built
    index = open_index(built)
    whole = select(index, (xt, yt), k=12)
    scale = np.abs(whole.row_scores).max()
    small = select(index, (xt, yt), k=12, batch_size=2)  # summed over 5 featurize calls
    vec = select(index, vectors=index.featurize((xt, yt)), k=12)
    for other in (small, vec):
        np.testing.assert_array_equal(other.indices, whole.indices)
        # float32 rounding (a batch's per-example gradients are computed in another order)
        np.testing.assert_allclose(other.row_scores, whole.row_scores, rtol=0, atol=5e-5 * scale)
    # a store path opens its own index
    store, ck, _, _ = built
    by_path = select(store, (xt, yt), k=12, model=make_model(), checkpoints=ck, device="cpu")
    np.testing.assert_array_equal(by_path.indices, whole.indices)


def test_rank_rows_ties_by_the_lower_row_at_both_ends():
    s = np.array([1.0, 3.0, 3.0, -0.0, 0.0, 3.0, -2.0, -2.0], dtype=np.float32)
    idx, sc = rank_rows(s, 2)
    assert idx.tolist() == [1, 2] and sc.tolist() == [3.0, 3.0]  # the edge cuts a tie: the lower rows
    assert rank_rows(s, 4)[0].tolist() == [1, 2, 5, 0]
    assert rank_rows(s, 1, opponents=True)[0].tolist() == [6]
    assert rank_rows(s, 4, opponents=True)[0].tolist() == [6, 7, 3, 4]  # -0.0 and 0.0 tie
    assert rank_rows(s, 8)[0].tolist() == [1, 2, 5, 0, 3, 4, 6, 7]


@pytest.mark.parametrize(
    "kw, match",
    [
        ({}, "give exactly one of fraction= and k="),
        ({"fraction": 0.1, "k": 3}, "give exactly one of fraction= and k="),
        ({"fraction": 0.0}, r"fraction=0.0: must be in \(0, 1\]"),
        ({"fraction": 1.5}, r"fraction=1.5: must be in \(0, 1\]"),
        ({"fraction": float("nan")}, r"fraction=nan: must be in \(0, 1\]"),
        ({"fraction": 0.001}, "fraction=0.001 of the store's 300 train rows selects no row"),
        ({"fraction": "0.1"}, "fraction='0.1': must be a number"),
        ({"k": 0}, "k=0: must be an integer from 1 to the store's 300 train rows"),
        ({"k": N + 1}, "k=301: must be an integer from 1"),
        ({"k": True}, "k=True: must be an integer"),
        ({"k": 2.0}, "k=2.0: must be an integer"),
    ],
)
def test_bad_sizes_are_refused_before_any_compute(built, monkeypatch, kw, match):
    import trak_core.scoring.selection as selection_mod

    _, _, (_, _, xt, yt), _ = built
    index = open_index(built)
    monkeypatch.setattr(selection_mod, "stream_scores", lambda *a, **k: pytest.fail("computed"))
    monkeypatch.setattr(index, "featurize", lambda *a, **k: pytest.fail("featurized"))
    with pytest.raises(BadInputError, match=match) as e:
        select(index, (xt, yt), **kw)
    assert "\n" not in str(e.value)


def test_bad_targets_are_refused(built):
    store, ck, (_, _, xt, yt), _ = built
    index = open_index(built)
    with pytest.raises(BadInputError, match="give exactly one of targets .* and vectors"):
        select(index, fraction=0.1)
    with pytest.raises(BadInputError, match="give exactly one of targets .* and vectors"):
        select(index, (xt, yt), vectors=index.featurize((xt, yt)), fraction=0.1)
    with pytest.raises(BadInputError, match=r"vectors: expected \(m, 32\) arrays"):
        select(index, vectors={0: np.zeros((3, 31)), 1: np.zeros((3, 31))}, k=1)
    with pytest.raises(BadInputError, match=r"vectors: one \(m, 32\) array per model_id \[0, 1\]"):
        select(index, vectors={0: np.zeros((3, 32))}, k=1)
    with pytest.raises(BadInputError, match=r"vectors\[1\]: NaN or inf"):
        select(index, vectors={0: np.zeros((3, 32)), 1: np.full((3, 32), np.nan)}, k=1)
    with pytest.raises(BadInputError, match="query batch"):
        select(index, (xt, yt[:3]), k=1)
    with pytest.raises(BadInputError, match="batch_size=0"):
        select(index, (xt, yt), k=1, batch_size=0)
    with pytest.raises(BadInputError, match=r"\['device'\]: index arguments are given with an index"):
        select(index, (xt, yt), k=1, device="cpu")
    bare = TrakIndex(store)
    with pytest.raises(StateError, match="this index has no model"):
        select(bare, (xt, yt), k=1)
    # without a model, the targets' projected gradients still select
    res = select(bare, vectors=index.featurize((xt, yt)), k=5)
    np.testing.assert_array_equal(res.indices, select(index, (xt, yt), k=5).indices)


def test_selection_reads_the_store_only(built):
    store = built[0]
    before = {p: p.stat().st_mtime_ns for p in store.rglob("*") if p.is_file()}
    _, _, (_, _, xt, yt), _ = built
    select(open_index(built), (xt, yt), fraction=0.5)
    assert {p: p.stat().st_mtime_ns for p in store.rglob("*") if p.is_file()} == before


def test_store_changing_during_a_selection_is_refused(built, tmp_path, monkeypatch):
    """A run that re-finalizes a checkpoint while a selection reads it: refused, as a query is."""
    import shutil

    from trak_core.scoring.selection import _IntoVector

    store = tmp_path / "copy.zarr"
    shutil.copytree(built[0], store)
    _, ck, (_, _, xt, yt), _ = built
    index = TrakIndex(store, model=make_model(), checkpoints=ck, device="cpu")
    info = TrakStore.open(str(store), mode="r").finalize_info(0)

    def run_refinalizes(self, a, b, scores):
        TrakStore.open(str(store)).model(0).group.attrs["finalize"] = {**info, "lambda": 0.5}

    monkeypatch.setattr(_IntoVector, "rows", run_refinalizes)
    with pytest.raises(StateError, match=r"changed during the selection \(model_ids \[0\]\)"):
        select(index, (xt, yt), k=3)
    with pytest.raises(StateError, match="changed since the index was opened"):
        select(index, (xt, yt), k=3)
