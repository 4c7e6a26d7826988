"""Fault injection: a small store (examples.tiny) damaged on disk between runs, as an interrupted
rsync, a partial copy or bit rot does. Every case ends in a clear error naming the array and the chunk, or in a
recomputation giving the undamaged scores (bit for bit) — never in other scores with exit code 0.

One clean reference run (module fixture) is copied per case (shutil.copytree). The pipeline is driven through
tasks.core's steps, in the order the flows call them (one case through the attribute flow for the retry
policy), and through TRAKer. Layout: 64 train rows, chunk_rows 8 (chunk c/1/0 holds rows 8..15), shards of 16;
an experiment's scores and their flags in chunks of a shard (few targets: scores chunk c/3/0 holds rows 48..63).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from trak_fixtures import tiny_attribute_config
from typer.testing import CliRunner

from examples import tiny
from tasks import core
from tasks.common import should_retry
from tasks.config import AttributeConfig
from trak_core.compat.traker import TRAKer
from trak_core.errors import BadInputError, StoreDamageError, StoreMismatchError
from trak_core.projection.projectors import make_projector, rebuild_kwargs
from trak_core.store import TrakStore
from trak_core.store.verify import repair_store, verify_location, verify_store

SHARD, CHUNK = 16, 8


def config(store, ckpts, **over) -> AttributeConfig:
    return AttributeConfig.model_validate(tiny_attribute_config(store, ckpts, **{"dtype": "float32", **over}))


def run_steps(cfg: AttributeConfig, upto: str = "score"):
    """The attribute DAG as the flows call tasks.core: plan → featurize → finalize → targets → scores."""
    plan = core.make_plan(cfg)
    for m, s in plan.featurize_jobs():
        core.featurize_shard(cfg, m.model_id, m.checkpoint, s)
    if upto == "featurize":
        return None
    for mid in plan.model_ids:
        core.finalize_checkpoint(cfg, mid)
    if upto == "finalize":
        return None
    for m in plan.models:
        core.featurize_targets(cfg, m.model_id, m.checkpoint)
    sp = core.prepare_scores(cfg, plan.model_ids)
    for a, b in sp.blocks:
        core.score_block(cfg, list(sp.model_ids), a, b)
    return TrakStore.open(cfg.store, mode="r").scores(cfg.exp_name)[:]


def traker_run(save_dir, ckpts, lambda_reg=1e-3, stages=("featurize", "finalize", "score"), **kw):
    x, y = tiny.train_data()
    xt, yt = tiny.target_data()
    model = tiny.make_model()
    t = TRAKer(
        model,
        "image_classification",
        tiny.NUM_TRAIN,
        save_dir=str(save_dir),
        device="cpu",
        proj_dim=16,
        lambda_reg=lambda_reg,
        use_half_precision=False,
        chunk_rows=CHUNK,
        shard_rows=SHARD,
        **kw,
    )
    if "featurize" in stages:
        for mid, path in enumerate(ckpts):
            t.load_checkpoint(torch.load(path, weights_only=True), model_id=mid)
            for s in range(0, tiny.NUM_TRAIN, 8):
                t.featurize([x[s : s + 8], y[s : s + 8]], num_samples=8)
    if "finalize" in stages:
        t.finalize_features()
    if "score" in stages:
        for mid, path in enumerate(ckpts):
            t.start_scoring_checkpoint(
                "tiny", torch.load(path, weights_only=True), model_id=mid, num_targets=tiny.NUM_TARGETS
            )
            t.score([xt, yt], num_samples=tiny.NUM_TARGETS)
        return t.finalize_scores("tiny")
    return t


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """Clean runs to copy: the pipeline's store after featurize, after finalize and complete; TRAKer's."""
    tmp = tmp_path_factory.mktemp("damage")
    ckpts = tiny.save_checkpoints(tmp / "ck", seeds=(0, 1))
    stores = {}
    for upto in ("featurize", "finalize", "score"):
        cfg = config(tmp / f"{upto}.zarr", ckpts)
        stores[upto] = run_steps(cfg, upto)
    traker_scores = traker_run(tmp / "traker.zarr", ckpts)
    return {"tmp": tmp, "ckpts": ckpts, "scores": stores["score"], "traker": traker_scores}


def copy(clean, which: str, dest: Path) -> Path:
    shutil.copytree(clean["tmp"] / f"{which}.zarr", dest)
    return dest


def flip_byte(path: Path, offset: int = 5) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def assert_recomputed(cfg, clean) -> list[str]:
    """A rerun warns that it recomputes and gives the undamaged scores; returns the warnings' text."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scores = run_steps(cfg)
    np.testing.assert_array_equal(scores, clean["scores"])
    assert verify_location(cfg.store).ok
    return [str(w.message) for w in caught]


