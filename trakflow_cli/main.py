"""The ``trakflow`` command line: demo, run, train, evaluate, show, verify, unlock, serve, trigger.

Flows run in this process against the Prefect API in PREFECT_API_URL, or, when that is unset, a Prefect
server answering on this machine, or Prefect's ephemeral local server (started and stopped by Prefect
itself: nothing to start by hand).

The import paths in a config ("mypkg.models:make_model") name modules of the installed packages or of
the working directory, as with ``python -m``: the working directory is searched last, so it never
shadows an installed module. The repository's ``examples`` are found that way when ``trakflow`` runs from
the repository root; the digits demo is the installed package ``trakflow_demo_data``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from trakflow_cli.base import (
    _config_errors,
    _config_failure,
    _fail,
    _load_config,
    _prefect_env,
    console,
    err_console,
)
from trakflow_cli.errors import ErrorHandlingGroup, debug_enabled, validation_lines

if os.getcwd() not in sys.path and "" not in sys.path:
    sys.path.append(os.getcwd())

app = typer.Typer(
    cls=ErrorHandlingGroup,
    help="TRAK data attribution as a Prefect pipeline. A failure is reported as one `error:` line (exit code 2 "
    "for bad input, 1 otherwise); `trakflow --debug COMMAND` (or TRAKFLOW_DEBUG=1) shows its traceback.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

STAGES = {
    "train": "train (epochs)",
    "featurize": "featurize (train rows × checkpoints)",
    "finalize": "finalize (checkpoints)",
    "targets": "target gradients (checkpoints)",
    "score": "score (train rows)",
    "lds-train": "counterfactual models (subsets × seeds)",
}


class _Bars:
    """Rich progress bars fed by tasks.progress events (tasks run in this process's threads)."""

    def __init__(self, enabled: bool = True) -> None:
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err_console,
            disable=not enabled,
        )
        self.ids: dict[str, int] = {}

    def __call__(self, kind: str, stage: str, amount: float) -> None:
        if kind == "start":
            if stage in self.ids:
                self.progress.reset(self.ids[stage], total=amount)
            else:
                self.ids[stage] = self.progress.add_task(STAGES.get(stage, stage), total=amount)
        elif stage in self.ids:
            self.progress.advance(self.ids[stage], amount)

    def __enter__(self):
        from tasks import progress

        progress.add_listener(self)
        self.progress.start()
        return self

    def __exit__(self, *exc):
        from tasks import progress

        progress.remove_listener(self)
        self.progress.stop()
        return False


@app.callback()
def _root(
    debug: bool = typer.Option(
        False,
        "--debug",
        envvar="TRAKFLOW_DEBUG",
        help="on a failure, show the traceback, not just the one error line (or set TRAKFLOW_DEBUG=1)",
    ),
) -> None:
    """TRAK data attribution as a Prefect pipeline."""


@contextlib.contextmanager
def _flow_guard(verbose: bool) -> Iterator[None]:
    """Around a flow run (trakflow_cli.lifecycle): any exception ends in one ``error:`` line naming its root
    cause (exit 1; the traceback and Prefect's error logs only with -v); SIGINT/SIGTERM stop the run and
    every process it started (Prefect's ephemeral server, process-pool workers, a local Dask cluster) and
    exit with 128 + the signal number; Prefect's ephemeral server is started so that it dies with the CLI."""
    import click
    import prefect  # noqa: F401  (configures logging: the filter below goes onto its handlers)
    from prefect.exceptions import TerminationSignal

    from trakflow_cli import lifecycle

    keep = lifecycle.child_pids()
    said: list[int] = []

    def interrupted(signum: int, stopped: int | None = None) -> None:
        procs = "" if not stopped else f" and its {stopped} process{'es' if stopped > 1 else ''}"
        if not said:
            said.append(signum)
            err_console.print(
                f"[bold red]error:[/] interrupted by {signal.Signals(signum).name}: stopped the run{procs}; what "
                "was written is kept, rerun the same command to resume",
                soft_wrap=True,
            )

    signals = lifecycle.Signals(keep, interrupted)
    signals.install()
    try:
        with lifecycle.quiet_prefect_errors(not verbose):
            lifecycle.start_ephemeral_server()
            yield
    except (typer.Exit, typer.Abort, click.exceptions.Exit, click.exceptions.Abort, click.exceptions.ClickException):
        raise
    except (KeyboardInterrupt, TerminationSignal) as e:
        signum = getattr(e, "signum", None) or getattr(e, "signal", None) or signal.SIGINT
        interrupted(signum, len(lifecycle.stop_children(keep)))
        if signals.signum is not None:  # a real signal: no exit hooks waiting on the stopped server
            lifecycle.exit_now(128 + signum)
        raise typer.Exit(128 + signum) from None
    except Exception as e:
        if verbose or debug_enabled():
            import traceback

            traceback.print_exception(e)
        _fail(lifecycle.error_line(e), 1, hint=not verbose)
    finally:
        signals.restore()


