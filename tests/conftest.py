"""Shared fixtures. Prefect gets a throw-away home (so tests never touch ~/.prefect or a profile's API
URL) and no telemetry; flow tests share one session-scoped prefect_test_harness."""

import atexit
import os
import shutil
import tempfile

if "PREFECT_HOME" not in os.environ:
    _home = tempfile.mkdtemp(prefix="trakflow-test-prefect-")
    atexit.register(shutil.rmtree, _home, True)
    os.environ["PREFECT_HOME"] = _home
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def prefect_harness():
    """A temporary Prefect server + SQLite database for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
