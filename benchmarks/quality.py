"""Attribution quality (LDS) over evaluation cases with cached ground truth (RESULTS.md: quality, peers).

Cases (``make_cases``): nine small ones (five near convergence, four stopped early) and ``LARGE_CASES``. Per case,
C checkpoints are trained on all train rows and M models on random half subsets (``trak_core.lds.subset_masks``); the
ground truth is the subset models' outputs on held-out targets, cached under ``.cache/lds/`` (``truth_key``), as are
X, Q, G per (case, projector kind, proj_dim, checkpoint). Scores follow the pipeline's formula (float64 XᵀX, traker's
rescale and checkpoint combination) in XᵀX's eigenbasis, so many ``lambda_reg`` settings are cheap (``Solver``,
checked against a brute-force inverse in tests/benchmarks). LDS: the mean over targets of the Spearman correlation.

    .venv/bin/python benchmarks/quality.py truth                         # train / load all ground truths
    .venv/bin/python benchmarks/quality.py eval --kinds dense --proj-dims 256 2048 --settings 0 adaptive --json d.json
    .venv/bin/python benchmarks/quality.py traker --proj-dims 256 2048 --json traker.json
    .venv/bin/python benchmarks/quality.py report --json d.json,traker.json --proj-dims 256 2048
    .venv/bin/python benchmarks/quality.py splits --cases small-lm --proj-dims 256 2048   # kind factored-v4 beside
    .venv/bin/python benchmarks/quality.py loco --json d.json --kinds factored --cases …  # rule by leave-one-case-out
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from trak_core.featurize.featurizer import Featurizer  # noqa: E402
from trak_core.featurize.gradients import grad_dim_of  # noqa: E402
from trak_core.lds import bootstrap_ci, lds, margins_from_logits, subset_masks, truth_key  # noqa: E402
from trak_core.projection.energy import PROBE_ROWS, sketched_energies  # noqa: E402
from trak_core.projection.factored import FactoredProjector  # noqa: E402
from trak_core.projection.projectors import make_projector  # noqa: E402
from trak_core.scoring.combine import combine_checkpoints, features_block, scores_block  # noqa: E402
from trak_core.solve.damping import cholesky_inverse, parse_lambda_reg  # noqa: E402
from trak_core.solve.lambda_rules import unfit_share_of_task  # noqa: E402
from trak_core.solve.reduce import RowSums  # noqa: E402

CACHE = os.path.join(ROOT, ".cache", "lds")
NUM_SUBSETS = 100
NUM_CKPTS = 3
ADAPTIVE_SETTING = "adaptive"
TRUTH_VERSION = 1
SCALE_ROWS = 512
#: the kind name of the factored projector with layout version 3's split (``split="size"``), for comparison
FACTORED_V3 = "factored-v3"
#: the kind name of the factored projector with layout version 4's equal split (``split="layer"``); ``"factored"`` is
#: the default's energy split (probed on the first 64 train rows at checkpoint 0, as the pipeline's plan does)
FACTORED_V4 = "factored-v4"


# ---------------------------------------------------------------------------- cases
@dataclass
class Case:
    name: str
    about: str
    make_model: Any
    train: Any  # () -> tuple of tensors (inputs..., labels)
    targets: Any  # () -> tuple of tensors
    task: str
    train_fn: Any  # (seed, rows | None) -> trained model (eval mode)
    recipe: dict = field(default_factory=dict)
    #: (model, targets) -> (margins float64 (m,), accuracy or None); default: classification margins
    outputs: Any = None


def _digits_targets(num: int = 200, module: str = "digits"):
    """The first ``num`` held-out rows of the sklearn digits (``module``: as examples/<module>.py shapes them)."""
    x, y = importlib.import_module(f"examples.{module}").heldout_data()
    return x[:num], y[:num]


def _conv_targets():
    return _digits_targets(module="digits_conv")


def _text_targets(num: int = 200):
    from examples import text

    rng = np.random.default_rng(text.SEED)
    pairs = [text._sentence(rng) for _ in range(text.NUM_TRAIN + num)][text.NUM_TRAIN :]
    ids, types, mask = text.encode([p[0] for p in pairs])
    return ids, types, mask, torch.tensor([p[1] for p in pairs], dtype=torch.long)


def _full_batch(make_model, train, steps: int, lr: float):
    from examples.tabular import train_full_batch

    return lambda seed, rows: train_full_batch(make_model, train(), seed, rows, steps, lr)


def _pipeline_recipe(model: str, data: str, **recipe):
    """Train with the pipeline's own training code (``tasks.trainer.train_on_rows``: mini-batch SGD/Adam, batch
    order from the seed) and this recipe — e.g. the digits demo's (``examples.digits.demo_configs``)."""

    def train_fn(seed, rows):
        from tasks.config import TrainConfig
        from tasks.trainer import train_on_rows

        cfg = TrainConfig(model=model, train_data=data, out_dir=tempfile.gettempdir(), alpha_every=0, **recipe)
        return train_on_rows(cfg, seed, rows)

    return train_fn


