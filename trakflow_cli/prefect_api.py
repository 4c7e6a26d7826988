"""What the CLI asks a Prefect server (no Prefect import at module level): where it answers, which
deployments it has, how a run ended."""

from __future__ import annotations

import os


def local_api_url() -> str:
    """Where `prefect server start` answers on this machine (port PREFECT_SERVER_API_PORT, default 4200)."""
    return f"http://127.0.0.1:{os.environ.get('PREFECT_SERVER_API_PORT', '4200')}/api"


def unreachable(url: str, timeout: float = 5.0) -> str | None:
    """Why nothing answers at ``url`` (connection refused, unknown host, timeout), or None when a server
    answers, with any HTTP status (a server asking for credentials answers 401)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        return " ".join(f"{type(reason).__name__}: {reason}".split())


def answers(url: str, timeout: float = 0.3) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (OSError, ValueError):
        return False


#: the config class each flow's deployments take as their ``config`` parameter
FLOW_CONFIGS = {
    "attribute": "AttributeConfig",
    "featurize": "AttributeConfig",
    "finalize": "AttributeConfig",
    "score": "AttributeConfig",
    "train": "TrainConfig",
    "evaluate": "EvaluateConfig",
}


def deployment_names() -> list[str]:
    """'flow/deployment' of every deployment the server knows."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        flows_by_id = {f.id: f.name for f in client.read_flows()}
        return sorted(f"{flows_by_id.get(d.flow_id, '?')}/{d.name}" for d in client.read_deployments())


_PARAMETER_FAILURE = "Validation of flow parameters failed with error:"


def is_parameter_failure(state) -> bool:
    """Whether the run failed on its parameters (refused by the flow's validation before it started)."""
    return (getattr(state, "message", None) or "").strip().startswith(_PARAMETER_FAILURE)


def failure_line(state) -> str:
    """The failed run's cause in one line (Prefect's state message, without its boilerplate): every line of it, so
    that a parameter validation failure keeps the fields it names (``request.inputs: ... is not a file``)."""
    import re

    msg = (getattr(state, "message", None) or "").strip()
    for prefix in ("Flow run encountered an exception: ", "Task run encountered an exception "):
        msg = msg.replace(prefix, "")
    if not msg:
        return f"the run ended {state.name if state else 'without a state'}"
    head, *rest = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    if is_parameter_failure(state):
        head = "invalid flow parameters:"
        rest = [ln.removeprefix("- ").replace("Value error, ", "") for ln in rest]
        # pydantic's loc, then a validator's message that names the field again: `request.inputs: inputs: ...`
        rest = [re.sub(r"^((?:[\w\[\]]+\.)*(\w+)): \2: ", r"\1: ", ln) for ln in rest]
    return " ".join([head, "; ".join(rest)]) if rest else head


def read_deployment(name: str):
    """The deployment ``flow-name/deployment-name`` (prefect.exceptions.ObjectNotFound when there is none)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_deployment_by_name(name)


def wait_for_run(flow_run_id, start_timeout: float, poll: float = 1.0):
    """The final state of a flow run, or None when no process has started it (it is still scheduled) after
    ``start_timeout`` seconds. Polls the API every ``poll`` seconds."""
    import time

    from prefect.client.orchestration import get_client

    t0 = time.monotonic()
    with get_client(sync_client=True) as client:
        while True:
            state = client.read_flow_run(flow_run_id).state
            if state is not None and state.is_final():
                return state
            if (state is None or state.is_scheduled()) and time.monotonic() - t0 >= start_timeout:
                return None
            time.sleep(poll)
