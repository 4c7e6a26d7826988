"""The compact results file of a ``benchmarks/gpu_session.sh`` run: its environment, each step's status, the CUDA
tests' summary line and the tables of the steps (model sizes, conv net against traker, host path), from the files the
steps left under the output folder (a missing or cut step is reported as such).

    python3 benchmarks/gpu_session_summary.py $OUT > $OUT/results.md
"""

from __future__ import annotations

import os
import sys


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


def _table(text: str | None) -> list[str]:
    """The markdown table lines of a step's report (all of them: a step may print several tables)."""
    return [line for line in (text or "").splitlines() if line.startswith("|")]


def summarize(out: str) -> str:
    lines = ["# GPU session results", ""]
    env = _read(os.path.join(out, "env.txt"))
    lines += ["## Machine", "", *(f"    {x}" for x in (env or "(no env.txt)").strip().splitlines()), ""]
    status = _read(os.path.join(out, "status.txt"))
    lines += ["## Steps", "", *(f"- {x}" for x in (status or "").strip().splitlines()), ""]
    tests = _read(os.path.join(out, "cuda_tests.md"))
    last = [
        x for x in (tests or "").splitlines() if " passed" in x or " failed" in x or " skipped" in x or "error" in x
    ]
    lines += ["## CUDA tests", "", last[-1] if last else "(no summary line: see cuda_tests.md)", ""]
    fj = _read(os.path.join(out, "fastjl.log"))
    fj_last = [x for x in (fj or "").splitlines() if x.strip()]
    lines += ["## fast_jl", "", fj_last[-1] if fj_last else "(no fastjl.log)", ""]
    for name, title in (
        ("sizes", "GPT-2 124M and ~1B: featurize against a training step of the same batches"),
        ("matrix_conv", "Conv net against traker (+ fast_jl)"),
        ("host_path", "Host path (µs a row)"),
        ("budget", "Memory budget against the measured peak"),
    ):
        rows = _table(_read(os.path.join(out, f"{name}.md")))
        lines += [f"## {title}", "", *(rows or [f"(no table: see {name}.md)"]), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(sys.argv[1] if len(sys.argv) > 1 else "/tmp/gpu_session"))
