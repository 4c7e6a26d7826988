"""Damping and the solve of one checkpoint: λ from its rule, (XᵀX + λI)⁻¹ and its condition.

* the rules (:func:`parse_lambda_reg`, :class:`LambdaRule`: what λ a ``lambda_reg`` setting means) are in
  :mod:`trak_core.solve.lambda_rules`, their names imported here too;
* :func:`solve` turns one checkpoint's XᵀX (the sum of its shard partials) into the inverse and finalize's
  record: the ``deff`` rules from float32 eigenvalues checked against the exact effective dimension
  (:func:`solve_deff_fast`), the Gauss-Newton curvature (``curvature="ggn"``), the conditioning warning.
* :func:`regularized_inverse` / :func:`cholesky_inverse` are the inverses; :func:`check_conditioning` warns
  when (XᵀX + λI) is ill-conditioned or rank deficient.

No store here: :mod:`trak_core.solve.reduce` reads the partials and writes what this returns.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import torch
from torch import Tensor

from trak_core.errors import BadInputError, IllConditionedWarning
from trak_core.solve import linalg_device as dl

# the rules (what λ a setting means) live in lambda_rules; their names are damping's too
from trak_core.solve.lambda_rules import (  # noqa: F401
    ADAPTIVE,
    ADAPTIVE_CRESID,
    ADAPTIVE_NEFF,
    AUTO_DAMPING,
    LambdaRule,
    check_lambda,
    coherent_residual,
    deff_lambda,
    deff_target,
    effective_dimension,
    effective_rows,
    parse_lambda_reg,
    residual_rayleigh,
    resolve_lambda,
    symmetric_eigenvalues,
)
from trak_core.solve.lanczos import LanczosSketch
from trak_core.store import mirror_upper

# above this condition number of (XᵀX + λI) the float32 features are dominated by round-off
CONDITION_WARN = 1e7


#: the curvatures H of A = (H + λI)⁻¹ (``StoreMetadata.curvature``): XᵀX (traker's) and XᵀRX (Gauss-Newton)
CURVATURES = ("xtx", "ggn", "kfac", "ekfac", "kfac-eigen")  # the last three: trak_core.solve.kfac


def loss_curvature(q: np.ndarray | Tensor) -> np.ndarray:
    """rᵢ = ∂²loss/∂fᵢ² (float64) of each row from its Qᵢ = −∂loss/∂fᵢ = 1 − pᵢ: for the margin output
    f = log(p/(1 − p)) of every built-in task the loss is log(1 + e^(−f)), so rᵢ = pᵢ(1 − pᵢ) = Qᵢ(1 − Qᵢ).
    XᵀRX, R = diag(r), is the Gauss-Newton matrix of TRAK's one Newton step; traker uses XᵀX (R = I)."""
    qd = np.asarray(q, dtype=np.float32).astype(np.float64).reshape(-1)
    return qd * (1.0 - qd)


#: β of the floor on the curvature weights in :func:`ggn_curvature` (with it, within 0.03 LDS of the best fixed λ on all
#: 9 evaluation cases: benchmarks/RESULTS.md, "Gauss-Newton curvature")
GGN_FLOOR = 0.3


def ggn_curvature(ggn: np.ndarray, xtx: np.ndarray, mean_r: float, floor: float = GGN_FLOOR) -> np.ndarray:
    """H = XᵀRX + β·mean(r)·XᵀX: the Gauss-Newton matrix with each row's weight rᵢ floored to rᵢ + β·mean(r), so that
    a confidently fitted row (rᵢ ≈ 0) still counts a little (β = 0: XᵀRX; β → ∞: XᵀX up to scale)."""
    return ggn + (float(floor) * float(mean_r)) * xtx


