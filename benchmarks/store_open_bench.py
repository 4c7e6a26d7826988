"""What opening the store costs a pipeline task, by the number of checkpoints and experiments.

Builds an empty store (its groups and arrays, no chunks) with ``--ckpts`` checkpoints and ``--exps`` experiments
of every checkpoint, then times, best of ``--repeats``:

* **open, every array checked** (``TrakStore.open``: each array's zarr.json read and compared with the root
  metadata — what the plan step, ``TRAKer``, ``trakflow show`` and the report do);
* **open, each array checked as it is opened** (``check_arrays="on_use"``: what a pipeline task does since
  ``tasks.common.open_store``), then the arrays one score task opens: each checkpoint's X and Q, the
  experiment's scores and flags, each checkpoint's G A (within ``TrakStore.pinned``, as the task does).

    .venv/bin/python benchmarks/store_open_bench.py --ckpts 1 5 20 --exps 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trak_core.store import StoreMetadata, TrakStore  # noqa: E402


def build(path: str, ckpts: int, exps: int) -> int:
    """The store's groups and arrays for ``ckpts`` checkpoints and ``exps`` experiments; returns its arrays."""
    st = TrakStore.create_or_open(path, StoreMetadata(train_set_size=100_000, grad_dim=1000, proj_dim=512))
    for mid in range(ckpts):
        st.init_model(mid)
    for e in range(exps):
        st.init_experiment(f"e{e}", 100)
        for mid in range(ckpts):
            st.init_experiment_model(f"e{e}", mid)
        st.begin_scores(f"e{e}", list(range(ckpts)))
    return sum(len(list(g.array_keys())) for g in st.array_groups())


def score_task_opens(path: str, ckpts: int) -> None:
    """The store as a score task opens it, and the arrays the task reads."""
    st = TrakStore.open(path, check_arrays="on_use")
    opened = []
    with st.pinned():
        for mid in range(ckpts):
            opened += [st.model(mid).grads, st.model(mid).out_to_loss, st.experiment("e0").model(mid).solved]
        opened += [st.experiment("e0").scores, st.experiment("e0").scores_done]


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpts", type=int, nargs="+", default=[1, 5, 20])
    ap.add_argument("--exps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    print(f"`.venv/bin/python benchmarks/store_open_bench.py --ckpts {' '.join(map(str, a.ckpts))} --exps {a.exps}`")
    print()
    head = "open, every array checked | open + a score task's arrays, each checked as opened"
    print(f"| checkpoints | experiments | arrays | {head} |")
    print("|---|---|---|---|---|")
    for c in a.ckpts:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "s.zarr")
            arrays = build(path, c, a.exps)
            full = best(lambda: TrakStore.open(path), a.repeats)
            used = best(lambda: score_task_opens(path, c), a.repeats)
            print(f"| {c} | {a.exps} | {arrays} | {full * 1e3:.1f} ms | {used * 1e3:.1f} ms |", flush=True)


if __name__ == "__main__":
    main()
