"""Scores of a model run in bfloat16 / float16 / float32 against the same model in float64, CPU or GPU (RESULTS.md,
"Mixed precision"; docs/scaleout.md explains the dtypes' paths).

Each run: TRAKer featurizes, finalizes and scores with the model and its inputs in one dtype. ``fixed`` runs share
one projection (the factored projector's equal split); ``default`` runs take TRAKer's default, whose split is probed
in the run's own dtype. Reported per dtype: the Pearson correlation of each target's score column with float64's
(min and mean over the targets) and the largest score difference relative to float64's largest |score|.

    .venv/bin/python benchmarks/mixed_precision.py                 # MLP and a 2-layer GPT-2, CPU
    .venv/bin/python benchmarks/mixed_precision.py --smoke         # tiny sizes: every code path
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import warnings

import numpy as np
import torch

from trak_core import TRAKer
from trak_core.featurize.gradients import grad_dim_of
from trak_core.projection.projectors import make_projector

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build(name: str, n: int, m: int, seq: int):
    """(model factory, task, train batch, target batch), inputs as float32 / token ids."""
    g = torch.Generator().manual_seed(0)
    if name == "mlp":

        def make():
            torch.manual_seed(0)
            return torch.nn.Sequential(
                torch.nn.Linear(32, 256),
                torch.nn.GELU(),
                torch.nn.Linear(256, 256),
                torch.nn.GELU(),
                torch.nn.Linear(256, 10),
            )

        data = (torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
        targets = (torch.randn(m, 32, generator=g), torch.randint(0, 10, (m,), generator=g))
        return make, "image_classification", data, targets
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4)

    def make():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(cfg).eval()

    def rows(k):
        ids = torch.randint(0, 512, (k, seq), generator=g)
        labels = ids.clone()
        labels[:, 0] = -100
        return ids, torch.ones_like(ids), labels

    return make, "causal_lm", rows(n), rows(m)


def run(make, task, data, targets, dtype, device, proj_dim, projector: str) -> np.ndarray:
    model = make().to(device=device, dtype=dtype)
    n, m = data[0].shape[0], targets[0].shape[0]
    proj = None
    if projector == "fixed":
        proj = make_projector("factored", grad_dim_of(model), proj_dim, 0, "rademacher", device=device, model=model)

    def cast(batch):
        return tuple(t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device) for t in batch)

    tr = TRAKer(
        model=model,
        task=task,
        train_set_size=n,
        save_dir=tempfile.mkdtemp() + "/s",
        device=device,
        proj_dim=proj_dim,
        projector=proj,
        use_half_precision=False,
        lambda_reg=1e-2,
        logging_level=logging.ERROR,
    )
    before = {k: (p.dtype, p.data_ptr()) for k, p in model.named_parameters()}
    tr.load_checkpoint(model.state_dict(), model_id=0)
    for a in range(0, n, 32):
        tr.featurize(cast([t[a : a + 32] for t in data]), num_samples=min(32, n - a))
    assert all(p.dtype == dtype for p in model.parameters()), "featurize changed the model's dtype"
    assert {k: (p.dtype, p.data_ptr()) for k, p in model.named_parameters()} == before
    tr.finalize_features()
    tr.start_scoring_checkpoint("e", model.state_dict(), 0, m)
    tr.score(cast(targets), num_samples=m)
    return np.asarray(tr.finalize_scores("e"), dtype=np.float64)


def compare(s: np.ndarray, ref: np.ndarray) -> dict:
    corr = [float(np.corrcoef(s[:, j], ref[:, j])[0, 1]) for j in range(ref.shape[1])]
    return {
        "min_corr": round(min(corr), 6),
        "mean_corr": round(float(np.mean(corr)), 6),
        "rel_err": float(f"{np.abs(s - ref).max() / np.abs(ref).max():.3g}"),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["mlp", "gpt2-tiny"])
    ap.add_argument("--n", type=int, default=512, help="train rows")
    ap.add_argument("--m", type=int, default=16, help="targets")
    ap.add_argument("--seq", type=int, default=16, help="tokens per row of the GPT-2")
    ap.add_argument("--proj-dim", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    ap.add_argument("--projectors", nargs="+", default=["fixed", "default"])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.n, args.m, args.seq, args.proj_dim = 64, 4, 8, 32
    warnings.filterwarnings("ignore")
    rows = []
    for name in args.models:
        make, task, data, targets = build(name, args.n, args.m, args.seq)
        for projector in args.projectors:
            ref = run(make, task, data, targets, torch.float64, args.device, args.proj_dim, projector)
            for dt in args.dtypes:
                row = {"model": name, "projector": projector, "dtype": dt}
                try:
                    s = run(make, task, data, targets, DTYPES[dt], args.device, args.proj_dim, projector)
                    row.update(compare(s, ref))
                except Exception as e:  # noqa: BLE001 - a dtype an op does not support is reported, not fatal
                    row["error"] = f"{type(e).__name__}: {e}"[:200]
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{args.device}, n={args.n}, m={args.m}, proj_dim={args.proj_dim}; against float64 (same projector kind)\n")
    print("| model | projector | dtype | min corr | mean corr | max rel. error |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        vals = f"not run: {r['error']} | |" if "error" in r else f"{r['min_corr']} | {r['mean_corr']} | {r['rel_err']}"
        print(f"| {r['model']} | {r['projector']} | {r['dtype']} | {vals} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