def ggn_lambda(lam_xtx: float, trace_xtx: float, trace_ggn: float) -> float:
    """λ for XᵀRX from the λ that the damping rule gives XᵀX: the same damping relative to the curvature's
    scale, λ · trace(XᵀRX) / trace(XᵀX) (benchmarks/curvature.py, "transfer"; 0 stays 0)."""
    if lam_xtx == 0:
        return 0.0
    if not (trace_xtx > 0 and math.isfinite(trace_xtx) and math.isfinite(trace_ggn)):
        raise BadInputError(f"curvature 'ggn': trace(XᵀX)={trace_xtx!r}, trace(XᵀRX)={trace_ggn!r} must be finite, > 0")
    return float(lam_xtx) * float(trace_ggn) / float(trace_xtx)


def condition_number(mat: Tensor) -> tuple[float, Tensor]:
    """(condition number, eigenvalues) of a symmetric PSD matrix, in float64."""
    ev = symmetric_eigenvalues(mat)
    top = float(ev[-1])
    low = float(ev[0])
    if top <= 0:
        return math.inf, ev
    if low <= top * 1e-300 or low <= 0:
        return math.inf, ev
    return top / low, ev


def check_conditioning(
    xtx: Tensor,
    lambda_reg: float,
    n_rows: int,
    *,
    model_id=None,
    stacklevel: int = 2,
    cond: float | None = None,
    matrix: str = "XᵀX",
) -> float:
    """Warn (:class:`IllConditionedWarning`) when XᵀX + λI (``matrix``: its name in the message, e.g. XᵀRX) is
    singular or badly conditioned.

    Returns the condition estimate. traker 0.3.2 silently returns noise in these cases. ``cond``: a
    condition estimate computed by the caller (e.g. from its Cholesky factor); without it the exact
    condition number is computed here (a symmetric eigendecomposition, O(p³)).
    """
    p = xtx.shape[0]
    reg = xtx.to(torch.float64) + lambda_reg * torch.eye(p, dtype=torch.float64, device=xtx.device)
    if cond is None:
        cond, ev = condition_number(reg)
        mean_eig = float(ev.clamp(min=0).mean())
    else:
        mean_eig = max(float(torch.trace(reg)) / p, 0.0)
    who = f" for model_id={model_id}" if model_id is not None else ""
    remedy = (
        f"set lambda_reg > 0 (e.g. {1e-3 * mean_eig:.3g}, 1e-3 × the mean eigenvalue of {matrix}) "
        f"or use a proj_dim well below the number of train examples"
    )
    if p >= n_rows and lambda_reg == 0:
        warnings.warn(
            f"proj_dim={p} ≥ number of train examples n={n_rows}{who}: {matrix} has rank ≤ {n_rows} < {p} and is "
            f"singular (condition estimate {cond:.3g}); scores would be noise. Remedy: {remedy}.",
            IllConditionedWarning,
            stacklevel=stacklevel,
        )
    elif not cond < CONDITION_WARN:
        warnings.warn(
            f"{matrix} + λI is badly conditioned{who} (condition estimate {cond:.3g} with lambda_reg={lambda_reg}, "
            f"proj_dim={p}, n={n_rows}); scores are dominated by round-off. Remedy: {remedy}.",
            IllConditionedWarning,
            stacklevel=stacklevel,
        )
    return cond


def regularized_inverse(xtx: Tensor, lambda_reg: float = 0.0, rescale: bool = True) -> Tensor:
    """(XᵀX + λI)⁻¹ in float64; divided by its mean |entry| when ``rescale`` (traker 0.3.2 does)."""
    p = xtx.shape[0]
    reg = xtx.to(torch.float64) + lambda_reg * torch.eye(p, dtype=torch.float64, device=xtx.device)
    try:
        inv = torch.linalg.inv(reg)
    except RuntimeError:  # exactly singular: the pseudo-inverse keeps the output finite
        inv = torch.linalg.pinv(reg, hermitian=True)
    if rescale:
        m = inv.abs().mean()
        if m > 0:
            inv = inv / m
    return inv


# up to this proj_dim the exact condition number (a symmetric eigendecomposition) is cheap; above it, finalize
# estimates it from the Cholesky factorization it needs anyway (the eigendecomposition cost 5× the rest of the
# solve at p = 2048)
EXACT_CONDITION_MAX_P = 512


