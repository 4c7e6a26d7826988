"""Arrays of the store and their damage guard: chunk coordinates and keys, reading a chunk, and
:class:`StoredArray`, whose reads and writes name the array and chunk of any damage."""

from __future__ import annotations

import math
from collections.abc import Callable, MutableMapping
from typing import Any, cast

import numpy as np
import zarr
from zarr.codecs import Crc32cCodec

from ..errors import BadInputError, StateError, StoreDamageError
from . import chunkio
from .places import MISSING, mark_pending, place_problems, record_places, record_trailers, touched_chunks
from .schema import SHARD_ARRAYS


def _codecs() -> list:
    """The bytes→bytes codecs of every array (after zarr's default ``bytes`` serializer)."""
    return [Crc32cCodec()]


def chunk_rows_of(arr: zarr.Array, coords: tuple[int, ...]) -> tuple[int, int]:
    """The rows [a, b) (indices along axis 0) chunk ``coords`` of ``arr`` holds."""
    step = arr.chunks[0]
    return coords[0] * step, min((coords[0] + 1) * step, arr.shape[0])


def chunk_key(arr: zarr.Array, coords: tuple[int, ...]) -> str:
    """The key of chunk ``coords`` relative to the array (e.g. ``c/1/0``)."""
    return arr.metadata.encode_chunk_key(tuple(coords))


def chunk_coords_of_rows(arr: zarr.Array, rows: np.ndarray) -> list[tuple[int, ...]]:
    """The chunks (coordinates) holding the given axis-0 indices (all chunks along the other axes)."""
    import itertools

    coords = np.asarray(rows, dtype=np.int64).reshape(-1) // int(arr.chunks[0])
    if coords.size and bool(np.all(coords[1:] >= coords[:-1])):  # sorted rows (the usual np.arange): no hashing
        firsts = coords[np.r_[True, coords[1:] != coords[:-1]]].tolist()
    else:
        firsts = np.unique(coords).tolist()
    rest = [range(math.ceil(s / c)) for s, c in zip(arr.shape[1:], arr.chunks[1:], strict=True)]
    return [(i, *other) for i in firsts for other in itertools.product(*rest)]


def stored_chunk_keys(arr: zarr.Array) -> set[str]:
    """The chunk keys (relative to the array, ``c/...``) present in the store: one listing of the array's ``c/``
    folder (not its place records), no chunk is read."""
    from zarr.core.sync import sync

    prefix = arr.path.rstrip("/") + "/"

    async def _list() -> list[str]:
        return [k async for k in arr.store.list_prefix(prefix + "c/")]

    return {k[len(prefix) :] for k in sync(_list())}


def _decode_problem(e: BaseException) -> str:
    text = str(e)
    if "checksum" in text.lower():
        return "fails its crc32c checksum"
    return f"cannot be decoded ({type(e).__name__}: {text[:120]})"


def read_chunk(arr: zarr.Array, coords: tuple[int, ...]) -> str | None:
    """Read (decode) one chunk; what is wrong with it, or None when it decodes (zarr checks its crc32c)."""
    try:
        arr.get_block_selection(tuple(coords))
    except Exception as e:  # zarr/numcodecs raise several types for an undecodable chunk
        return _decode_problem(e)
    return None


def find_corrupt_chunk(arr: zarr.Array) -> tuple[tuple[int, ...], str] | None:
    """The first stored chunk of ``arr`` that does not decode, and why (None: all decode)."""
    import itertools

    present = stored_chunk_keys(arr)
    for coords in itertools.product(*(range(math.ceil(s / c)) for s, c in zip(arr.shape, arr.chunks, strict=True))):
        if chunk_key(arr, coords) in present:
            problem = read_chunk(arr, coords)
            if problem is not None:
                return coords, problem
    return None


def damaged_chunk_error(arr: zarr.Array, coords: tuple[int, ...], problem: str) -> StoreDamageError:
    a, b = chunk_rows_of(arr, coords)
    unit = "shards" if arr.path.endswith(SHARD_ARRAYS) else "rows"
    where, what = f" ({unit} {a}..{b - 1})", f"those {unit}"
    if arr.path.endswith(("inverse", "inverse_done")):  # one matrix: no rows to name
        where, what = "", "it"
    loc = str(arr.store)
    return StoreDamageError(
        f"store {loc}: array {arr.path}, chunk {chunk_key(arr, coords)}{where} {problem} (damaged "
        f"on disk). Run `trakflow verify {loc} --repair`, then rerun to recompute {what}."
    )


