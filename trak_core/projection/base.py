"""The projector contract: :class:`AbstractProjector` (traker-compatible constructor), the projection types and
the argument checks every implementation shares."""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum

import torch
from torch import Tensor

from trak_core.errors import BadInputError


class ProjectionType(str, Enum):  # noqa: UP042 - a StrEnum would change str(member), which traker code prints
    normal = "normal"
    rademacher = "rademacher"


def as_proj_type(value) -> ProjectionType:
    """``value`` (a name or an enum member) as a :class:`ProjectionType`; :class:`BadInputError` otherwise."""
    try:
        return ProjectionType(value.value if isinstance(value, Enum) else value)
    except ValueError:
        raise BadInputError(f"unknown projection type {value!r}; use 'rademacher' or 'normal'") from None


def check_dims(grad_dim: int, proj_dim: int) -> None:
    """Raise :class:`BadInputError` unless grad_dim and proj_dim are positive integers."""
    for name, v in (("grad_dim", grad_dim), ("proj_dim", proj_dim)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise BadInputError(f"{name} must be a positive integer, got {v!r}")


class AbstractProjector(ABC):
    """Base class (traker-compatible constructor)."""

    kind: str = "abstract"

    def __init__(
        self, grad_dim: int, proj_dim: int, seed: int, proj_type: str | ProjectionType, device: str | torch.device
    ) -> None:
        self.grad_dim = grad_dim
        self.proj_dim = proj_dim
        self.seed = seed
        self.proj_type = proj_type
        self.device = device

    @abstractmethod
    def project(self, grads: dict | Tensor, model_id: int) -> Tensor:
        """Project a batch of gradients with the matrix of ``model_id``."""

    def free_memory(self) -> None:  # noqa: B027 - optional hook: projectors without a cache keep this no-op
        """Drop cached matrices."""

    @property
    def scale(self) -> float:
        """E⟨Px, Py⟩ / ⟨x, y⟩."""
        return float(self.proj_dim)

    def spec(self) -> dict:
        """What identifies this projection (stored in the store's metadata)."""
        pt = self.proj_type.value if isinstance(self.proj_type, Enum) else str(self.proj_type)
        return {
            "kind": self.kind,
            "proj_type": pt,
            "seed": int(self.seed),
            "grad_dim": int(self.grad_dim),
            "proj_dim": int(self.proj_dim),
        }

    def _check_input(self, grads) -> None:
        if isinstance(grads, dict):
            d = sum(int(g[0].numel()) for g in grads.values())
            b = {g.shape[0] for g in grads.values()}
            if len(b) != 1:
                raise BadInputError(f"gradient dict has different batch sizes {sorted(b)}")
        elif isinstance(grads, Tensor):
            if grads.dim() != 2:
                raise BadInputError(f"gradients must be (batch, grad_dim), got shape {tuple(grads.shape)}")
            d = grads.shape[1]
        else:
            raise BadInputError(f"gradients must be a tensor or a dict of tensors, got {type(grads).__name__}")
        if d != self.grad_dim:
            raise BadInputError(f"gradient dimension {d} does not match the projector's grad_dim={self.grad_dim}")