# ---------------------------------------------------------------------------------------------- missing chunks
@pytest.mark.parametrize("array", ["grads", "out_to_loss"])
def test_deleted_train_chunk_before_finalize_is_recomputed(clean, tmp_path, array):
    store = copy(clean, "featurize", tmp_path / "s.zarr")
    key = "c/1/0" if array == "grads" else "c/1"
    os.remove(store / "models" / "0" / array / key)
    cfg = config(store, clean["ckpts"])
    msgs = assert_recomputed(cfg, clean)
    assert any(f"array models/0/{array}, chunk {key} (rows 8..15): is missing" in m for m in msgs), msgs


def test_deleted_xtx_partial_between_featurize_and_finalize_is_recomputed(clean, tmp_path):
    store = copy(clean, "featurize", tmp_path / "s.zarr")
    os.remove(store / "models" / "1" / "xtx_partials" / "c" / "2" / "0")
    msgs = assert_recomputed(config(store, clean["ckpts"]), clean)
    assert any("array models/1/xtx_partials, chunk c/2/0 (shards 2..2): is missing" in m for m in msgs), msgs


@pytest.mark.parametrize(
    "path,chunk",
    [
        ("models/0/inverse", "c/0/0/0"),
        ("experiments/tiny/scores", "c/3/0"),
        ("experiments/tiny/models/1/grads", "c/0/0"),
        ("experiments/tiny/models/1/solved", "c/0/0"),
    ],
)
def test_deleted_chunk_after_the_run_is_recomputed(clean, tmp_path, path, chunk):
    store = copy(clean, "score", tmp_path / "s.zarr")
    os.remove(store / path / chunk)
    cfg = config(store, clean["ckpts"])
    assert core.up_to_date(cfg) is None  # a no-op `trakflow run` does not skip it
    if path.endswith("scores"):  # `trakflow show` reads the scores: it names the chunk instead of ranking zeros
        with pytest.raises(StoreDamageError, match=rf"array {path}, chunk {chunk} \(rows 48\.\.63\): is missing"):
            TrakStore.open(cfg.store, mode="r").scores("tiny")
    msgs = assert_recomputed(cfg, clean)
    assert any(f"array {path}, chunk {chunk}" in m for m in msgs), msgs


def test_deleted_chunk_through_traker_names_array_and_chunk(clean, tmp_path):
    save = tmp_path / "t.zarr"
    t = traker_run(save, clean["ckpts"], stages=("featurize",))
    os.remove(save / "models" / "0" / "grads" / "c" / "1" / "0")
    with pytest.raises(StoreDamageError, match=r"array models/0/grads, chunk c/1/0 \(rows 8\.\.15\): is missing"):
        t.finalize_features()
    repair_store(t.store, verify_store(t.store))  # = trakflow verify --repair
    np.testing.assert_array_equal(traker_run(save, clean["ckpts"]), clean["traker"])


# ---------------------------------------------------------------------------------------------- corrupt chunks
def test_flipped_byte_in_the_inverse_is_an_error_then_repaired(clean, tmp_path):
    store = copy(clean, "finalize", tmp_path / "s.zarr")
    flip_byte(store / "models" / "0" / "inverse" / "c" / "0" / "0" / "0")
    cfg = config(store, clean["ckpts"])
    with pytest.raises(StoreDamageError, match=r"array models/0/inverse, chunk c/0/0/0 fails its crc32c checksum") as e:
        run_steps(cfg)
    assert not should_retry(e.value)
    report = verify_location(cfg.store)
    assert [(d.array, d.chunk, d.kind) for d in report.damage] == [("models/0/inverse", "c/0/0/0", "corrupt")]
    repair_store(TrakStore.open(cfg.store), report)
    np.testing.assert_array_equal(run_steps(cfg), clean["scores"])


