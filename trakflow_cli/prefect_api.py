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


def failure_line(state) -> str:
    """The failed run's cause in one line (Prefect's state message, without its boilerplate)."""
    msg = (getattr(state, "message", None) or "").strip()
    for prefix in ("Flow run encountered an exception: ", "Task run encountered an exception "):
        msg = msg.replace(prefix, "")
    return msg.splitlines()[0] if msg else f"the run ended {state.name if state else 'without a state'}"
