"""Peak memory of α tracking: our JVP path vs a cockpit-like per-sample-gradient path.

Both paths track α at every step while training a ~410k-parameter MLP (784-448-128-10,
float32) with Adam on batches of 128 random examples.

* ``jvp``      — :class:`trak_core.alpha.Alpha`: keeps θ_k and batch k; one forward-mode
  JVP per point gives the B directional derivatives.
* ``cockpit``  — what cockpit does for optimizers other than plain SGD: per-sample
  gradients (here ``torch.func.vmap(grad)``, cockpit uses BackPACK) are materialised at
  every tracked step and kept until the next step, where they are projected on the update.
* ``none``     — the same training loop without tracking (reference).

Each mode runs in its own subprocess.  Reported per mode:

* ``peak_rss_mb`` — peak resident set size during the tracked steps minus the resident
  size just before them (the peak is reset via ``/proc/self/clear_refs`` after warm-up;
  falls back to ``ru_maxrss`` without that).
* ``probe_peak_mb`` — peak bytes of live tensors allocated inside one tracking call, from
  a ``TorchDispatchMode`` probe (allocator-independent; ``none``: n/a).
* ``held_mb`` — tensor bytes the tracker keeps between two steps.
* ``ms_per_step`` — median wall time of one tracking call (2 CPU threads).

Run:  ``.venv/bin/python benchmarks/alpha_memory.py``  (about 20-40 s on 2 cores).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCH, D_IN, HIDDEN, D_OUT, N_STEPS = 128, 784, (448, 128), 10, 6


# ----------------------------------------------------------------------------- helpers
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes(use_hwm: bool) -> int:
    if use_hwm:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def make_probe():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class AllocationProbe(TorchDispatchMode):
        """Peak bytes of live storages allocated while active."""

        def __init__(self):
            super().__init__()
            self.live, self.current, self.peak = {}, 0, 0

        @staticmethod
        def _ptr(t):
            try:
                return t.untyped_storage().data_ptr()
            except RuntimeError:
                return None

        def _release(self, ptr):
            entry = self.live.get(ptr)
            if entry is not None:
                entry[1] -= 1
                if entry[1] == 0:
                    self.current -= entry[0]
                    del self.live[ptr]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            existing = {self._ptr(a) for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
            out = func(*args, **kwargs)
            for t in tree_leaves(out):
                if not isinstance(t, torch.Tensor):
                    continue
                ptr = self._ptr(t)
                if not ptr:
                    continue
                if ptr in self.live:
                    self.live[ptr][1] += 1
                elif ptr in existing:
                    continue
                else:
                    nbytes = t.untyped_storage().nbytes()
                    self.live[ptr] = [nbytes, 1]
                    self.current += nbytes
                    self.peak = max(self.peak, self.current)
                weakref.finalize(t, self._release, ptr)
            return out

    return AllocationProbe


def held_bytes(obj, seen=None) -> int:
    import torch

    seen = {} if seen is None else seen
    if isinstance(obj, torch.Tensor):
        seen[id(obj)] = obj.numel() * obj.element_size()
    elif isinstance(obj, dict):
        for v in obj.values():
            held_bytes(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            held_bytes(v, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)) and not callable(obj):
        for v in vars(obj).values():
            held_bytes(v, seen)
    return sum(seen.values())


class CockpitLikeAlpha:
    """cockpit's non-SGD path: keep θ_k and the per-sample gradients of batch k."""

    def __init__(self, loss_fn):
        self.loss_fn = loss_fn
        self.output = {}
        self._start = None  # (step, params, per-sample grads, per-sample losses)

    def _per_sample(self, model, x, y):
        import torch
        from torch.func import functional_call, grad, vmap

        params = {n: p.detach() for n, p in model.named_parameters()}

        def one(p, xi, yi):
            loss = self.loss_fn(functional_call(model, p, (xi[None],)), yi[None])[0]
            return loss, loss

        with torch.no_grad():
            grads, losses = vmap(grad(one, has_aux=True), in_dims=(None, 0, 0))(params, x, y)
        return grads, losses

    def track(self, step, model, x, y):
        from trak_core.alpha import fit_alpha

        grads, losses = self._per_sample(model, x, y)
        if self._start is not None and self._start[0] == step - 1:
            k, theta, grads0, losses0 = self._start
            self._start = None
            d = {n: p.detach() - theta[n] for n, p in model.named_parameters()}
            t = float(sum((v.double() ** 2).sum() for v in d.values()).sqrt())
            proj = []
            for g in (grads0, grads):
                dots = sum((g[n].flatten(1) @ d[n].flatten()) for n in d)
                proj.append(dots.double() / t)
            l0, l1 = losses0.double(), losses.double()
            self.output[k] = fit_alpha(
                t,
                float(l0.mean()),
                float(l1.mean()),
                float(proj[0].mean()),
                float(proj[1].mean()),
                float(l0.var()),
                float(l1.var()),
                float(proj[0].var()),
                float(proj[1].var()),
            )
            del grads0, d, proj
        theta = {n: p.detach().clone() for n, p in model.named_parameters()}
        self._start = (step, theta, grads, losses)

    def get_output(self):
        return dict(self.output)