def test_flipped_byte_through_traker(clean, tmp_path):
    save = tmp_path / "t.zarr"
    shutil.copytree(clean["tmp"] / "traker.zarr", save)
    flip_byte(save / "models" / "1" / "grads" / "c" / "2" / "0")
    t = traker_run(save, clean["ckpts"], stages=())
    with pytest.raises(StoreDamageError, match=r"array models/1/grads, chunk c/2/0 \(rows 16\.\.23\) fails"):
        t.finalize_scores("tiny")


def test_truncated_chunk_is_a_clear_error_not_retried(clean, tmp_path, monkeypatch, prefect_harness):
    """Through the attribute flow: the score task fails once (no retry) with the array and chunk named."""
    from flows import attribute

    store = copy(clean, "finalize", tmp_path / "s.zarr")
    chunk = store / "models" / "1" / "grads" / "c" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:17])
    calls = []
    original = core.score_block
    monkeypatch.setattr(core, "score_block", lambda *a, **k: calls.append(a[2:]) or original(*a, **k))
    with pytest.raises(
        StoreDamageError,
        match=r"array models/1/grads, chunk c/0/0 \(rows 0\.\.7\) fails its "
        r"crc32c checksum",
    ):
        attribute(config(store, clean["ckpts"]))
    assert sorted(calls).count((0, 16)) == 1, calls  # the failing block ran once: not retried


# ---------------------------------------------------------------------------------------------- metadata
def test_dtype_edited_in_array_zarr_json_is_refused(clean, tmp_path):
    store = copy(clean, "score", tmp_path / "s.zarr")
    meta_path = store / "models" / "0" / "grads" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    assert meta["data_type"] == "float32"
    meta["data_type"] = "int32"
    meta_path.write_text(json.dumps(meta))
    cfg = config(store, clean["ckpts"])
    with pytest.raises(
        StoreDamageError,
        match=r"array models/0/grads: its zarr.json says dtype=int32, but the "
        r"store's metadata \(root zarr.json\) implies dtype=float32",
    ):
        run_steps(cfg)
    with pytest.raises(StoreDamageError, match="models/0/grads"):
        TrakStore.open(cfg.store, mode="r").scores("tiny")  # `trakflow show` reads nothing either
    repair_store(TrakStore.open(cfg.store, check_arrays=False), verify_location(cfg.store))
    np.testing.assert_array_equal(run_steps(cfg), clean["scores"])


def edit_dtype(store: Path, array: str, dtype: str = "int32") -> str:
    """Edit the dtype in ``array``'s zarr.json; returns the original text."""
    meta_path = store / array / "zarr.json"
    text = meta_path.read_text()
    meta_path.write_text(json.dumps({**json.loads(text), "data_type": dtype}))
    return text


def test_a_task_checks_the_arrays_it_opens_and_the_plan_checks_them_all(clean, tmp_path, monkeypatch):
    """A pipeline task opens the store with check_arrays="on_use": a score task reads no zarr.json of an array it
    does not use (an edited XᵀX partial, which only finalize reads, does not stop it), yet an edited array it
    does open is refused naming it, before a row is marked done; the run's plan refuses either edit."""
    from trak_core.store import arrays as store_mod

    store = copy(clean, "score", tmp_path / "s.zarr")
    cfg = config(store, clean["ckpts"])
    sp = core.prepare_scores(cfg, [0, 1])
    opened = []
    real = store_mod.array_at
    monkeypatch.setattr(store_mod, "array_at", lambda g, name: opened.append(f"{g.path}/{name}") or real(g, name))
    TrakStore.open(cfg.store).reset_scores(cfg.exp_name)
    opened.clear()
    original = edit_dtype(store, "models/1/xtx_partials")
    a, b = sp.blocks[0]
    core.score_block(cfg, list(sp.model_ids), a, b)
    assert opened and "models/1/xtx_partials" not in opened
    assert all(p.startswith(("models/0/", "models/1/", f"experiments/{cfg.exp_name}/")) for p in opened), opened
    assert TrakStore.open(cfg.store, check_arrays=False).scores_done_mask(cfg.exp_name)[a:b].all()
    with pytest.raises(StoreDamageError, match=r"array models/1/xtx_partials: its zarr.json says dtype=int32"):
        core.make_plan(cfg)

    (store / "models/1/xtx_partials/zarr.json").write_text(original)
    edit_dtype(store, "models/1/grads")  # read by every score task
    before = TrakStore.open(cfg.store, check_arrays=False).scores_done_mask(cfg.exp_name).copy()
    c, d = sp.blocks[-1]
    with pytest.raises(StoreDamageError, match=r"array models/1/grads: its zarr.json says dtype=int32.*verify"):
        core.score_block(cfg, list(sp.model_ids), c, d)
    np.testing.assert_array_equal(TrakStore.open(cfg.store, check_arrays=False).scores_done_mask(cfg.exp_name), before)
    assert not before[c:d].any()
    with pytest.raises(StoreDamageError, match=r"array models/1/grads: its zarr.json says dtype=int32") as e:
        core.make_plan(cfg)
    assert "more" not in str(e.value)  # the partials' zarr.json is as it was
    with pytest.raises(BadInputError, match="check_arrays='later'"):
        TrakStore.open(cfg.store, check_arrays="later")


