"""digits-demo: the embedded default end to end — train the checkpoints if absent, then attribute."""

from __future__ import annotations

import os
from pathlib import Path

from prefect import flow, get_run_logger

from flows.attribute import attribute
from flows.train import train
from tasks.config import AttributeConfig
from tasks.trainer import is_complete


@flow(name="digits-demo", validate_parameters=True)
def digits_demo(
    demo_dir: str = "trakflow_demo",
    num_models: int = 3,
    epochs: int = 4,
    proj_dim: int = 512,
    lambda_reg: float | str = "adaptive",
    train_folder: bool = False,
) -> dict:
    """scikit-learn's digits, a 64→32→10 MLP: ``num_models`` checkpoints (trained only when absent),
    then the attribute flow on 5 held-out digits. Returns the train result (or None) and the attribution.

    Args:
        train_folder: attribute the train data of the folder ``<demo_dir>/train`` (the files of
            :mod:`trakflow_demo_data.folder_data`, seeded with the digits train set): files added there since the last
            run are appended to the store, which featurizes only their rows (the nightly deployment). Once that
            folder holds files, every run of the demo reads it (the store holds its rows).
    """
    from trakflow_demo_data.digits import demo_configs, write_query_inputs

    train_cfg, attr = demo_configs(
        demo_dir, num_models=num_models, epochs=epochs, proj_dim=proj_dim, lambda_reg=lambda_reg
    )
    log = get_run_logger()
    trained = None
    manifest = Path(train_cfg.out_dir) / "manifest.json"
    if manifest.is_file() and all(is_complete(train_cfg.out_dir, i, train_cfg.snapshots) for i in range(num_models)):
        log.info("checkpoints present in %s: not retraining", train_cfg.out_dir)
    else:
        trained = train(train_cfg)
    folder = Path(demo_dir).absolute() / "train"
    if train_folder or _has_files(folder):  # a store the nightly run grew is read with its train folder
        attr["train_data"] = use_train_folder(folder, log)
    config = AttributeConfig.model_validate(attr)
    Path(demo_dir).mkdir(parents=True, exist_ok=True)
    (Path(demo_dir) / "attribute.yaml").write_text(config.to_yaml())
    write_query_inputs(demo_dir)  # what the query/digits deployment asks about
    result = attribute(config)
    return {"train": trained, "attribute": result, "config": str(Path(demo_dir) / "attribute.yaml")}


def _has_files(folder: Path) -> bool:
    from trakflow_demo_data import folder_data

    return folder.is_dir() and bool(folder_data.part_files(folder))


def use_train_folder(folder: Path, log) -> str:
    """Point :func:`trakflow_demo_data.folder_data.train_folder` at ``folder`` (seeded with the digits train set when it
    holds no data file) and forget this process's cached data, so files added since are read. Returns the
    ``train_data`` import path."""
    from tasks.common import clear_data_cache
    from trakflow_demo_data import digits, folder_data

    files = folder_data.part_files(folder) if folder.is_dir() else []
    if not files:
        files = [folder_data.save_part(folder, digits.train_data(), 0)]
        log.info("train data: %s seeded with the digits train set", files[0])
    os.environ[folder_data.TRAIN_DIR_ENV] = str(folder)
    clear_data_cache()
    log.info("train data: %d files in %s (%s)", len(files), folder, ", ".join(p.name for p in files))
    return "trakflow_demo_data.folder_data:train_folder"
