"""Going past TRAK where it is cheap: LDS of trajectory ensembles and of per-layer
normalization of the projected gradients, on the evaluation cases of ``benchmarks/quality.py``.

Everything is scored with quality.py's ground truth (100 half-subset models per case), its pipeline
formula (``quality.Solver``: float64 XᵀX, (XᵀX + λI)⁻¹ rescaled as traker, traker's checkpoint
combination) and ``lambda_reg="deff:0.1"`` (``SETTING``: the default "adaptive" when this was measured); the
projector is TRAKer's default (factored, proj_dim 2048) unless ``--proj-dims`` says otherwise.

``ensembles`` — per case, 6 training runs (seeds 0..5, the case's full-batch Adam recipe, T steps) with
snapshots at fractions 1/4, 1/2, 5/8, 3/4, 7/8, 1 of T. A full-batch run is deterministic, so the
snapshot at T/2 of seed s *is* a run of T/2 steps from seed s; seeds 0..2 at T are the checkpoints of
quality.py's ground truth (checked: same state dicts; their features use model_id = seed as quality.features
does, so the baseline row is quality.py's configuration). Features are cached per projector source (CODE_KEY).
Other snapshots use model_id = 100·(snapshot index + 1) + seed
(an independent projection per checkpoint, as in the pipeline). Configurations are compared at equal
training cost (in full-batch steps = epochs) and the number of featurize passes is reported beside it.
The ``-sgd`` cases (``SGD_RECIPES``) are four of the cases retrained with minibatch SGD (momentum 0.9), ground
truth included (100 subset models, cached under this script's folder): a training regime that no choice saw,
used to confirm what the full-batch cases decide.

``layernorm`` — per-layer normalization: the factored projector's columns come in per-layer blocks
(``Layout.blocks``, k_b columns each, in order); each block of X and G is multiplied by one scale d_b from
the train rows' X: ``equal``: d_b = 1 / ‖X_b‖_F (every layer the same energy), ``rms``: d_b = √k_b / ‖X_b‖_F
(the same energy per column: layers weighted by their share k_b of proj_dim); ``blockdiag``: no scaling,
but XᵀX restricted to its per-layer diagonal blocks (the layer-independence part of a Kronecker-factored
curvature). With λ = 0 and XᵀX invertible a column scaling cancels (up to one scalar per checkpoint); it acts
through the damping.

``report`` prints the tables (with leave-one-case-out decisions) from the cached results:

    .venv/bin/python benchmarks/past_trak.py truth --cases wine-sgd cancer-sgd digits-mlp-sgd digits-conv-sgd
    .venv/bin/python benchmarks/past_trak.py ensembles --cases digits-mlp digits-conv text cancer wine wine-sgd \
        cancer-sgd digits-mlp-sgd digits-conv-sgd
    .venv/bin/python benchmarks/past_trak.py report

    .venv/bin/python benchmarks/past_trak.py ensembles
    .venv/bin/python benchmarks/past_trak.py ensembles --cases wine-sgd cancer-sgd digits-mlp-sgd digits-conv-sgd
    .venv/bin/python benchmarks/past_trak.py layernorm --proj-dims 256 512 2048
    .venv/bin/python benchmarks/past_trak.py report
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.dirname(os.path.abspath(__file__))):
    if p not in sys.path:
        sys.path.insert(0, p)

import quality  # noqa: E402
from quality import Solver, ground_truth, make_cases, paired_ci  # noqa: E402

from trak_core.damping import cholesky_inverse, parse_lambda_reg  # noqa: E402
from trak_core.gradients import grad_dim_of  # noqa: E402
from trak_core.lds import bootstrap_ci, lds  # noqa: E402
from trak_core.projectors import make_projector  # noqa: E402
from trak_core.scoring import combine_checkpoints, features_block, scores_block  # noqa: E402

CACHE = os.path.join(ROOT, ".cache", "past_trak")
FRACS = (0.25, 0.5, 0.625, 0.75, 0.875, 1.0)
NUM_RUNS = 6
#: the damping of every row: what "adaptive" meant when this was measured (it became "deff:0.1,resid:3" later)
SETTING = "deff:0.1"
KIND, PROJ_DIM = "factored", 2048

# name: ([(seed, snapshot fraction), ...], what); training cost = Σ over runs of the last snapshot used (× T)
CONFIGS: dict[str, tuple[list, str]] = {
    "A": ([(s, 1.0) for s in range(3)], "3 runs × final (today)"),
    "A-half": ([(s, 0.5) for s in range(3)], "3 runs of T/2 steps × final"),
    "E": ([(0, 1.0)], "1 run × final"),
    "B3": ([(0, f) for f in (0.25, 0.5, 1.0)], "1 run × T/4, T/2, T"),
    "B": ([(0, f) for f in (0.25, 0.5, 0.75, 1.0)], "1 run × T/4, T/2, 3T/4, T"),
    "B-late": ([(0, f) for f in (0.625, 0.75, 0.875, 1.0)], "1 run × 5T/8, 3T/4, 7T/8, T"),
    "C": ([(s, f) for s in range(3) for f in (0.25, 0.5, 0.75, 1.0)], "3 runs × T/4, T/2, 3T/4, T"),
    "C-late": ([(s, f) for s in range(3) for f in (0.625, 0.75, 0.875, 1.0)], "3 runs × 5T/8, 3T/4, 7T/8, T"),
    "C-all": ([(s, f) for s in range(3) for f in FRACS], "3 runs × all 6 snapshots"),
    "C-early": ([(s, f) for s in range(3) for f in (0.25, 0.5)], "3 runs of T/2 steps × T/4, T/2"),
    "D": ([(s, 0.5) for s in range(6)], "6 runs of T/2 steps × final"),
    "D-traj": ([(s, f) for s in range(6) for f in (0.25, 0.5)], "6 runs of T/2 steps × T/4, T/2"),
    "D-quarter": ([(s, 0.25) for s in range(6)], "6 runs of T/4 steps × final"),
    "F": ([(s, 1.0) for s in range(6)], "6 runs × final (2× cost, reference)"),
}
#: budget: (its baseline, the most training, the most featurize passes a configuration may use)
BUDGETS = {"1T": ("E", 1.0, 99), "3T": ("A", 3.0, 99), "3T and 3 passes": ("A", 3.0, 3)}


def cost(cks: list) -> float:
    """Training cost in full runs: every run is trained up to its last snapshot used."""
    last: dict = {}
    for s, f in cks:
        last[s] = max(last.get(s, 0.0), f)
    return float(sum(last.values()))


NORMS = ("none", "equal", "rms", "blockdiag")
CASES = ("digits-mlp", "digits-conv", "text", "cancer", "wine")  # the cases with cached ground truth


def _code_key() -> str:
    """A short hash of the projector's source: cached features are recomputed when the projector changes."""
    h = hashlib.sha256()
    for name in ("factored.py", "projectors.py", "featurize.py", "counter_rng.py"):
        with open(os.path.join(ROOT, "trak_core", name), "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:10]


CODE_KEY = _code_key()


def model_id(seed: int, frac: float) -> int:
    return seed if frac == 1.0 else 100 * (FRACS.index(frac) + 1) + seed


def _steps(case) -> int:
    r = case.recipe
    return int(r.get("steps", r.get("epochs", 0)))


def supported(case) -> bool:
    return case.recipe.get("opt") in ("adam full-batch", SGD) and _steps(case) > 0


# ---------------------------------------------------------------------------- minibatch-SGD variants (held out)
SGD = "sgd minibatch"
#: case: (epochs, lr, batch size); momentum 0.9, reshuffled every epoch — a recipe none of the choices saw
SGD_RECIPES = {
    "digits-mlp": (20, 0.05, 64),
    "digits-conv": (10, 0.05, 64),
    "cancer": (20, 0.02, 32),
    "wine": (30, 0.02, 16),
}


def train_sgd(make_model, train: tuple, seed: int, rows, epochs: int, lr: float, batch: int, fracs=(1.0,)) -> dict:
    """{fraction: state_dict} of minibatch SGD (momentum 0.9) snapshotted at round(fraction · steps)."""
    torch.manual_seed(seed)
    model = make_model()
    if rows is not None:
        rows = torch.as_tensor(rows)
        train = tuple(t[rows] for t in train)
    *inputs, labels = train
    n = labels.shape[0]
    per_epoch = -(-n // batch)
    at = {max(1, int(round(f * epochs * per_epoch))): f for f in fracs}
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    out, step = {}, 0
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen)
        for a in range(0, n, batch):
            idx = perm[a : a + batch]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(*[x[idx] for x in inputs]), labels[idx]).backward()
            opt.step()
            step += 1
            if step in at:
                out[at[step]] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def sgd_cases() -> dict:
    """The cases of SGD_RECIPES with their recipe replaced by minibatch SGD (name + "-sgd")."""
    out = {}
    for name, base in make_cases().items():
        if name not in SGD_RECIPES:
            continue
        ep, lr, b = SGD_RECIPES[name]

        def train_fn(seed, rows, base=base, ep=ep, lr=lr, b=b):
            model = base.make_model()
            model.load_state_dict(train_sgd(base.make_model, base.train(), seed, rows, ep, lr, b)[1.0])
            return model.eval()

        recipe = {"opt": SGD, "epochs": ep, "lr": lr, "batch": b, "momentum": 0.9}
        about = base.about + f"; minibatch SGD, {ep} epochs, batch {b}, lr {lr}"
        out[name + "-sgd"] = dataclasses.replace(
            base, name=name + "-sgd", about=about, train_fn=train_fn, recipe=recipe
        )
    return out


