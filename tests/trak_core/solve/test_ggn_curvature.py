"""The Gauss-Newton curvature (``curvature="ggn"``): A = (H + λ'I)⁻¹, H = XᵀRX + β·mean(r)·XᵀX, R = diag(r),
r = Q(1 − Q), β = GGN_FLOOR, λ' = the XᵀX rule's λ × trace(H) / trace(XᵀX) — against a float64 brute force from the
stored rows, through the store (partials on the way, or computed by finalize), TRAKer and the pipeline's
featurize/finalize tasks; a store keeps its curvature; verify sees damage to the XᵀRX partials."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trak_core import TRAKer
from trak_core.errors import BadInputError, StoreMismatchError
from trak_core.scoring.combine import combine_checkpoints
from trak_core.solve import damping, reduce
from trak_core.solve.damping import GGN_FLOOR, ggn_lambda, loss_curvature
from trak_core.store import StoreMetadata, TrakStore
from trak_core.store.verify import repair_store, verify_store

N, P, M = 300, 24, 9


def ggn_store(path, ckpts: int = 2, partials: bool = True, dtype: str = "float16") -> TrakStore:
    rng = np.random.default_rng(5)
    meta = StoreMetadata(train_set_size=N, grad_dim=100, proj_dim=P, dtype=dtype, chunk_rows=16, curvature="ggn")
    st = TrakStore.create_or_open(str(path), meta)
    st.init_experiment("e", M)
    for mid in range(ckpts):
        st.init_model(mid)
        x = rng.standard_normal((N, P)) * rng.uniform(0.2, 3.0, P)
        q = rng.uniform(0.0, 1.0, N) ** 3  # mostly confident rows (Q near 0), a few uncertain
        st.write_train_rows(mid, slice(0, N), x.astype(np.float32), q.astype(np.float32))
        if partials:
            for s in range(st.meta.num_shards):
                reduce.ensure_partial(st, mid, s)
        st.init_experiment_model("e", mid)
        st.write_target_rows("e", mid, slice(0, M), rng.standard_normal((M, P)).astype(np.float32))
    return st


def brute_force(st: TrakStore, ckpts: int, setting: str) -> tuple[np.ndarray, list[float]]:
    """float64 from the stored (rounded) X, Q and G: λ by the rule on XᵀX (rel:f: f × its mean eigenvalue),
    H = XᵀRX + β·mean(r)·XᵀX, λ' = λ · tr(H)/tr(XᵀX), A = (H + λ'I)⁻¹ / mean|·|, scores combine(Σ X A Gᵀ)."""
    f = float(setting.split(":")[1])
    acc, qsum, lams = np.zeros((N, M)), np.zeros(N), []
    for mid in range(ckpts):
        x = st.model(mid).grads[:].astype(np.float64)
        q = st.model(mid).out_to_loss[:].astype(np.float64)
        g = st.target_grads("e", mid)[:].astype(np.float64)
        r = q * (1 - q)
        xtx = x.T @ x
        h = x.T @ (x * r[:, None]) + GGN_FLOOR * r.mean() * xtx
        lam = f * np.trace(xtx) / P * np.trace(h) / np.trace(xtx)
        lams.append(lam)
        a = np.linalg.inv(h + lam * np.eye(P))
        a /= np.abs(a).mean()
        acc += (x @ a) @ g.T
        qsum += q
    return combine_checkpoints(acc, qsum, ckpts), lams


def rel(got, want) -> float:
    return float(np.abs(np.asarray(got, dtype=np.float64) - want).max() / np.abs(want).max())


@pytest.mark.parametrize("partials", [True, False])  # stored while featurizing, or computed by finalize
def test_ggn_store_scores_match_brute_force(tmp_path, partials):
    st = ggn_store(tmp_path / "s", partials=partials)
    infos = [reduce.finalize_model(st, mid, lambda_reg="rel:0.3") for mid in range(2)]
    want, lams = brute_force(st, 2, "rel:0.3")
    for info, lam in zip(infos, lams, strict=True):
        assert info["curvature"] == "ggn"
        assert info["lambda_reg"] == pytest.approx(lam, rel=1e-9)
        assert info["lambda_xtx"] > info["lambda_reg"]  # r ≤ 1/4 (floored: ≤ 0.25 + β/4): H is smaller than XᵀX
    got = reduce.finalize_scores(st, "e")
    assert rel(got, want) < 2e-5
    # the partials summed are XᵀRX's, in shard order
    x = st.model(0).grads[:].astype(np.float64)
    r = loss_curvature(st.model(0).out_to_loss[:])
    np.testing.assert_allclose(reduce.total_ggn(st, 0), x.T @ (x * r[:, None]), rtol=1e-12, atol=1e-12)


def test_ggn_differs_from_xtx_and_xtx_is_unchanged(tmp_path):
    """The same rows in an XᵀX store give XᵀX's inverse (today's scores), not XᵀRX's."""
    ggn = ggn_store(tmp_path / "g")
    meta = StoreMetadata(train_set_size=N, grad_dim=100, proj_dim=P, dtype="float16", chunk_rows=16)
    plain = TrakStore.create_or_open(str(tmp_path / "x"), meta)
    plain.init_model(0)
    plain.write_train_rows(0, slice(0, N), ggn.model(0).grads[:], ggn.model(0).out_to_loss[:])
    for s in range(meta.num_shards):
        reduce.ensure_partial(plain, 0, s)
    a_ggn, info_g = reduce.solve_model(ggn, 0, "rel:0.3")
    a_xtx, info_x = reduce.solve_model(plain, 0, "rel:0.3")
    assert "curvature" not in info_x and "ggn_partials" not in plain.model(0).group
    x = plain.model(0).grads[:].astype(np.float64)
    want = np.linalg.inv(x.T @ x + info_x["lambda_reg"] * np.eye(P))
    np.testing.assert_allclose(a_xtx, want / np.abs(want).mean(), rtol=1e-8)
    assert info_g["lambda_xtx"] == pytest.approx(info_x["lambda_reg"], rel=1e-12)
    assert not np.allclose(a_ggn, a_xtx, rtol=0.05)


