"""trakflow's own GPU projection kernels (CUDA C++, built at first use with torch's extension builder).

The projections are those of :mod:`trak_core.projection.counter_rng` (dense Rademacher, dense normal, SJLT): the GPU
computes what the CPU computes, same seed ⇒ same result up to float rounding, on any GPU model.

* :class:`CudaDenseProjector` — dense, matrix generated on the fly from the counter hash; split-K with a
  deterministic reduction; float32 FMA or tensor cores (bf16 terms of x, float32 accumulation).
* :class:`CudaSJLTProjector` — SJLT, a deterministic gather over a per-model CSR plan built on the GPU.
* :class:`~cuda_ext.fast_jl_interop.FastJLProjector` — ``projector="fast_jl"`` (TRAK's kernel), optional.
* :func:`load_extension` / :func:`unavailable_reason` — the build, and why it is not there.

trak_core never imports this package. Importing it registers the GPU projectors in trak_core's projector
registry (:func:`trak_core.projection.projectors.register_projector`); the installed package declares the entry point
``trakflow.projectors: cuda_ext``, so ``make_projector(kind, ..., device="cuda")`` imports it on first use.
Without CUDA the projectors fall back to trak_core's CPU projectors with a one-line
:class:`CudaFallbackWarning`; kernels that fail their first-use self-check (:mod:`cuda_ext.selfcheck`) give
way to the torch path with a one-line :class:`CudaSelfCheckWarning`. See docs/gpu.md.
"""

from ._build import is_available, load_extension, source_digest, unavailable_reason
from .projectors import (
    ALGOS,
    BACKENDS,
    CudaBackendError,
    CudaDenseProjector,
    CudaFallbackWarning,
    CudaProjector,
    CudaSelfCheckWarning,
    CudaSJLTProjector,
    make_cuda_projector,
    register_projectors,
)

register_projectors()

__all__ = [
    "CudaDenseProjector",
    "CudaSJLTProjector",
    "CudaProjector",
    "CudaFallbackWarning",
    "CudaSelfCheckWarning",
    "CudaBackendError",
    "make_cuda_projector",
    "register_projectors",
    "load_extension",
    "unavailable_reason",
    "is_available",
    "source_digest",
    "ALGOS",
    "BACKENDS",
]
