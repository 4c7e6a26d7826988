"""Where each chunk belongs: a place record per chunk, kept beside the chunks and outside them.

zarr's crc32c codec ends each chunk with the checksum of its bytes, which says the bytes are whole but not
where they belong: a chunk moved to other coordinates, another array or another store still passes it. So each
chunk ``<array>/c/<i>/<j>`` has a record ``<array>/d/<i>/<j>``: a keyed blake2b of (store id, array path, chunk
key, the chunk's crc32c). A chunk that moved does not bring its record (and a record that moved with it was
sealed for the old place); a chunk of other contents has another crc32c. Before a chunk is written its record
says so (a pending record, also bound to the place), and right after it (before the rows' flags) it is sealed:
a run killed in between leaves the pending record, and its rerun rewrites the chunk instead of taking the crash
for a moved chunk. Reads and partial writes check the chunks they touch.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import math
import os
from collections.abc import Sequence

import numpy as np
import zarr
from zarr.abc.store import SuffixByteRequest
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from .chunkio import open_for_write

#: the folder of an array's place records (beside zarr's ``c``)
RECORD_DIR = "d"
_TRAILER = SuffixByteRequest(4)  # zarr's crc32c codec appends the checksum as the chunk's last 4 bytes

MISPLACED = (
    "does not belong here (its crc32c is not the one recorded for this place: a chunk moved, or copied from "
    "another array or store)"
)
MISSING = "is missing"
UNRECORDED = "has no place record (not written here by this store, or its write was interrupted)"


def record_key(path: str, ckey: str) -> str:
    """The store key of the record of chunk ``ckey`` (``c/1/0``) of the array at ``path``."""
    return f"{path.strip('/')}/{RECORD_DIR}/{ckey.split('/', 1)[1]}" if "/" in ckey else f"{path}/{RECORD_DIR}"


def seal(store_id: str, path: str, ckey: str, trailer: bytes) -> bytes:
    """The record of a chunk whose crc32c is ``trailer`` at (store, array, chunk)."""
    h = hashlib.blake2b(key=bytes.fromhex(store_id), digest_size=16, person=b"trakflow-place")
    h.update(f"{path.strip('/')}\0{ckey}\0".encode())
    h.update(trailer)
    return h.digest()


#: what a pending record is sealed from in place of a crc32c (4 bytes: no trailer can be it)
_PENDING = b"\0pending"


def pending_seal(store_id: str, path: str, ckey: str) -> bytes:
    """The record of a chunk whose write is under way at (store, array, chunk): written before the chunk, replaced
    by its seal after it (:func:`mark_pending`)."""
    return seal(store_id, path, ckey, _PENDING)


def _ckey(arr: zarr.Array, coords: tuple[int, ...]) -> str:
    return arr.metadata.encode_chunk_key(tuple(coords))


def _local_root(store) -> str | None:
    """The folder of a local store (its files are read and written directly: a zarr store call per small
    record costs more than the chunk read it guards); None for other stores."""
    from zarr.storage import LocalStore

    return str(store.root) if isinstance(store, LocalStore) else None


def _read_local(path: str, tail: bool) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        if not tail:
            return os.read(fd, 64)
        size = os.fstat(fd).st_size
        return os.pread(fd, 4, max(0, size - 4))
    finally:
        os.close(fd)


def _write_local(path: str, data: bytes | None) -> None:
    if data is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    with open_for_write(path) as fh:
        fh.write(data)


def _fetch(store, keys: list[str], record_keys: list[str]) -> tuple[list[bytes | None], list[bytes | None]]:
    """The crc32c trailers of the chunks ``keys`` and the records ``record_keys``."""
    root = _local_root(store)
    if root is not None:
        return (
            [_read_local(os.path.join(root, k), True) for k in keys],
            [_read_local(os.path.join(root, k), False) for k in record_keys],
        )

    async def both():
        return await asyncio.gather(_get_all(store, keys, _TRAILER), _get_all(store, record_keys, None))

    trailers, records = sync(both())
    return trailers, records


async def _get_all(store, keys: list[str], byte_range) -> list[bytes | None]:
    proto = default_buffer_prototype()

    async def one(k: str) -> bytes | None:
        buf = await store.get(k, prototype=proto, byte_range=byte_range)
        return None if buf is None else buf.to_bytes()

    return list(await asyncio.gather(*(one(k) for k in keys)))


def place_problems(
    arr: zarr.Array, store_id: str, coords: Sequence[tuple[int, ...]], present: bool = False
) -> list[tuple[tuple[int, ...], str]]:
    """Each chunk of ``coords`` that is stored but not sealed for its place, and why; ``present``: each absent
    one too (:data:`MISSING`; otherwise absent chunks pass: their presence is checked where rows are flagged)."""
    if not coords:
        return []
    ckeys = [_ckey(arr, c) for c in coords]
    path = arr.path
    trailers, records = _fetch(arr.store, [f"{path}/{k}" for k in ckeys], [record_key(path, k) for k in ckeys])
    out = []
    for c, k, t, r in zip(coords, ckeys, trailers, records, strict=True):
        if t is None:
            if present:
                out.append((c, MISSING))
            continue
        if r is None:
            out.append((c, UNRECORDED))
        elif r != seal(store_id, path, k, t) and r != pending_seal(store_id, path, k):
            out.append((c, MISPLACED))
    return out


def mark_pending(arr: zarr.Array, store_id: str, coords: Sequence[tuple[int, ...]]) -> None:
    """Before writing the chunks ``coords``: record each as being written here. A run killed between a chunk and
    its seal leaves this record, which accepts what the place holds (the old chunk or the new one, both written
    here by this store; their rows are not flagged yet, so the rerun writes them again and seals them), while a
    chunk moved onto a sealed place, or onto a place never written, is still refused."""
    if not coords:
        return
    ckeys = [_ckey(arr, c) for c in coords]
    path, store = arr.path, arr.store
    root = _local_root(store)
    if root is not None:
        for k in ckeys:
            _write_local(os.path.join(root, record_key(path, k)), pending_seal(store_id, path, k))
        return
    proto = default_buffer_prototype()

    async def write() -> None:
        await asyncio.gather(
            *(store.set(record_key(path, k), proto.buffer.from_bytes(pending_seal(store_id, path, k))) for k in ckeys)
        )

    sync(write())


def record_places(arr: zarr.Array, store_id: str, coords: Sequence[tuple[int, ...]]) -> None:
    """Seal the chunks of ``coords`` for their place (after writing them); an absent chunk's record is removed."""
    if not coords:
        return
    ckeys = [_ckey(arr, c) for c in coords]
    path, store = arr.path, arr.store
    root = _local_root(store)
    if root is not None:
        for k in ckeys:
            t = _read_local(os.path.join(root, path, k), True)
            _write_local(os.path.join(root, record_key(path, k)), None if t is None else seal(store_id, path, k, t))
        return
    proto = default_buffer_prototype()

    async def write() -> None:
        trailers = await _get_all(store, [f"{path}/{k}" for k in ckeys], _TRAILER)

        async def one(k: str, t: bytes | None) -> None:
            if t is None:
                await store.delete(record_key(path, k))
            else:
                await store.set(record_key(path, k), proto.buffer.from_bytes(seal(store_id, path, k, t)))

        await asyncio.gather(*(one(k, t) for k, t in zip(ckeys, trailers, strict=True)))

    sync(write())


