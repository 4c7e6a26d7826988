"""A run killed at any write of scoring resumes with the same command and gives an uninterrupted run's scores bit
for bit: a chunk written but not yet sealed for its place is rewritten on the rerun, never taken for a chunk that
moved (which is still refused). Each write of the store (a chunk file, a place record, a zarr key) is counted; the
run is killed at the Nth (that write and every later one fail, as in a dead process), for every N."""

from __future__ import annotations

import gc
import logging
import shutil
import warnings

import numpy as np
import pytest
import zarr
from trak_fixtures import checkpoints, make_data, make_model

from trak_core import TRAKer
from trak_core.errors import StoreDamageError
from trak_core.store import TrakStore, chunkio
from trak_core.store import places as store_places

N, M = 32, 3


class Killed(RuntimeError):
    pass


class Writes:
    """Counts the store's writes; from the ``at``-th on, each raises :class:`Killed`."""

    def __init__(self, monkeypatch, at: int | None = None):
        self.count, self.at = 0, at
        real_put, real_local, real_set = chunkio._put, store_places._write_local, zarr.storage.LocalStore.set

        def hit():
            self.count += 1
            if self.at is not None and self.count >= self.at:
                raise Killed(f"killed at write {self.count}")

        def put(*a, **k):
            hit()
            return real_put(*a, **k)

        def local(*a, **k):
            hit()
            return real_local(*a, **k)

        async def zset(store, key, value, *a, **k):
            if not key.endswith("trakflow.lock"):
                hit()
            return await real_set(store, key, value, *a, **k)

        monkeypatch.setattr(chunkio, "_put", put)
        monkeypatch.setattr(store_places, "_write_local", local)
        monkeypatch.setattr(zarr.storage.LocalStore, "set", zset)


def _traker(save_dir) -> TRAKer:
    return TRAKer(
        model=make_model(),
        task="image_classification",
        train_set_size=N,
        save_dir=str(save_dir),
        device="cpu",
        proj_dim=8,
        lambda_reg=1e-2,
        use_half_precision=False,
        logging_level=logging.ERROR,
    )


def _score(save_dir, ck, data) -> np.ndarray:
    """The scoring part of the TRAK recipe (the command that is run again after a crash)."""
    _, _, xt, yt = data
    tr = _traker(save_dir)
    try:
        for i, c in enumerate(ck):
            tr.start_scoring_checkpoint("exp", c, i, M)
            tr.score((xt, yt), num_samples=M)
        return np.array(tr.finalize_scores("exp"))
    finally:
        del tr
        gc.collect()


def _featurize(save_dir, ck, data) -> None:
    x, y, _, _ = data
    tr = _traker(save_dir)
    for i, c in enumerate(ck):
        tr.load_checkpoint(c, model_id=i)
        for a in range(0, N, 16):
            tr.featurize((x[a : a + 16], y[a : a + 16]), num_samples=16)
    tr.finalize_features()
    del tr
    gc.collect()


@pytest.fixture(scope="module")
def featurized(tmp_path_factory):
    """A store of 1 checkpoint, featurized and finalized (no experiment yet), and the uninterrupted scores."""
    d = tmp_path_factory.mktemp("kills")
    data = make_data(n=N, m=M)
    ck = checkpoints(1)
    _featurize(d / "base.zarr", ck, data)
    shutil.copytree(d / "base.zarr", d / "ref.zarr")
    return d, ck, data, _score(d / "ref.zarr", ck, data)


@pytest.mark.slow
def test_a_kill_at_every_write_of_scoring_resumes_bit_for_bit(featurized, tmp_path, monkeypatch, request):
    d, ck, data, want = featurized
    with monkeypatch.context() as m:
        counter = Writes(m)
        shutil.copytree(d / "base.zarr", tmp_path / "count.zarr")
        np.testing.assert_array_equal(_score(tmp_path / "count.zarr", ck, data), want)
    total = counter.count
    assert total > 20  # chunks, their pending records and seals, flags, zarr metadata
    # each run ends with a full gc.collect() (a dead process frees what it held): objects from before the loop
    # go to gc's permanent generation, so those collections walk only what the runs made
    gc.freeze()
    request.addfinalizer(gc.unfreeze)
    for at in range(1, total + 1):
        run = tmp_path / f"k{at}.zarr"
        shutil.copytree(d / "base.zarr", run)
        with monkeypatch.context() as m:
            Writes(m, at)
            with pytest.raises(Killed):
                _score(run, ck, data)
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                got = _score(run, ck, data)  # the same command again
        except Exception as e:
            raise AssertionError(f"killed at write {at} of {total}: the rerun fails") from e
        assert got.tobytes() == want.tobytes(), f"killed at write {at} of {total}"
        damage = [
            str(w.message) for w in seen if "does not belong" in str(w.message) or "place record" in str(w.message)
        ]
        assert not damage, f"killed at write {at} of {total}: the crash was taken for damage: {damage[0]}"
        shutil.rmtree(run)


def test_a_chunk_moved_onto_a_sealed_scores_place_is_still_refused(featurized, tmp_path):
    """Scores of another checkpoint in another store: their chunk decodes (its crc32c is whole) but is not the one
    sealed for this place; copied over this store's scores, reading them is refused."""
    d, ck, data, want = featurized
    other = checkpoints(2)[1:]
    _featurize(tmp_path / "other.zarr", other, data)
    assert not np.array_equal(_score(tmp_path / "other.zarr", other, data), want)
    run = tmp_path / "moved.zarr"
    shutil.copytree(d / "ref.zarr", run)
    path = "experiments/exp/scores/c/0/0"
    shutil.copyfile(tmp_path / "other.zarr" / path, run / path)
    with pytest.raises(StoreDamageError, match=r"array experiments/exp/scores, chunk c/0/0 .* does not belong here"):
        TrakStore.open(str(run), mode="r").experiment("exp").scores[:]
