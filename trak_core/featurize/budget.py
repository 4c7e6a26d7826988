"""Memory by budget: batch sizes chosen from a measured probe so that peak memory stays under ``max_memory``.

A budget bounds the peak memory of the device the featurizer computes on: on the CPU the process's resident
memory (everything it holds: libraries, model, data, buffers), on a CUDA device the memory torch allocates there
(``torch.cuda.max_memory_allocated``; the allocator's cache and the CUDA context come on top).

The featurize batch is chosen from a probe: a warm-up row, then batches of 1, 2, 4, … rows, each measured (the
peak resident memory of the process since a reset of its high-water mark, ``/proc/self/clear_refs``, after the C
allocator's free pages are given back, so that growth is not hidden by reused pages, on the CPU; the device's peak
allocated bytes on CUDA), doubling while the next is predicted to fit. The batch is the largest measured one whose
growth, with the buffers its caller holds beside (``reserve``: a shard's rows and its partial), stays under
:data:`SAFETY` × what the budget leaves above the memory used before it. Measured, not extrapolated: the memory
per row changes with the batch (a factored layer's product order follows the rows), so a line through small
batches underestimates a large one. The probe costs about twice the chosen batch's rows of compute, once per
featurizer. Scoring's buffers, computed from sizes, take a share of what the budget leaves (:func:`headroom`).

A budget below what the process already holds, or below one row's need, is refused (BadInputError naming
``max_memory`` and the bytes measured) before any row is featurized.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import gc
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from trak_core.errors import BadInputError

#: the share of what the budget leaves above the memory used before featurizing that the predicted growth may take
#: (the rest: what the linear fit does not see, e.g. the allocator's fragmentation, a writer thread's buffers)
SAFETY = 0.8
#: the most rows a budget's featurize batch gets (a larger batch is no faster, and the model is measured up to a few)
MAX_BUDGET_ROWS = 1024

#: resident memory a featurizing process gains once, on its first store write and first batches (zarr's codecs and
#: threads, torch's lazily built kernels), which a probe before them does not see: 20–40 MB measured on the CPU here
#: (a 2-layer MLP through TRAKer's first batch); counted beside the batches on the CPU
FIRST_USE_BYTES = 48 << 20

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 1 << 10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 1 << 40,
}


def parse_bytes(value, field: str = "max_memory") -> int | None:
    """``4000000000``, ``"4GB"`` (10⁹), ``"3.5GiB"`` (2³⁰), ``"512MiB"``, ``"800M"`` → bytes; None stays None.
    Anything else (a negative number, zero, an unknown unit) is a BadInputError naming ``field``."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise BadInputError(f"{field}: expected bytes (an integer) or a size like '4GB' or '512MiB', got {value!r}")
    if isinstance(value, (int, float)):
        n = float(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise BadInputError(
                f"{field}: {value!r} is not a size; use bytes or a number with a unit: B, KB, MB, GB, TB (powers of "
                "1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. '4GB' or '512MiB'"
            )
        n = float(m.group(1)) * _UNITS[unit]
    else:
        raise BadInputError(f"{field}: expected bytes (an integer) or a size like '4GB', got {type(value).__name__}")
    if not n > 0 or n != n or n == float("inf"):
        raise BadInputError(f"{field}: must be a positive size, got {value!r}")
    return int(n)


def check_budget(max_memory, device="cpu") -> int | None:
    """``max_memory`` in bytes (:func:`parse_bytes`), refused (BadInputError naming it) when it is not above what is
    used already on ``device`` (:func:`used_now`): checked before anything is created or computed."""
    limit = parse_bytes(max_memory)
    if limit is not None and used_now(device) >= limit:
        where = "this process holds" if not _is_cuda(device) else f"torch holds on {device}"
        raise BadInputError(
            f"max_memory: {_fmt(limit)} is below what {where} already ({_fmt(used_now(device))}: libraries, model, "
            "data); raise it. Nothing was featurized"
        )
    return limit


# ---------------------------------------------------------------------------------------------- measuring
def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def process_rss() -> int:
    """The resident memory of this process now (bytes)."""
    rss = _status_kib("VmRSS")
    if rss is not None:
        return rss
    import psutil  # pragma: no cover - a system without /proc

    return int(psutil.Process().memory_info().rss)  # pragma: no cover


def _reset_peak_rss() -> bool:
    """Reset the process's resident high-water mark to its resident memory now (Linux ≥ 4.0); False where that
    cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:  # pragma: no cover - not Linux, or /proc read-only
        return False


def release_free_memory() -> None:
    """Give the C allocator's free memory back to the system (glibc's ``malloc_trim``), so that what a computation
    needs shows as growth of the resident memory instead of reusing pages freed earlier. No-op elsewhere."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            import ctypes

            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # pragma: no cover - not glibc
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM: Any = None


def _is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def used_now(device) -> int:
    """What the budget counts now: the process's resident bytes (CPU) or torch's allocated bytes (CUDA)."""
    if _is_cuda(device):
        return int(torch.cuda.memory_allocated(device))
    return process_rss()