def test_ggn_lambda_zero_and_bad_traces():
    assert ggn_lambda(0.0, 5.0, 1.0) == 0.0
    assert ggn_lambda(2.0, 4.0, 1.0) == 0.5
    with pytest.raises(BadInputError, match="trace"):
        ggn_lambda(1.0, 0.0, 1.0)


def test_store_keeps_its_curvature(tmp_path):
    st = ggn_store(tmp_path / "s", ckpts=1)
    meta = st.meta.model_copy(update={"curvature": "xtx"})
    with pytest.raises(StoreMismatchError, match="curvature"):
        TrakStore.create_or_open(str(tmp_path / "s"), meta)
    with pytest.raises(BadInputError, match="required"):
        st.write_partial(0, 0, np.eye(P), np.zeros(P + 3))


def test_verify_sees_damaged_ggn_partials_and_repair_recomputes_them(tmp_path):
    st = ggn_store(tmp_path / "s", ckpts=1)
    assert verify_store(st).ok
    before = np.asarray(st.model(0).ggn_partials[:])
    chunk = tmp_path / "s" / "models" / "0" / "ggn_partials" / "c" / "1" / "0"
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    chunk.write_bytes(bytes(data))
    report = verify_store(st)
    assert not report.ok
    assert [d.array for d in report.damage] == ["models/0/ggn_partials"]
    assert report.damage[0].rows == (1, 2) and report.damage[0].unit == "shards"
    repair_store(st, report)
    assert st.model(0).partial_done[:].tolist() == [1, 0] + [1] * (st.meta.num_shards - 2)
    reduce.finalize_model(st, 0, lambda_reg="rel:0.3")  # recomputes shard 1's partials from its rows
    np.testing.assert_array_equal(st.model(0).ggn_partials[:], before)
    assert verify_store(st).ok


