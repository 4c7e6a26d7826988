"""Run the peers' own test suites against trak_core.

traker 0.3.2: its source distribution on the package registry ships its ``tests/``. This script downloads
it at run time (nothing of it is kept in this repository), adapts it to CPU programmatically and runs it
twice in separate pytest processes: once against the installed traker (``import trak``) and once against
trak_core through the ``trak`` import alias (``trak_core.compat.install_trak_alias``, installed by a
``conftest.py`` written next to the tests). It prints one row per test with both outcomes.

The CPU adaptations (all programmatic, see ``adapt_source``):

* device strings ``"cuda:0"`` / ``"cuda"`` and ``.cuda()`` become CPU;
* the JL tests' sizes are scaled down (grad_dim ÷ ``--jl-grad-scale``, proj_dim ÷ ``--jl-proj-scale``, and
  the 2³² chunk limit ÷ the same grad factor, so each case keeps its number of parameter chunks): the
  originals (up to 32 × 780M-coordinate inputs, proj_dim 15,360) need a GPU's memory;
* ``torchvision.models.resnet18`` is replaced by a ResNet-18 written here (same layers, parameter names and
  11,689,512 parameters) when torchvision is not installed;
* on the traker side, ``CudaProjector`` (fast_jl, GPU only) is replaced by traker's own CPU projector
  (``BasicProjector``), so its JL tests run there too;
* skipped, for both: tests that call fast_jl directly, download data sets / checkpoints, or import the
  ``tests/utils.py`` the sdist does not ship; skipped for traker only: the CUDA tests whose TRAKer uses the
  default projector (fast_jl on a GPU; traker's CPU fallback regenerates an 11.7M × 2048 matrix per batch).

cockpit 1.0.2 ships no tests; ``run_cockpit`` reproduces the problems of its ``test_alpha`` (toy data and
model, SGD and Adam, its two track schedules, atol = rtol = 1e-5 with type-strict comparison) and of its
issue-5 test (``MSELoss`` on ``[B, 1]`` targets), trains each once with cockpit's ``Alpha`` (the oracle,
when ``cockpit-for-pytorch`` and ``backpack-for-pytorch`` are installed) and once with ``trak_core.Alpha``,
and compares the outputs.

Usage::

    .venv/bin/python benchmarks/peer_suites.py                 # both suites, table on stdout
    .venv/bin/python benchmarks/peer_suites.py --no-cockpit --markdown table.md
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAKER_VERSION = "0.3.2"

RUN_FILES = ["test_class.py", "test_jl.py", "test_jl_additional.py"]
NOT_RUN = {  # file -> why it is not run (for both)
    "test_rademacher.py": "calls fast_jl (traker's CUDA kernels) directly",
    "test_rademacher_additional.py": "calls fast_jl (traker's CUDA kernels) directly",
    "test_parallel.py": "imports tests/utils.py (not in the sdist); downloads CIFAR-10 betons and checkpoints",
    "test_cifar2_accuracy.py": "imports tests/utils.py (not in the sdist); downloads CIFAR-2 data and checkpoints",
    "test_cifar10_accuracy.py": "imports tests/utils.py (not in the sdist); downloads CIFAR-10 and checkpoints",
    "test_integration_cifar.py": "downloads CIFAR-10 and pretrained ResNet-18 weights",
    "test_integration_clip.py": "needs open_clip, MS-COCO on disk and CUDA",
    "test_integration_qnli.py": "downloads QNLI and a BERT checkpoint (datasets, transformers)",
}
# test_class tests that build a TRAKer with the default projector on CUDA: for traker that is fast_jl
TRAKER_DEFAULT_PROJECTOR_CUDA = [
    "test_featurize",
    "test_max_batch_size",
    "test_forgot_loading_ckpt",
    "test_finalize_features",
    "test_finalize_features_multiple_ftr",
    "test_finalize_features_multiple_ftr_and_id",
    "test_score",
    "test_score_finalize",
    "test_score_finalize_some_model_ids",
    "test_score_finalize_split",
    "test_score_finalize_full_precision",
    "test_grad_wrt_last_layer_cuda",
]
# identity projection on ResNet-18 (11.7M-wide rows): a chunk of rows that wide asks for 22-45 GiB here
NOOP_RESNET = ["test_class_featurize_noop", "test_iterative_gradient_computer"]
NOOP_REASON = "not run (--skip-noop): NoOpProjector on ResNet-18 keeps 11.7M coordinates per row"

CONFTEST = """\
import json, os, pytest

