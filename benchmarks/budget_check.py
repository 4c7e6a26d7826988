"""A memory budget against a measured peak: TRAKer featurizes one large batch without a budget, then with
``max_memory`` set to what is used now plus a fraction of the growth that run measured.

On a GPU the peak is torch's allocated memory (``torch.cuda.max_memory_allocated``, reset before each run); on the
CPU the process's resident high-water mark (reset before each run; the second run may reuse pages the first freed,
so on the CPU this only checks the code path: tests/trak_core/test_budget.py measures it in fresh processes).
Prints one JSON line per run and a markdown table: budget, peak, whether the peak stayed under the budget, the
batch the probe chose, rows/s.

    python3 benchmarks/budget_check.py --device cuda                       # GPT-2 small, 256 rows of 128 tokens
    PYTHONPATH=. .venv/bin/python benchmarks/budget_check.py --smoke       # CPU, a tiny GPT-2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sizes import build  # noqa: E402

from trak_core import TRAKer  # noqa: E402
from trak_core.featurize.budget import _reset_peak_rss, _status_kib, release_free_memory, used_now  # noqa: E402


def _reset(device: str) -> None:
    release_free_memory()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        _reset_peak_rss()


def _peak(device: str) -> int:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    return int(_status_kib("VmHWM") or 0)


def featurize(model, task, batch, rows: int, device: str, proj_dim: int, max_memory) -> dict:
    tr = TRAKer(
        model=model,
        task=task,
        train_set_size=rows,
        save_dir=tempfile.mkdtemp() + "/s",
        device=device,
        proj_dim=proj_dim,
        logging_level=logging.ERROR,
        max_memory=max_memory,
    )
    tr.load_checkpoint(model.state_dict(), model_id=0)
    _reset(device)
    before = used_now(device)
    t = time.perf_counter()
    tr.featurize(batch, num_samples=rows)
    tr._flush_rows()
    seconds = time.perf_counter() - t
    out = {
        "budget": max_memory,
        "before": before,
        "peak": _peak(device),
        "budget_rows": tr.featurizer.budget_rows,
        "fit": repr(tr.featurizer.memory_fit),
        "rows_per_s": round(rows / seconds, 2),
    }
    tr._close()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--proj-dim", type=int, default=2048)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.25])
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny GPT-2, 16 rows of 16 tokens")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.rows, args.seq_len, args.proj_dim, args.device = "gpt2-tiny", 16, 16, 64, "cpu"
    model, task, make_batch = build(args.model, args.seq_len, 32, args.device)
    model.to(args.device)
    batch = tuple(t.to(args.device) for t in make_batch(args.rows, 0))
    free = featurize(model, task, batch, args.rows, args.device, args.proj_dim, None)
    print(json.dumps(free), flush=True)
    runs = []
    for f in args.fractions:
        release_free_memory()
        budget = int(used_now(args.device) + f * (free["peak"] - free["before"]))  # (on the CPU: from what is held now)
        try:
            r = featurize(model, task, batch, args.rows, args.device, args.proj_dim, budget)
        except Exception as e:  # noqa: BLE001 - reported
            r = {"budget": budget, "error": f"{type(e).__name__}: {e}"[:300]}
        r["fraction"] = f
        runs.append(r)
        print(json.dumps(r), flush=True)
    where = "torch allocated" if args.device.startswith("cuda") else "resident"
    print(
        f"\n{args.model}, {args.rows} rows × {args.seq_len} tokens, proj_dim {args.proj_dim}, {args.device} ({where})\n"
    )
    print("| budget | MiB | peak MiB | under | batch chosen | rows/s |")
    print("|---|---|---|---|---|---|")
    mib = 2**20
    print(f"| none | | {free['peak'] / mib:.0f} | | {args.rows} | {free['rows_per_s']} |")
    for r in runs:
        if "error" in r:
            cells = [r["error"], "", "", ""]
        else:
            under = "yes" if r["peak"] <= r["budget"] else "NO"
            cells = [f"{r['peak'] / mib:.0f}", under, r["budget_rows"], r["rows_per_s"]]
        print(f"| used + {r['fraction']} × growth | {r['budget'] / mib:.0f} | " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main()
