"""finalize's linear algebra with torch on a device: what :mod:`trak_core.solve.damping` does with LAPACK through scipy
on the host (faster there), done where XᵀX already is on a GPU run. Each function also runs on CPU tensors.

* :func:`float32_eigenvalues`: the eigenvalues of XᵀX rounded to float32 (the ``deff`` rules' first guess);
* :func:`cholesky_inverse`: (XᵀX + λI)⁻¹ in float64 by Cholesky, exactly symmetric, None when not positive
  definite (as :func:`trak_core.solve.damping.lapack_inverse`);
* :func:`positive_definite`, :func:`exact_deff_terms`: the rank test and the exact effective dimension.

No store and no damping rule here: :mod:`trak_core.solve.damping` decides, these compute.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def on_device(mat: np.ndarray | Tensor, device: torch.device | str) -> Tensor:
    """``mat`` as a float64 tensor on ``device`` (no copy when it is one already)."""
    t = mat if isinstance(mat, Tensor) else torch.from_numpy(np.asarray(mat))
    return t.to(device=device, dtype=torch.float64)


def float32_eigenvalues(xtx: np.ndarray | Tensor, device: torch.device | str | None = None) -> np.ndarray:
    """Eigenvalues (ascending, numpy float64, on the host) of the symmetric ``xtx`` rounded to float32, by
    ``torch.linalg.eigvalsh`` in float32 on ``device`` (default: where ``xtx`` is)."""
    t = xtx if isinstance(xtx, Tensor) else torch.from_numpy(np.asarray(xtx))
    a32 = t.to(device=device or t.device, dtype=torch.float32)
    ev = torch.linalg.eigvalsh(a32).to(torch.float64).cpu().numpy()
    return np.sort(ev)


def positive_definite(mat: Tensor, shift: float = 0.0) -> bool:
    """Whether ``mat`` + ``shift`` · I (symmetric, float64) has a Cholesky factorization on its device."""
    reg = mat.to(torch.float64).clone()
    reg.diagonal().add_(shift)
    _, info = torch.linalg.cholesky_ex(reg)
    return int(info) == 0


def mirror_upper(mat: Tensor) -> Tensor:
    """Fill the strict lower triangle of the square ``mat`` from its upper triangle, in place (exactly symmetric);
    returns ``mat``."""
    low = torch.triu(mat, diagonal=1).mT
    mat.triu_()
    mat += low
    return mat


def cholesky_inverse(xtx: np.ndarray | Tensor, lam: float, device: torch.device | str | None = None) -> Tensor | None:
    """(XᵀX + λI)⁻¹ float64 on ``device`` (default: where ``xtx`` is; a numpy ``xtx``: the CPU), by Cholesky and
    ``torch.cholesky_inverse``, its upper triangle mirrored (exactly symmetric, C order); None when XᵀX + λI is
    not positive definite in float64 (the factorization fails or the inverse is not finite)."""
    dev = device or (xtx.device if isinstance(xtx, Tensor) else "cpu")
    reg = on_device(xtx, dev).clone()
    reg.diagonal().add_(lam)
    chol, info = torch.linalg.cholesky_ex(reg)
    del reg
    if int(info) != 0:
        return None
    inv = torch.cholesky_inverse(chol)
    del chol
    if not inv.is_contiguous() and inv.mT.is_contiguous():
        inv = inv.mT  # torch's column-major result, transposed: a C-ordered view (symmetric once mirrored)
    inv = mirror_upper(inv.contiguous())
    if not bool(torch.isfinite(inv).all()):
        return None
    return inv


def exact_deff_terms(inv: Tensor, lam: float) -> tuple[float, float]:
    """(d_eff(λ), −d d_eff / d log λ) of XᵀX exactly, from ``inv`` = (XᵀX + λI)⁻¹ (float64, before any rescale)
    on its device: p − λ tr(inv) and λ (tr(inv) − λ ‖inv‖_F²)."""
    tr = float(torch.trace(inv))
    fro2 = float(torch.dot(inv.reshape(-1), inv.reshape(-1)))
    return inv.shape[0] - lam * tr, lam * (tr - lam * fro2)


def to_host(inv: Tensor) -> np.ndarray:
    """``inv`` as a C-ordered numpy float64 array on the host."""
    return np.ascontiguousarray(inv.detach().to(torch.float64).cpu().numpy())
