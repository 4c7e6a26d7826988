"""benchmarks/scoring_bench.py: ``cpu_by_thread`` puts a call's CPU time on the threads that spent it (the split the
RESULTS scoring table reports: workers, zarr's threads, the caller)."""

from __future__ import annotations

import importlib.util
import os
import threading
import time

import pytest
from trak_fixtures import REPO_ROOT

ROOT = str(REPO_ROOT)
pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("scoring_bench", os.path.join(ROOT, "benchmarks", "scoring_bench.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _spin(cpu_seconds: float) -> None:
    """Busy for ``cpu_seconds`` of this thread's CPU time (not wall time)."""
    end = time.thread_time() + cpu_seconds
    while time.thread_time() < end:
        pass


def test_cpu_by_thread_splits_a_started_thread_from_the_caller(bench):
    """A thread started and joined inside the call counts as "started", the caller's own work as "caller"; the parts
    add up to the process's CPU time of the call."""

    def call():
        t = threading.Thread(target=_spin, args=(0.3,))
        t.start()
        t.join()
        _spin(0.15)

    split = bench.cpu_by_thread(call)
    assert split["started"] >= 0.25  # clock ticks: ~0.01 s resolution
    assert 0.1 <= split["caller"] < 0.25
    assert split["zarr"] == 0.0
    parts = split["zarr"] + split["caller"] + split["other"] + split["started"]
    assert parts == pytest.approx(split["total"], abs=0.03)


def test_cpu_by_thread_counts_a_named_zarr_thread_as_zarr(bench):
    """A thread alive before and after the call and named as zarr's I/O threads are (``zarr_io``, ``asyncio_N``)
    counts as zarr's, not as the caller's or as a started one."""
    go, done, stop = threading.Event(), threading.Event(), threading.Event()

    def zarr_like():  # alive before and after the call, as zarr's threads are
        go.wait()
        _spin(0.2)
        done.set()
        stop.wait()

    t = threading.Thread(target=zarr_like, name="asyncio_7", daemon=True)
    t.start()

    def call():
        go.set()
        done.wait()

    try:
        split = bench.cpu_by_thread(call)
    finally:
        stop.set()
        t.join()
    assert split["zarr"] >= 0.15
    assert split["started"] < 0.05 and split["caller"] < 0.05
