"""Chunks that are whole but in the wrong place: swapped within an array, copied from another model's array, or
from another store. Each chunk's place record (trak_core.store.places) is sealed for (store id, array, chunk
coordinates, the chunk's crc32c): reading a misplaced chunk raises one line naming the array and the chunk,
``trakflow verify`` names each, and after ``--repair`` a rerun gives the undamaged scores (bit for bit).

Layout of the tiny stores (test_store_damage): 64 train rows in chunks of 8 (grads chunk c/3/0 = rows 24..31),
shards of 16; the scores in chunks of 16 rows (c/3/0 = rows 48..63).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_store_damage import clean, config, copy, run_steps, traker_run  # noqa: F401  (clean: a fixture)
from typer.testing import CliRunner

from examples import tiny
from trak_core.errors import StoreDamageError
from trak_core.store import TrakStore
from trak_core.store.verify import repair_store, verify_location

MISPLACED = "does not belong here"


def swap(a: Path, b: Path) -> None:
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)


def damage_of(store) -> list[tuple[str, str, str]]:
    return [(d.array, d.chunk, d.kind) for d in verify_location(str(store)).damage]


def repaired_scores(store: Path, clean_) -> np.ndarray:
    """``trakflow verify --repair`` (the CLI), then the pipeline's rerun."""
    from trakflow_cli.main import app

    out = CliRunner().invoke(app, ["verify", str(store), "--repair"], terminal_width=200)
    assert out.exit_code == 0, out.output
    assert verify_location(str(store)).ok
    return run_steps(config(store, clean_["ckpts"]))


@pytest.fixture(scope="module")
def other_store(clean):  # noqa: F811
    """Another store of the same shapes (other checkpoints), complete."""
    tmp = clean["tmp"] / "other"
    ckpts = tiny.save_checkpoints(tmp / "ck", seeds=(5, 6))
    run_steps(config(tmp / "o.zarr", ckpts))
    return tmp / "o.zarr"


@pytest.mark.parametrize(
    "array,first,second,rows",
    [
        ("models/0/grads", "c/3/0", "c/4/0", "rows 24..31"),
        ("models/1/out_to_loss", "c/3", "c/4", "rows 24..31"),
    ],
)
def test_two_chunks_of_one_array_swapped(clean, tmp_path, array, first, second, rows):  # noqa: F811
    store = copy(clean, "finalize", tmp_path / "s.zarr")
    swap(store / array / first, store / array / second)
    with pytest.raises(StoreDamageError, match=rf"^store .*: array {array}, chunk {first} \({rows}\) {MISPLACED}"):
        run_steps(config(store, clean["ckpts"]))
    assert {(array, first, "misplaced"), (array, second, "misplaced")} <= set(damage_of(store))
    np.testing.assert_array_equal(repaired_scores(store, clean), clean["scores"])


@pytest.mark.parametrize("array,chunk", [("grads", "c/2/0"), ("inverse", "c/0/0/0")])
def test_model_1s_chunk_copied_over_model_0s(clean, tmp_path, array, chunk):  # noqa: F811
    store = copy(clean, "finalize", tmp_path / "s.zarr")
    shutil.copyfile(store / "models/1" / array / chunk, store / "models/0" / array / chunk)
    with pytest.raises(StoreDamageError, match=rf"array models/0/{array}, chunk {chunk}.* {MISPLACED}"):
        run_steps(config(store, clean["ckpts"]))
    assert damage_of(store) == [(f"models/0/{array}", chunk, "misplaced")]
    np.testing.assert_array_equal(repaired_scores(store, clean), clean["scores"])