def _demo_recipe() -> dict:
    """The digits demo's training recipe (examples/digits.py demo_configs): 4 epochs of SGD, lr 0.01, batch 64."""
    from examples import digits

    cfg = digits.demo_configs()[0]
    return {k: getattr(cfg, k) for k in ("epochs", "batch_size", "optimizer", "lr", "momentum", "weight_decay")}


# recipes of the under-trained cases (mini-batch SGD with momentum, few epochs: far from convergence)
CONV_SGD = {"epochs": 3, "batch_size": 64, "optimizer": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 0.0}
CANCER_SGD = {"epochs": 2, "batch_size": 32, "optimizer": "sgd", "lr": 0.003, "momentum": 0.9, "weight_decay": 0.0}
WINE_SGD = {"epochs": 3, "batch_size": 16, "optimizer": "sgd", "lr": 0.003, "momentum": 0.9, "weight_decay": 0.0}
# recipes of the larger cases (mini-batch Adam, a few epochs: one model in seconds on one core)
WIDE_ADAM = {"epochs": 8, "batch_size": 64, "optimizer": "adam", "lr": 0.001, "momentum": 0.0, "weight_decay": 0.0}
BN_ADAM = {"epochs": 6, "batch_size": 64, "optimizer": "adam", "lr": 0.001, "momentum": 0.0, "weight_decay": 0.0}
# the small LM's recipe: AdamW, batches of 32 drawn with replacement, 30 epochs' worth of steps
LM_ADAMW = {"opt": "adamw", "epochs": 30, "batch": 32, "lr": 3e-3, "weight_decay": 0.01, "targets": 200}
#: the cases of 10⁵–10⁶ parameters (proj_dim 256–4096 compresses them 70–1,700×)
LARGE_CASES = ("wide-mlp", "bn-conv", "small-lm")


# fmt: off
#: the cases trained by the pipeline's trainer: name, about, model, train data, targets ("module:name" or a function),
#: recipe (None: the digits demo's)
TRAINER_CASES = (
    ("digits-sgd", "the digits demo's checkpoints: digits MLP, 4 epochs SGD lr 0.01 batch 64 (~90 % train acc.)",
     "examples.digits:make_model", "examples.digits:train_data", _digits_targets, None),
    ("conv-sgd", "digits conv net, 3 epochs SGD lr 0.01 batch 64",
     "examples.digits_conv:make_model", "examples.digits_conv:train_data", _conv_targets, CONV_SGD),
    ("cancer-sgd", "breast-cancer MLP, 2 epochs SGD lr 0.003 batch 32",
     "examples.tabular:cancer_model", "examples.tabular:cancer_train", "examples.tabular:cancer_heldout", CANCER_SGD),
    ("wine-sgd", "wine MLP, 3 epochs SGD lr 0.003 batch 16 (n=100 ≤ proj_dim)",
     "examples.tabular:wine_model", "examples.tabular:wine_train", "examples.tabular:wine_heldout", WINE_SGD),
    ("wide-mlp", "sklearn digits, 64→512→512→256→10 MLP (429,834 params), 8 epochs Adam batch 64",
     "examples.digits_large:mlp_model", "examples.digits:train_data", _digits_targets, WIDE_ADAM),
    ("bn-conv", "sklearn digits as 1×8×8 images, 3 conv+BatchNorm, 2 linear (293,290 params), 6 epochs Adam batch 64",
     "examples.digits_large:bn_conv_model", "examples.digits_conv:train_data", _conv_targets, BN_ADAM),
)
# fmt: on


def _trainer_case(name: str, about: str, model: str, data: str, targets, recipe: dict | None) -> Case:
    """A classification case of :data:`TRAINER_CASES`."""
    model_fn, data_fn, targets = (
        getattr(importlib.import_module(p.split(":")[0]), p.split(":")[1]) if isinstance(p, str) else p
        for p in (model, data, targets)
    )
    recipe = _demo_recipe() if recipe is None else recipe
    train_fn = _pipeline_recipe(model, data, **recipe)
    return Case(name, about, model_fn, data_fn, targets, "image_classification", train_fn,
                {"trainer": "tasks.trainer", **recipe})  # fmt: skip


def _lm_train(seed, rows):
    from examples import gpt

    n = gpt.NUM_TRAIN if rows is None else len(rows)
    steps = LM_ADAMW["epochs"] * n // LM_ADAMW["batch"]
    return gpt.train(seed, steps, LM_ADAMW["batch"], LM_ADAMW["lr"], rows=rows, model_fn=gpt.wide_model)[0]


