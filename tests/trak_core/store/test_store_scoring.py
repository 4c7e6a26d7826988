"""The store (layout, status, reopen, fsspec) and the streaming linear algebra against exact float64 math."""

import warnings

import numpy as np
import pytest
import torch
from trak_fixtures import checkpoints, make_data, rel_err, run_traker

import trak_core
from trak_core.errors import IllConditionedWarning, StoreMismatchError
from trak_core.solve import damping, reduce
from trak_core.store import StoreMetadata, TrakStore


def meta(**kw):
    base = dict(train_set_size=50, grad_dim=30, proj_dim=6, dtype="float32", chunk_rows=5, shard_rows=10)
    base.update(kw)
    return StoreMetadata(**base)


def filled_store(location, rng, q=None, **kw):
    st = TrakStore.create_or_open(location, meta(**kw))
    st.init_model(0)
    x = rng.standard_normal((50, 6)).astype(np.float32)
    q = rng.uniform(0, 1, 50).astype(np.float32) if q is None else q
    for a in range(0, 50, 10):  # shard by shard, like the pipeline
        st.write_train_rows(0, slice(a, a + 10), x[a : a + 10], q[a : a + 10])
    return st, x, q


@pytest.mark.parametrize("rows", [(0, None), (0, 5), (7, 23), (49, 50)])
def test_finalize_stores_the_inverse_and_features_on_demand_equal_exact_math(tmp_path, rows):
    st, x, _ = filled_store(str(tmp_path / "s"), np.random.default_rng(0))
    lam = 0.3
    info = reduce.finalize_model(st, 0, lambda_reg=lam, rescale=False)
    xd = x.astype(np.float64)
    inv = np.linalg.inv(xd.T @ xd + lam * np.eye(6))
    np.testing.assert_allclose(st.inverse(0), inv, rtol=1e-6)  # stored in float32
    assert st.model(0).inverse_done[:].all() and "features" not in st.model(0).group
    a, b = rows
    np.testing.assert_allclose(reduce.features_rows(st, 0, a, b), (xd @ inv)[a:b], rtol=1e-5, atol=1e-6)
    assert info["lambda_reg"] == lam and info["condition"] == pytest.approx(np.linalg.cond(xd.T @ xd + lam * np.eye(6)))
    # the partials sum to XᵀX
    np.testing.assert_allclose(reduce.total_xtx(st, 0), xd.T @ xd, rtol=1e-12)


def test_scores_stream_and_combine(tmp_path):
    rng = np.random.default_rng(1)
    st = TrakStore.create_or_open(str(tmp_path / "s"), meta())
    xs, qs, gs = [], [], []
    st.init_experiment("e", 4)
    for mid in (0, 3):
        st.init_model(mid)
        x = rng.standard_normal((50, 6)).astype(np.float32)
        q = rng.uniform(0, 1, 50).astype(np.float32)
        st.write_train_rows(mid, slice(0, 50), x, q)
        reduce.finalize_model(st, mid, lambda_reg=0.0, rescale=True)
        st.init_experiment_model("e", mid)
        g = rng.standard_normal((4, 6)).astype(np.float32)
        st.write_target_rows("e", mid, slice(0, 4), g)
        xs.append(x.astype(np.float64)), qs.append(q.astype(np.float64)), gs.append(g.astype(np.float64))
    got = reduce.finalize_scores(st, "e", block_rows=15)
    acc = 0
    for x, g in zip(xs, gs):
        inv = np.linalg.inv(x.T @ x)
        acc = acc + x @ (inv / np.abs(inv).mean()) @ g.T
    want = (acc / 2) * ((qs[0] + qs[1]) / 2)[:, None]
    assert rel_err(got, want) < 1e-5
    np.testing.assert_array_equal(st.scores("e")[:], got)
    status = st.status()
    assert status["models"][3] == {"featurized": 50, "of": 50, "finalized": True}
    assert status["experiments"]["e"]["scored_models"] == [0, 3]


def test_partial_work_is_visible(tmp_path):
    st = TrakStore.create_or_open(str(tmp_path / "s"), meta())
    st.init_model(2)
    st.write_train_rows(2, slice(10, 20), np.ones((10, 6), np.float32), np.ones(10, np.float32))
    reopened = TrakStore.open(str(tmp_path / "s"))
    assert reopened.shard_featurized(2, 1) and not reopened.shard_featurized(2, 0)
    assert reopened.status()["models"][2]["featurized"] == 10
    assert not reopened.is_finalized(2)


def test_fsspec_memory_url_roundtrip():
    """A non-local fsspec filesystem, available offline."""
    url = "memory://trakflow-test/store1"
    st, x, _ = filled_store(url, np.random.default_rng(2))
    reduce.finalize_model(st, 0, lambda_reg=0.1)
    again = TrakStore.open(url)
    np.testing.assert_array_equal(again.model(0).grads[:], x)
    assert again.is_finalized(0)


def test_traker_on_fsspec_file_url_equals_local_path(tmp_path):
    data = make_data()
    ck = checkpoints(2)
    a, _ = run_traker(trak_core.TRAKer, tmp_path / "local", ck, data, proj_dim=32, lambda_reg=1e-3)
    b, _ = run_traker(trak_core.TRAKer, f"file://{tmp_path}/viaurl", ck, data, proj_dim=32, lambda_reg=1e-3)
    np.testing.assert_array_equal(a, b)