@pytest.mark.parametrize("with_record", [False, True])
@pytest.mark.parametrize("array,chunk", [("grads", "c/1/0"), ("inverse", "c/0/0/0")])
def test_chunk_from_another_store_of_the_same_shape(clean, other_store, tmp_path, array, chunk, with_record):  # noqa: F811
    """Borrowed alone (its crc32c is not this place's) or with its place record (sealed for the other store)."""
    store = copy(clean, "finalize", tmp_path / "s.zarr")
    shutil.copyfile(other_store / "models/0" / array / chunk, store / "models/0" / array / chunk)
    if with_record:
        record = chunk.replace("c/", "d/", 1)
        shutil.copyfile(other_store / "models/0" / array / record, store / "models/0" / array / record)
    with pytest.raises(StoreDamageError, match=rf"array models/0/{array}, chunk {chunk}.* {MISPLACED}"):
        run_steps(config(store, clean["ckpts"]))
    assert damage_of(store) == [(f"models/0/{array}", chunk, "misplaced")]
    np.testing.assert_array_equal(repaired_scores(store, clean), clean["scores"])


@pytest.mark.parametrize("how", ["swapped", "borrowed"])
def test_score_chunks_swapped_or_borrowed_are_not_shown(clean, other_store, tmp_path, how):  # noqa: F811
    """``trakflow show`` names the chunk (exit 2, one line) instead of listing another row's opponents."""
    from trakflow_cli.main import app

    store = copy(clean, "score", tmp_path / "s.zarr")
    scores = store / "experiments/tiny/scores"
    if how == "swapped":
        swap(scores / "c/0/0", scores / "c/3/0")
    else:
        shutil.copyfile(other_store / "experiments/tiny/scores/c/0/0", scores / "c/0/0")
    with pytest.raises(StoreDamageError, match=rf"array experiments/tiny/scores, chunk c/0/0 .*{MISPLACED}"):
        TrakStore.open(str(store), mode="r").scores("tiny")[:]
    shown = CliRunner().invoke(app, ["show", str(store), "--exp", "tiny", "--target", "0"], terminal_width=300)
    assert shown.exit_code != 0 and "experiments/tiny/scores, chunk c/0/0" in shown.output, shown.output
    assert "Traceback" not in shown.output
    verify = CliRunner().invoke(app, ["verify", str(store)], terminal_width=300)
    assert verify.exit_code == 1 and "misplaced" in verify.output and "c/0/0" in verify.output, verify.output
    np.testing.assert_array_equal(repaired_scores(store, clean), clean["scores"])


def test_pipeline_swapped_grads_and_deleted_inverse_then_rerun(clean, tmp_path):  # noqa: F811
    """The rerun recomputes the deleted inverse (its partials are intact), then stops at the swapped chunk;
    after repair the scores are the undamaged ones."""
    store = copy(clean, "score", tmp_path / "s.zarr")
    swap(store / "models/0/grads/c/3/0", store / "models/0/grads/c/4/0")
    os.remove(store / "models/0/inverse/c/0/0/0")
    with pytest.raises(StoreDamageError, match=rf"array models/0/grads, chunk c/3/0 \(rows 24\.\.31\) {MISPLACED}"):
        run_steps(config(store, clean["ckpts"]))
    found = set(damage_of(store))
    assert {("models/0/grads", "c/3/0", "misplaced"), ("models/0/grads", "c/4/0", "misplaced")} <= found
    np.testing.assert_array_equal(repaired_scores(store, clean), clean["scores"])


@pytest.mark.parametrize("array,first,second", [("grads", "c/2/0", "c/5/0"), ("out_to_loss", "c/2", "c/5")])
def test_traker_swapped_chunks_named_then_repaired(clean, tmp_path, array, first, second):  # noqa: F811
    save = tmp_path / "t.zarr"
    traker_run(save, clean["ckpts"], stages=("featurize",))
    swap(save / "models/0" / array / first, save / "models/0" / array / second)
    with pytest.raises(StoreDamageError, match=rf"array models/0/{array}, chunk {first} \(rows 16\.\.23\) {MISPLACED}"):
        traker_run(save, clean["ckpts"], stages=("finalize", "score"))
    report = verify_location(str(save))
    assert {(d.array, d.chunk, d.kind) for d in report.damage} == {
        (f"models/0/{array}", first, "misplaced"),
        (f"models/0/{array}", second, "misplaced"),
    }
    repair_store(TrakStore.open(str(save)), report)
    traker_run(save, clean["ckpts"][:1], stages=("featurize",))  # model 0's unflagged rows again
    np.testing.assert_array_equal(traker_run(save, clean["ckpts"], stages=("finalize", "score")), clean["traker"])