def _lm_outputs(model, targets) -> tuple[np.ndarray, None]:
    """The causal_lm model output on each target sequence: log(p / (1 − p)), p the sequence's probability."""
    from trak_core.featurize.modelout import log_odds, sequence_log_prob

    ids, mask, labels = targets
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.double()
    return log_odds(sequence_log_prob(logits, labels)).numpy(), None


def make_cases() -> dict[str, Case]:
    from examples import digits, digits_conv, gpt, tabular, text

    return {
        c.name: c
        for c in [
            Case(
                "digits-mlp",
                "sklearn digits, 64→32→10 MLP (2,410 params), n=1500, 200 targets",
                digits.make_model,
                digits.train_data,
                _digits_targets,
                "image_classification",
                _full_batch(digits.make_model, digits.train_data, 200, 0.01),
                {"opt": "adam full-batch", "steps": 200, "lr": 0.01},
            ),
            Case(
                "digits-conv",
                "sklearn digits as 1×8×8 images, 2-conv net (3,818 params), n=1500, 200 targets",
                digits_conv.make_model,
                digits_conv.train_data,
                _conv_targets,
                "image_classification",
                _full_batch(digits_conv.make_model, digits_conv.train_data, 60, 0.03),
                {"opt": "adam full-batch", "steps": 60, "lr": 0.03},
            ),
            Case(
                "text",
                "generated sentences, embedding-bag classifier (2,619 params), n=1200, 200 targets",
                text.make_model,
                text.train_data,
                _text_targets,
                "text_classification",
                lambda seed, rows: text.train_model(seed, rows=rows),
                {"opt": "adam full-batch", "epochs": 60, "lr": 0.05},
            ),
            Case(
                "cancer",
                "breast cancer, 30→32→2 MLP (1,058 params), n=400, 169 targets",
                tabular.cancer_model,
                tabular.cancer_train,
                tabular.cancer_heldout,
                "image_classification",
                _full_batch(tabular.cancer_model, tabular.cancer_train, 200, 0.01),
                {"opt": "adam full-batch", "steps": 200, "lr": 0.01},
            ),
            Case(
                "wine",
                "wine, 13→64→3 MLP (1,091 params), n=100 ≤ proj_dim, 78 targets",
                tabular.wine_model,
                tabular.wine_train,
                tabular.wine_heldout,
                "image_classification",
                _full_batch(tabular.wine_model, tabular.wine_train, 200, 0.01),
                {"opt": "adam full-batch", "steps": 200, "lr": 0.01},
            ),
            # other training regimes, stopped early (mini-batch SGD), and realistic compression (a few hundred
            # thousand parameters, Adam): trained by the pipeline's own trainer
            *[_trainer_case(*row) for row in TRAINER_CASES],
            Case(
                "small-lm",
                "a GPT-2 (transformers) of width 128, 2 layers (415,360 params), characters of stdlib docstrings, "
                "n=480, 200 held-out texts, causal_lm",
                gpt.wide_model,
                gpt.train_data,
                lambda: gpt.target_data(LM_ADAMW["targets"]),
                "causal_lm",
                _lm_train,
                LM_ADAMW,
                _lm_outputs,
            ),
        ]
    }


# ---------------------------------------------------------------------------- ground truth
def _logits(model, batch: tuple) -> torch.Tensor:
    with torch.no_grad():
        return model(*batch[:-1])


def _outputs(case: Case, model, targets: tuple) -> tuple[np.ndarray, float | None]:
    """The ground truth's model outputs on the targets (float64) and the target accuracy where there is one."""
    if case.outputs is not None:
        return case.outputs(model, targets)
    z = _logits(model, targets)
    return margins_from_logits(z, targets[-1]), float((z.argmax(1) == targets[-1]).float().mean())


def ground_truth(case: Case, num_subsets: int = NUM_SUBSETS, num_ckpts: int = NUM_CKPTS, log=print) -> dict:
    """{'masks' (M, n), 'margins' (M, m), 'states' [C state_dicts], 'key', 'stats'}, cached on disk."""
    train = case.train()
    n = train[-1].shape[0]
    ident = {"case": case.name, "recipe": case.recipe, "M": num_subsets, "C": num_ckpts, "v": TRUTH_VERSION, "n": n}
    key = truth_key(ident)
    path = os.path.join(CACHE, f"{case.name}-{key}.pt")
    if os.path.exists(path):
        return torch.load(path, weights_only=False)
    os.makedirs(CACHE, exist_ok=True)
    t0 = time.perf_counter()
    targets = case.targets()
    ckpts = [case.train_fn(seed, None) for seed in range(num_ckpts)]
    masks = subset_masks(n, num_subsets, 0.5, seed=2024)
    margins = np.zeros((num_subsets, targets[-1].shape[0]))
    accs = []
    for s in range(num_subsets):
        model = case.train_fn(1000 + s, np.flatnonzero(masks[s]))
        margins[s], acc = _outputs(case, model, targets)
        accs.append(np.nan if acc is None else acc)
        if (s + 1) % 10 == 0:
            log(f"{case.name}: {s + 1}/{num_subsets} subset models, {time.perf_counter() - t0:.0f} s")
    ck_acc = [np.nan if (a := _outputs(case, m, targets)[1]) is None else a for m in ckpts]
    out = {
        "masks": masks,
        "margins": margins,
        "states": [m.state_dict() for m in ckpts],
        "key": key,
        "ident": ident,
        "stats": {
            "target_acc_ckpt": float(np.mean(ck_acc)),
            "target_acc_subset": float(np.mean(accs)),
            "train_s": time.perf_counter() - t0,
        },
    }
    torch.save(out, path)
    log(f"{case.name}: ground truth {num_subsets} subsets + {num_ckpts} checkpoints in {out['stats']['train_s']:.1f} s")
    return out