def _run_flow(flow_fn, config, bars: bool = True, verbose: bool = False):
    """Run a flow on a config (its tasks run on the config's task runner: flows.runners.ConfigTaskRunner);
    a failure or a signal is reported by :func:`_flow_guard`."""
    with _flow_guard(verbose), _Bars(bars):
        return flow_fn(config)


def _text_tables(r: dict, top_k: int) -> None:
    """A target with text inputs: its sentence, then one table of proponents and one of opponents."""
    from rich.markup import escape

    lab = "" if r.get("label") is None else f" (label {r['label']})"
    console.print(f"[bold]target {r['target']}{lab}[/]: {escape(r.get('text') or '')}")
    for key, color in (("proponents", "green"), ("opponents", "red")):
        t = Table(title=f"top {key}", title_justify="left", title_style=color)
        t.add_column("rank", justify="right")
        t.add_column("train", justify="right")
        t.add_column("score", justify="right")
        t.add_column("text", overflow="fold")
        for i, e in enumerate(r[key][:top_k]):
            y = "" if e.get("label") is None else f" y={e['label']}"
            t.add_row(str(i + 1), f"#{e['index']}{y}", f"{e['score']:+.4g}", escape(e.get("text") or ""))
        console.print(t)


def _top_k_tables(rows: list[dict], top_k: int) -> None:
    for r in rows:
        if r.get("text") is not None:
            _text_tables(r, top_k)
            continue
        lab = "" if r.get("label") is None else f" (label {r['label']})"
        t = Table(title=f"target {r['target']}{lab}", title_justify="left")
        t.add_column("rank", justify="right")
        t.add_column("proponent", justify="right")
        t.add_column("score", justify="right")
        t.add_column("opponent", justify="right")
        t.add_column("score", justify="right")
        for i in range(min(top_k, len(r["proponents"]))):
            p, o = r["proponents"][i], r["opponents"][i]
            pl = "" if p.get("label") is None else f" y={p['label']}"
            ol = "" if o.get("label") is None else f" y={o['label']}"
            t.add_row(
                str(i + 1), f"#{p['index']}{pl}", f"{p['score']:+.4g}", f"#{o['index']}{ol}", f"{o['score']:+.4g}"
            )
        console.print(t)


def _print_attribution(result: dict, config) -> None:
    f, fi, sc = result["featurize"], result["finalize"], result["score"]
    console.print(
        f"store [bold]{result['store']}[/], experiment [bold]{result['exp_name']}[/]: "
        f"featurize {f['computed']} computed / {f['skipped']} skipped, "
        f"finalize {fi['computed']} / {fi['skipped']}, score {sc['computed']} / {sc['skipped']} "
        f"({result['seconds']:.1f} s)"
    )
    rep = result.get("report")
    if rep:
        _top_k_tables(rep["rows"], config.top_k)
        if rep.get("label_agreement") is not None:
            console.print(
                f"fraction of top-{config.top_k} proponents sharing the target's label: "
                f"[bold]{rep['label_agreement']:.2f}[/]"
            )
        if rep.get("files"):
            console.print("report: " + ", ".join(rep["files"]))


