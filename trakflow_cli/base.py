"""What every command of the CLI shares: the consoles, the one-line failure with its exit code, reading a config,
and Prefect's environment (set before Prefect is imported)."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.console import Console

from trakflow_cli.errors import INPUT_EXIT, print_error, validation_lines
from trakflow_cli.prefect_api import answers, local_api_url

console = Console(soft_wrap=True)  # text lines (paths) never hard-wrap; tables still fit the width
err_console = Console(stderr=True, soft_wrap=True)


def _prefect_env(verbose: bool, reuse_local_server: bool = False) -> None:
    """Quiet defaults, set before Prefect is imported (an explicit environment wins). With
    ``reuse_local_server`` and no PREFECT_API_URL, a Prefect server already answering on this machine
    (`prefect server start`, port PREFECT_SERVER_API_PORT or 4200) is used instead of starting Prefect's
    ephemeral one: the run shows in its UI and skips the server's start-up and shutdown."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_ALLOW_EPHEMERAL_MODE", "true")
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    if reuse_local_server and not os.environ.get("PREFECT_API_URL"):
        url = local_api_url()
        if answers(url + "/health"):
            os.environ["PREFECT_API_URL"] = url
            err_console.print(f"[dim]using the Prefect server at {url} (set PREFECT_API_URL to choose another)[/]")


def _fail(msg: str | list[str], code: int = 2, hint: bool = False):
    """One ``error:`` line per message (never wrapped: printed as given), then exit with ``code``."""
    print_error([msg] if isinstance(msg, str) else msg)
    if hint:
        err_console.print("[dim](rerun with -v for the traceback and Prefect's logs)[/]")
    raise typer.Exit(code)


def _config_errors():
    from pydantic import ValidationError

    from trak_core.errors import TrakError

    return (ValidationError, TrakError)


def _config_failure(e: Exception, where: str):
    """Exit with one ``error:`` line per problem of a config: ``where: field.path: message``."""
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        _fail(validation_lines(e, f"{where}: "), INPUT_EXIT)
    _fail(f"{where}: {' '.join(str(e).split())}", INPUT_EXIT)


def _load_config(cls, path: Path):
    try:
        return cls.from_yaml(path)
    except _config_errors() as e:
        _config_failure(e, f"invalid config {path}")