# ---------------------------------------------------------------------------- features
def grad_dim(case: Case) -> int:
    return grad_dim_of(case.make_model())


def featurize_checkpoint(case: Case, model, proj, state: dict, model_id: int, rows: int = 250) -> dict:
    """X (n, p), Q (n,), G (m, p) of one checkpoint (``state``) with the pipeline's featurizer, in row batches."""
    feat = Featurizer(model, case.task, proj, device="cpu")
    feat.load_state(state)
    train, targets = case.train(), case.targets()
    n = train[-1].shape[0]
    xs, qs = [], []
    for a in range(0, n, rows):
        x, q = feat.featurize([t[a : a + rows] for t in train], model_id, range(a, min(a + rows, n)))
        xs.append(x)
        qs.append(q)
    return {"X": np.concatenate(xs), "Q": np.concatenate(qs), "G": feat.target_features(list(targets), model_id)}


def features(case: Case, truth: dict, kind: str, proj_dim: int, ckpt: int, seed: int = 0) -> dict:
    """X (n, p), Q (n,), G (m, p) float32 of one checkpoint, as the pipeline stores them; cached. The cache
    name of a projector with kind-specific parameters (the factored layout) carries a hash of its ``spec()``,
    so a changed projector is featurized anew."""
    p = grad_dim(case) if kind == "noop" else proj_dim
    model = case.make_model()
    gd = grad_dim_of(model)
    if kind == FACTORED_V3:  # layout version 3 (shares ∝ block size, pairs for small blocks), for comparison
        proj = FactoredProjector.from_model(model, p, seed, "rademacher", "cpu", split="size")
    elif kind == FACTORED_V4:  # layout version 4 (equal shares per block), for comparison
        proj = FactoredProjector.from_model(model, p, seed, "rademacher", "cpu", split="layer")
    elif kind == "factored":  # the default: proj_dim split by the gradient energy at checkpoint 0
        probe = case.make_model()
        probe.load_state_dict(truth["states"][0])
        energies = sketched_energies(probe, case.task, [t[:PROBE_ROWS] for t in case.train()], PROBE_ROWS)
        proj = FactoredProjector.from_model(model, p, seed, "rademacher", "cpu", energies=energies)
    else:
        proj = make_projector(kind, gd, p, seed, "rademacher", "cpu", model=model)
    tag = ""
    if kind not in ("dense", "noop"):
        tag = "-" + truth_key({k: v for k, v in proj.spec().items() if k not in ("kind", "proj_dim", "seed")})[:8]
    path = os.path.join(CACHE, "feats", f"{case.name}-{truth['key']}-{kind}{tag}-{p}-s{seed}-c{ckpt}.npz")
    if os.path.exists(path):
        with np.load(path) as f:
            return {k: f[k] for k in ("X", "Q", "G")}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    out = featurize_checkpoint(case, model, proj, truth["states"][ckpt], ckpt)
    np.savez(path, **out)
    return out


