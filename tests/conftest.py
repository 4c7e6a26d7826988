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
# a rich Console made while COLUMNS is set keeps that width for good, so the CLI's module-level consoles would
# keep whatever a terminal (or a pytest-xdist worker) had at import; tests choose a width per invocation instead
for _var in ("COLUMNS", "LINES"):
    os.environ.pop(_var, None)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def prefect_harness():
    """A temporary Prefect server + SQLite database for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=300):
        yield


def pytest_collection_modifyitems(config, items):
    """The modules that start real services run first, then those with a test marked ``slow``: under ``make test``
    (``-n 2 --dist loadfile --no-loadscope-reorder``, modules handed out in this order) the longest modules then
    overlap the rest instead of running alone at the end. A module's tests stay together and in their order (a
    stable sort by module)."""
    services = {item.module.__name__ for item in items if item.get_closest_marker("services")}
    slow = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (item.module.__name__ not in services, item.module.__name__ not in slow))