def all_cases() -> dict:
    return {**make_cases(), **sgd_cases()}


def truth_of(case) -> dict:
    """quality.ground_truth; the SGD variants' ground truth is cached under this script's folder."""
    if case.recipe.get("opt") != SGD:
        return ground_truth(case)
    saved = quality.CACHE
    quality.CACHE = os.path.join(CACHE, "lds")
    try:
        return ground_truth(case)
    finally:
        quality.CACHE = saved


# ---------------------------------------------------------------------------- trajectories
def trajectory(case, seed: int) -> dict:
    """{fraction: state_dict} of one run with the case's recipe (full-batch Adam or SGD_RECIPES; cached).

    The loop is the one of examples.tabular.train_full_batch / examples.text.train_model; the final state
    is checked against ``case.train_fn(seed, None)``."""
    T, lr = _steps(case), float(case.recipe["lr"])
    path = os.path.join(CACHE, "traj", f"{case.name}-T{T}-lr{lr:g}-s{seed}.pt")
    if os.path.exists(path):
        return torch.load(path, weights_only=False)
    if case.recipe.get("opt") == SGD:
        r = case.recipe
        out = train_sgd(case.make_model, case.train(), seed, None, T, lr, r["batch"], FRACS)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(out, path)
        return out
    at = {max(1, int(round(f * T))): f for f in FRACS}
    torch.manual_seed(seed)
    model = case.make_model()
    *inputs, labels = case.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    out = {}
    for step in range(1, T + 1):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(*inputs), labels).backward()
        opt.step()
        if step in at:
            out[at[step]] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref = case.train_fn(seed, None).state_dict()
    if any(not torch.equal(ref[k], out[1.0][k]) for k in ref):
        raise RuntimeError(f"{case.name}: the trajectory loop does not reproduce the case's recipe (seed {seed})")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(out, path)
    return out


