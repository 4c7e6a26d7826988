"""The pipeline tests' shared real service: one ``prefect server start`` for the session (tests/services.py),
used by every module that needs a real server (its scheduler, served deployments, the CLI's trigger), so that
each module does not pay for a server of its own."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def real_prefect_server(tmp_path_factory):
    """A real Prefect server (SQLite under a session temp folder); at the end, its log must hold no database
    error of its services or a conflicting create."""
    from services import prefect_server

    with prefect_server(tmp_path_factory.mktemp("prefect-server")) as server:
        yield server
        log = server.read_log()
        assert "InvalidRequestError" not in log, "the server's services logged SQLAlchemy errors"
        assert "IntegrityError" not in log, "a request conflicted with the server's database (a duplicate create?)"
