"""The run lock of a store (a file beside its arrays), atomic on local filesystems, and the one registry of the run
locks this process holds (:func:`acquire_run_lock` / :func:`release_run_lock`), which every front door uses."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from urllib.parse import urlparse

from ..errors import LockLostError, StoreLockedError
from .location import _is_url, check_writable


class StoreLock:
    """The run lock of a store: a small JSON file ``trakflow.lock`` (host, pid, run, since, token) in its folder.

    It needs only the location (a run locks before the plan creates the store). ``with
    StoreLock(location, run): ...`` holds it for a block. A lock left by a dead process of this host (a
    crash, SIGKILL) is stale and taken over, so a rerun resumes. Workers of one run (Dask, processes)
    write disjoint chunks and need no lock; the store checks before each commit of row flags that the lock
    it was opened under is still in place (:meth:`TrakStore.check_lock`).

    On a local filesystem every step is atomic, so of N processes racing for one lock exactly one wins:

    * a free lock is created by writing the payload to a private temporary file and hard-linking it to
      ``trakflow.lock`` (``link`` fails when the name exists; readers never see a half-written lock);
    * a stale lock is taken over by compare-and-swap: the racers that read the same stale content ``H``
      race to create ``trakflow.lock.takeover-<sha256(H)>`` with ``O_CREAT | O_EXCL``; the one that
      creates it re-reads the lock, and only if it still holds ``H`` renames its own payload over it
      (``os.replace``), then removes the claim file. The others see the new, live holder and are refused.

    On fsspec object stores (``s3://``, ``memory://``, ...) there is no such primitive: the lock is
    written, then read back (best effort; two racers can both pass in a narrow window). The per-commit
    check then stops the run whose lock was overwritten before it commits more rows.
    """

    NAME = "trakflow.lock"
    _CLAIM = ".takeover-"
    _ATTEMPTS = 200  # rounds of read → create/swap before giving up (a loser waits for the winner to install)

    def __init__(self, location: str, run: str = ""):
        self.location = str(location)
        self.run = run

    def _fs_and_path(self):
        import fsspec
        from fsspec.core import url_to_fs

        loc = self.location
        if loc.startswith("file://"):
            loc = urlparse(loc).path
        if _is_url(loc):
            fs, path = url_to_fs(loc)
        else:
            fs, path = fsspec.filesystem("file"), os.path.abspath(loc)
        return fs, path.rstrip("/") + "/" + self.NAME

    def _local_path(self) -> str | None:
        """The lock file's path on a local filesystem (None for other fsspec stores)."""
        loc = self.location
        if loc.startswith("file://"):
            loc = urlparse(loc).path
        if _is_url(loc):
            return None
        return os.path.abspath(loc).rstrip("/") + "/" + self.NAME

    def read_raw(self) -> bytes | None:
        """The lock file's bytes (None: there is no lock)."""
        local = self._local_path()
        try:
            if local is not None:
                with open(local, "rb") as fh:
                    return fh.read()
            fs, path = self._fs_and_path()
            with fs.open(path, "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None

    def fingerprint(self) -> str | None:
        """sha256 of the lock file's bytes (None: no lock). Any change of holder changes it."""
        raw = self.read_raw()
        return None if raw is None else hashlib.sha256(raw).hexdigest()

    def _parse(self, raw: bytes) -> dict:
        """The holder recorded in ``raw``; a torn (empty, truncated, not JSON) lock file gives
        ``{"torn": True, ...}`` with ``run`` saying so."""
        try:
            holder = json.loads(raw.decode())
            if isinstance(holder, dict) and "pid" in holder and "host" in holder:
                return holder
        except (UnicodeDecodeError, ValueError):
            pass
        what = "empty" if not raw.strip() else f"not a lock record ({raw[:40]!r})"
        return {"torn": True, "host": None, "pid": None, "run": f"<torn lock file: {what}>", "since": 0}

    def holder(self) -> dict | None:
        """Who holds the lock (``{"host", "pid", "run", "since", "token"}``), None if nobody; a torn lock file
        (empty or unreadable: a crash while it was written, or damage) gives a dict with ``"torn": True``."""
        raw = self.read_raw()
        return None if raw is None else self._parse(raw)

    def _torn_error(self, holder: dict) -> StoreLockedError:
        _, path = self._fs_and_path()
        return StoreLockedError(
            f"store {self.location}: its lock file {path} is {holder['run'][len('<torn lock file: ') : -1]} "
            "(torn: a run crashed while writing it, or the file was damaged), so the run holding the store "
            f"cannot be identified. If no run uses this store, remove the lock with `trakflow unlock "
            f"{self.location}`."
        )

    @staticmethod
    def holder_alive(holder: dict) -> bool:
        """Whether a lock holder may still run (a holder on another host, or a torn lock, is assumed alive)."""
        if holder.get("torn") or holder.get("host") != socket.gethostname():
            return True  # cannot tell for another machine: assume alive
        pid = int(holder.get("pid", -1))
        if pid <= 0:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    @staticmethod
    def _is_me(holder: dict) -> bool:
        return holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid()

    def _locked_error(self, holder: dict) -> StoreLockedError:
        return StoreLockedError(
            f"store {self.location} is in use by run {holder.get('run') or '?'} (pid {holder.get('pid')} on "
            f"{holder.get('host')}); two runs on one store are refused. Wait for it, or if that run is "
            f"gone, remove the lock with `trakflow unlock {self.location}`."
        )

    # local, atomic steps
    def _write_private(self, path: str, payload: bytes) -> str:
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "xb") as fh:
            fh.write(payload)
        return tmp

    def _create_local(self, path: str, payload: bytes) -> bool:
        """Create the lock atomically with its content; False when it exists already."""
        tmp = self._write_private(path, payload)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links: exclusive create, then write
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as fh:
                fh.write(payload)
            return True
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def _swap_local(self, path: str, seen: bytes, payload: bytes) -> bool | None:
        """Replace the lock holding ``seen`` by ``payload`` if it still holds ``seen`` (compare-and-swap).
        False: another process changed or is taking over the lock; None: a takeover claim on ``seen`` was
        left by a process that died in the middle of it."""
        claim = path + self._CLAIM + hashlib.sha256(seen).hexdigest()[:32]
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                with open(claim, "rb") as fh:
                    other = json.loads(fh.read().decode() or "{}")
            except (OSError, ValueError):
                return False
            return None if other and not self.holder_alive(other) else False
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(payload)
            if self.read_raw() != seen:
                return False  # installed or released by someone else meanwhile
            tmp = self._write_private(path, payload)
            os.replace(tmp, path)
            return True
        finally:
            with contextlib.suppress(OSError):
                os.unlink(claim)

    def acquire(self, run: str | None = None, force: bool = False) -> dict:
        """Take the lock or raise :class:`StoreLockedError` naming the live holder (re-entrant within one
        process; a dead holder of this host is taken over atomically; ``force`` takes it from a live one;
        a torn lock file is refused with what to do)."""
        run = self.run if run is None else run
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "run": run,
            "since": time.time(),
            "token": uuid.uuid4().hex,
        }
        payload = json.dumps(me).encode()
        local = self._local_path()
        orphan_claim = False
        for _ in range(self._ATTEMPTS):
            raw = self.read_raw()
            if raw is None:
                if local is not None:
                    if self._create_local(local, payload):
                        return me
                    continue  # another process created it: look at it
                return self._write_remote(payload, me)
            holder = self._parse(raw)
            if holder.get("torn"):
                if not force:
                    raise self._torn_error(holder)
            elif self._is_me(holder):
                return holder  # re-entrant within one process
            elif not force and self.holder_alive(holder):
                raise self._locked_error(holder)
            if local is None:
                return self._write_remote(payload, me)
            won = self._swap_local(local, raw, payload)
            if won:
                return me
            orphan_claim = won is None
            time.sleep(0.005)  # another process is taking it over: give it time to install its lock
        _, path = self._fs_and_path()
        why = (
            f"a takeover claim {path}{self._CLAIM}* was left by a process that died while taking over the lock"
            if orphan_claim
            else "other processes kept changing the lock"
        )
        raise StoreLockedError(
            f"store {self.location}: could not take the lock ({why}). If no run uses this store, "
            f"remove the lock with `trakflow unlock {self.location}`."
        )

    def _write_remote(self, payload: bytes, me: dict) -> dict:
        fs, path = self._fs_and_path()
        with fs.open(path, "wb") as fh:
            fh.write(payload)
        if self.read_raw() != payload:  # lost a race on a store without an atomic primitive
            raise StoreLockedError(f"store {self.location}: another run took the lock at the same time")
        return me

    def release(self) -> None:
        """Remove the lock if this process holds it."""
        holder = self.holder()
        if holder is not None and not holder.get("torn") and self._is_me(holder):
            fs, path = self._fs_and_path()
            with contextlib.suppress(FileNotFoundError):
                fs.rm(path)

    def force_unlock(self) -> dict | None:
        """Remove the lock whoever holds it (and takeover claims left beside it); returns the previous holder
        (None: it was not locked; ``"torn": True`` for a torn lock file)."""
        fs, path = self._fs_and_path()
        holder = self.holder()
        if holder is not None:
            with contextlib.suppress(FileNotFoundError):
                fs.rm(path)
        local = self._local_path()
        if local is not None:
            folder, base = os.path.split(local)
            with contextlib.suppress(OSError):
                for name in os.listdir(folder):
                    if name.startswith(base + self._CLAIM):
                        with contextlib.suppress(OSError):
                            os.unlink(os.path.join(folder, name))
        return holder

    @contextlib.contextmanager
    def held(self, run: str | None = None, force: bool = False):
        """``with lock.held(run_name): ...`` — hold the lock for the block."""
        self.acquire(run, force)
        try:
            yield self
        finally:
            self.release()

    def __enter__(self) -> StoreLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_lock_held(location: str, seen: str | None) -> None:
    """Raise :class:`LockLostError` when the run lock whose fingerprint was ``seen`` when a store at ``location``
    was opened has since been removed or taken by another run (one small read; nothing when ``seen`` is None: the
    store was opened unlocked). A store calls it before every commit of row flags."""
    if seen is None:
        return
    lock = StoreLock(location)
    raw = lock.read_raw()
    if raw is not None and hashlib.sha256(raw).hexdigest() == seen:
        return
    if raw is None:
        what = "was removed (e.g. `trakflow unlock`)"
    else:
        h = lock._parse(raw)
        what = f"is now held by run {h.get('run') or '?'} (pid {h.get('pid')} on {h.get('host')})"
    raise LockLostError(
        f"store {location}: the run lock this run was writing under {what}; stopping before committing "
        "more rows (rows already marked done are complete). Make sure only one run uses the store, then "
        "rerun: it resumes from the rows marked done."
    )