@pytest.mark.parametrize("seed", [1, 0])
def test_root_metadata_deleted_is_refused_never_reinitialized(clean, tmp_path, seed):
    store = copy(clean, "score", tmp_path / "s.zarr")
    os.remove(store / "zarr.json")
    before = sorted(p.relative_to(store) for p in store.rglob("*"))
    with pytest.raises(
        StoreDamageError,
        match=r"holds a store's arrays \(experiments/, models/\) but no root "
        "metadata",
    ):
        run_steps(config(store, clean["ckpts"], proj_seed=seed))
    with pytest.raises(StoreDamageError, match="no root metadata"):
        traker_run(store, clean["ckpts"], stages=())
    assert sorted(p.relative_to(store) for p in store.rglob("*")) == before  # nothing written


# ---------------------------------------------------------------------------------------------- settings
def test_crash_during_finalize_then_other_lambda_is_refused(clean, tmp_path, monkeypatch):
    import trak_core.solve.reduce as reduce

    store = copy(clean, "featurize", tmp_path / "s.zarr")
    cfg = config(store, clean["ckpts"])
    original = reduce.solve

    def crash(*a, **k):
        raise KeyboardInterrupt("crash during finalize")

    monkeypatch.setattr(reduce, "solve", crash)
    with pytest.raises(KeyboardInterrupt):
        core.finalize_checkpoint(cfg, 0)
    monkeypatch.setattr(reduce, "solve", original)
    st = TrakStore.open(cfg.store)
    assert not st.is_finalized(0) and not st.model(0).inverse_done[:].any()  # settled on λ=1e-3, nothing written
    with pytest.raises(StoreMismatchError, match=r"lambda_reg: model_id=0 .* was planned with lambda_reg=0.001"):
        run_steps(config(store, clean["ckpts"], lambda_reg=1e-2))
    with pytest.raises(StoreMismatchError, match="rescale_inverse: model_id=0"):
        run_steps(config(store, clean["ckpts"], rescale_inverse=False))
    np.testing.assert_array_equal(run_steps(cfg), clean["scores"])  # the same λ resumes