#: the deff λ from float32 eigenvalues is kept when the exact effective dimension at that λ (from the float64
#: inverse finalize computes anyway) moves log λ by at most this much (a Newton step); otherwise Newton steps
#: with a new factorization each, then the float64 eigenvalues
DEFF_LOG_TOL = 1e-4


DEFF_NEWTON_STEPS = 2


def _top_eigenvalue(mat: torch.Tensor, iters: int = 12, block: int = 6) -> float:
    """The largest eigenvalue of a symmetric PSD matrix by subspace iteration + Rayleigh–Ritz (a lower bound,
    typically within a fraction of a percent; O(iters · block · p²))."""
    v = torch.randn(mat.shape[0], block, dtype=mat.dtype, generator=torch.Generator().manual_seed(0)).to(mat.device)
    for _ in range(iters):
        v, _ = torch.linalg.qr(mat @ v)
    return float(torch.linalg.eigvalsh(v.T @ (mat @ v))[-1])


def lapack_inverse(xtx: np.ndarray | torch.Tensor, lam: float) -> np.ndarray | None:
    """(XᵀX + λI)⁻¹ float64 (C order, exactly symmetric) by LAPACK's Cholesky (potrf) and Cholesky inverse
    (potri: a triangular inverse and a triangular product, 2p³/3 flops in all) through scipy, in place on one
    copy; None when XᵀX + λI is not positive definite in float64. Faster here than torch.linalg.cholesky +
    torch.cholesky_inverse (which also leaves a column-major result)."""
    from scipy.linalg import lapack

    reg, (c, info) = _potrf_shifted(xtx, lam)
    if info != 0:
        return None
    c, info = lapack.dpotri(c, lower=1, overwrite_c=1)
    if info != 0:
        return None
    return mirror_upper(reg)


def cholesky_inverse(
    xtx: torch.Tensor,
    lam: float,
    n_rows: int,
    *,
    model_id=None,
    rescale: bool = True,
    eigenvalues: torch.Tensor | np.ndarray | None = None,
    inverse: np.ndarray | Tensor | None = None,
    matrix: str = "XᵀX",
    condition_bound: float | None = None,
    linalg_device=None,
) -> tuple[torch.Tensor, float]:
    """((XᵀX + λI)⁻¹ float64, optionally divided by its mean |entry| as traker does; the condition estimate).

    Cholesky + its triangular inverse in float64 (:func:`lapack_inverse`; ``inverse``: that result, computed
    by the caller and handed over: divided in place when rescaled). The condition number is (σ_max + λ) /
    (σ_min + λ) from ``eigenvalues`` of XᵀX when given; else exact (eigendecomposition) for
    p ≤ EXACT_CONDITION_MAX_P or when the estimate comes within 10× of the warning threshold; otherwise
    λ_max(XᵀX + λI) · λ_max(inverse) by subspace iteration. A matrix that is not positive definite in float64
    takes the general path (:func:`regularized_inverse`: LU, then the pseudo-inverse) with condition ∞.
    Warnings: :func:`check_conditioning` (naming ``matrix``).
    ``condition_bound``: an upper bound on the condition number known to the caller (:func:`ggn_condition_bound`),
    or an estimate proven within a per cent of it (:meth:`LanczosSketch.condition`); below the warning threshold it
    is the estimate, and nothing more is computed.
    ``linalg_device``: None computes on the host (LAPACK through scipy); a torch device computes there
    (:mod:`trak_core.solve.linalg_device`; ``inverse`` may be a tensor on it). The result is on the host either way.
    """
    p = xtx.shape[0]
    inv_np: Any = None  # the host's inverse (numpy)
    if linalg_device is None:
        inv_np = inverse if inverse is not None else lapack_inverse(xtx, lam)
        inv = None if inv_np is None else torch.from_numpy(inv_np)
    else:
        xtx = dl.on_device(xtx, linalg_device)
        inv = dl.cholesky_inverse(xtx, lam) if inverse is None else dl.on_device(inverse, linalg_device)
    if inv is None:
        cond = check_conditioning(
            xtx,
            lam,
            n_rows,
            model_id=model_id,
            stacklevel=4,
            cond=None if p <= EXACT_CONDITION_MAX_P else float("inf"),
            matrix=matrix,
        )
        return regularized_inverse(xtx, lam, rescale=rescale).cpu(), cond
    est = None
    if condition_bound is not None and condition_bound < CONDITION_WARN:
        est = condition_bound  # cannot warn: the condition number is at most this
    elif eigenvalues is not None:
        ev = torch.as_tensor(eigenvalues, dtype=torch.float64)
        low = max(float(ev.min()), 0.0) + lam
        est = (float(ev.max()) + lam) / low if low > 0 else float("inf")
    elif p > EXACT_CONDITION_MAX_P:
        hi, inv_hi = _top_eigenvalue(xtx.to(torch.float64)) + lam, _top_eigenvalue(inv)  # λ_max(XᵀX + λI)
        est = hi * inv_hi if hi > 0 and inv_hi > 0 else float("inf")
        if est >= CONDITION_WARN / 10 and not (p >= n_rows and lam == 0):
            est = None  # near the threshold: decide on the exact number
    if est is not None and est < CONDITION_WARN and not (p >= n_rows and lam == 0):
        cond = est  # nothing to warn about (check_conditioning would only build XᵀX + λI for its message)
    else:
        cond = check_conditioning(xtx, lam, n_rows, model_id=model_id, stacklevel=4, cond=est, matrix=matrix)
    if rescale:
        m = _mean_abs(inv_np) if linalg_device is None else float(inv.abs().mean())
        if m > 0:
            inv.div_(m)  # in place: the inverse is this function's (or the caller's ``inverse``, handed over)
    return inv.cpu(), cond


