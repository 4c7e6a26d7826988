"""A bounded background writer: store writes run in order on one thread while the caller computes the next batch.

Jobs run one at a time, in the order submitted. :meth:`BackgroundWriter.submit` waits while ``depth`` jobs are
already waiting (so at most that many batches of rows are held in memory). The first job that raises stops the
writer until the caller has it: the jobs queued after it are dropped (a job writes its rows before their flags, so a
dropped or failed job leaves its rows unflagged, to be featurized again), and the error is raised in the caller by
the next :meth:`submit` or :meth:`drain`; jobs submitted after that run again. The thread keeps no reference to a
job after running it (the jobs' owner, e.g. a TRAKer, is still garbage collected).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class BackgroundWriter:
    """Runs ``submit``-ted jobs in order on one daemon thread; ``drain`` waits for them and raises their error."""

    def __init__(self, depth: int = 2, name: str = "trakflow-writer"):
        self._jobs: queue.Queue = queue.Queue(maxsize=max(1, int(depth)))
        self._error: BaseException | None = None  # the error the caller has not been given yet
        self._epoch = 0  # jobs are tagged with it; it moves on each time the caller is given an error
        self._failed_epoch = -1  # the epoch of the last job that failed: the jobs of that epoch are dropped
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            item = self._jobs.get()
            try:
                if item is None:
                    return
                epoch, job = item
                with self._lock:
                    skip = epoch <= self._failed_epoch  # queued before the caller had a failed job's error: dropped
                if not skip:
                    job()
            except BaseException as err:  # noqa: BLE001 (handed to the caller, who raises it)
                with self._lock:
                    self._failed_epoch = epoch
                    if self._error is None:
                        self._error = err
            finally:
                item = job = None
                self._jobs.task_done()

    def _raise(self) -> None:
        with self._lock:
            err, self._error = self._error, None
            if err is not None:
                self._epoch += 1
        if err is not None:
            raise err

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job`` (waits while the queue is full); first raises the error of an earlier job, if any."""
        self._raise()
        if not self._thread.is_alive():
            raise RuntimeError("the background writer is closed")
        self._jobs.put((self._epoch, job))

    def drain(self) -> None:
        """Wait until every queued job has run (or been dropped after an error); raise that error here."""
        self._jobs.join()
        self._raise()

    def close(self) -> None:
        """Drain, then stop the thread (the error of a job, if any, is raised after the thread stopped)."""
        try:
            if self._thread.is_alive():
                self._jobs.join()
        finally:
            if self._thread.is_alive():
                self._jobs.put(None)
                self._thread.join()
        self._raise()
