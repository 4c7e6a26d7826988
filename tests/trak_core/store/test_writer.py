"""The background writer runs jobs in order on its own thread, hands a job's error to the caller, and drops the
jobs queued behind a failed one (their rows stay unflagged) until the caller has the error."""

from __future__ import annotations

import threading

import pytest

from trak_core.store.writer import BackgroundWriter


def test_jobs_run_in_order_on_one_other_thread():
    w = BackgroundWriter(depth=2)
    seen: list[tuple[int, int]] = []
    for i in range(20):
        w.submit(lambda i=i: seen.append((i, threading.get_ident())))
    w.drain()
    assert [i for i, _ in seen] == list(range(20))
    assert {t for _, t in seen} != {threading.get_ident()} and len({t for _, t in seen}) == 1
    w.close()
    with pytest.raises(RuntimeError, match="closed"):
        w.submit(lambda: None)


def test_an_error_reaches_the_caller_and_the_jobs_behind_it_are_dropped():
    w = BackgroundWriter(depth=4)
    gate, ran = threading.Event(), []

    def fail():
        gate.wait()
        raise OSError(28, "No space left on device")

    w.submit(fail)
    w.submit(lambda: ran.append("queued behind the failure"))  # queued before the error is raised
    w.submit(lambda: gate.wait())
    w.submit(lambda: ran.append("queued behind the failure, run after the caller has the error"))
    gate.set()
    with pytest.raises(OSError, match="No space left"):
        w.drain()
    w.drain()  # raised once
    w.submit(lambda: ran.append("after"))  # the caller has the error: the writer goes on
    w.close()
    assert ran == ["after"]


def test_jobs_queued_before_the_caller_has_the_error_are_dropped_even_when_they_run_after():
    w = BackgroundWriter(depth=4)
    failed, release, ran = threading.Event(), threading.Event(), []

    def fail():
        failed.set()
        raise OSError(5, "I/O error")

    w.submit(fail)
    w.submit(lambda: release.wait())  # dropped too, so it does not wait: the next job comes right after
    w.submit(lambda: ran.append("queued before the error was raised"))
    failed.wait()
    with pytest.raises(OSError, match="I/O error"):
        w.submit(lambda: ran.append("after"))  # raises the error; this job is not queued
    w.submit(lambda: ran.append("after"))
    release.set()
    w.close()
    assert ran == ["after"]


def test_the_next_submit_raises_an_earlier_jobs_error():
    w = BackgroundWriter(depth=1)
    w.submit(lambda: 1 / 0)
    w._jobs.join()  # the job has run (and failed)
    with pytest.raises(ZeroDivisionError):
        w.submit(lambda: None)
    w.close()


def test_close_raises_an_error_not_yet_given_and_stops_the_thread():
    w = BackgroundWriter()
    w.submit(lambda: [][1])
    with pytest.raises(IndexError):
        w.close()
    assert not w._thread.is_alive()
