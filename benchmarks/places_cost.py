"""What the chunks' place records cost: featurize, finalize and scoring with the place checks on and off, side by
side in one process (alternating rounds, each on a fresh store; medians and their ratio).

"off" replaces the two calls that read and write place records (``trak_core.store.arrays.place_problems`` and
``record_places``) by no-ops: everything else is the same code.

* featurize: TRAKer.featurize of ``--n`` rows of an MLP (batches of 64), all checkpoints;
* finalize: TRAKer.finalize_features (the partials summed, the p × p solve, the inverse written);
* targets + scoring: TRAKer start_scoring_checkpoint/score/finalize_scores of ``--targets`` targets;
* stream scoring: ``reduce.finalize_scores`` on a store of ``--score-n`` rows of proj_dim ``--p`` (float16), the
  streamed read of X against G·A (the scoring path of a large store).

    .venv/bin/python benchmarks/places_cost.py --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trak_core import TRAKer, reduce  # noqa: E402
from trak_core.store import StoreMetadata, TrakStore  # noqa: E402
from trak_core.store import arrays as store_arrays  # noqa: E402


@contextlib.contextmanager
def places(on: bool):
    real = store_arrays.place_problems, store_arrays.record_places
    if not on:
        store_arrays.place_problems = lambda *a, **k: []
        store_arrays.record_places = lambda *a, **k: None
    try:
        yield
    finally:
        store_arrays.place_problems, store_arrays.record_places = real


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def traker_times(save: str, a, x, y, xt, yt) -> dict:
    model = mlp(0)
    t = TRAKer(model, "image_classification", a.n, save_dir=save, device="cpu", proj_dim=a.traker_p, lambda_reg=1e-3)
    out = {}
    start = clock()
    for mid in range(a.ckpts):
        t.load_checkpoint(mlp(mid).state_dict(), model_id=mid)
        for s in range(0, a.n, 64):
            t.featurize([x[s : s + 64], y[s : s + 64]], num_samples=min(64, a.n - s))
    out["featurize"] = since(start)
    start = clock()
    t.finalize_features()
    out["finalize"] = since(start)
    start = clock()
    for mid in range(a.ckpts):
        t.start_scoring_checkpoint("e", mlp(mid).state_dict(), model_id=mid, num_targets=a.targets)
        t.score([xt, yt], num_samples=a.targets)
    t.finalize_scores("e")
    out["targets + scoring"] = since(start)
    return out


def clock() -> tuple[float, float]:
    """(wall, CPU) seconds now; CPU: user + system of this process, every thread."""
    t = os.times()
    return time.perf_counter(), t.user + t.system


def since(start: tuple[float, float]) -> tuple[float, float]:
    now = clock()
    return now[0] - start[0], now[1] - start[1]


def score_store(path: str, a) -> TrakStore:
    rng = np.random.default_rng(0)
    meta = StoreMetadata(train_set_size=a.score_n, grad_dim=10 * a.p, proj_dim=a.p, dtype="float16")
    st = TrakStore.create_or_open(path, meta)
    for mid in range(a.ckpts):
        st.init_model(mid)
        for lo in range(0, a.score_n, meta.rows_per_shard):
            hi = min(lo + meta.rows_per_shard, a.score_n)
            st.write_train_rows(
                mid, slice(lo, hi), rng.standard_normal((hi - lo, a.p), dtype=np.float32), np.ones(hi - lo, np.float32)
            )
        for s in range(meta.num_shards):
            reduce.ensure_partial(st, mid, s)
        reduce.finalize_model(st, mid, lambda_reg=1e-2)
    st.init_experiment("e", a.targets)
    for mid in range(a.ckpts):
        st.init_experiment_model("e", mid)
        st.write_target_rows("e", mid, slice(0, a.targets), rng.standard_normal((a.targets, a.p), dtype=np.float32))
    return st


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--ckpts", type=int, default=2)
    ap.add_argument("--traker-p", type=int, default=512)
    ap.add_argument("--targets", type=int, default=64)
    ap.add_argument("--score-n", type=int, default=32768)
    ap.add_argument("--p", type=int, default=1024)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(a.n, 64, generator=g), torch.randint(0, 10, (a.n,), generator=g)
    xt, yt = torch.randn(a.targets, 64, generator=g), torch.randint(0, 10, (a.targets,), generator=g)
    times: dict[str, dict[str, list[tuple[float, float]]]] = {"on": {}, "off": {}}
    with tempfile.TemporaryDirectory() as tmp:
        stores = {}
        for variant in ("on", "off"):  # a store written without place records is read without them
            with places(variant == "on"):
                stores[variant] = score_store(os.path.join(tmp, f"score-{variant}.zarr"), a)
        for r in range(a.rounds):
            for variant in ("on", "off") if r % 2 == 0 else ("off", "on"):
                with places(variant == "on"):
                    got = traker_times(os.path.join(tmp, f"t{r}{variant}"), a, x, y, xt, yt)
                    stores[variant].reset_scores("e")
                    start = clock()
                    reduce.finalize_scores(stores[variant], "e")
                    got["stream scoring"] = since(start)
                for k, v in got.items():
                    times[variant].setdefault(k, []).append(v)
    print(
        f"load {open('/proc/loadavg').read().split()[:3]}, {a.rounds} rounds, torch threads {torch.get_num_threads()}"
    )
    print(f"{'stage':<20} {'wall off':>9} {'wall on':>9} {'on/off':>7} {'CPU off':>9} {'CPU on':>9} {'on/off':>7}")
    for k in times["on"]:
        row = f"{k:<20}"
        for i in (0, 1):  # wall, CPU
            off = [v[i] for v in times["off"][k]]
            on = [v[i] for v in times["on"][k]]
            ratio = statistics.median(b / c for b, c in zip(on, off, strict=True))
            row += f" {statistics.median(off):>9.3f} {statistics.median(on):>9.3f} {ratio:>7.3f}"
        print(row)


if __name__ == "__main__":
    main()