def measure_peak(fn: Callable[[], object], device) -> int:
    """The peak of :func:`used_now` while ``fn()`` runs, above what is used before it (bytes, ≥ 0). On the CPU
    without a resettable high-water mark, psutil samples the resident memory every millisecond instead. The young
    generations of Python's garbage are collected first (what earlier runs left; :func:`fit_memory` collects all of it
    once, before its first measurement: a full collection takes ~0.15 s in a process holding Prefect and torch)."""
    gc.collect(1)
    release_free_memory()
    if _is_cuda(device):
        torch.cuda.synchronize(device)
        before = int(torch.cuda.memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return max(0, int(torch.cuda.max_memory_allocated(device)) - before)
    before = process_rss()
    if _reset_peak_rss():
        fn()
        peak = _status_kib("VmHWM")
        return max(0, (peak if peak is not None else process_rss()) - before)
    return max(0, _sampled_peak(fn) - before)  # pragma: no cover - see _reset_peak_rss


def _sampled_peak(fn: Callable[[], object]) -> int:  # pragma: no cover - used where /proc/self/clear_refs is not
    import threading

    import psutil

    proc, peak, done = psutil.Process(), [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            peak[0] = max(peak[0], proc.memory_info().rss)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        fn()
    finally:
        done.set()
        t.join()
    return max(peak[0], proc.memory_info().rss)


# ---------------------------------------------------------------------------------------------- the fit
@dataclass(frozen=True)
class MemoryFit:
    """A probe's measurements: ``base`` bytes used before it, and ``points``, (rows, peak above ``base``) of each
    batch measured, in growing rows. ``fixed`` and ``per_row``: the line through the last two points (a summary;
    the rows chosen are measured ones, as the memory per row changes with the batch where the computation does)."""

    base: int
    points: tuple[tuple[int, int], ...]

    @property
    def per_row(self) -> float:
        (r0, d0), (r1, d1) = self.points[max(0, len(self.points) - 2)], self.points[-1]
        return max(0.0, (d1 - d0) / (r1 - r0)) if r1 > r0 else float(d1) / max(1, r1)

    @property
    def fixed(self) -> int:
        r1, d1 = self.points[-1]
        return int(d1 - self.per_row * r1)

    def rows_within(self, budget: int, reserve: int = 0, cap: int = MAX_BUDGET_ROWS) -> int:
        """The most rows (≤ ``cap``) of a measured batch whose growth, with ``reserve``, stays under :data:`SAFETY`
        × what ``budget`` leaves above :attr:`base`; 0 when none."""
        room = SAFETY * (budget - self.base) - reserve
        fits = [r for r, d in self.points if d <= room and r <= cap]
        return max(fits, default=0)


def fit_memory(run: Callable[[int], object], device, budget: int, reserve: int = 0) -> MemoryFit:
    """Probe ``run(rows)`` (one computation of that many rows): a warm-up row (lazy initializations), then batches
    of 1, 2, 4, … rows, each measured (its peak above what is used before it), while the next one is predicted to
    fit (by the larger of the last batch's growth per row and the last step's) in :data:`SAFETY` × what ``budget``
    leaves, up to :data:`MAX_BUDGET_ROWS`. Refuses (BadInputError naming ``max_memory``) a budget below what is used
    already or below one row's peak. Python's garbage is collected in full once, here: what the runs leave is young
    and :func:`measure_peak` collects it; old garbage is not freed during a run (Python collects its oldest
    generation only once the objects promoted into it since the last full collection are a quarter of it)."""
    gc.collect()
    release_free_memory()
    base = used_now(device)
    where = "the process holds" if not _is_cuda(device) else f"torch holds on {device}"
    if reserve >= SAFETY * (budget - base):
        raise BadInputError(
            f"max_memory: {_fmt(budget)} is below what featurizing needs before any row: {where} {_fmt(base)} "
            f"already (libraries, model, data) and {_fmt(reserve)} are counted beside the batches (the rows and XᵀX "
            f"partial kept, and on the CPU what the first store writes add); raise max_memory above "
            f"{_fmt(base + reserve / SAFETY)} (or use a smaller shard_size / proj_dim). Nothing was featurized"
        )
    measure_peak(lambda: run(1), device)  # warm-up
    release_free_memory()
    base = used_now(device)
    room = SAFETY * (budget - base) - reserve
    points: list[tuple[int, int]] = []
    rows = 1
    while True:
        peak = measure_peak(functools.partial(run, rows), device)
        points.append((rows, peak))
        if peak > room or rows >= MAX_BUDGET_ROWS:
            break
        # the next batch's growth per row: the larger of this batch's per row and of the last step's
        per_row = max(peak / rows, (peak - points[-2][1]) / (rows - points[-2][0]) if len(points) > 1 else 0.0)
        nxt = min(MAX_BUDGET_ROWS, 2 * rows)
        if peak + per_row * (nxt - rows) > room:
            break
        rows = nxt
    fit = MemoryFit(base=base, points=tuple(points))
    if fit.rows_within(budget, reserve) < 1:
        raise BadInputError(
            f"max_memory: {_fmt(budget)} is below one row's need: {where} {_fmt(base)}, one row's batch takes "
            f"{_fmt(points[0][1])} more at its peak and {_fmt(reserve)} of buffers are kept beside; raise max_memory "
            f"above {_fmt(base + (points[0][1] + reserve) / SAFETY)}. Nothing was featurized"
        )
    return fit


def _fmt(n: float) -> str:
    from trak_core.memory import format_bytes

    return format_bytes(n)


# ---------------------------------------------------------------------------------------------- scoring's share
_LIMIT: contextvars.ContextVar[int | None] = contextvars.ContextVar("trakflow_max_memory", default=None)


@contextlib.contextmanager
def memory_limit(max_memory: int | None) -> Iterator[None]:
    """Within it, :func:`headroom` says what ``max_memory`` leaves (buffers sized from the available memory, such
    as scoring's blocks, take their share of that instead). None: no limit."""
    token = _LIMIT.set(max_memory)
    try:
        yield
    finally:
        _LIMIT.reset(token)


def headroom() -> int | None:
    """Bytes the active :func:`memory_limit` leaves this process (its budget less the resident memory now), or
    None without a limit."""
    limit = _LIMIT.get()
    if limit is None:
        return None
    return max(0, int(limit) - process_rss())
