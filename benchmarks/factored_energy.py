"""The factored projector with proj_dim split by gradient energy instead of equally: LDS against dense.

Layout version 4 splits proj_dim equally between a model's blocks (water-filled at each block's size). This script
measures what a split ∝ each block's gradient energy would give: the mean per-example ‖∂f/∂θ_block‖² over the first
64 train rows at checkpoint 0 (per-example gradients by ``torch.func``), shares ∝ that energy, water-filled at each
block's size, at least 4 each. The split is swapped into ``trak_core.factored_layout`` for this process only (the
rest of the layout rules — pairs, identity sides, factors — are the production ones). Features are cached under
``.cache/lds/feats`` like ``quality.py``'s (the layout's hash names them); the ground truth must exist
(``quality.py truth --cases ...``).

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

from trak_core import factored_layout  # noqa: E402
from trak_core.modelout import resolve_task  # noqa: E402

PROBE_ROWS = 64
MIN_SHARE = 4


def block_energy(case: quality.Case, state: dict) -> dict[str, float]:
    """{parameter name: mean over the probe rows of ‖∂f/∂θ‖²} at ``state``."""
    from torch.func import grad, vmap

    model = case.make_model()
    model.load_state_dict(state)
    model.eval()
    task = resolve_task(case.task)
    weights = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())
    batch = [t[:PROBE_ROWS] for t in case.train()]

    def f(w, *sample):
        return task.get_output(model, w, buffers, *sample)

    g = vmap(grad(f), in_dims=(None,) + (0,) * len(batch))(weights, *batch)
    return {k: float((v.reshape(v.shape[0], -1) ** 2).sum(1).mean()) for k, v in g.items()}


def energy_shares(energy: list[float], sizes: list[int], total: int) -> list[int]:
    """``total`` split ∝ ``energy``, water-filled at ``sizes``, at least MIN_SHARE (or the size) each."""
    share = [0.0] * len(sizes)
    free, left = list(range(len(sizes))), float(total)
    while free:
        mass = sum(energy[i] for i in free)
        full = [i for i in free if left * energy[i] / mass >= sizes[i]]
        if not full:
            for i in free:
                share[i] = left * energy[i] / mass
            break
        for i in full:
            share[i] = float(sizes[i])
            left -= sizes[i]
        free = [i for i in free if i not in full]
    ks = [min(sizes[i], max(MIN_SHARE, round(s))) for i, s in enumerate(share)]
    ks[int(np.argmax(share))] += total - sum(ks)
    return ks


def energy_split(energies: dict[str, float]):
    """A stand-in for ``factored_layout._with_split`` whose shares follow ``energies``."""
    real_with_split, real_equal = factored_layout._with_split, factored_layout._split_equal

    def with_split(blocks, proj_dim, split="layer"):
        energy = [max(sum(energies.get(p, 0.0) for p in b.params), 1e-30) for b in blocks]
        ks = energy_shares(energy, [b.size for b in blocks], proj_dim)
        factored_layout._split_equal = lambda sizes, total: list(ks)
        try:
            return real_with_split(blocks, proj_dim, split)
        finally:
            factored_layout._split_equal = real_equal

    return with_split


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
        energies = block_energy(case, truth["states"][0])
        for p in args.proj_dims:
            dense = quality.evaluate(case, truth, "dense", p, [args.setting])[0]["lds"]
            equal = quality.evaluate(case, truth, "factored", p, [args.setting])[0]["lds"]
            real = factored_layout._with_split
            factored_layout._with_split = energy_split(energies)
            try:
                energy = quality.evaluate(case, truth, "factored", p, [args.setting])[0]["lds"]
            finally:
                factored_layout._with_split = real
            print(
                f"| {name} | {d:,} | {p} | {d / p:,.0f}× | {dense:.3f} | {equal:.3f} | {equal - dense:+.3f} | "
                f"{energy:.3f} | {energy - dense:+.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