# ---------------------------------------------------------------------------------------------- held in this process
@dataclass
class _Held:
    lock: StoreLock
    owner: str
    run: str
    depth: int = 1
    created: list[str] = field(default_factory=list)  # folders made for the lock file, deepest first


#: the run locks this process holds: lock key (:func:`lock_key`) → holder
_HELD: dict[str, _Held] = {}
_HELD_GUARD = threading.Lock()


def lock_key(location: str) -> str:
    """One name per store: the absolute path of a local store (a ``file://`` URL included), else the URL."""
    loc = str(location)
    if loc.startswith("file://"):
        return os.path.abspath(urlparse(loc).path)
    return loc if _is_url(loc) else os.path.abspath(loc)


def _local_folder(location: str) -> str | None:
    loc = str(location)
    if loc.startswith("file://"):
        return os.path.abspath(urlparse(loc).path)
    return None if _is_url(loc) else os.path.abspath(loc)


def make_store_dir(path: str) -> list[str]:
    """Create the local folder ``path`` (for the lock file, before the store exists). Returns the folders
    created, deepest first (:func:`remove_empty` takes them away again if nothing was written into them)."""
    created: list[str] = []
    probe = path
    while not os.path.exists(probe):
        created.append(probe)
        probe = os.path.dirname(probe)
    os.makedirs(path, exist_ok=True)
    return created


