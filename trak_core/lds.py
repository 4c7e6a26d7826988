"""Linear datamodeling score (LDS): how well attribution scores predict counterfactual retraining.

Pure numpy/torch (no Prefect). The pieces, in the order the ``evaluate`` flow uses them:

* :func:`subset_masks` — M random subsets of the n train rows, each of ``round(fraction · n)`` rows,
  drawn from one seed (an (M, n) boolean array; row s is subset S_s);
* :func:`margins_from_logits` — the ground truth per model: f_j = log(p_y / (1 − p_y)) of target j's
  correct class, the same model output TRAK attributes for classification;
* :func:`lds_per_target` / :func:`lds` — for target j, the predicted effect of S_s is
  Σ_{i ∈ S_s} τ_ij (``masks @ scores``); LDS_j is the Spearman rank correlation over the M subsets between
  that prediction and the margin of target j under a model trained on S_s; LDS = mean_j LDS_j;
* :func:`truth_key` — a content key of everything the ground truth depends on (data, model, training
  recipe, fraction, M, seeds), so that a cache of trained-subset margins is reused only when it applies.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import torch

from .errors import BadInputError


def subset_masks(n: int, num_subsets: int, fraction: float = 0.5, seed: int = 0) -> np.ndarray:
    """(num_subsets, n) boolean masks; each row has exactly ``max(1, round(fraction · n))`` True entries.

    Deterministic in (n, num_subsets, fraction, seed); subset s does not depend on num_subsets (its rows come
    from the s-th draw of one generator), so a larger M extends a smaller one."""
    if n <= 0 or num_subsets <= 0:
        raise BadInputError(f"subset_masks: need n > 0 and num_subsets > 0, got n={n}, num_subsets={num_subsets}")
    if not 0.0 < fraction < 1.0:
        raise BadInputError(f"subset_fraction: must be in (0, 1), got {fraction}")
    size = max(1, int(round(fraction * n)))
    rng = np.random.default_rng(seed)
    masks = np.zeros((num_subsets, n), dtype=bool)
    for s in range(num_subsets):
        masks[s, rng.choice(n, size=size, replace=False)] = True
    return masks


def margins_from_logits(logits: torch.Tensor | np.ndarray, labels: torch.Tensor | np.ndarray) -> np.ndarray:
    """log(p_y / (1 − p_y)) = logit_y − logsumexp_{c≠y} logit_c per row, in float64."""
    z = torch.as_tensor(np.asarray(logits) if isinstance(logits, np.ndarray) else logits.detach()).to(torch.float64)
    y = torch.as_tensor(np.asarray(labels) if isinstance(labels, np.ndarray) else labels.detach()).long().reshape(-1)
    if z.dim() != 2 or z.shape[0] != y.shape[0]:
        raise BadInputError(f"margins: logits {tuple(z.shape)} and labels {tuple(y.shape)} do not match")
    mask = torch.nn.functional.one_hot(y, z.shape[1]).bool()
    correct = z[mask]
    others = z.masked_fill(mask, float("-inf")).logsumexp(dim=1)
    return (correct - others).cpu().numpy()


def _ranks(a: np.ndarray) -> np.ndarray:
    """Average ranks (1-based, ties share their mean rank) along axis 0, per column."""
    from scipy.stats import rankdata

    return rankdata(a, axis=0)


def predicted_effects(scores: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """(M, m): Σ_{i ∈ S_s} τ_ij for every subset s and target j, in float64."""
    return masks.astype(np.float64) @ np.asarray(scores, dtype=np.float64)


def lds_per_target(scores: np.ndarray, masks: np.ndarray, margins: np.ndarray) -> np.ndarray:
    """Spearman correlation over the M subsets of (masks @ scores)[:, j] and margins[:, j], for each target j.

    ``scores`` (n, m), ``masks`` (M, n) boolean, ``margins`` (M, m). A target whose prediction or margin is
    constant over the subsets (undefined correlation) gets NaN."""
    scores, masks, margins = np.asarray(scores), np.asarray(masks), np.asarray(margins, dtype=np.float64)
    if scores.ndim != 2 or masks.ndim != 2 or margins.ndim != 2:
        raise BadInputError("lds: scores (n, m), masks (M, n) and margins (M, m) must be 2-d")
    if masks.shape[1] != scores.shape[0]:
        raise BadInputError(f"lds: masks cover {masks.shape[1]} train rows but scores have {scores.shape[0]}")
    if margins.shape != (masks.shape[0], scores.shape[1]):
        raise BadInputError(
            f"lds: margins {margins.shape} must be (subsets, targets) = {(masks.shape[0], scores.shape[1])}"
        )
    if masks.shape[0] < 3:
        raise BadInputError(f"lds: need at least 3 subsets for a rank correlation, got {masks.shape[0]}")
    if not np.isfinite(scores).all() or not np.isfinite(margins).all():
        raise BadInputError("lds: scores and margins must be finite")
    rp = _ranks(predicted_effects(scores, masks))
    rt = _ranks(margins)
    rp = rp - rp.mean(axis=0)
    rt = rt - rt.mean(axis=0)
    den = np.sqrt((rp**2).sum(axis=0) * (rt**2).sum(axis=0))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (rp * rt).sum(axis=0) / np.where(den > 0, den, 1.0), np.nan)


def lds(scores: np.ndarray, masks: np.ndarray, margins: np.ndarray) -> tuple[float, np.ndarray]:
    """(LDS = mean over targets with a defined correlation, per-target correlations)."""
    per = lds_per_target(scores, masks, margins)
    ok = np.isfinite(per)
    return (float(per[ok].mean()) if ok.any() else float("nan")), per


def bootstrap_ci(per_target: np.ndarray, reps: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean over targets (NaN targets dropped)."""
    v = np.asarray(per_target, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, v.size, size=(reps, v.size))].mean(axis=1)
    a = (1.0 - level) / 2
    return float(np.quantile(means, a)), float(np.quantile(means, 1.0 - a))


def array_fingerprint(arrays) -> str:
    """sha256 over dtype, shape and bytes of a sequence of tensors/arrays."""
    h = hashlib.sha256()
    for t in arrays:
        a = t.detach().cpu().contiguous().numpy() if isinstance(t, torch.Tensor) else np.ascontiguousarray(t)
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(a.reshape(-1).view(np.uint8).data)  # the same bytes as a.tobytes(), without copying them
    return h.hexdigest()


def truth_key(identity: dict[str, Any]) -> str:
    """A short content key (sha256 of the canonical JSON) of what the ground truth depends on."""
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


__all__ = [
    "subset_masks",
    "margins_from_logits",
    "predicted_effects",
    "lds_per_target",
    "lds",
    "bootstrap_ci",
    "array_fingerprint",
    "truth_key",
]
