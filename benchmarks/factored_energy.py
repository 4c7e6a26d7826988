"""The factored projector's two splits of proj_dim, side by side: LDS against dense (RESULTS.md, "Attribution
quality at realistic compression").

``split="layer"`` (layout version 4, equal shares per block; quality.py's kind ``factored-v4``) against
``split="energy"`` (the default: shares ∝ each block's gradient energy, probed by ``sketched_energies``), both built
by ``FactoredProjector.from_model`` in ``quality.features`` (cached under ``.cache/lds/feats``); the ground truth
must exist (``quality.py truth --cases ...``).

    .venv/bin/python benchmarks/factored_energy.py --cases small-lm wide-mlp bn-conv --proj-dims 128 256 512 1024 2048
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import quality  # noqa: E402


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
        for p in args.proj_dims:
            dense, equal, energy = (
                quality.evaluate(case, truth, kind, p, [args.setting])[0]["lds"]
                for kind in ("dense", quality.FACTORED_V4, "factored")
            )
            print(
                f"| {name} | {d:,} | {p} | {d / p:,.0f}× | {dense:.3f} | {equal:.3f} | {equal - dense:+.3f} | "
                f"{energy:.3f} | {energy - dense:+.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
