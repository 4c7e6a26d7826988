"""Train rows appended to a pipeline store: the rerun featurizes only the new rows, keeps the old ones bit for
bit, re-solves every checkpoint and recomputes the scores over all rows: the same scores (and index answers) as
one run over all rows. A changed old row, or fewer rows, is refused in one line."""

from __future__ import annotations

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


def cfg(root, train="examples.tiny:train_data", **over):
    return AttributeConfig.model_validate(
        tiny_attribute_config(root / "s.zarr", str(root / "ck" / "model_*.pt"), train_data=train, **over)
    )


def _stores(tmp_path, first: str, **over):
    """A store built in two runs (``first`` rows, then all 64) and one built at once; both attributed."""
    from flows import attribute

    grow, once = tmp_path / "grow", tmp_path / "once"
    for root in (grow, once):
        tiny.save_checkpoints(root / "ck", seeds=(0, 1))
    clear_data_cache()
    attribute(cfg(grow, first, **over))
    old = TrakStore.open(str(grow / "s.zarr"), mode="r")
    kept = {
        mid: tuple(np.asarray(getattr(old.model(mid), k)[:]).copy() for k in ("grads", "out_to_loss", "xtx_partials"))
        for mid in (0, 1)
    }
    out = attribute(cfg(grow, **over))
    attribute(cfg(once, **over))
    return grow, once, kept, out


def test_two_appends_equal_one_run_bit_for_bit(tmp_path):
    grow, once, kept, out = _stores(tmp_path, "test_append_rows:first_48")
    assert out["plan"].grown_from == 48 and out["plan"].train_set_size == tiny.NUM_TRAIN
    assert out["featurize"]["computed"] == 2  # one new shard of 16 rows per checkpoint
    assert out["finalize"]["computed"] == 2  # XᵀX changed: every checkpoint solved again
    grown, ref = TrakStore.open(str(grow / "s.zarr"), mode="r"), TrakStore.open(str(once / "s.zarr"), mode="r")
    assert grown.meta.train_set_size == tiny.NUM_TRAIN
    for mid in (0, 1):
        np.testing.assert_array_equal(grown.model(mid).grads[:48], kept[mid][0])  # the old rows, untouched
        np.testing.assert_array_equal(grown.model(mid).out_to_loss[:48], kept[mid][1])
        np.testing.assert_array_equal(grown.model(mid).xtx_partials[:3], kept[mid][2])  # old shards' partials
        assert grown.num_partials_done(mid) == 4 and grown.featurized_mask(mid).all()
        np.testing.assert_array_equal(grown.model(mid).grads[:], ref.model(mid).grads[:])
        np.testing.assert_array_equal(grown.inverse(mid), ref.inverse(mid))
    np.testing.assert_array_equal(grown.scores("tiny")[:], ref.scores("tiny")[:])
    report = verify_store(grown)
    assert report.ok, report.summary()
    x = tiny.target_data()
    a, b = TrakIndex.from_config(cfg(grow)).query(x, k=5), TrakIndex.from_config(cfg(once)).query(x, k=5)
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_array_equal(a.scores, b.scores)


def test_append_into_a_partial_last_shard(tmp_path):
    """40 rows (the last shard half full), then 64: the half shard keeps its 8 stored rows and gets 8 more."""
    grow, once, kept, out = _stores(tmp_path, "test_append_rows:first_40")
    assert out["plan"].grown_from == 40
    assert out["featurize"]["computed"] == 2 * 2  # shards 2 (rows 40..47 new) and 3, per checkpoint
    grown, ref = TrakStore.open(str(grow / "s.zarr"), mode="r"), TrakStore.open(str(once / "s.zarr"), mode="r")
    for mid in (0, 1):
        np.testing.assert_array_equal(grown.model(mid).grads[:40], kept[mid][0])
        np.testing.assert_allclose(grown.model(mid).grads[:], ref.model(mid).grads[:], rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(grown.scores("tiny")[:], ref.scores("tiny")[:], rtol=1e-4, atol=1e-6)
    assert verify_store(grown).ok


def test_changed_old_row_or_fewer_rows_refused(tmp_path):
    from flows import attribute

    tiny.save_checkpoints(tmp_path / "ck", seeds=(0,))
    clear_data_cache()
    attribute(cfg(tmp_path, "test_append_rows:first_48"))
    before = TrakStore.open(str(tmp_path / "s.zarr"), mode="r")
    with pytest.raises(StoreMismatchError, match=r"train_data: rows 0\.\.15 differ") as e:
        attribute(cfg(tmp_path, "test_append_rows:row_5_changed"))
    assert "\n" not in str(e.value)
    with pytest.raises(StoreMismatchError, match="train_data: 40 rows, but the store .* holds 48") as e:
        attribute(cfg(tmp_path, "test_append_rows:first_40"))
    after = TrakStore.open(str(tmp_path / "s.zarr"), mode="r")
    assert after.meta == before.meta  # nothing written
    np.testing.assert_array_equal(after.scores("tiny")[:], before.scores("tiny")[:])


def test_growth_interrupted_before_the_root_is_written(tmp_path, monkeypatch):
    """A run that dies while growing the store (arrays resized, root metadata not yet written): the store is
    refused on open, `verify --repair` puts its arrays back to the root's size (no chunk deleted), and the rerun
    grows it and scores as one run over all rows."""
    from flows import attribute
    from trak_core.errors import StoreDamageError
    from trak_core.store import grow
    from trak_core.store.verify import repair_store, verify_location

    grow_root, once = tmp_path / "grow", tmp_path / "once"
    for root in (grow_root, once):
        tiny.save_checkpoints(root / "ck", seeds=(0, 1))
    clear_data_cache()
    attribute(cfg(grow_root, "test_append_rows:first_48"))
    old = TrakStore.open(str(grow_root / "s.zarr"), mode="r")
    kept = old.model(0).grads[:].copy()

    def dies(*a, **k):
        raise RuntimeError("killed while growing")

    with monkeypatch.context() as m:
        m.setattr(grow, "write_root", dies)
        with pytest.raises(RuntimeError, match="killed while growing"):
            attribute(cfg(grow_root))
    location = str(grow_root / "s.zarr")
    with pytest.raises(StoreDamageError, match="shape"):
        TrakStore.open(location)
    report = verify_location(location)
    repair_store(TrakStore.open(location, check_arrays=False), report)
    assert verify_location(location).ok
    np.testing.assert_array_equal(TrakStore.open(location, mode="r").model(0).grads[:], kept)
    attribute(cfg(grow_root))
    attribute(cfg(once))
    grown, ref = TrakStore.open(location, mode="r"), TrakStore.open(str(once / "s.zarr"), mode="r")
    np.testing.assert_array_equal(grown.scores("tiny")[:], ref.scores("tiny")[:])
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
