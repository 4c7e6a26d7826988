"""Plots for the effective relative step size α (see :mod:`trak_core.alpha`).

* :func:`plot_alpha_trace` — α against the training step.
* :func:`plot_alpha_gauge` — cockpit's α gauge: the normalised parabola ``y = x²`` with
  the distribution of all α values and of the most recent ones underneath, so one can see
  at a glance whether steps under-shoot (``α < 0``), hit (``α ≈ 0``) or over-shoot
  (``α > 0``) the local minimum along the step.

Both write a PNG and return its path.  They draw on a standalone
:class:`matplotlib.figure.Figure` with the Agg canvas, so they neither need a display
nor touch pyplot's global state (safe in worker processes and threads).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .errors import BadInputError

__all__ = ["plot_alpha_trace", "plot_alpha_gauge"]


def _finite(values: Iterable) -> np.ndarray:
    out = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return np.asarray(out, dtype=np.float64)


def _save(fig: Figure, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, format="png", dpi=100)
    return path


def plot_alpha_trace(
    alpha_output: Mapping[int, float | None],
    path: str | os.PathLike,
    *,
    title: str = "Effective relative step size α",
) -> Path:
    """Plot α against the step (``Alpha.get_output()``) and save it as a PNG.

    Steps whose α is ``None`` (undefined, see :mod:`trak_core.alpha`) are marked with
    grey crosses on the zero line.  Reference lines: ``α = 0`` (step lands on the fitted
    minimum) and ``α = ±1``.
    """
    items = sorted((int(k), v) for k, v in dict(alpha_output).items())
    ok = [(k, float(v)) for k, v in items if v is not None and math.isfinite(float(v))]
    missing = [k for k, v in items if v is None or not math.isfinite(float(v))]

    fig = Figure(figsize=(7, 3.5))
    ax = fig.add_subplot(1, 1, 1)
    ax.axhline(0.0, color="black", linewidth=0.8)
    for level in (-1.0, 1.0):
        ax.axhline(level, color="grey", linewidth=0.8, linestyle="--")
    if ok:
        steps, values = zip(*ok, strict=True)
        ax.plot(steps, values, marker="o", markersize=3, linewidth=1, label="α")
    if missing:
        ax.plot(missing, [0.0] * len(missing), "x", color="grey", label="undefined")
    if not items:
        ax.text(0.5, 0.5, "no α values", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel("α")
    ax.set_title(title)
    if ok or missing:
        ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    return _save(fig, path)


def plot_alpha_gauge(
    alpha_values: Iterable[float | None] | Mapping[int, float | None],
    path: str | os.PathLike,
    *,
    xlim: float = 1.5,
    last_fraction: float = 0.1,
    bins: int = 30,
    title: str = "α gauge",
) -> Path:
    """cockpit-style α gauge, saved as a PNG.

    Draws the unit parabola ``y = x²`` on ``[-xlim, xlim]`` and, on a second y-axis,
    the histogram of all α values and of the last ``last_fraction`` of them (at least
    one value).  Values outside ``[-xlim, xlim]`` are clipped into the outermost bins so
    that they stay visible; ``None``/non-finite values are skipped.  A mapping (e.g.
    ``Alpha.get_output()``) is read in step order.
    """
    if not 0 < last_fraction <= 1:
        raise BadInputError(f"last_fraction must be in (0, 1], got {last_fraction}")
    if isinstance(alpha_values, Mapping):
        alpha_values = [v for _, v in sorted(alpha_values.items())]
    values = _finite(alpha_values)
    n_last = max(1, int(math.ceil(last_fraction * len(values)))) if len(values) else 0
    recent = values[len(values) - n_last :]

    fig = Figure(figsize=(5, 4))
    ax = fig.add_subplot(1, 1, 1)
    xs = np.linspace(-xlim, xlim, 301)
    ax.plot(xs, xs**2, color="black", linewidth=1.5, zorder=3)
    ax.axvline(0.0, color="grey", linewidth=0.8, linestyle=":", zorder=2)
    ax.set_xlim(-xlim, xlim)
    ax.set_ylim(0.0, xlim**2 * 1.05)
    ax.set_xlabel("α  (normalised step: 0 = minimum, ±1 = same height)")
    ax.set_ylabel("normalised loss")
    ax.text(-xlim * 0.95, xlim**2 * 0.97, "under-shoot", ha="left", va="top", fontsize="small")
    ax.text(xlim * 0.95, xlim**2 * 0.97, "over-shoot", ha="right", va="top", fontsize="small")

    hist_ax = ax.twinx()
    hist_ax.set_ylabel("density")
    edges = np.linspace(-xlim, xlim, bins + 1).tolist()  # a list: matplotlib's stubs type bins Sequence[float]
    if len(values):
        hist_ax.hist(
            np.clip(values, -xlim, xlim),
            bins=edges,
            density=True,
            alpha=0.35,
            color="tab:blue",
            label=f"all ({len(values)})",
        )
        hist_ax.hist(
            np.clip(recent, -xlim, xlim),
            bins=edges,
            density=True,
            alpha=0.55,
            color="tab:orange",
            label=f"last {last_fraction:.0%} ({len(recent)})",
        )
        hist_ax.legend(loc="upper center", fontsize="small")
        title = f"{title}: mean α = {values.mean():.2f}"
    else:
        ax.text(0.5, 0.5, "no α values", ha="center", va="center", transform=ax.transAxes)
    ax.set_zorder(hist_ax.get_zorder() + 1)  # parabola above the bars
    ax.patch.set_visible(False)
    ax.set_title(title)
    fig.tight_layout()
    return _save(fig, path)
