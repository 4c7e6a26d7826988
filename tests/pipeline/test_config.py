"""The pipeline config fails before any compute, naming the field, and leaves nothing behind."""

from __future__ import annotations

import json
import os

import pytest
from pydantic import ValidationError
from trak_fixtures import REPO_ROOT

from examples import tiny
from tasks.config import AttributeConfig, TrainConfig, check_store_location, load_object, resolve_checkpoints
from trak_core.errors import BadInputError


@pytest.fixture()
def ckpts(tmp_path):
    return tiny.save_checkpoints(tmp_path / "ck", seeds=(1, 0))


def good(tmp_path, ckpts, **over):
    cfg = dict(
        model="examples.tiny:make_model",
        train_data="examples.tiny:train_data",
        target_data="examples.tiny:target_data",
        checkpoints=ckpts,
        store=str(tmp_path / "store.zarr"),
        proj_dim=16,
        batch_size=8,
        shard_size=16,
        chunk_rows=8,
        device="cpu",
    )
    cfg.update(over)
    return cfg


def fails_naming(field: str, cfg: dict, cls=AttributeConfig) -> str:
    with pytest.raises(ValidationError) as ei:
        cls.model_validate(cfg)
    msg = str(ei.value)
    assert field in msg, msg
    return msg


def test_good_config_resolves_sorted_checkpoints(tmp_path, ckpts):
    cfg = AttributeConfig.model_validate(good(tmp_path, ckpts))
    assert cfg.checkpoint_paths == sorted(os.path.abspath(p) for p in ckpts)
    assert cfg.effective_chunk_rows == 8
    assert not os.path.exists(cfg.store)  # validation writes nothing


def test_checkpoints_by_glob_and_manifest(tmp_path, ckpts):
    by_glob = AttributeConfig.model_validate(good(tmp_path, str(tmp_path / "ck" / "*.pt")))
    manifest = tmp_path / "ck" / "manifest.json"
    manifest.write_text(json.dumps({"checkpoints": [{"path": os.path.basename(p)} for p in ckpts]}))
    by_manifest = AttributeConfig.model_validate(good(tmp_path, str(manifest)))
    assert by_glob.checkpoint_paths == by_manifest.checkpoint_paths == sorted(os.path.abspath(p) for p in ckpts)


@pytest.mark.parametrize(
    "field,value",
    [
        ("model", "examples.tiny:no_such_factory"),
        ("model", "no_such_package.mod:make_model"),
        ("model", "examples.tiny.make_model"),
        ("train_data", "examples.nope:train_data"),
        ("target_data", "examples.tiny:nothing"),
        ("task", "examples.tiny:make_model"),
        ("task", "image_clasification"),
        ("show", "examples.tiny:nope"),
    ],
)
def test_bad_import_path_names_field(tmp_path, ckpts, field, value):
    cfg = good(tmp_path, ckpts, **{field: value})
    fails_naming(field, cfg)
    assert not os.path.exists(cfg["store"])


def test_missing_checkpoint_names_field(tmp_path, ckpts):
    cfg = good(tmp_path, ckpts + [str(tmp_path / "ck" / "missing.pt")])
    msg = fails_naming("checkpoints", cfg)
    assert "missing.pt" in msg
    fails_naming("checkpoints", good(tmp_path, str(tmp_path / "nothing" / "*.pt")))
    fails_naming("checkpoints", good(tmp_path, str(tmp_path / "ck" / "no_manifest.json")))
    assert not os.path.exists(cfg["store"])


@pytest.mark.parametrize("proj_dim", [0, -3])
def test_proj_dim_must_be_positive(tmp_path, ckpts, proj_dim):
    cfg = good(tmp_path, ckpts, proj_dim=proj_dim)
    fails_naming("proj_dim", cfg)
    assert not os.path.exists(cfg["store"])


def test_store_under_a_file_is_unwritable(tmp_path, ckpts):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cfg = good(tmp_path, ckpts, store=str(blocker / "sub" / "store.zarr"))
    msg = fails_naming("store", cfg)
    assert "not a directory" in msg
    assert not os.path.exists(blocker / "sub")


@pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0,
    reason="root ignores directory permissions; the file-parent case covers unwritable stores",
)
def test_store_in_read_only_dir_is_unwritable(tmp_path, ckpts):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        cfg = good(tmp_path, ckpts, store=str(ro / "store.zarr"))
        fails_naming("store", cfg)
        assert os.listdir(ro) == []
    finally:
        ro.chmod(0o700)


def test_writability_probe_leaves_nothing(tmp_path):
    check_store_location(str(tmp_path / "x" / "y.zarr"))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "over,field",
    [
        (dict(chunk_rows=6), "chunk_rows"),
        (dict(score_task_rows=24), "score_task_rows"),  # not whole shards of 16
        (dict(score_task_rows=0), "score_task_rows"),
        (dict(lambda_reg=-1.0), "lambda_reg"),
        (dict(batch_size=0), "batch_size"),
        (dict(projector="sparse"), "projector"),
        (dict(dtype="float64"), "dtype"),
        (dict(exp_name="a/b"), "exp_name"),
        (dict(grad_wrt=[]), "grad_wrt"),
        (dict(unknown_field=1), "unknown_field"),
    ],
)
def test_other_fields(tmp_path, ckpts, over, field):
    fails_naming(field, good(tmp_path, ckpts, **over))


def test_yaml_round_trip(tmp_path, ckpts):
    cfg = AttributeConfig.model_validate(good(tmp_path, ckpts))
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    again = AttributeConfig.from_yaml(path)
    assert again == cfg
    bad = tmp_path / "bad.yaml"
    bad.write_text(cfg.to_yaml().replace("proj_dim: 16", "proj_dim: 0"))
    with pytest.raises(ValidationError, match="proj_dim"):
        AttributeConfig.from_yaml(bad)


def test_json_schema_is_a_form():
    schema = AttributeConfig.model_json_schema()
    assert {"model", "train_data", "checkpoints", "proj_dim", "store"} <= set(schema["properties"])
    assert schema["properties"]["proj_dim"]["exclusiveMinimum"] == 0


def test_load_object_and_resolve_errors(tmp_path):
    assert load_object("examples.tiny:make_model") is tiny.make_model
    with pytest.raises(BadInputError, match="model"):
        load_object("examples.tiny:nope", "model")
    with pytest.raises(BadInputError, match="checkpoints"):
        resolve_checkpoints([])


def test_train_config(tmp_path):
    ok = dict(model="examples.tiny:make_model", train_data="examples.tiny:train_data", out_dir=str(tmp_path / "o"))
    cfg = TrainConfig.model_validate(ok)
    assert cfg.model_seeds() == [0, 1, 2]
    fails_naming("seeds", {**ok, "seeds": [1]}, TrainConfig)
    fails_naming("model", {**ok, "model": "examples.tiny:nope"}, TrainConfig)
    fails_naming("subset_fraction", {**ok, "subset_fraction": 0.0}, TrainConfig)
    blocker = tmp_path / "f"
    blocker.write_text("")
    fails_naming("out_dir", {**ok, "out_dir": str(blocker / "o")}, TrainConfig)
    assert not os.path.exists(tmp_path / "o")


def test_example_yaml_files_name_real_fields():

    import yaml

    root = REPO_ROOT / "examples"
    attr = yaml.safe_load((root / "digits.yaml").read_text())
    assert set(attr) <= set(AttributeConfig.model_fields)
    train = TrainConfig.from_yaml(root / "digits_train.yaml")  # validates; writes nothing
    assert train.num_models == 3 and train.model_seeds() == [0, 1, 2]


# ---------------------------------------------------------------------------- bad configs, clear lines
@pytest.mark.parametrize("name", ["..", ".", "a/b", "new\\sub", "../up", "a..b", ".hidden", "-x", "", "x y", "x" * 129])
def test_unsafe_exp_name_is_refused(tmp_path, ckpts, name):
    cfg = good(tmp_path, ckpts, exp_name=name)
    msg = fails_naming("exp_name", cfg)
    assert "not a safe experiment name" in msg
    assert not os.path.exists(cfg["store"])