def require_present(location: str, arrays: list[tuple[zarr.Array | StoredArray, np.ndarray]]) -> None:
    """Raise :class:`StoreDamageError` naming the array and chunk when a chunk holding the given rows is not in
    the store at ``location`` (zarr would read it back as zeros). ``arrays``: (array, axis-0 indices about to be
    read). One listing per array, no chunk is read."""
    for arr, rows in arrays:
        arr = arr.array if isinstance(arr, StoredArray) else arr
        rows = np.asarray(rows).reshape(-1)
        if not rows.size:
            continue
        present = stored_chunk_keys(arr)
        for coords in chunk_coords_of_rows(arr, rows):
            key = chunk_key(arr, coords)
            if key not in present:
                a, b = chunk_rows_of(arr, coords)
                unit = "shards" if arr.path.endswith(SHARD_ARRAYS) else "rows"
                where = "" if arr.path.endswith(("inverse", "inverse_done")) else f" ({unit} {a}..{b - 1})"
                raise StoreDamageError(
                    f"store {location}: array {arr.path}, chunk {key}{where}: is missing (deleted or lost on disk; "
                    f"zarr would read it back as zeros). Run `trakflow verify {location} --repair`, then rerun to "
                    f"recompute those {unit}."
                )


class StoredArray:
    """An array of the store: zarr's array (every chunk written, zeros too, so a missing chunk is damage), whose
    reads and writes raise :class:`StoreDamageError` naming the array and the chunk when a chunk does not decode
    (fails its crc32c checksum) or, with the store's id ``sid``, is not the chunk recorded for its place
    (:mod:`.places`: reads and partial writes check the chunks they touch, writes record them).
    Everything else is the zarr array's (``shape``, ``path``, ``get_block_selection``, ...)."""

    def __init__(self, array: zarr.Array, sid: str | None = None, required: bool = False):
        self.array = array
        self.sid = sid
        self.required = required  # a data array: every chunk a read touches must be stored (never read as zeros)

    def __getattr__(self, name: str):
        return getattr(self.array, name)

    def __len__(self) -> int:  # zarr 3's Array has no __len__: the length along axis 0, as numpy's
        return int(self.array.shape[0])

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self[...], dtype=dtype)

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except (KeyboardInterrupt, SystemExit, MemoryError, IndexError, TypeError):
            raise
        except Exception as e:
            if isinstance(e, (BadInputError, StateError)):
                raise
            found = find_corrupt_chunk(self.array)
            if found is None:
                raise
            raise damaged_chunk_error(self.array, *found) from None

    def check_places(self, coords: list[tuple[int, ...]], present: bool = False) -> None:
        """Raise :class:`StoreDamageError` for the first stored chunk of ``coords`` not sealed for its place
        (``present``: or not stored)."""
        if not coords:
            return
        if self.sid is None:
            if present:
                stored = stored_chunk_keys(self.array)
                gone = [c for c in coords if chunk_key(self.array, c) not in stored]
                if gone:
                    raise damaged_chunk_error(self.array, gone[0], MISSING)
            return
        bad = place_problems(self.array, self.sid, coords, present)
        if bad:  # a chunk whose bytes are damaged (its crc32c fails) is named as such
            where, problem = bad[0]
            if problem == MISSING:
                raise damaged_chunk_error(self.array, where, problem)
            raise damaged_chunk_error(self.array, where, read_chunk(self.array, where) or problem)

    def _read(self, fn, selection):
        if self.sid is not None or self.required:
            self.check_places(touched_chunks(self.array, selection)[0], self.required)
        return self._guard(fn, selection)

    def _write(self, fn, selection, value) -> None:
        every, partial = touched_chunks(self.array, selection) if self.sid is not None else ([], [])
        self.check_places(partial)  # a partial write keeps the rest of the chunk: it must be this place's
        if self.sid is not None:
            mark_pending(self.array, self.sid, every)  # a crash before the seal is not taken for a moved chunk
        self._guard(fn, selection, value)
        if self.sid is not None:
            record_places(self.array, self.sid, every)

    def __getitem__(self, selection):
        return self._read(self.array.__getitem__, selection)

    def __setitem__(self, selection, value) -> None:  # a partial-chunk write reads the chunk first
        self._write(self.array.__setitem__, selection, value)

    def read_into(self, a: int, b: int, out: np.ndarray) -> None:
        """``out[:] = self[a:b]`` along the first axis without allocating the result: zarr decodes the chunks
        straight into ``out`` (a caller's reused buffer)."""
        from zarr.core.buffer import default_buffer_prototype

        nd = default_buffer_prototype().nd_buffer.from_numpy_array(out)
        self._read(lambda sel: self.array.get_basic_selection(sel, out=nd), (slice(a, b),))

    def write_rows(self, a: int, values: np.ndarray) -> np.ndarray:
        """``self[a:a + len(values)] = values``; returns the rows as stored (``values`` in the array's dtype).
        Whole chunks of a local store (``a`` and the end multiples of the chunk rows, or the end the array's) are
        written straight to their files (:mod:`.chunkio`): zarr's bytes, their place records sealed."""
        arr = self.array
        n, c = int(arr.shape[0]), int(arr.chunks[0])
        dtype = np.dtype(arr.dtype)
        b = a + int(values.shape[0])
        whole = b > a and a % c == 0 and (b % c == 0 or b == n) and b <= n and values.shape[1:] == arr.shape[1:]
        folder = chunkio.direct_layout(arr) if whole else None
        if folder is None:
            stored = chunkio.to_dtype(values, dtype)
            self[a:b] = stored
            return stored
        stored, parts = chunkio.encode_rows(values, dtype, c, n, a)
        if self.sid is not None:
            zeros = (0,) * (stored.ndim - 1)
            mark_pending(arr, self.sid, [(part[0], *zeros) for part in parts])
        coords = chunkio.write_chunk_files(arr, folder, stored, parts)
        if self.sid is not None:
            record_trailers(arr, self.sid, coords, [part[-1] for part in parts])
        return stored

    @property
    def oindex(self) -> _GuardedIndex:
        return _GuardedIndex(self, self.array.oindex)


