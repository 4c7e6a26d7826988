"""Featurize at the sizes users run (RESULTS.md, "Model sizes users run"): a ResNet-18-shaped net (11.7M
parameters) and a GPT-2-small-shaped model (124M, transformers' GPT2LMHeadModel), random init, TRAKer's defaults.

Each measurement runs in a fresh subprocess (its peak RSS is its own): TRAKer featurize of ``--rows`` rows in
batches of ``--batch``; a training pass over the same batches (the floor); traker 0.3.2's fastest CPU configuration
where its grad_dim × proj_dim matrix fits in half the machine's memory. Prints one JSON line per measurement and a
markdown table (rows/s, × the training pass, peak RSS).

    .venv/bin/python benchmarks/sizes.py                                  # both models, 256 rows
    python3 benchmarks/sizes.py --device cuda --models gpt2 gpt2-1b --rows 128 --batch 16 --what train featurize
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess

import psutil
from common import fresh_json, md_table

CODE = r"""
import json, logging, resource, sys, tempfile, time, warnings
import torch
warnings.filterwarnings("ignore")
sys.path[:0] = [sys.argv[1] + "/benchmarks", sys.argv[1]]
from sizes import build
what, model_name, rows, batch, seq_len, image_size, proj_dim = sys.argv[2], sys.argv[3], *map(int, sys.argv[4:9])
device, passes = sys.argv[9], int(sys.argv[10])
model, task, make_batch = build(model_name, seq_len, image_size, device)
model.to(device)
params = sum(p.numel() for p in model.parameters())
batches = [tuple(v.to(device) for v in make_batch(min(batch, rows - a), a)) for a in range(0, rows, batch)]
sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def measure():
    t = time.perf_counter()
    if what == "featurize":
        from trak_core import TRAKer
        tr = TRAKer(model=model, task=task, train_set_size=rows, save_dir=tempfile.mkdtemp() + "/s", device=device,
                    proj_dim=proj_dim, logging_level=logging.ERROR)
        tr.load_checkpoint(model.state_dict(), model_id=0)
        t = time.perf_counter()
        for b in batches:
            tr.featurize(b, num_samples=b[0].shape[0])
        tr._flush_rows()
    elif what == "train":
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for b in batches:
            if model_name.startswith("gpt2"):
                loss = model(input_ids=b[0], attention_mask=b[1], labels=b[2]).loss
            else:
                loss = torch.nn.functional.cross_entropy(model(b[0]), b[1])
            opt.zero_grad()
            loss.backward()
            opt.step()
    elif what == "traker":
        from trak import TRAKer as Ref
        from trak.projectors import BasicSingleBlockProjector, CudaProjector, ProjectionType
        if device.startswith("cuda"):  # traker's GPU default: fast_jl's kernel
            proj = CudaProjector(params, proj_dim, 0, ProjectionType.rademacher, device, 32)
        else:
            proj = BasicSingleBlockProjector(grad_dim=params, proj_dim=proj_dim, seed=0,
                                             proj_type=ProjectionType.rademacher, device="cpu", dtype=torch.float32)
        tr = Ref(model=model, task=task, train_set_size=rows, save_dir=tempfile.mkdtemp() + "/s", device=device,
                 projector=proj, proj_dim=proj_dim, use_half_precision=False, logging_level=logging.ERROR)
        tr.load_checkpoint(model.state_dict(), model_id=0)
        t = time.perf_counter()
        for b in batches:
            tr.featurize(b, num_samples=b[0].shape[0])
    sync()
    return time.perf_counter() - t


for _ in range(passes):  # the last pass is reported (GPU: the first one pays cuDNN's and the allocator's set-up)
    seconds = measure()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
gpu = torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else 0
print(json.dumps({"model": model_name, "what": what, "params": params, "rows": rows, "batch": batch,
                  "seq_len": seq_len, "image_size": image_size, "proj_dim": proj_dim, "seconds": round(seconds, 2),
                  "rows_per_s": round(rows / seconds, 3), "peak_rss_mib": round(peak / 1024),
                  "rss_before_mib": round(base / 1024), "device": device, "gpu_peak_mib": round(gpu)}))
