"""traker's ``CudaProjector``, ``ChunkedCudaProjector``, ``BasicProjector`` and ``BasicSingleBlockProjector`` names
over trak_core's dense projection.

They take traker's constructor arguments and map to :class:`~trak_core.projection.projectors.DenseProjector`
(counter-based
RNG): they work on any device, CPU included, and give the same vectors on every device. On a GPU the projection
uses trakflow's kernels (``cuda_ext``) when they build. They are not fast_jl: the matrices differ from traker's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trak_core.projection.projectors import DenseProjector, ProjectionType, make_projector

from ..errors import BadInputError

__all__ = ["CudaProjector", "ChunkedCudaProjector", "BasicProjector", "BasicSingleBlockProjector"]


def _proj_type(value) -> ProjectionType:
    try:
        return ProjectionType(getattr(value, "value", value))
    except ValueError:
        raise BadInputError(f"unknown projection type {value!r}; use 'rademacher' or 'normal'") from None


class CudaProjector(DenseProjector):
    """traker's ``CudaProjector(grad_dim, proj_dim, seed, proj_type, device, max_batch_size, ...)`` on any
    device: the dense Rademacher/normal projection of :class:`~trak_core.projection.projectors.DenseProjector`.

    As with fast_jl, the result has the dtype of the input gradients (``dtype=`` sets the compute dtype;
    float32 by default) and ``max_batch_size`` / ``num_sms`` do not change the result (they are kept as
    attributes for scripts that set them).
    """

    def __init__(
        self,
        grad_dim: int,
        proj_dim: int,
        seed: int,
        proj_type: str | ProjectionType,
        device,
        max_batch_size: int,
        *args,
        **kwargs,
    ) -> None:
        dtype = kwargs.pop("dtype", torch.float32)
        if dtype not in (torch.float32, torch.float64):
            dtype = torch.float32  # half-precision inputs are projected in float32, returned in their dtype
        ptype = _proj_type(proj_type)
        super().__init__(int(grad_dim), int(proj_dim), int(seed), ptype, device, dtype=dtype)
        self.max_batch_size = max_batch_size
        dev = torch.device(device)
        if dev.type == "cuda" and torch.cuda.is_available():
            self.num_sms = torch.cuda.get_device_properties(dev.index or 0).multi_processor_count
        else:
            self.num_sms = torch.get_num_threads()
        self._gpu = None
        if dev.type == "cuda":
            p = make_projector("dense", self.grad_dim, self.proj_dim, self.seed, ptype.value, device)
            if not isinstance(p, DenseProjector):
                self._gpu = p

    def project(self, grads: dict | Tensor, model_id: int) -> Tensor:
        in_dtype = next(iter(grads.values())).dtype if isinstance(grads, dict) else grads.dtype
        out = self._gpu.project(grads, model_id) if self._gpu is not None else super().project(grads, model_id)
        return out.to(in_dtype) if in_dtype.is_floating_point else out


class ChunkedCudaProjector:
    """traker's ``ChunkedCudaProjector``: consecutive parameters are grouped into chunks (a new chunk starts
    when the next parameter would take the current one past ``max_chunk_size``; ``params_per_chunk`` are the
    chunk widths, as from :func:`trak_core.compat.utils.get_parameter_chunk_sizes`), chunk ``i`` is projected with
    ``projector_per_chunk[i]`` and the projections are summed. Any device."""

    def __init__(
        self,
        projector_per_chunk: list,
        max_chunk_size: int,
        params_per_chunk: list,
        feat_bs: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        if len(projector_per_chunk) != len(params_per_chunk):
            raise BadInputError(
                f"ChunkedCudaProjector: {len(projector_per_chunk)} projectors for {len(params_per_chunk)} chunks"
            )
        self.projector_per_chunk = projector_per_chunk
        self.proj_dim = projector_per_chunk[0].proj_dim
        self.proj_type = projector_per_chunk[0].proj_type
        self.params_per_chunk = [int(c) for c in params_per_chunk]
        self.grad_dim = sum(self.params_per_chunk)
        self.max_chunk_size = int(max_chunk_size)
        self.feat_bs = feat_bs
        self.device = device
        self.dtype = dtype

    def free_memory(self) -> None:
        for p in self.projector_per_chunk:
            p.free_memory()

    def _chunks(self, grads: dict):
        current: list[Tensor] = []
        width = 0
        for g in grads.values():
            flat = g.detach().reshape(g.shape[0], -1)
            if current and width + flat.shape[1] > self.max_chunk_size:
                yield current, width
                current, width = [], 0
            current.append(flat)
            width += flat.shape[1]
        if current:
            yield current, width

    def project(self, grads, model_id):
        if not isinstance(grads, dict):
            raise BadInputError("ChunkedCudaProjector.project takes the gradient dict {name: (B, *shape)}")
        out = None
        for i, (parts, width) in enumerate(self._chunks(grads)):
            if i >= len(self.params_per_chunk) or width != self.params_per_chunk[i]:
                raise BadInputError(
                    f"ChunkedCudaProjector: chunk {i} has {width} parameters, params_per_chunk "
                    f"says {self.params_per_chunk[i] if i < len(self.params_per_chunk) else None}"
                )
            x = torch.cat(parts, dim=1).to(self.device)
            p = self.projector_per_chunk[i].project(x, model_id=model_id).to(self.device, self.dtype)
            out = p if out is None else out + p
        return out


class BasicProjector(DenseProjector):
    """traker's name for the block-wise dense projector (``block_size`` is accepted and ignored: our
    blocking is over rows of the matrix and does not change the result)."""

    kind = "dense"

    def __init__(
        self,
        grad_dim: int,
        proj_dim: int,
        seed: int = 0,
        proj_type: str | ProjectionType = ProjectionType.rademacher,
        device="cpu",
        block_size: int = 100,
        dtype: torch.dtype = torch.float32,
        model_id: int = 0,
        *args,
        **kwargs,
    ) -> None:
        super().__init__(grad_dim, proj_dim, seed, proj_type, device, dtype=dtype, model_id=model_id, **kwargs)


class BasicSingleBlockProjector(DenseProjector):
    """The same projection with the whole matrix materialized at once (no cache limit)."""

    def __init__(
        self,
        grad_dim: int,
        proj_dim: int,
        seed: int = 0,
        proj_type: str | ProjectionType = ProjectionType.rademacher,
        device="cpu",
        dtype: torch.dtype = torch.float32,
        model_id: int = 0,
        *args,
        **kwargs,
    ) -> None:
        super().__init__(
            grad_dim,
            proj_dim,
            seed,
            proj_type,
            device,
            dtype=dtype,
            model_id=model_id,
            block_rows=grad_dim,
            cache_bytes=2**62,
        )