def test_traker_crash_during_finalize_then_other_lambda_is_refused(clean, tmp_path, monkeypatch):
    import trak_core.solve.reduce as reduce

    save = tmp_path / "t.zarr"
    t = traker_run(save, clean["ckpts"], stages=("featurize",))
    original = reduce.solve
    monkeypatch.setattr(reduce, "solve", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        t.finalize_features()
    monkeypatch.setattr(reduce, "solve", original)
    t2 = traker_run(save, clean["ckpts"], lambda_reg=0.5, stages=())
    with pytest.raises(StoreMismatchError, match="lambda_reg: model_id=0"):
        t2.finalize_features()


def test_traker_load_from_save_dir_false_does_not_reuse_old_gradients(clean, tmp_path):
    """save_dir holds gradients (and inverses, scores) of other checkpoints; load_from_save_dir=False starts
    over, as traker does: the scores equal a clean run on the new checkpoints."""
    save = tmp_path / "t.zarr"
    other = tiny.save_checkpoints(tmp_path / "other", seeds=(7, 8))
    traker_run(save, other)
    # the store keeps its projection (the default's split follows the energy of its first checkpoint): the clean run
    # to compare with uses that projection too
    meta = TrakStore.open(str(save), mode="r").meta
    kw = rebuild_kwargs("factored", meta.projector_params)
    proj = make_projector("factored", meta.grad_dim, 16, 0, device="cpu", model=tiny.make_model(), **kw)
    want = traker_run(tmp_path / "fresh.zarr", clean["ckpts"], projector=proj)
    np.testing.assert_array_equal(traker_run(save, clean["ckpts"], load_from_save_dir=False), want)


# ---------------------------------------------------------------------------------------------- verify CLI
def test_verify_cli_table_exit_codes_and_repair(clean, tmp_path):
    from trakflow_cli.main import app

    store = copy(clean, "score", tmp_path / "s.zarr")
    runner = CliRunner()
    ok = runner.invoke(app, ["verify", str(store)])
    assert ok.exit_code == 0 and "intact" in ok.output
    os.remove(store / "models" / "0" / "grads" / "c" / "2" / "0")
    flip_byte(store / "experiments" / "tiny" / "scores" / "c" / "2" / "0")
    bad = runner.invoke(app, ["verify", str(store)], terminal_width=200)
    assert bad.exit_code == 1, bad.output
    for text in (
        "models/0/grads",
        "c/2/0",
        "rows 16..23",
        "missing",
        "experiments/tiny/scores",
        "c/2/0",
        "corrupt: fails its crc32c",
    ):
        assert text in bad.output, bad.output
    fixed = runner.invoke(app, ["verify", str(store), "--repair"], terminal_width=200)
    assert fixed.exit_code == 0 and "repaired" in fixed.output, fixed.output
    st = TrakStore.open(str(store), mode="r")
    assert not st.model(0).featurized[16:24].any() and st.model(0).featurized[:16].all()
    assert st.finalize_info(0) is None and st.is_finalized(1)
    assert not st.experiment("tiny").scores_done[16:24].any() and not st.experiment("tiny").scores_done[32:48].any()
    assert runner.invoke(app, ["verify", str(store)]).exit_code == 0
    np.testing.assert_array_equal(run_steps(config(store, clean["ckpts"])), clean["scores"])


def test_corrupt_flag_chunk_is_found_by_the_plan_and_recomputed(clean, tmp_path):
    """A flag chunk is read whole by the plan's check: one that fails its checksum is removed (its rows then
    read as not done) and the rows are recomputed."""
    store = copy(clean, "score", tmp_path / "s.zarr")
    flip_byte(store / "models" / "0" / "featurized" / "c" / "1", offset=2)
    report = verify_location(str(store), read_chunks=False)
    assert [(d.array, d.chunk, d.kind) for d in report.damage] == [("models/0/featurized", "c/1", "corrupt")]
    msgs = assert_recomputed(config(store, clean["ckpts"]), clean)
    assert any("array models/0/featurized, chunk c/1 (rows 8..15): fails its crc32c checksum" in m for m in msgs)


def test_score_task_of_several_shards_resumes_with_its_unfinished_shards(clean, tmp_path, monkeypatch):
    """A score task of two shards killed after its first shard's scores and flags were written: the rerun of the
    task scores only the second shard; progress counts every row once; the scores equal the clean run's."""
    from trak_core.solve import reduce

    store = copy(clean, "finalize", tmp_path / "s.zarr")
    cfg = config(store, clean["ckpts"], score_task_rows=2 * SHARD)
    plan = core.make_plan(cfg)
    for m in plan.models:
        core.featurize_targets(cfg, m.model_id, m.checkpoint)
    sp = core.prepare_scores(cfg, plan.model_ids)
    assert sp.blocks == ((0, 32), (32, 64))
    st = TrakStore.open(cfg.store)
    reduce.score_rows(st, cfg.exp_name, list(sp.model_ids), 0, SHARD)  # the first shard of the first task: done
    calls, advanced = [], []
    from trak_core import engine

    real = engine.score_rows
    monkeypatch.setattr(engine, "score_rows", lambda *a, **k: calls.append(a[3:5]) or real(*a, **k))
    monkeypatch.setattr(core.progress, "advance", lambda stage, amount=1: advanced.append((stage, amount)))
    manifests = [core.score_block(cfg, list(sp.model_ids), a, b) for a, b in sp.blocks]
    assert calls == [(SHARD, 2 * SHARD), (32, 64)]
    assert not any(m.skipped for m in manifests)
    assert {s for s, _ in advanced} == {"score"} and sum(a for _, a in advanced) == 64
    np.testing.assert_array_equal(TrakStore.open(cfg.store, mode="r").scores(cfg.exp_name)[:], clean["scores"])
    again = core.score_block(cfg, list(sp.model_ids), 0, 32)  # all rows done: skipped, nothing computed
    assert again.skipped and calls == [(SHARD, 2 * SHARD), (32, 64)]
