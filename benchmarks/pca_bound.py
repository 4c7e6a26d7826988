"""Upper bound for a data-dependent projection at proj_dim k (the traker margin at proj_dim 256).

The exact per-example gradients (``noop``, cached by ``quality.py``) of each checkpoint projected on the top-k
eigenvectors of that checkpoint's XᵀX (PCA, the best rank-k subspace for XᵀX), then scored as the pipeline does with
``adaptive`` and with λ = 0 — to compare with a random projection at the same k (RESULTS.md, "Attribution quality").

    .venv/bin/python benchmarks/pca_bound.py --cases digits-mlp digits-conv --dims 128 256 512
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quality as Q  # noqa: E402

from trak_core.lds import lds  # noqa: E402
from trak_core.scoring import combine_checkpoints  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=["digits-mlp", "digits-conv"])
    ap.add_argument("--dims", nargs="*", type=int, default=[128, 256, 512])
    ap.add_argument("--settings", nargs="*", default=["adaptive", "0"])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cases = Q.make_cases()
    print("| case | k | " + " | ".join(f"PCA, {s}" for s in args.settings) + " |")
    print("|---|---|" + "---|" * len(args.settings))
    for name in args.cases:
        case = cases[name]
        truth = Q.ground_truth(case, log=lambda *a: None)
        feats = [Q.features(case, truth, "noop", 0, c) for c in range(Q.NUM_CKPTS)]
        for k in args.dims:
            solvers = []
            for f in feats:
                x = torch.from_numpy(f["X"]).double()
                v = torch.linalg.eigh(x.T @ x)[1][:, -k:]  # top-k eigenvectors
                g = torch.from_numpy(f["G"]).double()
                solvers.append(Q.Solver({"X": (x @ v).float().numpy(), "Q": f["Q"], "G": (g @ v).float().numpy()}))
            qsum = sum(s.q for s in solvers).astype(np.float32)
            cells = []
            for setting in args.settings:
                lams = [s.resolve(setting) for s in solvers]
                acc = sum(s.scores(lam) for s, lam in zip(solvers, lams, strict=True))
                sc = combine_checkpoints(acc.numpy(), qsum, Q.NUM_CKPTS).astype(np.float64)
                cells.append(f"{lds(sc, truth['masks'], truth['margins'])[0]:.3f}")
            print(f"| {name} | {k} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
