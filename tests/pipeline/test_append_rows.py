"""Train rows appended to a pipeline store: the rerun featurizes only the new rows, keeps the old ones bit for
bit, re-solves every checkpoint and recomputes the scores over all rows: the same scores (and index answers) as
one run over all rows. A changed old row, or fewer rows, is refused in one line."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from trak_fixtures import tiny_attribute_config

from examples import tiny
from tasks.common import clear_data_cache
from tasks.config import AttributeConfig
from trak_core import TrakIndex
from trak_core.errors import StoreMismatchError
from trak_core.store import TrakStore
from trak_core.store.verify import verify_store

pytestmark = pytest.mark.usefixtures("prefect_harness")


def first_48():
    return tuple(t[:48] for t in tiny.train_data())


def first_40():
    return tuple(t[:40] for t in tiny.train_data())


def row_5_changed():
    x, y = tiny.train_data()
    x = x.clone()
    x[5] += 1.0
    return x, y


def cfg(root, ck, train="examples.tiny:train_data", **over):
    return AttributeConfig.model_validate(
        tiny_attribute_config(root / "s.zarr", str(ck / "model_*.pt"), train_data=train, **over)
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory, prefect_harness):
    """Two checkpoints, a store of the first 48 rows and one of all 64 built at once, both attributed: the tests grow
    copies of the first (``grown``) and compare them with the second (read only)."""
    from flows import attribute

    d = tmp_path_factory.mktemp("append")
    tiny.save_checkpoints(d / "ck", seeds=(0, 1))
    clear_data_cache()
    attribute(cfg(d / "first_48", d / "ck", "test_append_rows:first_48"))
    attribute(cfg(d / "once", d / "ck"))
    return d


def grown(built, tmp_path):
    """A copy of the store of the first 48 rows, in ``tmp_path``."""
    shutil.copytree(built / "first_48" / "s.zarr", tmp_path / "s.zarr")
    return tmp_path


def test_two_appends_equal_one_run_bit_for_bit(built, tmp_path):
    from flows import attribute

    grow, once, ck = grown(built, tmp_path), built / "once", built / "ck"
    old = TrakStore.open(str(grow / "s.zarr"), mode="r")
    kept = {
        mid: tuple(np.asarray(getattr(old.model(mid), k)[:]).copy() for k in ("grads", "out_to_loss", "xtx_partials"))
        for mid in (0, 1)
    }
    clear_data_cache()
    out = attribute(cfg(grow, ck))
    assert out["plan"].grown_from == 48 and out["plan"].train_set_size == tiny.NUM_TRAIN
    assert out["featurize"]["computed"] == 2  # one new shard of 16 rows per checkpoint
    assert out["finalize"]["computed"] == 2  # XᵀX changed: every checkpoint solved again
    grown_store, ref = TrakStore.open(str(grow / "s.zarr"), mode="r"), TrakStore.open(str(once / "s.zarr"), mode="r")
    assert grown_store.meta.train_set_size == tiny.NUM_TRAIN
    for mid in (0, 1):
        np.testing.assert_array_equal(grown_store.model(mid).grads[:48], kept[mid][0])  # the old rows, untouched
        np.testing.assert_array_equal(grown_store.model(mid).out_to_loss[:48], kept[mid][1])
        np.testing.assert_array_equal(grown_store.model(mid).xtx_partials[:3], kept[mid][2])  # old shards' partials
        assert grown_store.num_partials_done(mid) == 4 and grown_store.featurized_mask(mid).all()
        np.testing.assert_array_equal(grown_store.model(mid).grads[:], ref.model(mid).grads[:])
        np.testing.assert_array_equal(grown_store.inverse(mid), ref.inverse(mid))
    np.testing.assert_array_equal(grown_store.scores("tiny")[:], ref.scores("tiny")[:])
    report = verify_store(grown_store)
    assert report.ok, report.summary()
    x = tiny.target_data()
    a, b = TrakIndex.from_config(cfg(grow, ck)).query(x, k=5), TrakIndex.from_config(cfg(once, ck)).query(x, k=5)
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_array_equal(a.scores, b.scores)


def test_append_into_a_partial_last_shard(built, tmp_path):
    """40 rows (the last shard half full), then 64: the half shard keeps its 8 stored rows and gets 8 more."""
    from flows import attribute

    once, ck = built / "once", built / "ck"
    clear_data_cache()
    attribute(cfg(tmp_path, ck, "test_append_rows:first_40"))
    kept = {mid: TrakStore.open(str(tmp_path / "s.zarr"), mode="r").model(mid).grads[:].copy() for mid in (0, 1)}
    out = attribute(cfg(tmp_path, ck))
    assert out["plan"].grown_from == 40
    assert out["featurize"]["computed"] == 2 * 2  # shards 2 (rows 40..47 new) and 3, per checkpoint
    grown_store, ref = (
        TrakStore.open(str(tmp_path / "s.zarr"), mode="r"),
        TrakStore.open(str(once / "s.zarr"), mode="r"),
    )
    for mid in (0, 1):
        np.testing.assert_array_equal(grown_store.model(mid).grads[:40], kept[mid])
        np.testing.assert_allclose(grown_store.model(mid).grads[:], ref.model(mid).grads[:], rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(grown_store.scores("tiny")[:], ref.scores("tiny")[:], rtol=1e-4, atol=1e-6)
    assert verify_store(grown_store).ok


def test_changed_old_row_or_fewer_rows_refused(built, tmp_path):
    from flows import attribute

    root, ck = grown(built, tmp_path), built / "ck"
    clear_data_cache()
    before = TrakStore.open(str(root / "s.zarr"), mode="r")
    with pytest.raises(StoreMismatchError, match=r"train_data: rows 0\.\.15 differ") as e:
        attribute(cfg(root, ck, "test_append_rows:row_5_changed"))
    assert "\n" not in str(e.value)
    with pytest.raises(StoreMismatchError, match="train_data: 40 rows, but the store .* holds 48") as e:
        attribute(cfg(root, ck, "test_append_rows:first_40"))
    after = TrakStore.open(str(root / "s.zarr"), mode="r")
    assert after.meta == before.meta  # nothing written
    np.testing.assert_array_equal(after.scores("tiny")[:], before.scores("tiny")[:])


@pytest.mark.slow
def test_growth_interrupted_before_the_root_is_written(built, tmp_path, monkeypatch):
    """A run that dies while growing the store (arrays resized, root metadata not yet written): the store is
    refused on open, `verify --repair` puts its arrays back to the root's size (no chunk deleted), and the rerun
    grows it and scores as one run over all rows."""
    from flows import attribute
    from trak_core.errors import StoreDamageError
    from trak_core.store import grow
    from trak_core.store.verify import repair_store, verify_location

    grow_root, once, ck = grown(built, tmp_path), built / "once", built / "ck"
    clear_data_cache()
    old = TrakStore.open(str(grow_root / "s.zarr"), mode="r")
    kept = old.model(0).grads[:].copy()

    def dies(*a, **k):
        raise RuntimeError("killed while growing")

    with monkeypatch.context() as m:
        m.setattr(grow, "write_root", dies)
        with pytest.raises(RuntimeError, match="killed while growing"):
            attribute(cfg(grow_root, ck))
    location = str(grow_root / "s.zarr")
    with pytest.raises(StoreDamageError, match="shape"):
        TrakStore.open(location)
    report = verify_location(location)
    repair_store(TrakStore.open(location, check_arrays=False), report)
    assert verify_location(location).ok
    np.testing.assert_array_equal(TrakStore.open(location, mode="r").model(0).grads[:], kept)
    attribute(cfg(grow_root, ck))
    grown_store, ref = TrakStore.open(location, mode="r"), TrakStore.open(str(once / "s.zarr"), mode="r")
    np.testing.assert_array_equal(grown_store.scores("tiny")[:], ref.scores("tiny")[:])
    # a store that recorded the whole data's fingerprint only (before row fingerprints): its rows as one range
    from trak_core import engine
    from trak_core.lds import array_fingerprint

    store = TrakStore.open(location)
    info = store.pipeline_info()
    del info["train_data_rows"]
    store.set_pipeline_info(info)
    full, changed = tiny.train_data(), row_5_changed()
    engine.check_train_data(store, array_fingerprint(full), tiny.NUM_TRAIN, engine.train_rows_print(full))
    with pytest.raises(StoreMismatchError, match=r"train_data: rows 0\.\.63 differ"):
        engine.check_train_data(store, array_fingerprint(changed), tiny.NUM_TRAIN, engine.train_rows_print(changed))