# ---------------------------------------------------------------------------- scores for many settings
class Solver:
    """One checkpoint's XᵀX, eigendecomposition and the inverse for any λ (traker's rescale included)."""

    def __init__(self, f: dict, unfit: float | None = None) -> None:  # unfit: unfit_share_of_task(the case's task)
        self.x, self.unfit = torch.from_numpy(f["X"]), unfit
        self.g = torch.from_numpy(f["G"])
        self.q = f["Q"].astype(np.float64)
        self.n = self.x.shape[0]
        self.xtx = self.x.to(torch.float64).T @ self.x.to(torch.float64)
        ev, vec = torch.linalg.eigh(self.xtx)
        self.ev, self.vec = ev.clamp(min=0), vec
        # Xᵀq, qᵀq ('resid', 'cresid'), Σ‖xᵢ‖⁴ ('neff'), Σqᵢ²‖xᵢ‖² ('cresid'): the pipeline's arithmetic, in one block
        rs = RowSums.of_rows(f["X"], f["Q"])
        self.xtq, self.qtq, self.norm4, self.q2x2 = torch.from_numpy(rs.xtq), rs.qtq, rs.row_norm4, rs.q2x2
        self._xv: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None

    def resolve(self, setting) -> float:
        rule = parse_lambda_reg(setting)
        return rule.resolve(
            self.xtx,
            n_rows=self.n,
            eigenvalues=self.ev,
            xtq=self.xtq,
            qtq=self.qtq,
            row_norm4=self.norm4,
            q2x2=self.q2x2,
            unfit=self.unfit,
        )

    def inverse(self, lam: float) -> torch.Tensor:
        if lam == 0:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return cholesky_inverse(self.xtx, 0.0, self.n, rescale=True)[0]
        inv = (self.vec / (self.ev + lam)) @ self.vec.T
        return inv / inv.abs().mean()

    def scores(self, lam: float) -> torch.Tensor:
        """X (XᵀX + λI)⁻¹ Gᵀ with traker's rescale (float32 out). λ > 0: in XᵀX's eigenbasis, float64 —
        (XV) diag(1/(σ+λ)) (GV)ᵀ / mean|V diag(1/(σ+λ)) Vᵀ|, n·p·m per λ instead of n·p² (the pipeline's
        float32 path to ~1e-6 relative); λ = 0 through damping.cholesky_inverse."""
        if lam == 0:
            return scores_block(features_block(self.x, self.inverse(lam)), self.g)
        if self._xv is None:
            self._xv = self.x.to(torch.float64) @ self.vec
            self._gv = self.g.to(torch.float64) @ self.vec
            self._vec32 = self.vec.to(torch.float32)
            p = self.vec.shape[0]
            # traker's rescale (a scalar per checkpoint) from SCALE_ROWS fixed random rows of the inverse when p is
            # large: p²·SCALE_ROWS instead of p³ flops per λ (its relative error is ~1e-3)
            self._rows = (
                None if p <= SCALE_ROWS else torch.randperm(p, generator=torch.Generator().manual_seed(0))[:SCALE_ROWS]
            )
        w = 1.0 / (self.ev + lam)
        v = self._vec32 if self._rows is None else self._vec32[self._rows]
        scale = ((v * w.to(torch.float32)) @ self._vec32.T).abs().to(torch.float64).mean()
        return ((self._xv * (w / scale)) @ self._gv.T).to(torch.float32)

    def deff(self, lam: float) -> float:
        return float((self.ev / (self.ev + lam)).sum()) if lam > 0 else float((self.ev > 0).sum())


def evaluate(
    case: Case, truth: dict, kind: str, proj_dim: int, settings: list, num_ckpts: int = NUM_CKPTS, seed: int = 0
) -> list[dict]:
    """Per setting: LDS, its interval, per-target correlations, resolved λ per checkpoint, d_eff / min(n, p)."""
    unfit = unfit_share_of_task(case.task)
    solvers = [Solver(features(case, truth, kind, proj_dim, c, seed), unfit) for c in range(num_ckpts)]
    return [{"case": case.name, "kind": kind, **r} for r in solver_rows(solvers, settings, truth)]


def solver_rows(solvers: list[Solver], settings: list, truth: dict) -> list[dict]:
    """:func:`evaluate` from the checkpoints' solvers (any :class:`Solver`, e.g. another curvature's)."""
    qsum = sum(s.q for s in solvers).astype(np.float32)
    p = solvers[0].x.shape[1]
    rows = []
    for setting in settings:
        lams = [s.resolve(setting) for s in solvers]
        acc = sum(s.scores(lam) for s, lam in zip(solvers, lams, strict=True))
        sc = combine_checkpoints(acc.numpy(), qsum, len(solvers)).astype(np.float64)
        val, per = lds(sc, truth["masks"], truth["margins"])
        lo, hi = bootstrap_ci(per)
        frac = [s.deff(lam) / min(s.n, p) for s, lam in zip(solvers, lams, strict=True)]
        row = dict(proj_dim=p, setting=str(setting), lds=val, ci=(lo, hi), per=per, lams=lams)
        rows.append({**row, "deff_frac": float(np.mean(frac))})
    return rows


