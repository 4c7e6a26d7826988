"""Effective relative step size α (cockpit's ``Alpha`` quantity) via ``torch.func``.

What α measures
---------------
Between two consecutive iterates ``θ_k`` and ``θ_{k+1} = θ_k + d`` we look at the
loss along the straight line through them, parametrised by the distance
``x = ||θ - θ_k||`` travelled along the unit direction ``u = d / ||d||``.  At both ends
we observe (noisily, from a mini-batch):

* the loss ``f`` (mini-batch mean of the per-sample losses) and the unbiased variance
  of the per-sample losses,
* the directional derivative ``f' = uᵀ∇f`` (mini-batch mean of the per-sample values
  ``uᵀ∇ℓ_i``) and the unbiased variance of those per-sample values.

Per-sample losses may have any shape ``[B, ...]`` whose leading dimension is the batch
(e.g. ``MSELoss(reduction="none")`` on ``[B, k]`` targets), reduced as cockpit does: ``f``
is the mean over all entries, its variance the unbiased variance over all entries (cockpit's
``individual_losses.var()``), and sample ``i``'s loss ``ℓ_i`` is the mean of its entries
(the per-sample gradients cockpit rescales from BackPACK are those of this mean).

A parabola ``q(x) = c + b·x + a·x²`` is fitted to these four observations by weighted
least squares, each observation weighted by the inverse of its variance.  With
``t = ||d||`` the step length and ``x̄ = -b / a`` the point where the parabola comes back
to its starting height (twice its minimiser), the step is summarised as::

    α = 2·t / x̄ - 1 = t / x_min - 1

so ``α = 0`` means the step landed on the fitted minimum, ``α < 0`` it stopped short
(undershoot), ``α = 1`` it jumped to the same height on the other side, ``α > 1`` it
went further uphill (overshoot).  As in cockpit, the start point is evaluated on batch
``k`` and the end point ``θ_{k+1}`` on the *next* batch ``k+1`` (the one seen at step
``k+1``); the value of the pair ``(k, k+1)`` is stored under step ``k``.

How it is computed here
-----------------------
cockpit materialises per-sample gradients (BackPACK ``BatchGrad``) at both points and
keeps them between the two steps for any optimizer other than plain SGD.  That is
``batch × parameters`` memory.  This module keeps only

* a copy of the parameters/buffers at ``θ_k`` and a copy of batch ``k``,

and once the update ``d = θ_{k+1} - θ_k`` is known (at the next :meth:`Alpha.track`
call, whatever the optimizer did), it obtains all ``B`` per-sample directional
derivatives ``dᵀ∇ℓ_i`` with a single forward-mode JVP
(``torch.func.jvp`` of the per-sample loss vector through
``torch.func.functional_call``) at each of the two points.  No per-sample gradient is
ever formed.

Outcomes that are not a number
------------------------------
Every tracked pair gets an entry in :meth:`Alpha.get_output`; its value is a finite
``float``, the int ``-1`` (concave fit, as cockpit) or ``None``, never NaN.  ``None``
always comes with an :class:`AlphaWarning` and a ``reason`` in :meth:`Alpha.get_details`:

* **zero step** (``d = 0``, e.g. ``lr = 0`` or a skipped update): the line through the
  two points is undefined → ``None`` (reason ``"zero step"``).  cockpit 1.0.2 has no
  value for it either: it divides by the step length, which gives NaN with plain SGD
  (projections computed in torch) and raises ``ZeroDivisionError`` with any other
  optimizer (projections computed in Python floats).
* **batch of size 1** at either end: the unbiased variance is undefined → ``None``
  (reason ``"batch size 1"``; cockpit's variance of one sample is NaN, and so is its α).
  We do not substitute a made-up variance.
* **non-finite loss, directional derivative or step length** → ``None``
  (reason ``"non-finite ..."``).
* **singular fit** (the weighted least-squares system has rank < 3) → ``None``.
* **fitted minimiser exactly at the start point** (``b = 0``, ``a > 0``; α would be
  infinite) → ``None``.
* **concave fit** (``a < 0``: no finite minimiser) → the int ``-1``, cockpit's
  convention and type ("still going downhill").  A **linear fit** (``a == 0``, ``b ≠ 0``)
  gives the float ``-1.0``, as cockpit's formula does there (``2t/∞ - 1``).
* **zero variance** of the loss or of the directional derivative at a point (e.g.
  identical samples) → replaced by ``eps`` (default ``1e-10``) with a warning, as in
  cockpit.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.func import functional_call, jvp

from .errors import BadInputError

__all__ = [
    "Alpha",
    "AlphaWarning",
    "alpha_from_coefficients",
    "fit_alpha",
    "fit_quadratic",
]

#: Variance used instead of an exact zero variance (cockpit's value).
DEFAULT_EPS = 1e-10


class AlphaWarning(UserWarning):
    """Warning emitted when α is undefined for a step or an input had to be patched."""


# --------------------------------------------------------------------------------------
# The fit (pure functions of scalars)
# --------------------------------------------------------------------------------------


def _patch_variances(variances: list[float], what: str, eps: float) -> list[float]:
    if any(v == 0.0 for v in variances):
        warnings.warn(
            f"The variance of {what} is 0; using eps={eps:g} instead.",
            AlphaWarning,
            stacklevel=2,
        )
        return [eps if v == 0.0 else v for v in variances]
    return variances


def _fit(
    t: float,
    loss0: float,
    loss1: float,
    dderiv0: float,
    dderiv1: float,
    var_loss0: float,
    var_loss1: float,
    var_dd0: float,
    var_dd1: float,
    eps: float,
) -> tuple[np.ndarray | None, str | None]:
    """Weighted least-squares parabola; returns (coefficients [c, b, a], reason)."""
    values = [t, loss0, loss1, dderiv0, dderiv1, var_loss0, var_loss1, var_dd0, var_dd1]
    if not all(math.isfinite(float(v)) for v in values):
        return None, "non-finite input to the fit"
    if t < 0:
        raise BadInputError(f"step length t must be >= 0, got {t}")
    if min(var_loss0, var_loss1, var_dd0, var_dd1) < 0:
        raise BadInputError("variances must be >= 0")
    var_f = _patch_variances([float(var_loss0), float(var_loss1)], "the loss", eps)
    var_df = _patch_variances([float(var_dd0), float(var_dd1)], "the directional derivative", eps)
    t = float(t)
    # Rows: how q(x) = c + b x + a x^2 is observed: q(0), q(t), q'(0), q'(t).
    design = np.array([[1.0, 0.0, 0.0], [1.0, t, t * t], [0.0, 1.0, 0.0], [0.0, 1.0, 2.0 * t]])
    obs = np.array([loss0, loss1, dderiv0, dderiv1], dtype=np.float64)
    sqrt_w = 1.0 / np.sqrt(np.array(var_f + var_df, dtype=np.float64))
    # Whitened least squares == the maximum-likelihood estimate under the diagonal
    # Gaussian noise model, solved via SVD (no explicit normal-equation inverse).
    coeffs, _, rank, _ = np.linalg.lstsq(design * sqrt_w[:, None], obs * sqrt_w, rcond=None)
    if rank < 3:
        return None, "singular fit"
    if not np.all(np.isfinite(coeffs)):
        return None, "singular fit"
    return coeffs, None


def fit_quadratic(
    t: float,
    loss0: float,
    loss1: float,
    dderiv0: float,
    dderiv1: float,
    var_loss0: float,
    var_loss1: float,
    var_dd0: float,
    var_dd1: float,
    *,
    eps: float = DEFAULT_EPS,
) -> np.ndarray | None:
    """Noise-aware quadratic fit along the step.

    Fits ``q(x) = c + b·x + a·x²`` to ``q(0) ≈ loss0``, ``q(t) ≈ loss1``,
    ``q'(0) ≈ dderiv0``, ``q'(t) ≈ dderiv1`` by least squares weighted with the inverse
    variances.  Derivatives are taken w.r.t. the distance along the *unit* step
    direction, so ``dderiv*`` are gradients projected on ``d / ||d||`` and ``t = ||d||``.

    Zero variances are replaced by ``eps`` (with an :class:`AlphaWarning`).

    Returns:
        ``np.array([c, b, a])`` (float64), or ``None`` if the system is singular
        (rank < 3, e.g. ``t == 0``) or an input is non-finite.
    """
    coeffs, _ = _fit(t, loss0, loss1, dderiv0, dderiv1, var_loss0, var_loss1, var_dd0, var_dd1, eps)
    return coeffs


def _alpha_with_reason(coeffs: np.ndarray | None, t: float) -> tuple[float | None, str | None]:
    if coeffs is None:
        return None, "singular fit"
    _, b, a = (float(c) for c in coeffs)
    if a < 0.0:
        # Concave fit: no finite minimiser; cockpit logs the int -1 (its comparisons are type-strict).
        return -1, "concave fit"
    if a == 0.0 and b != 0.0:
        # Linear fit: cockpit's formula gives 2t / (-b/0) - 1 = -1.0, a float.
        return -1.0, "linear fit"
    if b == 0.0:
        return None, "fitted minimum at the start point (alpha infinite)"
    x_bar = -b / a  # where q returns to q(0): twice the minimiser
    alpha = 2.0 * t / x_bar - 1.0
    if not math.isfinite(alpha):
        return None, "non-finite alpha"
    return alpha, None


def alpha_from_coefficients(coeffs: np.ndarray | None, t: float) -> float | None:
    """α from fitted coefficients ``[c, b, a]`` and the step length ``t``.

    The int ``-1`` for ``a < 0`` (concave fit), ``-1.0`` for ``a == 0, b ≠ 0`` (linear
    fit), ``None`` if ``coeffs`` is ``None`` or the fitted minimiser sits exactly at the
    start (``b == 0``), else ``2t/x̄ - 1`` with ``x̄ = -b/a``.
    """
    return _alpha_with_reason(coeffs, t)[0]


def fit_alpha(
    t: float,
    loss0: float,
    loss1: float,
    dderiv0: float,
    dderiv1: float,
    var_loss0: float,
    var_loss1: float,
    var_dd0: float,
    var_dd1: float,
    *,
    eps: float = DEFAULT_EPS,
) -> float | None:
    """α for one step from the eight observed statistics and the step length.

    ``t == 0`` (zero step) gives ``None`` with an :class:`AlphaWarning`; see the module
    docstring for every other convention.  Example, noise-free ``f(x) = (x-1)²`` from
    ``x = 0`` with step ``t = 0.5`` (half-way to the minimum at 1)::

        >>> fit_alpha(0.5, 1.0, 0.25, -2.0, -1.0, 1e-8, 1e-8, 1e-8, 1e-8)
        -0.5
    """
    alpha, _, reason = _fit_alpha_full(t, loss0, loss1, dderiv0, dderiv1, var_loss0, var_loss1, var_dd0, var_dd1, eps)
    if alpha is None:
        warnings.warn(f"alpha undefined: {reason}", AlphaWarning, stacklevel=2)
    return alpha


def _fit_alpha_full(
    t, loss0, loss1, dderiv0, dderiv1, var_loss0, var_loss1, var_dd0, var_dd1, eps
) -> tuple[float | None, np.ndarray | None, str | None]:
    if float(t) == 0.0:
        return None, None, "zero step"
    coeffs, reason = _fit(t, loss0, loss1, dderiv0, dderiv1, var_loss0, var_loss1, var_dd0, var_dd1, eps)
    if coeffs is None:
        return None, None, reason
    alpha, reason = _alpha_with_reason(coeffs, float(t))
    return alpha, coeffs, reason


# --------------------------------------------------------------------------------------
# The tracker
# --------------------------------------------------------------------------------------


def _tree_clone(obj: Any) -> Any:
    """Detached copy of a tensor or a (nested) tuple/list/dict of tensors."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, Mapping):
        return {k: _tree_clone(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_tree_clone(v) for v in obj)
    if isinstance(obj, list):
        return [_tree_clone(v) for v in obj]
    return obj


def _tree_detach(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, Mapping):
        return {k: _tree_detach(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_tree_detach(v) for v in obj)
    if isinstance(obj, list):
        return [_tree_detach(v) for v in obj]
    return obj


@dataclass
class _Snapshot:
    """Everything kept between the start step and the end step of one pair."""

    step: int
    params: dict[str, torch.Tensor]  # all parameters at θ_k (detached copies)
    buffers: dict[str, torch.Tensor]  # buffers at θ_k (detached copies)
    inputs: Any  # batch k (detached copies)
    targets: Any


def _schedule_fn(track_schedule) -> Callable[[int], bool]:
    if callable(track_schedule):
        return track_schedule
    if isinstance(track_schedule, Iterable) and not isinstance(track_schedule, (str, bytes)):
        steps = frozenset(int(s) for s in track_schedule)
        return lambda step: step in steps
    raise TypeError(
        "track_schedule must be a callable global_step -> bool or an iterable of steps, "
        f"got {type(track_schedule).__name__}"
    )


class Alpha:
    """Track cockpit's effective relative step size α during training.

    Args:
        loss_fn: ``loss_fn(outputs, targets)`` returning the **per-sample** losses, a
            tensor whose leading dimension is the batch: ``[B]`` (e.g.
            ``F.cross_entropy(..., reduction="none")``) or ``[B, ...]`` (e.g.
            ``MSELoss(reduction="none")`` on ``[B, k]`` targets; reduced as cockpit does,
            see the module docstring).  The training loss is assumed to be the mean of
            all entries.
        track_schedule: callable ``global_step -> bool`` saying at which steps a pair
            ``(step, step + 1)`` starts, or an iterable of such steps.
        eps: variance used instead of an exactly zero variance (with a warning).

    Not thread-safe: ``torch.func.jvp`` uses torch's process-wide forward-AD levels, so two threads must not
    call :meth:`track` at the same time (the train flow serializes them with a lock); separate processes
    are fine.

    Usage (any optimizer)::

        alpha = Alpha(per_sample_loss, track_schedule=lambda s: s % 10 == 0)
        for step, (x, y) in enumerate(loader):
            opt.zero_grad()
            loss = per_sample_loss(model(x), y).mean()
            loss.backward()
            alpha.track(step, model, x, y)   # after backward, before opt.step()
            opt.step()
        alpha.get_output()                   # {start_step: α or None}

    ``track`` must be called at every step that starts or ends a pair (it returns
    immediately at other steps, so calling it every step is fine).  ``model`` is called
    as ``model(inputs)``; ``inputs``/``targets`` may be tensors or nested
    tuples/lists/dicts of tensors.  The gradients in ``.grad`` are not used: the update
    is read off the parameters, so the optimizer can be anything (including gradient
    clipping, weight decay, schedulers...).  Only parameters with
    ``requires_grad=True`` define the step direction.

    Evaluation happens with the model in its current train/eval mode.  The extra
    forward passes run under a forked RNG so they do not change the training run's
    random stream; with dropout they use their own masks, i.e. the evaluated losses are
    not the ones of the training forward pass.  Buffers are copied, never mutated
    (BatchNorm running statistics are left untouched; note that in train mode the
    BatchNorm per-sample losses depend on the whole batch).

    Memory held between steps: one copy of the parameters and buffers and one copy of
    the batch.  Transient memory at the end step: the update direction (one more
    parameter copy) and the activations of a forward-mode pass (about twice those of a
    forward pass).  Nothing of size ``batch × parameters``.
    """

    #: The value of the pair (k, k + SAVE_SHIFT) is stored under k (as in cockpit).
    SAVE_SHIFT = 1

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        track_schedule: Callable[[int], bool] | Iterable[int],
        *,
        eps: float = DEFAULT_EPS,
    ):
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable")
        if not eps > 0:
            raise BadInputError(f"eps must be > 0, got {eps}")
        self.loss_fn = loss_fn
        self._schedule = _schedule_fn(track_schedule)
        self.eps = float(eps)
        self._pending: _Snapshot | None = None
        self._last_step: int | None = None
        self._output: dict[int, float | None] = {}
        self._details: dict[int, dict[str, Any]] = {}

    # ---------------------------------------------------------------- schedule
    def is_start(self, global_step: int) -> bool:
        """Whether a pair starts at ``global_step``."""
        return bool(self._schedule(global_step))

    def is_end(self, global_step: int) -> bool:
        """Whether a pair ends at ``global_step`` (i.e. one started one step before)."""
        return bool(self._schedule(global_step - self.SAVE_SHIFT))

    def should_track(self, global_step: int) -> bool:
        """Whether :meth:`track` has work to do at ``global_step``."""
        return self.is_start(global_step) or self.is_end(global_step)

    @property
    def pending_step(self) -> int | None:
        """Start step of the pair waiting for its end point, if any."""
        return None if self._pending is None else self._pending.step

    # ---------------------------------------------------------------- results
    def get_output(self) -> dict[int, float | None]:
        """``{start_step: α}`` for every completed pair; values are floats, the int ``-1`` (concave
        fit) or ``None``."""
        return dict(sorted(self._output.items()))

    def get_details(self) -> dict[int, dict[str, Any]]:
        """Per-pair diagnostics, keyed like :meth:`get_output`.

        Each entry has ``alpha``, ``reason`` (``None`` if α is a regular value, else why
        it is ``None``/``-1``), ``end_step``, ``t`` (step length ``||d||``),
        ``loss_start``/``loss_end`` (batch mean losses), ``var_loss_start``/
        ``var_loss_end``, ``dderiv_start``/``dderiv_end`` (mean directional derivatives
        along ``d/||d||``), ``var_dderiv_start``/``var_dderiv_end`` (unbiased),
        ``batch_size_start``/``batch_size_end`` and ``coefficients`` (``[c, b, a]`` of
        the fitted parabola, or ``None``).  Entries not computed are ``None``.
        """
        return {k: dict(v) for k, v in sorted(self._details.items())}

    def reset(self) -> None:
        """Forget all results and any pending pair."""
        self._pending = None
        self._last_step = None
        self._output.clear()
        self._details.clear()

    # ---------------------------------------------------------------- tracking
    def track(self, global_step: int, model: torch.nn.Module, inputs: Any, targets: Any) -> None:
        """Record step ``global_step``; call after ``backward()``, before ``optimizer.step()``.

        If a pair started at ``global_step - 1``, its end point is evaluated now (at the
        current parameters, on this batch) and its α is stored.  If a pair starts at
        ``global_step``, the parameters and the batch are copied for the next call.
        A pending pair whose end step was skipped (``track`` not called at
        ``start + 1``) is dropped with a warning and recorded as ``None``.
        """
        global_step = int(global_step)
        if self._last_step is not None and global_step <= self._last_step:
            raise BadInputError(
                f"global_step must increase between track calls: got {global_step} after {self._last_step}"
            )
        self._last_step = global_step

        if self._pending is not None:
            if self._pending.step == global_step - self.SAVE_SHIFT:
                self._finish_pair(self._pending, model, inputs, targets, end_step=global_step)
            else:
                start = self._pending.step
                self._pending = None
                self._record(
                    start,
                    None,
                    "end point not tracked",
                    {"end_step": None},
                    message=(
                        f"alpha for step {start} undefined: track() was not called at "
                        f"step {start + self.SAVE_SHIFT}, the end point of the pair"
                    ),
                )

        if self.is_start(global_step):
            self._pending = _Snapshot(
                step=global_step,
                params={n: p.detach().clone() for n, p in model.named_parameters()},
                buffers={n: b.detach().clone() for n, b in model.named_buffers()},
                inputs=_tree_clone(inputs),
                targets=_tree_clone(targets),
            )

    def finish(self, model: torch.nn.Module, inputs: Any = None, targets: Any = None) -> float | None:
        """Complete the pending pair now (e.g. after the last optimizer step).

        Call it after ``optimizer.step()``.  The end point is evaluated at the current
        parameters on the given batch; if ``inputs`` is ``None`` the start batch is
        reused (a deviation from cockpit, which always uses the next batch; the two
        points then share their sampling noise).  Returns the pair's α (also stored),
        or ``None`` if nothing was pending.
        """
        if self._pending is None:
            return None
        if inputs is None:
            inputs, targets = self._pending.inputs, self._pending.targets
        step = self._pending.step
        self._finish_pair(self._pending, model, inputs, targets, end_step=step + self.SAVE_SHIFT)
        self._last_step = max(self._last_step or step, step + self.SAVE_SHIFT)
        return self._output.get(step)

    # ---------------------------------------------------------------- internals
    def _record(
        self,
        step: int,
        alpha: float | None,
        reason: str | None,
        info: dict[str, Any],
        message: str | None = None,
    ) -> None:
        if alpha is not None and not math.isfinite(alpha):  # defensive, never stored
            alpha, reason = None, "non-finite alpha"
        if alpha is None:
            warnings.warn(
                message or f"alpha for step {step} undefined: {reason}",
                AlphaWarning,
                stacklevel=4,
            )
        keys = (
            "end_step",
            "t",
            "loss_start",
            "loss_end",
            "var_loss_start",
            "var_loss_end",
            "dderiv_start",
            "dderiv_end",
            "var_dderiv_start",
            "var_dderiv_end",
            "batch_size_start",
            "batch_size_end",
            "coefficients",
        )
        details = {k: info.get(k) for k in keys}
        details.update(alpha=alpha, reason=reason)
        self._details[step] = details
        self._output[step] = alpha

    def _finish_pair(self, snap: _Snapshot, model, inputs, targets, end_step: int) -> None:
        """Complete the pending pair ``snap`` (``self._pending``) at ``end_step``."""
        self._pending = None  # released once this method returns
        start = snap.step
        info: dict[str, Any] = {"end_step": end_step}

        current = dict(model.named_parameters())
        if current.keys() != snap.params.keys() or any(current[n].shape != snap.params[n].shape for n in current):
            raise BadInputError(f"model parameters changed names/shapes between steps {start} and {end_step}")
        trainable = [n for n, p in current.items() if p.requires_grad]
        if not trainable:
            raise BadInputError("model has no parameter with requires_grad=True")

        with torch.no_grad():
            direction = {n: current[n].detach() - snap.params[n] for n in trainable}
            sq = sum(float(torch.sum(d.double() ** 2)) for d in direction.values())
        t = math.sqrt(sq)
        info["t"] = t
        if not math.isfinite(t):
            self._record(start, None, "non-finite step", info)
            return
        if t == 0.0:
            self._record(start, None, "zero step", info)
            return

        losses0, dd0 = self._directional(
            model, snap.params, snap.buffers, snap.inputs, snap.targets, direction, trainable
        )
        losses1, dd1 = self._directional(
            model,
            {n: p.detach() for n, p in current.items()},
            {n: b.detach() for n, b in model.named_buffers()},
            _tree_detach(inputs),
            _tree_detach(targets),
            direction,
            trainable,
        )
        del direction, snap

        info["batch_size_start"] = int(losses0.shape[0])
        info["batch_size_end"] = int(losses1.shape[0])
        # Sample i's directional derivative is that of the mean of its loss entries (cockpit's per-sample
        # gradient); projections on the unit direction, statistics in float64.
        proj0 = dd0.double().reshape(dd0.shape[0], -1).mean(1) / t
        proj1 = dd1.double().reshape(dd1.shape[0], -1).mean(1) / t
        # The loss statistics run over all entries, as cockpit's individual_losses.mean() / .var().
        l0, l1 = losses0.double().reshape(-1), losses1.double().reshape(-1)
        info["loss_start"], info["loss_end"] = float(l0.mean()), float(l1.mean())
        info["dderiv_start"], info["dderiv_end"] = float(proj0.mean()), float(proj1.mean())

        if not all(bool(torch.isfinite(x).all()) for x in (l0, l1)):
            self._record(start, None, "non-finite loss", info)
            return
        if not all(bool(torch.isfinite(x).all()) for x in (proj0, proj1)):
            self._record(start, None, "non-finite directional derivative", info)
            return
        if min(info["batch_size_start"], info["batch_size_end"]) < 2:  # checked before .var() of one sample
            self._record(start, None, "batch size 1", info)
            return

        info["var_loss_start"], info["var_loss_end"] = float(l0.var()), float(l1.var())
        info["var_dderiv_start"] = float(proj0.var())
        info["var_dderiv_end"] = float(proj1.var())
        alpha, coeffs, reason = _fit_alpha_full(
            t,
            info["loss_start"],
            info["loss_end"],
            info["dderiv_start"],
            info["dderiv_end"],
            info["var_loss_start"],
            info["var_loss_end"],
            info["var_dderiv_start"],
            info["var_dderiv_end"],
            self.eps,
        )
        info["coefficients"] = None if coeffs is None else [float(c) for c in coeffs]
        self._record(start, alpha, reason, info)

    def _directional(self, model, params, buffers, inputs, targets, direction, trainable):
        """Per-sample losses and directional derivatives ``dᵀ∇ℓ_i`` in one JVP."""
        frozen = {n: p for n, p in params.items() if n not in direction}
        primals = tuple(params[n] for n in trainable)
        tangents = tuple(direction[n] for n in trainable)
        loss_fn = self.loss_fn

        def per_sample_losses(*trainable_values):
            state = dict(zip(trainable, trainable_values, strict=True))
            state.update(frozen)
            # Fresh copies so in-place buffer updates (BatchNorm) touch neither the
            # model nor the snapshot, and are legal inside the transform.
            state.update({n: b.clone() for n, b in buffers.items()})
            losses = loss_fn(functional_call(model, state, (inputs,)), targets)
            if not isinstance(losses, torch.Tensor) or losses.dim() < 1:
                raise BadInputError(
                    "loss_fn must return per-sample losses whose leading dimension is the batch "
                    f"([B] or [B, ...], e.g. reduction='none'), got {getattr(losses, 'shape', type(losses))}"
                )
            return losses

        cuda = sorted({p.device.index or 0 for p in params.values() if p.device.type == "cuda"})
        with torch.random.fork_rng(devices=cuda), torch.no_grad(), warnings.catch_warnings():
            # torch's first forward-AD use scripts its jvp decompositions and warns that
            # torch.jit.script is deprecated; that is torch-internal, not the caller's.
            warnings.filterwarnings(
                "ignore", message=r"`torch\.jit\.script` is deprecated", category=DeprecationWarning
            )
            losses, dderivs = jvp(per_sample_losses, primals, tangents)
        return losses.detach(), dderivs.detach()
