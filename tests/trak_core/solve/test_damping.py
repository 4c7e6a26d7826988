"""The adaptive damping rule (lambda_reg 'adaptive' / 'deff:<c>') against exact float64 math."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trak_core.errors import BadInputError
from trak_core.solve.damping import (
    ADAPTIVE,
    ADAPTIVE_NEFF,
    AUTO_DAMPING,
    deff_lambda,
    effective_dimension,
    parse_lambda_reg,
    resolve_lambda,
)


def _xtx(n: int, p: int, seed: int = 0, decay: float = 0.9) -> torch.Tensor:
    g = np.random.default_rng(seed)
    x = g.standard_normal((n, p)) * decay ** np.arange(p) * 10.0
    return torch.from_numpy(x.T @ x)


def _deff_exact(xtx: torch.Tensor, lam: float) -> float:
    """trace(XᵀX (XᵀX + λI)⁻¹), by a float64 solve (no eigenvalues)."""
    a = xtx.to(torch.float64)
    return float(torch.trace(torch.linalg.solve(a + lam * torch.eye(a.shape[0], dtype=torch.float64), a)))


@pytest.mark.parametrize("n,p", [(200, 50), (30, 80), (64, 64), (500, 40)])
@pytest.mark.parametrize("c", [0.01, 0.05, 0.1, 0.5, 0.9])
def test_resolved_lambda_solves_its_equation(n, p, c):
    """d_eff(λ) = trace(XᵀX (XᵀX + λI)⁻¹) = min(c·n, min(n, p) / 2), by a float64 solve."""
    xtx = _xtx(n, p)
    lam = resolve_lambda(f"deff:{c}", xtx, n_rows=n)
    assert lam > 0
    assert _deff_exact(xtx, lam) == pytest.approx(min(c * n, min(n, p) / 2), rel=1e-8)


def _xq(n: int, p: int, seed: int = 0):
    g = np.random.default_rng(seed)
    x = g.standard_normal((n, p)) * 0.9 ** np.arange(p) * 10.0
    q = g.uniform(0.0, 1.0, n)
    return x, q


def _resolve_from_rows(setting, x: np.ndarray, q: np.ndarray) -> float:
    xt = torch.from_numpy(x)
    return parse_lambda_reg(setting).resolve(
        xt.T @ xt, n_rows=x.shape[0], xtq=torch.from_numpy(x.T @ q), qtq=float(q @ q)
    )


@pytest.mark.parametrize("n,p", [(200, 50), (30, 80)])
def test_resid_is_the_rayleigh_quotient_of_the_out_to_loss_vector(n, p):
    """resid:k = k · qᵀXXᵀq / qᵀq, by brute force over the rows (no XᵀX, no eigenvalues)."""
    x, q = _xq(n, p, seed=n)
    want = float(q @ (x @ (x.T @ q))) / float(q @ q)
    assert _resolve_from_rows("resid:1", x, q) == pytest.approx(want, rel=1e-12)
    assert _resolve_from_rows("resid:2.5", x, q) == pytest.approx(2.5 * want, rel=1e-12)
    # exactly 0 when q is orthogonal to the columns of X (a converged checkpoint: no loss gradient left)
    q_perp = q - x @ np.linalg.lstsq(x, q, rcond=None)[0]
    if n > p:
        assert _resolve_from_rows("resid:1", x, q_perp) == pytest.approx(0.0, abs=1e-12 * want)


def test_joined_rules_take_the_largest_lambda():
    x, q = _xq(150, 40, seed=5)
    xtx = torch.from_numpy(x.T @ x)
    parts = {s: _resolve_from_rows(s, x, q) for s in ("deff:0.1", "resid:3", "rel:0.5", "2.0")}
    for joined in ("deff:0.1,resid:3", "resid:3,rel:0.5", "deff:0.1,rel:0.5,2.0", "deff:0.1,resid:3,rel:0.5"):
        want = max(parts[s] for s in joined.split(","))
        assert _resolve_from_rows(joined, x, q) == pytest.approx(want, rel=1e-12)
    # the deff part still solves its equation exactly inside a joined rule
    lam = _resolve_from_rows("deff:0.1,resid:0", x, q)
    assert _deff_exact(xtx, lam) == pytest.approx(15.0, rel=1e-8)


def test_adaptive_records_its_parts_and_equals_them():
    rule = parse_lambda_reg("Adaptive ")
    assert rule.setting == ADAPTIVE and ADAPTIVE != "adaptive"  # a store records what computed its features
    assert parse_lambda_reg("deff").setting == ADAPTIVE
    assert f"neff:{ADAPTIVE_NEFF:g}" in ADAPTIVE.split(",")
    assert parse_lambda_reg("deff:0.25").setting == "deff:0.25"
    assert parse_lambda_reg(" Deff:0.10 , RESID:3 ").setting == "deff:0.1,resid:3"
    x, q = _xq(100, 40)
    assert _resolve_from_rows("deff:0.1,resid:3", x, q) > 0
    assert parse_lambda_reg(ADAPTIVE).needs_xtq == ("resid:" in ADAPTIVE)
    rule = parse_lambda_reg(ADAPTIVE)
    assert rule.needs_row_norm4 and rule.needs_q2x2  # the default needs the per-shard row sums


def test_resid_without_xtq_is_a_clear_error():
    xtx = _xtx(50, 20)
    with pytest.raises(BadInputError, match="needs Xᵀq"):
        resolve_lambda("deff:0.1,resid:3", xtx, 50)
    with pytest.raises(BadInputError, match="not finite"):
        parse_lambda_reg("resid:1").resolve(xtx, 50, xtq=torch.full((20,), math.nan), qtq=1.0)
    assert parse_lambda_reg("resid:1").resolve(xtx, 50, xtq=torch.zeros(20), qtq=0.0) == 0.0  # q = 0: no damping


def test_monotone_in_the_fraction_and_scale_equivariant():
    xtx = _xtx(120, 60, seed=3)
    lams = [resolve_lambda(f"deff:{c}", xtx, n_rows=120) for c in (0.05, 0.1, 0.2, 0.24, 0.3)]
    assert all(a > b for a, b in zip(lams[:4], lams[1:4], strict=False))  # more effective dimensions: less damping
    assert resolve_lambda("deff:0.2", 7.0 * xtx, n_rows=120) == pytest.approx(7.0 * lams[2], rel=1e-9)
    assert lams[-1] == resolve_lambda("deff:0.9", xtx, n_rows=120)  # 0.3·120 = 36 and 108: both at the cap 60 / 2
    ev = torch.linalg.eigvalsh(xtx)
    ds = [effective_dimension(ev, lam) for lam in (1e-3, 1e-1, 1e1, 1e3)]
    assert all(a > b for a, b in zip(ds, ds[1:], strict=False))


def test_rank_deficient_counts_the_rank_not_p():
    xtx = _xtx(20, 100)  # rank 20 < p
    lam = resolve_lambda("deff:0.25", xtx, n_rows=20)
    assert _deff_exact(xtx, lam) == pytest.approx(5.0, rel=1e-7)
    assert resolve_lambda("deff:0.25", xtx) == pytest.approx(lam, rel=1e-12)  # n_rows is implied by the rank


def test_deff_lambda_with_numpy_eigenvalues():
    ev = np.array([4.0, 1.0, 0.25, 0.0, -1e-18])
    lam = deff_lambda(ev, 0.4)  # rank 3 → target min(0.4·3, 3/2) = 1.2
    assert sum(s / (s + lam) for s in ev[:3]) == pytest.approx(1.2, rel=1e-10)
    assert effective_dimension(ev, 0.0) == 3


@pytest.mark.parametrize("xtx", [torch.zeros(5, 5, dtype=torch.float64), torch.full((3, 3), math.nan)])
def test_no_positive_spectrum_is_a_clear_error(xtx):
    with pytest.raises(BadInputError, match="no positive eigenvalue"):
        resolve_lambda("deff:0.1", xtx)


@pytest.mark.parametrize(
    "bad",
    [
        "deff:0",
        "deff:1",
        "deff:-0.1",
        "deff:1.5",
        "deff:x",
        "deff:nan",
        "resid:-1",
        "resid:x",
        "resid:inf",
        "deff:0.1,",
        "deff:0.1,big",
        "deff:0.1,rel:-1",
        "deff:0.1,-2",
        "res:1",
        "neff:0",
        "neff:1",
        "neff:x",
        "cresid:-1",
        "cresid:x",
    ],
)
def test_bad_fractions_are_refused(bad):
    with pytest.raises(BadInputError, match="lambda_reg"):
        parse_lambda_reg(bad)


def test_existing_settings_unchanged():
    xtx = _xtx(50, 20)
    mean_eig = float(torch.trace(xtx)) / 20
    assert resolve_lambda("auto", xtx) == pytest.approx(AUTO_DAMPING * mean_eig)
    assert resolve_lambda("rel:0.1", xtx) == pytest.approx(0.1 * mean_eig)
    assert resolve_lambda(0.5, xtx) == 0.5 and resolve_lambda("0", xtx) == 0.0


def test_symmetric_eigenvalues_equal_torch_eigvalsh():
    """The fast CPU eigenvalue path (LAPACK's MRRR driver) gives torch.linalg.eigvalsh's values to round-off,
    on a full-rank and a rank-deficient (n < p) XᵀX."""
    from trak_core.solve.damping import symmetric_eigenvalues

    g = torch.Generator().manual_seed(3)
    for n, p in ((300, 64), (40, 64)):
        x = torch.randn(n, p, generator=g, dtype=torch.float64)
        xtx = x.T @ x
        ours = symmetric_eigenvalues(xtx.float())
        ref = torch.linalg.eigvalsh(xtx.float().double())
        assert ours.dtype == torch.float64 and ours.shape == (p,)
        assert torch.allclose(ours, ref, rtol=1e-10, atol=1e-9 * float(ref[-1]))
        assert bool((ours[1:] >= ours[:-1]).all())


def test_pipeline_resolves_resid_from_the_stored_rows(tmp_path):
    """finalize (TRAKer → reduce.solve_model) resolves a joined rule with Xᵀq, qᵀq summed over the stored rows:
    λ = max(deff λ, k · qᵀXXᵀq / qᵀq), by brute force over the stored gradients and out-to-loss weights."""
    import trak_fixtures as tf

    from trak_core import TRAKer

    _, tr = tf.run_traker(TRAKer, tmp_path / "t", tf.checkpoints(2), tf.make_data(n=90), lambda_reg="deff:0.2,resid:3")
    for mid in range(2):
        m = tr.store.model(mid)
        x = np.asarray(m.grads[:]).astype(np.float64)
        q = np.asarray(m.out_to_loss[:], dtype=np.float64).reshape(-1)
        want = max(
            resolve_lambda("deff:0.2", torch.from_numpy(x.T @ x), n_rows=90),
            3.0 * float(q @ (x @ (x.T @ q))) / float(q @ q),
        )
        info = tr.store.finalize_info(mid)
        assert info["lambda_setting"] == "deff:0.2,resid:3"
        assert info["lambda_reg"] == pytest.approx(want, rel=1e-9)


# ---------------------------------------------------------------- 'neff': deff with the rows' effective number
def _rows_with_uneven_norms(n: int, p: int, seed: int = 1) -> np.ndarray:
    g = np.random.default_rng(seed)
    x = g.standard_normal((n, p)) * 0.9 ** np.arange(p) * 10.0
    return x * g.lognormal(0.0, 1.0, n)[:, None]  # a few rows carry most of the gradient


@pytest.mark.parametrize("n,p", [(200, 50), (30, 80), (400, 128)])
@pytest.mark.parametrize("c", [0.05, 0.12, 0.3])
def test_neff_solves_deff_with_the_rows_participation_ratio(n, p, c):
    """neff:c: d_eff(λ) = trace(XᵀX (XᵀX + λI)⁻¹) = min(c · (Σ‖xᵢ‖²)² / Σ‖xᵢ‖⁴, rank / 2), the effective number
    of rows by a loop over the rows and d_eff by a float64 solve."""
    x = _rows_with_uneven_norms(n, p)
    sq = [float(row @ row) for row in x]
    n_eff = sum(sq) ** 2 / sum(v * v for v in sq)
    assert n_eff < 0.8 * n  # uneven norms: fewer effective rows than rows
    xtx = torch.from_numpy(x.T @ x)
    lam = parse_lambda_reg(f"neff:{c}").resolve(xtx, n_rows=n, row_norm4=sum(v * v for v in sq))
    assert _deff_exact(xtx, lam) == pytest.approx(min(c * n_eff, min(n, p) / 2), rel=1e-8)


def test_neff_equals_deff_when_rows_have_equal_norms():
    g = np.random.default_rng(2)
    x = g.standard_normal((300, 40))
    x /= np.linalg.norm(x, axis=1, keepdims=True)  # every ‖xᵢ‖ = 1: n_eff = n
    xtx = torch.from_numpy(x.T @ x)
    assert parse_lambda_reg("neff:0.05").resolve(xtx, n_rows=300, row_norm4=300.0) == pytest.approx(
        resolve_lambda("deff:0.05", xtx, n_rows=300), rel=1e-10
    )


def test_neff_joined_and_normalized():
    x, q = _xq(150, 40)
    xt = torch.from_numpy(x)
    kw = dict(n_rows=150, xtq=torch.from_numpy(x.T @ q), qtq=float(q @ q), row_norm4=float(((x**2).sum(1) ** 2).sum()))
    rule = parse_lambda_reg(" NEFF:0.120 , Resid:2 ")
    assert rule.setting == "neff:0.12,resid:2" and rule.needs_row_norm4 and rule.needs_xtq
    parts = [parse_lambda_reg(s).resolve(xt.T @ xt, **kw) for s in ("neff:0.12", "resid:2")]
    assert rule.resolve(xt.T @ xt, **kw) == max(parts)


def test_neff_without_row_norms_is_a_clear_error():
    xtx = _xtx(50, 20)
    with pytest.raises(BadInputError, match="neff"):
        resolve_lambda("neff:0.1", xtx, 50)
    with pytest.raises(BadInputError, match="neff"):
        parse_lambda_reg("neff:0.1").resolve(xtx, 50, row_norm4=0.0)


# ---------------------------------------------------------------- 'cresid': the part of resid the rows share
def _resolve_cresid(setting, x: np.ndarray, q: np.ndarray) -> float:
    xt = torch.from_numpy(x)
    return parse_lambda_reg(setting).resolve(
        xt.T @ xt,
        n_rows=x.shape[0],
        xtq=torch.from_numpy(x.T @ q),
        qtq=float(q @ q),
        q2x2=float((q**2 * (x**2).sum(1)).sum()),
        row_norm4=float(((x**2).sum(1) ** 2).sum()),
    )


@pytest.mark.parametrize("n,p", [(200, 50), (30, 80)])
def test_cresid_is_the_cross_row_part_of_the_rayleigh_quotient(n, p):
    """cresid:k = k · max(Σ_{i≠j} qᵢqⱼ xᵢᵀxⱼ, 0) / qᵀq, with the cross terms summed from the n × n Gram matrix
    without its diagonal."""
    x, q = _xq(n, p)
    x = x + 5.0 * np.random.default_rng(7).standard_normal(p)  # a direction the rows share: cross terms > 0
    gram = x @ x.T
    cross = float(q @ (gram - np.diag(np.diag(gram))) @ q)
    assert cross > 0
    assert _resolve_cresid("cresid:1", x, q) == pytest.approx(cross / float(q @ q), rel=1e-10)
    assert _resolve_cresid("cresid:4", x, q) == pytest.approx(4 * cross / float(q @ q), rel=1e-10)
    assert _resolve_cresid("cresid:1", x, q) < _resolve_cresid("resid:1", x, q)
    x0, q0 = _xq(30, 80)  # fewer rows than dimensions, no shared direction: the cross terms cancel to < 0
    g0 = x0 @ x0.T
    assert float(q0 @ (g0 - np.diag(np.diag(g0))) @ q0) < 0 and _resolve_cresid("cresid:2", x0, q0) == 0.0


def test_cresid_is_zero_when_the_residual_gradients_do_not_add_up():
    """Mutually orthogonal rows: no cross terms, so cresid = 0 while resid > 0; rows along one direction with
    equal q: cresid = (n − 1)/n · resid."""
    x = np.eye(12)[:8] * np.arange(1.0, 9.0)[:, None]
    q = np.linspace(0.2, 1.0, 8)
    assert _resolve_cresid("resid:1", x, q) > 0
    assert _resolve_cresid("cresid:3", x, q) == 0.0
    x1 = np.tile(np.arange(1.0, 6.0), (10, 1))
    q1 = np.full(10, 0.3)
    assert _resolve_cresid("cresid:1", x1, q1) == pytest.approx(0.9 * _resolve_cresid("resid:1", x1, q1), rel=1e-12)


def test_cresid_joined_normalized_and_clear_errors():
    x, q = _xq(120, 30)
    rule = parse_lambda_reg("NEFF:0.12 , CResid:4.0")
    assert rule.setting == "neff:0.12,cresid:4" and rule.needs_xtq and rule.needs_q2x2 and rule.needs_row_norm4
    assert _resolve_cresid("neff:0.12,cresid:4", x, q) == max(
        _resolve_cresid("neff:0.12", x, q), _resolve_cresid("cresid:4", x, q)
    )
    xt = torch.from_numpy(x)
    with pytest.raises(BadInputError, match="cresid"):
        parse_lambda_reg("cresid:1").resolve(xt.T @ xt, 120, xtq=torch.from_numpy(x.T @ q), qtq=float(q @ q))
    with pytest.raises(BadInputError, match="cresid"):
        parse_lambda_reg("cresid:1").resolve(
            xt.T @ xt, 120, xtq=torch.from_numpy(x.T @ q), qtq=float(q @ q), q2x2=math.nan
        )


# ---------------------------------------------------------------- 'uresid': cresid while the rows are unfit
@pytest.mark.parametrize("rms", [0.0, 0.01, 0.1, 0.29, 0.3, 0.31, 0.6])
def test_uresid_is_cresid_times_the_unfit_share(rms):
    """uresid:k = cresid:k × min(1, mean qᵢ² / UNFIT_RMS²): the full coherent residual for rows far from fit,
    a share of it for fitted ones (q scaled to the root mean square ``rms``; the direction of q, and so
    cresid, does not change with its scale)."""
    from trak_core.solve.lambda_rules import UNFIT_RMS

    g = np.random.default_rng(7)
    x = g.standard_normal((150, 30)) + 0.8 * g.standard_normal(30)  # rows sharing a direction: cresid > 0
    q = g.uniform(0.2, 1.0, 150)
    q = q * rms / math.sqrt(float(np.mean(q**2))) if rms > 0 else np.zeros(150)
    share = min(1.0, rms**2 / UNFIT_RMS**2)
    cres = _resolve_cresid("cresid:10", x, q)
    assert _resolve_cresid("uresid:10", x, q) == pytest.approx(cres * share, rel=1e-9, abs=1e-12)
    if rms >= UNFIT_RMS:  # at UNFIT_RMS the share is 1 up to the rounding of mean qᵢ²
        assert _resolve_cresid("uresid:10", x, q) == pytest.approx(cres, rel=1e-12) and cres > 0
    elif rms > 0:  # scale-free in q: cresid is the same for every rms, the weight is not
        base = _resolve_cresid("cresid:10", x, q * UNFIT_RMS / rms)
        assert cres == pytest.approx(base, rel=1e-9) and _resolve_cresid("uresid:10", x, q) < cres


def test_adaptive_damps_a_fitted_model_less_than_an_early_stopped_one():
    """The same rows and the same direction of q: with q small (a model that fits its rows) the coherent residual
    counts by its unfit share, with q large (stopped early) in full, as cresid (the earlier default) does."""
    from trak_core.solve.lambda_rules import UNFIT_RMS

    g = np.random.default_rng(3)
    x = g.standard_normal((400, 60)) * 0.9 ** np.arange(60) + 2.0 * g.standard_normal(60) * 0.9 ** np.arange(60)
    q = g.uniform(0.5, 1.0, 400)
    neff = f"neff:{ADAPTIVE_NEFF:g}"
    for scale in (0.02, 0.6):
        qs = q * scale
        share = min(1.0, float(np.mean(qs**2)) / UNFIT_RMS**2)
        old = max(_resolve_cresid(neff, x, qs), _resolve_cresid("cresid:10", x, qs))
        want = max(_resolve_cresid(neff, x, qs), share * _resolve_cresid("cresid:10", x, qs))
        assert _resolve_cresid(ADAPTIVE, x, qs) == pytest.approx(want, rel=1e-9)
        if scale == 0.6:
            assert share == 1.0 and _resolve_cresid(ADAPTIVE, x, qs) == pytest.approx(old, rel=1e-12)
        else:
            assert share < 0.01 and _resolve_cresid(ADAPTIVE, x, qs) < 0.01 * old


def test_uresid_parses_records_and_names_what_it_lacks():
    from trak_core.solve.lambda_rules import UNFIT_RMS

    rule = parse_lambda_reg(" UResid:10 ")
    assert (
        rule.setting == f"uresid:10/{UNFIT_RMS:g}" and rule.needs_xtq and rule.needs_q2x2 and not rule.needs_row_norm4
    )
    assert parse_lambda_reg("neff:0.12,uresid:10").setting == ADAPTIVE == parse_lambda_reg(ADAPTIVE).setting
    assert parse_lambda_reg("uresid:4/0.50").setting == "uresid:4/0.5"
    g = np.random.default_rng(5)
    x, q = g.standard_normal((80, 12)) + 1.0, g.uniform(0.0, 0.4, 80)
    share = min(1.0, float(np.mean(q**2)) / 0.2**2)
    assert _resolve_cresid("uresid:4/0.2", x, q) == pytest.approx(share * _resolve_cresid("cresid:4", x, q), rel=1e-12)
    x = torch.ones(4, 3, dtype=torch.float64)
    with pytest.raises(BadInputError, match="n_rows"):
        parse_lambda_reg("uresid:1").resolve(
            x.T @ x, None, xtq=x.T @ torch.ones(4, dtype=torch.float64), qtq=4.0, q2x2=12.0
        )
    for bad in ("uresid:-1", "uresid:x", "uresid:", "uresid:1/0", "uresid:1/-0.3", "uresid:1/x", "uresid:1/inf"):
        with pytest.raises(BadInputError, match="lambda_reg"):
            parse_lambda_reg(bad)


@pytest.mark.parametrize("n,p", [(900, 600), (300, 40), (400, 700)])
@pytest.mark.parametrize("setting", ["neff:0.12,uresid:10", "neff:0.12,cresid:10", "neff:0.3", "cresid:2,deff:0.05"])
def test_finalize_resolves_neff_and_cresid_from_the_shard_partials(tmp_path, n, p, setting):
    """The store's per-shard row sums (Σ‖xᵢ‖⁴, Σqᵢ²‖xᵢ‖², Xᵀq, qᵀq) give finalize the λ that brute force over
    the rows gives (p > 512: float32 eigenvalues checked by the exact effective dimension, to 1e-3)."""
    from trak_core.solve import reduce
    from trak_core.store import StoreMetadata, TrakStore

    g = np.random.default_rng(n + p)
    x = (g.standard_normal((n, p)) * 0.97 ** np.arange(p) * g.uniform(0.2, 3.0, (n, 1))).astype(np.float32)
    q = g.uniform(0.0, 1.0, n).astype(np.float32)
    meta = StoreMetadata(train_set_size=n, grad_dim=2 * p, proj_dim=p, dtype="float32", chunk_rows=50, shard_rows=100)
    st = TrakStore.create_or_open(str(tmp_path / "s"), meta)
    st.init_model(0)
    st.write_train_rows(0, slice(0, n), x, q)
    info = reduce.finalize_model(st, 0, setting, rescale=False)
    x64, q64 = x.astype(np.float64), q.astype(np.float64)
    rn = (x64**2).sum(axis=1)
    want = parse_lambda_reg(setting).resolve(
        torch.from_numpy(x64.T @ x64),
        n_rows=n,
        xtq=torch.from_numpy(x64.T @ q64),
        qtq=float(q64 @ q64),
        row_norm4=float(rn @ rn),
        q2x2=float((q64**2) @ rn),
    )
    assert info["lambda_reg"] == pytest.approx(want, rel=1e-3)
    assert info["lambda_setting"] == parse_lambda_reg(setting).setting


# ---------------------------------------------------------------- a causal LM's q does not measure its fit
def test_a_causal_lm_gets_no_unfit_share():
    """q = 1 − p(sequence) is near 1 for any causal LM: its task gives the unfit share 0, so ``adaptive`` is its
    ``neff`` part (what ``uresid`` would add otherwise is checked to be larger here), other tasks keep the share
    from qᵀq; the share may also be given to the rule directly."""
    from trak_core.featurize.modelout import CausalLMModelOutput, ImageClassificationModelOutput
    from trak_core.solve.lambda_rules import unfit_share_of_task

    assert unfit_share_of_task("causal_lm") == 0.0 == unfit_share_of_task(CausalLMModelOutput())
    assert unfit_share_of_task("CausalLMModelOutput") == 0.0
    assert unfit_share_of_task("image_classification") is None is unfit_share_of_task(ImageClassificationModelOutput())
    g = np.random.default_rng(3)
    x = g.standard_normal((400, 60)) * 0.9 ** np.arange(60) + 2.0 * g.standard_normal(60) * 0.9 ** np.arange(60)
    q = 1.0 - g.uniform(0.0, 1e-6, 400)  # sequences' q: 1 − a tiny probability
    xt = torch.from_numpy(x)
    kw = dict(n_rows=400, xtq=torch.from_numpy(x.T @ q), qtq=float(q @ q), q2x2=float((q**2 * (x**2).sum(1)).sum()))
    kw["row_norm4"] = float(((x**2).sum(1) ** 2).sum())
    neff = parse_lambda_reg(f"neff:{ADAPTIVE_NEFF:g}").resolve(xt.T @ xt, **kw)
    assert parse_lambda_reg(ADAPTIVE).resolve(xt.T @ xt, **kw) > 2 * neff  # the share from q: 1
    assert parse_lambda_reg(ADAPTIVE).resolve(xt.T @ xt, **kw, unfit=0.0) == pytest.approx(neff, rel=1e-12)
    half = parse_lambda_reg("uresid:10").resolve(xt.T @ xt, **kw, unfit=0.5)
    assert half == pytest.approx(0.5 * parse_lambda_reg("cresid:10").resolve(xt.T @ xt, **kw), rel=1e-12)


@pytest.mark.parametrize("task", ["CausalLMModelOutput", "ImageClassificationModelOutput"])
def test_finalize_of_a_causal_lm_store_resolves_adaptive_without_the_unfit_share(tmp_path, task):
    """finalize (the one path of TRAKer and the pipeline, reduce.finalize_model) reads the store's task: a causal
    LM's ``adaptive`` λ is its ``neff`` part's; a classifier's, with the same rows, the one with the share from qᵀq."""
    from trak_core.solve import reduce
    from trak_core.store import StoreMetadata, TrakStore

    n, p = 300, 40
    g = np.random.default_rng(11)
    x = (g.standard_normal((n, p)) * 0.9 ** np.arange(p) + 2.0 * g.standard_normal(p) * 0.9 ** np.arange(p)).astype(
        np.float32
    )
    q = (1.0 - g.uniform(0.0, 1e-3, n)).astype(np.float32)
    meta = StoreMetadata(train_set_size=n, grad_dim=2 * p, proj_dim=p, dtype="float32", chunk_rows=50, task=task)
    st = TrakStore.create_or_open(str(tmp_path / "s"), meta)
    st.init_model(0)
    st.write_train_rows(0, slice(0, n), x, q)
    info = reduce.finalize_model(st, 0, "adaptive", rescale=False)
    x64, q64 = x.astype(np.float64), q.astype(np.float64)
    rn = (x64**2).sum(axis=1)
    kw = dict(n_rows=n, xtq=torch.from_numpy(x64.T @ q64), qtq=float(q64 @ q64), row_norm4=float(rn @ rn))
    kw["q2x2"] = float((q64**2) @ rn)
    xtx = torch.from_numpy(x64.T @ x64)
    neff = parse_lambda_reg(f"neff:{ADAPTIVE_NEFF:g}").resolve(xtx, **kw)
    full = parse_lambda_reg(ADAPTIVE).resolve(xtx, **kw)
    assert full > 2 * neff
    want = neff if task == "CausalLMModelOutput" else full
    assert info["lambda_reg"] == pytest.approx(want, rel=1e-6) and info["lambda_setting"] == ADAPTIVE