def featurize(case, truth: dict, state: dict, mid: int, tag: str, kind: str = KIND, p: int = PROJ_DIM) -> dict:
    """X, Q, G of one checkpoint with the pipeline's featurizer (as quality.features), cached."""
    path = os.path.join(CACHE, "feats", f"{case.name}-{truth['key']}-{kind}-{p}-{tag}-m{mid}-{CODE_KEY}.npz")
    if os.path.exists(path):
        with np.load(path) as f:
            return {k: f[k] for k in ("X", "Q", "G")}
    out = featurize_now(case, state, mid, kind, p)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savez(path, **out)
    return out


def featurize_now(case, state: dict, mid: int, kind: str = KIND, p: int = PROJ_DIM) -> dict:
    model = case.make_model()
    proj = make_projector(kind, grad_dim_of(model), p, 0, "rademacher", "cpu", model=model)
    return quality.featurize_checkpoint(case, model, proj, state, mid)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def pipeline_scores(f: dict, setting=SETTING) -> torch.Tensor:
    """One checkpoint's scores the way the pipeline computes them (float64 XᵀX, λ from the rule, Cholesky
    inverse rescaled, features, scores) — timed as the per-checkpoint scoring cost."""
    x, g = torch.from_numpy(f["X"]), torch.from_numpy(f["G"])
    xtx = x.to(torch.float64).T @ x.to(torch.float64)
    lam = parse_lambda_reg(setting).resolve(xtx, n_rows=x.shape[0])
    inv = cholesky_inverse(xtx, lam, x.shape[0], rescale=True)[0]
    return scores_block(features_block(x, inv), g)


