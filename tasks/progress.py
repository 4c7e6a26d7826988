"""Progress events from the pipeline's plain functions to whoever listens in this process (the CLI's
progress bars). No listener: no cost. Events from other processes (e.g. Dask workers) are not seen."""

from __future__ import annotations

import threading
from collections.abc import Callable

# listener(kind, stage, amount): kind "start" (amount = total) or "advance" (amount = increment)
Listener = Callable[[str, str, float], None]

_lock = threading.Lock()
_listeners: list[Listener] = []


def add_listener(fn: Listener) -> None:
    with _lock:
        _listeners.append(fn)


def remove_listener(fn: Listener) -> None:
    with _lock:
        if fn in _listeners:
            _listeners.remove(fn)


def _emit(kind: str, stage: str, amount: float) -> None:
    with _lock:
        listeners = list(_listeners)
    for fn in listeners:
        try:
            fn(kind, stage, amount)
        except Exception:  # a broken progress bar must not break the computation
            pass


def start(stage: str, total: float) -> None:
    _emit("start", stage, total)


def advance(stage: str, amount: float = 1) -> None:
    _emit("advance", stage, amount)
