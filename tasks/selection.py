"""Data selection for the pipeline, the CLI and the flow (no Prefect import; flows/selection.py wraps it).

A selection names a store (or the YAML config of the attribute run that built it), a file of target inputs (the
format of ``trakflow query``'s inputs, :func:`tasks.query.load_inputs`), and how many train rows to keep (a
``fraction`` of them or ``k``). It ranks the train rows by their summed influence on the targets
(:func:`trak_core.scoring.selection.select`: one pass over the store) and writes to ``out_dir``:

* ``selected_indices.npy`` (k,) int64 and ``selected_scores.npy`` (k,) float32, best first;
* ``selection.csv``: ``rank,index,score`` (and ``label`` where the train data has class labels);
* ``summed_influence.npy``: (n,) float32, every train row's summed influence (to choose another cut later);
* ``selected_rows.pt``: the selected train rows, ``torch.save`` of a tuple of tensors in the train data's format,
  where the train data is known (the config's ``train_data``, or ``train_data`` given);
* ``selection.json``: what was selected from what (store, inputs, checkpoints, k, fraction, files).
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trak_core.errors import BadInputError
from trak_core.scoring.index import TrakIndex
from trak_core.scoring.selection import Selection, select, selection_size

from . import report
from .config import AttributeConfig, load_data
from .query import INPUT_SUFFIXES, QueryConfig, load_inputs, open_index


class SelectConfig(BaseModel):
    """Parameters of the ``select`` flow and of ``trakflow select``."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    store: str = Field(description="the store (path or URL), or the YAML file of the attribute config that built it")
    inputs: str = Field(description="the target set: a .pt file (torch.save((x, y), path)) or a .npz file")
    out_dir: str = Field(description="folder for the selected indices, their scores and the selected rows")
    fraction: float | None = Field(None, gt=0, le=1, description="share of the train rows to keep (or give k)")
    k: int | None = Field(None, ge=1, description="number of train rows to keep (or give fraction)")
    opponents: bool = Field(False, description="keep the rows with the lowest summed influence instead")
    model: str | None = Field(
        None, description="import path 'pkg.mod:factory' of the model (needed with a store; a config names it)"
    )
    checkpoints: list[str] | None = Field(
        None, description="checkpoint files, one per model_id (default: the config's, or the store's records)"
    )
    task: str | None = Field(None, description="model output function (default: the config's, or the store's)")
    grad_wrt: list[str] | None = Field(None, description="parameters the store's gradients were taken for")
    device: str = Field("cpu", description="'cpu', 'cuda', 'cuda:N' or 'auto'")
    train_data: str | None = Field(None, description="import path of the train data, to write the selected rows")
    batch_size: int = Field(64, ge=1, description="targets featurized at once")
    import_roots: list[str] | None = Field(None, description="modules the import paths may name (null: any)")

    @field_validator("inputs")
    @classmethod
    def _inputs_file(cls, v: str) -> str:
        if not Path(v).is_file():
            raise ValueError(f"inputs: {v!r} is not a file")
        if Path(v).suffix.lower() not in INPUT_SUFFIXES:
            raise ValueError(f"inputs: {v!r} must be a .pt, .pth or .npz file (torch.save((x, y)) or np.savez(x, y))")
        return v

    @field_validator("out_dir")
    @classmethod
    def _out_dir(cls, v: str) -> str:
        if Path(v).exists() and not Path(v).is_dir():
            raise ValueError(f"out_dir: {v!r} exists and is not a folder")
        return v

    @model_validator(mode="after")
    def _one_size(self) -> SelectConfig:
        if (self.fraction is None) == (self.k is None):
            raise ValueError("fraction: give exactly one of fraction and k (how many train rows to keep)")
        return self

    @property
    def is_config(self) -> bool:
        return self.store.endswith((".yaml", ".yml")) and Path(self.store).is_file()

    def query_config(self) -> QueryConfig:
        """The same store, model and checkpoints as a query names them (to open the index as a query does)."""
        keep = ("store", "inputs", "model", "checkpoints", "task", "grad_wrt", "device", "train_data", "import_roots")
        return QueryConfig(**{key: getattr(self, key) for key in keep})


def _train_data(sc: SelectConfig) -> tuple | None:
    """The train data the selected rows are taken from, if known (the config's or ``train_data``)."""
    config = AttributeConfig.from_yaml(sc.store) if sc.is_config else None
    path = sc.train_data or (config.train_data if config else None)
    roots = sc.import_roots or (config.import_roots if config else None)
    return load_data(path, "train_data", roots) if path else None


def write_selection(sel: Selection, out_dir: str | os.PathLike, train: tuple | None, meta: dict) -> list[str]:
    """The files of the module docstring, in ``out_dir`` (created); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "selected_indices.npy", out / "selected_scores.npy", out / "summed_influence.npy"]
    np.save(files[0], sel.indices)
    np.save(files[1], sel.scores)
    np.save(files[2], sel.row_scores)
    labels = report.labels_of(train) if train is not None else None
    with open(out / "selection.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["rank", "index", "score", *(["label"] if labels is not None else [])])
        for r, (i, s) in enumerate(zip(sel.indices, sel.scores, strict=True)):
            w.writerow([r + 1, int(i), repr(float(s)), *([int(labels[i])] if labels is not None else [])])
    files.append(out / "selection.csv")
    if train is not None:
        rows = torch.from_numpy(sel.indices)
        torch.save(tuple(t[rows] for t in train), out / "selected_rows.pt")
        files.append(out / "selected_rows.pt")
    else:
        (out / "selected_rows.pt").unlink(missing_ok=True)  # an earlier selection's rows are not this one's
    names = [str(f) for f in files] + [str(out / "selection.json")]
    doc = {**meta, **{k: v for k, v in sel.to_dict().items() if k not in ("indices", "scores")}, "files": names}
    (out / "selection.json").write_text(json.dumps(doc, indent=1))
    return names


def run_select(sc: SelectConfig, index: TrakIndex | None = None) -> dict:
    """Select the train rows (see the module docstring) and write them to ``sc.out_dir``. Returns ``{"store",
    "inputs", "n", "k", "fraction", "opponents", "num_targets", "model_ids", "rows", "files"}``, ``rows`` the
    selected rows best first (``{"rank", "index", "score", "label"}``)."""
    targets = load_inputs(sc.inputs)
    index = index or open_index(sc.query_config())
    size = selection_size(index.n, sc.fraction, sc.k)  # refused before any compute
    train = _train_data(sc)
    if train is not None and train[0].shape[0] != index.n:
        raise BadInputError(
            f"train_data: {train[0].shape[0]} rows, but the store {index.location} has {index.n} train rows"
        )
    sel = select(index, targets, k=size, opponents=sc.opponents, batch_size=sc.batch_size)
    labels = report.labels_of(train) if train is not None else None
    meta = {"store": index.location, "inputs": sc.inputs, "fraction": sel.fraction}
    files = write_selection(sel, sc.out_dir, train, meta)
    rows: list[dict[str, Any]] = [
        {"rank": r + 1, "index": int(i), "score": float(s), "label": None if labels is None else int(labels[i])}
        for r, (i, s) in enumerate(zip(sel.indices, sel.scores, strict=True))
    ]
    return {
        "store": index.location,
        "inputs": sc.inputs,
        "n": index.n,
        "k": sel.k,
        "fraction": sel.fraction,
        "opponents": sel.opponents,
        "num_targets": sel.num_targets,
        "model_ids": list(sel.model_ids),
        "rows": rows,
        "files": files,
    }


__all__ = ["SelectConfig", "run_select", "write_selection"]
