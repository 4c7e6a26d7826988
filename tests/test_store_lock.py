"""Two runs on one store: the second is refused while the first lives; a dead holder's lock is stale."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from trak_core.errors import StoreLockedError
from trak_core.store import StoreLock, StoreMetadata, TrakStore


def make_store(location):
    return TrakStore.create_or_open(location, StoreMetadata(train_set_size=10, grad_dim=4, proj_dim=2, chunk_rows=5,
                                                            shard_rows=5))


def test_second_live_run_is_refused_and_lock_released(tmp_path):
    loc = str(tmp_path / "s")
    st = make_store(loc)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from trak_core.store import TrakStore
        st = TrakStore.open({loc!r})
        st.lock.acquire("holder-run")
        print("locked", flush=True)
        sys.stdin.readline()
        st.lock.release()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(StoreLockedError, match=r"in use by run holder-run \(pid \d+"):
            st.lock.acquire("second")
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(timeout=60) == 0
    finally:
        holder.kill()
    with st.lock.held("second"):
        assert st.lock.holder()["run"] == "second"
    assert st.lock.holder() is None


def test_lock_of_a_killed_process_is_stale(tmp_path):
    loc = str(tmp_path / "s")
    st = make_store(loc)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    import socket
    with open(os.path.join(loc, StoreLock.NAME), "w") as fh:
        json.dump({"host": socket.gethostname(), "pid": pid, "run": "crashed"}, fh)
    me = st.lock.acquire("resume")  # taken over, no error
    assert me["pid"] == os.getpid()
    st.lock.release()


def test_lock_on_fsspec_memory_store():
    st = make_store("memory://locktest/s")
    with StoreLock(st.location, "a"):
        assert st.lock.holder()["run"] == "a"
        assert st.lock.acquire("a")["pid"] == os.getpid()  # re-entrant in one process
    assert st.lock.holder() is None


def test_force_unlock_reports_previous_holder(tmp_path):
    st = make_store(str(tmp_path / "s"))
    with open(os.path.join(str(tmp_path / "s"), StoreLock.NAME), "w") as fh:
        json.dump({"host": "elsewhere", "pid": 1, "run": "remote"}, fh)
    with pytest.raises(StoreLockedError, match="remote"):
        st.lock.acquire("x")  # another host: assumed alive
    assert st.lock.force_unlock()["run"] == "remote"
    assert st.lock.holder() is None
