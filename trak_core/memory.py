"""How much memory one pipeline task needs, estimated before the store is created.

A setting that cannot fit (``proj_dim: 1000000000``, a NoOpProjector on a large model, a huge shard) is refused
up front naming the field, instead of each task allocating gigabytes, dying, and being retried. The estimate
is an upper-bound sketch of the task's big buffers (what featurize and finalize hold at their peak), not an
exact count: Python, torch and zarr overheads of a few hundred MiB come on top.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from trak_core.projection.projectors import projector_traits

from .errors import BadInputError


def format_bytes(n: float) -> str:
    """``1536`` → ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover


def available_memory() -> int:
    """Bytes of memory a new allocation can get now (psutil's ``available``; /proc/meminfo or the physical
    memory without psutil). ``TRAKFLOW_MEMORY_LIMIT`` (bytes) overrides it, e.g. for a worker smaller than this
    machine."""
    env = os.environ.get("TRAKFLOW_MEMORY_LIMIT")
    if env:
        return int(float(env))
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil comes with distributed
        try:
            with open("/proc/meminfo") as fh:
                for line in fh:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class Term:
    """One buffer of a task: what it is, the config field that sets its size, its bytes."""

    what: str
    field: str
    nbytes: int


@dataclass(frozen=True)
class TaskMemory:
    """The estimate of one task kind (``featurize``, ``finalize``): its terms and their sum."""

    task: str
    terms: tuple[Term, ...]

    @property
    def total(self) -> int:
        return sum(t.nbytes for t in self.terms)

    @property
    def largest(self) -> Term:
        return max(self.terms, key=lambda t: t.nbytes)

    def describe(self) -> str:
        parts = sorted(self.terms, key=lambda t: -t.nbytes)
        return "; ".join(f"{t.what}: {format_bytes(t.nbytes)}" for t in parts if t.nbytes)


def estimate_task_memory(
    *,
    train_set_size: int,
    grad_dim: int,
    proj_dim: int,
    num_params: int,
    batch_size: int,
    shard_rows: int,
    dtype_bytes: int,
    chunk_bytes: int,
    model_bytes: int = 4,
    num_targets: int = 0,
    curvature: str = "xtx",
) -> list[TaskMemory]:
    """The big buffers of a featurize task (one shard) and of a finalize task (one checkpoint).

    ``dtype_bytes``: the storage dtype's size; ``model_bytes``: the model's parameter size (8 for float64).
    ``curvature="ggn"``: XᵀRX's partials and sum beside XᵀX's. Batches and shards never hold more rows than the
    data has."""
    n = int(train_set_size)
    b = min(int(batch_size), int(shard_rows), n)
    s = min(int(shard_rows), n)
    p, g = int(proj_dim), int(grad_dim)
    xtx = p * p * 8  # float64
    grams = 2 if curvature == "ggn" else 1  # XᵀX, and XᵀRX in a store of curvature "ggn"
    featurize = TaskMemory(
        "featurize",
        (
            Term("model and its state_dict", "model", 3 * int(num_params) * model_bytes),
            Term(f"per-example gradients (batch_size={b} × grad_dim={g})", "batch_size", 2 * b * g * model_bytes),
            Term(
                f"projected rows of one shard (shard_size={s} × proj_dim={p})",
                "shard_size",
                s * p * (4 + 4 + int(dtype_bytes)) + 2 * b * p * 4,
            ),
            Term(f"XᵀX partial{'s' * (grams > 1)} (proj_dim² = {p}² float64)", "proj_dim", 2 * grams * xtx),
            Term("Zarr chunk buffers", "chunk_rows", 2 * int(chunk_bytes)),
        ),
    )
    finalize = TaskMemory(
        "finalize",
        (
            Term(f"XᵀX, its inverse and the solve (proj_dim² = {p}² float64)", "proj_dim", (3 + grams) * xtx),
            Term(f"rows of one block (shard_size={s} × proj_dim={p}, float64)", "shard_size", 2 * s * p * 8),
            Term(f"scores of one block ({s} × {int(num_targets)} targets)", "shard_size", s * int(num_targets) * 4),
            Term("Zarr chunk buffers", "chunk_rows", 2 * int(chunk_bytes)),
        ),
    )
    return [featurize, finalize]


def check_task_memory(estimates: list[TaskMemory], available: int | None = None, projector: str = "") -> None:
    """Refuse (BadInputError naming the field that sets the largest buffer, the task and the estimate) when a
    task's estimate exceeds the available memory."""
    avail = available_memory() if available is None else int(available)
    for est in estimates:
        if est.total <= avail:
            continue
        big = est.largest
        field = big.field
        hint = {
            "proj_dim": "lower proj_dim (a few thousand dimensions are typical)",
            "batch_size": "lower batch_size",
            "shard_size": "lower shard_size (rows per featurize task)",
            "chunk_rows": "lower chunk_rows",
            "model": "use a machine with more memory",
        }[field]
        if field == "proj_dim" and projector and projector_traits(projector).is_identity:
            field = "projector"
            hint = (
                f"{projector!r} keeps every gradient dimension (proj_dim = grad_dim): use a projection "
                "('factored', 'dense', 'sjlt') with a proj_dim of a few thousand"
            )
        raise BadInputError(
            f"{field}: a {est.task} task would need about {format_bytes(est.total)} of memory "
            f"({est.describe()}), but {format_bytes(avail)} is available; {hint}. Nothing was written."
        )