# ----------------------------------------------------------------------------- child
def child(mode: str) -> dict:
    import torch
    from torch import nn

    from trak_core.alpha import Alpha

    torch.set_num_threads(2)

    def per_sample_ce(out, y):
        return nn.functional.cross_entropy(out, y, reduction="none")

    def build(hidden):
        torch.manual_seed(0)
        dims = (D_IN, *hidden)
        layers = []
        for a, b in zip(dims[:-1], dims[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(dims[-1], D_OUT))

    def make_tracker():
        if mode == "jvp":
            return Alpha(per_sample_ce, lambda s: True)
        if mode == "cockpit":
            return CockpitLikeAlpha(per_sample_ce)
        return None

    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(BATCH, D_IN, generator=g), torch.randint(0, D_OUT, (BATCH,), generator=g))
        for _ in range(N_STEPS + 1)
    ]

    def run(model, opt, tracker, steps, first=0, timings=None):
        for step in range(first, first + steps):
            x, y = data[step % len(data)]
            opt.zero_grad()
            per_sample_ce(model(x), y).mean().backward()
            if tracker is not None:
                t0 = time.perf_counter()
                tracker.track(step, model, x, y)
                if timings is not None:
                    timings.append(time.perf_counter() - t0)
            opt.step()

    # warm-up: library code paths (functorch, jvp decompositions) on a small model,
    # and the real model's gradients + Adam state
    small = build((16,))
    run(small, torch.optim.Adam(small.parameters()), make_tracker(), 2)
    model = build(HIDDEN)
    num_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    run(model, opt, None, 1)
    del small
    gc.collect()

    tracker = make_tracker()
    base = rss_bytes()
    use_hwm = reset_peak()
    timings: list[float] = []
    run(model, opt, tracker, N_STEPS, first=0, timings=timings)
    peak = peak_bytes(use_hwm) - base
    held = held_bytes(vars(tracker)) if tracker is not None else 0

    probe_peak = None
    if tracker is not None:  # one more tracking call under the allocation probe
        x, y = data[N_STEPS]
        opt.zero_grad()
        per_sample_ce(model(x), y).mean().backward()
        with make_probe()() as probe:
            tracker.track(N_STEPS, model, x, y)
        probe_peak = probe.peak

    out = tracker.get_output() if tracker is not None else {}
    return {
        "mode": mode,
        "num_params": num_params,
        "batch": BATCH,
        "peak_rss_mb": peak / 2**20,
        "peak_source": "VmHWM" if use_hwm else "ru_maxrss",
        "probe_peak_mb": None if probe_peak is None else probe_peak / 2**20,
        "held_mb": held / 2**20,
        "ms_per_step": 1e3 * sorted(timings)[len(timings) // 2] if timings else None,
        "alpha": {int(k): v for k, v in out.items()},
    }


# ----------------------------------------------------------------------------- parent
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["none", "jvp", "cockpit"])
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(child(args.mode)))
        return

    results = {}
    for mode in ("none", "jvp", "cockpit"):
        proc = subprocess.run([sys.executable, __file__, "--mode", mode], capture_output=True, text=True, check=True)
        results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    r = results["jvp"]
    per_sample_mb = r["num_params"] * r["batch"] * 4 / 2**20
    print(
        f"model: {r['num_params']:,} params (float32), batch {r['batch']}, {N_STEPS} steps, "
        f"alpha tracked every step; one point's per-sample gradients = {per_sample_mb:.0f} MiB"
    )
    print(f"{'mode':8s} {'peak RSS +MiB':>14s} {'probe peak MiB':>15s} {'held MiB':>9s} {'median ms/track':>16s}")
    for mode, r in results.items():
        probe = "-" if r["probe_peak_mb"] is None else f"{r['probe_peak_mb']:.1f}"
        ms = "-" if r["ms_per_step"] is None else f"{r['ms_per_step']:.0f}"
        print(f"{mode:8s} {r['peak_rss_mb']:14.1f} {probe:>15s} {r['held_mb']:9.1f} {ms:>16s}")
    a, b = results["jvp"]["alpha"], results["cockpit"]["alpha"]
    diffs = [abs(a[k] - b[k]) for k in a if a[k] is not None and b.get(k) is not None]
    print(f"alpha jvp vs cockpit-like (float32): max |diff| = {max(diffs):.2e} over {len(diffs)} steps")
    print(f"(peak source: {results['jvp']['peak_source']})")


if __name__ == "__main__":
    main()
