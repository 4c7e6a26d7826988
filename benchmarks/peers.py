"""trakflow (defaults, curvature options, λ rel:1, dense) beside kronfluence 1.0.1 (K-FAC, EK-FAC, heuristic damping)
and traker 0.3.2 on quality.py's cases and truth (RESULTS.md, "Beside kronfluence"): LDS, CPU and wall s, peak RSS
above the RSS before, one process per (case, column, proj_dim), scores cached in .cache/lds/peers/. kronfluence:
pip install --no-deps kronfluence==1.0.1 einops einconv opt-einsum

    python benchmarks/peers.py --cases wide-mlp bn-conv --proj-dims 512 2048
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quality  # noqa: E402

from trak_core.lds import bootstrap_ci, lds  # noqa: E402

#: trakflow's curvature options measured beside its defaults: TRAKer(curvature=<name>) for each
CURVATURES = ("ggn", "kfac", "ekfac", "kfac-eigen")
KRON = ("kfac", "ekfac")
REL = "trakflow lambda_reg=rel:1"
OUT = os.path.join(quality.CACHE, "peers")


def _margin(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """TRAK's classification margin per example: logit of the label − logsumexp of the other logits."""
    idx = torch.arange(len(labels))
    other = logits.clone()
    other[idx, labels] = -torch.inf
    return logits[idx, labels] - other.logsumexp(-1)