def _mlp_case(n: int = 96):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x = torch.randn(n, 6)
    y = torch.randint(0, 3, (n,))
    return model, (x, y)


def test_traker_ggn_matches_the_store_brute_force(tmp_path):
    """TRAKer(curvature="ggn") end to end: its scores are the brute force from what it stored."""
    model, (x, y) = _mlp_case()
    tr = TRAKer(
        model, "image_classification", len(y), save_dir=str(tmp_path / "t"), device="cpu", proj_dim=16,
        lambda_reg="rel:0.3", curvature="ggn", use_half_precision=False,
    )  # fmt: skip
    for mid in range(2):
        with torch.no_grad():
            for prm in model.parameters():
                prm.add_(0.05 * torch.randn_like(prm))
        tr.load_checkpoint(model.state_dict(), model_id=mid)
        tr.featurize((x, y), num_samples=len(y))
    tr.finalize_features()
    for mid in range(2):
        tr.start_scoring_checkpoint("e", model.state_dict(), mid, 5)
        tr.score((x[:5], y[:5]), num_samples=5)
    got = tr.finalize_scores("e")
    st = tr.store
    assert st.meta.curvature == "ggn"
    acc, qsum = np.zeros((len(y), 5)), np.zeros(len(y))
    for mid in range(2):
        xs = st.model(mid).grads[:].astype(np.float64)
        q = st.model(mid).out_to_loss[:].astype(np.float64)
        g = st.target_grads("e", mid)[:].astype(np.float64)
        info = st.finalize_info(mid)
        r = q * (1 - q)
        h = xs.T @ (xs * r[:, None]) + GGN_FLOOR * r.mean() * (xs.T @ xs)
        lam = 0.3 * np.trace(xs.T @ xs) / 16 * np.trace(h) / np.trace(xs.T @ xs)
        assert info["lambda_reg"] == pytest.approx(lam, rel=1e-9)
        a = np.linalg.inv(h + lam * np.eye(16))
        acc += xs @ (a / np.abs(a).mean()) @ g.T
        qsum += q
    assert rel(np.asarray(got), combine_checkpoints(acc, qsum, 2)) < 2e-5


def test_traker_refuses_an_unknown_curvature(tmp_path):
    model, (_, y) = _mlp_case()
    with pytest.raises(BadInputError, match="curvature"):
        TRAKer(model, "image_classification", len(y), save_dir=str(tmp_path / "t"), device="cpu", curvature="hessian")


def test_device_gram_weights_rows_block_by_block(tmp_path, monkeypatch):
    """The GPU path's float64 product (run here on the CPU device, in blocks of 7 rows) scales each row by √rᵢ as the
    host's syrk does."""
    st = ggn_store(tmp_path / "s", ckpts=1, partials=False)
    rows = np.asarray(st.model(0).grads[0:80])
    r = loss_curvature(st.model(0).out_to_loss[0:80])
    monkeypatch.setattr(reduce, "DEVICE_BLOCK_BYTES", 7 * 8 * P)
    host = reduce.shard_partial(st, 0, 0, rows=rows, weights=r)
    dev = reduce._device_gram(rows, torch.device("cpu"), np.sqrt(r).reshape(-1, 1))
    np.testing.assert_allclose(dev, host, rtol=1e-12, atol=1e-12 * np.abs(host).max())
    np.testing.assert_array_equal(dev, dev.T)


def test_singular_ggn_warning_names_xtrx(tmp_path):
    """proj_dim ≥ n at λ = 0: the warning names the matrix inverted (XᵀRX, floored)."""
    from trak_core.errors import IllConditionedWarning

    n = 16
    meta = StoreMetadata(train_set_size=n, grad_dim=100, proj_dim=P, dtype="float32", chunk_rows=16, curvature="ggn")
    st = TrakStore.create_or_open(str(tmp_path / "s"), meta)
    st.init_model(0)
    rng = np.random.default_rng(2)
    st.write_train_rows(0, slice(0, n), rng.standard_normal((n, P)).astype(np.float32), np.full(n, 0.5, np.float32))
    with pytest.warns(IllConditionedWarning, match="XᵀRX has rank"):
        reduce.finalize_model(st, 0, lambda_reg=0.0)


