"""Train data that grows: the ``.pt`` and ``.npz`` files of a folder, concatenated in sorted file-name order.

New rows arrive as new files whose names sort after the old ones (``part_000.pt``, ``part_001.pt``, ...); a
rerun of the pipeline then appends them to its store and featurizes only them (a file that changed, or one that
sorts before the last old one, changes stored rows and is refused by the plan, naming the rows).

Import path for the pipeline config (``train_data``)::

    trakflow_demo_data.folder_data:train_folder  # $TRAKFLOW_TRAIN_DIR's folder (else the demo's train folder)

A store built from it records the folder (``train_source`` in its pipeline record), so the query route shows
the same rows, new ones included.

A ``.pt`` file holds a tuple (or list) of tensors (``torch.save((x, y), path)``); an ``.npz`` file its arrays
in the order they were saved (``np.savez(path, x, y)``). Every file has the same number of tensors.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from trak_core.errors import BadInputError

#: the environment variable naming the folder :func:`train_folder` reads
TRAIN_DIR_ENV = "TRAKFLOW_TRAIN_DIR"
SUFFIXES = (".pt", ".npz")


def part_files(folder: str | Path) -> list[Path]:
    """The data files of ``folder`` (``.pt``, ``.npz``), in sorted name order."""
    return sorted(p for p in Path(folder).iterdir() if p.is_file() and p.suffix in SUFFIXES)


def _load(path: Path) -> tuple[torch.Tensor, ...]:
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            return tuple(torch.from_numpy(np.array(z[k])) for k in z.files)
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if torch.is_tensor(obj):
        obj = (obj,)
    if not isinstance(obj, (tuple, list)) or not all(torch.is_tensor(t) for t in obj):
        raise BadInputError(f"{path}: expected a tuple of tensors, got {type(obj).__name__}")
    return tuple(obj)


def load_folder(folder: str | Path) -> tuple[torch.Tensor, ...]:
    """The tensors of every data file of ``folder`` concatenated along rows, files in sorted name order.

    Returns:
        A tuple of tensors (e.g. inputs, labels), each with the rows of all files.
    """
    files = part_files(folder)
    if not files:
        raise BadInputError(f"{folder}: no {' or '.join(SUFFIXES)} files")
    parts = [_load(p) for p in files]
    widths = {len(p) for p in parts}
    if len(widths) != 1:
        counts = {p.name: len(t) for p, t in zip(files, parts, strict=True)}
        raise BadInputError(f"{folder}: the files hold different numbers of tensors {counts}")
    return tuple(torch.cat(ts) for ts in zip(*parts, strict=True))


def save_part(folder: str | Path, data, index: int) -> Path:
    """Write ``data`` (a tuple of tensors) as ``part_<index>.pt`` in ``folder`` (created). Returns its path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"part_{int(index):03d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save(tuple(data), tmp)
    os.replace(tmp, path)  # a reader never sees half a file
    return path


def demo_train_dir() -> Path:
    """The digits demo's train folder: ``<demo_dir>/train``, the demo dir ``$TRAKFLOW_DEMO_DIR`` or
    ``trakflow_demo`` (as the deployments resolve it)."""
    return Path(os.environ.get("TRAKFLOW_DEMO_DIR", "trakflow_demo")).absolute() / "train"


def train_dir() -> Path:
    """The folder :func:`train_folder` reads: ``$TRAKFLOW_TRAIN_DIR``, else the demo's train folder when it holds
    data files (so every route that reads the demo's store sees the rows the nightly run appended)."""
    folder = os.environ.get(TRAIN_DIR_ENV)
    if folder:
        return Path(folder).absolute()
    demo = demo_train_dir()
    if demo.is_dir() and part_files(demo):
        return demo
    raise BadInputError(
        f"train_folder: set {TRAIN_DIR_ENV} to the folder of the train data files (the demo's {demo} holds none)"
    )


def train_folder() -> tuple[torch.Tensor, ...]:
    """The train data of :func:`train_dir` (:func:`load_folder`)."""
    return load_folder(train_dir())


#: the import path of the reader a store records with its folder
READER = "trakflow_demo_data.folder_data:load_folder"


def _source() -> dict:
    return {"read": READER, "train_dir": str(train_dir())}


def _adopt(source: dict) -> bool:
    """Read the folder a store recorded (``source``: its ``train_source``) unless $TRAKFLOW_TRAIN_DIR names one
    (this process was told its folder). True when that changed the folder :func:`train_folder` reads."""
    folder = source.get("train_dir")
    if os.environ.get(TRAIN_DIR_ENV) or not folder or source.get("read") != READER:
        return False
    os.environ[TRAIN_DIR_ENV] = str(folder)
    return True


#: what a store built from this data records as its train data's source (read by the query route)
train_folder.data_source = _source  # type: ignore[attr-defined]
#: a route reading a store built from this data reads the folder the store recorded (tasks.common.adopt_train_source)
train_folder.adopt_source = _adopt  # type: ignore[attr-defined]