SIDE = os.environ["PEER_SUITE_SIDE"]
if SIDE == "trak_core":
    import trak_core.compat
    trak_core.compat.install_trak_alias()
else:  # traker's CudaProjector needs fast_jl on a GPU: its JL tests run with traker's CPU projector instead
    import trak.projectors
    trak.projectors.CudaProjector = trak.projectors.BasicProjector

_MARKS = json.loads(os.environ.get("PEER_SUITE_MARKS", "{{}}"))


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a GPU in traker's suite (adapted to CPU here)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        base = item.name.split("[")[0]
        how = _MARKS.get(base)
        if how is None:
            continue
        kind, reason = how
        if kind == "skip":
            item.add_marker(pytest.mark.skip(reason=reason))
        elif kind == "xfail-norun":
            item.add_marker(pytest.mark.xfail(run=False, reason=reason))
        elif kind == "xfail":
            item.add_marker(pytest.mark.xfail(reason=reason, strict=False))
"""

RESNET18 = '''\
"""A ResNet-18 for traker's tests when torchvision is absent (same layers and parameter names)."""
import torch.nn as nn


class _Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        skip = x if self.downsample is None else self.downsample(x)
        return self.relu(out + skip)


class ResNet(nn.Module):
    def __init__(self, num_classes=1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths, cin = (64, 128, 256, 512), 64
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            setattr(self, f"layer{i + 1}", nn.Sequential(_Block(cin, w, stride), _Block(w, w, 1)))
            cin = w
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


def resnet18(weights=None, num_classes=1000, **kwargs):
    if weights is not None:
        raise RuntimeError("stand-in resnet18: no pretrained weights (they would be downloaded)")
    return ResNet(num_classes=num_classes)
'''


# --------------------------------------------------------------------------------------------- traker suite
def download_sdist(dest: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        f"traker=={TRAKER_VERSION}",
        "-d",
        str(dest),
        "-q",
    ]
    subprocess.run(cmd, check=True)
    (sdist,) = dest.glob(f"traker-{TRAKER_VERSION}.tar.gz")
    return sdist


def adapt_source(name: str, src: str, grad_scale: int, proj_scale: int) -> str:
    """The CPU adaptations of one of traker's test files (see the module docstring)."""
    src = src.replace('"cuda:0"', '"cpu"').replace('device="cuda"', 'device="cpu"').replace(".cuda()", ".cpu()")
    if name.startswith("test_jl"):
        # the 2**32 chunk limit scales with grad_dim, so every case keeps its number of chunks
        src = src.replace(
            "np.iinfo(np.uint32).max // batch_size", f"(np.iinfo(np.uint32).max // {grad_scale}) // batch_size"
        )

        def shape(m):  # (batch, grad_dim) tuples with a large grad_dim
            b, d = m.group(1), int(m.group(2).replace("_", ""))
            return f"({b}, {max(1, d // grad_scale)})" if d >= 100_000 else m.group(0)

        src = re.sub(r"\((\d+), (\d[\d_]*)\)", shape, src)
        src = src.replace("(1, int(1e9))", f"(1, {int(1e9) // grad_scale})")

        def proj(m):  # the "# proj dim" lists
            dims = [str(max(8, int(x.strip().replace("_", "")) // proj_scale)) for x in m.group(1).split(",")]
            return "[" + ", ".join(dims) + "],  # proj dim"

        src = re.sub(r"\[([\d_, ]+)\],\s*# proj dim", proj, src)
    return src


def write_suite(sdist: Path, dest: Path, grad_scale: int, proj_scale: int) -> Path:
    suite = dest / "suite"
    (suite / "tests").mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if len(parts) == 3 and parts[1] == "tests" and parts[2].endswith(".py"):
                text = tar.extractfile(member).read().decode()
                (suite / "tests" / parts[2]).write_text(adapt_source(parts[2], text, grad_scale, proj_scale))
    (suite / "conftest.py").write_text(CONFTEST.replace("{{}}", "{}"))
    (suite / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        (suite / "torchvision").mkdir()
        (suite / "torchvision" / "__init__.py").write_text("from . import models  # stand-in\n")
        (suite / "torchvision" / "models.py").write_text(RESNET18)
    return suite


def marks_for(side: str, run_noop: bool) -> dict:
    marks = {}
    if side == "traker":
        for t in TRAKER_DEFAULT_PROJECTOR_CUDA:
            marks[t] = (
                "skip",
                "needs CUDA: traker's default projector is fast_jl; its CPU fallback regenerates "
                "an 11.7M x 2048 matrix per batch",
            )
    elif not run_noop:  # kept for a machine too small for an 11.7M-parameter NoOpProjector run
        for t in NOOP_RESNET:
            marks[t] = ("xfail-norun", NOOP_REASON)
    return marks


def run_side(suite: Path, side: str, files: list[str], run_noop: bool, timeout: float, mem_gib: float) -> dict:
    xml = suite / f"junit-{side}.xml"
    env = dict(
        os.environ,
        PEER_SUITE_SIDE=side,
        PEER_SUITE_MARKS=json.dumps(marks_for(side, run_noop)),
        PYTHONPATH=os.pathsep.join([str(suite), str(ROOT)]),
        PYTHONDONTWRITEBYTECODE="1",
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-rN", f"--junitxml={xml}", *[f"tests/{f}" for f in files]]

    def limit():  # a runaway allocation fails the test instead of taking the machine down
        import resource

        cap = int(mem_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    t0 = time.time()
    proc = subprocess.run(
        cmd,
        cwd=suite,
        env=env,
        timeout=timeout,
        capture_output=True,
        text=True,
        preexec_fn=limit if mem_gib > 0 else None,
    )
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    print(f"[{side}] pytest exit {proc.returncode} in {time.time() - t0:.0f} s: {tail[0]}", flush=True)
    return parse_junit(xml)


def parse_junit(xml: Path) -> dict:
    out = {}
    if not xml.exists():
        return out
    for case in ET.parse(xml).getroot().iter("testcase"):
        file = case.get("classname", "").split(".")[-1]
        key = f"{file}::{case.get('name')}"
        outcome, msg = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                msg = (child.get("message") or child.text or "").strip().splitlines()[0:1]
                msg = msg[0] if msg else ""
                if child.tag == "skipped" and child.get("type") == "pytest.xfail":
                    outcome = "xfail"
        out[key] = (outcome, msg[:160])
    return out


def run_traker_suites(args) -> tuple[list, dict]:
    tmp = Path(tempfile.mkdtemp(prefix="peer_suites_"))
    sdist = download_sdist(tmp)
    suite = write_suite(sdist, tmp, args.jl_grad_scale, args.jl_proj_scale)
    files = [f for f in RUN_FILES if not args.only or any(f.startswith(o) for o in args.only)]
    results = {}
    for side in ("traker", "trak_core"):
        if args.side in (side, "both"):
            results[side] = run_side(suite, side, files, not args.skip_noop, args.timeout, args.mem_gib)
    rows = []
    keys = sorted(set().union(*[set(r) for r in results.values()]) if results else set())
    for key in keys:
        row = [key] + [results.get(s, {}).get(key, ("-", "")) for s in ("traker", "trak_core")]
        rows.append(row)
    for f, why in NOT_RUN.items():
        rows.append([f"{f} (whole file)", ("not run", why), ("not run", why)])
    print(f"suite kept in {suite}" if args.keep else "", end="")
    return rows, results


def summarize(rows) -> dict:
    counts = {"traker": {}, "trak_core": {}}
    for _, a, b in rows:
        for side, (outcome, _) in (("traker", a), ("trak_core", b)):
            counts[side][outcome] = counts[side].get(outcome, 0) + 1
    return counts


def print_table(rows, out=sys.stdout, markdown=False) -> None:
    def short(cell):
        outcome, msg = cell
        return outcome if outcome in ("passed", "-") or not msg else f"{outcome}: {msg[:90]}"

    if markdown:
        print("| test | traker 0.3.2 | trak_core |", file=out)
        print("|---|---|---|", file=out)
        for name, a, b in rows:
            print(f"| `{name}` | {short(a)} | {short(b)} |".replace("\n", " "), file=out)
    else:
        w = max(len(r[0]) for r in rows) if rows else 10
        for name, a, b in rows:
            print(f"{name:<{w}}  {short(a):<40.40}  {short(b)}", file=out)


# --------------------------------------------------------------------------------------------- cockpit
def import_cockpit():
    """cockpit 1.0.2 imports pkg_resources (gone from recent setuptools) and, for its plotter, pandas and
    seaborn; stand-ins for those let its quantities import without them."""
    import types

    try:
        import pkg_resources  # noqa: F401
    except ImportError:
        m = types.ModuleType("pkg_resources")

        class DistributionNotFound(Exception):
            pass

        def get_distribution(name):
            raise DistributionNotFound(name)

        m.DistributionNotFound, m.get_distribution = DistributionNotFound, get_distribution
        sys.modules["pkg_resources"] = m
    try:
        import pandas  # noqa: F401
        import seaborn  # noqa: F401
    except ImportError:
        sys.modules.setdefault("cockpit.plotter", types.SimpleNamespace(CockpitPlotter=None))
    from backpack import extend
    from cockpit import Cockpit
    from cockpit.quantities import Alpha

    return Cockpit, Alpha, extend


def toy_model():
    import torch.nn as nn

    return nn.Sequential(nn.Flatten(), nn.Linear(25, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))


def toy_batches(batch_size, n):
    import torch

    out = []
    for _ in range(n):
        xs, ys = [], []
        for _ in range(batch_size):  # one draw per item, as a Dataset's __getitem__ does
            xs.append(torch.rand(1, 5, 5) + 0.1)
            ys.append(torch.randint(size=(), low=0, high=3))
        out.append((torch.stack(xs), torch.stack(ys)))
    return out


def linear_batches(n_samples, d_in, d_out, n):
    import torch

    return [(torch.rand(n_samples, d_in), torch.rand(n_samples, d_out)) for _ in range(n)]


def cockpit_problems():
    """Cockpit's Alpha test problems (facts from its test settings; the data and training code are ours)."""
    import torch
    import torch.nn as nn

    ce = (lambda: nn.CrossEntropyLoss(reduction="mean"), lambda: nn.CrossEntropyLoss(reduction="none"))
    mse = (lambda: nn.MSELoss(reduction="mean"), lambda: nn.MSELoss(reduction="none"))
    sgd = lambda ps, lr=0.01: torch.optim.SGD(ps, lr=lr)  # noqa: E731
    return [
        dict(name="toy CE, SGD(lr=0.01), B=5", model=toy_model, data=lambda: toy_batches(5, 5), loss=ce, opt=sgd),
        dict(
            name="toy CE, Adam(lr=0.01), B=4",
            model=toy_model,
            data=lambda: toy_batches(4, 5),
            loss=ce,
            opt=lambda ps: torch.optim.Adam(ps, lr=0.01),
        ),
        dict(
            name="MSE on [B,1], Adam(lr=1e-3), B=2",
            model=lambda: nn.Sequential(nn.Flatten(), nn.Linear(3, 1)),
            data=lambda: linear_batches(2, 3, 1, 5),
            loss=mse,
            opt=lambda ps: torch.optim.Adam(ps, lr=1e-3),
        ),
        dict(
            name="MSE on [B,1], SGD(lr=0.01), B=4",
            model=lambda: nn.Sequential(nn.Flatten(), nn.Linear(3, 1)),
            data=lambda: linear_batches(4, 3, 1, 5),
            loss=mse,
            opt=sgd,
        ),
        dict(
            name="MSE on [B,3], Adam(lr=1e-3), B=4 (ours)",
            model=lambda: nn.Sequential(nn.Linear(3, 3)),
            data=lambda: linear_batches(4, 3, 3, 5),
            loss=mse,
            opt=lambda ps: torch.optim.Adam(ps, lr=1e-3),
        ),
    ]


SCHEDULES = {  # cockpit's test_alpha schedules: linear(interval=1, offset=2) and logarithmic(0, 1, 4, init=False)
    "linear(1, offset=2)": lambda s: s >= 2,
    "log {1,2,4,10}": lambda s: s in (1, 2, 4, 10),
}


def run_cockpit_alpha(problem, schedule, model0, batches, Cockpit, CAlpha, extend):
    m = extend(copy.deepcopy(model0))
    q = CAlpha(schedule)
    ck = Cockpit(m.parameters(), quantities=[q])
    opt = problem["opt"](m.parameters())
    loss_fn, ind_fn = extend(problem["loss"][0]()), problem["loss"][1]()
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        out = m(x)
        loss, losses = loss_fn(out, y), ind_fn(out, y)
        with ck(step, info={"batch_size": x.shape[0], "individual_losses": losses, "loss": loss, "optimizer": opt}):
            loss.backward(create_graph=ck.create_graph(step))
        opt.step()
    return q.get_output()


def run_ours_alpha(problem, schedule, model0, batches):
    import warnings

    from trak_core import Alpha

    m = copy.deepcopy(model0)
    ind_fn = problem["loss"][1]()
    a = Alpha(lambda out, y: ind_fn(out, y), track_schedule=schedule)
    opt = problem["opt"](m.parameters())
    loss_fn = problem["loss"][0]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step, (x, y) in enumerate(batches):
            opt.zero_grad()
            loss_fn(m(x), y).backward()
            a.track(step, m, x, y)
            opt.step()
    return a.get_output()


def compare_outputs(theirs: dict, ours: dict, atol=1e-5, rtol=1e-5) -> tuple[bool, str]:
    """cockpit's comparison: same keys; two floats close, two ints equal, anything else a failure."""
    if sorted(theirs) != sorted(ours):
        return False, f"steps differ: {sorted(theirs)} vs {sorted(ours)}"
    worst = 0.0
    for k in theirs:
        a, b = theirs[k], ours[k]
        if isinstance(a, float) and isinstance(b, float):
            if not math.isclose(a, b, rel_tol=rtol, abs_tol=atol) and not (math.isnan(a) and math.isnan(b)):
                return False, f"step {k}: {a!r} vs {b!r}"
            worst = max(worst, abs(a - b))
        elif isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool):
            if a != b:
                return False, f"step {k}: {a} vs {b}"
        else:
            return False, f"step {k}: types {type(a).__name__} vs {type(b).__name__} ({a!r} vs {b!r})"
    return True, f"{len(theirs)} steps, max |diff| {worst:.1e}"


def zero_step_behaviour(Cockpit, CAlpha, extend) -> list[tuple[str, str, str]]:
    """What cockpit and trak_core do for a zero step (lr = 0), with SGD and with Adam."""
    import torch

    rows = []
    for opt_name, make in (
        ("SGD(lr=0)", lambda ps: torch.optim.SGD(ps, lr=0.0)),
        ("Adam(lr=0)", lambda ps: torch.optim.Adam(ps, lr=0.0)),
    ):
        torch.manual_seed(0)
        problem = dict(
            loss=(lambda: torch.nn.CrossEntropyLoss(), lambda: torch.nn.CrossEntropyLoss(reduction="none")), opt=make
        )
        model0, batches = toy_model(), toy_batches(5, 2)
        try:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                theirs = repr(run_cockpit_alpha(problem, lambda s: s == 0, model0, batches, Cockpit, CAlpha, extend))
        except Exception as e:  # noqa: BLE001 - reporting what cockpit does
            theirs = f"raises {type(e).__name__}"
        ours = repr(run_ours_alpha(problem, lambda s: s == 0, model0, batches))
        rows.append((opt_name, theirs, ours))
    return rows


def run_cockpit(args) -> tuple[list, list]:
    import torch

    try:
        Cockpit, CAlpha, extend = import_cockpit()
    except ImportError as e:
        print(
            f"cockpit comparison skipped: {e} (pip install --no-deps cockpit-for-pytorch==1.0.2 "
            "backpack-for-pytorch einops unfoldnd json-tricks)"
        )
        return [], []
    import warnings

    rows = []
    for problem in cockpit_problems():
        for sname, schedule in SCHEDULES.items():
            torch.manual_seed(0)
            model0 = problem["model"]()
            batches = problem["data"]()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                theirs = run_cockpit_alpha(problem, schedule, model0, batches, Cockpit, CAlpha, extend)
            ours = run_ours_alpha(problem, schedule, model0, batches)
            ok, note = compare_outputs(theirs, ours)
            rows.append((problem["name"], sname, ok, note))
    return rows, zero_step_behaviour(Cockpit, CAlpha, extend)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", choices=["both", "traker", "trak_core"], default="both")
    ap.add_argument("--only", nargs="*", help="test file prefixes to run (e.g. test_class)")
    ap.add_argument("--jl-grad-scale", type=int, default=10_000)
    ap.add_argument("--jl-proj-scale", type=int, default=10)
    ap.add_argument("--skip-noop", action="store_true", help="skip the NoOpProjector-on-ResNet-18 tests")
    ap.add_argument("--mem-gib", type=float, default=12.0, help="address-space cap per pytest process (0: none)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--no-traker", action="store_true")
    ap.add_argument("--no-cockpit", action="store_true")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--markdown", help="also write the tables as markdown to this file")
    args = ap.parse_args(argv)

    md = open(args.markdown, "w") if args.markdown else None
    with contextlib.ExitStack() as stack:
        if md:
            stack.enter_context(md)
        if not args.no_traker:
            rows, _ = run_traker_suites(args)
            print_table(rows)
            counts = summarize(rows)
            print(json.dumps(counts))
            if md:
                print_table(rows, md, markdown=True)
                print(f"\ncounts: {json.dumps(counts)}\n", file=md)
        if not args.no_cockpit:
            crow, zrows = run_cockpit(args)
            for name, sched, ok, note in crow:
                print(f"cockpit Alpha | {name} | {sched} | {'pass' if ok else 'FAIL'} | {note}")
            for opt, theirs, ours in zrows:
                print(f"zero step | {opt} | cockpit: {theirs} | trak_core: {ours}")
            if crow:
                print(f"cockpit problems: {sum(r[2] for r in crow)}/{len(crow)} pass")
            if md and crow:
                print("| problem | schedule | trak_core.Alpha vs cockpit | note |\n|---|---|---|---|", file=md)
                for name, sched, ok, note in crow:
                    print(f"| {name} | {sched} | {'pass' if ok else 'FAIL'} | {note} |", file=md)
                for opt, theirs, ours in zrows:
                    print(f"\nzero step, {opt}: cockpit {theirs}; trak_core {ours}", file=md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