#: :func:`_mean_abs` sums this many entries per BLAS call (its length argument is a 32-bit integer)
ASUM_CHUNK = 1 << 30


def _mean_abs(a: np.ndarray) -> float:
    """The mean |entry| of a float64 array by BLAS's asum, in chunks below its 32-bit length: one pass and no
    temporary |a| (numpy's abs().mean() allocates and page-faults a p² array first)."""
    from scipy.linalg import blas

    flat = np.ascontiguousarray(a, dtype=np.float64).reshape(-1)
    if not flat.size:
        return float("nan")
    step = ASUM_CHUNK
    return sum(float(blas.dasum(flat[i : i + step])) for i in range(0, flat.size, step)) / flat.size


def ggn_condition_bound(xtx_eigenvalues: np.ndarray | torch.Tensor, weight_max: float, lam: float) -> float | None:
    """An upper bound on the condition number of H + λI for H = Xᵀ W X with row weights 0 ≤ wᵢ ≤ ``weight_max``
    (:func:`ggn_curvature`: wᵢ = rᵢ + β·mean(r)), from XᵀX's eigenvalues: 0 ⪯ H ⪯ w_max·XᵀX, so
    κ ≤ (w_max·σ_max + λ) / λ. The eigenvalues may be float32's (relative error ≲ 1e-6 of σ_max: the bound takes
    1e-4 more). None when λ = 0 (no bound without σ_min(H)): the caller estimates it then."""
    if not lam > 0:
        return None
    top = float(torch.as_tensor(xtx_eigenvalues, dtype=torch.float64).max())
    if not math.isfinite(top):
        return None
    return (max(weight_max, 0.0) * max(top, 0.0) * (1 + 1e-4) + lam) / lam


def _float32_eigenvalues(xtx: np.ndarray) -> np.ndarray:
    """Eigenvalues (ascending, as float64) of the symmetric XᵀX rounded to float32, by LAPACK's MRRR driver in
    float32: about half the time of float64. Their error is ~1e-7 × the largest (measured on the quality
    cases' projected gradients and on power-law spectra: ≤ 2e-6 × σ_max at p = 2048)."""
    import scipy.linalg

    a32 = np.asarray(xtx, dtype=np.float32)
    a32 = np.array(a32, order="C", copy=a32 is xtx or not a32.flags.c_contiguous)
    # symmetric: the Fortran-ordered transpose view lets LAPACK overwrite this copy instead of copying it again
    ev = scipy.linalg.eigvalsh(a32.T, driver="evr", overwrite_a=True, check_finite=False)
    return np.sort(ev.astype(np.float64))


