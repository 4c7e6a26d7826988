"""Whole chunks of a local store written straight to their files: the bytes zarr writes, without its per-call cost.

A chunk of the store's arrays is its raw little-endian bytes in C order (zarr's ``bytes`` codec; an edge chunk
padded to the full chunk shape with the fill value, 0) followed by the crc32c of those bytes (zarr's ``crc32c``
codec, 4 bytes, little endian). For an array whose layout is exactly that, on a local store, a write of whole
chunks along axis 0 converts the rows once into the stored dtype, takes each chunk's crc32c from the converted
rows in place and writes each file as zarr does (a temporary file, then renamed over the chunk). The caller gets
each chunk's crc32c trailer (its place record is sealed from it, no read back) and the converted rows. Any other
array or store goes through zarr.
"""

from __future__ import annotations

import os
import uuid

import google_crc32c
import numpy as np
import torch
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec
from zarr.core.chunk_grids import RegularChunkGrid

#: numpy dtypes torch converts to with numpy's bits (IEEE round to nearest even; NaNs go through numpy)
_TORCH = {np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32}


def direct_layout(arr: zarr.Array) -> str | None:
    """The folder of ``arr``'s chunks when whole chunks can be written directly: a local store, a regular chunk
    grid whose chunks span every column, the codecs ``bytes`` (little endian) then ``crc32c``, fill value 0;
    None otherwise (zarr writes them)."""
    from zarr.core.metadata.v3 import ArrayV3Metadata
    from zarr.storage import LocalStore

    store = arr.store
    meta = arr.metadata
    if not isinstance(store, LocalStore) or not isinstance(meta, ArrayV3Metadata):
        return None
    codecs = tuple(meta.codecs)
    if len(codecs) != 2 or not isinstance(codecs[1], Crc32cCodec) or not isinstance(codecs[0], BytesCodec):
        return None
    dtype = np.dtype(arr.dtype)
    if dtype.itemsize > 1 and (codecs[0].endian is None or codecs[0].endian.value != "little"):
        return None
    if not isinstance(meta.chunk_grid, RegularChunkGrid) or tuple(arr.chunks[1:]) != tuple(arr.shape[1:]):
        return None
    fill = np.asarray(meta.fill_value, dtype=dtype).reshape(1)
    if dtype.kind not in "fiub" or fill.view(np.uint8).any():  # the fill value's bytes must be zeros (not -0.0)
        return None
    return os.path.join(str(store.root), arr.path)


def to_dtype(values: np.ndarray, dtype: np.dtype, out: np.ndarray | None = None) -> np.ndarray:
    """``values.astype(dtype)`` as a C-ordered array (``values`` itself when it is one already), or written into
    ``out``, bit for bit; float32 → float16 by torch (several times faster than numpy's conversion, the same
    rounding), by numpy where a value is NaN (its payload bits)."""
    values = np.asarray(values)
    dtype = np.dtype(dtype)
    if out is None:
        if values.dtype == dtype:
            return np.ascontiguousarray(values)
        out = np.empty(values.shape, dtype=dtype)
    if values.dtype == dtype:
        np.copyto(out, values)
    elif values.dtype in _TORCH and dtype in _TORCH and values.size:
        converted = torch.from_numpy(out)
        converted.copy_(torch.from_numpy(np.ascontiguousarray(values)))
        if torch.isnan(converted.max()):  # max propagates a NaN: checked on the converted (smaller) rows
            np.copyto(out, values, casting="unsafe")
    else:
        np.copyto(out, values, casting="unsafe")
    return out


def stack_dtype(pieces, dtype: np.dtype, out: np.ndarray | None = None) -> np.ndarray:
    """``np.concatenate(pieces).astype(dtype)`` without the concatenated copy in the pieces' dtype: each piece
    converted (:func:`to_dtype`) straight into its rows of the result, or of ``out`` (a caller's reused buffer of
    exactly those rows)."""
    pieces = [np.asarray(v) for v in pieces]
    if out is None and len(pieces) == 1:
        return to_dtype(pieces[0], dtype)
    shape = (sum(v.shape[0] for v in pieces), *pieces[0].shape[1:])
    if out is None:
        out = np.empty(shape, dtype=dtype)
    elif out.shape != shape or out.dtype != np.dtype(dtype) or not out.flags.c_contiguous:
        raise ValueError(f"out: {out.shape} {out.dtype} buffer for {shape} rows of {np.dtype(dtype)}")
    i = 0
    for v in pieces:
        to_dtype(v, dtype, out[i : i + v.shape[0]])
        i += v.shape[0]
    return out


def crc32c_trailer(block: np.ndarray, pad: int = 0) -> bytes:
    """The 4 bytes zarr's crc32c codec appends to a chunk holding ``block``'s bytes then ``pad`` zero bytes."""
    crc = google_crc32c.value(np.ascontiguousarray(block).reshape(-1).view(np.uint8))
    if pad:
        crc = google_crc32c.extend(crc, bytes(pad))
    return np.uint32(crc).astype("<u4").tobytes()


def encode_rows(rows: np.ndarray, dtype: np.dtype, chunk_rows: int, array_rows: int, a: int) -> tuple:
    """Rows [a, a + len(rows)) (``a`` a multiple of ``chunk_rows``, the end one or the array's end) in the stored
    ``dtype``. Returns (the converted rows, [(chunk index, rows [i, j) of them, zero bytes to pad, crc32c
    trailer)])."""
    stored = to_dtype(rows, dtype)
    row_bytes = stored.itemsize * int(np.prod(stored.shape[1:], dtype=np.int64))
    parts = []
    for i in range(0, stored.shape[0], chunk_rows):
        j = min(i + chunk_rows, stored.shape[0])
        pad = (chunk_rows - (j - i)) * row_bytes
        parts.append(((a + i) // chunk_rows, i, j, pad, crc32c_trailer(stored[i:j], pad)))
    return stored, parts


def open_for_write(path: str):
    """``open(path, "wb")``, creating the missing folders first when there are any."""
    try:
        return open(path, "wb")  # noqa: SIM115
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return open(path, "wb")  # noqa: SIM115


def _put(path: str, block: np.ndarray, pad: int, trailer: bytes) -> None:
    """One chunk file, written as zarr's local store writes one: a temporary file renamed over it."""
    tmp = f"{path}.{uuid.uuid4().hex}.partial"
    try:
        with open_for_write(tmp) as fh:
            fh.write(np.ascontiguousarray(block).reshape(-1).view(np.uint8).data)
            if pad:
                fh.write(bytes(pad))
            fh.write(trailer)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_chunk_files(arr: zarr.Array, folder: str, stored: np.ndarray, parts: list) -> list[tuple[int, ...]]:
    """Write the chunks :func:`encode_rows` prepared into ``folder`` (:func:`direct_layout`). Returns their
    coordinates."""
    coords = []
    for index, i, j, pad, trailer in parts:
        c = (index,) + (0,) * (stored.ndim - 1)
        _put(os.path.join(folder, arr.metadata.encode_chunk_key(c)), stored[i:j], pad, trailer)
        coords.append(c)
    return coords