# ---------------------------------------------------------------------------------------------- commands
@app.command()
def demo(
    demo_dir: Path = typer.Option(Path("trakflow_demo"), "--dir", help="where checkpoints, store and report go"),
    models: int = typer.Option(3, min=1, help="checkpoints to train"),
    epochs: int = typer.Option(4, min=1, help="epochs per checkpoint"),
    proj_dim: int = typer.Option(512, min=1, help="projection dimension (< 1500 train digits)"),
    lambda_reg: str = typer.Option(
        "adaptive",
        help="ridge term λ: 'adaptive' (neff:0.12,uresid:10/0.3), a number, 'auto', 'rel:<f>', 'deff:<c>', "
        "'neff:<c>', 'resid:<k>', 'cresid:<k>', 'uresid:<k>[/<rms>]'",
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="show Prefect's logs"),
) -> None:
    """Train digit classifiers (if absent), attribute 5 held-out digits to the 1,500 train digits, report."""
    _prefect_env(verbose)
    t0 = time.perf_counter()
    from flows import digits_demo
    from tasks.trainer import is_complete
    from trak_core.settings import normalize_lambda_reg
    from trakflow_demo_data.digits import demo_configs

    train_cfg, _ = demo_configs(demo_dir, num_models=models, epochs=epochs)
    if not all(is_complete(train_cfg.out_dir, i, train_cfg.snapshots) for i in range(models)):
        console.print(f"training {models} checkpoints ({epochs} epochs each) in {train_cfg.out_dir}")
    with _flow_guard(verbose), _Bars(True):
        out = digits_demo(
            demo_dir=str(demo_dir),
            num_models=models,
            epochs=epochs,
            proj_dim=proj_dim,
            lambda_reg=normalize_lambda_reg(lambda_reg),
        )
    if out["train"] is None:
        console.print(f"checkpoints present in {train_cfg.out_dir}: not retraining")
    else:
        for r in out["train"]["models"]:
            a = "" if r.get("alpha_mean") is None else f", mean α {r['alpha_mean']:.2f}"
            console.print(
                f"  model {r['index']}: loss {r['final_loss']:.3f}, train accuracy "
                f"{r['train_accuracy']:.3f}{a}{' (kept)' if r['skipped'] else ''}"
            )
    from tasks.config import AttributeConfig

    _print_attribution(out["attribute"], AttributeConfig.from_yaml(out["config"]))
    console.print(f"config: {out['config']} (re-run with `trakflow run` on it)")
    console.print(
        f"query inputs: {demo_dir / 'query.pt'} (`trakflow query {out['config']} --inputs FILE`, or the query/digits "
        "deployment)"
    )
    console.print(f"demo finished in {time.perf_counter() - t0:.1f} s")


@app.command()
def run(
    config_file: Path = typer.Argument(..., help="YAML file of an AttributeConfig", exists=False),
    flow: str = typer.Option("attribute", help="attribute | featurize | finalize | score"),
    always_run: bool = typer.Option(False, "--always-run", help="run the flow even when the store is complete"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="show Prefect's logs"),
) -> None:
    """Run the attribute flow (or one stage of it) on a YAML config.

    The config is checked before Prefect is imported. When the store already holds everything the config
    asks for, nothing is started: the plan's checks run (a mismatching store is still refused) and the
    store's state is printed. A Prefect server already running on this machine is reused."""
    from tasks.config import AttributeConfig

    if flow not in ("attribute", "featurize", "finalize", "score"):
        _fail(f"--flow must be attribute, featurize, finalize or score, not {flow!r}")
    config = _load_config(AttributeConfig, config_file)
    if flow == "attribute" and not always_run:
        from tasks.core import up_to_date

        plan = up_to_date(config)  # a store refusing the config: one error line (trakflow_cli.errors)
        if plan is not None:
            console.print(
                f"store [bold]{plan.store}[/], experiment [bold]{plan.exp_name}[/]: complete "
                f"({plan.train_set_size} train rows × {plan.num_targets} targets, {len(plan.models)} "
                "checkpoints) — nothing to run. Top-k: `trakflow show CONFIG`; `--always-run` runs "
                "the flow anyway."
            )
            return
    _prefect_env(verbose, reuse_local_server=True)
    import flows

    result = _run_flow(getattr(flows, flow), config, verbose=verbose)
    if flow == "attribute":
        _print_attribution(result, config)
    else:
        console.print(json.dumps({k: v for k, v in result.items() if k != "manifests"}, indent=1, default=str))


@app.command("train")
def train_cmd(
    config_file: Path = typer.Argument(..., help="YAML file of a TrainConfig"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="show Prefect's logs"),
) -> None:
    """Train N checkpoints (the train flow) and write their manifest.json."""
    from tasks.config import TrainConfig

    config = _load_config(TrainConfig, config_file)
    _prefect_env(verbose, reuse_local_server=True)
    from flows import train

    res = _run_flow(train, config, verbose=verbose)
    console.print(
        f"{res['tasks']} models ({res['computed']} trained, {res['skipped']} kept); manifest: {res['manifest']}"
    )