def _linear_gpt(model: torch.nn.Module) -> list[str]:
    """Each transformers ``Conv1D`` replaced in place by the same map as ``nn.Linear`` (what kronfluence fits)."""
    names = [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    for n in names:
        conv, lin = model.get_submodule(n), torch.nn.Linear(*model.get_submodule(n).weight.shape)
        lin.weight.data, lin.bias.data = conv.weight.data.T.contiguous(), conv.bias.data.clone()
        model.set_submodule(n, lin)
    return names


def kron_scores(case, states: list, strategy: str, batch: int = 250, **score_kw):
    """(n, m) float64 kronfluence 1.0.1 influence of each train example on each target's output (margin; a causal LM's
    log-odds), averaged over ``states``: factors (``strategy``: kfac, ekfac, identity, diagonal) fitted on the train
    rows with the sampled-label Fisher (its default), then pairwise scores; ``score_kw`` go to ScoreArguments (here
    ``damping_factor=None``: its heuristic). A GPT's ``Conv1D`` layers as ``nn.Linear``, its tied head left out."""
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task
    from torch.nn.functional import cross_entropy

    from trak_core.featurize.modelout import log_odds, sequence_log_prob

    lm, tracked, total = case.task == "causal_lm", None, 0.0

    def logits_of(batch, model):
        return model(input_ids=batch[0], attention_mask=batch[1]).logits if lm else model(*batch[:-1])

    class Outputs(Task):
        def compute_train_loss(self, batch, model, sample=False):
            logits, y = logits_of(batch, model), batch[-1]
            if lm:  # next-token loss over the scored tokens (labels -100 elsewhere)
                logits, y = logits[:, :-1].flatten(0, 1), y[:, 1:].flatten()
            if sample:  # labels drawn from the model (kronfluence's default, the true Fisher)
                with torch.no_grad():
                    y = torch.where(y != -100, torch.multinomial(torch.softmax(logits, -1), 1).flatten(), y)
            return cross_entropy(logits, y, ignore_index=-100, reduction="sum")

        def compute_measurement(self, batch, model):  # −output: kronfluence's sign then gives the output's increase
            logits = logits_of(batch, model)
            out = log_odds(sequence_log_prob(logits, batch[-1])) if lm else _margin(logits, batch[-1])
            return -out.sum()

        def get_influence_tracked_modules(self):
            return tracked

        def get_attention_mask(self, batch):
            return batch[1] if lm else None

    data, queries = (torch.utils.data.TensorDataset(*t) for t in (case.train(), case.targets()))
    with tempfile.TemporaryDirectory() as tmp:
        for i, state in enumerate(states):
            model = case.make_model()
            model.load_state_dict(state)
            tracked = _linear_gpt(model) if lm else None
            model = prepare_model(model.eval(), Outputs())
            an = Analyzer(f"c{i}", model, Outputs(), cpu=True, disable_tqdm=True, output_dir=tmp,
                          log_level=logging.WARNING)  # fmt: skip
            an.fit_all_factors("f", data, batch, factor_args=FactorArguments(strategy=strategy))
            args = ScoreArguments(**{"damping_factor": None, **score_kw})
            an.compute_pairwise_scores("s", "f", queries, data, len(queries), batch, score_args=args)
            total = total + an.load_pairwise_scores("s")["all_modules"].to(torch.float64).T.numpy()
    return total / len(states)


def _trakflow(case, truth, p, **kw) -> np.ndarray:
    from trak_core.compat.traker import TRAKer

    return quality.traker_scores(TRAKer, case, truth, proj_dim=p, logging_level=logging.ERROR, **kw)


def _dense(case, truth, p) -> np.ndarray:
    from trak_core.projection.projectors import make_projector

    return _trakflow(case, truth, p, projector=make_projector("dense", quality.grad_dim(case), p, 0, "rademacher"))


def _traker(case, truth, p) -> np.ndarray:
    from trak.traker import TRAKer

    return quality.traker_scores(TRAKer, case, truth, proj_dim=p, logging_level=logging.ERROR)


def column(name: str):
    """(function (case, truth, proj_dim) -> (n, m) scores, whether it projects) of a column: one of ``COLUMNS`` or
    ``"trakflow key=value ..."``, trakflow's TRAKer with those keywords (e.g. ``"trakflow lambda_reg=rel:1"``)."""
    if name in COLUMNS:
        return COLUMNS[name]
    if name.startswith("trakflow ") and "=" in name:
        kw = {k: float(v) if k == "curvature_damping" else v for k, v in (p.split("=", 1) for p in name.split()[1:])}
        return lambda case, truth, p: _trakflow(case, truth, p, **kw), True
    raise SystemExit(f"unknown column {name!r}: one of {list(COLUMNS)} or 'trakflow key=value ...'")


COLUMNS = {"trakflow defaults": (_trakflow, True)}
COLUMNS.update({name: column(name) for name in [f"trakflow curvature={c}" for c in CURVATURES] + [REL]})
COLUMNS["trakflow dense"] = (_dense, True)
for _s in KRON + ("identity", "diagonal"):  # the last two: kronfluence without its factors, or their diagonal
    COLUMNS[f"kronfluence {_s}"] = (lambda c, t, p, s=_s: kron_scores(c, t["states"], s), False)
COLUMNS["traker 0.3.2"] = (_traker, True)
#: the defaults, the curvature options and kronfluence's (others by ``--columns``; traker's CPU projector takes hours)
DEFAULT_COLUMNS = ["trakflow defaults"] + [f"trakflow curvature={c}" for c in CURVATURES]
DEFAULT_COLUMNS += [f"kronfluence {k}" for k in KRON]


def _path(case: str, truth: dict, column: str, p: int) -> str:
    return os.path.join(OUT, f"{case}-{truth['key']}-{column.replace(' ', '_')}-{p}.npz")


def one(case_name: str, col: str, p: int) -> None:
    """In this process: the column's scores, wall time and peak RSS above the RSS before the run, cached."""
    import psutil

    torch.set_num_threads(1)
    warnings.simplefilter("ignore", FutureWarning)  # kronfluence's torch.cuda.amp.GradScaler, on every run
    case = quality.make_cases()[case_name]
    truth, _ = quality.ground_truth(case), (case.train(), case.targets())  # data loaded before the clock
    base, cpu0, t0 = psutil.Process().memory_info().rss, time.process_time(), time.perf_counter()
    sc = column(col)[0](case, truth, p)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    os.makedirs(OUT, exist_ok=True)
    np.savez(_path(case_name, truth, col, p), scores=sc, wall=wall, cpu=cpu, peak=peak)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=["wide-mlp", "bn-conv"])
    ap.add_argument("--proj-dims", nargs="*", type=int, default=[512, 2048])
    ap.add_argument("--columns", nargs="*", default=DEFAULT_COLUMNS, help="names in COLUMNS or 'trakflow key=value'")
    ap.add_argument("--fresh", action="store_true", help="run every column again (else: its cached scores)")
    ap.add_argument("--cached", action="store_true", help="only the runs in the cache (no new run)")
    ap.add_argument("--json", default=None, help="write the table's rows here")
    ap.add_argument("--summary", action="store_true", help="one row per case and proj_dim: each column's LDS")
    ap.add_argument("--one", nargs=3, metavar=("CASE", "COLUMN", "PROJ_DIM"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        return one(a.one[0], a.one[1], int(a.one[2]))
    cases, rows = quality.make_cases(), []
    head = ["case", "proj_dim (×)"] + a.columns if a.summary else ["case", "proj_dim (×)", "column", "LDS [95 % CI]"]
    head += [] if a.summary else ["− kronfluence best (paired)", "CPU s", "wall s", "peak MiB"]
    print("| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|")
    for name in a.cases:
        truth, gd, res = quality.ground_truth(cases[name]), quality.grad_dim(cases[name]), {}
        for col in a.columns:
            for p in a.proj_dims if column(col)[1] else [0]:
                path = _path(name, truth, col, p)
                if a.cached and not os.path.exists(path):
                    continue
                if a.fresh or not os.path.exists(path):
                    subprocess.run([sys.executable, __file__, "--one", name, col, str(p)], check=True)
                with np.load(path) as f:
                    r = {k: float(f[k]) if k in f.files else float("nan") for k in ("cpu", "wall", "peak")}
                    r["lds"], r["per"] = lds(f["scores"], truth["masks"], truth["margins"])
                res[col, p] = {**r, "ci": bootstrap_ci(r["per"]), "peak": r["peak"] / 2**20}
        kron = [k for k in res if k[0].startswith("kronfluence")]
        best = max(kron, key=lambda k: res[k]["lds"]) if kron else None
        for p in a.proj_dims if a.summary else []:
            cells = [f"{(res.get((c, p)) or res.get((c, 0)) or {'lds': float('nan')})['lds']:.3f}" for c in a.columns]
            print(f"| {name} | {p} ({gd / p:,.0f}×) | " + " | ".join(cells) + " |")
        for (col, p), r in [] if a.summary else res.items():
            d = "{:+.3f} [{:+.3f}, {:+.3f}]".format(*quality.paired_ci(r["per"], res[best]["per"])) if best else "—"
            where = f"{p} ({gd / p:,.0f}×)" if p else "— (exact per layer)"
            cost = f"{r['cpu']:.0f} | {r['wall']:.0f} | {r['peak']:.0f}"
            print(f"| {name} | {where} | {col} | {quality.fmt(r)} | {d if (col, p) != best else '—'} | {cost} |")
            rows.append({"case": name, "column": col, "proj_dim": p, **{k: v for k, v in r.items() if k != "per"}})
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=0, default=float)


if __name__ == "__main__":
    main()
