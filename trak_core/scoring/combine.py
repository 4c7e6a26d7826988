"""TRAK's block products: XᵀX, features, scores, checkpoint combination (the solve is :mod:`trak_core.solve.damping`).

Everything here works on blocks of rows so that memory stays flat in the number of train examples n:

* ``xtx_partial(X_block)`` — one block's XᵀX in float64; XᵀX of all rows is the sum of the partials.
* ``features_block(X_block, inv)`` — Φ = X (XᵀX + λI)⁻¹ for one block.
* ``scores_block(Φ_block, G)`` — Φ Gᵀ for one block of train rows against all targets.
* combination over C checkpoints (traker's): S = [(1/C) Σ_c Φ_c G_cᵀ] ⊙ [(1/C) Σ_c Q_c] (Q broadcast
  over targets), see :func:`combine_checkpoints`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def xtx_partial(x_block: Tensor) -> Tensor:
    """Xᵀ X of one block of rows, accumulated in float64."""
    x = x_block.to(torch.float64)
    return x.T @ x


def features_block(x_block: Tensor, inv: Tensor, compute_dtype: torch.dtype = torch.float32) -> Tensor:
    """Φ = X (XᵀX + λI)⁻¹ for a block of rows."""
    return x_block.to(compute_dtype) @ inv.to(compute_dtype)


def scores_block(features: Tensor, target_grads: Tensor, compute_dtype: torch.dtype = torch.float32) -> Tensor:
    """Φ Gᵀ for a block of train rows (rows × p) and all targets (m × p) → rows × m.

    Gᵀ is made contiguous first: MKL's GEMM on a transposed view runs at about half the speed here.
    """
    return torch.mm(features.to(compute_dtype), target_grads.to(compute_dtype).T.contiguous())


def combine_checkpoints(
    score_sum: np.ndarray | Tensor, out_to_loss_sum: np.ndarray | Tensor, num_models: int
) -> np.ndarray | Tensor:
    """traker's combination: (Σ_c Φ_c G_cᵀ / C) ⊙ (Σ_c Q_c / C), Q (rows,) broadcast over targets."""
    if num_models <= 0:
        raise ValueError("no checkpoint contributed to the scores")
    q = out_to_loss_sum.reshape(-1, 1)
    return (score_sum / num_models) * (q / num_models)
