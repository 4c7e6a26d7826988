"""The deployments' commands: ``trakflow serve`` (register and serve them), ``trakflow worker`` (a work pool's
worker) and ``trakflow trigger`` (start a run, as the UI's Run button does, and optionally wait for it). Registered
on the app by :mod:`trakflow_cli.main`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from trakflow_cli.base import (
    _config_errors,
    _config_failure,
    _fail,
    _load_config,
    _prefect_env,
    console,
    err_console,
)
from trakflow_cli.errors import INPUT_EXIT, validation_lines
from trakflow_cli.prefect_api import (
    FLOW_CONFIGS,
    deployment_names,
    failure_line,
    is_parameter_failure,
    local_api_url,
    read_deployment,
    unreachable,
    wait_for_run,
)


def serve(verbose: bool = typer.Option(True, help="show Prefect's logs")) -> None:
    """Register the deployments (one on a cron schedule) and serve them until SIGINT or SIGTERM.

    On the server in PREFECT_API_URL, or a Prefect server answering on this machine. A signal stops the
    serving process and the runs it started within 10 s (exit 128 + the signal's number)."""
    _prefect_env(verbose, reuse_local_server=True)
    from trakflow_cli.lifecycle import supervise

    # -P and the working directory appended: it never shadows an installed module (as in this process)
    code = "import os, sys; sys.path.append(os.getcwd()); from deployments.serve import main; main()"
    raise typer.Exit(supervise([sys.executable, "-P", "-c", code]))


def worker(
    ctx: typer.Context,
    pool: str = typer.Option(..., "--pool", "-p", help="the work pool whose runs to execute"),
    verbose: bool = typer.Option(True, help="show Prefect's logs"),
) -> None:
    """`prefect worker start --pool POOL [ARGS]` (the work-pool route: deployments/prefect.yaml) until SIGINT or
    SIGTERM, which stop the worker and the runs it started within 10 s (exit 128 + the signal's number).
    Further arguments go to Prefect's worker (e.g. --limit 1)."""
    _prefect_env(verbose, reuse_local_server=True)
    from trakflow_cli.lifecycle import supervise

    raise typer.Exit(supervise([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, *ctx.args]))


def trigger(
    deployment: str = typer.Argument("attribute/digits", help="'flow-name/deployment-name'"),
    config_file: Path | None = typer.Option(
        None, "--config", help="YAML config replacing the deployment's (a query's request, for query deployments)"
    ),
    inputs: Path | None = typer.Option(
        None, "--inputs", help="query deployments: the inputs file (.pt/.npz) to attribute, in the deployment's request"
    ),
    wait: bool = typer.Option(False, help="wait for the run to finish; exit 1 with its error if it fails"),
    start_timeout: float = typer.Option(
        60.0, "--start-timeout", min=0, help="with --wait: give up when no process has started the run in this many s"
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="show Prefect's logs"),
) -> None:
    """Start a run of a deployment on the server in PREFECT_API_URL (like the UI's Run button).

    A --config (or --inputs) is validated here, against the config class of the deployment's flow, before it is
    sent. With --wait, the run must be started by a process serving the deployment (`trakflow serve`, or a worker
    of its pool) within --start-timeout seconds."""
    params = None
    flow_name = deployment.split("/", 1)[0]
    if inputs is not None and flow_name != "query":
        _fail(f"--inputs: only query deployments take an inputs file, not {deployment!r} (use --config)")
    if config_file is not None and inputs is not None:
        _fail("--inputs and --config: give one (a query's --config holds its inputs)")
    if config_file is not None:
        params = {_trigger_key(flow_name): _trigger_config(flow_name, config_file)}
    _prefect_env(verbose, reuse_local_server=True)
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():  # Prefect would start a throw-away server that holds no deployment
        _fail(
            f"no Prefect server to trigger {deployment!r} on: PREFECT_API_URL is not set and no server answers at "
            f"{local_api_url()}. Start one (`prefect server start`), serve the deployments on it "
            f"(`PREFECT_API_URL={local_api_url()} trakflow serve`), then trigger (or set PREFECT_API_URL to your "
            "server)",
            1,
        )
    url = str(PREFECT_API_URL.value())
    reason = unreachable(url.rstrip("/") + "/health")
    if reason is not None:  # Prefect's client would retry for seconds, then raise a long traceback
        _fail(
            f"the Prefect API at {url} cannot be reached ({reason}): start the server (`prefect server start`) or "
            "set PREFECT_API_URL to one that answers",
            1,
        )
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    try:
        if inputs is not None:
            params = {"request": _query_request(read_deployment(deployment).parameters.get("request"), inputs)}
        fr = run_deployment(deployment, parameters=params, timeout=0)
    except ObjectNotFound:
        names = deployment_names()
        _fail(
            f"no deployment {deployment!r} on {os.environ.get('PREFECT_API_URL') or 'the ephemeral server'}; "
            + (f"available: {', '.join(names)}" if names else "none is registered (start `trakflow serve`)")
        )
    console.print(f"flow run {fr.name} ({fr.id}): {fr.state.name if fr.state else 'scheduled'}")
    if not wait:
        return
    err_console.print(
        f"[dim]waiting for a process serving {deployment!r} (`trakflow serve`, or a worker of its pool) to start "
        f"it (up to {start_timeout:g} s) and for the run to end[/]",
        highlight=False,
    )
    state = wait_for_run(fr.id, start_timeout)
    if state is None:
        _fail(
            f"flow run {fr.name} of {deployment!r} was not started within {start_timeout:g} s: no process serves the "
            f"deployment on {url} (start `trakflow serve` there, or a worker of its pool; --start-timeout to wait "
            "longer). The run stays scheduled and starts once one does.",
            1,
        )
    console.print(f"flow run {fr.name} ({fr.id}): {state.name}")
    if not state.is_completed():
        _fail(failure_line(state), INPUT_EXIT if is_parameter_failure(state) else 1)


def _trigger_key(flow_name: str) -> str:
    """The parameter a flow's deployments take their config as."""
    return "request" if flow_name == "query" else "config"


def _trigger_config(flow_name: str, path: Path) -> dict:
    """A --config for a deployment of ``flow_name``, validated against its config class (one line per error)."""
    if flow_name == "query":
        import yaml

        from tasks.query import QueryConfig

        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as e:
            _fail(f"invalid config {path}: {' '.join(str(e).split())}")
        if not isinstance(data, dict):
            _fail(f"invalid config {path}: must hold a mapping of field: value (a QueryConfig)")
        try:
            return QueryConfig.model_validate(data).model_dump(mode="json", exclude_unset=True)
        except _config_errors() as e:
            _config_failure(e, f"invalid config {path}")
    import tasks.config

    cls = getattr(tasks.config, FLOW_CONFIGS.get(flow_name, ""), None)
    if cls is None:
        _fail(
            f"--config: deployments of flow {flow_name!r} take no config (flows with one: "
            f"{', '.join(sorted([*FLOW_CONFIGS, 'query']))})"
        )
    return _load_config(cls, path).model_dump(mode="json", exclude_unset=True)


def _query_request(request: dict | None, inputs: Path) -> dict:
    """The deployment's query request with ``inputs`` (absolute: the serving process may run elsewhere), validated
    here."""
    from pydantic import ValidationError

    from tasks.query import QueryConfig

    req = {**(request or {}), "inputs": str(inputs.absolute())}
    try:
        return QueryConfig.model_validate(req).model_dump(mode="json", exclude_unset=True)
    except ValidationError as e:
        _fail(validation_lines(e, "--inputs FILE: the query's request: "))
    raise AssertionError("unreachable")