def _potrf_shifted(xtx: np.ndarray | torch.Tensor, shift: float) -> tuple[np.ndarray, tuple]:
    """(the float64 copy of ``xtx`` + ``shift`` · I, LAPACK's potrf of it in place: (factor, info)). Symmetric: the
    transpose view is Fortran-ordered, so LAPACK works on the copy without another (its lower triangle is our
    upper one)."""
    from scipy.linalg import lapack

    reg = np.array(xtx.numpy() if isinstance(xtx, torch.Tensor) else xtx, dtype=np.float64, order="C", copy=True)
    reg.flat[:: reg.shape[0] + 1] += shift
    return reg, lapack.dpotrf(reg.T, lower=1, clean=0, overwrite_a=1)


def _host_positive_definite(xtx: np.ndarray, shift: float) -> bool:
    """Whether ``xtx`` + ``shift`` · I has a float64 Cholesky factorization (LAPACK's potrf on one copy)."""
    return _potrf_shifted(xtx, shift)[1][1] == 0


def _exact_deff_terms(inv: np.ndarray, lam: float) -> tuple[float, float]:
    """(d_eff(λ), −d d_eff / d log λ) of XᵀX exactly, from (XᵀX + λI)⁻¹ (float64, before any rescale):
    d_eff = Σ σ/(σ+λ) = p − λ tr(inv), −d d_eff/d log λ = Σ σλ/(σ+λ)² = λ (tr(inv) − λ ‖inv‖_F²)."""
    tr = float(np.trace(inv))
    fro2 = float(np.vdot(inv.reshape(-1), inv.reshape(-1)))
    return inv.shape[0] - lam * tr, lam * (tr - lam * fro2)


