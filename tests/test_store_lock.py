"""Two runs on one store: the second is refused while the first lives; a dead holder's lock is stale."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from trak_core.errors import StoreLockedError
from trak_core.store import StoreMetadata, TrakStore


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
        st.acquire_lock("holder-run")
        print("locked", flush=True)
        sys.stdin.readline()
        st.release_lock()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(StoreLockedError, match=r"in use by run holder-run \(pid \d+"):
            st.acquire_lock("second")
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(timeout=60) == 0
    finally:
        holder.kill()
    with st.locked("second"):
        assert st.lock_holder()["run"] == "second"
    assert st.lock_holder() is None


def test_lock_of_a_killed_process_is_stale(tmp_path):
    loc = str(tmp_path / "s")
    st = make_store(loc)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    import socket
    with open(os.path.join(loc, TrakStore.LOCK_NAME), "w") as fh:
        json.dump({"host": socket.gethostname(), "pid": pid, "run": "crashed"}, fh)
    me = st.acquire_lock("resume")  # taken over, no error
    assert me["pid"] == os.getpid()
    st.release_lock()


def test_lock_on_fsspec_memory_store():
    st = make_store("memory://locktest/s")
    with st.locked("a"):
        assert st.lock_holder()["run"] == "a"
        assert st.acquire_lock("a")["pid"] == os.getpid()  # re-entrant in one process
    assert st.lock_holder() is None


def test_force_unlock_reports_previous_holder(tmp_path):
    st = make_store(str(tmp_path / "s"))
    with open(os.path.join(str(tmp_path / "s"), TrakStore.LOCK_NAME), "w") as fh:
        json.dump({"host": "elsewhere", "pid": 1, "run": "remote"}, fh)
    with pytest.raises(StoreLockedError, match="remote"):
        st.acquire_lock("x")  # another host: assumed alive
    assert st.force_unlock()["run"] == "remote"
    assert st.lock_holder() is None
