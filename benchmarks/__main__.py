"""The benchmarks behind RESULTS.md, one entry point: each case is declared once, here, with the section of
RESULTS.md its tables fill, what it measures, what it is measured against in the same run, and its commands.

    python -m benchmarks list                 # every case
    python -m benchmarks show featurize       # its commands, as RESULTS.md gives them
    python -m benchmarks run featurize        # run them (from the repository root; `python` is this interpreter)

The commands are bash lines run in order in the repository root (`python` = this interpreter, the repository on
PYTHONPATH). RESULTS.md quotes them verbatim in the case's section (tests/benchmarks/test_harness.py checks it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Case:
    name: str
    section: str  # the '## ' heading of RESULTS.md whose tables this case regenerates
    measures: str
    against: str  # the floor and the peer, measured in the same run
    commands: tuple[str, ...]
    device: str = "cpu"  # "cuda": run on a GPU machine (benchmarks/gpu_session.sh runs its checks there)


# the 93 damping settings of the LDS grid ($S in the LDS commands)
LDS_SETTINGS = (
    'S="0 rel:0.01 rel:0.03 rel:0.1 rel:0.3 rel:1 rel:3 rel:10 rel:30 rel:100 rel:300 rel:1000 '
    'deff:0.02 deff:0.03 deff:0.05 deff:0.1 deff:0.2 deff:0.3 deff:0.5 resid:1 resid:3 resid:10 resid:30"',
    'for c in 0.05 0.1 0.2; do for k in 1 3 10 30; do S="$S deff:$c,resid:$k"; done; done',
    'for c in 0.05 0.1; do for f in 1 3 10; do S="$S deff:$c,rel:$f"; done; done',
    "for c in deff:0.08 deff:0.085 deff:0.09 deff:0.1 neff:0.1 neff:0.12 neff:0.15; do for k in 2 3 4 5; do "
    'S="$S $c,cresid:$k"; done; done',
    'for c in 0.08 0.1 0.12 0.15 0.2; do for k in 2 2.5 3; do S="$S neff:$c,resid:$k"; done; done',
    'S="$S neff:0.12,cresid:7 neff:0.12,cresid:10 neff:0.1,cresid:10 neff:0.15,cresid:10 deff:0.08,cresid:10 '
    'deff:0.09,cresid:10 deff:0.1,cresid:10 neff:0.12,cresid:20 neff:0.12,uresid:10/0.3"',
)
U = "neff:0.12,cresid:10 " + " ".join(f"neff:0.12,uresid:10/{r}" for r in (0.1, 0.2, 0.3, 0.5))  # the unfit share
DIMS = "--proj-dims 128 256 512 1024 2048"
LARGE = "--cases wide-mlp bn-conv small-lm"
J = ".cache/lds/"
SMALL = "digits-mlp digits-conv text cancer wine digits-sgd conv-sgd cancer-sgd wine-sgd"
ELEVEN = f"--cases wide-mlp bn-conv {SMALL}"  # the eleven cases with cached truth

CASES = (
    Case(
        "lds",
        "Attribution quality (LDS) against traker 0.3.2",
        "LDS of trakflow's projectors and damping rules on 9 small cases (3 checkpoints, 100 half-subset models)",
        "traker 0.3.2 itself on the same checkpoints; exact gradients (noop)",
        (
            *LDS_SETTINGS,
            "python benchmarks/quality.py truth",
            f"python benchmarks/quality.py eval --kinds dense {DIMS} --settings $S --json {J}grid-dense.json",
            f"python benchmarks/quality.py eval --kinds noop --settings $S --json {J}grid-noop.json",
            f"python benchmarks/quality.py eval --kinds factored {DIMS} --settings 0 neff:0.12,uresid:10/0.3 "
            f"--json {J}grid-factored.json",
            f"python benchmarks/quality.py traker --proj-dims 2048 256 1024 --json {J}traker.json",
            f"python benchmarks/quality.py report --json {J}grid-dense.json,{J}grid-noop.json,{J}grid-factored.json,"
            f"{J}traker.json {DIMS}",
        ),
    ),
    Case(
        "lds-large",
        "Attribution quality at realistic compression",
        "LDS of the default projector at 143–3,358× compression (two 300–430k-parameter nets, a small GPT-2)",
        "dense projection at the same proj_dim and damping",
        (
            *LDS_SETTINGS,
            f"python benchmarks/quality.py truth {LARGE}",
            f"python benchmarks/quality.py eval {LARGE} --kinds dense {DIMS} --settings $S --json {J}loco-large.json",
            f"python benchmarks/quality.py eval {LARGE} --kinds factored {DIMS} --settings neff:0.12,uresid:10/0.3 "
            f"--json {J}large-factored.json",
            f"python benchmarks/quality.py splits --cases small-lm wide-mlp bn-conv {DIMS}",
            f"python benchmarks/quality.py eval {ELEVEN} --kinds factored {DIMS} --settings {U} --json {J}unfit.json",
            f"python benchmarks/quality.py loco --json {J}unfit.json --kinds factored {DIMS} {ELEVEN}",
        ),
    ),
    Case(
        "curvature",
        "Gauss-Newton curvature",
        "LDS with curvature='ggn' (XᵀRX) against XᵀX on the 9 small cases",
        "XᵀX at the same λ rule; traker 0.3.2",
        (
            f"python benchmarks/curvature.py --kinds dense factored {DIMS} --json {J}curvature.json",
            f"python benchmarks/curvature.py --kinds noop --cases digits-mlp digits-conv --json {J}curvature-noop.json",
        ),
    ),
    Case(
        "peers",
        "Beside kronfluence: LDS, time and memory in one run",
        "LDS, wall time and peak RSS of trakflow's defaults and its Kronecker-factored curvatures at 143–840× "
        "compression (wide-mlp, bn-conv, small-lm; 100 half-subset models)",
        "kronfluence 1.0.1 K-FAC and EK-FAC (heuristic damping), traker 0.3.2; same checkpoints, targets, truth",
        (
            f"python benchmarks/quality.py truth {LARGE}",
            f"python benchmarks/peers.py {LARGE} --proj-dims 512 2048 --json {J}peers.json",
            'python benchmarks/peers.py --cases small-lm --columns "kronfluence identity" "kronfluence diagonal"',
            "python benchmarks/quality.py truth",
            f"python benchmarks/peers.py --cases {SMALL} --proj-dims 512 2048 --json {J}peers-small.json",
            f"python benchmarks/peers.py --cases {SMALL} --proj-dims 512 --cached --summary",
        ),
    ),
    Case(
        "parity",
        "Agreement with traker 0.3.2",
        "scores against traker 0.3.2's on the recipes of tests/compat/test_traker_parity.py",
        "traker 0.3.2",
        ("python benchmarks/parity_table.py",),
    ),
    Case(
        "featurize",
        "Speed against the floor and traker",
        "featurize + finalize of a 400k-parameter MLP, cold and warm, through TRAKer and the pipeline's tasks",
        "the floor (a training pass + finalize's float32 linear algebra); traker 0.3.2, default and fastest",
        (
            "python benchmarks/featurize_bench.py --models mlp400k --impls floor traker traker-fastest factored "
            "pipeline --repeats 2 --warm-runs 2",
        ),
    ),
    Case(
        "matrix",
        "Speed against the floor and traker",
        "featurize + finalize of every model family of bench_models.py (MLPs, conv net, ResNet-18, transformers)",
        "the floor; traker 0.3.2's fastest CPU configuration where its matrix fits in 4 GiB",
        (
            "python benchmarks/matrix.py --proj-dims 2048 --warm-runs 2 --repeats 3",
            "python benchmarks/matrix.py --models mlp3w --proj-dims 2048 --threads 1 --stat median --repeats 5 "
            "--warm-runs 1 --traker-max-gib 0",
            "python benchmarks/matrix.py --proj-dims 512 2048 --curvatures xtx kfac kfac-eigen --repeats 2 "
            "--warm-runs 2 --json .cache/curvature-cost.json",
        ),
    ),
    Case(
        "scoring",
        "Scoring against the matmul peak",
        "streaming scoring X (A Gᵀ) from a 65,536-row float16 store; finalize; bytes stored",
        "the machine's float32 matmul peak and the same GEMM with X in memory; float64 scores",
        ("python benchmarks/scoring_bench.py --n 65536 --targets 256 1024 4096 --repeats 2",),
    ),
    Case(
        "memory",
        "Memory flat in n",
        "peak RSS of featurize, finalize and score at n = 50,000 and 200,000",
        "the same phases at a quarter of the rows",
        (
            "python benchmarks/memory_flat.py --sizes 50000 200000 --proj-dim 512",
            "MALLOC_MMAP_THRESHOLD_=1048576 python benchmarks/memory_flat.py --sizes 50000 200000 --proj-dim 512",
        ),
    ),
    Case(
        "mixed-precision",
        "Mixed precision",
        "scores of an MLP and a 2-layer GPT-2 run in bfloat16 / float16 / float32, CPU",
        "the same model in float64",
        ("python benchmarks/mixed_precision.py",),
    ),
    Case(
        "host-path",
        "Host path: featurize without the model's arithmetic",
        "µs per row of the write paths (TRAKer, write-behind, the pipeline's shard task) given X and Q",
        "the floor: the same bytes written to new files",
        (
            "python benchmarks/host_path.py --n 65536 --threads 1 --repeats 3 --paths traker traker-behind shard "
            "floor --batches 2048",
        ),
    ),
    Case(
        "query",
        "Queries: top-k from a finished store",
        "TrakIndex.query latency (p50, p95) and extra RSS at 100,000 and 1,281,167 rows",
        "one read of the rows + the fastest GEMM",
        (
            "python benchmarks/query_bench.py --dir /tmp/qb --repeats 7",
            "python benchmarks/query_bench.py --dir /tmp/qb --imagenet --repeats 3",
        ),
    ),
    Case(
        "sizes",
        "Model sizes users run",
        "TRAKer featurize rows/s and peak RSS on ResNet-18 and GPT-2 small (CPU)",
        "a training pass over the same rows",
        (
            "python benchmarks/sizes.py --models resnet18 --rows 256 --batch 16",
            "python benchmarks/sizes.py --models gpt2 --rows 256 --seq-len 32 --batch 16 --what train featurize",
        ),
    ),
    Case(
        "gpu-session",
        "GPU session: large models, the conv net, the host path and a budget (H200)",
        "one call on a lent GPU: GPT-2 124M and a ~1B model featurized (rows/s, peak GPU memory), the conv net, the "
        "host path, max_memory against its measured peak, the CUDA tests",
        "a training step of the same batches; traker 0.3.2 (BasicSingleBlockProjector, fast_jl); the floor",
        ("OUT=/tmp/gs bash benchmarks/gpu_session.sh",),
        device="cuda",
    ),
    Case(
        "sizes-cuda",
        "Model sizes users run",
        "the same on a GPU",
        "a training pass; traker 0.3.2 with fast_jl",
        ("python3 benchmarks/sizes.py --device cuda --models resnet18 gpt2 --rows 256 --batch 32 --passes 2",),
        device="cuda",
    ),
)
BY_NAME = {c.name: c for c in CASES}


def script(commands: tuple[str, ...]) -> str:
    """The bash script that runs the commands in order, stopping at the first that fails."""
    return "set -e\n" + "\n".join(commands) + "\n"


def run(case: Case) -> int:
    """Run the case's commands in the repository root; `python` and `python3` are this interpreter."""
    os.makedirs(os.path.join(ROOT, ".cache", "lds"), exist_ok=True)
    with tempfile.TemporaryDirectory() as bin_dir:
        for name in ("python", "python3"):  # a wrapper, not a symlink: a venv is found from the path it is run as
            with open(os.path.join(bin_dir, name), "w") as fh:
                fh.write(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
            os.chmod(os.path.join(bin_dir, name), 0o755)
        path = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "PYTHONPATH": path}
        return subprocess.run(["bash", "-c", script(case.commands)], cwd=ROOT, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    sub.add_parser("list", help="every case: name, device, RESULTS.md section, what it measures")
    for verb in ("show", "run"):
        p = sub.add_parser(verb, help="print the case's commands" if verb == "show" else "run the case's commands")
        p.add_argument("case", choices=list(BY_NAME))
    a = ap.parse_args(argv)
    if a.what == "list":
        for c in CASES:
            print(f"{c.name:15} {c.device:5} [{c.section}] {c.measures}; against {c.against}")
        return 0
    case = BY_NAME[a.case]
    if a.what == "show":
        print(script(case.commands), end="")
        return 0
    return run(case)


if __name__ == "__main__":
    sys.exit(main())