def remove_empty(created: list[str]) -> None:
    """Remove the folders :func:`make_store_dir` created, deepest first, while they are empty."""
    for d in created:
        try:
            os.rmdir(d)
        except OSError:
            break


def reenter_run_lock(location: str, owner: str) -> bool:
    """Count one more hold of the run lock that ``owner`` holds on ``location`` in this process and return True
    (release it with :func:`release_run_lock`); False when ``owner`` does not hold it (nothing changes)."""
    with _HELD_GUARD:
        held = _HELD.get(lock_key(location))
        if held is None or held.owner != owner:
            return False
        held.depth += 1
        return True


def acquire_run_lock(location: str, run: str, owner: str = "") -> None:
    """Hold the run lock of the store at ``location`` (:class:`StoreLock`) for ``owner`` in this process.

    Holds of one owner are counted (``owner=""``: every holder of the process shares it, as TRAKers on one
    store do; a flow run passes its root run, so its subflows re-enter it); the lock file is removed after the
    last :func:`release_run_lock`. Another owner of this process is refused (StoreLockedError naming the run that
    holds it), as another live process or machine is by the lock file; a lock left by a dead process of this
    host is taken over. A new local store's folder is checked (BadInputError before anything is made), then
    created for the lock file, and removed again after the last release when nothing was written into it.
    """
    key = lock_key(location)
    with _HELD_GUARD:
        held = _HELD.get(key)
        if held is not None:
            if held.owner == owner:
                held.depth += 1
                return
            raise StoreLockedError(
                f"store {location} is in use by run {held.run} in this process (pid {os.getpid()}); "
                "two runs on one store are refused. Wait for it to finish."
            )
        folder = _local_folder(location)
        created: list[str] = []
        if folder is not None:
            check_writable(folder)  # a clear error, before any folder is made
            created = make_store_dir(folder)
        lock = StoreLock(location, run)
        try:
            lock.acquire()
        except BaseException:
            remove_empty(created)
            raise
        _HELD[key] = _Held(lock, owner, run, 1, created)


def release_run_lock(location: str) -> None:
    """Release one hold of :func:`acquire_run_lock` or :func:`reenter_run_lock` (the last one removes the lock
    file, then the folders made for it while they are empty); a location this process does not hold is a no-op."""
    key = lock_key(location)
    with _HELD_GUARD:
        held = _HELD.get(key)
        if held is None:
            return
        held.depth -= 1
        if held.depth > 0:
            return
        del _HELD[key]
    try:
        held.lock.release()
    finally:
        remove_empty(held.created)
