"""Damping variants against the best fixed λ, and leave-one-case-out under two criteria.

Reads ``benchmarks/quality.py eval`` result files (``--json``, in ``.cache/lds/``) and prints, for every damping
rule with dense rows on all cases and proj_dims and noop rows on the small cases (quality.py ``LARGE_CASES``
have none), its worst shortfall from the best fixed λ (best of λ = 0 and rel:0.01 … rel:1000 on that case and
proj_dim, an oracle) per case; then leave-one-case-out with the rule chosen on the other cases by (a) mean dense
LDS over the proj_dims (what ``quality.py report`` uses) and (b) the largest worst shortfall over the other
cases' proj_dims and noop (the issue's own bar), among all those rules or (``--family REGEX``) the matching
ones; per case and proj_dim for the rules named by ``--detail`` (dense, noop, and factored against traker where
those rows exist); and traker 0.3.2's margin at proj_dim 256 on the cases named by ``--margin-cases``.

    J=grid-dense.json,grid-dense-d2.json,grid-noop.json,grid-noop2.json,grid-noop-d2.json,grid-factored3.json,\\
    grid-factored4.json,grid-factored-d2.json,traker.json,traker2.json
    .venv/bin/python benchmarks/damping_variants.py --json $J --detail neff:0.12,cresid:10
    .venv/bin/python benchmarks/damping_variants.py --json $J --family '^neff:[0-9.]+,cresid:' --top 0
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quality import LARGE_CASES, _num  # noqa: E402  (_num: a number, i.e. an absolute λ)

from trak_core.damping import ADAPTIVE  # noqa: E402

CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "lds")
SMALL = ["digits-mlp", "digits-conv", "text", "cancer", "wine", "digits-sgd", "conv-sgd", "cancer-sgd", "wine-sgd"]
ALL_CASES = SMALL + list(LARGE_CASES)  # the large cases have no noop rows (grad_dim² XᵀX is out of reach)
DIMS = [128, 256, 512, 1024, 2048]


def load(paths: list[str]) -> dict:
    """{(case, kind, proj_dim, setting): row}; noop rows get proj_dim 0; later files win (as quality.load_rows)."""
    out = {}
    for path in paths:
        full = path if os.path.isabs(path) else os.path.join(CACHE, path)
        for r in json.load(open(full)):
            p = 0 if r["kind"] == "noop" else int(r["proj_dim"])
            out[(r["case"], r["kind"], p, str(r["setting"]))] = r
    return out


def _fixed(s: str) -> bool:
    return s.startswith("rel:") or _num(s)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="comma-separated result files (relative to .cache/lds)")
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--show", nargs="*", default=["deff:0.1,resid:3"], help="rules always listed")
    ap.add_argument("--family", default="", help="leave-one-case-out among the rules matching this regex only")
    ap.add_argument("--detail", nargs="*", default=[], help="rules to tabulate per case and proj_dim")
    ap.add_argument("--margin-cases", nargs="*", default=["digits-mlp", "digits-conv"])
    args = ap.parse_args(argv)
    rows = load(args.json.split(","))
    # the cases with dense rows in these files (the large ones only when their file is named)
    CASES = [c for c in ALL_CASES if any(k[0] == c and k[1] == "dense" for k in rows)]  # noqa: N806
    cells = [(c, "dense", p) for c in CASES for p in DIMS] + [(c, "noop", 0) for c in CASES if c in SMALL]
    best = {k: max(r["lds"] for kk, r in rows.items() if kk[:3] == k and _fixed(kk[3])) for k in cells}
    rules = sorted({k[3] for k in rows if k[1] == "dense" and not _num(k[3])})
    rules = [s for s in rules if all(k + (s,) in rows for k in cells)]

    def gap(k, s) -> float:
        return rows[k + (s,)]["lds"] - best[k]

    def mean_lds(s, among) -> float:
        return float(np.mean([rows[(c, "dense", p, s)]["lds"] for c in among for p in DIMS]))

    def worst(s, among) -> float:
        return min(gap(k, s) for k in cells if k[0] in among)

    def noop_gap(c, s) -> str:
        return f"{gap((c, 'noop', 0), s):+.3f}" if c in SMALL else "—"

    print(f"{len(rules)} rules with rows on every case × proj_dim {DIMS} and noop.\n")
    print("### Worst shortfall from the best fixed λ per case: dense 128…2048 / noop\n")
    print("| rule | worst | mean dense LDS | " + " | ".join(CASES) + " |")
    print("|---|---|---|" + "---|" * len(CASES))
    ranked = sorted(rules, key=lambda s: (-worst(s, CASES), -mean_lds(s, CASES)))
    shown = ranked[: args.top] + [s for s in args.show if s in rules and s not in ranked[: args.top]]
    for s in shown:
        per = [f"{min(gap((c, 'dense', p), s) for p in DIMS):+.3f} / {noop_gap(c, s)}" for c in CASES]
        print(f"| `{s}` | {worst(s, CASES):+.3f} | {mean_lds(s, CASES):.4f} | " + " | ".join(per) + " |")

    cands = [s for s in rules if re.search(args.family, s)]
    print("\n### Leave-one-case-out: the rule chosen on the other cases, its worst shortfall on the held-out case\n")
    if args.family:
        print(f"(candidates: the {len(cands)} rules matching `{args.family}`)\n")
    print("| held-out | by mean dense LDS | its worst (dense / noop) | by worst shortfall | its worst (dense / noop) |")
    print("|---|---|---|---|---|")
    for h in CASES:
        others = [c for c in CASES if c != h]
        by_mean = max(cands, key=lambda s: mean_lds(s, others))
        by_worst = max(cands, key=lambda s: (worst(s, others), mean_lds(s, others)))
        cells_h = []
        for s in (by_mean, by_worst):
            d = min((gap((h, "dense", p), s), p) for p in DIMS)
            cells_h.append(f"`{s}` | {d[0]:+.3f} (at {d[1]}) / {noop_gap(h, s)}")
        print(f"| {h} | " + " | ".join(cells_h) + " |")

    for s in args.detail:
        print(f"\n### `{s}` per case: dense LDS − best fixed λ at 128 … 2048, noop; 1024 − 256; factored − traker\n")
        print(
            "| case | " + " | ".join(str(p) for p in DIMS) + " | noop | 1024 − 256 dense / factored | "
            "factored − dense at 256 / 2048 | factored − traker 0.3.2 at 256 / 1024 / 2048 |"
        )
        print("|---|" + "---|" * (len(DIMS) + 4))
        for c in CASES:
            lds = {k: rows[k + (s,)]["lds"] for k in cells if k[0] == c and k + (s,) in rows}
            g = [f"{lds[(c, 'dense', p)]:.3f} ({gap((c, 'dense', p), s):+.3f})" for p in DIMS]
            g.append(f"{lds[(c, 'noop', 0)]:.3f} ({noop_gap(c, s)})" if c in SMALL else "—")
            fac = {p: rows.get((c, "factored", p, s), {}).get("lds") for p in DIMS}
            tra = {p: rows.get((c, "traker", p, "traker"), {}).get("lds") for p in DIMS}
            rise_f = f"{fac[1024] - fac[256]:+.3f}" if fac[1024] is not None and fac[256] is not None else "—"
            rise = f"{lds[(c, 'dense', 1024)] - lds[(c, 'dense', 256)]:+.3f} / {rise_f}"
            fd = " / ".join(f"{fac[p] - lds[(c, 'dense', p)]:+.3f}" if fac[p] is not None else "—" for p in (256, 2048))
            ft = " / ".join(
                f"{fac[p] - tra[p]:+.3f}" if fac[p] is not None and tra[p] is not None else "—"
                for p in (256, 1024, 2048)
            )
            print(f"| {c} | " + " | ".join(g) + f" | {rise} | {fd} | {ft} |")

    if args.margin_cases:
        print("\n### traker 0.3.2 at proj_dim 256 and what damping can add (LDS)\n")
        print(
            "| case | traker 0.3.2 | dense best fixed λ (oracle) | − traker | dense best rule | factored adaptive | "
            "− traker | noop best (exact gradients) | − traker |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for c in args.margin_cases:
            t = rows.get((c, "traker", 256, "traker"))
            if t is None:
                continue
            t = t["lds"]
            fixed = max((r["lds"], k[3]) for k, r in rows.items() if k[:3] == (c, "dense", 256) and _fixed(k[3]))
            anyr = max((r["lds"], k[3]) for k, r in rows.items() if k[:3] == (c, "dense", 256))
            noop = max((r["lds"], k[3]) for k, r in rows.items() if k[:3] == (c, "noop", 0))
            fa = rows.get((c, "factored", 256, ADAPTIVE))
            fcell = f"{fa['lds']:.3f} | {fa['lds'] - t:+.3f}" if fa else "— | —"
            print(
                f"| {c} | {t:.3f} | {fixed[0]:.3f} (`{fixed[1]}`) | {fixed[0] - t:+.3f} | "
                f"{anyr[0]:.3f} (`{anyr[1]}`) | {fcell} | {noop[0]:.3f} (`{noop[1]}`) | {noop[0] - t:+.3f} |"
            )


if __name__ == "__main__":
    main()
