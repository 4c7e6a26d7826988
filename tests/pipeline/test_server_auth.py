"""A Prefect server reachable from outside must have authentication on (README "Security"): against a real
`prefect server start` with PREFECT_SERVER_API_AUTH_STRING, `trakflow trigger` and a Prefect client fail
without PREFECT_API_AUTH_STRING and work with it."""

from __future__ import annotations

import subprocess

import pytest
from services import BIN, prefect_server

pytestmark = pytest.mark.services

AUTH = "admin:trakflow-test-secret"
READ = (
    "import asyncio\nfrom prefect.client.orchestration import get_client\n"
    "async def main():\n    async with get_client() as c:\n        print('flows', len(await c.read_flows()))\n"
    "asyncio.run(main())\n"
)
DEPLOY = (
    "import asyncio\nfrom prefect.client.orchestration import get_client\n"
    "async def main():\n    async with get_client() as c:\n"
    "        fid = await c.create_flow_from_name('attribute')\n"
    "        print(await c.create_deployment(flow_id=fid, name='auth-check'))\n"
    "asyncio.run(main())\n"
)


def run(cmd, env, timeout=400):
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_cli_against_a_server_with_auth(tmp_path):
    with prefect_server(tmp_path / "prefect", auth_string=AUTH) as server:
        with_auth = dict(server.env)
        without = {k: v for k, v in server.env.items() if k != "PREFECT_API_AUTH_STRING"}
        wrong = {**without, "PREFECT_API_AUTH_STRING": "admin:wrong"}
        py = str(BIN / "python")
        for env in (without, wrong):
            r = run([py, "-c", READ], env)
            assert r.returncode != 0 and "401" in r.stdout + r.stderr, r.stdout + r.stderr[-2000:]
        r = run([py, "-c", READ], with_auth)
        assert r.returncode == 0 and "flows" in r.stdout, r.stderr[-2000:]
        r = run([py, "-c", DEPLOY], with_auth)
        assert r.returncode == 0, r.stderr[-2000:]
        trigger = [str(BIN / "trakflow"), "trigger", "attribute/auth-check"]
        r = run(trigger, without)
        assert r.returncode != 0 and "401" in r.stdout + r.stderr, r.stdout + r.stderr[-2000:]
        r = run(trigger, with_auth)
        assert r.returncode == 0, r.stdout + r.stderr[-2000:]
        assert "flow run" in r.stdout and "Scheduled" in r.stdout, r.stdout
