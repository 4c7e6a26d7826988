"""Helpers shared by the benchmark scripts: a measurement in a fresh interpreter, markdown tables, result files, the
CPU's name and the generated blocks of RESULTS.md. No torch import: a parent process that reports its children's
peak RSS stays small (a child's ``ru_maxrss`` starts from its parent's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def fresh_json(argv: list[str], timeout: float | None = None) -> dict:
    """Run ``python *argv`` in a fresh interpreter and return the last line of its output, parsed as JSON; a failure
    raises RuntimeError with the end of its stderr (subprocess.TimeoutExpired past ``timeout`` seconds)."""
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)[:200]} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def md_table(head: list[str], rows: list[list], align: list[str] | None = None) -> str:
    """A markdown table: the header's cells, one alignment cell per column (``---`` unless given, e.g. ``---:``),
    then the rows' cells."""

    def line(cells: list) -> str:
        return "| " + " | ".join(str(c) for c in cells) + " |"

    return "\n".join([line(head), "|" + "|".join(align or ["---"] * len(head)) + "|", *map(line, rows)])


def write_json(path: str | None, obj, default=str) -> None:
    """Write the raw results to ``path`` (no file without a path)."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            json.dump(obj, fh, indent=1, default=default)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or "" where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "")
    except OSError:
        return ""


def write_section(path: str, body: str, start: str, end: str) -> None:
    """Replace the block between the ``start`` and ``end`` markers of ``path`` (or append it) with ``body``."""
    old = open(path).read() if os.path.exists(path) else "# trakflow benchmarks\n"
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in old and end in old:
        new = old[: old.index(start)] + block + old[old.index(end) + len(end) :]
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as fh:
        fh.write(new if new.endswith("\n") else new + "\n")
