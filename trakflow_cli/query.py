"""``trakflow query STORE_OR_CONFIG --inputs FILE --k 10``: the top-k proponents and opponents of new inputs.

The inputs file is one batch: ``torch.save((x, y), "new.pt")`` or ``np.savez("new.npz", x, y)`` (tasks/query.py).
Prints a table per input (``--json``: the answer as JSON on stdout). Runs in this process, without Prefect;
the ``query`` flow (flows/query.py) is the same with artifacts.
"""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

console = Console(soft_wrap=True)  # text lines (paths) never hard-wrap; tables still fit the width
err_console = Console(stderr=True, soft_wrap=True)


def query(
    store: str = typer.Argument(..., help="store path or URL, or the YAML file of the attribute config that built it"),
    inputs: str = typer.Option(..., "--inputs", help="the batch: a .pt (torch.save((x, y))) or .npz (np.savez(x, y))"),
    k: int = typer.Option(10, "--k", help="train examples per input, at each end"),
    model: str | None = typer.Option(None, help="the model's import path pkg.mod:factory (with a store)"),
    checkpoint: list[str] | None = typer.Option(
        None,
        "--checkpoint",
        metavar="FILE",
        help="a checkpoint file, one per model_id in order, the option repeated: --checkpoint a.pt --checkpoint b.pt "
        "(default: the store's records)",
    ),
    task: str | None = typer.Option(None, help="model output function (default: the config's or the store's)"),
    device: str = typer.Option("cpu", help="cpu, cuda, cuda:N or auto"),
    report_dir: str | None = typer.Option(None, "--report-dir", help="also write the markdown table and PNGs here"),
    explain: bool = typer.Option(
        False, "--explain", help="sequence models: highlight the tokens of each proponent's text that carry its score"
    ),
    train_data: str | None = typer.Option(
        None, "--train-data", help="import path of the train data (with a store; a config names it)"
    ),
    show: str | None = typer.Option(
        None, "--show", help="import path of the function turning a row (or one token) into text (a config names it)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print the answer as JSON"),
) -> None:
    """Top-k train examples (proponents and opponents) of each input, from one pass over the store."""
    from pydantic import ValidationError

    from tasks.query import QueryConfig, run_query
    from trak_core.errors import TrakError
    from trakflow_cli.errors import validation_lines

    try:
        qc = QueryConfig(
            store=store,
            inputs=inputs,
            k=k,
            model=model,
            checkpoints=list(checkpoint) if checkpoint else None,
            task=task,
            device=device,
            report_dir=report_dir,
            explain=explain,
            train_data=train_data,
            show=show,
        )
        out = run_query(qc)
    except ValidationError as e:  # `field: message`, the field named once
        _fail(validation_lines(e)[0])
    except (TrakError, OSError) as e:
        _fail(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    if as_json:
        keep = ("store", "inputs", "k", "model_ids", "rows", "files")
        print(json.dumps({key: out[key] for key in keep}, indent=1))
        return
    console.print(
        f"[bold]{len(out['rows'])}[/] inputs against [bold]{escape(out['store'])}[/] "
        f"(checkpoints {out['model_ids']}), top {k} at each end"
    )
    for r in out["rows"]:
        lab = "" if r["label"] is None else f", label {r['label']}"
        t = Table(title=f"input {r['target']}{lab}", title_justify="left")
        for col in ("rank", "proponent", "score", "opponent", "score "):
            t.add_column(col, justify="right" if col in ("rank",) or col.startswith("score") else "left")
        for i in range(max(len(r["proponents"]), len(r["opponents"]))):
            cells = [str(i + 1)]
            for key in ("proponents", "opponents"):
                e = r[key][i] if i < len(r[key]) else None
                y = "" if e is None or e["label"] is None else f" y={e['label']}"
                cells += ["", ""] if e is None else [f"#{e['index']}{y}", f"{e['score']:+.4g}"]
            t.add_row(*cells)
        console.print(t)
        for rank, e in enumerate(r["proponents"], start=1):
            if e.get("tokens"):
                console.print(token_text(e["tokens"], f"{rank}. #{e['index']} ({e['score']:+.4g}): "))
    for f in out["files"]:
        console.print(f"[dim]wrote {escape(f)}[/]")


def token_text(tokens: list[dict], prefix: str = "") -> Text:
    """One proponent's tokens as rich text: each on a background whose strength follows its share of the score
    (green positive, red negative, relative to the largest |share|), the strongest bold and underlined; then the
    strongest token, its position and share in words (what a terminal without colours still shows)."""
    from tasks.report import strongest_token

    out = Text(prefix)
    top = max((abs(e["share"]) for e in tokens), default=0.0) or 1.0
    best = strongest_token(tokens)
    for e in tokens:
        level = abs(e["share"]) / top
        style = ""
        if level >= 0.1:
            style = ("on green" if level >= 0.5 else "on dark_green") if e["share"] > 0 else "on red"
            if e["share"] < 0 and level < 0.5:
                style = "on dark_red"
        if e is best:
            style = f"bold underline {style}".strip()
        out.append(e["text"], style=style or None)
    if best is not None:
        out.append(f"   strongest: {best['text']!r} at position {best['position']} ({best['share']:+.3g})", style="dim")
    return out


def _fail(msg: str) -> None:
    err_console.print(f"[bold red]error:[/] {escape(msg)}", soft_wrap=True)
    raise typer.Exit(2)
