"""Streaming reductions over a store: per-shard XᵀX partials, features, and combined scores.

Memory is O(block × (p + m) + p²) whatever the number of train rows n.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import numpy as np
import torch

from .errors import StateError
from .scoring import (
    CONDITION_WARN,
    check_conditioning,
    features_block,
    parse_lambda_reg,
    regularized_inverse,
)
from .store import TrakStore
from .streaming import stream_scores
from .verify import require_present


def shard_partial(store: TrakStore, model_id: int, shard: int, rows: np.ndarray | None = None) -> np.ndarray:
    """Xₛᵀ Xₛ (float64) of one shard, from the stored (rounded) gradients or the given rows."""
    if rows is None:
        a, b = store.meta.shard_range(shard)
        rows = store.model(model_id).grads[a:b]
    x = np.asarray(rows).astype(store.meta.np_dtype, copy=False).astype(np.float64)
    # numpy turns ``x.T @ x`` into one BLAS syrk (half the flops of a GEMM; the result is exactly symmetric):
    # float64 XᵀX at the cost of a float32 GEMM
    return x.T @ x


def ensure_partial(store: TrakStore, model_id: int, shard: int) -> None:
    if not store.partial_done(model_id, shard):
        if not store.shard_featurized(model_id, shard):
            a, b = store.meta.shard_range(shard)
            raise StateError(f"model_id={model_id}: rows {a}..{b - 1} of shard {shard} are not all featurized")
        store.write_partial(model_id, shard, shard_partial(store, model_id, shard))


def total_xtx(store: TrakStore, model_id: int) -> np.ndarray:
    """XᵀX as the sum of the shard partials in shard order (the one canonical order)."""
    m = store.model(model_id)
    total = np.zeros((store.meta.proj_dim, store.meta.proj_dim), dtype=np.float64)
    for s in range(store.meta.num_shards):
        total += m.xtx_partials[s]
    return total


def require_featurized(store: TrakStore, model_id: int) -> None:
    mask = store.featurized_mask(model_id)
    if not mask.all():
        missing = np.flatnonzero(~mask)
        raise StateError(
            f"model_id={model_id} is not fully featurized: {missing.size} of {mask.size} rows "
            f"missing (first: {missing[:10].tolist()}); featurize them before finalizing"
        )


# up to this proj_dim the exact condition number (a symmetric eigendecomposition) is cheap; above it, finalize
# estimates it from the Cholesky factorization it needs anyway (the eigendecomposition cost 5× the rest of the
# solve at p = 2048)
EXACT_CONDITION_MAX_P = 512


def _top_eigenvalue(mat: torch.Tensor, iters: int = 12, block: int = 6) -> float:
    """The largest eigenvalue of a symmetric PSD matrix by subspace iteration + Rayleigh–Ritz (a lower bound,
    typically within a fraction of a percent; O(iters · block · p²))."""
    v = torch.randn(mat.shape[0], block, dtype=mat.dtype, generator=torch.Generator().manual_seed(0))
    for _ in range(iters):
        v, _ = torch.linalg.qr(mat @ v)
    return float(torch.linalg.eigvalsh(v.T @ (mat @ v))[-1])


def cholesky_inverse(
    xtx: torch.Tensor, lam: float, n_rows: int, *, model_id=None, rescale: bool = True
) -> tuple[torch.Tensor, float]:
    """((XᵀX + λI)⁻¹ float64, optionally divided by its mean |entry| as traker does; the condition estimate).

    Cholesky + its triangular inverse in float64 (a third of an LU inverse's work). The condition number
    is exact (eigendecomposition) for p ≤ EXACT_CONDITION_MAX_P or when the estimate comes within 10× of
    the warning threshold; otherwise λ_max(XᵀX + λI) · λ_max(inverse) by subspace iteration. A matrix that
    is not positive definite in float64 takes the general path (:func:`regularized_inverse`: LU, then the
    pseudo-inverse) with condition ∞. Warnings: :func:`check_conditioning`.
    """
    p = xtx.shape[0]
    reg = xtx.to(torch.float64) + lam * torch.eye(p, dtype=torch.float64)
    chol, failed = torch.linalg.cholesky_ex(reg)
    if int(failed):
        cond = check_conditioning(
            xtx, lam, n_rows, model_id=model_id, stacklevel=4, cond=None if p <= EXACT_CONDITION_MAX_P else float("inf")
        )
        return regularized_inverse(xtx, lam, rescale=rescale), cond
    inv = torch.cholesky_inverse(chol).contiguous()  # LAPACK's column-major result: 4× slower GEMMs
    est = None
    if p > EXACT_CONDITION_MAX_P:
        hi, inv_hi = _top_eigenvalue(reg), _top_eigenvalue(inv)
        est = hi * inv_hi if hi > 0 and inv_hi > 0 else float("inf")
        if est >= CONDITION_WARN / 10 and not (p >= n_rows and lam == 0):
            est = None  # near the threshold: decide on the exact number
    cond = check_conditioning(xtx, lam, n_rows, model_id=model_id, stacklevel=4, cond=est)
    if rescale:
        m = inv.abs().mean()
        if m > 0:
            inv = inv / m
    return inv, cond


def rows_xtq(store: TrakStore, model_id: int, block_rows: int | None = None) -> tuple[np.ndarray, float]:
    """(Xᵀq (p,) float64, qᵀq) over the stored train rows: X the projected gradients (as stored), q the
    out-to-loss weights; streamed by shards."""
    m = store.model(model_id)
    step = block_rows or store.meta.rows_per_shard
    xtq = np.zeros(store.meta.proj_dim, dtype=np.float64)
    qtq = 0.0
    for a in range(0, store.meta.train_set_size, step):
        b = min(a + step, store.meta.train_set_size)
        q = np.asarray(m.out_to_loss[a:b], dtype=np.float64).reshape(-1)
        xtq += np.asarray(m.grads[a:b]).astype(np.float64).T @ q
        qtq += float(q @ q)
    return xtq, qtq


def solve_model(store: TrakStore, model_id: int, lambda_reg=0.0, rescale: bool = True) -> tuple[np.ndarray, dict]:
    """(inverse (p, p) float64, info) for one model from its partials. ``lambda_reg``: see parse_lambda_reg."""
    xtx = torch.from_numpy(total_xtx(store, model_id))
    rule = parse_lambda_reg(lambda_reg)
    xtq, qtq = rows_xtq(store, model_id) if rule.needs_xtq else (None, None)  # a 'resid' rule ('adaptive')
    lam = rule.resolve(xtx, n_rows=store.meta.train_set_size, xtq=xtq, qtq=qtq)
    inv, cond = cholesky_inverse(xtx, lam, store.meta.train_set_size, model_id=model_id, rescale=rescale)
    info = {
        "lambda_reg": lam,
        "lambda_setting": rule.setting,
        "rescale": bool(rescale),
        "condition": float(cond),
        "xtx_trace": float(torch.trace(xtx)),
    }
    return inv.numpy(), info


def write_features_rows(store: TrakStore, model_id: int, inv: np.ndarray, a: int, b: int) -> None:
    m = store.model(model_id)
    inv_t = torch.from_numpy(inv)
    x = torch.from_numpy(m.grads[a:b].astype(np.float32))
    store.write_features_rows(model_id, a, b, features_block(x, inv_t).numpy())


def finalize_model(
    store: TrakStore, model_id: int, lambda_reg=0.0, rescale: bool = True, block_rows: int | None = None, progress=None
) -> dict:
    """Partials → XᵀX → (XᵀX + λI)⁻¹ → features, streaming over rows. Idempotent."""
    recorded = store.finalize_info(model_id) if store.has_model(model_id) else None  # as store.is_finalized
    if recorded is not None:
        return recorded
    require_featurized(store, model_id)
    m = store.model(model_id)
    rows = np.arange(store.meta.train_set_size)
    require_present(
        store, [(m.grads, rows), (m.out_to_loss, rows), (m.xtx_partials, np.flatnonzero(m.partial_done[:]))]
    )
    # what determines the features is recorded before the first row is written: a rerun after a crash with
    # another λ or rescale is refused naming the field, never finalized with two settings
    store.record_feature_settings(model_id, parse_lambda_reg(lambda_reg).setting, rescale)
    for s in range(store.meta.num_shards):
        ensure_partial(store, model_id, s)
    inv, info = solve_model(store, model_id, lambda_reg, rescale)
    step = block_rows or store.meta.rows_per_shard
    n = store.meta.train_set_size
    done = store.model(model_id).finalized
    for a in range(0, n, step):
        b = min(a + step, n)
        if not done[a:b].all():
            write_features_rows(store, model_id, inv, a, b)
        if progress:
            progress(b - a)
    store.set_finalize_info(model_id, info)
    return info


def usable_models(
    store: TrakStore, exp_name: str, model_ids: Iterable[int] | None = None, allow_skip: bool = False
) -> list[int]:
    """Models whose features are finalized and whose target gradients are complete."""
    ids = list(model_ids) if model_ids is not None else store.experiment_model_ids(exp_name)
    if not ids:
        raise StateError(f"experiment {exp_name!r} has no scored checkpoints")
    used = []
    for mid in ids:
        problem = None
        if not store.is_finalized(mid):
            problem = f"model_id={mid} is not finalized"
        elif not store.targets_complete(exp_name, mid):
            problem = f"target gradients of experiment {exp_name!r} for model_id={mid} are incomplete or missing"
        if problem:
            if allow_skip:
                warnings.warn(f"{problem}; skipping it (allow_skip=True)", stacklevel=2)
                continue
            raise StateError(problem)
        used.append(mid)
    if not used:
        raise StateError(f"no usable checkpoint for experiment {exp_name!r}")
    rows, targets = np.arange(store.meta.train_set_size), np.arange(store.num_targets(exp_name))
    for mid in used:  # a chunk lost after its rows were marked done is damage, never read back as zeros
        m = store.model(mid)
        require_present(
            store, [(m.features, rows), (m.out_to_loss, rows), (store.target_grads(exp_name, mid), targets)]
        )
    return used


def load_targets(store: TrakStore, exp_name: str, model_ids: list[int]) -> dict[int, torch.Tensor]:
    """Each model's target gradients, transposed and contiguous: (p, m) float32, ready for GEMM."""
    return {
        mid: torch.from_numpy(store.target_grads(exp_name, mid)[:].astype(np.float32)).T.contiguous()
        for mid in model_ids
    }


def score_rows(
    store: TrakStore,
    exp_name: str,
    model_ids: list[int],
    a: int,
    b: int,
    targets: dict | None = None,
    block_rows: int | None = None,
) -> None:
    """Combined scores for train rows [a, b) written to the experiment's score array.

    Streams in blocks of ``block_rows`` rows (default: chosen from the cache and memory sizes), reading the
    next block while multiplying this one (:func:`trak_core.streaming.stream_scores`)."""
    targets = targets if targets is not None else load_targets(store, exp_name, model_ids)
    stream_scores(store, exp_name, model_ids, a, b, targets, block_rows=block_rows)


def finalize_scores(
    store: TrakStore,
    exp_name: str,
    model_ids: Iterable[int] | None = None,
    allow_skip: bool = False,
    block_rows: int | None = None,
    progress=None,
) -> np.ndarray:
    """Stream over train rows; returns the (n, m) float32 scores (also stored).

    ``block_rows``: rows per GEMM (default: chosen from the cache and memory sizes,
    :func:`trak_core.streaming.score_block_rows`). The returned array is the one the blocks were computed
    into (the store holds the same bits), not a read-back of the store."""
    used = usable_models(store, exp_name, model_ids, allow_skip)
    targets = load_targets(store, exp_name, used)
    n = store.meta.train_set_size
    store.reset_scores(exp_name)  # a new combination: recompute all rows
    out = np.empty((n, store.num_targets(exp_name)), dtype=np.float32)
    stream_scores(store, exp_name, used, 0, n, targets, block_rows=block_rows, out=out, progress=progress)
    store.set_scored_with(exp_name, used)
    return out