def split_table(names: list[str], cases: dict, dims: list[int], setting: str = ADAPTIVE_SETTING) -> None:
    """The factored projector's two splits of proj_dim beside dense (RESULTS.md, "Attribution quality at realistic
    compression"): ``split="layer"`` (layout version 4, equal shares per block: kind ``factored-v4``) and
    ``split="energy"`` (the default: shares ∝ each block's gradient energy, probed by ``sketched_energies``)."""
    print(
        "| case | parameters | proj_dim | compression | dense | factored, equal split | − dense | "
        "factored, energy split | − dense |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        truth, d = ground_truth(cases[name]), grad_dim(cases[name])
        for p in dims:
            dense, equal, energy = (
                evaluate(cases[name], truth, kind, p, [setting])[0]["lds"]
                for kind in ("dense", FACTORED_V4, "factored")
            )
            print(
                f"| {name} | {d:,} | {p} | {d / p:,.0f}× | {dense:.3f} | {equal:.3f} | {equal - dense:+.3f} | "
                f"{energy:.3f} | {energy - dense:+.3f} |",
                flush=True,
            )


# ---------------------------------------------------------------------------- traker 0.3.2 itself
def traker_cache(case: Case, truth: dict, proj_dim: int, num_ckpts: int = NUM_CKPTS) -> str:
    """Where :func:`traker_lds` keeps traker's scores."""
    return os.path.join(CACHE, f"traker-{case.name}-{truth['key']}-{proj_dim}-c{num_ckpts}.npz")


def traker_scores(tr_cls, case: Case, truth: dict, num_ckpts: int = NUM_CKPTS, rows: int = 250, **kw) -> np.ndarray:
    """(n, m) float64 scores of a TRAKer with traker 0.3.2's API (``tr_cls``: traker's or trakflow's) built with
    ``kw`` on CPU in a temporary store: featurize in batches of ``rows``, finalize, score every checkpoint."""
    train, targets = case.train(), case.targets()
    n, m = train[-1].shape[0], targets[-1].shape[0]
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = tr_cls(model=case.make_model(), task=case.task, train_set_size=n, save_dir=tmp, device="cpu", **kw)
        batches = [[t[a : a + rows] for t in train] for a in range(0, n, rows)]
        for mid in range(num_ckpts):
            tr.load_checkpoint(truth["states"][mid], model_id=mid)
            if kw.get("curvature") == "kfac-eigen":  # fitted first (kfac/ekfac: summed while featurized)
                tr.fit_curvature(batches)
            for b in batches:
                tr.featurize(b, num_samples=len(b[-1]))
        tr.finalize_features()
        for mid in range(num_ckpts):
            tr.start_scoring_checkpoint("q", truth["states"][mid], mid, m)
            tr.score(list(targets), num_samples=m)
        return np.asarray(tr.finalize_scores("q"), dtype=np.float64)


def traker_lds(case: Case, truth: dict, proj_dim: int, num_ckpts: int = NUM_CKPTS) -> dict:
    """LDS of traker 0.3.2 with its defaults (CPU: BasicProjector, normal; float16 store; λ = 0); cached."""
    path = traker_cache(case, truth, proj_dim, num_ckpts)
    if not os.path.exists(path):
        import logging

        from trak.traker import TRAKer as RefTRAKer

        logging.getLogger("TRAK").setLevel(logging.ERROR)
        sc = traker_scores(RefTRAKer, case, truth, num_ckpts, proj_dim=proj_dim, logging_level=logging.ERROR)
        np.savez(path, scores=sc)
    with np.load(path) as f:
        sc = f["scores"]
    if not np.isfinite(sc).all():
        nan = float("nan")
        return {"lds": nan, "ci": (nan, nan), "per": np.full(truth["margins"].shape[1], nan)}
    val, per = lds(sc, truth["masks"], truth["margins"])
    return {"lds": val, "ci": bootstrap_ci(per), "per": per}


# ---------------------------------------------------------------------------- tables
def fmt(r: dict | None) -> str:
    if r is None:
        return "—"
    lo, hi = r["ci"]
    return f"{r['lds']:.3f} [{lo:.3f}, {hi:.3f}]"


def paired_ci(a: np.ndarray, b: np.ndarray, reps: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    ok = np.isfinite(a) & np.isfinite(b)
    d = (a - b)[ok]
    lo, hi = bootstrap_ci(d, reps=reps, seed=seed)
    return float(d.mean()), lo, hi


# ---------------------------------------------------------------------------- tables from result files
def load_rows(paths: list[str]) -> dict:
    """{(case, kind, proj_dim, setting): row} from --json files (later files win). noop rows get proj_dim 0."""
    out = {}
    for path in paths:
        for r in json.load(open(path)):
            p = 0 if r["kind"] == "noop" else int(r["proj_dim"])
            out[(r["case"], r["kind"], p, str(r["setting"]))] = r
    return out


def fixed_settings(rows: dict, case: str, kind: str, p: int) -> list[str]:
    return [s for (c, k, q, s) in rows if c == case and k == kind and q == p and (s.startswith("rel:") or _num(s))]


def _num(s: str) -> bool:
    return isinstance(parse_lambda_reg(s).setting, float)  # an absolute λ ("0", "2.5", "1e-3"), not a rule


def best_fixed(rows: dict, case: str, kind: str, p: int) -> tuple[str, float] | None:
    """(setting, LDS) of the best fixed λ in the rows; None where no fixed λ was run."""
    cands = [(rows[(case, kind, p, s)]["lds"], s) for s in fixed_settings(rows, case, kind, p)]
    if not cands:
        return None
    v, s = max(cands)
    return s, v


def rule_settings(rows: dict, kind: str = "dense") -> list[str]:
    """The damping rules in the result rows (every setting that is not an absolute λ)."""
    return sorted({s for (_, k, _, s) in rows if k == kind and not _num(s)})


def family_of(setting: str) -> str:
    """'rel', 'deff', 'resid', 'deff,resid', … — the rule's parts without their constants."""
    return ",".join(part.split(":")[0] for part in setting.split(","))


def choose(rows: dict, among: list[str], dims: list[int], cands: list[str], kind: str = "dense") -> str:
    """The candidate with the best mean LDS over the given cases × dims (= the least mean shortfall from the
    best fixed λ: the oracle is the same for every candidate); candidates missing a row are skipped."""

    def score(s: str) -> float:
        vals = [rows.get((c, kind, p, s), {}).get("lds") for c in among for p in dims]
        return float(np.mean(vals)) if vals and all(v is not None for v in vals) else -np.inf

    return max(cands, key=score)


def report(paths: list[str], dims: list[int], cases: list[str]) -> None:
    rows = load_rows(paths)
    ad = str(parse_lambda_reg(ADAPTIVE_SETTING).setting)  # 'adaptive' as the runs name it
    all_cases = make_cases()
    lds_of = lambda c, k, p, s: rows.get((c, k, p, s), {}).get("lds")  # noqa: E731
    print(f"\n`adaptive` = `{ad}`.\n")
    print("### Cases (C = 3 checkpoints, 100 half-subset models; LDS [95 % CI] at proj_dim 2048)\n")
    print(
        "| case | traker 0.3.2 defaults | dense, λ=0 | dense, adaptive | factored, adaptive | factored − dense | "
        "adaptive (factored) − traker |"
    )
    print("|---|---|---|---|---|---|---|")
    for c in cases:
        t, z = rows.get((c, "traker", 2048, "traker")), rows.get((c, "dense", 2048, "0"))
        a, f = rows.get((c, "dense", 2048, ad)), rows.get((c, "factored", 2048, ad))
        fd = f"{f['lds'] - a['lds']:+.3f}" if f and a else "—"
        ft = f"{f['lds'] - t['lds']:+.3f}" if f and t else "—"
        print(f"| {c}: {all_cases[c].about} | {fmt(t)} | {fmt(z)} | {fmt(a)} | {fmt(f)} | {fd} | {ft} |")

    cands = rule_settings(rows)
    fams = sorted({family_of(s) for s in cands}, key=lambda f: (f.count(","), f))
    print(
        "\n### Leave-one-case-out (every damping rule and constant chosen on the other cases — mean dense LDS over "
        f"proj_dim {', '.join(map(str, dims))} — and scored on the held-out one)\n"
    )
    print(
        "| held-out case | chosen on the others | its LDS at 256 / 1024 / 2048 | − best fixed λ at 256 / 1024 / 2048 | "
        + " | ".join(f"best `{f}` on the others: LDS at 2048" for f in fams)
        + " | held-out's own best rule |"
    )
    print("|---|---|---|---|" + "---|" * len(fams) + "---|")
    for h in cases:
        others = [c for c in cases if c != h]
        pick = choose(rows, others, dims, cands)
        vals = " / ".join(
            f"{v:.3f}" if (v := lds_of(h, "dense", p, pick)) is not None else "—" for p in (256, 1024, 2048)
        )
        gaps = []
        for p in (256, 1024, 2048):
            b, v = best_fixed(rows, h, "dense", p) or (None, None), lds_of(h, "dense", p, pick)
            gaps.append(f"{v - b[1]:+.3f}" if b[0] is not None and v is not None else "—")
        fam_cells = []
        for f in fams:
            s = choose(rows, others, dims, [x for x in cands if family_of(x) == f])
            v = lds_of(h, "dense", 2048, s)
            fam_cells.append(f"`{s}`: {v:.3f}" if v is not None else "—")
        own = choose(rows, [h], dims, cands)
        print(f"| {h} | `{pick}` | {vals} | {' / '.join(gaps)} | " + " | ".join(fam_cells) + f" | `{own}` |")

    print("\n### Damping over proj_dim (dense projector; LDS [95 % CI]; noop = exact gradients)\n")
    print("| case | lambda_reg | " + " | ".join(str(p) for p in dims) + " | noop | 1024 − 256 |")
    print("|---|---|" + "---|" * (len(dims) + 2))
    for c in cases:
        for label, s in [("0 (traker)", "0"), ("auto (rel:0.3)", "rel:0.3"), (f"**adaptive** ({ad})", ad)]:
            cells = [fmt(rows.get((c, "dense", p, s))) for p in dims] + [fmt(rows.get((c, "noop", 0, s)))]
            a, b = lds_of(c, "dense", 1024, s), lds_of(c, "dense", 256, s)
            diff = f"{a - b:+.3f}" if a is not None and b is not None else "—"
            print(f"| {c} | {label} | " + " | ".join(cells) + f" | {diff} |")
        cells, gaps = [], []
        for k, p in [("dense", p) for p in dims] + [("noop", 0)]:
            bf = best_fixed(rows, c, k, p)
            v = lds_of(c, k, p, ad)
            cells.append(f"{bf[1]:.3f} ({bf[0]})" if bf else "—")
            gaps.append(f"{v - bf[1]:+.3f}" if bf and v is not None else "—")
        print(f"| {c} | best fixed (0, rel grid) | " + " | ".join(cells) + " | |")
        print(f"| {c} | adaptive − best fixed | " + " | ".join(gaps) + " | |")


def loco(paths: list[str], dims: list[int], cases: list[str], kind: str) -> None:
    """Leave-one-case-out among the damping rules of the rows (one kind): each held-out case's pick on the others."""
    rows, ad = load_rows(paths), str(parse_lambda_reg(ADAPTIVE_SETTING).setting)
    at = lambda c, s, p: rows[(c, kind, p, s)]["lds"]  # noqa: E731
    cells = lambda c, s: " / ".join(f"{at(c, s, p):.3f}" for p in dims)  # noqa: E731
    print(f"| held-out case | chosen on the others | LDS at {dims} | `{ad}` (default) |\n|---|---|---|---|")
    for h in cases:
        pick = choose(rows, [c for c in cases if c != h], dims, rule_settings(rows, kind), kind)
        print(f"| {h} | `{pick}` | {cells(h, pick)} | {cells(h, ad)} |")
    means = [f"`{s}` {np.mean([at(c, s, p) for c in cases for p in dims]):.4f}" for s in rule_settings(rows, kind)]
    print("\nmean LDS over every case and proj_dim:", ", ".join(means))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["truth", "eval", "traker", "report", "splits", "loco"])
    ap.add_argument("--cases", nargs="*", default=None, help=f"default: all but {', '.join(LARGE_CASES)}")
    ap.add_argument("--kinds", nargs="*", default=["dense"])
    ap.add_argument("--proj-dims", nargs="*", type=int, default=[512])
    ap.add_argument("--settings", nargs="*", default=["0", "rel:0.3"])
    ap.add_argument("--checkpoints", type=int, default=NUM_CKPTS)
    ap.add_argument("--json", default=None, help="append result rows (without per-target values) to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cases = make_cases()
    names = args.cases or [c for c in cases if c not in LARGE_CASES]  # the large ones named: hours of training
    if args.what == "report":
        return report(args.json.split(","), args.proj_dims, names)
    if args.what == "splits":
        return split_table(names, cases, args.proj_dims)
    if args.what == "loco":
        return loco(args.json.split(","), args.proj_dims, names, args.kinds[0])
    out = []
    for name in names:
        case = cases[name]
        truth = ground_truth(case)
        if args.what == "truth":
            print(name, truth["stats"])
            continue
        if args.what == "traker":
            for p in args.proj_dims:
                t0 = time.perf_counter()
                r = traker_lds(case, truth, p, args.checkpoints)
                print(
                    f"| {name} | traker 0.3.2 defaults | {p} | {fmt(r)} | {time.perf_counter() - t0:.0f} s |",
                    flush=True,
                )
                out.append(
                    {"case": name, "kind": "traker", "proj_dim": p, "setting": "traker", "lds": r["lds"], "ci": r["ci"]}
                )
            continue
        for kind in args.kinds:
            for p in args.proj_dims if kind != "noop" else [0]:
                t0 = time.perf_counter()
                rows = evaluate(case, truth, kind, p, args.settings, args.checkpoints)
                for r in rows:
                    lam = float(np.mean(r["lams"]))
                    print(
                        f"| {name} | {kind} | {r['proj_dim']} | {r['setting']} | {fmt(r)} | λ {lam:.4g} | "
                        f"d_eff/min(n,p) {r['deff_frac']:.3f} |",
                        flush=True,
                    )
                    out.append({k: v for k, v in r.items() if k != "per"})
                print(f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
                _append_json(args.json, out)  # after every (case, kind, proj_dim): a long run keeps what it did
                out = []
    _append_json(args.json, out)


def _append_json(path: str | None, out: list) -> None:
    """Append result rows to a --json file (read, extend, replace: a crash leaves the previous rows)."""
    if path and out:
        old = json.load(open(path)) if os.path.exists(path) else []
        with open(path + ".tmp", "w") as fh:
            json.dump(old + out, fh, indent=0, default=float)
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