def solve_deff_fast(
    xtx: np.ndarray | Tensor,
    fractions,
    n_rows: int,
    lam_floor: float = 0.0,
    linalg_device=None,
    sketch: LanczosSketch | None = None,
) -> tuple[float, np.ndarray | Tensor, np.ndarray | None] | None:
    """(λ, (XᵀX + λI)⁻¹ float64 unscaled, the eigenvalues used or None) for ``deff`` rules without a float64
    eigendecomposition, or None where this cannot decide (the caller then takes the float64 path).

    λ = max(``lam_floor``, the ``deff:<c>`` λ of each fraction c in ``fractions``): a rule such as
    ``"deff:0.1,resid:3"`` passes its other parts' (exact, cheap) λ as ``lam_floor``. An entry of ``fractions``
    may be a pair (c, rows): its target is min(c · rows, rank / 2) (the ``neff`` rule's effective number of rows),
    while the rank bounds still use ``n_rows``.

    0. with a floor that may decide (:func:`_floor_may_decide`: Jensen's bound and a Lanczos estimate of d_eff
       there), first the float64 inverse at the floor: λ is the
       floor, with no eigenvalues (the third value returned is then None), when the exact d_eff there is at most
       every target that a rank it proves gives (:func:`_floor_decides`); otherwise that inverse is kept for
       steps 2 and 4;
    1. eigenvalues of XᵀX in float32 (:func:`_float32_eigenvalues`);
    2. a target min(c·n, rank / 2) needs the numerical rank only when it is below 2 c n: the rank is taken as
       certain when the count of float32 eigenvalues far above their round-off (> 8√p · ε₃₂ · σ_max) and
       min(n, p) give the same targets, or, for n ≥ p, when XᵀX − θI (θ the rule's rank threshold) has a
       float64 Cholesky factorization (rank p); where it is not, λ is still ``lam_floor`` when the exact d_eff at
       the floor is at most the targets of the smallest rank possible (every deff λ is then below the floor);
       otherwise None;
    3. each deff λ by the rule (:func:`deff_lambda`) on those eigenvalues (the p − n smallest set to 0 when
       n < p: they are exact zeros, and float32 noise would bias d_eff);
    4. the float64 inverse at λ gives the exact d_eff(λ) and its slope (:func:`_exact_deff_terms`), hence a
       Newton estimate of each deff λ; λ is kept when max(lam_floor, those estimates) moves log λ by at most
       DEFF_LOG_TOL, else that is the next λ (a factorization each, up to DEFF_NEWTON_STEPS), else None.

    ``linalg_device``: None computes on the host (LAPACK through scipy); a torch device computes there
    (:mod:`trak_core.solve.linalg_device`) and returns the inverse as a float64 tensor on it.
    ``sketch``: XᵀX's :class:`LanczosSketch`, for step 0 (the caller's, to ask it the condition number after; by
    default a new one).
    """
    p = xtx.shape[0]
    pairs = [(float(c[0]), float(c[1])) if isinstance(c, tuple) else (float(c), None) for c in fractions]
    if p <= EXACT_CONDITION_MAX_P or n_rows is None or not pairs:
        return None
    a: Any = xtx if linalg_device is None else dl.on_device(xtx, linalg_device)
    prims: tuple[Any, Any, Any] = (
        (_float32_eigenvalues, lapack_inverse, _exact_deff_terms)
        if linalg_device is None
        else (dl.float32_eigenvalues, dl.cholesky_inverse, dl.exact_deff_terms)
    )
    eig, inverse, terms = prims
    # a finite sum proves every entry finite (a NaN or an infinity propagates; an overflow only means the slow path)
    if not math.isfinite(float(np.sum(a) if linalg_device is None else a.sum())):
        return None
    n = int(n_rows)
    pairs = [(c, n if rows is None else rows) for c, rows in pairs]
    floor = float(lam_floor)
    known: dict[float, Any] = {}  # λ → its float64 inverse (None: not positive definite), each computed once

    def inverse_at(lam: float) -> Any:
        if lam not in known:
            known[lam] = inverse(a, lam)
        return known[lam]

    sketch = LanczosSketch(a) if sketch is None else sketch
    if floor > 0 and math.isfinite(floor) and _floor_may_decide(float(a.trace()), p, n, floor, pairs, sketch):
        inv = inverse_at(floor)
        d, slope = terms(inv, floor) if inv is not None else (math.inf, 0.0)
        if _floor_decides(d, slope, floor, float(a.trace()), p, n, pairs):
            return floor, inv, None
    ev = eig(a)
    top = float(ev[-1])
    if not top > 0:
        return None
    max_rank = min(n, p)
    theta = top * p * 1e-13  # deff_target's rank threshold
    if n < p:
        ev[: p - n] = 0.0  # rank ≤ n: these are zeros
    tau = 8.0 * math.sqrt(p) * float(np.finfo(np.float32).eps) * top
    sure = np.where(ev > tau, ev, 0.0)
    full = ev.copy()
    full[p - max_rank :] = np.maximum(full[p - max_rank :], 2.0 * theta)  # rank min(n, p)
    targets = [deff_target(full, c, rows) for c, rows in pairs]
    lowest = [deff_target(sure, c, rows) for c, rows in pairs]  # the targets of the smallest rank possible
    if lowest != targets:
        # each deff λ solves d_eff(λ) = its target, which grows with the rank: when d_eff(floor) is at most the
        # lowest target any possible rank gives, every deff λ is ≤ the floor, and λ is the floor
        inv = inverse_at(floor) if floor > 0 and math.isfinite(floor) else None
        if inv is not None and terms(inv, floor)[0] <= min(lowest):
            return floor, inv, full
        if n < p:
            return None
        if not (_host_positive_definite(a, -theta) if linalg_device is None else dl.positive_definite(a, -theta)):
            return None  # rank < p: decided on the float64 eigenvalues
    lam = max([float(lam_floor)] + [deff_lambda(full, c, rows) for c, rows in pairs])
    for _ in range(1 + DEFF_NEWTON_STEPS):
        if not (lam > 0 and math.isfinite(lam)):
            return None
        inv = inverse_at(lam)
        if inv is None:
            return None
        d, slope = terms(inv, lam)
        if not slope > 0:
            return None
        # d_eff falls as log λ grows: the Newton estimate of each deff λ from here
        est = [lam * math.exp(max(min((d - t) / slope, 1.0), -1.0)) for t in targets]
        new = max([float(lam_floor)] + est)
        if abs(math.log(new / lam)) <= DEFF_LOG_TOL:
            return lam, inv, full
        lam = new
    return None


