"""TRAKer(write_behind=True): rows written by a background thread while the next batches are featurized. The store
holds the same bytes as with synchronous writes; a write's error reaches the caller and leaves its rows unflagged;
a process killed with writes queued leaves a store the next run completes."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import numpy as np
import pytest
from trak_fixtures import REPO_ROOT, make_data, make_model

from trak_core.compat.traker import TRAKer
from trak_core.featurize.row_sink import RowSink
from trak_core.store import TrakStore, chunkio
from trak_core.store.verify import verify_location

N = 40


def _traker(save_dir: Path, write_behind: bool) -> TRAKer:
    return TRAKer(
        model=make_model(),
        task="image_classification",
        train_set_size=N,
        save_dir=str(save_dir),
        device="cpu",
        proj_dim=16,
        logging_level=logging.ERROR,
        chunk_rows=4,
        shard_rows=8,
        lambda_reg=1e-3,
        write_behind=write_behind,
    )


def _featurize(tr: TRAKer, batch: int = 6) -> None:
    x, y, _, _ = make_data(n=N)
    tr.load_checkpoint(make_model(1).state_dict(), model_id=0)
    for a in range(0, N, batch):
        tr.featurize((x[a : a + batch], y[a : a + batch]), num_samples=min(batch, N - a))


def _same_rows(save_dir: Path, reference: Path) -> None:
    """Every row flagged and stored as in the reference (to float16 rounding: a row featurized again in a smaller
    batch may differ in its last float32 bits), and the store verifies."""
    got, want = TrakStore.open(str(save_dir)), TrakStore.open(str(reference))
    assert got.featurized_mask(0).all()
    g, w = got.read_train_rows(0, 0, N), want.read_train_rows(0, 0, N)
    np.testing.assert_allclose(g[0].astype(np.float32), w[0].astype(np.float32), rtol=2e-3, atol=1e-6)
    np.testing.assert_allclose(g[1], w[1], rtol=1e-5)
    assert verify_location(str(save_dir)).ok


def _chunks(save_dir: Path) -> dict[str, bytes]:
    base = save_dir / "models" / "0"
    return {
        str(f.relative_to(base)): f.read_bytes() for f in sorted(base.rglob("*")) if f.is_file() and "/c/" in str(f)
    }


@pytest.fixture
def reference(tmp_path):
    tr = _traker(tmp_path / "sync", write_behind=False)
    _featurize(tr)
    tr.finalize_features()
    tr._close()
    return tmp_path / "sync"


@pytest.mark.parametrize("on_device", [False, True])  # True: each shard's partial stored by the writer too
def test_same_bytes_as_synchronous_writes(tmp_path, monkeypatch, reference, on_device):
    if on_device:
        monkeypatch.setattr(RowSink, "partials_while_featurizing", lambda self: True)
    tr = _traker(tmp_path / "behind", write_behind=True)
    _featurize(tr)
    tr._flush_rows()
    assert tr._rows._writer is not None and tr._rows._writer._thread.is_alive()
    assert tr.store.num_partials_done(0) == (5 if on_device else 0)
    tr.finalize_features()
    tr._close()
    got, want = _chunks(tmp_path / "behind"), _chunks(reference)
    assert set(got) == set(want) and got == want


def test_a_write_error_reaches_the_caller_then_a_rerun_completes(tmp_path, reference, monkeypatch):
    real_put, calls = chunkio._put, []

    def failing(path, *a):
        calls.append(path)
        if len(calls) == 7:  # the second write (rows 4..11): its grads written, the disk fails on their Q
            raise OSError(28, "No space left on device")
        real_put(path, *a)

    monkeypatch.setattr(chunkio, "_put", failing)
    tr = _traker(tmp_path / "s", write_behind=True)
    with pytest.raises(OSError, match="No space left"):
        _featurize(tr)
        tr.finalize_features()  # at the latest: it writes what is held first
    flags = TrakStore.open(str(tmp_path / "s")).featurized_mask(0)
    assert flags[:4].all() and not flags[4:].any()  # the failed write's rows (and the rest) are not flagged
    monkeypatch.setattr(chunkio, "_put", real_put)
    _featurize(tr)  # the same TRAKer featurizes what is missing
    tr.finalize_features()
    tr._close()
    _same_rows(tmp_path / "s", reference)


def test_a_dropped_traker_is_collected_and_releases_its_lock(tmp_path):
    tr = _traker(tmp_path / "s", write_behind=True)
    _featurize(tr)
    thread = tr._rows._writer._thread
    ref = weakref.ref(tr)
    del tr
    gc.collect()
    assert ref() is None and not thread.is_alive()
    assert not (tmp_path / "s" / "trakflow.lock").exists()
    again = _traker(tmp_path / "s", write_behind=False)  # the lock is free
    assert again.store.featurized_mask(0).all()


def test_a_process_killed_with_writes_queued_leaves_a_store_the_next_run_completes(tmp_path, reference):
    child = textwrap.dedent(
        f"""
        import os, sys
        sys.path[:0] = [{str(REPO_ROOT)!r}, {str(REPO_ROOT / "tests")!r}]
        from test_write_behind import _featurize, _traker
        from pathlib import Path
        from trak_core.store import chunkio
        real, n = chunkio._put, [0]
        def put(path, *a):
            n[0] += 1
            if n[0] == 10:  # killed in the middle of the writes
                os._exit(3)
            real(path, *a)
        chunkio._put = put
        tr = _traker(Path({str(tmp_path / "s")!r}), write_behind=True)
        _featurize(tr)
        tr._flush_rows()
        """
    )
    env = dict(os.environ, PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{REPO_ROOT / 'tests' / 'compat'}")
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stderr
    flags = TrakStore.open(str(tmp_path / "s")).featurized_mask(0)
    assert 0 < flags.sum() < N  # some rows written and flagged, the rest not
    tr = _traker(tmp_path / "s", write_behind=True)  # the dead process's lock is taken over
    _featurize(tr)
    tr.finalize_features()
    tr._close()
    _same_rows(tmp_path / "s", reference)


def test_write_behind_is_the_default_on_a_cuda_device_only(tmp_path, monkeypatch):
    """TRAKer's default write_behind (None): on for device="cuda" (here without CUDA: the device check and the
    featurizer are stand-ins), off for the CPU; an explicit setting wins on either."""
    from trak_core.compat import traker as compat_traker
    from trak_core.projection.projectors import DenseProjector, ProjectionType

    class _NoFeaturizer:
        def __init__(self, *args, **kwargs):
            self.gradient_computer = None

    monkeypatch.setattr(compat_traker, "check_device", lambda device: str(device))
    monkeypatch.setattr(compat_traker.engine, "Featurizer", _NoFeaturizer)
    model = make_model()
    grad_dim = sum(p.numel() for p in model.parameters())
    seen = {}
    for i, (device, setting) in enumerate([("cuda", None), ("cuda:1", None), ("cpu", None), ("cuda", False)]):
        proj = DenseProjector(grad_dim, 16, 0, ProjectionType.rademacher, "cpu")
        tr = TRAKer(
            model=model, task="image_classification", train_set_size=N, save_dir=str(tmp_path / str(i)),
            device=device, projector=proj, logging_level=logging.ERROR, write_behind=setting,
        )  # fmt: skip
        seen[(device, setting)] = tr.write_behind
        tr._close()
    assert seen == {("cuda", None): True, ("cuda:1", None): True, ("cpu", None): False, ("cuda", False): False}
    tr = _traker(tmp_path / "on", write_behind=True)  # explicit, on the CPU
    assert tr.write_behind is True
    tr._close()
