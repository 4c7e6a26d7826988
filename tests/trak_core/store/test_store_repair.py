"""Metadata damage and a repair that cannot destroy: every field of an array's zarr.json is checked against the
schema (codecs and their configuration too); the root metadata is sealed (sha256) and kept twice more, so an
edited root is named as the damaged side and restored from its copy, never "fixed" by deleting intact arrays;
an array's edited zarr.json gets the schema's back with its chunks kept. ``--repair`` is idempotent.

Stores: the tiny pipeline stores of test_store_damage (64 train rows, chunks of 8, shards of 16, proj_dim 16).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_store_damage import clean, config, copy, run_steps, traker_run  # noqa: F401  (clean: a fixture)
from typer.testing import CliRunner

from trak_core.errors import StoreDamageError
from trak_core.store import TrakStore
from trak_core.store.verify import repair_store, verify_location


def cli(*args: str):
    from trakflow_cli.main import app

    return CliRunner().invoke(app, list(args), terminal_width=300)


def edit_json(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def chunk_files(store: Path) -> set[str]:
    return {str(p.relative_to(store)) for p in store.rglob("*") if p.is_file() and "/c/" in str(p)}


def flags(store: Path) -> dict[str, np.ndarray]:
    st = TrakStore.open(str(store), mode="r")
    return {f"models/{m}/featurized": st.model(m).featurized[:] for m in st.model_ids()}


def assert_repaired_then_clean(store: Path, clean_, kept: set[str]) -> None:
    """``--repair`` fixes it keeping every chunk, a second ``--repair`` finds it intact, verify exits 0, the
    rerun gives the undamaged scores."""
    first = cli("verify", str(store), "--repair")
    assert first.exit_code == 0 and "repaired" in first.output, first.output
    assert chunk_files(store) >= kept
    again = cli("verify", str(store), "--repair")
    assert again.exit_code == 0 and "intact" in again.output and "repaired" not in again.output, again.output
    assert cli("verify", str(store)).exit_code == 0
    np.testing.assert_array_equal(run_steps(config(store, clean_["ckpts"])), clean_["scores"])


# ---------------------------------------------------------------------------------------------- array metadata
def test_big_endian_codec_in_grads_zarr_json_is_named_and_restored(clean, tmp_path):  # noqa: F811
    store = copy(clean, "score", tmp_path / "s.zarr")
    kept, before = chunk_files(store), flags(store)
    edit_json(store / "models/0/grads/zarr.json", lambda d: d["codecs"][0]["configuration"].update(endian="big"))
    line = r'array models/0/grads: its zarr.json says codecs=.*"endian": "big".* the store\'s schema says codecs='
    with pytest.raises(StoreDamageError, match=line):
        TrakStore.open(str(store))
    with pytest.raises(StoreDamageError, match=line):
        run_steps(config(store, clean["ckpts"]))
    bad = cli("verify", str(store))
    assert bad.exit_code == 1 and "models/0/grads" in bad.output and '"big"}' in bad.output, bad.output
    assert_repaired_then_clean(store, clean, kept)
    for k, v in before.items():  # nothing was unflagged: the chunks were intact
        np.testing.assert_array_equal(flags(store)[k], v)


def test_traker_refuses_an_edited_codec(clean, tmp_path):  # noqa: F811
    save = tmp_path / "t.zarr"
    traker_run(save, clean["ckpts"], stages=("featurize",))
    edit_json(save / "models/1/out_to_loss/zarr.json", lambda d: d["codecs"].pop())
    with pytest.raises(StoreDamageError, match=r"array models/1/out_to_loss: its zarr.json says codecs="):
        traker_run(save, clean["ckpts"], stages=("finalize",))


def test_grads_shape_edited_is_restored_keeping_every_row(clean, tmp_path):  # noqa: F811
    store = copy(clean, "score", tmp_path / "s.zarr")
    kept, before = chunk_files(store), flags(store)
    edit_json(store / "models/0/grads/zarr.json", lambda d: d.update(shape=[56, d["shape"][1]]))
    with pytest.raises(
        StoreDamageError, match=r"array models/0/grads: its zarr.json says shape=\(56, 16\).*\(64, 16\)"
    ):
        TrakStore.open(str(store))
    report = verify_location(str(store))
    assert [(d.array, d.kind) for d in report.damage] == [("models/0/grads", "metadata")] and not report.root
    assert_repaired_then_clean(store, clean, kept)
    for k, v in before.items():
        np.testing.assert_array_equal(flags(store)[k], v)


def test_array_zarr_json_deleted_is_restored_and_its_chunks_kept(clean, tmp_path):  # noqa: F811
    store = copy(clean, "score", tmp_path / "s.zarr")
    kept = chunk_files(store)
    (store / "models/1/inverse/zarr.json").unlink()
    report = verify_location(str(store))
    assert [(d.array, d.chunk, d.kind) for d in report.damage] == [("models/1/inverse", "zarr.json", "metadata")]
    assert_repaired_then_clean(store, clean, kept)


# ---------------------------------------------------------------------------------------------- root metadata
@pytest.mark.parametrize(
    "field,value",
    [("proj_dim", 32), ("dtype", "float16"), ("chunk_rows", 16), ("train_set_size", 48), ("proj_seed", 7)],
)
def test_root_metadata_edited_is_the_damaged_side_and_restored(clean, tmp_path, field, value):  # noqa: F811
    store = copy(clean, "score", tmp_path / "s.zarr")
    kept, before = chunk_files(store), flags(store)
    edit_json(store / "zarr.json", lambda d: d["attributes"]["trakflow"].update({field: value}))
    with pytest.raises(StoreDamageError, match=rf"root zarr.json: its trakflow metadata fails its seal: {field}="):
        TrakStore.open(str(store))
    with pytest.raises(StoreDamageError, match=rf"fails its seal: {field}={value!r}"):
        run_steps(config(store, clean["ckpts"]))
    report = verify_location(str(store))
    assert not report.damage and len(report.root) == 1 and f"{field}={value!r}" in report.root[0]  # the root's fault
    shown = cli("verify", str(store))
    assert shown.exit_code == 1 and "zarr.json (root)" in shown.output and f"{field}=" in shown.output, shown.output
    assert_repaired_then_clean(store, clean, kept)
    for k, v in before.items():
        np.testing.assert_array_equal(flags(store)[k], v)


def test_malformed_root_attributes_are_restored_from_the_copy(clean, tmp_path):  # noqa: F811
    store = copy(clean, "finalize", tmp_path / "s.zarr")
    edit_json(store / "zarr.json", lambda d: d["attributes"].update(trakflow={"proj_dim": "many"}))
    report = verify_location(str(store))
    assert report.root and "proj_dim='many'" in report.root[0]
    repair_store(TrakStore.open(str(store), check_arrays=False), report)
    assert verify_location(str(store)).ok
    np.testing.assert_array_equal(run_steps(config(store, clean["ckpts"])), clean["scores"])


def test_a_damaged_copy_is_named_and_rewritten(clean, tmp_path):  # noqa: F811
    store = copy(clean, "score", tmp_path / "s.zarr")
    edit_json(
        store / "experiments/zarr.json", lambda d: d["attributes"]["trakflow_root"]["trakflow"].update(proj_dim=8)
    )
    TrakStore.open(str(store))  # the root is intact: the store opens
    report = verify_location(str(store))
    assert report.root == ("experiments/zarr.json: its copy of the root metadata is missing or fails its seal",)
    repair_store(TrakStore.open(str(store), check_arrays=False), report)
    assert verify_location(str(store)).ok


def test_root_and_both_copies_damaged_is_one_line(clean, tmp_path):  # noqa: F811
    store = copy(clean, "finalize", tmp_path / "s.zarr")
    for path in ("zarr.json", "models/zarr.json", "experiments/zarr.json"):
        edit_json(
            store / path,
            lambda d: (d["attributes"].get("trakflow_root", d["attributes"]))["trakflow"].update(proj_dim=8),
        )
    with pytest.raises(StoreDamageError, match=r"fails its seal and no intact copy is left.*restore the root"):
        TrakStore.open(str(store))
    out = cli("verify", str(store))
    assert out.exit_code == 2 and "no intact copy" in out.output and "Traceback" not in out.output, out.output