#: the floor's inverse is computed first (it may decide λ with no eigenvalues) when Jensen's bound on d_eff(floor)
#: is at most this many times the smallest deff target: beyond it the deff λ is well above the floor on most spectra
FLOOR_FIRST_RATIO = 4.0

#: ... and when the Lanczos estimate of d_eff(floor) (:meth:`LanczosSketch.deff`, a few per cent off) is at most this
#: many times that target: above it the floor cannot decide, and its factorization would only be thrown away
FLOOR_PROBE_MARGIN = 1.25


def _floor_may_decide(trace: float, p: int, n: int, floor: float, pairs, sketch: LanczosSketch | None = None) -> bool:
    """Whether the floor may be λ, cheaply: d_eff(floor) ≤ p·m/(m + floor) (Jensen: σ/(σ+λ) is concave; m =
    trace / p the mean eigenvalue) is within FLOOR_FIRST_RATIO of the largest value the smallest target can take,
    and, given XᵀX's ``sketch``, its Lanczos estimate of d_eff(floor) within FLOOR_PROBE_MARGIN of it (the sketch
    runs only when Jensen's bound passes). Only the cost depends on this answer: a floor that is λ is found on the
    eigenvalues too."""
    if not (trace > 0 and math.isfinite(trace)):
        return False
    target = min(min(c * rows, min(n, p) / 2.0) for c, rows in pairs)
    if p * trace / (trace + p * floor) > FLOOR_FIRST_RATIO * target:
        return False
    return sketch is None or sketch.deff(floor) <= FLOOR_PROBE_MARGIN * target


def _floor_decides(d: float, slope: float, floor: float, trace: float, p: int, n: int, pairs) -> bool:
    """Whether every deff λ is at most the floor, from the exact d = d_eff(floor) and slope = Σ fᵢ(1 − fᵢ), fᵢ =
    σᵢ/(σᵢ + floor), of the float64 inverse at the floor (:func:`_exact_deff_terms`): each target min(c·rows,
    rank / 2) grows with the rank (eigenvalues above θ = σ_max·p·1e-13), and Cauchy–Schwarz over those terms proves
    rank ≥ (Σ_{σ>θ} fᵢ)² / Σ fᵢ² ≥ (d − p·θ/floor)² / (d − slope), with σ_max ≤ trace. The float64 round-off of d
    and slope (≲ p·ε each) is taken against the floor."""
    eps = 64.0 * p * float(np.finfo(np.float64).eps)
    theta = 2.0 * trace * p * 1e-13
    sq = max(d - slope, 0.0) + eps  # Σ fᵢ² = d − slope
    covered = max(d - p * theta / floor - eps, 0.0)
    rank = min(covered * covered / sq, float(min(n, p)))
    return d + eps <= min(min(c * rows, rank / 2.0) for c, rows in pairs)


def _has_deff(rule) -> bool:
    return bool(rule.deff or rule.neff) or any(_has_deff(r) for r in getattr(rule, "parts", ()))