def score(solvers: list, truth: dict, setting=SETTING) -> dict:
    """LDS of the pipeline's scores over these checkpoints' solvers."""
    acc = sum(s.scores(s.resolve(setting)) for s in solvers)
    qsum = sum(s.q for s in solvers).astype(np.float32)
    sc = combine_checkpoints(acc.numpy(), qsum, len(solvers)).astype(np.float64)
    val, per = lds(sc, truth["masks"], truth["margins"])
    return {"lds": val, "ci": bootstrap_ci(per), "per": per}


def run_ensembles(names: list[str], log=print) -> None:
    cases = all_cases()
    os.makedirs(CACHE, exist_ok=True)
    for name in names:
        case = cases[name]
        if not supported(case):
            log(f"{name}: recipe {case.recipe} is not full-batch Adam; skipped")
            continue
        truth = truth_of(case)
        t0 = time.perf_counter()
        trajs = {s: trajectory(case, s) for s in range(NUM_RUNS)}
        for s in range(min(3, len(truth["states"]))):
            ref = truth["states"][s]
            if any(not torch.equal(ref[k], trajs[s][1.0][k]) for k in ref):
                raise RuntimeError(f"{name}: seed {s} final state differs from the ground truth's checkpoint {s}")
        t_train = time.perf_counter() - t0
        need = sorted({c for cks, _ in CONFIGS.values() for c in cks})
        solvers, t_feat = {}, 0.0
        for s, f in need:
            t1 = time.perf_counter()
            feats = featurize(case, truth, trajs[s][f], model_id(s, f), f"s{s}-f{f:g}")
            t_feat += time.perf_counter() - t1
            solvers[(s, f)] = Solver(feats)
        # seconds at this size (one process, best of 3): one run of T steps, one featurize pass, one checkpoint's
        # scoring as the pipeline does it (XᵀX, λ, Cholesky inverse, scores)
        t_run = min(_timed(lambda: case.train_fn(0, None)) for _ in range(3))
        t_pass = min(_timed(lambda: featurize_now(case, trajs[0][1.0], 0)) for _ in range(3))
        f0 = featurize(case, truth, trajs[0][1.0], 0, "s0-f1")
        t_solve = min(_timed(lambda: pipeline_scores(f0)) for _ in range(3))
        timing = {"t_run": t_run, "t_pass": t_pass, "t_solve": t_solve, "load": open("/proc/loadavg").read()[:14]}
        log(f"  ({name}: {timing})", flush=True)
        rows = []
        for cname, (cks, what) in CONFIGS.items():
            r = score([solvers[c] for c in cks], truth)
            rows.append({"case": name, "config": cname, "cost": cost(cks), "passes": len(cks), "what": what, **r})
            lo, hi = r["ci"]
            log(
                f"| {name} | {cname} | {what} | {cost(cks):g}T | {len(cks)} | {r['lds']:.3f} [{lo:.3f}, {hi:.3f}] |",
                flush=True,
            )
        log(
            f"  ({name}: training {t_train:.1f} s, featurize {t_feat:.1f} s, load {open('/proc/loadavg').read()[:14]})",
            flush=True,
        )
        _save(f"ens-{name}", rows, {"T": _steps(case), "n": int(truth["masks"].shape[1]), "code": CODE_KEY, **timing})