def test_traker_model_1s_inverse_over_model_0s(clean, tmp_path):  # noqa: F811
    save = tmp_path / "t.zarr"
    traker_run(save, clean["ckpts"], stages=("featurize", "finalize"))
    chunk = "inverse/c/0/0/0"
    shutil.copyfile(save / "models/1" / chunk, save / "models/0" / chunk)
    with pytest.raises(StoreDamageError, match=rf"array models/0/inverse, chunk c/0/0/0 {MISPLACED}"):
        traker_run(save, clean["ckpts"], stages=("score",))
    report = verify_location(str(save))
    assert [(d.array, d.chunk, d.kind) for d in report.damage] == [("models/0/inverse", "c/0/0/0", "misplaced")]
    repair_store(TrakStore.open(str(save)), report)
    np.testing.assert_array_equal(traker_run(save, clean["ckpts"], stages=("finalize", "score")), clean["traker"])


def test_a_partial_write_does_not_adopt_a_misplaced_chunk(tmp_path):
    """Writing some rows of a chunk keeps the rest of it: a misplaced chunk is refused before it is rewritten
    (and sealed) as this place's."""
    from trak_core.store import StoreMetadata

    meta = StoreMetadata(train_set_size=32, grad_dim=10, proj_dim=4, dtype="float32", chunk_rows=8, shard_rows=16)
    st = TrakStore.create_or_open(str(tmp_path / "s"), meta)
    st.init_model(0)
    x = np.arange(128, dtype=np.float32).reshape(32, 4)
    st.write_train_rows(0, slice(0, 16), x[:16], np.ones(16, np.float32))
    grads = tmp_path / "s/models/0/grads/c"
    swap(grads / "0/0", grads / "1/0")
    with pytest.raises(StoreDamageError, match=rf"chunk c/0/0 \(rows 0\.\.7\) {MISPLACED}"):
        st.model(0).grads[2:4] = 0
    st.model(0).grads[0:8] = x[:8]  # a whole-chunk write replaces it: sealed again, and the other still refused
    np.testing.assert_array_equal(st.model(0).grads[0:8], x[:8])
    with pytest.raises(StoreDamageError, match=rf"chunk c/1/0 \(rows 8\.\.15\) {MISPLACED}"):
        st.model(0).grads[8:16]


def test_touched_chunks_of_each_kind_of_selection():
    """The chunks a read or write touches (and those it covers in part) for slices, ints, Ellipsis, index arrays
    and masks, in an array of 20 rows in chunks of 8 (the last one short) and 2 column chunks."""
    import zarr

    from trak_core.store.places import touched_chunks

    g = zarr.open_group(store=zarr.storage.MemoryStore(), mode="w", zarr_format=3)
    arr = g.create_array("a", shape=(20, 6), chunks=(8, 3), dtype="float32")
    both = [0, 1]

    def rows(sel):
        every, partial = touched_chunks(arr, sel)
        return sorted({c[0] for c in every}), sorted({c[0] for c in partial}), len(every)

    assert rows(slice(0, 16)) == ([0, 1], [], 4)
    assert rows(slice(4, 17)) == ([0, 1, 2], [0, 2], 6)
    assert rows(slice(16, 20)) == ([2], [], 2)  # the short last chunk, whole
    assert rows(...) == ([0, 1, 2], [], 6)
    assert rows(9) == ([1], [1], 2) and rows(-1) == ([2], [2], 2)
    assert rows(np.arange(8, 16)) == ([1], [], 2)
    assert rows(np.array([1, 17, 3])) == ([0, 2], both[:1] + [2], 4)
    mask = np.zeros(20, dtype=bool)
    mask[16:] = True
    assert rows(mask) == ([2], [], 2)
    assert rows((slice(0, 8), slice(0, 3))) == ([0], [0], 2)  # narrower along axis 1: partial
    assert rows((slice(0, 8), slice(None))) == ([0], [], 2)
