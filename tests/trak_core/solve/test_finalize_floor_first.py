"""finalize's floor-first solve against exact float64 math: where a rule's other parts give a floor (the default
``adaptive`` has its ``cresid`` part), the float64 inverse at the floor is computed first and decides λ when the
exact effective dimension there is below every target a rank it proves gives; then no eigenvalues are computed.

Stated tolerances: where the floor decides, λ is the float64 rule's to 1e-12 (the floor is computed exactly) and
the inverse (so the scores X A Gᵀ) is the float64 inverse to 1e-9 relative; where it does not, λ is the rule's
within the fast path's acceptance (2 × DEFF_LOG_TOL), as before."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from trak_core.errors import IllConditionedWarning
from trak_core.solve import damping
from trak_core.solve.damping import parse_lambda_reg
from trak_core.solve.lanczos import LanczosSketch


def _spectrum(p: int, ev: np.ndarray, seed: int = 0) -> np.ndarray:
    """A symmetric p × p matrix with eigenvalues ``ev`` (a random orthogonal basis), exactly symmetric."""
    q = np.linalg.qr(np.random.default_rng(seed).standard_normal((p, p)))[0]
    a = (q * ev) @ q.T
    return (a + a.T) / 2


def _rule_lambda(a: np.ndarray, c: float, rows: float, floor: float) -> float:
    """The float64 rule: max(floor, the deff λ on the float64 eigenvalues)."""
    return max(floor, damping.deff_lambda(np.linalg.eigvalsh(a), c, rows))


def _no_eigenvalues(monkeypatch) -> None:
    def fail(*_a, **_k):
        raise AssertionError("eigenvalues computed where the floor decides")

    monkeypatch.setattr(damping, "_float32_eigenvalues", fail)
    monkeypatch.setattr(damping, "symmetric_eigenvalues", fail)


def test_floor_decision_is_sound_on_many_spectra():
    """Whenever the floor test says "the floor is λ", every deff λ of the float64 rule (its exact eigenvalues,
    its rank) is at most the floor; and it does decide on most spectra where the floor is well above the deff λ."""
    rng = np.random.default_rng(7)
    decided = above = 0
    for trial in range(60):
        p = 96
        rank = int(rng.integers(4, p + 1))
        alpha = float(rng.uniform(0.0, 4.0))
        ev = np.zeros(p)
        ev[p - rank :] = np.sort(np.arange(1, rank + 1, dtype=np.float64) ** -alpha)
        a = _spectrum(p, ev, seed=trial)
        n = int(rng.choice([p // 2, p, 4 * p, 50 * p]))
        c = float(rng.choice([0.05, 0.1, 0.12, 0.3]))
        exact = np.linalg.eigvalsh(a)
        deff = damping.deff_lambda(exact, c, n)
        floor = deff * float(np.exp(rng.uniform(-3.0, 3.0)))
        inv = np.linalg.inv(a + floor * np.eye(p))
        d, slope = damping._exact_deff_terms(inv, floor)
        says = damping._floor_decides(d, slope, floor, float(np.trace(a)), p, n, [(c, n)])
        if says:
            decided += 1
            assert deff <= floor * (1 + 1e-9), (trial, deff, floor)
        above += floor > 2 * deff
    assert decided >= 0.4 * above > 0  # Cauchy-Schwarz is weak on steep spectra: those take the eigenvalues


@pytest.mark.parametrize("n,alpha", [(600, 1.0), (6000, 0.5), (400, 1.5)])
def test_a_deciding_floor_is_lambda_with_no_eigenvalues(monkeypatch, n, alpha):
    """A floor above the deff λ (here an absolute part of the rule, as cresid's is in 'adaptive'): one float64
    factorization, no eigenvalues; λ is the rule's exactly, the inverse and scores the float64 ones, the condition
    estimate near the exact one, and the torch (device) solve on the CPU the same."""
    p = 600
    g = np.random.default_rng(n)
    x = (g.standard_normal((n, min(n, p))) * np.arange(1, min(n, p) + 1) ** (-alpha / 2)) @ np.linalg.qr(
        g.standard_normal((p, min(n, p)))
    )[0].T
    a = x.T @ x
    deff = damping.deff_lambda(np.linalg.eigvalsh(a), 0.1, n)
    floor = 1.5 * deff
    rule = parse_lambda_reg(f"deff:0.1,{floor!r}")
    want_lam = _rule_lambda(a, 0.1, n, floor)
    assert want_lam == floor
    _no_eigenvalues(monkeypatch)
    calls = []
    real = damping.lapack_inverse
    monkeypatch.setattr(damping, "lapack_inverse", lambda *a_, **k: calls.append(1) or real(*a_, **k))
    with warnings.catch_warnings():
        warnings.simplefilter("error", IllConditionedWarning)
        inv, info = damping.solve(a.copy(), n, rule, rescale=False)
    assert len(calls) == 1
    assert info["lambda_reg"] == pytest.approx(want_lam, rel=1e-12)
    ref = np.linalg.inv(a + want_lam * np.eye(p))
    np.testing.assert_allclose(inv, ref, rtol=1e-9, atol=1e-12 * np.abs(ref).max())
    targets = g.standard_normal((7, p))
    np.testing.assert_allclose(x @ inv @ targets.T, x @ ref @ targets.T, rtol=1e-9, atol=1e-9 * np.abs(x @ ref).max())
    assert info["condition"] == pytest.approx(np.linalg.cond(a + want_lam * np.eye(p)), rel=0.05)
    monkeypatch.undo()
    _no_eigenvalues(monkeypatch)
    inv_d, info_d = damping.solve(a.copy(), n, rule, rescale=False, linalg_device="cpu")
    assert info_d["lambda_reg"] == info["lambda_reg"]
    np.testing.assert_allclose(inv_d, inv, rtol=1e-10, atol=1e-12 * np.abs(inv).max())
    assert info_d["condition"] == pytest.approx(info["condition"], rel=1e-3)


def test_a_floor_below_the_deff_lambda_reuses_its_inverse_and_finds_the_deff_lambda(monkeypatch):
    """A floor within reach of the deff λ but below it: the floor's inverse does not decide, the float32
    eigenvalues then give the deff λ (within the fast path's acceptance of the float64 rule), and no inverse is
    computed twice."""
    p, n = 600, 3000
    a = _spectrum(p, np.arange(1, p + 1, dtype=np.float64) ** -1.0, seed=3)
    deff = damping.deff_lambda(np.linalg.eigvalsh(a), 0.1, n)
    floor = 0.7 * deff
    assert damping._floor_may_decide(float(np.trace(a)), p, n, floor, [(0.1, n)])
    seen = []
    real = damping.lapack_inverse
    monkeypatch.setattr(damping, "lapack_inverse", lambda m, lam: seen.append(lam) or real(m, lam))
    lam, inv, ev = damping.solve_deff_fast(a, [0.1], n, floor)
    assert ev is not None and seen[0] == floor and len(seen) == len(set(seen))
    assert lam == pytest.approx(_rule_lambda(a, 0.1, n, floor), rel=2 * damping.DEFF_LOG_TOL)
    np.testing.assert_allclose(inv, np.linalg.inv(a + lam * np.eye(p)), rtol=1e-9, atol=1e-12 * np.abs(inv).max())


def test_an_ill_conditioned_deciding_floor_still_warns(monkeypatch):
    """One eigenvalue far above the rest: the floor decides (no eigenvalues) but XᵀX + λI has a condition number
    above the threshold; the warning names it, and the recorded condition is the exact one's order."""
    p, n = 600, 6000
    ev = np.ones(p)
    ev[-1] = 1e9
    a = _spectrum(p, ev, seed=5)
    rule = parse_lambda_reg("deff:0.1,10")
    assert _rule_lambda(a, 0.1, n, 10.0) == 10.0
    _no_eigenvalues(monkeypatch)
    monkeypatch.setattr(damping, "condition_number", lambda m: _exact_condition(m))
    with pytest.warns(IllConditionedWarning, match="badly conditioned"):
        inv, info = damping.solve(a.copy(), n, rule, rescale=False)
    assert info["lambda_reg"] == 10.0
    want = np.linalg.cond(a + 10.0 * np.eye(p))
    assert want > damping.CONDITION_WARN and info["condition"] == pytest.approx(want, rel=1e-3)
    ref = np.linalg.inv(a + 10.0 * np.eye(p))
    np.testing.assert_allclose(inv, ref, rtol=1e-5, atol=1e-8 * np.abs(ref).max())  # κ·ε₆₄ ≈ 2e-8, grown


def _exact_condition(m: torch.Tensor) -> tuple[float, torch.Tensor]:
    """condition_number by numpy's float64 eigenvalues (the warning's exact check, allowed here)."""
    ev = torch.from_numpy(np.linalg.eigvalsh(m.numpy()))
    return float(ev[-1] / ev[0]), ev


def test_a_floor_far_below_the_deff_lambda_is_not_factorized(monkeypatch):
    """Jensen's bound alone would try the floor (0.3 × the deff λ), but the Lanczos estimate of d_eff there is
    well above the target: no factorization at the floor, the deff λ from the eigenvalues with one inverse."""
    p, n = 600, 3000
    a = _spectrum(p, np.arange(1, p + 1, dtype=np.float64) ** -1.0, seed=3)
    deff = damping.deff_lambda(np.linalg.eigvalsh(a), 0.1, n)
    floor = 0.3 * deff
    assert damping._floor_may_decide(float(np.trace(a)), p, n, floor, [(0.1, n)])  # Jensen says "try it"
    assert not damping._floor_may_decide(float(np.trace(a)), p, n, floor, [(0.1, n)], LanczosSketch(a))
    seen = []
    real = damping.lapack_inverse
    monkeypatch.setattr(damping, "lapack_inverse", lambda m, lam: seen.append(lam) or real(m, lam))
    lam, inv, ev = damping.solve_deff_fast(a, [0.1], n, floor)
    assert floor not in seen and len(seen) == 1 and ev is not None
    assert lam == pytest.approx(_rule_lambda(a, 0.1, n, floor), rel=2 * damping.DEFF_LOG_TOL)


@pytest.mark.parametrize("ratio", [0.3, 0.97, 1.03, 1.5])
def test_only_the_cost_depends_on_trying_the_floor(monkeypatch, ratio):
    """The floor tried first or not (the estimate's margin forced either way), on floors below, at and above the
    deff λ: the same λ (within the fast path's acceptance; the same number where the floor is λ) and inverse."""
    p, n = 600, 3000
    a = _spectrum(p, np.arange(1, p + 1, dtype=np.float64) ** -1.0, seed=4)
    floor = ratio * damping.deff_lambda(np.linalg.eigvalsh(a), 0.1, n)
    out = {}
    for margin in (0.0, math.inf):
        monkeypatch.setattr(damping, "FLOOR_PROBE_MARGIN", margin)
        out[margin] = damping.solve_deff_fast(a, [0.1], n, floor)
    (lam0, inv0, _), (lam1, inv1, _) = out[0.0], out[math.inf]
    assert lam0 == pytest.approx(lam1, rel=2 * damping.DEFF_LOG_TOL)
    if ratio > 1:
        assert lam0 == lam1 == floor
        np.testing.assert_array_equal(inv0, inv1)
    np.testing.assert_allclose(inv0, inv1, rtol=4 * damping.DEFF_LOG_TOL, atol=1e-12 * np.abs(inv1).max())


def test_a_deciding_floor_takes_its_condition_from_the_sketch(monkeypatch):
    """Rank deficient (n < p): the floor decides, and the Lanczos run that let finalize try it gives the condition
    number: no subspace iteration, one Lanczos run in all, the record within 1 % of the exact condition number, on
    the host and through the torch (device) solve on the CPU."""
    from trak_core.solve import lanczos

    p, n = 600, 400
    g = np.random.default_rng(11)
    x = (g.standard_normal((n, n)) * np.arange(1, n + 1) ** -0.5) @ np.linalg.qr(g.standard_normal((p, n)))[0].T
    a = x.T @ x
    floor = 1.5 * damping.deff_lambda(np.linalg.eigvalsh(a), 0.1, n)
    rule = parse_lambda_reg(f"deff:0.1,{floor!r}")
    _no_eigenvalues(monkeypatch)

    def no_iteration(*_a, **_k):
        raise AssertionError("subspace iteration where the sketch gives the condition number")

    runs = []
    real_run = lanczos.LanczosSketch._run

    def counted(self):
        runs.append(self.ran)
        return real_run(self)

    monkeypatch.setattr(damping, "_top_eigenvalue", no_iteration)
    monkeypatch.setattr(lanczos.LanczosSketch, "_run", counted)
    want = np.linalg.cond(a + floor * np.eye(p))
    for device in (None, "cpu"):
        runs.clear()
        _, info = damping.solve(a.copy(), n, rule, rescale=True, linalg_device=device)
        assert info["lambda_reg"] == floor
        assert info["condition"] == pytest.approx(want, rel=0.01)
        assert runs.count(False) == 1  # the Lanczos run itself, once
