"""Task runners selected by the config (``task_runner``: "thread" for now)."""

from __future__ import annotations

from prefect.futures import wait
from prefect.task_runners import ThreadPoolTaskRunner


def make_task_runner(config):
    if config.task_runner == "thread":
        return ThreadPoolTaskRunner(max_workers=config.max_workers)
    raise ValueError(f"task_runner: unknown task runner {config.task_runner!r}")  # pragma: no cover


def gather(futures) -> list:
    """Wait for all futures, then return their results (raising the first failure)."""
    wait(futures)
    return [f.result() for f in futures]