def _demo_evaluate_config(demo_dir: Path, subsets: int, lambda_reg: str | None, verbose: bool = False):
    """The demo's evaluate setup: its checkpoints (trained here when absent) and recipe, all 297 held-out
    digits as targets (experiment 'digits-heldout'), the demo's lambda_reg unless given (another lambda_reg
    gets its own store: a finalized store keeps its λ)."""
    from flows import train
    from tasks.config import EvaluateConfig
    from tasks.trainer import is_complete
    from trak_core.settings import normalize_lambda_reg
    from trakflow_demo_data.digits import demo_configs

    train_cfg, attr = demo_configs(demo_dir)
    if not (Path(train_cfg.out_dir) / "manifest.json").is_file() or not all(
        is_complete(train_cfg.out_dir, i, train_cfg.snapshots) for i in range(train_cfg.num_models)
    ):
        console.print(f"training the demo's {train_cfg.num_models} checkpoints in {train_cfg.out_dir}")
        _run_flow(train, train_cfg, verbose=verbose)
    attr.update(exp_name="digits-heldout", target_data="trakflow_demo_data.digits:heldout_data", report_targets=5)
    report = Path(demo_dir).absolute() / "report"
    if lambda_reg is not None:
        value = normalize_lambda_reg(lambda_reg)  # any lambda_reg setting (BadInputError naming it)
        if value != attr["lambda_reg"]:
            tag = "".join(ch if ch.isalnum() or ch == "." else "-" for ch in str(value))
            report = Path(demo_dir).absolute() / f"report-lambda-{tag}"
            attr.update(
                store=str(Path(demo_dir).absolute() / f"store-lambda-{tag}.zarr"),
                lambda_reg=value,
                report_dir=str(report),
            )
    return EvaluateConfig(
        attribute=attr,
        recipe_from=str(Path(train_cfg.out_dir) / "manifest.json"),
        num_subsets=subsets,
        cache_dir=str(Path(demo_dir).absolute() / "lds_cache"),
        report_dir=str(report),
    )


@app.command()
def evaluate(
    config_file: Path | None = typer.Argument(None, help="YAML file of an EvaluateConfig (default: the demo setup)"),
    demo_dir: Path = typer.Option(Path("trakflow_demo"), "--dir", help="the demo's folder (no config)"),
    subsets: int | None = typer.Option(None, min=3, help="counterfactual models M (demo default 50)"),
    fraction: float | None = typer.Option(None, min=0.0, max=1.0, help="subset fraction (default 0.5)"),
    seeds_per_subset: int | None = typer.Option(None, min=1, help="inits per subset, margins averaged"),
    lambda_reg: str | None = typer.Option(
        None, help="demo only: lambda_reg to evaluate (number, 'adaptive', 'auto', 'rel:<f>', ...; default the demo's)"
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="show Prefect's logs"),
) -> None:
    """Counterfactual LDS of an experiment (the evaluate flow): attribute if needed, train M models on random
    subsets (cached), print the LDS. Without a config: the digits demo on its 297 held-out digits."""
    _prefect_env(verbose)
    t0 = time.perf_counter()
    from flows import evaluate as evaluate_flow
    from tasks.config import EvaluateConfig

    try:
        if config_file is None:
            config = _demo_evaluate_config(demo_dir, subsets or 50, lambda_reg, verbose)
        else:
            config = _load_config(EvaluateConfig, config_file)
        over = {
            k: v
            for k, v in (
                ("num_subsets", subsets),
                ("subset_fraction", fraction),
                ("seeds_per_subset", seeds_per_subset),
            )
            if v is not None
        }
        if over:
            config = EvaluateConfig.model_validate({**config.model_dump(), **over})
    except _config_errors() as e:
        _config_failure(e, "invalid evaluate config" if config_file is None else f"invalid config {config_file}")
    res = _run_flow(evaluate_flow, config, verbose=verbose)
    a, s = config.attribute, res["settings"]
    lam = ", ".join(f"{x:.3g}" for x in s["lambda_abs"] if x is not None)
    console.print(
        f"experiment [bold]{a.exp_name}[/] in {a.store}: {res['num_targets']} targets, {s['checkpoints']} "
        f"checkpoints, projector {s['projector']} proj_dim {s['proj_dim']}, lambda_reg {s['lambda_reg']} "
        f"(λ = {lam})"
    )
    console.print(
        f"ground truth: {res['num_subsets']} subsets × {res['seeds_per_subset']} seeds, fraction "
        f"{res['subset_fraction']}, recipe {s['recipe']}; {res['trained']} models trained now "
        f"({res['num_subsets'] * res['seeds_per_subset'] - res['trained']} reused) — {res['truth']}"
    )
    console.print(
        f"[bold]LDS = {res['lds']:.4f}[/] (95% bootstrap interval over targets "
        f"[{res['ci95'][0]:.3f}, {res['ci95'][1]:.3f}])"
    )
    if res.get("files"):
        console.print("report: " + ", ".join(res["files"]))
    console.print(f"evaluate finished in {time.perf_counter() - t0:.1f} s")


