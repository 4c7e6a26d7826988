"""The projections of :mod:`trak_core.counter_rng` with plain torch ops, on any device.

This is the build-free GPU path (used when the CUDA extension cannot be built) and the oracle of the
kernels' tests: the matrix blocks are generated with the counter hash of ``counter_rng`` on the tensors'
own device (int64 ops, masked to 32 bits), then multiplied with ``addmm``. On the CPU every function here
gives exactly what ``counter_rng`` gives (tests/test_cuda_ext.py checks it), so on a GPU it computes the
same matrix.

Also here: the CSR plan of the SJLT matrix that the SJLT kernel gathers from (built with torch ops on the
GPU, once per model), and a torch emulation of that gather so the plan can be tested on the CPU.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from trak_core import counter_rng

__all__ = ["rademacher_block", "normal_block", "dense_block", "dense_project", "sjlt_entries", "sjlt_plan",
           "sjlt_project_from_plan", "sjlt_dense_block", "sjlt_project", "sjlt_reference"]

KIND_RADEMACHER = "rademacher"
KIND_NORMAL = "normal"


def rademacher_block(seed: int, model_id: int, row0: int, row1: int, cols: int, device=None,
                     dtype: torch.dtype = torch.float32) -> Tensor:
    """Rows [row0, row1) of the Rademacher matrix on ``device`` (= ``counter_rng.rademacher_block``)."""
    device = torch.device(device or "cpu")
    words = (cols + 31) // 32
    key = counter_rng.stream_key(seed, model_id, counter_rng.STREAM_SIGN_WORDS)
    rows = torch.arange(row0, row1, dtype=torch.int64, device=device)
    counter = rows[:, None] * words + torch.arange(words, dtype=torch.int64, device=device)[None, :]
    h = counter_rng.hash_counter(counter, key)
    bits = (h[:, :, None] >> torch.arange(32, dtype=torch.int64, device=device)) & 1
    bits = bits.reshape(row1 - row0, words * 32)[:, :cols]
    return (1 - 2 * bits).to(dtype)


def normal_block(seed: int, model_id: int, row0: int, row1: int, cols: int, device=None,
                 dtype: torch.dtype = torch.float32) -> Tensor:
    """Rows [row0, row1) of the normal matrix on ``device`` (= ``counter_rng.normal_block``)."""
    device = torch.device(device or "cpu")
    k1 = counter_rng.stream_key(seed, model_id, counter_rng.STREAM_NORMAL_U1)
    k2 = counter_rng.stream_key(seed, model_id, counter_rng.STREAM_NORMAL_U2)
    rows = torch.arange(row0, row1, dtype=torch.int64, device=device)
    counter = rows[:, None] * cols + torch.arange(cols, dtype=torch.int64, device=device)[None, :]
    u1 = ((counter_rng.hash_counter(counter, k1) >> 8) + 1).to(torch.float32) * (1.0 / 16777216.0)
    u2 = (counter_rng.hash_counter(counter, k2) >> 8).to(torch.float32) * (1.0 / 16777216.0)
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)
    return z.to(dtype)


def dense_block(kind: str, seed: int, model_id: int, row0: int, row1: int, cols: int, device=None) -> Tensor:
    fn = rademacher_block if kind == KIND_RADEMACHER else normal_block
    return fn(seed, model_id, row0, row1, cols, device)


def dense_project(x: Tensor, kind: str, seed: int, model_id: int, proj_dim: int, row0: int = 0,
                  out: Tensor | None = None, block_elems: int = 1 << 24) -> Tensor:
    """``out += x @ R[row0 : row0 + K]`` with R generated block-wise on x's device (float32)."""
    batch, width = x.shape
    if out is None:
        out = torch.zeros(batch, proj_dim, dtype=torch.float32, device=x.device)
    step = max(1, block_elems // proj_dim)
    for r0 in range(0, width, step):
        r1 = min(r0 + step, width)
        blk = dense_block(kind, seed, model_id, row0 + r0, row0 + r1, proj_dim, x.device)
        out.addmm_(x[:, r0:r1].to(torch.float32), blk)
    return out


# ------------------------------------------------------------------------------------------------ SJLT
def sjlt_entries(seed: int, model_id: int, row0: int, row1: int, proj_dim: int, c: int,
                 device=None) -> tuple[Tensor, Tensor]:
    """(columns (r, c) int64, signs (r, c) int64) on ``device`` (= ``counter_rng.sjlt_block``)."""
    device = torch.device(device or "cpu")
    counter = torch.arange(row0 * c, row1 * c, dtype=torch.int64, device=device).reshape(row1 - row0, c)
    cols = counter_rng.uniform_ints(seed, model_id, counter_rng.STREAM_SJLT_ROW, counter, proj_dim)
    signs = counter_rng.random_signs(seed, model_id, counter_rng.STREAM_SJLT_SIGN, counter)
    return cols, signs


def sjlt_plan(seed: int, model_id: int, grad_dim: int, proj_dim: int, c: int, device=None,
              chunk_rows: int = 1 << 22) -> tuple[Tensor, Tensor]:
    """The CSR of the transposed sign matrix: (col_ptr (proj_dim + 1,), packed (grad_dim·c,)) int64.

    ``packed = i * 2 + (sign < 0)``, sorted by (column, i): the gather of column j visits its coordinates in
    increasing order (a fixed summation order: the kernel is deterministic).
    """
    device = torch.device(device or "cpu")
    nnz = grad_dim * c
    cols = torch.empty(nnz, dtype=torch.int32, device=device)
    neg = torch.empty(nnz, dtype=torch.bool, device=device)
    for r0 in range(0, grad_dim, chunk_rows):
        r1 = min(r0 + chunk_rows, grad_dim)
        cc, ss = sjlt_entries(seed, model_id, r0, r1, proj_dim, c, device)
        cols[r0 * c:r1 * c] = cc.reshape(-1).to(torch.int32)
        neg[r0 * c:r1 * c] = ss.reshape(-1) < 0
    col_ptr = torch.zeros(proj_dim + 1, dtype=torch.int64, device=device)
    col_ptr[1:] = torch.bincount(cols, minlength=proj_dim).cumsum(0)
    order = torch.sort(cols, stable=True).indices  # flat index i*c + r, increasing within a column
    del cols
    packed = torch.div(order, c, rounding_mode="floor") * 2 + neg[order].to(torch.int64)
    return col_ptr, packed


def sjlt_project_from_plan(x: Tensor, col_ptr: Tensor, packed: Tensor, proj_dim: int, scale: float) -> Tensor:
    """What the SJLT kernel computes, with torch ops (tests of the plan on the CPU)."""
    coord = packed >> 1
    sign = (1 - 2 * (packed & 1)).to(torch.float32)
    col = torch.repeat_interleave(torch.arange(proj_dim, device=packed.device), col_ptr.diff())
    out = torch.zeros(x.shape[0], proj_dim, dtype=torch.float32, device=x.device)
    out.index_add_(1, col, x.to(torch.float32)[:, coord] * sign)
    return out * scale


def sjlt_dense_block(seed: int, model_id: int, row0: int, row1: int, proj_dim: int, c: int, device=None) -> Tensor:
    """Rows [row0, row1) of the SJLT matrix divided by √(proj_dim / c): small integers, exact in float32."""
    cols, signs = sjlt_entries(seed, model_id, row0, row1, proj_dim, c, device)
    blk = torch.zeros(row1 - row0, proj_dim, dtype=torch.float32, device=cols.device)
    rows = torch.arange(row1 - row0, device=cols.device)[:, None].expand_as(cols)
    blk.index_put_((rows, cols), signs.to(torch.float32), accumulate=True)  # integer sums: order-free
    return blk


def sjlt_project(x: Tensor, seed: int, model_id: int, proj_dim: int, c: int, row0: int = 0,
                 out: Tensor | None = None, block_elems: int = 1 << 24) -> Tensor:
    """``out += (x @ S[row0 : row0 + K]) / √(proj_dim / c)`` with dense blocks of S on x's device.

    The caller multiplies by √(proj_dim / c) once at the end (as the kernel does).
    """
    batch, width = x.shape
    if out is None:
        out = torch.zeros(batch, proj_dim, dtype=torch.float32, device=x.device)
    step = max(1, block_elems // proj_dim)
    for r0 in range(0, width, step):
        r1 = min(r0 + step, width)
        out.addmm_(x[:, r0:r1].to(torch.float32),
                   sjlt_dense_block(seed, model_id, row0 + r0, row0 + r1, proj_dim, c, x.device))
    return out


def sjlt_reference(x: Tensor, seed: int, model_id: int, proj_dim: int, c: int, row0: int = 0,
                   block_rows: int = 1 << 16, dtype: torch.dtype = torch.float64) -> Tensor:
    """A direct transcription of the definition (``counter_rng.sjlt_block``, scatter-add), in ``dtype``."""
    batch, width = x.shape
    out = torch.zeros(batch, proj_dim, dtype=dtype, device=x.device)
    for r0 in range(0, width, block_rows):
        r1 = min(r0 + block_rows, width)
        cols, signs = counter_rng.sjlt_block(seed, model_id, row0 + r0, row0 + r1, proj_dim, c)
        cols, signs = cols.to(x.device), signs.to(x.device, dtype)
        vals = x[:, r0:r1, None].to(dtype) * signs[None]
        out.index_add_(1, cols.reshape(-1), vals.reshape(batch, -1))
    return out * math.sqrt(proj_dim / c)
