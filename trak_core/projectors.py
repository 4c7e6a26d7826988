"""JL projections of per-example gradients: one contract, several implementations.

Contract (checked for every implementation by ``tests/test_projector_contract.py``):

* ``project(grads, model_id)`` takes (B, grad_dim) gradients, or a dict {name: (B, *shape)} whose
  flattened sizes add up to grad_dim, and returns (B, proj_dim) float32 (or the projector's dtype).
* The result is a pure function of (seed, model_id, grad_dim, proj_dim, kind) and the example's own
  gradient: the same example gets the same vector in any batch, batch size, shard, process or machine
  (up to float rounding of the matmul; bit-identical for identical batches).
* E⟨Px, Py⟩ = proj_dim · ⟨x, y⟩ for the dense kinds (entries have unit variance, no 1/√k scaling, as in
  traker); ``scale`` tells the factor so callers can compare inner products.

The dense matrix is defined by :mod:`trak_core.counter_rng`, generated in row blocks, cached when it
fits ``cache_bytes``. A dict input is projected parameter by parameter (the "chunked path": the
flattened (B, grad_dim) gradient is never materialized, so grad_dim may exceed memory for one matrix).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import Union

import torch
from torch import Tensor

from . import counter_rng
from .errors import BadInputError
from .gradients import vectorize


class ProjectionType(str, Enum):
    normal = "normal"
    rademacher = "rademacher"


def _proj_type(value) -> ProjectionType:
    try:
        return ProjectionType(value.value if isinstance(value, Enum) else value)
    except ValueError:
        raise BadInputError(f"unknown projection type {value!r}; use 'rademacher' or 'normal'") from None


def _check_dims(grad_dim: int, proj_dim: int) -> None:
    for name, v in (("grad_dim", grad_dim), ("proj_dim", proj_dim)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise BadInputError(f"{name} must be a positive integer, got {v!r}")


class AbstractProjector(ABC):
    """Base class (traker-compatible constructor)."""

    kind: str = "abstract"

    def __init__(self, grad_dim: int, proj_dim: int, seed: int, proj_type: Union[str, ProjectionType],
                 device: Union[str, torch.device]) -> None:
        self.grad_dim = grad_dim
        self.proj_dim = proj_dim
        self.seed = seed
        self.proj_type = proj_type
        self.device = device

    @abstractmethod
    def project(self, grads: Union[dict, Tensor], model_id: int) -> Tensor:
        """Project a batch of gradients with the matrix of ``model_id``."""

    def free_memory(self) -> None:
        """Drop cached matrices."""

    @property
    def scale(self) -> float:
        """E⟨Px, Py⟩ / ⟨x, y⟩."""
        return float(self.proj_dim)

    def spec(self) -> dict:
        """What identifies this projection (stored in the store's metadata)."""
        pt = self.proj_type.value if isinstance(self.proj_type, Enum) else str(self.proj_type)
        return {"kind": self.kind, "proj_type": pt, "seed": int(self.seed), "grad_dim": int(self.grad_dim),
                "proj_dim": int(self.proj_dim)}

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


class NoOpProjector(AbstractProjector):
    """The identity: ``project(g) = g`` (proj_dim is grad_dim)."""

    kind = "noop"

    def __init__(self, grad_dim: int = 0, proj_dim: int = 0, seed: int = 0,
                 proj_type: Union[str, ProjectionType] = "na", device="cpu", *args, **kwargs) -> None:
        super().__init__(grad_dim, proj_dim, seed, proj_type, device)

    def project(self, grads, model_id: int) -> Tensor:
        if self.grad_dim:
            self._check_input(grads)
        return vectorize(grads, device=self.device)

    @property
    def scale(self) -> float:
        return 1.0


class DenseProjector(AbstractProjector):
    """Dense Rademacher (±1) or standard-normal projection, generated block-wise from the counter RNG.

    ``block_rows`` rows of the matrix are generated (or read from the cache) and multiplied at a time;
    the whole matrix is cached per model_id when grad_dim × proj_dim × 4 bytes ≤ ``cache_bytes``.
    """

    kind = "dense"

    def __init__(self, grad_dim: int, proj_dim: int, seed: int = 0,
                 proj_type: Union[str, ProjectionType] = ProjectionType.rademacher, device="cpu",
                 dtype: torch.dtype = torch.float32, block_rows: int | None = None,
                 cache_bytes: int = 512 * 2**20, model_id: int = 0, *args, **kwargs) -> None:
        _check_dims(grad_dim, proj_dim)
        super().__init__(grad_dim, proj_dim, seed, _proj_type(proj_type), device)
        self.dtype = dtype
        self.block_rows = block_rows or max(256, (64 * 2**20) // (4 * proj_dim))
        self.cache_bytes = cache_bytes
        self.model_id = model_id
        self._cache: tuple[int, Tensor] | None = None

    def free_memory(self) -> None:
        self._cache = None

    def generate(self, model_id: int, row0: int, row1: int) -> Tensor:
        """Rows [row0, row1) of the matrix for ``model_id`` (CPU float32; the definition)."""
        fn = counter_rng.rademacher_block if self.proj_type == ProjectionType.rademacher else counter_rng.normal_block
        step = max(1, (1 << 19) // self.proj_dim)  # generate in cache-sized pieces
        if row1 - row0 <= step:
            return fn(self.seed, model_id, row0, row1, self.proj_dim)
        out = torch.empty(row1 - row0, self.proj_dim, dtype=torch.float32)
        for r in range(row0, row1, step):
            e = min(r + step, row1)
            out[r - row0:e - row0] = fn(self.seed, model_id, r, e, self.proj_dim)
        return out

    def matrix(self, model_id: int) -> Tensor:
        """The whole grad_dim × proj_dim matrix (only for small sizes and tests)."""
        return self.generate(model_id, 0, self.grad_dim)

    def _block(self, model_id: int, row0: int, row1: int) -> Tensor:
        fits = self.grad_dim * self.proj_dim * 4 <= self.cache_bytes
        if fits:
            if self._cache is None or self._cache[0] != model_id:
                self._cache = (model_id, self.generate(model_id, 0, self.grad_dim).to(self.device, self.dtype))
            return self._cache[1][row0:row1]
        return self.generate(model_id, row0, row1).to(self.device, self.dtype)

    def project(self, grads, model_id: int) -> Tensor:
        self._check_input(grads)
        if isinstance(grads, dict):
            pieces = [(g.reshape(g.shape[0], -1)) for g in grads.values()]
        else:
            pieces = [grads]
        batch = pieces[0].shape[0]
        out = torch.zeros(batch, self.proj_dim, dtype=self.dtype, device=self.device)
        offset = 0
        for piece in pieces:
            width = piece.shape[1]
            for c0 in range(0, width, self.block_rows):
                c1 = min(c0 + self.block_rows, width)
                block = self._block(model_id, offset + c0, offset + c1)
                out.addmm_(piece[:, c0:c1].to(self.device, self.dtype), block)
            offset += width
        return out


class BasicProjector(DenseProjector):
    """traker's name for the block-wise dense projector (``block_size`` is accepted and ignored: our
    blocking is over rows of the matrix and does not change the result)."""

    kind = "dense"

    def __init__(self, grad_dim: int, proj_dim: int, seed: int = 0,
                 proj_type: Union[str, ProjectionType] = ProjectionType.rademacher, device="cpu",
                 block_size: int = 100, dtype: torch.dtype = torch.float32, model_id: int = 0,
                 *args, **kwargs) -> None:
        super().__init__(grad_dim, proj_dim, seed, proj_type, device, dtype=dtype, model_id=model_id, **kwargs)


class BasicSingleBlockProjector(DenseProjector):
    """The same projection with the whole matrix materialized at once (no cache limit)."""

    def __init__(self, grad_dim: int, proj_dim: int, seed: int = 0,
                 proj_type: Union[str, ProjectionType] = ProjectionType.rademacher, device="cpu",
                 dtype: torch.dtype = torch.float32, model_id: int = 0, *args, **kwargs) -> None:
        super().__init__(grad_dim, proj_dim, seed, proj_type, device, dtype=dtype, model_id=model_id,
                         block_rows=grad_dim, cache_bytes=2**62)


# the structured kinds live in their own modules (imported here, after the base classes they subclass)
from .factored import FactoredProjector  # noqa: E402
from .sjlt import SJLTProjector  # noqa: E402

PROJECTORS = {"noop": NoOpProjector, "dense": DenseProjector, "sjlt": SJLTProjector, "factored": FactoredProjector}


def make_projector(kind: str, grad_dim: int, proj_dim: int, seed: int = 0, proj_type: str = "rademacher",
                   device="cpu", **kwargs) -> AbstractProjector:
    """Build a projector by kind name (the pipeline's entry point).

    ``"factored"`` needs ``model=`` (and the ``grad_wrt`` used for the gradients): its blocks are the model's
    layers; ``"sjlt"`` takes ``c=`` (nonzeros per input coordinate).
    """
    if kind == "fast_jl" or (kind in ("dense", "sjlt") and str(device).startswith("cuda")):
        try:  # the GPU kernels (cuda_ext/, optional): imported here only, never when trak_core is imported
            import cuda_ext
        except ImportError:
            cuda_ext = None
        if cuda_ext is not None:
            kwargs.pop("model", None)
            kwargs.pop("grad_wrt", None)
            return cuda_ext.make_cuda_projector(kind, grad_dim, proj_dim, seed, proj_type, device, **kwargs)
    if kind not in PROJECTORS:
        raise BadInputError(f"unknown projector {kind!r}; choose one of {sorted(PROJECTORS)}")
    if kind == "noop":
        return NoOpProjector(grad_dim=grad_dim, proj_dim=grad_dim, device=device)
    if kind == "factored":
        model = kwargs.pop("model", None)
        if model is None:
            raise BadInputError("projector 'factored' needs the model (make_projector(..., model=model, "
                                "grad_wrt=...)): its blocks are the model's layers")
        grad_wrt = kwargs.pop("grad_wrt", None)
        p = FactoredProjector.from_model(model, proj_dim, seed, proj_type, device, grad_wrt=grad_wrt, **kwargs)
        if p.grad_dim != grad_dim:
            raise BadInputError(f"projector 'factored': the model has {p.grad_dim} gradient coordinates "
                                f"(grad_wrt={grad_wrt!r}), not grad_dim={grad_dim}")
        return p
    kwargs.pop("model", None)
    kwargs.pop("grad_wrt", None)
    return PROJECTORS[kind](grad_dim, proj_dim, seed, proj_type, device, **kwargs)
