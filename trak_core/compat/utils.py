"""traker 0.3.2's ``trak.utils`` helpers, with its signatures, working on any device.

``import trak_core.compat.utils`` offers every public function of ``trak.utils`` so that a script written against
traker ports by changing the import. Where traker needs CUDA (pinned memory, CUDA streams, fast_jl) these
fall back to plain torch on whatever device the tensors live on; the results are the same.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor

from ..errors import BadInputError
from .score_computers import (
    get_free_memory,
    get_matrix_mult,
    get_matrix_mult_blockwise,
    get_matrix_mult_standard,
    get_output_memory,
)

__all__ = [
    "test_install",
    "parameters_to_vector",
    "get_num_params",
    "is_not_buffer",
    "vectorize",
    "get_output_memory",
    "get_free_memory",
    "get_matrix_mult_standard",
    "get_matrix_mult_blockwise",
    "get_matrix_mult",
    "get_parameter_chunk_sizes",
]

_BUFFER_MARKERS = ("running_mean", "running_var", "num_batches_tracked")


def test_install(use_fast_jl: bool = True):
    """Featurize a tiny linear model end to end; prints a line when it works.

    ``use_fast_jl=True`` uses the CUDA projector name (:class:`~trak_core.compat.projectors.CudaProjector`, our dense
    projection on any device) on CUDA when a GPU is present, else on CPU; ``False`` uses the identity
    projection on CPU, as traker does.
    """
    from trak_core.projection.projectors import AbstractProjector, NoOpProjector

    from .projectors import CudaProjector
    from .traker import TRAKer

    device = "cuda" if (use_fast_jl and torch.cuda.is_available()) else "cpu"
    x, y = torch.randn(20, 256, device=device), torch.randint(high=2, size=(20,), device=device)
    model = torch.nn.Linear(256, 2, bias=False).to(device)
    projector: AbstractProjector
    if use_fast_jl:
        projector = CudaProjector(
            grad_dim=512, proj_dim=512, seed=0, proj_type="rademacher", device=device, max_batch_size=32
        )
    else:
        projector = NoOpProjector()
    with tempfile.TemporaryDirectory() as tmp:
        traker = TRAKer(
            model=model,
            task="image_classification",
            train_set_size=20,
            proj_dim=512,
            save_dir=os.path.join(tmp, "store"),
            projector=projector,
            device=device,
            logging_level=100,
        )
        traker.load_checkpoint(model.state_dict(), model_id=0)
        traker.featurize((x, y), num_samples=20)
    print("trak_core is installed correctly!")


vars(test_install)["__test__"] = False  # not a pytest test, though its name says so (pytest reads __test__)


def parameters_to_vector(parameters: Iterable[Tensor]) -> Tensor:
    """Concatenate the flattened tensors (``reshape``, so non-contiguous parameters are fine)."""
    return torch.cat([p.reshape(-1) for p in parameters])


def get_num_params(model: torch.nn.Module) -> int:
    """Number of scalar parameters of ``model``."""
    return int(sum(p.numel() for p in model.parameters()))


def is_not_buffer(ind, params_dict) -> bool:
    """False when ``params_dict[ind]`` names a BatchNorm statistic (running mean/var, batch counter)."""
    name = params_dict[ind]
    return not any(marker in name for marker in _BUFFER_MARKERS)


def _resolve_device(device, like: Tensor):
    # traker's default is "cuda"; without a GPU we keep the gradients where they are instead of failing.
    if device is None:
        return like.device
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        return like.device
    return dev


def vectorize(g, arr=None, device="cuda") -> Tensor:
    """Flatten a dict ``{name: (B, *shape)}`` into ``(B, num_params)`` in dict order, written into ``arr``
    when given (else a new tensor on ``device``; ``"cuda"`` without a GPU means the gradients' device).
    1-D entries count as one column each, as in traker."""
    values = list(g.values())
    if not values:
        raise BadInputError("vectorize: empty gradient dict")
    first = values[0]
    batch = first.shape[0]
    cols = []
    for v in values:
        if v.shape[0] != batch:
            raise BadInputError(f"vectorize: batch sizes differ ({v.shape[0]} vs {batch})")
        cols.append(v.detach().reshape(batch, -1))
    width = sum(c.shape[1] for c in cols)
    if arr is None:
        arr = torch.empty(batch, width, dtype=first.dtype, device=_resolve_device(device, first))
    offset = 0
    for c in cols:
        arr[:, offset : offset + c.shape[1]] = c.to(arr.device)
        offset += c.shape[1]
    return arr


def get_parameter_chunk_sizes(model: torch.nn.Module, batch_size: int):
    """traker's grouping of consecutive parameters into chunks whose size times ``batch_size`` stays
    under 2³²: returns ``(max_chunk_size, params_per_chunk)``, the list summing to the parameter count.
    (Our projectors take any size; this serves scripts that build a ``ChunkedCudaProjector``.)"""
    max_chunk_size = int(np.iinfo(np.uint32).max // batch_size)
    chunks: list[int] = []
    current = 0
    for p in model.parameters():
        size = int(p.numel())
        if current + size >= max_chunk_size:
            chunks.append(current)
            current = 0
        current += size
    total = sum(int(p.numel()) for p in model.parameters())
    if total - sum(chunks) > 0:
        chunks.append(total - sum(chunks))
    return max_chunk_size, chunks
