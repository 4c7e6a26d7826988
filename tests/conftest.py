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


@pytest.fixture(scope="session", autouse=True)
def _flow_runs_without_a_heartbeat_thread():
    """Prefect starts a heartbeat thread per flow run (an event every 180 s, for a server to find crashed runs) and
    joins it when the run ends; the thread sleeps in steps of a second, so every flow run's end waits up to one
    (~0.5 s a run, hundreds of in-process runs here). The tests' in-process flow runs go without it; the flows the
    real-service tests start in processes of their own keep it."""
    from prefect import flow_engine

    patch = pytest.MonkeyPatch()
    patch.setattr(flow_engine.BaseFlowRunEngine, "heartbeat_seconds", property(lambda self: None))
    yield
    patch.undo()


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
    _one_worker_for_the_shared_server(items)


def _one_worker_for_the_shared_server(items) -> None:
    """The modules that use the session's real Prefect server (``real_prefect_server``, a server per xdist worker)
    handed to one worker, so that one server starts instead of two and none idles beside the other worker's tests.

    xdist's loadfile scheduler gives each worker its first module, then the next one while that worker has at most
    2 tests pending (and so on as its tests finish). So the order [first shared-server module (1 test), a module of
    more than 2 tests, the other shared-server modules, the rest] gives the first worker both shared-server modules
    while the second takes the long module. Other layouts (a shared-server module of more tests, other worker
    counts) keep the order as it was: only the saving is lost."""
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.module.__name__, []).append(item)
    shared = [m for m, its in modules.items() if any("real_prefect_server" in it.fixturenames for it in its)]
    others = [m for m in modules if m not in shared]
    partner = next((m for m in others if len(modules[m]) > 2), None)
    if len(shared) < 2 or len(modules[shared[0]]) > 2 or partner is None:
        return
    order = [shared[0], partner, *shared[1:], *(m for m in others if m != partner)]
    items[:] = [item for m in order for item in modules[m]]