def test_safe_exp_names_pass(tmp_path, ckpts):
    for name in ("default", "tiny", "run-2.v1", "A_b"):
        assert AttributeConfig.model_validate(good(tmp_path, ckpts, exp_name=name)).exp_name == name


def test_validation_calls_nothing_and_follows_no_attribute_chain(tmp_path, ckpts, monkeypatch):
    """`model: "os:environ.clear"` used to pass validation and empty the environment."""
    monkeypatch.setenv("TRAKFLOW_CANARY", "alive")
    for value in ("os:environ.clear", "os:environ.clear()", "builtins:__import__", "os.path:join.__call__"):
        fails_naming("model", good(tmp_path, ckpts, model=value))
    assert os.environ.get("TRAKFLOW_CANARY") == "alive"
    with pytest.raises(BadInputError, match="one attribute name"):
        load_object("os:environ.clear", "model")
    # a zero-argument factory is resolved, not called: the validation of a config does not build the model
    calls = []
    orig = tiny.make_model

    def spy():
        calls.append(1)
        return orig()

    monkeypatch.setattr(tiny, "make_model", spy)
    cfg = AttributeConfig.model_validate(good(tmp_path, ckpts))
    assert calls == []
    cfg.build_model()  # running the config calls it
    assert calls == [1]


def test_import_roots_from_the_environment(tmp_path, ckpts, monkeypatch):
    monkeypatch.setenv("TRAKFLOW_IMPORT_ROOTS", "examples")
    AttributeConfig.model_validate(good(tmp_path, ckpts))  # inside the allow-list
    import sys

    sys.modules.pop("json.tool", None)
    msg = fails_naming("model", good(tmp_path, ckpts, model="json.tool:main"))
    assert "outside the allowed import roots ['examples']" in msg and "TRAKFLOW_IMPORT_ROOTS" in msg
    assert "json.tool" not in sys.modules  # refused before import
    fails_naming("task", good(tmp_path, ckpts, task="trak_core.featurize.modelout:ImageClassificationModelOutput"))
    # a config cannot widen the deployment's list
    fails_naming("model", good(tmp_path, ckpts, model="json:dumps", import_roots=["examples", "json"]))
    monkeypatch.setenv("TRAKFLOW_IMPORT_ROOTS", "examples.tin")  # a prefix of a name is not its root
    fails_naming("model", good(tmp_path, ckpts))


def test_import_roots_field_narrows(tmp_path, ckpts, monkeypatch):
    monkeypatch.delenv("TRAKFLOW_IMPORT_ROOTS", raising=False)
    cfg = AttributeConfig.model_validate(good(tmp_path, ckpts, import_roots=["examples.tiny"]))
    assert cfg.import_roots == ["examples.tiny"]
    msg = fails_naming("train_data", good(tmp_path, ckpts, import_roots=["examples.other"]))
    assert "import_roots" in msg
    fails_naming("import_roots", good(tmp_path, ckpts, import_roots=["not a module"]))


def test_flow_parameter_validation_enforces_the_allow_list(tmp_path, ckpts, monkeypatch):
    """A run triggered over the API arrives as JSON parameters that Prefect validates into AttributeConfig in the
    worker's process: the worker's TRAKFLOW_IMPORT_ROOTS applies."""
    from prefect.utilities.callables import parameters_to_args_kwargs  # noqa: F401 - prefect is importable

    from flows.attribute import attribute

    monkeypatch.setenv("TRAKFLOW_IMPORT_ROOTS", "examples")
    params = {"config": good(tmp_path, ckpts, model="os:getcwd")}
    with pytest.raises(Exception, match="outside the allowed import roots"):
        attribute.validate_parameters(params)
    ok = attribute.validate_parameters({"config": good(tmp_path, ckpts)})
    assert isinstance(ok["config"], AttributeConfig)


def _plan_fails(tmp_path, ckpts, field: str, match: str, **over):
    from tasks.core import make_plan

    cfg = AttributeConfig.model_validate(good(tmp_path, ckpts, **over))
    with pytest.raises(BadInputError, match=match) as ei:
        make_plan(cfg)
    assert str(ei.value).startswith(f"{field}:"), str(ei.value)
    assert not os.path.exists(cfg.store)  # nothing written
    return str(ei.value)