# ---------------------------------------------------------------------------- per-layer normalization
def block_ranges(case, p: int) -> list[tuple[str, int, int]]:
    """(block name, first column, end column) of the factored projector's output, in order."""
    model = case.make_model()
    proj = make_projector("factored", grad_dim_of(model), p, 0, "rademacher", "cpu", model=model)
    out, o = [], 0
    for b in proj.layout.blocks:
        out.append((b.name, o, o + b.k))
        o += b.k
    if o != p:
        raise RuntimeError(f"factored layout covers {o} columns, not {p}")
    return out


def normalized(f: dict, blocks: list, how: str) -> dict:
    """f with each block's columns of X and G scaled by one factor from the train rows' X (see module doc)."""
    if how in ("none", "blockdiag"):
        return f
    d = np.ones(f["X"].shape[1], dtype=np.float64)
    for _, a, b in blocks:
        fro = float(np.linalg.norm(f["X"][:, a:b].astype(np.float64)))
        d[a:b] = (1.0 if how == "equal" else np.sqrt(b - a)) / max(fro, 1e-30)
    return {"X": (f["X"] * d).astype(np.float32), "Q": f["Q"], "G": (f["G"] * d).astype(np.float32)}


class BlockDiagSolver(Solver):
    """quality.Solver with XᵀX restricted to its per-layer diagonal blocks."""

    def __init__(self, f: dict, blocks: list) -> None:
        super().__init__(f)
        mask = torch.zeros_like(self.xtx, dtype=torch.bool)
        for _, a, b in blocks:
            mask[a:b, a:b] = True
        self.xtx = torch.where(mask, self.xtx, torch.zeros((), dtype=self.xtx.dtype))
        ev, vec = torch.linalg.eigh(self.xtx)
        self.ev, self.vec = ev.clamp(min=0), vec


def run_layernorm(names: list[str], dims: list[int], log=print) -> None:
    cases = all_cases()
    for name in names:
        case = cases[name]
        truth = truth_of(case)
        rows = []
        for p in dims:
            blocks = block_ranges(case, p)
            # quality.py's checkpoints (= seeds 0..2 at T of `ensembles`), featurized as quality.features does
            # (model_id = checkpoint index) but cached here, keyed by the projector's source
            feats = [
                featurize(case, truth, truth["states"][c], c, f"s{c}-f1", "factored", p)
                for c in range(quality.NUM_CKPTS)
            ]
            for how in NORMS:
                if how == "blockdiag":
                    solvers = [BlockDiagSolver(f, blocks) for f in feats]
                else:
                    solvers = [Solver(normalized(f, blocks, how)) for f in feats]
                r = score(solvers, truth)
                rows.append({"case": name, "proj_dim": p, "norm": how, "blocks": len(blocks), **r})
                lo, hi = r["ci"]
                log(
                    f"| {name} | {p} | {how} | {len(blocks)} blocks | {r['lds']:.3f} [{lo:.3f}, {hi:.3f}] |", flush=True
                )
        _save(f"norm-{name}", rows, {"dims": dims, "code": CODE_KEY})


# ---------------------------------------------------------------------------- results and tables
def _save(tag: str, rows: list, meta: dict) -> None:
    os.makedirs(CACHE, exist_ok=True)
    out = [{**{k: v for k, v in r.items() if k != "per"}, "per": [float(x) for x in r["per"]], **meta} for r in rows]
    with open(os.path.join(CACHE, f"{tag}.json"), "w") as fh:
        json.dump(out, fh, default=float)


def _load(prefix: str) -> list:
    out = []
    for fn in sorted(os.listdir(CACHE)) if os.path.isdir(CACHE) else []:
        if fn.startswith(prefix) and fn.endswith(".json"):
            out += json.load(open(os.path.join(CACHE, fn)))
    for r in out:
        r["per"] = np.array(r["per"], dtype=np.float64)
    return out