@app.command()
def show(
    store: str = typer.Argument(..., help="store path or URL, or the YAML file of an AttributeConfig"),
    exp: str | None = typer.Option(None, help="experiment (default: the config's, the only one, or 'default')"),
    target: int | None = typer.Option(None, help="print the top proponents/opponents of this target"),
    top_k: int | None = typer.Option(None, "--top-k", min=1, help="how many (default: the config's, or 5)"),
    config_file: Path | None = typer.Option(
        None, "--config", help="AttributeConfig YAML of the store: labels, and text for text inputs (its show function)"
    ),
) -> None:
    """Status per checkpoint and experiment; with --target (or a config), the top-k train examples.

    With a config (as the argument or --config) the tables are the report's: labels, and the sentences when
    the config's ``show`` returns text; without --target they cover the config's report_targets."""
    from trak_core.errors import TrakError
    from trak_core.store import TrakStore

    config = None
    if config_file is None and store.endswith((".yaml", ".yml")) and Path(store).is_file():
        config_file = Path(store)
    if config_file is not None:
        from tasks.config import AttributeConfig

        config = _load_config(AttributeConfig, config_file)
        if store == str(config_file):
            store = config.store
    try:
        with _store_metadata(store):
            st = TrakStore.open(store, None if config is None else config.storage_options, mode="r")
    except TrakError as e:
        _fail(str(e))
    exps = st.experiments()
    if exp is not None and exp not in exps:
        have = ", ".join(repr(x) for x in exps) if exps else "none (nothing has been scored)"
        _fail(f"--exp {exp!r}: store {store} has no experiment {exp!r}; its experiments: {have}")
    status = st.status()
    meta = status["metadata"]
    k = top_k or (config.top_k if config is not None else 5)
    if (target is not None or config is not None) and k > meta["train_set_size"]:  # as `trakflow query` refuses it
        where = "--top-k" if top_k else f"the config's top_k ({config_file})"
        _fail(f"{where} {k}: must be an integer from 1 to the store's {meta['train_set_size']} train rows")
    console.print(
        f"store [bold]{store}[/]: {meta['train_set_size']} train rows, grad_dim {meta['grad_dim']} → "
        f"proj_dim {meta['proj_dim']} ({meta['projector']}, {meta['proj_type']}, seed {meta['proj_seed']}), "
        f"{meta['dtype']}, shards of {meta['shard_rows']} rows, task {meta['task']}"
        + (", curvature XᵀRX (ggn)" if meta.get("curvature") == "ggn" else "")
        + (
            f", curvature {meta['curvature']} (before the projection)"
            if meta.get("curvature") in ("kfac", "ekfac")
            else ""
        )
    )
    t = Table(title="checkpoints", title_justify="left")
    for col in ("model_id", "featurized rows", "XᵀX partials", "finalized", "condition"):
        t.add_column(col)
    t.add_column("checkpoint", overflow="fold")
    for mid, info in status["models"].items():
        parts = st.num_partials_done(mid)
        fin = st.finalize_info(mid) or {}
        ck = (st.checkpoint_record(mid) or {}).get("path", "")
        t.add_row(
            str(mid),
            f"{info['featurized']}/{info['of']}",
            f"{parts}/{st.meta.num_shards}",
            "yes" if info["finalized"] else "no",
            f"{fin['condition']:.3g}" if "condition" in fin else "",
            ck,
        )
    console.print(t)
    t = Table(title="experiments", title_justify="left")
    for col in ("experiment", "targets", "target grads complete", "score rows done", "combined checkpoints"):
        t.add_column(col)
    for name, info in status["experiments"].items():
        with_ = st.scored_with(name)
        t.add_row(
            name,
            str(info["num_targets"]),
            f"{len(info['scored_models'])}/{len(info['models'])} checkpoints",
            f"{info['scores_rows_done']}/{meta['train_set_size']}",
            "" if with_ is None else str(with_),
        )
    console.print(t)
    if target is None and config is None:
        return
    if exp is None:
        exp = config.exp_name if config is not None else (exps[0] if len(exps) == 1 else "default")
    try:
        scores = st.scores(exp)[:]
    except TrakError as e:
        _fail(str(e))
    if target is not None and not 0 <= target < scores.shape[1]:
        _fail(f"--target {target} out of range [0, {scores.shape[1]}) for experiment {exp!r}")
    console.print(f"experiment [bold]{exp}[/]")
    if config is None:
        from tasks.report import top_k as top_k_of

        pro, opp = top_k_of(scores, target, k)
        row = {
            "target": target,
            "label": None,
            "proponents": [{"index": int(i), "score": float(scores[i, target])} for i in pro],
            "opponents": [{"index": int(i), "score": float(scores[i, target])} for i in opp],
        }
        _top_k_tables([row], k)
        return
    from tasks.common import adopt_train_source
    from tasks.config import load_data, load_object
    from tasks.report import add_texts, labels_of, top_k_table

    adopt_train_source(config)
    train, targets = load_data(config.train_data, "train_data"), load_data(config.target_data, "target_data")
    if targets[0].shape[0] != scores.shape[1] or train[0].shape[0] != scores.shape[0]:
        _fail(
            f"experiment {exp!r} has {scores.shape[0]} train × {scores.shape[1]} targets but the config's data has "
            f"{train[0].shape[0]} × {targets[0].shape[0]}: use the config the experiment was made with"
        )
    shown = [target] if target is not None else list(range(min(config.report_targets, scores.shape[1])))
    rows = top_k_table(st, exp, shown, k, labels_of(train), labels_of(targets))
    if config.show:
        add_texts(rows, load_object(config.show, "show"), train, targets)
    _top_k_tables(rows, k)
    agree = [r["label_agreement"] for r in rows if "label_agreement" in r]
    if agree:
        console.print(
            f"fraction of top-{k} proponents sharing the target's label: [bold]{sum(agree) / len(agree):.2f}[/]"
        )


