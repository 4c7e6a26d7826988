"""Flows under one session-scoped prefect_test_harness, on seconds-fast synthetic data (examples.tiny)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from trak_fixtures import REPO_ROOT, set_gpu_limit, tiny_attribute_config

from examples import tiny
from tasks.config import AttributeConfig, TrainConfig
from trak_core import TRAKer
from trak_core.errors import BadInputError, StateError, StoreMismatchError
from trak_core.featurize.featurizer import Featurizer
from trak_core.store import TrakStore

pytestmark = pytest.mark.usefixtures("prefect_harness")

N, M, BATCH, SHARD, CHUNK, PROJ, LAM = tiny.NUM_TRAIN, tiny.NUM_TARGETS, 8, 16, 8, 16, 1e-3


def config(tmp: Path, ckpts, **over) -> AttributeConfig:
    report = dict(top_k=3, report_targets=2, show="examples.tiny:as_image", report_dir=str(tmp / "report"))
    return AttributeConfig.model_validate(tiny_attribute_config(tmp / "store.zarr", ckpts, **{**report, **over}))


def traker_scores(
    tmp: Path, ckpt_paths, projector: str = "dense", curvature: str = "xtx", record: dict | None = None
) -> np.ndarray:
    """trak_core.TRAKer on the same inputs, same batches and the same store layout (``record``: the pipeline store's
    projector_params, whose split the factored projector takes)."""
    from trak_core.featurize.gradients import grad_dim_of
    from trak_core.projection.projectors import make_projector, rebuild_kwargs

    x, y = tiny.train_data()
    xt, yt = tiny.target_data()
    model = tiny.make_model()
    proj = None
    if projector != "dense":
        kw = rebuild_kwargs(projector, record) if projector == "factored" and record else {}
        proj = make_projector(projector, grad_dim_of(model), PROJ, 0, "rademacher", "cpu", model=model, **kw)
    tr = TRAKer(
        model,
        "image_classification",
        N,
        save_dir=str(tmp / "traker.zarr"),
        device="cpu",
        proj_dim=PROJ,
        lambda_reg=LAM,
        chunk_rows=CHUNK,
        shard_rows=SHARD,
        projector=proj,
        curvature=curvature,
    )
    sds = [torch.load(p, weights_only=True) for p in sorted(ckpt_paths)]
    for mid, sd in enumerate(sds):
        tr.load_checkpoint(sd, mid)
        for a in range(0, N, BATCH):
            tr.featurize((x[a : a + BATCH], y[a : a + BATCH]), inds=np.arange(a, a + BATCH))
    tr.finalize_features()
    for mid, sd in enumerate(sds):
        tr.start_scoring_checkpoint("tiny", sd, mid, M)
        for a in range(0, M, BATCH):
            tr.score((xt[a : a + BATCH], yt[a : a + BATCH]), inds=np.arange(a, a + BATCH))
    return np.asarray(tr.finalize_scores("tiny"))


def float64_target_data():
    """tiny's targets as float64 (the model is float32): refused by the plan, not inside a task."""
    x, y = tiny.target_data()
    return x.double(), y


def file_mtimes(root: str) -> dict[str, int]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[p] = os.stat(p).st_mtime_ns
    return out


@pytest.fixture(scope="module")
def attributed(tmp_path_factory):
    """One attribute run on 3 checkpoints (given in unsorted order, by glob)."""
    from flows import attribute

    tmp = tmp_path_factory.mktemp("attr")
    paths = tiny.save_checkpoints(tmp / "ck", seeds=(2, 0, 1))
    cfg = config(tmp, str(tmp / "ck" / "model_*.pt"))
    result = attribute(cfg)
    return tmp, paths, cfg, result