def test_memory_estimate_refuses_a_proj_dim_that_cannot_fit(tmp_path, ckpts):
    msg = _plan_fails(
        tmp_path,
        ckpts,
        "proj_dim",
        r"featurize task would need about .* is available",
        proj_dim=1_000_000_000,
        projector="dense",
        chunk_rows=None,
        lambda_reg=1e-3,
    )
    assert "XᵀX partial" in msg and "Nothing was written" in msg


def test_memory_estimate_names_the_largest_buffer(tmp_path, ckpts, monkeypatch):
    monkeypatch.setenv("TRAKFLOW_MEMORY_LIMIT", str(4 << 10))  # a 4 KiB worker
    _plan_fails(
        tmp_path,
        ckpts,
        "batch_size",
        r"would need about .*per-example gradients .* 4\.0 KiB is available",
        lambda_reg=1e-3,
    )


def test_memory_estimate_terms():
    from trak_core.memory import check_task_memory, estimate_task_memory

    est = estimate_task_memory(
        train_set_size=100_000,
        grad_dim=10_000_000,
        proj_dim=512,
        num_params=10_000_000,
        batch_size=4096,
        shard_rows=4096,
        dtype_bytes=2,
        chunk_bytes=32 << 20,
    )
    with pytest.raises(BadInputError, match=r"^batch_size: a featurize task .*per-example gradients"):
        check_task_memory(est, available=100 << 30)
    est = estimate_task_memory(
        train_set_size=1_000_000,
        grad_dim=1000,
        proj_dim=100_000,
        num_params=1000,
        batch_size=8,
        shard_rows=1_000_000,
        dtype_bytes=2,
        chunk_bytes=32 << 20,
    )
    with pytest.raises(BadInputError, match=r"^shard_size: "):
        check_task_memory(est, available=100 << 30)
    est = estimate_task_memory(
        train_set_size=100,
        grad_dim=11_700_000,
        proj_dim=11_700_000,
        num_params=11_700_000,
        batch_size=8,
        shard_rows=100,
        dtype_bytes=2,
        chunk_bytes=32 << 20,
    )
    with pytest.raises(BadInputError, match=r"^projector: .*'noop' keeps every gradient dimension"):
        check_task_memory(est, available=100 << 30, projector="noop")


def test_noop_projector_with_proj_dim_at_least_n_and_zero_lambda_is_refused(tmp_path, ckpts):
    _plan_fails(
        tmp_path,
        ckpts,
        "projector",
        r"'noop' keeps all \d+ gradient dimensions, ≥ .* lambda_reg=0",
        projector="noop",
        lambda_reg=0.0,
    )


def test_cuda_device_without_cuda_is_refused_by_the_plan(tmp_path, ckpts):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    fails_naming("device", good(tmp_path, ckpts, device="cuda"))


def test_missing_module_says_where_modules_are_searched(tmp_path, monkeypatch):
    """A module that is not importable from here (e.g. examples.* outside the repository) names the working
    directory and what to do."""
    from tasks.config import load_object

    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadInputError, match=r"model: cannot import module 'nosuch_pkg_42\.models'.*working directory"):
        load_object("nosuch_pkg_42.models:make", "model")


@pytest.mark.parametrize(
    "over,slots",
    [
        (dict(task_runner="thread", max_workers=3), 3),
        (dict(task_runner="process", max_workers=5), 5),
        (dict(task_runner="process", gpus=["0", "1"]), 2),
        (dict(task_runner="dask", dask_n_workers=3, dask_threads_per_worker=2), 6),
        (dict(task_runner="dask", dask_address="tcp://127.0.0.1:8786"), None),
    ],
)
def test_task_slots_follow_the_runner(tmp_path, ckpts, over, slots):
    """How many tasks run at once (what sizes the score tasks); unknown for an existing Dask cluster."""
    assert AttributeConfig.model_validate(good(tmp_path, ckpts, **over)).task_slots == slots


