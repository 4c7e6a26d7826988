"""The factored projector's two splits of proj_dim, side by side: LDS against dense.

``split="layer"`` (layout version 4: equal shares per block, water-filled at each block's size) against
``split="energy"`` (layout version 5, the default of TRAKer and the pipeline: shares ∝ each block's mean per-example
‖∂f/∂θ_block‖², probed by :func:`trak_core.energy.gradient_energies` on the first 64 train rows at checkpoint 0,
water-filled at each block's size, at least 4 each), both built by ``FactoredProjector.from_model`` (the production
code). Features are cached under ``.cache/lds/feats`` like ``quality.py``'s (the projector's spec hash names them);
the ground truth must exist (``quality.py truth --cases ...``).

    .venv/bin/python benchmarks/factored_energy.py --cases small-lm wide-mlp bn-conv --proj-dims 128 256 512 1024 2048
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import quality  # noqa: E402

from trak_core.energy import PROBE_ROWS, gradient_energies  # noqa: E402
from trak_core.factored import FactoredProjector  # noqa: E402
from trak_core.lds import lds, truth_key  # noqa: E402
from trak_core.scoring import combine_checkpoints  # noqa: E402


def probe(case: quality.Case, state: dict) -> dict[str, float]:
    """The production probe: {parameter name: mean ‖∂f/∂θ‖²} over the first PROBE_ROWS train rows at ``state``."""
    model = case.make_model()
    model.load_state_dict(state)
    return gradient_energies(model, case.task, [t[:PROBE_ROWS] for t in case.train()], PROBE_ROWS)


def features(case: quality.Case, truth: dict, proj_dim: int, ckpt: int, split: str, energies, seed: int = 0) -> dict:
    """X, Q, G of checkpoint ``ckpt`` with the factored projector of ``split``; cached by its spec's hash."""
    model = case.make_model()
    proj = FactoredProjector.from_model(
        model, proj_dim, seed, "rademacher", "cpu", split=split, energies=energies if split == "energy" else None
    )
    tag = truth_key({k: v for k, v in proj.spec().items() if k not in ("kind", "proj_dim", "seed")})[:8]
    path = os.path.join(
        quality.CACHE, "feats", f"{case.name}-{truth['key']}-factored-{tag}-{proj_dim}-s{seed}-c{ckpt}.npz"
    )
    if os.path.exists(path):
        with np.load(path) as f:
            return {k: f[k] for k in ("X", "Q", "G")}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    out = quality.featurize_checkpoint(case, model, proj, truth["states"][ckpt], ckpt)
    np.savez(path, **out)
    return out


def factored_lds(case, truth, proj_dim: int, setting: str, split: str, energies) -> float:
    """LDS of the factored projector of ``split`` (quality.evaluate's arithmetic: quality.Solver per checkpoint)."""
    solvers = [quality.Solver(features(case, truth, proj_dim, c, split, energies)) for c in range(quality.NUM_CKPTS)]
    qsum = sum(s.q for s in solvers).astype(np.float32)
    acc = sum(s.scores(s.resolve(setting)) for s in solvers)
    sc = combine_checkpoints(acc.numpy(), qsum, quality.NUM_CKPTS).astype(np.float64)
    return float(lds(sc, truth["masks"], truth["margins"])[0])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=list(quality.LARGE_CASES))
    ap.add_argument("--proj-dims", nargs="*", type=int, default=[128, 256, 512, 1024, 2048])
    ap.add_argument("--setting", default=quality.ADAPTIVE_SETTING)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cases = quality.make_cases()
    print(
        "| case | parameters | proj_dim | compression | dense | factored, equal split | − dense | "
        "factored, energy split | − dense |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.cases:
        case = cases[name]
        truth = quality.ground_truth(case)
        d = quality.grad_dim(case)
        energies = probe(case, truth["states"][0])
        for p in args.proj_dims:
            dense = quality.evaluate(case, truth, "dense", p, [args.setting])[0]["lds"]
            equal = factored_lds(case, truth, p, args.setting, "layer", None)
            energy = factored_lds(case, truth, p, args.setting, "energy", energies)
            print(
                f"| {name} | {d:,} | {p} | {d / p:,.0f}× | {dense:.3f} | {equal:.3f} | {equal - dense:+.3f} | "
                f"{energy:.3f} | {energy - dense:+.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
