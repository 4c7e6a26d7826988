"""Featurize seconds of the factored projector's layouts side by side, in one process, on the larger evaluation
cases' models (benchmarks/quality.py ``LARGE_CASES``): the current layout (equal shares per block, pairs where
they cost at most ``PAIRS_MAX_RATIO`` × the layer's forward), layout version 3's (shares ∝ block size, pairs for
small blocks only), and a training pass over the same rows (forward + backward + SGD step: the floor).

    .venv/bin/python benchmarks/quality.py truth --cases wide-mlp bn-conv   # the checkpoints
    .venv/bin/python benchmarks/factored_speed.py --proj-dims 512 2048 --rows 1500 --repeats 5

``--bench-models mlp400k convnet transformer`` adds benchmarks/featurize_bench.py's model shapes (seeded random
weights and inputs, task image_classification); ``--ratios`` times the current layout under other
``PAIRS_MAX_RATIO`` values too. Each configuration featurizes ``--rows`` train rows of checkpoint 0 in batches of
250 with the pipeline's featurizer (one warm-up batch first); the configurations take turns ``--repeats`` times and
the best time is kept. One thread; the load average is
printed (other processes may share the cores).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

import quality  # noqa: E402

import trak_core.factored_layout as factored_layout  # noqa: E402
from trak_core.factored import FactoredProjector  # noqa: E402
from trak_core.featurize import Featurizer  # noqa: E402

BATCH = 250


def _train_pass(case, state: dict, rows: int) -> float:
    model = case.make_model()
    model.load_state_dict(state)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    *xs, y = case.train()
    rows = min(rows, len(y))  # a case with fewer train rows (small-lm: 480) runs them all
    t0 = time.perf_counter()
    for a in range(0, rows, BATCH):
        opt.zero_grad()
        batch = [x[a : a + BATCH] for x in xs]
        if case.task == "causal_lm":  # (input_ids, attention_mask, labels): transformers' own loss
            loss = model(input_ids=batch[0], attention_mask=batch[1], labels=y[a : a + BATCH]).loss
        else:
            loss = torch.nn.functional.cross_entropy(model(*batch), y[a : a + BATCH])
        loss.backward()
        opt.step()
    return time.perf_counter() - t0


def _featurize(feat: Featurizer, train: tuple, rows: int) -> float:
    rows = min(rows, len(train[0]))
    t0 = time.perf_counter()
    for a in range(0, rows, BATCH):
        feat.featurize([t[a : a + BATCH] for t in train], 0, range(a, min(a + BATCH, rows)))
    return time.perf_counter() - t0


class _Shape:
    """A featurize_bench model shape as a case: model, random train rows, task."""

    task = "image_classification"

    def __init__(self, name: str, rows: int) -> None:
        import featurize_bench

        self.name = name
        model, shape, kind = featurize_bench.make_model(name)
        self.state = model.state_dict()
        self.make_model = lambda: featurize_bench.make_model(name)[0]
        self._train = featurize_bench.make_data(shape, kind, rows)

    def train(self) -> tuple:
        return self._train


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=list(quality.LARGE_CASES))
    ap.add_argument("--proj-dims", nargs="*", type=int, default=[512, 2048])
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bench-models", nargs="*", default=[], help="featurize_bench.py model names to time too")
    ap.add_argument(
        "--ratios",
        nargs="*",
        type=float,
        default=[factored_layout.PAIRS_MAX_RATIO],
        help="PAIRS_MAX_RATIO values of the current layout to time (the first is the default's)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cases = quality.make_cases()
    print(f"load average before: {open('/proc/loadavg').read().split()[:3]}")
    labels = ["v3"] + [f"ratio {r:g}" for r in args.ratios]
    print(
        "| case | params | proj_dim | training pass (s) | "
        + " | ".join(f"{x} (s)" for x in labels)
        + " | "
        + " | ".join(f"{x} / v3" for x in labels[1:])
        + " |"
    )
    print("|---|---|---|---|" + "---|" * (2 * len(labels) - 1))
    for name in args.cases + args.bench_models:
        if name in cases:
            case = cases[name]
            state = quality.ground_truth(case)["states"][0]
        else:
            case = _Shape(name, args.rows)
            state = case.state
        train = case.train()
        for p in args.proj_dims:
            feats = {}
            default = factored_layout.PAIRS_MAX_RATIO
            for label, split, ratio in [("v3", "size", default)] + [(f"ratio {r:g}", "layer", r) for r in args.ratios]:
                model = case.make_model()
                factored_layout.PAIRS_MAX_RATIO = ratio
                proj = FactoredProjector.from_model(model, p, 0, "rademacher", "cpu", split=split)
                factored_layout.PAIRS_MAX_RATIO = default
                feats[label] = Featurizer(model, case.task, proj)
                feats[label].load_state(state)
                _featurize(feats[label], train, BATCH)  # warm-up: factors, first vmap
            best = {k: float("inf") for k in ["train", *labels]}
            for _ in range(args.repeats):
                best["train"] = min(best["train"], _train_pass(case, state, args.rows))
                for label, feat in feats.items():
                    best[label] = min(best[label], _featurize(feat, train, args.rows))
            params = sum(t.numel() for t in case.make_model().parameters())
            cells = [f"{best[x]:.2f}" for x in labels] + [f"{best[x] / best['v3']:.2f}" for x in labels[1:]]
            print(f"| {name} | {params:,} | {p} | {best['train']:.2f} | " + " | ".join(cells) + " |", flush=True)
    print(f"load average after: {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
