"""Models trained two at a time: each with its share of the cores (what the train and evaluate flows' tasks do,
``tasks.common.threads_per_task``) against torch's default of all the cores each (before).

Trains ``--models`` models of the digits recipe (examples/digits_train.yaml, ``--epochs`` epochs, half the rows)
in a pool of ``--slots`` threads, in fresh processes alternating the two settings, and prints wall and CPU
seconds per setting (best of ``--repeats``) and the largest weight difference between them.

    .venv/bin/python benchmarks/train_threads_bench.py --model examples.digits_conv --models 6 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def child(module: str, models: int, slots: int, epochs: int, share: bool, out: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    import torch
    import yaml

    from tasks.common import threads_per_task, torch_threads
    from tasks.config import TrainConfig
    from tasks.trainer import load_data, train_on_rows

    with open(os.path.join(ROOT, "examples", "digits_train.yaml")) as fh:
        recipe = yaml.safe_load(fh)
    recipe.update(
        model=f"{module}:make_model",
        train_data=f"{module}:train_data",
        out_dir=tempfile.mkdtemp(),
        alpha_every=0,
        epochs=epochs,
        max_workers=slots,
    )
    config = TrainConfig.model_validate(recipe)
    data = load_data(config.train_data, "train_data")
    rows = np.arange(0, data[1].shape[0], 2)
    threads = threads_per_task(config, models) if share else None

    def one(seed: int) -> list:
        with torch_threads(threads):
            model = train_on_rows(config, seed, rows, data)
        return [p.detach().clone() for p in model.parameters()]

    t, c = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(slots) as pool:
        weights = list(pool.map(one, range(models)))
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    torch.save(weights, out + ".pt")
    with open(out, "w") as fh:
        json.dump({"wall": wall, "cpu": cpu, "threads": threads or torch.get_num_threads()}, fh)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="examples.digits_conv", help="module with make_model and train_data")
    ap.add_argument("--models", type=int, default=6)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.model, a.models, a.slots, a.epochs, a.child.startswith("share"), a.child.split(":", 1)[1])
        return
    import torch

    res: dict[str, list] = {"share": [], "default": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.repeats):
            for kind in ("default", "share"):
                out = os.path.join(tmp, f"{kind}{r}.json")
                args = [f"--model={a.model}", f"--models={a.models}", f"--slots={a.slots}", f"--epochs={a.epochs}"]
                subprocess.run([sys.executable, __file__, *args, f"--child={kind}:{out}"], check=True)
                with open(out) as fh:
                    res[kind].append(json.load(fh))
        w_share = torch.load(os.path.join(tmp, "share0.json.pt"))
        w_default = torch.load(os.path.join(tmp, "default0.json.pt"))
    diff = max(float((x - y).abs().max()) for m1, m2 in zip(w_share, w_default) for x, y in zip(m1, m2))
    print(
        f"`.venv/bin/python benchmarks/train_threads_bench.py --model {a.model} --models {a.models} "
        f"--slots {a.slots} --epochs {a.epochs} --repeats {a.repeats}`"
    )
    print()
    print("| threads per model | wall s (best, all runs) | CPU s (best) |")
    print("|---|---|---|")
    for kind in ("default", "share"):
        walls = sorted(x["wall"] for x in res[kind])
        label = f"{res[kind][0]['threads']} ({'its share' if kind == 'share' else 'torch default'})"
        runs = ", ".join(f"{w:.2f}" for w in walls)
        print(f"| {label} | {walls[0]:.2f} ({runs}) | {min(x['cpu'] for x in res[kind]):.2f} |")
    print()
    print(f"largest weight difference between the two settings: {diff:.1e}")


if __name__ == "__main__":
    main()
