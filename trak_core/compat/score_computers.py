"""traker's score computers (``get_xtx``, ``get_x_xtx_inv``, ``get_scores``) as standalone tensor utilities, the
matrix-product helpers of ``trak.utils`` they use, and what ``TRAKer(score_computer=...)`` means."""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod

import torch
from torch import Tensor

from ..errors import BadInputError
from .savers import traker_class

__all__ = [
    "AbstractScoreComputer",
    "BasicSingleBlockScoreComputer",
    "BasicScoreComputer",
    "score_computer_settings",
    "get_matrix_mult",
]


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


class AbstractScoreComputer(ABC):
    """traker's score-computer interface (``get_xtx``, ``get_x_xtx_inv``, ``get_scores``)."""

    @abstractmethod
    def __init__(self, dtype, device) -> None:
        self.dtype = dtype
        self.device = device

    @abstractmethod
    def get_xtx(self, grads: Tensor) -> Tensor:
        """XᵀX, (p, p)."""

    @abstractmethod
    def get_x_xtx_inv(self, grads: Tensor, xtx: Tensor) -> Tensor:
        """X (XᵀX)⁻¹, (n, p)."""

    @abstractmethod
    def get_scores(self, features: Tensor, target_grads: Tensor, accumulator: Tensor) -> Tensor | None:
        """accumulator += features @ target_gradsᵀ (in place; a subclass may also return the accumulator)."""


class BasicSingleBlockScoreComputer(AbstractScoreComputer):
    """All in one block: XᵀX, X (XᵀX)⁻¹ with the plain inverse (no λ, no rescale), one product.
    ``TRAKer(score_computer=BasicSingleBlockScoreComputer)`` means ``rescale_inverse=False`` and λ = 0."""

    def __init__(self, dtype, device) -> None:
        super().__init__(dtype, device)

    def get_xtx(self, grads: Tensor) -> Tensor:
        return grads.T @ grads

    def get_x_xtx_inv(self, grads: Tensor, xtx: Tensor) -> Tensor:
        inv = torch.linalg.inv(xtx.float())  # float16 has no inverse
        return grads @ inv.to(grads.dtype if self.dtype is None else self.dtype)

    def get_scores(self, features: Tensor, target_grads: Tensor, accumulator: Tensor) -> None:
        accumulator += (features @ target_grads.T).detach().to(accumulator.device, accumulator.dtype)


class BasicScoreComputer(AbstractScoreComputer):
    """Block-wise XᵀX; (XᵀX + λI)⁻¹ in float32 divided by its mean |entry| (traker's rescale); block-wise
    scores. This is what ``TRAKer`` computes by default (ours in float64 over the store)."""

    def __init__(
        self,
        dtype: torch.dtype,
        device: torch.device,
        CUDA_MAX_DIM_SIZE: int = 20_000,
        logging_level=logging.INFO,
        lambda_reg: float = 0.0,
    ) -> None:
        super().__init__(dtype, device)
        self.CUDA_MAX_DIM_SIZE = int(CUDA_MAX_DIM_SIZE)
        self.logger = logging.getLogger("ScoreComputer")
        self.logger.setLevel(logging_level)
        self.lambda_reg = lambda_reg

    def get_xtx(self, grads: Tensor) -> Tensor:
        self.proj_dim = grads.shape[1]
        out = torch.zeros(self.proj_dim, self.proj_dim, dtype=self.dtype, device=self.device)
        for block in torch.split(grads, self.CUDA_MAX_DIM_SIZE, dim=0):
            b = block.to(self.device, self.dtype)
            out += b.T @ b
        return out

    def get_x_xtx_inv(self, grads: Tensor, xtx: Tensor) -> Tensor:
        eye = torch.eye(xtx.shape[0], dtype=xtx.dtype, device=xtx.device)
        inv = torch.linalg.inv((xtx + self.lambda_reg * eye).to(torch.float32))
        inv = (inv / inv.abs().mean()).to(self.dtype)
        out = torch.empty(grads.shape[0], inv.shape[1], dtype=self.dtype, device=self.device)
        for start in range(0, grads.shape[0], self.CUDA_MAX_DIM_SIZE):
            out[start : start + self.CUDA_MAX_DIM_SIZE] = (
                grads[start : start + self.CUDA_MAX_DIM_SIZE].to(self.device, self.dtype) @ inv
            )
        return out

    def get_scores(self, features: Tensor, target_grads: Tensor, accumulator: Tensor) -> Tensor:
        big = features.shape[0] > self.CUDA_MAX_DIM_SIZE or target_grads.shape[0] > self.CUDA_MAX_DIM_SIZE
        scores = get_matrix_mult(
            features, target_grads, target_dtype=self.dtype, batch_size=self.CUDA_MAX_DIM_SIZE, use_blockwise=big
        )
        accumulator += scores.detach().to(accumulator.device, accumulator.dtype)
        return accumulator


def score_computer_settings(score_computer, lambda_reg) -> dict:
    """``TRAKer(score_computer=...)`` → the TRAKer settings it means (``rescale_inverse``), or an error."""
    if (
        score_computer is None
        or score_computer is BasicScoreComputer
        or traker_class(score_computer, "BasicScoreComputer")
    ):
        return {}
    if score_computer is BasicSingleBlockScoreComputer or traker_class(score_computer, "BasicSingleBlockScoreComputer"):
        if not (isinstance(lambda_reg, (int, float)) and float(lambda_reg) == 0.0):
            raise BadInputError(
                "score_computer=BasicSingleBlockScoreComputer uses the plain inverse without "
                f"damping, but lambda_reg={lambda_reg!r}: drop one of the two (the default "
                "BasicScoreComputer honours lambda_reg)"
            )
        return {"rescale_inverse": False}
    raise BadInputError(
        f"TRAKer(score_computer={getattr(score_computer, '__name__', score_computer)!r}) is not supported: "
        "trak_core computes XᵀX, (XᵀX + λI)⁻¹ and the scores itself, block-wise over its store in float64. "
        "Use score_computer=None (BasicScoreComputer's math) or BasicSingleBlockScoreComputer (plain inverse), "
        "and lambda_reg= / rescale_inverse= to change the math"
    )