def _cell(r: dict) -> str:
    lo, hi = r["ci"]
    return f"{r['lds']:.3f} [{lo:.3f}, {hi:.3f}]"


def _delta(r: dict, base: dict) -> str:
    d, lo, hi = paired_ci(r["per"], base["per"])
    return f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def loco_pick(table: dict, cases: list, options: list, held: str, rule: str = "mean", base: str = "A") -> str:
    """The option with the best mean LDS (rule "mean") or the best worst-case Δ against ``base`` (rule
    "worst") over the cases other than ``held``."""
    others = [c for c in cases if c != held]
    if rule == "mean":
        return max(options, key=lambda o: np.mean([table[(c, o)]["lds"] for c in others]))
    return max(options, key=lambda o: min(table[(c, o)]["lds"] - table[(c, base)]["lds"] for c in others))


def _lds_table(t: dict, cases: list) -> None:
    print("| configuration | training | passes | " + " | ".join(cases) + " | mean |")
    print("|---|---|---|" + "---|" * (len(cases) + 1))
    for k, (cks, what) in CONFIGS.items():
        m = np.mean([t[(c, k)]["lds"] for c in cases])
        cells = " | ".join(_cell(t[(c, k)]) for c in cases)
        print(f"| **{k}**: {what} | {cost(cks):g}T | {len(cks)} | {cells} | {m:.3f} |")


def report_ensembles() -> None:
    rows = _load("ens-")
    if not rows:
        print("no ensemble results: run `past_trak.py ensembles` first")
        return
    present = list(dict.fromkeys(r["case"] for r in rows))
    adam = [c for c in CASES if c in present]
    sgd = [c + "-sgd" for c in CASES if c + "-sgd" in present]
    cases = adam + sgd
    t = {(r["case"], r["config"]): r for r in rows}
    steps = ", ".join(f"{c} {t[(c, 'A')]['T']}" for c in cases)
    print(f"\n### Trajectory ensembles ({KIND}, proj_dim {PROJ_DIM}, lambda_reg {SETTING}; LDS [95 % CI])\n")
    print("Training cost in full runs of the recipe (T = its full-batch steps, or its epochs for SGD:")
    print(f"{steps});")
    print("passes = checkpoints featurized (and scored). Projector source key " + rows[0].get("code", "?") + ".")
    print("Cases of quality.py (full-batch Adam):\n")
    _lds_table(t, adam)
    if sgd:
        print("\nThe same cases trained with minibatch SGD (momentum 0.9; ground truth retrained with that recipe; ")
        print("held out from every choice below):\n")
        _lds_table(t, sgd)
    print("\nMeasured cost at these sizes relative to A: training + passes × (featurize + scoring), from one run of T")
    print("steps, one featurize pass and one checkpoint's scoring as the pipeline does it (XᵀX, λ, Cholesky inverse,")
    print("scores), each timed in the same process, best of 3:\n")
    print("| configuration | " + " | ".join(cases) + " |")
    print("|---|" + "---|" * len(cases))
    for k, (cks, _) in CONFIGS.items():
        rel = []
        for c in cases:
            r = t[(c, "A")]
            sec = cost(cks) * r["t_run"] + len(cks) * (r["t_pass"] + r["t_solve"])
            rel.append(sec / (3 * r["t_run"] + 3 * (r["t_pass"] + r["t_solve"])))
        print(f"| {k} | " + " | ".join(f"{v:.2f}×" for v in rel) + " |")
    print(
        "\nPer case (s): "
        + "; ".join(
            f"{c}: run {t[(c, 'A')]['t_run']:.2f}, pass {t[(c, 'A')]['t_pass']:.2f}, "
            f"scoring {t[(c, 'A')]['t_solve']:.2f} (load {t[(c, 'A')]['load']})"
            for c in cases
        )
    )
    print("\nΔ LDS vs A (today: 3 runs × final) and, for the 1T configurations, vs E (1 run × final); paired")
    print("bootstrap over targets, 95 % CI:\n")
    print("| configuration | vs | " + " | ".join(cases) + " |")
    print("|---|---|" + "---|" * len(cases))
    for base in ("A", "E"):
        for k, (cks, _) in CONFIGS.items():
            if k == base or (base == "E" and cost(cks) > 1.0):
                continue
            print(f"| {k} | {base} | " + " | ".join(_delta(t[(c, k)], t[(c, base)]) for c in cases) + " |")
    for rule, how in (("mean", "the best mean LDS"), ("worst", "the best worst-case Δ against the baseline")):
        print(f"\nLeave-one-case-out over the full-batch Adam cases, rule {rule!r}: per held-out case, the")
        print(f"configuration with {how} on the other four, among those within the")
        print("budget; its Δ on the held-out case against the budget's baseline. The -sgd rows: chosen on all five")
        print("Adam cases, scored on the SGD variants.\n")
        print("| held-out case | " + " | ".join(f"≤ {b}: chosen | Δ vs {v[0]}" for b, v in BUDGETS.items()) + " |")
        print("|---|" + "---|---|" * len(BUDGETS))
        for h in cases:
            cells = []
            for base, most, passes in BUDGETS.values():
                opts = [k for k, (cks, _) in CONFIGS.items() if cost(cks) <= most and len(cks) <= passes]
                pick = loco_pick(t, adam, opts, h, rule, base)  # h not in adam (SGD case): chosen on all five
                cells.append(f"{pick} | {_delta(t[(h, pick)], t[(h, base)])}")
            print(f"| {h} | " + " | ".join(cells) + " |")