def solve(
    xtx: np.ndarray,
    n_rows: int,
    rule: LambdaRule,
    rescale: bool = True,
    *,
    model_id=None,
    xtq=None,
    qtq=None,
    row_norm4=None,
    q2x2=None,
    unfit=None,
    ggn: np.ndarray | None = None,
    out_to_loss: np.ndarray | None = None,
    linalg_device=None,
) -> tuple[np.ndarray, dict]:
    """The inverse of one checkpoint and its finalize record.

    Args:
        xtx: XᵀX (p, p) float64, the sum of the shard partials in shard order.
        n_rows: the number of train rows.
        rule: the parsed ``lambda_reg`` (:func:`parse_lambda_reg`).
        rescale: divide the inverse by its mean |entry|, as traker does.
        xtq, qtq, row_norm4, q2x2: the row sums the rule asks for (``rule.needs_*``), else None.
        unfit: the rows' unfit share where the task's q does not measure it (``uresid``), else None.
        ggn, out_to_loss: XᵀRX's partial sum and the stored Q, for ``curvature="ggn"``; None for XᵀX.
        linalg_device: where the eigenvalues and inverses are computed: None on the host (LAPACK through scipy,
            faster on a CPU), a torch device (a GPU's) with torch there.
    Returns:
        (inverse (p, p) float64, record): the record holds ``lambda_reg`` (the λ used), ``lambda_setting``,
        ``rescale``, ``condition``, ``xtx_trace`` and, for the Gauss-Newton curvature, ``curvature``,
        ``mean_curvature``, ``lambda_xtx`` (λ of the rule on XᵀX) and ``ggn_trace``.
    """
    xtx_t = torch.from_numpy(xtx)
    xtx_d = xtx_t if linalg_device is None else dl.on_device(xtx_t, linalg_device)  # where it is inverted
    n = n_rows
    kw: dict[str, Any] = {}
    for name, value in (("xtq", xtq), ("qtq", qtq), ("row_norm4", row_norm4), ("q2x2", q2x2), ("unfit", unfit)):
        if value is not None:
            kw[name] = value
    fast = None
    sketch = LanczosSketch(xtx if linalg_device is None else xtx_d)  # runs only if the fast path asks it
    parts = tuple(getattr(rule, "parts", ())) or (rule,)
    if _has_deff(rule) and not any(getattr(r, "parts", ()) for r in parts):
        # the deff/neff parts from float32 eigenvalues, checked; the others exactly (cheap)
        others = [r.resolve(xtx_t, n_rows=n, **kw) for r in parts if not (r.deff or r.neff)]
        targets = [
            (r.factor, effective_rows(xtx_t, kw.get("row_norm4")) if r.neff else n) for r in parts if r.deff or r.neff
        ]
        fast = solve_deff_fast(
            xtx if linalg_device is None else xtx_d, targets, n, max(others, default=0.0), linalg_device, sketch
        )
    ev: Any
    if fast is not None:
        lam, inv_np, ev = fast
    else:
        if _has_deff(rule) and bool(torch.isfinite(xtx_t).all()):
            kw["eigenvalues"] = ev = symmetric_eigenvalues(xtx_d).cpu()
        else:
            ev = None
        lam = rule.resolve(xtx_t, n_rows=n, **kw)
        inv_np = None
    extra: dict[str, Any] = {}
    matrix = "XᵀX"
    # no eigenvalues (the floor decided): the sketch that let it try the floor may give XᵀX's condition number too
    bound = sketch.condition(lam) if ggn is None and ev is None and sketch.ran else None
    if ggn is not None:
        if out_to_loss is None:
            raise BadInputError("solve: the Gauss-Newton curvature needs out_to_loss (the stored Q)")
        r = loss_curvature(out_to_loss)
        mean_r = float(r.mean())
        ggn_np = ggn_curvature(ggn, xtx, mean_r)
        extra = {"curvature": "ggn", "mean_curvature": mean_r, "lambda_xtx": lam, "ggn_trace": float(np.trace(ggn_np))}
        lam = ggn_lambda(lam, float(np.trace(xtx)), extra["ggn_trace"])
        bound = None if ev is None else ggn_condition_bound(ev, float(r.max(initial=0.0)) + GGN_FLOOR * mean_r, lam)
        xtx_d, ev, inv_np, matrix = torch.from_numpy(ggn_np), None, None, "XᵀRX"  # XᵀRX + λ'I is inverted below
    inv, cond = cholesky_inverse(
        xtx_d,
        lam,
        n,
        model_id=model_id,
        rescale=rescale,
        eigenvalues=ev,
        inverse=inv_np,
        matrix=matrix,
        condition_bound=bound,
        linalg_device=linalg_device,
    )
    info = {
        **extra,
        "lambda_reg": lam,
        "lambda_setting": rule.setting,
        "rescale": bool(rescale),
        "condition": float(cond),
        "xtx_trace": float(np.trace(xtx)),
    }
    return inv.numpy(), info
