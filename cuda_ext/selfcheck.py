"""The GPU kernels check themselves before their first use in a process.

A CUDA projector whose kernels have never run on this GPU (new architecture, new driver, a miscompile)
must not give wrong projections silently. Before its first projection with the kernel backend, each
projector runs its kernel on two small probe inputs and compares it with the device-independent torch
path (:mod:`cuda_ext.torch_path`, matrix from :mod:`trak_core.projection.counter_rng`) accumulated in float64:

* the **integer probe**: integers in [-8, 8]. With ±1 (Rademacher) or ±1·√(proj_dim/c) (SJLT) entries
  every partial sum is an integer below 2**24, so float32 computes it exactly in *any* accumulation order
  (and tensor cores lose nothing: such integers are exact in bf16). The kernel must match the exact result
  entry by entry up to the final float32 rounding of the SJLT scale product (relative 2**-21 per entry; for
  dense Rademacher that is equality). Any wrong sign, column, coordinate, split or batch tile shows here.
  Normal matrices have no such exact input; they get the float probe only.
* the **float probe**: standard normal float32 values, compared as ``max |out - ref| / max |ref|``
  against a tolerance per algorithm (:data:`TOLERANCE`). Measured on this probe (CPU, torch path in float32
  vs float64, proj_dim 512/2048, Rademacher and normal): 7–8e-7 from float32 accumulation; with the input
  rounded as tc2 does (two bf16 terms) 2.4e-6, as tc1 does (one bf16 term) 1.7e-3; one flipped matrix sign
  among the 70,001 coordinates of a column moves the result by 3.5e-3. Hence 1e-4 for fma/tc3/SJLT (over
  100× the float32 error: no false alarm from another summation order, yet it catches precision bugs
  such as a dropped tc3 term), 2e-4 for tc2 (80×) and 2e-2 for tc1 (12×). Structural errors are the
  integer probe's job, which is exact for every Rademacher algorithm.

The probe is 33 rows × 70,001 coordinates: it crosses the 32-row batch tile, the 32/64-coordinate steps
(70,001 is odd) and two split-K boundaries (32,768 rows each), with the projector's own proj_dim, seed,
model_id, kind and algorithm. On a mismatch, a non-finite output, a wrong shape or any exception the
projector uses the torch path and emits ONE :class:`CudaSelfCheckWarning` line naming the reason. The
decision is cached per (process, device, projector class, algorithm): later projectors of the same kind
in the process reuse it without re-running the check or warning again.

:func:`self_check` takes the candidate and the reference as plain callables (``x -> (B, proj_dim)``), so
it is testable on the CPU with a deliberately wrong candidate.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from torch import Tensor

from trak_core.errors import BadInputError

__all__ = [
    "CudaBackendError",
    "CudaFallbackWarning",
    "CudaSelfCheckWarning",
    "Probe",
    "make_probes",
    "self_check",
    "checked_once",
    "clear_cache",
    "PROBE_ROWS",
    "PROBE_COLS",
    "TOLERANCE",
    "EXACT_REL",
]


class CudaBackendError(BadInputError, RuntimeError):
    """The backend asked for (``backend="kernel"``, ``projector="fast_jl"``) cannot run here: no CUDA, the
    kernels did not build or failed their self-check. A :class:`~trak_core.errors.BadInputError` (retrying
    cannot help; the pipeline does not retry it), and a ``RuntimeError`` as it was before."""


PROBE_ROWS = 33  # > one 32-row batch tile
PROBE_COLS = 70_001  # > 2 × 32,768 (three split-K splits), odd: ragged 32/64-coordinate steps
PROBE_INT_MAX = 8  # |integer probe entries| ≤ 8: every partial sum ≤ 8 · 70,001 < 2**24, exact in float32
EXACT_REL = 2.0**-21  # per entry, integer probe: the final float32 rounding(s) of scale · sum, nothing else
TOLERANCE = {  # max |out - ref| / max |ref| on the float probe
    "fma": 1e-4,
    "tc3": 1e-4,
    "tc2": 2e-4,
    "tc1": 2e-2,
    "sjlt": 1e-4,
}


class CudaFallbackWarning(UserWarning):
    """A GPU projector runs on a slower path than asked for; the message says why."""


class CudaSelfCheckWarning(CudaFallbackWarning):
    """A GPU kernel failed its self-check; the projector uses the torch path (the message says why)."""


@dataclass(frozen=True)
class Probe:
    name: str  # "integer" or "float"
    x: Tensor
    exact: bool  # True: per-entry check to EXACT_REL; False: max-relative error to ``tol``
    tol: float


def make_probes(device, tol: float, exact: bool = True, rows: int = PROBE_ROWS, cols: int = PROBE_COLS) -> list[Probe]:
    """The probe inputs (fixed, seeded; float32 on ``device``): the integer probe when ``exact``, then the
    float probe."""
    g = torch.Generator().manual_seed(0x7EA11)
    probes = []
    if exact:
        xi = torch.randint(-PROBE_INT_MAX, PROBE_INT_MAX + 1, (rows, cols), generator=g).to(torch.float32)
        probes.append(Probe("integer", xi.to(device), True, EXACT_REL))
    xf = torch.randn(rows, cols, generator=g, dtype=torch.float32)
    probes.append(Probe("float", xf.to(device), False, tol))
    return probes


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or "(no message)"
    return f"{type(e).__name__}: {text[:200]}"


def self_check(
    candidate: Callable[[Tensor], Tensor], reference: Callable[[Tensor], Tensor], probes: list[Probe]
) -> str | None:
    """None when ``candidate`` agrees with ``reference`` on every probe, else why not (one line).

    ``reference`` should accumulate in float64; both get the same float32 probe tensor.
    """
    for p in probes:
        shape = "×".join(str(n) for n in p.x.shape)
        where = f"on a {shape} {p.name} input"
        try:
            ref = reference(p.x)
        except Exception as e:  # the reference failing is no licence for the kernel
            return f"the reference (torch path) raised {_one_line(e)} {where}"
        try:
            out = candidate(p.x)
        except Exception as e:
            return f"the kernel raised {_one_line(e)} {where}"
        if not isinstance(out, Tensor) or tuple(out.shape) != tuple(ref.shape):
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            return f"the kernel returned shape {got}, expected {tuple(ref.shape)} {where}"
        out64 = out.detach().to(torch.float64)
        ref64 = ref.detach().to(out64.device, torch.float64)
        if not bool(torch.isfinite(out64).all()):
            n = int((~torch.isfinite(out64)).sum())
            return f"{n} non-finite outputs {where}"
        diff = (out64 - ref64).abs()
        if p.exact:
            bad = diff > p.tol * ref64.abs()
            if bool(bad.any()):
                return (
                    f"{int(bad.sum())} of {bad.numel()} entries differ from the exact result "
                    f"(max |diff| {float(diff.max()):.3g}) {where}"
                )
        else:
            err = float(diff.max() / ref64.abs().max().clamp_min(1e-30))
            if not err <= p.tol:
                return f"max rel err {err:.1e} > {p.tol:.0e} {where}"
    return None


_lock = threading.RLock()
_decisions: dict[tuple, str | None] = {}


def clear_cache() -> None:
    """Forget the cached decisions (the next projector checks again)."""
    with _lock:
        _decisions.clear()


def checked_once(owner: str, device, algo: Hashable, run: Callable[[], str | None]) -> str | None:
    """The cached decision for (this process, ``device``, ``owner``, ``algo``): None (the kernel passed)
    or the reason it failed. The first call runs ``run()`` (normally a :func:`self_check`; an exception
    from it counts as a failure) and, on failure, emits the one warning line."""
    key = (os.getpid(), str(device), owner, algo)
    with _lock:
        if key in _decisions:
            return _decisions[key]
        try:
            reason = run()
        except Exception as e:
            reason = f"the check raised {_one_line(e)}"
        _decisions[key] = reason
    if reason is not None:
        label = owner if algo in (None, "") else f"{owner} ({algo})"
        warnings.warn(
            f"cuda_ext: {label} failed its self-check ({reason}); using the torch path",
            CudaSelfCheckWarning,
            stacklevel=4,
        )
    return reason
