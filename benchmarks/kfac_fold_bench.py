"""Featurize time of ``TRAKer(curvature="kfac")`` without a fit (the factor sums folded into featurizing) beside
``curvature="xtx"`` (no factors): small-lm's GPT-2 (width 128, 2 layers, 480 docstring texts, causal_lm) and an MLP
256-512-512-10 (2,048 random rows, image_classification), the default projector, on the CPU.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/kfac_fold_bench.py [--cases small-lm mlp] [--repeats 2] [--threads 1]

Run it from another checkout (PYTHONPATH=that checkout) for a before/after. Prints one line per run: the case, the
curvature, the seconds of featurize (every row, the rows written; wall and the process's CPU time) and of
finalize_features. On a shared machine ``--threads 1`` and the CPU time compare best."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def small_lm():
    from examples import gpt

    return gpt.wide_model, tuple(gpt.train_data()), "causal_lm"


def mlp():
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
            torch.nn.Linear(512, 10),
        ).eval()  # fmt: skip

    g = torch.Generator().manual_seed(1)
    return (
        model,
        (torch.randn(2048, 256, generator=g), torch.randint(0, 10, (2048,), generator=g)),
        "image_classification",
    )


CASES = {"small-lm": small_lm, "mlp": mlp}


def run(case: str, curvature: str, proj_dim: int, batch: int) -> tuple[float, float, float]:
    from trak_core import TRAKer

    model_fn, data, task = CASES[case]()
    model = model_fn()
    n = data[0].shape[0]
    with tempfile.TemporaryDirectory() as tmp:
        tr = TRAKer(model=model, task=task, train_set_size=n, save_dir=os.path.join(tmp, "s"), device="cpu",
                    proj_dim=proj_dim, curvature=curvature, use_half_precision=False,
                    logging_level=logging.ERROR)  # fmt: skip
        tr.load_checkpoint(model.state_dict(), model_id=0)
        t0, c0 = time.perf_counter(), time.process_time()
        for a in range(0, n, batch):
            tr.featurize(tuple(t[a : a + batch] for t in data), num_samples=min(n, a + batch) - a)
        tr._flush_rows()
        t1, c1 = time.perf_counter(), time.process_time()
        tr.finalize_features()
        t2 = time.perf_counter()
    return t1 - t0, c1 - c0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--curvatures", nargs="*", default=["xtx", "kfac"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--proj-dim", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")  # (the factors' warning names the layers that keep XᵀX blocks)
    if args.threads:
        torch.set_num_threads(args.threads)
    for case in args.cases:
        for rep in range(args.repeats):
            for curvature in args.curvatures:
                feat, cpu, fin = run(case, curvature, args.proj_dim, args.batch)
                line = f"featurize {feat:7.2f} s (CPU {cpu:7.2f} s)  finalize {fin:6.2f} s"
                print(f"{case:9s} {curvature:5s} run {rep}: {line}", flush=True)


if __name__ == "__main__":
    main()
