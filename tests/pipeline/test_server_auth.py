"""A Prefect server reachable from outside must have authentication on (README "Security"): against a real
`prefect server start` with PREFECT_SERVER_API_AUTH_STRING, `trakflow trigger` and a Prefect client fail
without PREFECT_API_AUTH_STRING and work with it."""

from __future__ import annotations

import subprocess

import pytest
from services import BIN, prefect_server

pytestmark = pytest.mark.services

AUTH = "admin:trakflow-test-secret"


def run(cmd, env, timeout=400):
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def client_call(server, auth: str | None, call):
    """``call(client)`` with a Prefect client of this process sent to ``server`` with the auth string ``auth`` (None:
    none), as a process with only PREFECT_API_URL (and PREFECT_API_AUTH_STRING) set would send it."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY, PREFECT_API_URL, temporary_settings

    with (
        temporary_settings({PREFECT_API_URL: server.api_url, PREFECT_API_AUTH_STRING: auth, PREFECT_API_KEY: None}),
        get_client(sync_client=True) as client,
    ):
        return call(client)


def test_cli_against_a_server_with_auth(tmp_path):
    import httpx

    with prefect_server(tmp_path / "prefect", auth_string=AUTH) as server:
        with_auth = dict(server.env)
        without = {k: v for k, v in server.env.items() if k != "PREFECT_API_AUTH_STRING"}
        for auth in (None, "admin:wrong"):
            with pytest.raises(httpx.HTTPStatusError) as refused:
                client_call(server, auth, lambda c: c.read_flows())
            assert refused.value.response.status_code == 401, refused.value
        assert isinstance(client_call(server, AUTH, lambda c: c.read_flows()), list)
        client_call(
            server,
            AUTH,
            lambda c: c.create_deployment(flow_id=c.create_flow_from_name("attribute"), name="auth-check"),
        )
        trigger = [str(BIN / "trakflow"), "trigger", "attribute/auth-check"]
        r = run(trigger, without)
        assert r.returncode != 0 and "401" in r.stdout + r.stderr, r.stdout + r.stderr[-2000:]
        r = run(trigger, with_auth)
        assert r.returncode == 0, r.stdout + r.stderr[-2000:]
        assert "flow run" in r.stdout and "Scheduled" in r.stdout, r.stdout
