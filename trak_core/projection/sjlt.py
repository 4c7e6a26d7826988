"""Sparse JL projection (SJLT): ``c`` nonzero ±√(proj_dim / c) entries per input coordinate.

The matrix is *defined* by :func:`trak_core.projection.counter_rng.sjlt_block` (the CUDA kernel implements the same
definition): input coordinate i has nonzeros in the columns ``cols[i, r]`` with signs ``signs[i, r]``,
r < c, hashed from (seed, model_id, i·c + r); repeated columns of one coordinate add up. Every entry has
E[P_ij²] = 1 (as the dense kinds), so E⟨Px, Py⟩ = proj_dim · ⟨x, y⟩ and ``scale`` is proj_dim.

CPU implementation (chosen by measurement, see ``benchmarks/RESULTS.md``): the coordinates are cut into
segments of ``block_rows`` (and at parameter boundaries for dict input); each segment's transposed
matrix Sₛᵀ (proj_dim × segment) is a torch CSR tensor, cached per model_id while the cache stays under
``cache_bytes``, and the batch is accumulated as ``outᵀ += Sₛᵀ @ Gₛᵀ`` (``torch.sparse.mm``, MKL). Short
segments keep Gₛᵀ in cache: with 4096-row segments this is 2–4× faster than one big sparse product
(transposing a 400 MB gradient block alone costs more than the sparse product). A dict input is
projected parameter by parameter; the flattened (B, grad_dim) gradient is never built.

Cost per example: grad_dim · c multiply-adds (dense: grad_dim · proj_dim).
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

from trak_core.errors import BadInputError
from trak_core.projection import counter_rng
from trak_core.projection.base import AbstractProjector, ProjectionType, as_proj_type, check_dims

DEFAULT_C = 4


def _check_c(c, proj_dim: int) -> int:
    if not isinstance(c, int) or isinstance(c, bool) or c <= 0:
        raise BadInputError(f"SJLT: c (nonzeros per input coordinate) must be a positive integer, got {c!r}")
    if c > proj_dim:
        raise BadInputError(f"SJLT: c={c} exceeds proj_dim={proj_dim}; use c ≤ proj_dim (typically 2–8)")
    return c


class SJLTProjector(AbstractProjector):
    """Sparse JL projection with ``c`` nonzeros per input coordinate (kind ``"sjlt"``).

    Arguments follow the other projectors; extra ones: ``c`` (nonzeros per coordinate, default 4),
    ``block_rows`` (coordinates per sparse segment), ``cache_bytes`` (budget of the cached segments of
    one model_id; beyond it segments are rebuilt for every batch).
    """

    kind = "sjlt"

    def __init__(
        self,
        grad_dim: int,
        proj_dim: int,
        seed: int = 0,
        proj_type: str | ProjectionType = ProjectionType.rademacher,
        device="cpu",
        c: int = DEFAULT_C,
        dtype: torch.dtype = torch.float32,
        block_rows: int = 4096,
        cache_bytes: int = 256 * 2**20,
        model_id: int = 0,
        *args,
        **kwargs,
    ) -> None:
        check_dims(grad_dim, proj_dim)
        pt = as_proj_type(proj_type)
        if pt != ProjectionType.rademacher:
            raise BadInputError(
                f"SJLT entries are signs ±√(proj_dim/c); proj_type {pt.value!r} is not defined "
                "for it (use 'rademacher')"
            )
        super().__init__(grad_dim, proj_dim, seed, pt, device)
        self.c = _check_c(c, proj_dim)
        self.dtype = dtype
        if not isinstance(block_rows, int) or block_rows <= 0:
            raise BadInputError(f"block_rows must be a positive integer, got {block_rows!r}")
        self.block_rows = block_rows
        self.cache_bytes = cache_bytes
        self.model_id = model_id
        self._cache: dict[tuple[int, int], Tensor] = {}
        self._cache_model: int | None = None
        self._cache_used = 0

    # ------------------------------------------------------------------ the definition
    def nonzeros(self, model_id: int, row0: int, row1: int) -> tuple[Tensor, Tensor]:
        """(columns (r, c) int64, values (r, c) float32) of input coordinates [row0, row1)."""
        cols, signs = counter_rng.sjlt_block(self.seed, model_id, row0, row1, self.proj_dim, self.c)
        return cols, signs.to(torch.float32) * math.sqrt(self.proj_dim / self.c)

    def matrix(self, model_id: int) -> Tensor:
        """The dense grad_dim × proj_dim matrix (small sizes and tests only)."""
        cols, vals = self.nonzeros(model_id, 0, self.grad_dim)
        out = torch.zeros(self.grad_dim, self.proj_dim)
        out.index_put_((torch.arange(self.grad_dim)[:, None].expand_as(cols), cols), vals, accumulate=True)
        return out

    def spec(self) -> dict:
        return {**super().spec(), "c": int(self.c)}

    # ------------------------------------------------------------------ the sparse segments
    def free_memory(self) -> None:
        self._cache = {}
        self._cache_model = None
        self._cache_used = 0

    def _segment(self, model_id: int, row0: int, row1: int) -> Tensor:
        """Sᵀ of coordinates [row0, row1): a (proj_dim × (row1 - row0)) CSR tensor (duplicates summed)."""
        if self._cache_model != model_id:
            self.free_memory()
            self._cache_model = model_id
        key = (row0, row1)
        seg = self._cache.get(key)
        if seg is not None:
            return seg
        cols, vals = self.nonzeros(model_id, row0, row1)
        width = row1 - row0
        # sort by (output column, input coordinate): CSR of Sᵀ; equal pairs are summed (repeated columns)
        flat = cols.reshape(-1) * width + torch.arange(width).repeat_interleave(self.c)
        uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        values = torch.zeros(uniq.numel(), dtype=torch.float32).index_add_(0, inverse, vals.reshape(-1))
        rows = uniq // width
        crow = torch.zeros(self.proj_dim + 1, dtype=torch.int64)
        crow[1:] = torch.bincount(rows, minlength=self.proj_dim).cumsum(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
            seg = torch.sparse_csr_tensor(
                crow, uniq % width, values.to(self.dtype), (self.proj_dim, width), device=self.device
            )
        size = uniq.numel() * 12 + crow.numel() * 8
        if self._cache_used + size <= self.cache_bytes:
            self._cache[key] = seg
            self._cache_used += size
        return seg

    # ------------------------------------------------------------------ projection
    def project(self, grads, model_id: int) -> Tensor:
        self._check_input(grads)
        if isinstance(grads, dict):
            pieces = [g.reshape(g.shape[0], -1) for g in grads.values()]
        else:
            pieces = [grads]
        batch = pieces[0].shape[0]
        out_t = torch.zeros(self.proj_dim, batch, dtype=self.dtype, device=self.device)
        offset = 0
        for piece in pieces:
            width = piece.shape[1]
            for c0 in range(0, width, self.block_rows):
                c1 = min(c0 + self.block_rows, width)
                seg = self._segment(model_id, offset + c0, offset + c1)
                g_t = piece[:, c0:c1].to(self.device, self.dtype).T.contiguous()
                out_t.add_(torch.sparse.mm(seg, g_t))
            offset += width
        return out_t.T.contiguous()
