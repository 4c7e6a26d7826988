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
    return TrakStore.create_or_open(
        location, StoreMetadata(train_set_size=10, grad_dim=4, proj_dim=2, chunk_rows=5, shard_rows=5)
    )


def test_second_live_run_is_refused_and_lock_released(tmp_path):
    loc = str(tmp_path / "s")
    st = make_store(loc)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import sys, time
        from trak_core.store import TrakStore
        st = TrakStore.open({loc!r})
        st.lock.acquire("holder-run")
        print("locked", flush=True)
        sys.stdin.readline()
        st.lock.release()
        """),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(StoreLockedError, match=r"in use by run holder-run \(pid \d+"):
            st.lock.acquire("second")
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(timeout=300) == 0
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


# ---------------------------------------------------------------------------- racing takeovers
def _dead_pid() -> int:
    return int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
        ).stdout
    )


def _write_dead_lock(loc: str, pid: int) -> None:
    import socket

    os.makedirs(loc, exist_ok=True)
    with open(os.path.join(loc, StoreLock.NAME), "w") as fh:
        json.dump({"host": socket.gethostname(), "pid": pid, "run": "crashed", "since": 0.0}, fh)


def _racer(idx, barrier, jobs, results):
    """A pool process: for each location it is given, wait for the others at the barrier, then try to take the
    lock; report won / lost (StoreLockedError) / anything else."""
    from trak_core.errors import StoreLockedError
    from trak_core.store import StoreLock

    while True:
        loc = jobs.get()
        if loc is None:
            return
        barrier.wait()
        try:
            StoreLock(loc, f"racer-{idx}").acquire()
            results.put((loc, idx, "won"))
        except StoreLockedError:
            results.put((loc, idx, "lost"))
        except Exception as e:  # noqa: BLE001 - reported to the test
            results.put((loc, idx, f"{type(e).__name__}: {e}"))


def race(tmp_path, rounds: int, racers: int) -> dict:
    """``rounds`` rounds; in each, ``racers`` processes (one pool, reused) race to take over the lock of the same
    dead holder. Returns counts of rounds by number of winners, and any unexpected outcome."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(racers)
    queues = [ctx.Queue() for _ in range(racers)]
    results = ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(i, barrier, queues[i], results), daemon=True) for i in range(racers)]
    for p in procs:
        p.start()
    dead = _dead_pid()
    winners_per_round: dict[int, int] = {}
    odd = []
    try:
        for r in range(rounds):
            loc = str(tmp_path / f"r{r}")
            _write_dead_lock(loc, dead)
            for q in queues:
                q.put(loc)
            outcome = [results.get(timeout=300) for _ in range(racers)]
            won = [i for _, i, o in outcome if o == "won"]
            odd += [o for _, _, o in outcome if o not in ("won", "lost")]
            winners_per_round[len(won)] = winners_per_round.get(len(won), 0) + 1
            if len(won) == 1:  # the lock names the winner
                assert StoreLock(loc).holder()["run"] == f"racer-{won[0]}"
    finally:
        for q in queues:
            q.put(None)
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return {"winners_per_round": winners_per_round, "odd": odd}


def test_racing_takeovers_of_a_dead_holder_have_exactly_one_winner(tmp_path):
    out = race(tmp_path, rounds=250, racers=2)
    assert out["odd"] == []
    assert out["winners_per_round"] == {1: 250}, out  # 250 racing pairs, 0 double (and 0 no) winners


def test_racing_takeovers_four_racers(tmp_path):
    out = race(tmp_path, rounds=40, racers=4)
    assert out["odd"] == []
    assert out["winners_per_round"] == {1: 40}, out


def test_takeover_claim_left_by_a_dead_process_is_reported(tmp_path):
    """A process that died between claiming a stale lock and installing its own leaves a claim file: the next
    run says so (instead of spinning or racing), and `unlock` clears it."""
    import hashlib

    loc = str(tmp_path / "s")
    pid = _dead_pid()
    _write_dead_lock(loc, pid)
    path = os.path.join(loc, StoreLock.NAME)
    with open(path, "rb") as fh:
        key = hashlib.sha256(fh.read()).hexdigest()[:32]
    import socket

    with open(path + ".takeover-" + key, "w") as fh:
        json.dump({"host": socket.gethostname(), "pid": pid, "run": "died-taking-over"}, fh)
    lock = StoreLock(loc, "next")
    with pytest.raises(StoreLockedError, match=r"takeover claim .* died .*trakflow unlock"):
        lock.acquire()
    assert lock.force_unlock()["run"] == "crashed"
    assert os.listdir(loc) == []
    assert lock.acquire()["run"] == "next"
    lock.release()


# ---------------------------------------------------------------------------- torn / empty lock files
@pytest.mark.parametrize(
    "content, what",
    [
        (b"", "empty"),
        (b"   \n", "empty"),
        (b'{"host": "h", "pi', "not a lock record"),
        (b"[1, 2]", "not a lock record"),
        (b"\xff\xfe", "not a lock record"),
    ],
)
def test_torn_lock_file_is_refused_with_a_clear_message(tmp_path, content, what):
    loc = str(tmp_path / "s")
    make_store(loc)
    with open(os.path.join(loc, StoreLock.NAME), "wb") as fh:
        fh.write(content)
    lock = StoreLock(loc, "next")
    assert lock.holder()["torn"] is True
    with pytest.raises(StoreLockedError, match=rf"lock file .*trakflow.lock is {what}.*torn.*trakflow unlock"):
        lock.acquire()
    assert lock.force_unlock()["torn"] is True
    assert lock.acquire()["run"] == "next"
    lock.release()