def drop_record(arr: zarr.Array, coords: tuple[int, ...]) -> None:
    """Remove the record of one chunk (with the chunk: repair)."""
    sync(arr.store.delete(record_key(arr.path, _ckey(arr, coords))))


def touched_chunks(arr: zarr.Array, selection) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The chunks a selection reads or writes, and those of them it covers only in part (a write of those reads
    the chunk first). ``selection``: what ``arr[...]`` or ``arr.oindex[...]`` takes, along axis 0 (other axes are
    taken whole; a selection narrower there counts as partial)."""
    first, rest = (selection[0], selection[1:]) if isinstance(selection, tuple) else (selection, ())
    if isinstance(selection, tuple) and not selection:
        first = slice(None)
    n, c = int(arr.shape[0]), int(arr.chunks[0])
    narrow = any(not (r is Ellipsis or (isinstance(r, slice) and r == slice(None))) for r in rest)
    if first is Ellipsis:
        first = slice(None)
    if isinstance(first, (int, np.integer)):
        i = int(first) % n if n else 0
        first = slice(i, i + 1)
    if isinstance(first, slice) and first.step in (None, 1):
        a, b, _ = first.indices(n)
        ids: list[int] = list(range(a // c, (b - 1) // c + 1)) if b > a else []
        part = {i for i in ids if not (a <= i * c and min((i + 1) * c, n) <= b)}
    else:
        sel = np.asarray(first) if not isinstance(first, slice) else None
        if sel is None:
            rows = np.arange(n)[first]
        elif sel.dtype == bool:  # a mask
            rows = np.flatnonzero(sel)
        else:
            rows = np.unique(sel.reshape(-1) % max(n, 1))
        chunk_of = rows // c
        uniq, counts = np.unique(chunk_of, return_counts=True)
        ids = [int(i) for i in uniq]
        part = {i for i, k in zip(ids, counts.tolist(), strict=True) if k < min((i + 1) * c, n) - i * c}
    grid = (range(math.ceil(s / k)) for s, k in zip(arr.shape[1:], arr.chunks[1:], strict=True))
    others = list(itertools.product(*grid))
    every = [(i, *o) for i in ids for o in others]
    partial = every if narrow else [(i, *o) for i in ids if i in part for o in others]
    return every, partial


def record_trailers(
    arr: zarr.Array, store_id: str, coords: Sequence[tuple[int, ...]], trailers: Sequence[bytes]
) -> None:
    """Seal the chunks of ``coords`` just written with the crc32c ``trailers`` their writer computed (no read back:
    :func:`record_places`' records)."""
    path, store = arr.path, arr.store
    ckeys = [_ckey(arr, c) for c in coords]
    root = _local_root(store)
    if root is not None:
        for k, t in zip(ckeys, trailers, strict=True):
            _write_local(os.path.join(root, record_key(path, k)), seal(store_id, path, k, t))
        return
    proto = default_buffer_prototype()

    async def write() -> None:
        await asyncio.gather(
            *(
                store.set(record_key(path, k), proto.buffer.from_bytes(seal(store_id, path, k, t)))
                for k, t in zip(ckeys, trailers, strict=True)
            )
        )

    sync(write())
