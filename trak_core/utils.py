"""traker 0.3.2's ``trak.utils`` helpers, with its signatures, working on any device.

``import trak_core.utils`` offers every public function of ``trak.utils`` so that a script written against
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

from .errors import BadInputError

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

    ``use_fast_jl=True`` uses the CUDA projector name (:class:`~trak_core.compat.CudaProjector`, our dense
    projection on any device) on CUDA when a GPU is present, else on CPU; ``False`` uses the identity
    projection on CPU, as traker does.
    """
    from .compat import CudaProjector
    from .projectors import AbstractProjector, NoOpProjector
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


def get_output_memory(features: Tensor, target_grads: Tensor, target_dtype: torch.dtype):
    """Bytes of the (n_train, n_targets) score matrix in ``target_dtype``."""
    itemsize = torch.empty((), dtype=target_dtype).element_size()
    return int(features.size(0)) * int(target_grads.size(0)) * itemsize


def get_free_memory(device):
    """Bytes free for new tensors: reserved-but-unallocated CUDA memory (traker's rule) on a GPU, the
    available RAM elsewhere."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 0


def get_matrix_mult_standard(features: Tensor, target_grads: Tensor, target_dtype: torch.dtype):
    """``features @ target_grads.T`` in one product, returned as a new ``target_dtype`` tensor."""
    return (features @ target_grads.t()).to(target_dtype).clone()


def get_matrix_mult_blockwise(features: Tensor, target_grads: Tensor, target_dtype: torch.dtype, bs: int):
    """``features @ target_grads.T`` in (bs × bs) blocks, on the CPU output (traker overlaps the blocks with
    CUDA streams; the blocks here run on the device of the inputs, a GPU when one holds them)."""
    n, m = features.shape[0], target_grads.shape[0]
    bs = max(1, min(n, m, int(bs)))
    out = torch.empty((n, m), dtype=target_dtype, device="cpu")
    for i in range(0, n, bs):
        fi = features[i : i + bs]
        for j in range(0, m, bs):
            out[i : i + bs, j : j + bs] = (fi @ target_grads[j : j + bs].t()).to(device="cpu", dtype=target_dtype)
    return out


def get_matrix_mult(
    features: Tensor,
    target_grads: Tensor,
    target_dtype: torch.dtype | None = None,
    batch_size: int = 8096,
    use_blockwise: bool = False,
) -> Tensor:
    """``features @ target_grads.T`` (n × m), block-wise when asked or when the output would not fit in
    free memory of the features' device; ``target_dtype`` defaults to the features' dtype."""
    if target_dtype is None:
        target_dtype = features.dtype
    if use_blockwise:
        return get_matrix_mult_blockwise(features, target_grads, target_dtype, batch_size)
    if features.device.type == "cpu":
        return get_matrix_mult_standard(features, target_grads, target_dtype)
    if get_output_memory(features, target_grads, target_dtype) < get_free_memory(features.device):
        return get_matrix_mult_standard(features, target_grads, target_dtype)
    return get_matrix_mult_blockwise(features, target_grads, target_dtype, batch_size)


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
