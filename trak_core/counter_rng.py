"""A counter-based random number generator that every device implements the same way.

The projection matrices of trakflow are *defined* by this module: entry (i, j) of the matrix for
``(seed, model_id)`` is a pure function of those integers and the entry's index, so any row block can be
generated independently, in any order, on any device (the CUDA kernels in ``cuda_ext/`` implement the
same functions bit for bit for the integer part).

The hash is Wellons' ``lowbias32`` integer mixer, applied twice per 64-bit counter with a per-(seed,
model_id) key and a per-stream constant. All arithmetic is on 32-bit unsigned words; in torch we carry
them in int64 tensors and mask after every multiply.
"""

from __future__ import annotations

import math

import torch

MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D
_M2 = 0x846CA68B
_GOLDEN = 0x9E3779B9
_MODEL_SALT = 0x85EBCA6B

# stream identifiers: one per use of randomness, so they never share a hash value
STREAM_SIGN_WORDS = 1  # 32 Rademacher signs per word
STREAM_NORMAL_U1 = 2
STREAM_NORMAL_U2 = 3
STREAM_SJLT_ROW = 4
STREAM_SJLT_SIGN = 5
STREAM_FACTOR = 6


def mix32_int(x: int) -> int:
    """lowbias32 on a Python int (reference for the tensor version and for the CUDA kernels)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _M1) & MASK32
    x ^= x >> 15
    x = (x * _M2) & MASK32
    x ^= x >> 16
    return x


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on an int64 tensor holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _M1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & MASK32
    return x ^ (x >> 16)


def stream_key(seed: int, model_id: int, stream: int) -> int:
    """The 32-bit key of one random stream of one (seed, model_id)."""
    if seed < 0 or model_id < 0:
        raise ValueError(f"seed and model_id must be non-negative, got seed={seed}, model_id={model_id}")
    k = mix32_int((seed & MASK32) ^ _GOLDEN)
    k = mix32_int(k ^ ((seed >> 32) & MASK32))
    k = mix32_int(k ^ (model_id & MASK32) ^ _MODEL_SALT)
    k = mix32_int(k ^ ((model_id >> 32) & MASK32))
    return mix32_int(k + stream * _GOLDEN)


def hash_counter(counter: torch.Tensor, key: int) -> torch.Tensor:
    """32 random bits for each non-negative 64-bit counter (int64 tensor) under ``key``."""
    lo = counter & MASK32
    hi = counter >> 32
    h = mix32(lo ^ key)
    return mix32(h ^ hi ^ ((key * _M2) & MASK32))


def rademacher_block(seed: int, model_id: int, row0: int, row1: int, cols: int,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows [row0, row1) of the grad_dim × cols Rademacher (±1) matrix.

    Row i uses ceil(cols / 32) words; bit b of word w gives column 32 w + b (bit set ⇒ −1).
    """
    words = (cols + 31) // 32
    key = stream_key(seed, model_id, STREAM_SIGN_WORDS)
    rows = torch.arange(row0, row1, dtype=torch.int64)
    counter = rows[:, None] * words + torch.arange(words, dtype=torch.int64)[None, :]
    h = hash_counter(counter, key)  # (r, words)
    bits = (h[:, :, None] >> torch.arange(32, dtype=torch.int64)) & 1  # (r, words, 32)
    bits = bits.reshape(row1 - row0, words * 32)[:, :cols]
    return (1 - 2 * bits).to(dtype)


def normal_block(seed: int, model_id: int, row0: int, row1: int, cols: int,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows [row0, row1) of the grad_dim × cols standard normal matrix (Box–Muller, float32)."""
    k1 = stream_key(seed, model_id, STREAM_NORMAL_U1)
    k2 = stream_key(seed, model_id, STREAM_NORMAL_U2)
    rows = torch.arange(row0, row1, dtype=torch.int64)
    counter = rows[:, None] * cols + torch.arange(cols, dtype=torch.int64)[None, :]
    # u1 in (0, 1], u2 in [0, 1): 24-bit mantissas so that float32 represents them exactly
    u1 = ((hash_counter(counter, k1) >> 8) + 1).to(torch.float32) * (1.0 / 16777216.0)
    u2 = (hash_counter(counter, k2) >> 8).to(torch.float32) * (1.0 / 16777216.0)
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)
    return z.to(dtype)


def uniform_ints(seed: int, model_id: int, stream: int, counter: torch.Tensor, high: int) -> torch.Tensor:
    """Integers in [0, high) for each counter (multiply-shift on 32 bits; bias < high / 2**32)."""
    h = hash_counter(counter, stream_key(seed, model_id, stream))
    return (h * high) >> 32


def random_signs(seed: int, model_id: int, stream: int, counter: torch.Tensor) -> torch.Tensor:
    """±1 (int64) for each counter."""
    h = hash_counter(counter, stream_key(seed, model_id, stream))
    return 1 - 2 * (h >> 31)


def sjlt_block(seed: int, model_id: int, row0: int, row1: int, proj_dim: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse JL matrix's nonzeros for input coordinates [row0, row1).

    Coordinate i has ``c`` nonzeros: for r in [0, c), counter = i * c + r, column
    ``(hash(counter, key_row) * proj_dim) >> 32`` and sign ``1 - 2 * (hash(counter, key_sign) >> 31)``;
    the value is sign · √(proj_dim / c) (so E⟨Px, Py⟩ = proj_dim ⟨x, y⟩, as for the dense kinds).
    Repeated columns of one coordinate add up. Returns (columns (r, c) int64, signs (r, c) int64).
    """
    rows = torch.arange(row0, row1, dtype=torch.int64)
    counter = rows[:, None] * c + torch.arange(c, dtype=torch.int64)[None, :]
    cols = uniform_ints(seed, model_id, STREAM_SJLT_ROW, counter, proj_dim)
    signs = random_signs(seed, model_id, STREAM_SJLT_SIGN, counter)
    return cols, signs
