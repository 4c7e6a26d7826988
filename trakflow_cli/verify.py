"""``trakflow verify STORE [--repair]``: check every array, flag and checksum of a store (fsck).

Prints a table of what is intact, missing or corrupt (array, chunk, rows); exits 1 on damage, 0 when intact
(or repaired). The logic is trak_core.store.verify; this module only prints.
"""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

console = Console(soft_wrap=True)  # text lines (paths) never hard-wrap; tables still fit the width
err_console = Console(stderr=True, soft_wrap=True)


def verify(
    store: str = typer.Argument(..., help="store path or URL"),
    repair: bool = typer.Option(
        False,
        "--repair",
        help="unflag the damaged rows (and what depends on them) so that a rerun recomputes exactly those",
    ),
    quick: bool = typer.Option(False, "--quick", help="list chunks only (do not read them: checksums unchecked)"),
    details: bool = typer.Option(False, "--all", help="list every array, intact ones too"),
) -> None:
    """Check every array, flag and checksum of a store; exit 1 on damage (0 after --repair)."""
    from trak_core.errors import TrakError
    from trak_core.store import TrakStore
    from trak_core.store.verify import repair_store, verify_store

    try:
        st = TrakStore.open(store, check_arrays=False)
        report = verify_store(st, read_chunks=not quick)
    except TrakError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(2) from None
    checked = "listed" if quick else "listed and read (crc32c)"
    table = Table(title=f"{store}: {len(report.arrays)} arrays, chunks {checked}")
    for col in ("array", "chunk", "rows", "status"):
        table.add_column(col)
    by_array: dict[str, list] = {}
    for d in report.damage:
        by_array.setdefault(d.array, []).append(d)
    for a in report.arrays:
        for d in by_array.get(a.array, []):
            style = "red" if d.kind != "missing" else "yellow"
            status = d.kind if d.kind != "metadata" else f"metadata: {d.detail}"
            if d.kind in ("corrupt", "misplaced") and d.detail:
                status = f"{d.kind}: {d.detail}"
            table.add_row(d.array, d.chunk, f"{d.unit} {d.rows[0]}..{d.rows[1] - 1}", f"[{style}]{status}[/]")
        if details and a.array not in by_array:
            table.add_row(a.array, f"{a.chunks} chunks", "", "[green]intact[/]")
    for line in report.root:  # the root (or a copy) is the damaged side: the arrays are checked against the seal
        table.add_row("zarr.json (root)", "", "", f"[red]metadata: {line}[/]")
    for line in report.inconsistent:
        table.add_row("", "", "", f"[red]{line}[/]")
    if not report.ok or details:
        console.print(table)
    if report.ok:
        console.print(
            f"[green]intact[/]: {len(report.arrays)} arrays, every chunk of rows marked done is present"
            + ("" if quick else ", passes its crc32c checksum and is the chunk recorded for its place")
        )
        return
    n = len(report.damage) + len(report.inconsistent) + len(report.root)
    if not repair:
        err_console.print(
            f"[bold red]damaged[/]: {n} problem(s). `trakflow verify {store} --repair` restores damaged metadata "
            "from its sealed copy or the schema, removes damaged chunks and unflags their rows (and what depends on "
            "them); a rerun then recomputes them.",
            highlight=False,
        )
        raise typer.Exit(1)
    try:
        with st.lock.held("trakflow verify --repair"):
            done = repair_store(st, report)
    except TrakError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(2) from None
    for line in done.actions:
        console.print(f"repaired: {line}", highlight=False)
    console.print(f"[green]repaired[/]: {n} problem(s); rerun the pipeline (or TRAKer) to recompute the unflagged rows")