def test_memory_estimate_counts_the_second_gram():
    """A featurize task holds two p × p float64 partials more (XᵀRX's), finalize one p × p more."""
    from trak_core.memory import estimate_task_memory

    kw = dict(
        train_set_size=10_000, grad_dim=10_000, proj_dim=2048, num_params=10_000, batch_size=64, shard_rows=4096,
        dtype_bytes=2, chunk_bytes=1 << 20,
    )  # fmt: skip
    xtx, ggn = estimate_task_memory(**kw), estimate_task_memory(**kw, curvature="ggn")
    p2 = 2048 * 2048 * 8
    assert ggn[0].total - xtx[0].total == 2 * p2  # featurize
    assert ggn[1].total - xtx[1].total == p2  # finalize


@pytest.mark.parametrize("curvature", ["xtx", "ggn"])
def test_shard_grams_are_shard_partials_bits(tmp_path, curvature):
    """Both Grams from one float64 copy of the rows: the bits of XᵀX and of XᵀRX computed one at a time."""
    st = ggn_store(tmp_path / "s", ckpts=1, partials=False)
    if curvature == "xtx":
        meta = st.meta.model_copy(update={"curvature": "xtx"})
        st = TrakStore.create_or_open(str(tmp_path / "x"), meta)
    rng = np.random.default_rng(9)
    rows = rng.standard_normal((40, P)).astype(np.float32)
    q = rng.uniform(0, 1, 40).astype(np.float32)
    xtx, ggn = reduce.shard_grams(st, 0, 0, rows, q)
    np.testing.assert_array_equal(xtx, reduce.shard_partial(st, 0, 0, rows=rows))
    if curvature == "xtx":
        assert ggn is None
    else:
        np.testing.assert_array_equal(ggn, reduce.shard_partial(st, 0, 0, rows=rows, weights=loss_curvature(q)))
        assert not np.array_equal(ggn, xtx)


