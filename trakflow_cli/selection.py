"""``trakflow select STORE_OR_CONFIG --inputs FILE --fraction 0.1 --out DIR``: data selection, the train rows with
the largest summed influence on a target set (tasks/selection.py writes the files; see its docstring).

The inputs file is the target set, in ``trakflow query``'s format: ``torch.save((x, y), "val.pt")`` or
``np.savez("val.npz", x, y)``. Prints the first rows of the selection (``--json``: the answer as JSON on stdout).
Runs in this process, without Prefect; the ``select`` flow (flows/selection.py) is the same with an artifact.
"""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)

#: rows printed in the table (all are written to --out)
SHOWN = 20


def select(
    store: str = typer.Argument(..., help="store path or URL, or the YAML file of the attribute config that built it"),
    inputs: str = typer.Option(
        ..., "--inputs", help="the targets: a .pt (torch.save((x, y))) or .npz (np.savez(x, y))"
    ),
    out: str = typer.Option(..., "--out", help="folder for the selected indices, scores and rows"),
    fraction: float | None = typer.Option(None, "--fraction", help="share of the train rows to keep, in (0, 1]"),
    k: int | None = typer.Option(None, "--k", help="number of train rows to keep (instead of --fraction)"),
    opponents: bool = typer.Option(False, "--opponents", help="keep the rows with the lowest summed influence"),
    model: str | None = typer.Option(None, help="the model's import path pkg.mod:factory (with a store)"),
    checkpoint: list[str] | None = typer.Option(
        None, "--checkpoint", help="a checkpoint file, one per model_id in order (default: the store's records)"
    ),
    task: str | None = typer.Option(None, help="model output function (default: the config's or the store's)"),
    train_data: str | None = typer.Option(
        None, "--train-data", help="import path of the train data, to write the selected rows (a config names it)"
    ),
    device: str = typer.Option("cpu", help="cpu, cuda, cuda:N or auto"),
    as_json: bool = typer.Option(False, "--json", help="print the answer as JSON"),
) -> None:
    """Train rows ranked by their summed influence on the targets (one pass over the store): the top ones kept."""
    from pydantic import ValidationError

    from tasks.selection import SelectConfig, run_select
    from trak_core.errors import TrakError

    try:
        sc = SelectConfig(
            store=store,
            inputs=inputs,
            out_dir=out,
            fraction=fraction,
            k=k,
            opponents=opponents,
            model=model,
            checkpoints=list(checkpoint) if checkpoint else None,
            task=task,
            train_data=train_data,
            device=device,
        )
        ans = run_select(sc)
    except ValidationError as e:
        err = e.errors()[0]
        field, msg = ".".join(str(x) for x in err["loc"]), err["msg"].removeprefix("Value error, ")
        _fail(f"{field}: {msg}" if field else msg)  # a check of several fields names them itself
    except (TrakError, OSError) as e:
        _fail(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    if as_json:
        print(json.dumps(ans, indent=1))
        return
    which = "lowest" if opponents else "highest"
    console.print(
        f"[bold]{ans['k']}[/] of {ans['n']} train rows ({ans['fraction']:.3g}) with the {which} summed influence on "
        f"the {ans['num_targets']} targets in {escape(inputs)} (checkpoints {ans['model_ids']})"
    )
    t = Table(title=f"first {min(SHOWN, ans['k'])}", title_justify="left")
    for col in ("rank", "train row", "summed score"):
        t.add_column(col, justify="right")
    for r in ans["rows"][:SHOWN]:
        y = "" if r["label"] is None else f" y={r['label']}"
        t.add_row(str(r["rank"]), f"#{r['index']}{y}", f"{r['score']:+.4g}")
    console.print(t)
    for f in ans["files"]:
        console.print(f"[dim]wrote {escape(f)}[/]")


def _fail(msg: str) -> None:
    err_console.print(f"[bold red]error:[/] {escape(msg)}", soft_wrap=True)
    raise typer.Exit(2)