"""


#: GPT-2-shaped configurations built from transformers' GPT2Config (random init; nothing is downloaded): GPT-2 small
#: (124M), a ~1B one (d 2048, 18 layers: 1.01B) and a tiny one for smoke runs
GPT2_SHAPES = {
    "gpt2": {},
    "gpt2-1b": {"n_embd": 2048, "n_layer": 18, "n_head": 16},
    "gpt2-tiny": {"n_embd": 64, "n_layer": 2, "n_head": 4},
}


def build(name: str, seq_len: int, image_size: int, device: str = "cpu"):
    """(model in eval mode, task name, make_batch(size, offset) → a batch of random rows); a GPT-2 shape is
    initialized on ``device`` (a 1B model's random init on the host takes longer than its measurement)."""
    import torch

    torch.manual_seed(0)
    if name == "resnet18":
        from bench_models import ResNet18

        model = ResNet18(1000, imagenet=True).eval()

        def make_batch(b, a):
            g = torch.Generator().manual_seed(a)
            return torch.randn(b, 3, image_size, image_size, generator=g), torch.randint(0, 1000, (b,), generator=g)

        return model, "image_classification", make_batch
    if name in GPT2_SHAPES:
        import transformers

        transformers.logging.set_verbosity_error()
        with torch.device(device):
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2_SHAPES[name])).eval()

        def make_batch(b, a):
            g = torch.Generator().manual_seed(a)
            ids = torch.randint(0, 50257, (b, seq_len), generator=g)
            labels = ids.clone()
            labels[:, 0] = -100
            return ids, torch.ones_like(ids), labels

        return model, "causal_lm", make_batch
    raise ValueError(f"unknown model {name!r}")


def run(what: str, model: str, args) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = ["-c", CODE, root, what, model]
    argv += [str(v) for v in (args.rows, args.batch, args.seq_len, args.image_size, args.proj_dim)]
    try:
        return fresh_json([*argv, args.device, str(args.passes)], timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"model": model, "what": what, "error": f"over the {args.timeout} s limit"}
    except RuntimeError as e:
        return {"model": model, "what": what, "error": str(e).strip().splitlines()[-1:]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["resnet18", "gpt2"])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128, help="GPT-2 tokens per row")
    ap.add_argument("--image-size", type=int, default=32, help="ResNet-18 input side (3 × side × side)")
    ap.add_argument("--proj-dim", type=int, default=2048)
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per measurement")
    ap.add_argument("--device", default="cpu", help="cuda: model, batches and TRAKer on the GPU")
    ap.add_argument("--passes", type=int, default=1, help="passes per measurement, the last one reported")
    whats = ["train", "featurize", "traker"]
    ap.add_argument("--what", nargs="+", default=whats, choices=whats)
    args = ap.parse_args(argv)
    results = []
    for model in args.models:
        for what in args.what:
            params = next((r["params"] for r in results if r["model"] == model and "params" in r), 0)
            need = params * args.proj_dim * 4  # traker's matrix on the CPU
            if what == "traker" and model.startswith("gpt2"):
                results.append({"model": model, "what": what, "error": "traker 0.3.2 has no causal-LM task"})
            elif what == "traker" and need > psutil.virtual_memory().total / 2 and args.device == "cpu":
                results.append({"model": model, "what": what, "error": f"needs a {need / 2**30:.0f} GiB matrix"})
            else:
                results.append(run(what, model, args))
            print(json.dumps(results[-1]), flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    rows = []
    for model in args.models:
        rs = {r["what"]: r for r in results if r["model"] == model}
        floor = rs.get("train", {}).get("rows_per_s")
        for what, r in rs.items():
            if "error" in r:
                rows.append([model, "", what, f"not run: {r['error']}", "", "", ""])
                continue
            ratio = f"{r['rows_per_s'] / floor:.3f}" if floor else ""
            params = f"{r['params'] / 1e6:.1f}M"
            rows.append([model, params, what, r["rows_per_s"], ratio, r["peak_rss_mib"], r.get("gpu_peak_mib", 0)])
    head = ["model", "params", "measurement", "rows/s", "× training pass", "peak RSS MiB", "peak GPU MiB"]
    print(md_table(head, rows))


if __name__ == "__main__":
    main()
