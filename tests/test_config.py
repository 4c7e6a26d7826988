"""The pipeline config fails before any compute, naming the field, and leaves nothing behind."""

from __future__ import annotations

import json
import os

import pytest
from pydantic import ValidationError

from examples import tiny
from tasks.config import AttributeConfig, TrainConfig, check_store_location, load_object, resolve_checkpoints
from trak_core.errors import BadInputError


@pytest.fixture()
def ckpts(tmp_path):
    return tiny.save_checkpoints(tmp_path / "ck", seeds=(1, 0))


def good(tmp_path, ckpts, **over):
    cfg = dict(model="examples.tiny:make_model", train_data="examples.tiny:train_data",
               target_data="examples.tiny:target_data", checkpoints=ckpts, store=str(tmp_path / "store.zarr"),
               proj_dim=16, batch_size=8, shard_size=16, chunk_rows=8, device="cpu")
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


@pytest.mark.parametrize("field,value", [
    ("model", "examples.tiny:no_such_factory"),
    ("model", "no_such_package.mod:make_model"),
    ("model", "examples.tiny.make_model"),
    ("train_data", "examples.nope:train_data"),
    ("target_data", "examples.tiny:nothing"),
    ("task", "examples.tiny:make_model"),
    ("task", "image_clasification"),
    ("show", "examples.tiny:nope"),
])
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


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root ignores directory permissions; the file-parent case covers unwritable stores")
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


@pytest.mark.parametrize("over,field", [
    (dict(chunk_rows=6), "chunk_rows"),
    (dict(lambda_reg=-1.0), "lambda_reg"),
    (dict(batch_size=0), "batch_size"),
    (dict(projector="sparse"), "projector"),
    (dict(dtype="float64"), "dtype"),
    (dict(exp_name="a/b"), "exp_name"),
    (dict(grad_wrt=[]), "grad_wrt"),
    (dict(unknown_field=1), "unknown_field"),
])
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
    from pathlib import Path

    import yaml

    root = Path(__file__).parent.parent / "examples"
    attr = yaml.safe_load((root / "digits.yaml").read_text())
    assert set(attr) <= set(AttributeConfig.model_fields)
    train = TrainConfig.from_yaml(root / "digits_train.yaml")  # validates; writes nothing
    assert train.num_models == 3 and train.model_seeds() == [0, 1, 2]