def test_attribute_equals_traker_exactly(attributed):
    tmp, paths, cfg, result = attributed
    ours = TrakStore.open(cfg.store, mode="r").scores("tiny")[:]
    ref = traker_scores(tmp, paths)
    assert ours.shape == (N, M)
    np.testing.assert_array_equal(ours, ref)
    assert result["featurize"]["computed"] == 3 * (N // SHARD)
    assert result["score"]["model_ids"] == [0, 1, 2]


@pytest.mark.parametrize("projector", ["sjlt", "factored"])
def test_structured_projectors_equal_traker_exactly(tmp_path, projector):
    from flows import attribute

    paths = tiny.save_checkpoints(tmp_path / "ck", seeds=(0,))
    cfg = config(tmp_path, paths, projector=projector, report_targets=0)
    result = attribute(cfg)
    assert result["report"] is None
    store = TrakStore.open(cfg.store, mode="r")
    assert store.meta.projector == projector
    if projector == "factored":  # the plan probed the gradient energy once; the store records the split
        assert store.meta.projector_params["split"] == "energy"
    ref = traker_scores(tmp_path, paths, projector, record=store.meta.projector_params)
    np.testing.assert_array_equal(store.scores("tiny")[:], ref)


def test_ggn_curvature_equals_traker_exactly(tmp_path):
    """curvature "ggn" through the pipeline's tasks (XᵀRX partials written by featurize) = TRAKer's, bit for bit,
    and not the XᵀX scores."""
    from flows import attribute

    paths = tiny.save_checkpoints(tmp_path / "ck", seeds=(0, 1))
    cfg = config(tmp_path, paths, curvature="ggn", report_targets=0)
    attribute(cfg)
    store = TrakStore.open(cfg.store, mode="r")
    assert store.meta.curvature == "ggn"
    assert all(store.finalize_info(mid)["curvature"] == "ggn" for mid in (0, 1))
    ours = store.scores("tiny")[:]
    np.testing.assert_array_equal(ours, traker_scores(tmp_path, paths, curvature="ggn"))
    assert not np.allclose(ours, traker_scores(tmp_path / "x", paths), rtol=1e-3)


def test_second_run_recomputes_nothing(attributed, monkeypatch):
    from flows import attribute

    tmp, paths, cfg, first = attributed
    calls = []
    for name in ("featurize", "target_features"):
        orig = getattr(Featurizer, name)

        def counting(self, *a, _orig=orig, _name=name, **k):
            calls.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(Featurizer, name, counting)
    import trak_core.engine as engine_mod

    monkeypatch.setattr(engine_mod, "finalize_model", lambda *a, **k: pytest.fail("finalize_model called"))
    monkeypatch.setattr(engine_mod, "score_rows", lambda *a, **k: pytest.fail("score_rows called"))
    before = file_mtimes(cfg.store)
    scores_before = TrakStore.open(cfg.store, mode="r").scores("tiny")[:]

    again = attribute(cfg)

    assert calls == []
    for stage in ("featurize", "finalize"):
        assert again[stage]["computed"] == 0 and again[stage]["skipped"] == first[stage]["tasks"]
        assert all(m.skipped for m in again[stage]["manifests"])
    assert again["score"]["computed"] == 0 and again["score"]["skipped"] == first["score"]["tasks"]
    after = file_mtimes(cfg.store)
    assert after == before, sorted(k for k in after if after[k] != before.get(k))
    np.testing.assert_array_equal(TrakStore.open(cfg.store, mode="r").scores("tiny")[:], scores_before)


def test_rerun_with_other_lambda_is_refused(attributed):
    from flows import attribute

    tmp, paths, cfg, _ = attributed
    before = file_mtimes(cfg.store)
    with pytest.raises(StoreMismatchError, match="lambda_reg"):
        attribute(cfg.model_copy(update={"lambda_reg": 0.5}))
    assert file_mtimes(cfg.store) == before


def test_report_files_and_artifacts(attributed):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    tmp, paths, cfg, result = attributed
    rep = result["report"]
    assert [r["target"] for r in rep["rows"]] == [0, 1]
    scores = TrakStore.open(cfg.store, mode="r").scores("tiny")[:]
    for r in rep["rows"]:
        assert [e["index"] for e in r["proponents"]] == list(np.argsort(-scores[:, r["target"]], kind="stable")[:3])
        assert [e["index"] for e in r["opponents"]] == list(np.argsort(scores[:, r["target"]], kind="stable")[:3])
    md = Path(cfg.report_dir) / "tiny_top_k.md"
    assert md.is_file() and "top proponents" in md.read_text()
    for j in (0, 1):
        assert (Path(cfg.report_dir) / f"tiny_target_{j}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    from tasks.common import store_identity

    prefix = f"trakflow-{store_identity(cfg.store)}-tiny"  # keys carry the store's identity

    async def read():
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_="trakflow-")))

    arts = {a.key: a for a in asyncio.run(read())}
    assert arts[f"{prefix}-top-k"].type == "markdown"
    assert "top proponents" in arts[f"{prefix}-top-k"].data
    # images are markdown artifacts embedding the PNG: the UI shows the picture without its data URL under it
    assert arts[f"{prefix}-target-0"].type == "markdown"
    assert arts[f"{prefix}-target-0"].data.startswith("![target 0](data:image/png;base64,iVBOR")
    assert store_identity(cfg.store) != store_identity(str(tmp / "other.zarr"))
    assert store_identity(cfg.store) == store_identity("file://" + os.path.abspath(cfg.store))


