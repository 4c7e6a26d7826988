"""FactorSpectrum (every eigenvalue and the top eigenvectors of a Kronecker factor from one tridiagonal reduction)
against numpy's float64 eigendecomposition: values to 1e-12 of the largest, vectors to 1e-9 (up to sign) where the
spectrum separates them, the same invariant subspace where it does not, orthonormal columns, and the robust
fallback where MRRR fails."""

from __future__ import annotations

import numpy as np
import pytest

from trak_core.solve import spectrum
from trak_core.solve.spectrum import FactorSpectrum


def _factor(n: int, ev: np.ndarray, seed: int = 0) -> np.ndarray:
    q = np.linalg.qr(np.random.default_rng(seed).standard_normal((n, n)))[0]
    return (q * ev) @ q.T


def _aligned(u: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return u * np.sign(np.sum(u * ref, axis=0))


@pytest.mark.parametrize("n,k", [(300, 1), (300, 40), (300, 300), (520, 0), (520, 97)])
def test_values_and_top_vectors_equal_the_full_decomposition(n, k):
    ev = np.arange(1, n + 1, dtype=np.float64) ** -1.2  # distinct, gaps ~1e-4 of the largest at the bottom
    m = _factor(n, ev, seed=n + k)
    m[0, 1] += 1e-9  # a factor as fitted is symmetric only to round-off: its symmetric part is decomposed
    assert n > spectrum.DIRECT_MAX
    sp = FactorSpectrum(m)
    want_e, want_u = np.linalg.eigh((m + m.T) / 2)
    np.testing.assert_allclose(sp.values, np.clip(want_e[::-1], 0, None), rtol=0, atol=1e-12 * want_e.max())
    u = sp.vectors(k)
    assert u.shape == (n, k) and u.flags.c_contiguous and min(u.strides) >= 0  # torch takes no negative stride
    ref = want_u[:, ::-1][:, :k]
    np.testing.assert_allclose(_aligned(u, ref), ref, atol=1e-9)
    np.testing.assert_allclose(u.T @ u, np.eye(k), atol=1e-12)
    sp.release()
    with pytest.raises(RuntimeError, match="after release"):
        sp.vectors(1)


def test_a_cluster_gives_an_orthonormal_basis_of_its_subspace():
    """Five equal eigenvalues on top: any orthonormal basis of their eigenspace is right; the columns must span
    it (projector onto it equal) and be orthonormal. Negative round-off eigenvalues are clipped to 0."""
    n = 400
    ev = np.r_[np.full(5, 3.0), np.linspace(1.0, 0.1, n - 10), np.full(5, -1e-15)]
    m = _factor(n, ev, seed=3)
    sp = FactorSpectrum(m)
    u = sp.vectors(5)
    want_u = np.linalg.eigh(m)[1][:, -5:]
    np.testing.assert_allclose(u @ u.T, want_u @ want_u.T, atol=1e-10)
    np.testing.assert_allclose(u.T @ u, np.eye(5), atol=1e-12)
    assert sp.values.min() == 0.0 and np.all(np.diff(sp.values) <= 0)


def test_a_failing_mrrr_takes_implicit_qr(monkeypatch):
    """LAPACK's MRRR (stemr) reporting failure: the tridiagonal matrix's eigenvectors by implicit QR (stev), the
    same top vectors."""
    from scipy.linalg import lapack

    n, k = 300, 12
    m = _factor(n, np.linspace(2.0, 0.01, n), seed=5)
    monkeypatch.setattr(lapack, "dstemr", lambda *a, **kw: (0, None, None, 3))
    u = FactorSpectrum(m).vectors(k)
    ref = np.linalg.eigh(m)[1][:, ::-1][:, :k]
    np.testing.assert_allclose(_aligned(u, ref), ref, atol=1e-9)


def test_narrow_factors_take_the_full_decomposition(monkeypatch):
    calls = []
    real = np.linalg.eigh
    monkeypatch.setattr(np.linalg, "eigh", lambda a: calls.append(a.shape) or real(a))
    m = _factor(spectrum.DIRECT_MAX, np.linspace(1.0, 0.5, spectrum.DIRECT_MAX))
    FactorSpectrum(m).vectors(3)
    FactorSpectrum(_factor(spectrum.DIRECT_MAX + 1, np.linspace(1.0, 0.5, spectrum.DIRECT_MAX + 1))).vectors(3)
    assert calls == [(spectrum.DIRECT_MAX, spectrum.DIRECT_MAX)]


@pytest.mark.parametrize("n", [1, 2, 3, 9])
def test_tiny_factors_through_either_path(monkeypatch, n):
    """Widths 1-9 with the reduction forced where LAPACK allows it: the full decomposition's values and vectors,
    every k, arrays torch takes (no negative stride)."""
    monkeypatch.setattr(spectrum, "DIRECT_MAX", 0)
    m = _factor(n, np.linspace(2.0, 1.0, n), seed=n)
    want_e, want_u = np.linalg.eigh(m)
    for k in range(n + 1):
        sp = FactorSpectrum(m)
        u = sp.vectors(k)
        assert u.shape == (n, k) and min(u.strides) >= 0
        np.testing.assert_allclose(sp.values, want_e[::-1], atol=1e-12)
        ref = want_u[:, ::-1][:, :k]
        np.testing.assert_allclose(_aligned(u, ref), ref, atol=1e-9)
