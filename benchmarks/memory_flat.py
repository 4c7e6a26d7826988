"""Peak RSS of featurize, finalize and score against the number of train rows n (RESULTS.md, "Memory flat in n").

Each phase runs in a fresh subprocess (peak RSS = that process's own high-water mark, VmHWM), on a store of n rows of
proj_dim-dim features from a small MLP through TRAKer's defaults. ``delta_rss_mib`` is the peak minus the RSS
after the imports (the phase's own memory). tests/trak_core/test_memory_flat.py runs the same phases at moderate n.

    .venv/bin/python benchmarks/memory_flat.py --sizes 50000 200000 --proj-dim 512
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fresh_json, md_table, write_json  # noqa: E402

PHASE_CODE = r"""
import json, logging, sys, time, warnings
import numpy as np, torch
def hwm():  # own peak (KiB): ru_maxrss also holds the parent's mark, inherited at this process's start
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
torch.manual_seed(0)
import trak_core
phase, store = sys.argv[1], sys.argv[2]
n, p, m, bs = (int(a) for a in sys.argv[3:7])
base = hwm()
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10))
tr = trak_core.TRAKer(model=model, task="image_classification", train_set_size=n, save_dir=store, device="cpu",
                      proj_dim=p, lambda_reg=1e-3, logging_level=logging.ERROR)
g = torch.Generator().manual_seed(1)
t = time.perf_counter()
if phase == "featurize":
    tr.load_checkpoint(model.state_dict(), model_id=0)
    for a in range(0, n, bs):
        b = min(a + bs, n)
        x = torch.randn(b - a, 16, generator=g); y = torch.randint(0, 10, (b - a,), generator=g)
        tr.featurize((x, y), num_samples=b - a)
elif phase == "finalize":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr.finalize_features()
elif phase == "score":
    tr.start_scoring_checkpoint("bench", model.state_dict(), 0, m)
    x = torch.randn(m, 16, generator=g); y = torch.randint(0, 10, (m,), generator=g)
    tr.score((x, y), num_samples=m)
    s = tr.finalize_scores("bench")
    assert s.shape == (n, m)
peak = hwm()
print(json.dumps({"phase": phase, "n": n, "peak_rss_mib": peak / 1024, "baseline_rss_mib": base / 1024, "delta_rss_mib":
                  (peak - base) / 1024, "seconds": time.perf_counter() - t, "projector": tr.store.meta.projector}))
"""


def run_phase(phase: str, store: str, n: int, proj_dim: int, targets: int, batch: int) -> dict:
    """One phase in a fresh interpreter; its JSON line (peak_rss_mib, baseline_rss_mib, delta_rss_mib, ...)."""
    return fresh_json(["-c", PHASE_CODE, phase, store, str(n), str(proj_dim), str(targets), str(batch)])


def run(sizes, proj_dim, targets, batch):
    rows = []
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            for phase in ("featurize", "finalize", "score"):
                rows.append(run_phase(phase, os.path.join(tmp, "store"), n, proj_dim, targets, batch))
                print(rows[-1], flush=True)
    return rows


def table(rows, sizes, proj_dim, targets) -> str:
    ratio = f"ratio (n={sizes[-1]:,} / n={sizes[0]:,})"
    head = ["phase", *(f"n={n:,}" for n in sizes), ratio, "phase's own memory (peak − after imports)"]
    body = []
    for phase in ("featurize", "finalize", "score"):
        vals = [r for r in rows if r["phase"] == phase]
        cells = [f"{r['peak_rss_mib']:.0f} MiB ({r['seconds']:.1f} s)" for r in vals]
        ratio = f"{vals[-1]['peak_rss_mib'] / vals[0]['peak_rss_mib']:.2f}"
        body.append([phase, *cells, ratio, " → ".join(f"{r['delta_rss_mib']:.0f}" for r in vals) + " MiB"])
    store_mib = {n: n * proj_dim * 2 / 2**20 for n in sizes}  # float16 grads (the store keeps no features)
    kinds = sorted({r.get("projector", "?") for r in rows})
    return md_table(head, body) + (
        f"\n\nProjector `{'/'.join(kinds)}` (TRAKer's default), "
        f"proj_dim={proj_dim}, {targets} targets, float16 store; the grads array alone is "
        + ", ".join(f"{store_mib[n]:.0f} MiB at n={n:,}" for n in sizes)
        + ". Peak RSS includes the interpreter with torch and zarr loaded."
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[50_000, 200_000])
    ap.add_argument("--proj-dim", type=int, default=512)
    ap.add_argument("--targets", type=int, default=100)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = run(a.sizes, a.proj_dim, a.targets, a.batch)
    print(table(rows, a.sizes, a.proj_dim, a.targets))
    write_json(a.json, rows)