def test_torn_lock_in_a_run_and_in_unlock(tmp_path):
    """`trakflow run`'s lock (flows.runners.run_lock) and `trakflow unlock` on an empty lock file: a clear
    message, no JSONDecodeError; unlock removes it."""
    from types import SimpleNamespace

    from typer.testing import CliRunner

    from flows.runners import run_lock
    from trakflow_cli.main import app

    loc = str(tmp_path / "s")
    make_store(loc)
    open(os.path.join(loc, StoreLock.NAME), "wb").close()
    with pytest.raises(StoreLockedError, match="is empty"):
        with run_lock(SimpleNamespace(store=loc)):
            pass
    res = CliRunner().invoke(app, ["unlock", loc])
    assert res.exit_code == 0, res.output
    assert "torn" in res.output and "JSONDecodeError" not in res.output
    assert StoreLock(loc).holder() is None
    with run_lock(SimpleNamespace(store=loc), run="after"):
        assert StoreLock(loc).holder()["run"] == "after"


# ---------------------------------------------------------------------------- lock lost mid-run
def test_run_that_lost_its_lock_stops_before_committing_flags(tmp_path):
    import numpy as np

    from trak_core.errors import LockLostError, StateError

    loc = str(tmp_path / "s")
    make_store(loc)
    lock = StoreLock(loc, "mine")
    lock.acquire()
    st = TrakStore.open(loc)  # opened under the run's lock
    st.init_model(0)
    st.write_train_rows(0, slice(0, 5), np.ones((5, 2)), np.ones(5))
    assert st.featurized_mask(0)[:5].all()
    lock.force_unlock()  # e.g. `trakflow unlock --yes` by someone else
    with pytest.raises(LockLostError, match=r"lock this run was writing under was removed.*stopping before"):
        st.write_train_rows(0, slice(5, 10), np.ones((5, 2)), np.ones(5))
    assert not st.featurized_mask(0)[5:].any()  # no flag committed
    # taken by another run (another process): stops naming it; not retried (a StateError)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import sys
        from trak_core.store import StoreLock
        StoreLock({loc!r}, "thief").acquire()
        print("locked", flush=True)
        sys.stdin.readline()
        """),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(LockLostError, match=r"now held by run thief \(pid \d+") as e:
            st.write_partial(0, 1, np.eye(2), np.ones(5))
        assert isinstance(e.value, StateError) and isinstance(e.value, StoreLockedError)
        assert not st.partial_done(0, 1)
        with pytest.raises(LockLostError):
            st.write_inverse(0, np.eye(2))
        assert not st.model(0).inverse_done[:].any()
    finally:
        holder.kill()
        holder.wait()


def test_store_opened_without_a_lock_does_not_check(tmp_path):
    import numpy as np

    st = make_store(str(tmp_path / "s"))  # TRAKer's case: no run lock
    st.init_model(0)
    st.write_train_rows(0, slice(0, 5), np.ones((5, 2)), np.ones(5))
    assert st.featurized_mask(0)[:5].all()


# ---------------------------------------------------------------------------- the locks this process holds
def test_one_registry_for_the_engine_and_the_flows(tmp_path):
    """TRAKer's holds (engine.acquire_store) and a flow run's (flows.runners.run_lock) are counted in one registry:
    holders that share the lock count, the last release removes the lock file and the folders made for it, and a
    flow run refuses a store a TRAKer of its process holds (and the other way round), naming the holder."""
    from types import SimpleNamespace

    from flows.runners import run_lock
    from trak_core import engine
    from trak_core.store import lock as store_lock

    loc = str(tmp_path / "new" / "s.zarr")
    others = set(store_lock._HELD)  # what earlier tests' TRAKers in this process still hold
    engine.acquire_store(loc, "TRAKer one")
    engine.acquire_store(loc, "TRAKer two")  # shared by the process's TRAKers: counted
    assert StoreLock(loc).holder()["run"] == "TRAKer one"
    assert set(store_lock._HELD) - others == {os.path.abspath(loc)}
    with pytest.raises(StoreLockedError, match="in use by run TRAKer one in this process"):
        with run_lock(SimpleNamespace(store=loc), run="flow"):
            pass
    engine.release_store(loc)
    assert StoreLock(loc).holder()["run"] == "TRAKer one"  # one holder left
    engine.release_store(loc)
    assert StoreLock(loc).holder() is None and not (tmp_path / "new").exists()
    assert set(store_lock._HELD) == others
    with run_lock(SimpleNamespace(store=f"file://{loc}"), run="flow"):  # one key for a path and its file:// URL
        with pytest.raises(StoreLockedError, match="in use by run flow in this process"):
            engine.acquire_store(loc, "TRAKer three")
        assert StoreLock(loc).holder()["run"] == "flow"
    assert set(store_lock._HELD) == others and not (tmp_path / "new").exists()