@app.command()
def unlock(
    store: str = typer.Argument(..., help="store path or URL"),
    yes: bool = typer.Option(False, "--yes", "-y", help="remove the lock even if its holder may be alive"),
) -> None:
    """Remove a store's run lock left by a run that is gone (a crashed machine, a killed job).

    A lock of a dead process on this host is taken over by the next run anyway; this is for locks of
    another host, which trakflow cannot check. Removing the lock of a live run lets two runs write one
    store: make sure it is gone."""
    import socket

    from trak_core.store import StoreLock

    lock = StoreLock(store)
    holder = lock.holder()
    if holder is None:
        console.print(f"store {store} is not locked")
        return
    if holder.get("torn"):  # empty or unreadable: no holder to check
        lock.force_unlock()
        console.print(f"removed a torn lock file ({holder['run'][1:-1]}) from {store}", markup=False)
        return
    who = (
        f"run {holder.get('run') or '?'} (pid {holder.get('pid')} on {holder.get('host')}, since "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(float(holder.get('since', 0))))})"
    )
    if not yes and StoreLock.holder_alive(holder) and holder.get("host") == socket.gethostname():
        _fail(f"store {store} is locked by {who}, which is still running on this host; stop it first (or pass --yes)")
    lock.force_unlock()
    console.print(f"removed the lock of {who} from {store}")


@contextlib.contextmanager
def _store_metadata(store: str) -> Iterator[None]:
    """A store whose trakflow metadata (the root group's ``trakflow`` attributes) does not parse: one line per
    bad field, naming the store, exit 1 (the store is damaged, not the command)."""
    from pydantic import ValidationError

    try:
        yield
    except ValidationError as e:
        if e.title != "StoreMetadata":
            raise
        _fail(
            validation_lines(e, f"store {store}: malformed trakflow metadata (root zarr.json, attribute 'trakflow'): "),
            1,
        )


from trakflow_cli.verify import verify as _verify  # noqa: E402  (trakflow verify STORE [--repair])


@app.command("verify")
@functools.wraps(_verify)
def verify(**kwargs) -> None:
    with _store_metadata(kwargs["store"]):
        _verify(**kwargs)


from trakflow_cli import deploy as _deploy  # noqa: E402  (serve, worker, trigger: the deployments' commands)

app.command()(_deploy.serve)
app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(_deploy.worker)
app.command()(_deploy.trigger)

from trakflow_cli.query import query as _query  # noqa: E402  (trakflow query STORE_OR_CONFIG --inputs FILE)

app.command("query")(_query)

from trakflow_cli.selection import select as _select  # noqa: E402  (trakflow select STORE_OR_CONFIG --inputs FILE)

app.command("select")(_select)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