def test_ggn_condition_bound_bounds_the_condition_number():
    """0 ⪯ XᵀWX ⪯ max(w)·XᵀX: (max(w)·σ_max(XᵀX) + λ)/λ is at least the condition number of XᵀWX + λI, also from
    float32-rounded eigenvalues; no bound without damping."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((200, 40)) * np.logspace(0, -2, 40)
    w = rng.uniform(0, 1, 200) ** 4 + 0.01
    h = x.T @ (x * w[:, None])
    ev = np.linalg.eigvalsh(x.T @ x)
    for lam in (1e-6, 1e-3, 1.0):
        exact = np.linalg.cond(h + lam * np.eye(40))
        for eig in (ev, ev.astype(np.float32)):
            bound = damping.ggn_condition_bound(eig, float(w.max()), lam)
            assert bound is not None and exact <= bound
        # the bound is what 0 ⪯ H ⪯ max(w)·XᵀX gives: tight when one row's weight dominates the top direction
        assert bound == pytest.approx((w.max() * ev.max() + lam) / lam, rel=1e-3)
    assert damping.ggn_condition_bound(ev, float(w.max()), 0.0) is None


def test_ggn_solve_takes_the_bound_instead_of_estimating_the_condition(tmp_path, monkeypatch):
    """At proj_dim > EXACT_CONDITION_MAX_P with the default rule (XᵀX's eigenvalues known), the ggn solve reports the
    bound as its condition estimate and runs no subspace iteration; its inverse is (H + λ'I)⁻¹ in float64."""
    n, p = 900, damping.EXACT_CONDITION_MAX_P + 40
    rng = np.random.default_rng(6)
    meta = StoreMetadata(
        train_set_size=n, grad_dim=10_000, proj_dim=p, dtype="float32", chunk_rows=300, curvature="ggn"
    )
    st = TrakStore.create_or_open(str(tmp_path / "s"), meta)
    st.init_model(0)
    x = (rng.standard_normal((n, p)) * np.logspace(0, -1.5, p)).astype(np.float32)
    q = (rng.uniform(0, 1, n) ** 3).astype(np.float32)
    st.write_train_rows(0, slice(0, n), x, q)

    def no_estimate(*_a, **_k):
        raise AssertionError("the condition was estimated although a bound was known")

    monkeypatch.setattr(damping, "_top_eigenvalue", no_estimate)
    info = reduce.finalize_model(st, 0, lambda_reg="adaptive")  # TRAKer's default
    xd = x.astype(np.float64)
    r = loss_curvature(q)
    h = xd.T @ (xd * r[:, None]) + GGN_FLOOR * r.mean() * (xd.T @ xd)
    reg = h + info["lambda_reg"] * np.eye(p)
    assert np.linalg.cond(reg) <= info["condition"] < 1e7
    want = np.linalg.inv(reg)
    np.testing.assert_allclose(st.inverse(0), want / np.abs(want).mean(), rtol=1e-7, atol=1e-9)


def test_shard_grams_on_a_device_are_the_hosts_grams(tmp_path, monkeypatch):
    """The device branch (a GPU in production; here the CPU device standing in for it): XᵀX unweighted, XᵀRX
    with √r, both equal to the host's syrk to float64 rounding."""
    st = ggn_store(tmp_path / "s", ckpts=1, partials=False)
    rows = np.asarray(st.model(0).grads[0:80])
    q = np.asarray(st.model(0).out_to_loss[0:80])
    real = reduce._device_gram
    seen = []

    def on_cpu(x, device, scale=None):
        seen.append(device.type)
        return real(x, torch.device("cpu"), scale)

    monkeypatch.setattr(reduce, "_device_gram", on_cpu)
    xtx, ggn = reduce.shard_grams(st, 0, 0, rows, q, device="meta")
    assert seen == ["meta", "meta"]
    host_xtx, host_ggn = reduce.shard_grams(st, 0, 0, rows, q)
    np.testing.assert_allclose(xtx, host_xtx, rtol=1e-12, atol=1e-12 * np.abs(host_xtx).max())
    np.testing.assert_allclose(ggn, host_ggn, rtol=1e-12, atol=1e-12 * np.abs(host_ggn).max())


def _tiny_gpt():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=11, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    return GPT2LMHeadModel(cfg).eval()


@pytest.mark.parametrize("curvature", ["ggn", "xtx"])
def test_ggn_with_a_causal_lm_warns_on_both_routes(tmp_path, curvature):
    """curvature='ggn' on task='causal_lm' (r = Q(1 − Q) ≈ each sequence's probability ≈ 0) is allowed with a warning
    naming both, from TRAKer and from the pipeline's input check (the same rule); 'xtx' does not warn."""
    import warnings

    from trak_core.featurize.modelout import resolve_task
    from trak_core.plan import check_inputs
    from trak_core.settings import TrakSettings

    ids = torch.randint(2, 11, (12, 8), generator=torch.Generator().manual_seed(1))
    data = (ids, torch.ones_like(ids), ids.clone())
    model = _tiny_gpt()
    torch.save(model.state_dict(), tmp_path / "c.pt")
    routes = {
        "TRAKer": lambda: TRAKer(
            model=model,
            task="causal_lm",
            train_set_size=12,
            save_dir=str(tmp_path / "s"),
            device="cpu",
            proj_dim=8,
            curvature=curvature,
            logging_level=40,
        ),  # fmt: skip
        "pipeline": lambda: check_inputs(
            TrakSettings(proj_dim=8, curvature=curvature),
            model,
            resolve_task("causal_lm"),
            data,
            data,
            [str(tmp_path / "c.pt")],
            location=str(tmp_path / "p"),
            batch_size=4,
        ),  # fmt: skip
    }
    for route, build in routes.items():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            build()
        named = [w for w in seen if "curvature='ggn' with task='causal_lm'" in str(w.message)]
        assert len(named) == (curvature == "ggn"), (route, [str(w.message) for w in seen])
