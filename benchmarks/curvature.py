"""Gauss-Newton curvature for TRAK: LDS with XᵀRX in place of XᵀX, on the evaluation cases of
``benchmarks/quality.py`` (RESULTS.md, "Gauss-Newton curvature"; docs/damping.md derives it).

rᵢ = ∂²loss/∂fᵢ² = pᵢ(1 − pᵢ) = Qᵢ(1 − Qᵢ) for the margin output of every built-in task; traker 0.3.2 uses XᵀX
(R = I). Both are scored with quality.py's pipeline formula (``quality.Solver``) on its cached ground truth:

* ``xtx``: H = XᵀX, λ by ``lambda_reg="adaptive"``;
* ``ggn``: H = XᵀRX + β·mean(r)·XᵀX (β = trak_core's GGN_FLOOR, as ``curvature="ggn"`` builds it),
  λ = (the λ ``adaptive`` gives XᵀX) × trace(H) / trace(XᵀX);
* ``best fixed``: per case, kind and proj_dim the best of λ = rel:0.01 … rel:1000 (an oracle), for each curvature.

Δ is ggn − xtx with both at their rule (paired bootstrap over targets, 95 %); "vs traker" compares with
traker 0.3.2 itself at the same checkpoints and proj_dim (quality.py's cached run, ``quality.traker_lds``).

    .venv/bin/python benchmarks/curvature.py --kinds dense factored --proj-dims 128 256 512 1024 2048
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quality  # noqa: E402
from common import write_json  # noqa: E402

from trak_core.solve.damping import GGN_FLOOR  # noqa: E402

RULE = "adaptive"
FIXED = [f"rel:{f:g}" for f in (0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100, 300, 1000)]


def loss_curvature(q: np.ndarray) -> np.ndarray:
    """rᵢ = ∂²loss/∂fᵢ² = pᵢ(1 − pᵢ) from Qᵢ = 1 − pᵢ (float64)."""
    q = q.astype(np.float64)
    return q * (1.0 - q)


class GGNSolver(quality.Solver):
    """quality.Solver with the curvature XᵀRX: its eigendecomposition from the rows scaled by √rᵢ, the scores
    from the unscaled rows X. λ: ``transfer`` (the XᵀX rule's λ scaled by the traces' ratio) or rel:f."""

    def __init__(self, f: dict, base: quality.Solver, floor: float = GGN_FLOOR) -> None:
        r = loss_curvature(f["Q"])
        r = r + floor * r.mean()  # the floor β: rᵢ + β·mean(r), XᵀRX + β·mean(r)·XᵀX (``--floors``)
        super().__init__({**f, "X": (f["X"] * np.sqrt(r)[:, None]).astype(np.float32)})
        self.x = torch.from_numpy(f["X"])  # the scores' rows: X, not √R X
        self.base = base
        self.ratio = float(self.ev.sum() / base.ev.sum())

    def resolve(self, setting) -> float:
        """``transfer`` (the XᵀX rule's λ scaled by the traces' ratio) or a lambda_reg."""
        if setting == "transfer":
            return self.base.resolve(RULE) * self.ratio
        return super().resolve(setting)


def by_setting(solvers: list, settings: list, truth: dict) -> dict:
    """{setting: quality.py's row (LDS, its interval, per-target correlations)} for the checkpoints' solvers."""
    return {r["setting"]: r for r in quality.solver_rows(solvers, settings, truth)}


def evaluate(case, truth, kind: str, proj_dim: int, num_ckpts: int) -> dict:
    feats = [quality.features(case, truth, kind, proj_dim, c) for c in range(num_ckpts)]
    base = [quality.Solver(f) for f in feats]
    ggn = [GGNSolver(f, b) for f, b in zip(feats, base, strict=True)]
    xb = by_setting(base, [RULE, *FIXED], truth)
    xg = by_setting(ggn, ["transfer", *FIXED], truth)
    row = {"case": case.name, "kind": kind, "proj_dim": base[0].x.shape[1]}
    for name, res, rule in (("xtx", xb, RULE), ("ggn", xg, "transfer")):
        best = max(FIXED, key=lambda s, res=res: res[s]["lds"])
        row[name] = {"lds": res[rule]["lds"], "ci": res[rule]["ci"], "best": res[best]["lds"], "best_setting": best}
    row["delta"] = quality.paired_ci(xg["transfer"]["per"], xb[RULE]["per"])
    row["per_ggn"] = xg["transfer"]["per"]
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=None, help="default: the nine small cases (not quality.LARGE_CASES)")
    ap.add_argument("--kinds", nargs="*", default=["dense", "factored"])
    ap.add_argument("--proj-dims", nargs="*", type=int, default=[128, 256, 512, 1024, 2048])
    ap.add_argument("--json", default=None, help="write the result rows (without per-target values) here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cases = quality.make_cases()
    args.cases = args.cases or [c for c in cases if c not in quality.LARGE_CASES]
    rows = []
    print(
        "| case | kind | proj_dim | XᵀX, adaptive | XᵀRX, transfer | Δ (paired) | XᵀX best fixed | XᵀRX best fixed |"
        " XᵀRX − traker 0.3.2 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.cases:
        case = cases[name]
        truth = quality.ground_truth(case, log=lambda *a: None)
        for kind in args.kinds:
            for p in args.proj_dims if kind != "noop" else [0]:
                t0 = time.perf_counter()
                r = evaluate(case, truth, kind, p, quality.NUM_CKPTS)
                ref = ""
                if kind != "noop" and os.path.exists(quality.traker_cache(case, truth, p)):
                    tr = quality.traker_lds(case, truth, p)
                    d, lo, hi = quality.paired_ci(r["per_ggn"], tr["per"])
                    r["vs_traker"] = (d, lo, hi)
                    ref = f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]"
                d, lo, hi = r["delta"]
                x, g = r["xtx"], r["ggn"]
                print(
                    f"| {name} | {kind} | {r['proj_dim']} | {quality.fmt(x)} | {quality.fmt(g)} | "
                    f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}] | {x['best']:.3f} ({x['best_setting']}) | "
                    f"{g['best']:.3f} ({g['best_setting']}) | {ref or '—'} |",
                    flush=True,
                )
                print(f"  ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
                rows.append({k: v for k, v in r.items() if k != "per_ggn"})
                write_json(args.json, rows, default=float)


if __name__ == "__main__":
    main()