@pytest.mark.parametrize(
    "over,tasks,cores,want",
    [
        (dict(task_runner="thread", max_workers=2), 313, 2, 1),  # two featurize tasks at once on two cores
        (dict(task_runner="thread", max_workers=2), 1, 2, 2),  # one finalize task: all the cores
        (dict(task_runner="thread", max_workers=4), 100, 16, 4),
        (dict(task_runner="thread", max_workers=8), 3, 16, 5),  # 3 tasks run at once: 16 // 3
        (dict(task_runner="process", max_workers=3), 9, 2, 1),  # never below one
        (dict(task_runner="dask", dask_n_workers=2, dask_threads_per_worker=2), 50, 16, 4),
        (dict(task_runner="dask", dask_address="tcp://127.0.0.1:8786"), 50, 16, None),  # cluster size unknown
    ],
)
def test_threads_per_task_share_the_cores_among_concurrent_tasks(
    tmp_path, ckpts, monkeypatch, over, tasks, cores, want
):
    from tasks import common

    monkeypatch.setattr(common, "cores", lambda: cores)
    config = AttributeConfig.model_validate(good(tmp_path, ckpts, **over))
    assert common.threads_per_task(config, tasks) == want


def test_pipeline_tasks_run_with_their_share_of_torch_and_blas_threads(tmp_path, ckpts, monkeypatch):
    """A pipeline task runs its work with tasks.common.threads_per_task torch threads (its own thread) and as many
    OpenBLAS threads (process-wide: the first task in sets it, the last one out restores it), then restores both;
    None (an existing Dask cluster) leaves them as they are."""
    import threading

    import numpy as np
    import torch
    from threadpoolctl import threadpool_info

    from tasks import attribution, common, core

    np.ones((4, 4)) @ np.ones((4, 4))  # numpy's BLAS loaded
    blas = [d for d in threadpool_info() if d["user_api"] == "blas"]
    if not blas:
        pytest.skip("no BLAS library that threadpoolctl controls")

    def blas_threads() -> int:
        return min(d["num_threads"] for d in threadpool_info() if d["user_api"] == "blas")

    monkeypatch.setattr(common, "cores", lambda: 2)  # not above the machine's (OpenBLAS misbehaves past them)
    config = AttributeConfig.model_validate(good(tmp_path, ckpts, task_runner="thread", max_workers=2))
    seen = []
    monkeypatch.setattr(core, "score_block", lambda *a: seen.append((torch.get_num_threads(), blas_threads())))
    monkeypatch.setattr(core, "finalize_checkpoint", lambda *a: seen.append((torch.get_num_threads(), blas_threads())))
    torch_before, blas_before = torch.get_num_threads(), blas_threads()
    attribution.score_block.fn(config, [0], 0, 16, tasks=10)  # two of ten at once on two cores: one each
    attribution.finalize_checkpoint.fn(config, 0, tasks=1)  # alone: both
    assert seen == [(1, 1), (2, 2)]
    assert (torch.get_num_threads(), blas_threads()) == (torch_before, blas_before)
    dask = AttributeConfig.model_validate(good(tmp_path, ckpts, task_runner="dask", dask_address="tcp://h:8786"))
    attribution.score_block.fn(dask, [0], 0, 16, tasks=10)
    assert seen[-1] == (torch_before, blas_before)
    # OpenBLAS's count is process-wide: with two tasks at once, only the last one out restores the limits
    import threadpoolctl

    calls = []

    class Limits:
        def __init__(self, limits, user_api):
            calls.append(("set", limits, user_api))

        def restore_original_limits(self):
            calls.append(("restore",))

    monkeypatch.setattr(threadpoolctl, "threadpool_limits", Limits)
    inside, leave = threading.Event(), threading.Event()

    def first():
        with common.torch_threads(1):
            inside.set()
            leave.wait()

    t = threading.Thread(target=first)
    t.start()
    inside.wait()
    with common.torch_threads(1):
        pass
    assert calls == [("set", 1, "blas"), ("set", 1, "blas")]  # the first task is still in: nothing restored
    leave.set()
    t.join()
    assert calls[2:] == [("restore",)]
    monkeypatch.undo()