def test_condition_warnings_and_clean_case():
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((100, 5)))
    xtx = x.T @ x
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cond = damping.check_conditioning(xtx, 0.0, 100)
    assert cond == pytest.approx(float(torch.linalg.cond(xtx)), rel=1e-6)
    singular = xtx.clone()
    singular[:, 0] = singular[:, 1]
    singular[0, :] = singular[1, :]
    with pytest.warns(IllConditionedWarning, match="badly conditioned"):
        damping.check_conditioning(singular, 0.0, 100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        damping.check_conditioning(singular, 1.0, 100)  # λ fixes it


def test_inverse_float64_and_rescale():
    rng = np.random.default_rng(4)
    a = rng.standard_normal((20, 4))
    xtx = torch.from_numpy(a.T @ a)
    inv = damping.regularized_inverse(xtx, 0.5, rescale=False)
    assert inv.dtype == torch.float64
    np.testing.assert_allclose(inv.numpy(), np.linalg.inv(a.T @ a + 0.5 * np.eye(4)), rtol=1e-12)
    r = damping.regularized_inverse(xtx, 0.5, rescale=True)
    assert float(r.abs().mean()) == pytest.approx(1.0)


def test_metadata_validation():
    with pytest.raises(ValueError, match="multiple of chunk_rows"):
        meta(shard_rows=12)
    with pytest.raises(ValueError, match="proj_dim"):
        meta(proj_dim=0)
    with pytest.raises(ValueError, match="dtype"):
        meta(dtype="float64")


def test_open_missing_store_is_clear(tmp_path):
    with pytest.raises(trak_core.BadInputError, match="no trakflow store"):
        TrakStore.open(str(tmp_path / "nothing"))


def test_relative_damping_resolves_against_mean_eigenvalue():
    rng = np.random.default_rng(5)
    a = rng.standard_normal((40, 6))
    xtx = torch.from_numpy(a.T @ a)
    mean_eig = float(np.linalg.eigvalsh(a.T @ a).mean())
    assert damping.resolve_lambda("rel:0.5", xtx) == pytest.approx(0.5 * mean_eig)
    assert damping.resolve_lambda("auto", xtx) == pytest.approx(damping.AUTO_DAMPING * mean_eig)
    assert damping.resolve_lambda(0.25, xtx) == 0.25
    # scale-free: scaling the gradients by s scales λ by s²
    assert damping.resolve_lambda("rel:0.5", 9 * xtx) == pytest.approx(9 * 0.5 * mean_eig)
    for bad in ("fancy", "rel:x", "rel:-1", -0.1):
        with pytest.raises(ValueError, match="lambda_reg"):
            damping.resolve_lambda(bad, xtx)


def test_relative_damping_in_finalize_equals_absolute(tmp_path):
    st, x, _ = filled_store(str(tmp_path / "a"), np.random.default_rng(6))
    info = reduce.finalize_model(st, 0, lambda_reg="rel:0.2", rescale=False)
    xd = x.astype(np.float64)
    lam = 0.2 * np.trace(xd.T @ xd) / 6
    assert info["lambda_reg"] == pytest.approx(lam) and info["lambda_setting"] == "rel:0.2"
    np.testing.assert_allclose(st.inverse(0), np.linalg.inv(xd.T @ xd + lam * np.eye(6)), rtol=1e-6)


def test_traker_features_on_demand_and_no_features_array(tmp_path):
    """The store keeps no Φ: TRAKer.features computes X A from the stored gradients and inverse (float64 reference),
    and traker's del_grads=True is refused politely (a warning; the gradients are what scoring reads)."""
    scores, tr = run_traker(trak_core.TRAKer, tmp_path / "t", checkpoints(2), make_data(), proj_dim=16, lambda_reg=1e-2)
    for mid in (0, 1):
        x = tr.store.model(mid).grads[:].astype(np.float64)
        xtx = x.T @ x
        inv = np.linalg.inv(xtx + 1e-2 * np.eye(16))
        want = x @ (inv / np.abs(inv).mean())  # traker's rescaled inverse
        assert rel_err(tr.features(mid), want) < 1e-5
        assert rel_err(tr.features(mid, 10, 30), want[10:30]) < 1e-5
        assert "features" not in tr.store.model(mid).group
    with pytest.warns(UserWarning, match="del_grads=True is ignored"):
        tr.finalize_features(del_grads=True)
    np.testing.assert_array_equal(tr.finalize_scores("exp"), scores.astype(np.float32))  # gradients kept
    with pytest.raises(ValueError, match=r"rows \[30, 500\) are not within the 120 train rows"):
        tr.features(0, 30, 500)


def test_schema_2_store_is_refused_naming_the_field(tmp_path):
    st, _, _ = filled_store(str(tmp_path / "s"), np.random.default_rng(8))
    attrs = dict(st.root.attrs["trakflow"])
    attrs["schema_version"] = 2
    st.root.attrs["trakflow"] = attrs
    with pytest.raises(StoreMismatchError, match=r"schema_version: the store at .* has schema_version=2.*Use a new"):
        TrakStore.open(str(tmp_path / "s"))