def report_layernorm() -> None:
    rows = _load("norm-")
    if not rows:
        print("no normalization results: run `past_trak.py layernorm` first")
        return
    cases = list(dict.fromkeys(r["case"] for r in rows))
    dims = sorted({r["proj_dim"] for r in rows})
    nb = {r["case"]: r["blocks"] for r in rows}
    t = {(r["case"], r["proj_dim"], r["norm"]): r for r in rows}
    print(f"\n### Per-layer normalization (factored, 3 checkpoints, lambda_reg {SETTING}; LDS [95 % CI])\n")
    print("| case (blocks) | proj_dim | none (today) | equal | Δ equal | rms | Δ rms | blockdiag | Δ blockdiag |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in cases:
        for p in dims:
            if (c, p, "none") not in t:
                continue
            b = t[(c, p, "none")]
            cells = [f"{_cell(t[(c, p, k)])} | {_delta(t[(c, p, k)], b)}" for k in NORMS[1:]]
            print(f"| {c} ({nb[c]}) | {p} | {_cell(b)} | " + " | ".join(cells) + " |")
    print(
        "\nLeave-one-case-out (option with the best mean LDS over the other cases and all proj_dims; Δ vs none\n"
        "on the held-out case):\n"
    )
    print("| held-out case | chosen | " + " | ".join(f"Δ at {p}" for p in dims) + " |")
    print("|---|---|" + "---|" * len(dims))
    for h in cases:
        others = [c for c in cases if c != h]
        pick = max(NORMS, key=lambda k: np.mean([t[(c, p, k)]["lds"] for c in others for p in dims if (c, p, k) in t]))
        cells = [_delta(t[(h, p, pick)], t[(h, p, "none")]) if (h, p, pick) in t else "—" for p in dims]
        print(f"| {h} | {pick} | " + " | ".join(cells) + " |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["truth", "ensembles", "layernorm", "report"])
    ap.add_argument("--cases", nargs="*", default=None)
    ap.add_argument("--proj-dims", nargs="*", type=int, default=[PROJ_DIM])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    names = args.cases or [c for c in CASES if c in make_cases()]
    if args.what == "truth":
        for name in names:
            print(name, truth_of(all_cases()[name])["stats"], flush=True)
    elif args.what == "ensembles":
        run_ensembles(names)
    elif args.what == "layernorm":
        run_layernorm(names, args.proj_dims)
    else:
        report_ensembles()
        report_layernorm()


if __name__ == "__main__":
    main()
