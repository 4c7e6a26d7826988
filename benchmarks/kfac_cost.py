"""Time and memory of the Kronecker-factored curvature's fit beside featurizing, on one small MLP (CPU).

    PYTHONPATH=. python benchmarks/kfac_cost.py [--rows 1024] [--width 256] [--proj-dim 512] [--repeat 3]

Prints, per curvature, the seconds of the factor fit (one pass for K-FAC, two for EK-FAC, and the eigendecompositions
of the factors), of those eigendecompositions alone (``eigh_s``: O(d³) per layer, the part that a busy BLAS slows
most), of featurizing the same rows with the factored projection (preconditioned or not), the bytes of the factors
recorded in the store, and the process's peak resident memory after each step (times: the fastest of --repeat)."""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
from torch import nn

from trak_core import kfac
from trak_core.featurize import Featurizer
from trak_core.gradients import grad_dim_of
from trak_core.projectors import make_projector


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--proj-dim", type=int, default=512)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, a.width), nn.ReLU(), nn.Linear(a.width, a.width), nn.ReLU(), nn.Linear(a.width, 10)
    )
    x, y = torch.randn(a.rows, 64), torch.randint(0, 10, (a.rows,))
    batches = lambda: [[x[s : s + a.batch], y[s : s + a.batch]] for s in range(0, a.rows, a.batch)]  # noqa: E731
    out: dict = {"rows": a.rows, "params": grad_dim_of(model), "proj_dim": a.proj_dim, "repeat": a.repeat}
    sites = kfac.linear_sites(model)[0]

    def best(fn) -> float:  # the fastest of --repeat runs (a shared machine's noise only adds time)
        times = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return round(min(times), 3)

    for curvature in ("xtx", "kfac", "ekfac"):
        proj = make_projector("factored", grad_dim_of(model), a.proj_dim, 0, "rademacher", model=model)
        feat = Featurizer(model, "image_classification", proj)
        feat.load_state(model.state_dict())
        if curvature != "xtx":
            pre = kfac.fit_factors(feat, batches, curvature)  # (also the first use of vmap's machinery)
            out[f"{curvature}_fit_s"] = best(lambda c=curvature, f=feat: kfac.fit_factors(f, batches, c))
            sums = kfac.FactorSums()
            for b in batches():
                sums.add(kfac.batch_sums(feat, b, sites)[0])
            out[f"{curvature}_eigh_s"] = best(lambda s=sums: kfac.eigenbases(s))
            feat.curvature = lambda mid, pre=pre: pre
            out[f"{curvature}_record_bytes"] = len(json.dumps(kfac.to_record(pre)))
        feat.featurize(batches()[0], 0)  # warm-up
        out[f"{curvature}_featurize_s"] = best(lambda f=feat: [f.featurize(b, 0) for b in batches()])
        out[f"{curvature}_peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
