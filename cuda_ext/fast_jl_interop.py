"""``projector="fast_jl"``: TRAK's own CUDA projector (the ``fast_jl`` package), where it is installed.

fast_jl draws its own matrix (curand, seeded with ``seed + 10000 * model_id`` as traker does), so its
projections are *not* those of trakflow's counter RNG; it is here for interop with traker-featurized
stores and as a benchmark baseline. This wrapper removes its usual constraints:

* any ``proj_dim``: the projection is computed at the next multiple of 512 and cut;
* any batch size: fast_jl loops over batches of 8/16/32 itself; we pick the variant by batch size;
* grad_dim × batch < 2**31 per call (fast_jl indexes with uint32): larger inputs are cut into row chunks
  and, where one example alone is too large, into coordinate chunks projected with derived seeds and summed;
* the result does not depend on the GPU's SM count: fast_jl's ``num_feature_tiles`` (traker passes the SM
  count, which changes the matrix) is pinned to a constant, 128 by default.

No self-check (cuda_ext/selfcheck.py) applies: fast_jl's matrix comes from curand inside the package and has
no device-independent definition to compare with (a JL-distortion test is statistics, not correctness).

Install (CUDA machine): ``pip install fast_jl --no-build-isolation`` (with build isolation, pip ≥ 23 builds
it against a fresh torch and fails).
"""

from __future__ import annotations

import torch
from torch import Tensor

from trak_core.errors import BadInputError
from trak_core.projection.projectors import AbstractProjector, ProjectionType, as_proj_type, check_dims

from .selfcheck import CudaBackendError

_LIMIT = 2**31 - 1
_CHUNK_SEED_STEP = 7919  # seed offset of the coordinate chunks of a single example above 2**31 elements


class FastJLMissingError(BadInputError, ModuleNotFoundError):
    """``projector="fast_jl"`` where the fast_jl package is not installed: a bad input (never retried), and
    the ``ModuleNotFoundError`` it was before."""


def import_fast_jl():
    try:
        import fast_jl  # noqa: F401
    except ImportError as e:
        raise FastJLMissingError(
            "projector='fast_jl' needs TRAK's CUDA projector, the fast_jl package: on a CUDA machine run "
            f"`pip install fast_jl --no-build-isolation` ({e})"
        ) from None
    return fast_jl


class FastJLProjector(AbstractProjector):
    kind = "fast_jl"

    def __init__(
        self,
        grad_dim: int,
        proj_dim: int,
        seed: int = 0,
        proj_type: str | ProjectionType = ProjectionType.rademacher,
        device="cuda",
        max_batch_size: int = 32,
        num_feature_tiles: int = 128,
        input_dtype: torch.dtype | None = None,
        dtype: torch.dtype = torch.float32,
        *args,
        **kwargs,
    ) -> None:
        check_dims(grad_dim, proj_dim)
        super().__init__(grad_dim, proj_dim, seed, as_proj_type(proj_type), device)
        self.fast_jl = import_fast_jl()
        dev = torch.device(device)
        if dev.type != "cuda":
            raise BadInputError(
                f"projector='fast_jl' runs on CUDA only, got device={str(dev)!r}; use projector='dense' on the CPU"
            )
        if not torch.cuda.is_available():
            raise CudaBackendError("projector='fast_jl' needs a CUDA device; none is visible")
        if max_batch_size not in (8, 16, 32):
            raise BadInputError(f"max_batch_size must be 8, 16 or 32, got {max_batch_size!r}")
        self.device = dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.max_batch_size = max_batch_size
        self.num_feature_tiles = int(num_feature_tiles)
        self.input_dtype = input_dtype  # None: float32 stays float32, anything else becomes float16
        self.dtype = dtype
        self.padded_dim = -(-proj_dim // 512) * 512

    def _fn(self, batch: int):
        eff = 8 if batch <= 8 else 16 if batch <= 16 else 32
        eff = min(eff, self.max_batch_size)
        return getattr(self.fast_jl, f"project_{self.proj_type.value}_{eff}")

    def _seed(self, model_id: int, chunk: int = 0) -> int:
        return (int(self.seed) + 10000 * int(model_id) + _CHUNK_SEED_STEP * chunk) & 0xFFFFFFFF

    def project(self, grads: dict | Tensor, model_id: int) -> Tensor:
        self._check_input(grads)
        if isinstance(grads, dict):
            x = torch.cat([g.reshape(g.shape[0], -1).to(self.device) for g in grads.values()], dim=1)
        else:
            x = grads.to(self.device)
        dt = self.input_dtype or (torch.float32 if x.dtype == torch.float32 else torch.float16)
        x = x.to(dt).contiguous()
        batch, width = x.shape
        out = torch.zeros(batch, self.padded_dim, dtype=torch.float32, device=self.device)
        col_step = min(width, _LIMIT)
        with torch.cuda.device(self.device):
            for ci, k0 in enumerate(range(0, width, col_step)):
                k1 = min(k0 + col_step, width)
                rows = max(1, _LIMIT // (k1 - k0))
                for b0 in range(0, batch, rows):
                    b1 = min(b0 + rows, batch)
                    xb = x[b0:b1, k0:k1].contiguous()
                    out[b0:b1] += self._fn(b1 - b0)(
                        xb, self.padded_dim, self._seed(model_id, ci), self.num_feature_tiles
                    )
        out = out[:, : self.proj_dim]
        return out if self.dtype == torch.float32 else out.to(self.dtype)