class _GuardedIndex:
    def __init__(self, owner: StoredArray, index):
        self.owner, self.index = owner, index

    def __getitem__(self, selection):
        return self.owner._read(self.index.__getitem__, selection)

    def __setitem__(self, selection, value) -> None:
        self.owner._write(self.index.__setitem__, selection, value)


def _member_kind_error(group: zarr.Group, name: str, want: str) -> StoreDamageError:
    path = f"{group.path}/{name}".strip("/")
    return StoreDamageError(f"store {group.store}: {path} is not a zarr {want} (the store is damaged)")


def array_at(group: zarr.Group, name: str) -> zarr.Array:
    """``group[name]``, which must be an array (zarr types a member as ``Array | Group``): KeyError when it is
    absent, :class:`StoreDamageError` when it is a group."""
    node = group[name]
    if not isinstance(node, zarr.Array):
        raise _member_kind_error(group, name, "array")
    return node


def group_at(group: zarr.Group, name: str) -> zarr.Group:
    """``group[name]``, which must be a group: KeyError when it is absent, :class:`StoreDamageError` when it is
    an array."""
    node = group[name]
    if not isinstance(node, zarr.Group):
        raise _member_kind_error(group, name, "group")
    return node


def _attrs(node: zarr.Group | zarr.Array) -> MutableMapping[str, Any]:
    """``node.attrs``, its values typed Any: zarr types each as JSON (a union mypy cannot narrow per key); what
    each key of the store holds is this module's schema (written only through it)."""
    return cast(MutableMapping[str, Any], node.attrs)


#: the data arrays a read must find every touched chunk of (their rows are read only once flagged written)
REQUIRED_ON_READ = frozenset({"grads", "out_to_loss", "inverse", "solved"})


def _stored(
    group: zarr.Group, name: str, check: Callable[[zarr.Array], None] | None = None, sid: str | None = None
) -> StoredArray:
    """The array ``name`` of ``group``; ``check(array)`` first when given (a store opened with
    ``check_arrays="on_use"``: its zarr.json against the root metadata); ``sid``: the store's id (place checks)."""
    try:
        arr = array_at(group, name)
    except KeyError:
        path = f"{group.path}/{name}".strip("/")
        raise StoreDamageError(
            f"store {group.store}: array {path} is missing (its zarr.json is gone). Run "
            f"`trakflow verify {group.store} --repair`, then rerun to recompute it."
        ) from None
    if check is not None:
        check(arr)
    return StoredArray(arr.with_config({"write_empty_chunks": True}), sid, name in REQUIRED_ON_READ)


def _damaged_metadata(location: str, problems: list[str]) -> StoreDamageError:
    """The error for arrays whose zarr.json differs from what the root metadata implies."""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return StoreDamageError(
        f"store {location}: {problems[0]}{more}. The array's metadata was edited or "
        f"damaged: run `trakflow verify {location} --repair` (it recreates the array "
        "and unflags its rows), then rerun."
    )


def _write_rows(arr: StoredArray, rows, values: np.ndarray) -> np.ndarray:
    """Write ``values`` to ``rows`` (a slice or an index array) of ``arr``. Returns them as stored (its dtype)."""
    if isinstance(rows, slice):
        start, stop, step = rows.indices(int(arr.shape[0]))
        if step == 1 and stop - start == values.shape[0]:
            return arr.write_rows(start, values)
        arr[rows] = values
        return np.asarray(values).astype(arr.dtype, copy=False)
    rows = np.asarray(rows)
    if rows.size and np.all(np.diff(rows) == 1):
        return arr.write_rows(int(rows[0]), values)
    arr.oindex[rows] = values
    return np.asarray(values).astype(arr.dtype, copy=False)