def test_prefect_api_read_endpoint():
    """A read_* call against the harness server: fails loudly on a FastAPI/Prefect mismatch (422s)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    async def read():
        async with get_client() as client:
            flows = await client.read_flows(flow_filter=FlowFilter(name=FlowFilterName(any_=["attribute"])))
            runs = await client.read_flow_runs(limit=5)
            return flows, runs

    flows, runs = asyncio.run(read())
    assert isinstance(flows, list) and isinstance(runs, list)


def test_featurize_skips_complete_shards_and_redoes_one(tmp_path):
    from flows import featurize

    paths = tiny.save_checkpoints(tmp_path / "ck", seeds=(0,))
    cfg = config(tmp_path, paths)
    first = featurize(cfg)
    assert first["computed"] == N // SHARD
    store = TrakStore.open(cfg.store)
    grads = store.model(0).grads[:]
    # forget shard 2 (as if its task died before marking it complete)
    store.model(0).featurized[32:48] = 0
    store.model(0).partial_done[2] = 0
    again = featurize(cfg)
    assert again["computed"] == 1 and again["skipped"] == N // SHARD - 1
    assert [m.shard for m in again["manifests"] if not m.skipped] == [2]
    np.testing.assert_array_equal(TrakStore.open(cfg.store).model(0).grads[:], grads)


def test_gpu_tag_and_its_lease_only_where_a_limit_exists(tmp_path, monkeypatch):
    """Prefect asks the server for a lease at every start of a tagged task, limit or not. Without a `trakflow-gpu`
    limit the flows start their model tasks untagged: no lease is asked for; with one, each asks for its slot."""
    import prefect.concurrency._asyncio as aconc
    import prefect.concurrency._sync as sconc

    from flows import featurize
    from tasks import evaluate, training
    from tasks.attribution import featurize_shard, featurize_targets, fit_curvature, on_gpu
    from tasks.common import GPU_TAG

    asked: list[list[str]] = []  # the tag limits asked for (a store's queue, a global limit, is not a tag's)

    def spy(orig):
        def acquire(names, *a, **k):
            asked.extend([n] for n in names if n.startswith("tag:"))
            return orig(names, *a, **k)

        return acquire

    monkeypatch.setattr(sconc, "acquire_concurrency_slots_with_lease", spy(sconc.acquire_concurrency_slots_with_lease))
    monkeypatch.setattr(
        aconc, "aacquire_concurrency_slots_with_lease", spy(aconc.aacquire_concurrency_slots_with_lease)
    )
    gpu_tasks = (
        featurize_shard,
        fit_curvature,
        featurize_targets,
        training.train_model,
        evaluate.train_subset_model_task,
    )
    paths = tiny.save_checkpoints(tmp_path / "ck", seeds=(0,))

    assert all(GPU_TAG not in t.tags for t in on_gpu(*gpu_tasks))
    featurize(config(tmp_path / "free", paths, projector="dense"))
    assert asked == []

    set_gpu_limit(2)
    try:
        assert all(GPU_TAG in t.tags for t in on_gpu(*gpu_tasks))
        featurize(config(tmp_path / "limited", paths, projector="dense"))
    finally:
        set_gpu_limit(None)
    # one featurize task per shard, each asking for a slot of the limit
    assert asked.count([f"tag:{GPU_TAG}"]) == N // SHARD, asked


def test_bad_config_fails_before_any_compute(tmp_path, monkeypatch):
    from prefect.exceptions import ParameterTypeError

    from flows import attribute

    monkeypatch.setattr(Featurizer, "featurize", lambda *a, **k: pytest.fail("computed despite a bad config"))
    paths = tiny.save_checkpoints(tmp_path / "ck", seeds=(0,))
    base = config(tmp_path, paths).model_dump()
    blocker = tmp_path / "file"
    blocker.write_text("")
    cases = {
        "model": "examples.tiny:nope",
        "checkpoints": [str(tmp_path / "ck" / "gone.pt")],
        "proj_dim": 0,
        "store": str(blocker / "store.zarr"),
    }
    for field, value in cases.items():
        with pytest.raises(ParameterTypeError, match=f"config.{field}" if field != "checkpoints" else "checkpoints"):
            attribute(config={**base, field: value})
    assert not os.path.exists(base["store"]) and not os.path.exists(blocker.parent / "report")


@pytest.mark.parametrize(
    "over,field,exc",
    [
        (dict(train_data="examples.tiny:bad_labels"), "train_data", BadInputError),
        (dict(proj_dim=N, lambda_reg=0.0), "proj_dim", BadInputError),
        (dict(grad_wrt=["0.weight", "nope"]), "grad_wrt", BadInputError),
        (dict(target_data="test_flows:float64_target_data"), "target_data: tensor 0 is torch.float64", BadInputError),
    ],
)
def test_plan_rejects_bad_input_before_writing(tmp_path, over, field, exc):
    from flows import attribute

    paths = tiny.save_checkpoints(tmp_path / "ck", seeds=(0,))
    cfg = config(tmp_path, paths, **over)
    with pytest.raises(exc, match=field):
        attribute(cfg)
    assert not os.path.exists(cfg.store)


def test_checkpoint_that_does_not_fit_is_named(tmp_path):
    from flows import attribute

    paths = tiny.save_checkpoints(tmp_path / "ck", seeds=(0,))
    torch.save({"weight": torch.zeros(2)}, tmp_path / "ck" / "model_009.pt")
    cfg = config(tmp_path, str(tmp_path / "ck" / "*.pt"))
    with pytest.raises(BadInputError, match=r"checkpoints\[1\].*model_009.pt"):
        attribute(cfg)
    assert not os.path.exists(cfg.store)
    assert len(paths) == 1


def test_other_checkpoint_for_same_model_id_is_refused(tmp_path):
    from flows import featurize

    tiny.save_checkpoints(tmp_path / "ck", seeds=(0,))
    cfg = config(tmp_path, str(tmp_path / "ck" / "*.pt"))
    featurize(cfg)
    torch.manual_seed(5)
    torch.save(tiny.make_model().state_dict(), tmp_path / "ck" / "model_000.pt")  # same path, new content
    with pytest.raises(StoreMismatchError, match="model_id=0"):
        featurize(cfg)


def test_plan_refuses_a_store_of_other_train_data(tmp_path):
    """The plan records the train data's fingerprint; a rerun with the same data resumes, other data is refused."""
    from tasks import core

    paths = tiny.save_checkpoints(tmp_path / "ck", seeds=(0,))
    cfg = config(tmp_path, paths)
    plan = core.make_plan(cfg)
    assert plan.model_ids == [0] and list(plan.shards()) == list(range(N // SHARD))
    store = TrakStore.open(cfg.store)
    assert len(store.pipeline_info()["train_data_sha256"]) == 64
    assert core.make_plan(cfg) == plan
    store.set_pipeline_info({"train_data_sha256": "0" * 64})
    with pytest.raises(StoreMismatchError, match="train_data"):
        core.make_plan(cfg)


def test_retry_condition():
    from prefect.states import Failed

    from tasks.attribution import retry_unless_bad_input

    assert not retry_unless_bad_input(None, None, Failed(data=BadInputError("x")))
    assert not retry_unless_bad_input(None, None, Failed(data=StateError("x")))
    assert not retry_unless_bad_input(None, None, Failed(data=StoreMismatchError("x")))
    assert retry_unless_bad_input(None, None, Failed(data=OSError("disk hiccup")))
    assert retry_unless_bad_input(None, None, Failed(data=RuntimeError("CUDA out of memory")))


def test_task_options():
    from prefect.cache_policies import NONE

    from tasks import attribution, training

    for t in (attribution.featurize_shard, attribution.featurize_targets, training.train_model):
        assert "trakflow-gpu" not in t.tags  # tagged by the flows only where a limit exists (on_gpu)
    for t in (
        attribution.featurize_shard,
        attribution.finalize_checkpoint,
        attribution.featurize_targets,
        attribution.score_block,
        training.train_model,
    ):
        assert t.retries == 2 and t.retry_condition_fn is attribution.retry_unless_bad_input
        assert type(t.cache_policy) is type(NONE)


def test_flows_run_tasks_on_their_configs_runner(tmp_path):
    """Every flow's tasks run on the runner its config asks for, however it is called (directly here):
    ConfigTaskRunner builds it from the flow run's validated ``config`` on the first submitted task."""
    from prefect import flow, task
    from prefect.context import FlowRunContext
    from prefect.task_runners import ThreadPoolTaskRunner

    import flows
    from flows.runners import ConfigTaskRunner

    for f in (flows.attribute, flows.featurize, flows.finalize, flows.score, flows.train, flows.evaluate):
        assert isinstance(f.task_runner, ConfigTaskRunner), f.name

    @task
    def one() -> int:
        return 1

    @flow(task_runner=ConfigTaskRunner())
    def probe(config: TrainConfig) -> tuple:
        assert one.submit().result() == 1
        runner = FlowRunContext.get().task_runner.runner
        return type(runner).__name__, runner._max_workers

    cfg = TrainConfig(
        model="examples.tiny:make_model",
        train_data="examples.tiny:train_data",
        out_dir=str(tmp_path / "ck"),
        max_workers=3,
    )
    assert probe(cfg) == (ThreadPoolTaskRunner.__name__, 3)


def test_train_flow_gives_each_model_its_share_of_the_cores(tmp_path, monkeypatch):
    """Two models trained at once on two cores train with one torch thread each, a lone model with both
    (concurrent trainings on all the cores each spin at each other's OpenMP barriers); the flow's thread keeps
    its count."""
    import torch

    from flows import train
    from tasks import common, trainer

    monkeypatch.setattr(common, "cores", lambda: 2)
    seen: list[int] = []
    real = trainer.train_one

    def train_one(config, index):
        seen.append(torch.get_num_threads())
        return real(config, index)

    monkeypatch.setattr(trainer, "train_one", train_one)
    recipe = dict(model="examples.tiny:make_model", train_data="examples.tiny:train_data", epochs=1, batch_size=16)
    before = torch.get_num_threads()
    train(TrainConfig(**recipe, out_dir=str(tmp_path / "two"), num_models=2, max_workers=2))
    assert seen == [1, 1]
    train(TrainConfig(**recipe, out_dir=str(tmp_path / "one"), num_models=1, max_workers=2))
    assert seen[2:] == [2] and torch.get_num_threads() == before


def test_train_flow_manifest_and_rerun(tmp_path):
    from flows import train

    cfg = TrainConfig(
        model="examples.tiny:make_model",
        train_data="examples.tiny:train_data",
        out_dir=str(tmp_path / "ck"),
        num_models=2,
        epochs=2,
        batch_size=16,
        lr=0.05,
        subset_fraction=0.5,
        alpha_every=1,
    )
    res = train(cfg)
    assert res["computed"] == 2
    manifest = json.loads(Path(res["manifest"]).read_text())
    assert [c["path"] for c in manifest["checkpoints"]] == ["model_000.pt", "model_001.pt"]
    for i, entry in enumerate(manifest["checkpoints"]):
        sd = torch.load(tmp_path / "ck" / entry["path"], weights_only=True)
        tiny.make_model().load_state_dict(sd)
        subset = np.load(tmp_path / "ck" / entry["subset"])
        assert subset.size == N // 2 and entry["train_rows"] == N // 2
        for plot in entry["plots"].values():
            assert (tmp_path / "ck" / plot).read_bytes()[:4] == b"\x89PNG"
    try:
        import trak_core.alpha  # noqa: F401
    except ImportError:
        pass
    else:
        assert {"alpha_trace", "alpha_gauge"} <= set(manifest["checkpoints"][0]["plots"])
        record = json.loads((tmp_path / "ck" / "model_000.json").read_text())
        assert len(record["alpha"]) >= 1
    # different seeds → different subsets and weights
    s0 = np.load(tmp_path / "ck" / manifest["checkpoints"][0]["subset"])
    s1 = np.load(tmp_path / "ck" / manifest["checkpoints"][1]["subset"])
    assert not np.array_equal(s0, s1)

    again = train(cfg)
    assert again["computed"] == 0 and again["skipped"] == 2
    acfg = config(tmp_path, res["manifest"])
    assert acfg.checkpoint_paths == [str(tmp_path / "ck" / "model_000.pt"), str(tmp_path / "ck" / "model_001.pt")]


def test_alpha_restores_the_global_rng_only_under_the_seeding_lock(tmp_path, monkeypatch):
    """α's JVP runs inside torch.random.fork_rng, which restores torch's global RNG on exit: in another training
    thread that would overwrite a seed set for a model not yet built (models then start from other weights, seen as
    snapshots that are not the one-epoch models under load). Every fork_rng of a training run and every seeded
    model build hold the same lock, so the two never interleave."""
    import contextlib

    from tasks import trainer

    forks, builds = [], []
    real_fork, real_seed = torch.random.fork_rng, torch.manual_seed

    @contextlib.contextmanager
    def fork_rng(*a, **k):
        forks.append(trainer._TORCH_STATE_LOCK.locked())
        with real_fork(*a, **k):
            yield

    def manual_seed(seed):
        builds.append(trainer._TORCH_STATE_LOCK.locked())
        return real_seed(seed)

    monkeypatch.setattr(torch.random, "fork_rng", fork_rng)
    monkeypatch.setattr(torch, "manual_seed", manual_seed)
    recipe = dict(model="examples.tiny:make_model", train_data="examples.tiny:train_data", batch_size=16, lr=0.05)
    trainer.train_one(TrainConfig(**recipe, out_dir=str(tmp_path), num_models=1, epochs=1, alpha_every=1), 0)
    assert forks and all(forks) and builds and all(builds), (forks, builds)


def test_train_flow_snapshots_are_checkpoints_of_their_own(tmp_path):
    """``snapshots``: each run also saves its state after the step nearest each fraction (below 1) of its steps,
    as a checkpoint of its own in the manifest; the snapshot at half of two epochs is the model of a one-epoch run
    (to float32 rounding: concurrent training threads may split BLAS work differently). A rerun skips; other
    fractions retrain; bad fractions are refused naming the field."""
    from flows import train
    from tasks import trainer

    recipe = dict(model="examples.tiny:make_model", train_data="examples.tiny:train_data", batch_size=16, lr=0.05)
    cfg = TrainConfig(**recipe, out_dir=str(tmp_path / "ck"), num_models=2, epochs=2, snapshots=[1.0, 0.5, 0.5])
    assert cfg.snapshots == [0.5, 1.0]
    res = train(cfg)
    steps = 2 * (N // 16)
    manifest = json.loads(Path(res["manifest"]).read_text())
    half = f"step{steps // 2}"
    assert [c["path"] for c in manifest["checkpoints"]] == [
        f"model_000.{half}.pt",
        "model_000.pt",
        f"model_001.{half}.pt",
        "model_001.pt",
    ]
    assert [c["snapshot"] for c in manifest["checkpoints"]] == [0.5, 1.0, 0.5, 1.0]
    one_epoch = TrainConfig(**recipe, out_dir=str(tmp_path / "one"), num_models=2, epochs=1)
    train(one_epoch)
    for i in range(2):
        snap = torch.load(tmp_path / "ck" / f"model_00{i}.{half}.pt", weights_only=True)
        ref = torch.load(tmp_path / "one" / f"model_00{i}.pt", weights_only=True)
        assert snap.keys() == ref.keys()
        for k in snap:
            torch.testing.assert_close(snap[k], ref[k], rtol=1e-5, atol=1e-6)
        end = torch.load(tmp_path / "ck" / f"model_00{i}.pt", weights_only=True)
        assert any((snap[k] - end[k]).abs().max() > 1e-3 for k in snap if snap[k].is_floating_point())
    acfg = config(tmp_path, res["manifest"])
    assert len(acfg.checkpoint_paths) == 4  # attribute takes every snapshot
    assert train(cfg)["skipped"] == 2
    other = cfg.model_copy(update={"snapshots": [0.25, 1.0]})
    assert train(other)["computed"] == 2  # other fractions: retrained
    assert not trainer.is_complete(cfg.out_dir, 0, cfg.snapshots) and trainer.is_complete(cfg.out_dir, 0, [0.25, 1])
    assert trainer.snapshot_steps([0.25, 0.26, 0.999, 1.0], 8) == {2: 0.25}  # same step once, none at the end
    for bad in ([0.5], [0.0, 1.0], [1.5, 1.0]):
        with pytest.raises(ValidationError, match="snapshots"):
            TrainConfig(**recipe, out_dir=str(tmp_path / "x"), snapshots=bad)
    assert not (tmp_path / "x").exists()


def test_deployments_register_and_trigger():
    """serve.py's deployments: one on a cron schedule; applied and triggered with run_deployment."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from deployments.serve import build_deployments

    deps = build_deployments()
    names = {(d.flow_name, d.name) for d in deps}
    assert names == {
        ("digits-demo", "nightly"),
        ("attribute", "digits"),
        ("train", "digits"),
        ("query", "digits"),
        ("select", "digits"),
    }
    nightly = next(d for d in deps if d.name == "nightly")
    assert [s.schedule.cron for s in nightly.schedules] == ["0 3 * * *"]
    on_demand = next(d for d in deps if d.flow_name == "attribute")
    on_demand.apply()
    run = run_deployment("attribute/digits", timeout=0)

    async def read():
        async with get_client() as client:
            return await client.read_flow_run(run.id)

    fr = asyncio.run(read())
    assert fr.deployment_id is not None and fr.state.is_scheduled()
    assert "config" in fr.parameters


def test_prefect_yaml_entrypoints_resolve():
    import importlib

    import yaml

    spec = yaml.safe_load((REPO_ROOT / "deployments" / "prefect.yaml").read_text())
    assert spec["deployments"]
    from prefect import Flow

    from tasks.config import AttributeConfig, TrainConfig

    for dep in spec["deployments"]:
        path, fn = dep["entrypoint"].split(":")
        flow_obj = getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), fn)
        assert isinstance(flow_obj, Flow)
        cfg = dep["parameters"].get("config")
        if cfg is not None:  # the pre-filled configs name only real fields
            cls = AttributeConfig if flow_obj.name == "attribute" else TrainConfig
            assert set(cfg) <= set(cls.model_fields)
    assert [s["cron"] for d in spec["deployments"] for s in d.get("schedules") or []] == ["0 3 * * *"]


def test_stages_give_each_task_its_share_of_the_cores(tmp_path, monkeypatch):
    """The flows tell each task how many tasks its stage has: on two cores with two task threads, each of the
    featurize tasks multiplies with one torch thread, the one finalize task with both; the flow's own thread
    keeps its count."""
    import torch

    from flows import featurize, finalize
    from tasks import common, core

    monkeypatch.setattr(common, "cores", lambda: 2)
    seen: dict[str, list[int]] = {"featurize": [], "finalize": []}
    real_shard, real_final = core.featurize_shard, core.finalize_checkpoint

    def shard(*a):
        seen["featurize"].append(torch.get_num_threads())
        return real_shard(*a)

    def final(*a):
        seen["finalize"].append(torch.get_num_threads())
        return real_final(*a)

    monkeypatch.setattr(core, "featurize_shard", shard)
    monkeypatch.setattr(core, "finalize_checkpoint", final)
    paths = tiny.save_checkpoints(tmp_path / "ck", seeds=(0,))
    cfg = config(tmp_path, paths, task_runner="thread", max_workers=2)
    before = torch.get_num_threads()
    featurize(cfg)
    finalize(cfg)
    assert seen == {"featurize": [1] * (N // SHARD), "finalize": [2]}
    assert torch.get_num_threads() == before
