"""A counter-based random number generator that every device implements the same way.

The projection matrices of trakflow are *defined* by this module: entry (i, j) of the matrix for
``(seed, model_id)`` is a pure function of those integers and the entry's index, so any row block can be
generated independently, in any order, on any device: every generator takes ``device=`` (default CPU)
and gives the same values there (the integer part — hash, signs, SJLT entries, the uniforms of the
normals — bit for bit on every device). This module is the only definition of the matrices: the dense
projectors, the factored projector's factors (:func:`rademacher_from_key` / :func:`normal_from_keys` under
per-block keys) and the build-free GPU path use it; the CUDA kernels transcribe its integer part.

The hash is Wellons' ``lowbias32`` integer mixer, applied twice per 64-bit counter with a per-(seed,
model_id) key and a per-stream constant. All arithmetic is on 32-bit unsigned words; in torch we carry
them in int64 tensors and mask after every multiply.
"""

from __future__ import annotations

import math

import torch

from trak_core.errors import BadInputError

MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D
_M2 = 0x846CA68B
GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: the step between derived keys
_GOLDEN = GOLDEN
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
        raise BadInputError(f"seed and model_id must be non-negative, got seed={seed}, model_id={model_id}")
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


def _device(device) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


def rademacher_from_key(
    key: int, row0: int, row1: int, cols: int, dtype: torch.dtype = torch.float32, *, device=None
) -> torch.Tensor:
    """Rows [row0, row1) of the rows × ``cols`` Rademacher (±1) matrix of the stream ``key``, on ``device``.

    Row i uses ceil(cols / 32) words; bit b of word w (counter i·words + w) gives column 32 w + b (bit set ⇒
    −1). Integer arithmetic only: the same bits on every device.
    """
    dev = _device(device)
    words = (cols + 31) // 32
    rows = torch.arange(row0, row1, dtype=torch.int64, device=dev)
    counter = rows[:, None] * words + torch.arange(words, dtype=torch.int64, device=dev)[None, :]
    h = hash_counter(counter, key)  # (r, words)
    # one bit position at a time into the output: (r, words) int64 temporaries, not an (r, words, 32) int64 tensor
    # (8 bytes per entry, several times over: 10x slower and 16x the memory of a float32 output)
    out = torch.empty(row1 - row0, words, 32, dtype=dtype, device=dev)
    for b in range(32):
        out[:, :, b] = 1 - 2 * ((h >> b) & 1)
    out = out.reshape(row1 - row0, words * 32)
    return out if words * 32 == cols else out[:, :cols].contiguous()


def normal_from_keys(
    key1: int, key2: int, row0: int, row1: int, cols: int, dtype: torch.dtype = torch.float32, *, device=None
) -> torch.Tensor:
    """Rows [row0, row1) of the rows × ``cols`` standard normal matrix of the streams (``key1``, ``key2``).

    Entry (i, j) is Box–Muller (float32) of the two uniforms hashed from counter i·cols + j under the two
    keys: u1 = ((h1 >> 8) + 1) / 2**24 ∈ (0, 1], u2 = (h2 >> 8) / 2**24 ∈ [0, 1) (24-bit mantissas, exact in
    float32), z = √(−2 ln u1) · cos(2π u2). The uniforms are the same on every device; the result is
    bit-identical wherever the device's float32 ``log``/``cos``/``sqrt`` round as the CPU's do (torch's CPU
    and CUDA kernels may differ in the last ulp).
    """
    dev = _device(device)
    rows = torch.arange(row0, row1, dtype=torch.int64, device=dev)
    counter = rows[:, None] * cols + torch.arange(cols, dtype=torch.int64, device=dev)[None, :]
    u1 = ((hash_counter(counter, key1) >> 8) + 1).to(torch.float32) * (1.0 / 16777216.0)
    u2 = (hash_counter(counter, key2) >> 8).to(torch.float32) * (1.0 / 16777216.0)
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)
    return z.to(dtype)


def rademacher_block(
    seed: int, model_id: int, row0: int, row1: int, cols: int, dtype: torch.dtype = torch.float32, *, device=None
) -> torch.Tensor:
    """Rows [row0, row1) of the grad_dim × cols Rademacher (±1) matrix of (seed, model_id), on ``device``
    (default CPU; the same values on every device)."""
    key = stream_key(seed, model_id, STREAM_SIGN_WORDS)
    return rademacher_from_key(key, row0, row1, cols, dtype, device=device)


def normal_block(
    seed: int, model_id: int, row0: int, row1: int, cols: int, dtype: torch.dtype = torch.float32, *, device=None
) -> torch.Tensor:
    """Rows [row0, row1) of the grad_dim × cols standard normal matrix of (seed, model_id) (Box–Muller,
    float32), on ``device`` (default CPU; see :func:`normal_from_keys` for the floating-point part)."""
    k1 = stream_key(seed, model_id, STREAM_NORMAL_U1)
    k2 = stream_key(seed, model_id, STREAM_NORMAL_U2)
    return normal_from_keys(k1, k2, row0, row1, cols, dtype, device=device)


def dense_block(
    kind: str,
    seed: int,
    model_id: int,
    row0: int,
    row1: int,
    cols: int,
    dtype: torch.dtype = torch.float32,
    *,
    device=None,
) -> torch.Tensor:
    """:func:`rademacher_block` (``kind="rademacher"``) or :func:`normal_block` (``kind="normal"``)."""
    kind = getattr(kind, "value", kind)
    if kind == "rademacher":
        return rademacher_block(seed, model_id, row0, row1, cols, dtype, device=device)
    if kind == "normal":
        return normal_block(seed, model_id, row0, row1, cols, dtype, device=device)
    raise BadInputError(f"unknown dense matrix kind {kind!r}; use 'rademacher' or 'normal'")


def uniform_ints(seed: int, model_id: int, stream: int, counter: torch.Tensor, high: int) -> torch.Tensor:
    """Integers in [0, high) for each counter (multiply-shift on 32 bits; bias < high / 2**32)."""
    h = hash_counter(counter, stream_key(seed, model_id, stream))
    return (h * high) >> 32


def random_signs(seed: int, model_id: int, stream: int, counter: torch.Tensor) -> torch.Tensor:
    """±1 (int64) for each counter."""
    h = hash_counter(counter, stream_key(seed, model_id, stream))
    return 1 - 2 * (h >> 31)


def sjlt_block(
    seed: int, model_id: int, row0: int, row1: int, proj_dim: int, c: int, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse JL matrix's nonzeros for input coordinates [row0, row1).

    Coordinate i has ``c`` nonzeros: for r in [0, c), counter = i * c + r, column
    ``(hash(counter, key_row) * proj_dim) >> 32`` and sign ``1 - 2 * (hash(counter, key_sign) >> 31)``;
    the value is sign · √(proj_dim / c) (so E⟨Px, Py⟩ = proj_dim ⟨x, y⟩, as for the dense kinds).
    Repeated columns of one coordinate add up. Returns (columns (r, c) int64, signs (r, c) int64) on
    ``device`` (default CPU; integer arithmetic only: the same on every device).
    """
    dev = _device(device)
    rows = torch.arange(row0, row1, dtype=torch.int64, device=dev)
    counter = rows[:, None] * c + torch.arange(c, dtype=torch.int64, device=dev)[None, :]
    cols = uniform_ints(seed, model_id, STREAM_SJLT_ROW, counter, proj_dim)
    signs = random_signs(seed, model_id, STREAM_SJLT_SIGN, counter)
    return cols, signs
