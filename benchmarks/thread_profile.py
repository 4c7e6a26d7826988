"""A py-spy stacks file (``py-spy record --threads --idle -f raw``) summarized thread by thread: each thread's
samples, the functions it spent them in (inclusive, each function counted once per sample) and where its samples
end (the innermost frames). Threads outside ``--under`` (a function name on the caller's path) are kept when their
name starts with ``--keep`` (the background threads).

    python benchmarks/thread_profile.py stacks.txt --under worker --top 40
"""

from __future__ import annotations

import argparse
import collections
import re


def _name(frame: str) -> str:
    """``func (path/to/file.py:123)`` → ``func (file.py)``."""
    m = re.match(r"(.*) \((.*?):\d+\)$", frame)
    return f"{m.group(1)} ({m.group(2).rsplit('/', 1)[-1]})" if m else frame


def summarize(lines, under: str | None, keep: str, top: int) -> str:
    samples: collections.Counter = collections.Counter()
    inclusive: dict = collections.defaultdict(collections.Counter)
    leaves: dict = collections.defaultdict(collections.Counter)
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        thread, *frames = stack.split(";")
        thread = re.sub(r"^thread:?", "", re.sub(r" ?\(\d+\)", "", thread)).strip(" :") or "(unnamed)"
        if under and not any(under in f for f in frames) and not thread.startswith(keep):
            continue
        n = int(count)
        samples[thread] += n
        for name in {_name(f) for f in frames}:
            inclusive[thread][name] += n
        if frames:
            leaves[thread][_name(frames[-1])] += n
    out = []
    for thread, total in samples.most_common():
        out.append(f"== {thread}: {total} samples")
        out += [f"  {100 * k / total:5.1f}%  {name}" for name, k in inclusive[thread].most_common(top)]
        out.append("  innermost:")
        out += [f"  {100 * k / total:5.1f}%  {name}" for name, k in leaves[thread].most_common(top // 3)]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stacks")
    ap.add_argument("--under", default=None, help="keep samples with this function on the path")
    ap.add_argument("--keep", default="trakflow", help="threads kept whatever their path (name prefix)")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    with open(args.stacks) as fh:
        print(summarize(fh, args.under, args.keep, args.top))


if __name__ == "__main__":
    main()
