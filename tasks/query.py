"""Top-k queries for the pipeline, the CLI and the report (no Prefect import; flows/query.py wraps them).

A query names a store (or the YAML config of the attribute run that built it), a file of inputs and k. The
inputs file holds one batch in the task's format, e.g. (inputs, labels) for classification:

* ``.pt`` / ``.pth``: ``torch.save((x, y), path)`` — a tuple or list of tensors, or a dict of tensors (in its
  order);
* ``.npz``: ``np.savez(path, x, y)`` — the arrays in the order saved (``arr_0``, ``arr_1``, ... or the names
  given), each becoming a tensor (``x.astype(np.float32)`` for a float32 model).

With a config everything else comes from it (model, checkpoints, task, grad_wrt; the train data and ``show`` to
draw the report). With a store, ``model`` (an import path) is needed; the checkpoints default to the files the
store recorded (a pipeline store records them), the task to the store's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from trak_core.errors import BadInputError
from trak_core.featurize.modelout import TASK_TO_MODELOUT
from trak_core.scoring.index import QueryResult, TrakIndex, register_config_loader
from trak_core.store import RunStore, open_store

from . import report
from .common import adopt_train_source
from .config import AttributeConfig, load_data, load_object, resolve_device

register_config_loader(AttributeConfig.from_yaml)


class QueryConfig(BaseModel):
    """Parameters of the ``query`` flow and of ``trakflow query``."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    store: str = Field(description="the store (path or URL), or the YAML file of the attribute config that built it")
    inputs: str = Field(description="the batch to attribute: a .pt file (torch.save((x, y), path)) or a .npz file")
    k: int = Field(10, ge=1, description="how many train examples per input and end (proponents, opponents)")
    model: str | None = Field(
        None, description="import path 'pkg.mod:factory' of the model (needed with a store; a config names it)"
    )
    checkpoints: list[str] | None = Field(
        None, description="checkpoint files, one per model_id (default: the config's, or the store's records)"
    )
    task: str | None = Field(None, description="model output function (default: the config's, or the store's)")
    grad_wrt: list[str] | None = Field(None, description="parameters the store's gradients were taken for")
    device: str = Field("cpu", description="'cpu', 'cuda', 'cuda:N' or 'auto'")
    train_data: str | None = Field(None, description="import path of the train data, to show and label the rows")
    show: str | None = Field(None, description="import path of the function drawing an input (image or text)")
    report_dir: str | None = Field(None, description="write the markdown table and one PNG per input here")
    explain: bool = Field(
        False, description="sequence models: split each proponent's score by token of its train text (needs train_data)"
    )
    import_roots: list[str] | None = Field(None, description="modules the import paths may name (null: any)")

    @field_validator("inputs")
    @classmethod
    def _inputs_file(cls, v: str) -> str:
        if not Path(v).is_file():
            raise ValueError(f"inputs: {v!r} is not a file")
        if Path(v).suffix.lower() not in INPUT_SUFFIXES:
            raise ValueError(f"inputs: {v!r} must be a .pt, .pth or .npz file (torch.save((x, y)) or np.savez(x, y))")
        return v

    @property
    def is_config(self) -> bool:
        return self.store.endswith((".yaml", ".yml")) and Path(self.store).is_file()


INPUT_SUFFIXES = (".pt", ".pth", ".npz")


def load_inputs(path: str | os.PathLike) -> tuple[torch.Tensor, ...]:
    """The batch in an inputs file (see the module docstring); BadInputError naming the file otherwise."""
    path = str(path)
    suffix = Path(path).suffix.lower()
    try:
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                data: Any = [torch.from_numpy(np.ascontiguousarray(z[name])) for name in z.files]
        elif suffix in (".pt", ".pth"):
            data = torch.load(path, map_location="cpu", weights_only=True)
        else:
            raise BadInputError(f"inputs: {path!r} must be a .pt, .pth or .npz file")
    except BadInputError:
        raise
    except Exception as e:
        raise BadInputError(f"inputs: cannot read {path!r} ({type(e).__name__}: {e})") from None
    if isinstance(data, dict):
        data = list(data.values())
    if isinstance(data, torch.Tensor):
        data = [data]
    if not isinstance(data, (list, tuple)) or not data or not all(isinstance(t, torch.Tensor) for t in data):
        raise BadInputError(f"inputs: {path!r} must hold a tuple of tensors (e.g. (inputs, labels))")
    rows = {int(t.shape[0]) if t.dim() else None for t in data}
    if len(rows) != 1 or None in rows or 0 in rows:
        raise BadInputError(
            f"inputs: the tensors in {path!r} need one number of rows ≥ 1, got shapes {[tuple(t.shape) for t in data]}"
        )
    return tuple(data)


def _task_name(store: RunStore) -> str:
    """The built-in task whose class the store records (image_classification when it records none)."""
    names = [name for name, cls in TASK_TO_MODELOUT.items() if cls.__name__ == store.meta.task]
    return names[0] if names else "image_classification"


def open_index(qc: QueryConfig | str | os.PathLike) -> TrakIndex:
    """The index a query asks for: from the attribute config, or the store plus model (see the module docstring).
    A path alone is a config file."""
    if not isinstance(qc, QueryConfig):
        return TrakIndex.from_config(AttributeConfig.from_yaml(qc))
    device = resolve_device(qc.device)
    if qc.is_config:
        config = AttributeConfig.from_yaml(qc.store)
        over: dict[str, Any] = {"device": device}
        if qc.checkpoints:
            over["checkpoints"] = qc.checkpoints
            over["model_ids"] = list(range(len(qc.checkpoints)))
        return TrakIndex.from_config(config, **over)
    if qc.model is None:
        raise BadInputError(
            f"model: querying the store {qc.store} needs the model's import path (--model pkg.mod:factory), "
            "or give the attribute config instead of the store"
        )
    store = open_store(qc.store, mode="r")
    ids = store.model_ids()
    checkpoints = qc.checkpoints
    if not checkpoints:
        recorded = [(store.checkpoint_record(mid) or {}).get("path") for mid in ids]
        if not all(recorded):
            raise BadInputError(
                f"checkpoints: the store {qc.store} does not record its checkpoint files; give them (--checkpoint)"
            )
        checkpoints = [str(p) for p in recorded]
    model = load_object(qc.model, "model", qc.import_roots)()
    if not isinstance(model, torch.nn.Module):
        raise BadInputError(f"model: {qc.model!r} returned a {type(model).__name__}, not a torch.nn.Module")
    task: Any = qc.task or _task_name(store)
    if task not in TASK_TO_MODELOUT:
        obj = load_object(task, "task", qc.import_roots)
        task = obj if not isinstance(obj, type) else obj()
    return TrakIndex(
        qc.store,
        model=model,
        checkpoints=checkpoints,
        task=task,
        model_ids=ids[: len(checkpoints)] if qc.checkpoints else ids,
        grad_wrt=qc.grad_wrt,
        device=device,
    )


def result_rows(
    top: QueryResult,
    low: QueryResult,
    input_labels: np.ndarray | None,
    train_labels: np.ndarray | None,
    train: tuple | None = None,
    show=None,
) -> list[dict]:
    """The report's rows (as :func:`tasks.report.top_k_table` gives for stored scores), one per input. With shares
    (an explained query) and ``train`` (input_ids, attention_mask, ...), each entry also gets ``tokens``
    (:func:`tasks.report.token_entries`, the tokens' text from ``show`` where it decodes one token)."""
    rows = []
    for j in range(top.indices.shape[0]):
        row: dict[str, Any] = {
            "target": j,
            "label": None if input_labels is None else int(input_labels[j]),
            "proponents": [_entry(i, s, train_labels) for i, s in zip(top.indices[j], top.scores[j], strict=True)],
            "opponents": [_entry(i, s, train_labels) for i, s in zip(low.indices[j], low.scores[j], strict=True)],
        }
        for key, res in (("proponents", top), ("opponents", low)):
            if res.shares is None or train is None:
                continue
            for r, e in enumerate(row[key]):
                i = e["index"]
                e["tokens"] = report.token_entries(res.shares[j, r], train[0][i].cpu(), train[1][i].cpu(), show)
        if train_labels is not None and input_labels is not None:
            row["label_agreement"] = float(np.mean(train_labels[top.indices[j]] == input_labels[j]))
        rows.append(row)
    return rows


def _entry(i, score, labels) -> dict:
    return {"index": int(i), "score": float(score), "label": None if labels is None else int(labels[i])}


def query_train_data(qc: QueryConfig, index: TrakIndex, config: AttributeConfig | None, roots) -> tuple | None:
    """The train rows a query shows and labels: ``train_data`` of the query, else of its config, else the source
    the store recorded when it was built (``train_source``: a folder is read as it is now, new rows included;
    its reader is an import path, under the same allow-list).
    Refused (BadInputError) when their number is not the store's: the rows would not be the store's."""
    source = index.store.pipeline_info().get("train_source") or {}
    path = qc.train_data or (config.train_data if config else None)
    if path is None and source.get("read") and source.get("train_dir"):  # e.g. a folder of train files
        path = source["train_dir"]
        train = tuple(load_object(source["read"], "train_data", roots)(path))
    else:
        path = path or source.get("train_data")
        if not path:
            return None
        train = load_data(path, "train_data", roots)
    if int(train[0].shape[0]) != index.n:
        raise BadInputError(
            f"train_data: {path} has {int(train[0].shape[0])} rows, but the store at {index.location} holds "
            f"{index.n}; give the train data the store was built from (or leave train_data out: the store records it)"
        )
    return train


def run_query(qc: QueryConfig, index: TrakIndex | None = None) -> dict:
    """Answer a query: proponents and opponents of every input (one pass over the store), as the report's rows,
    a markdown table, and with ``report_dir`` the table and one PNG per input written there. Returns
    ``{"store", "inputs", "k", "model_ids", "rows", "markdown", "files", "text", "pngs"}``."""
    batch = load_inputs(qc.inputs)
    config = AttributeConfig.from_yaml(qc.store) if qc.is_config else None
    if config is not None and not qc.train_data:
        adopt_train_source(config)
    index = index or open_index(qc)
    roots = qc.import_roots or (config.import_roots if config else None)
    train = query_train_data(qc, index, config, roots)
    if qc.explain and train is None:
        raise BadInputError(
            "explain: splitting the proponents' scores by token featurizes their train sequences again: give the "
            "train data (train_data / --train-data, or the attribute config that names it)"
        )
    top, low = index.query_both(batch, qc.k, explain=qc.explain, train_data=train)
    show_path = qc.show or (config.show if config else None)
    show = load_object(show_path, "show", roots) if show_path and train is not None else None
    train_labels = report.labels_of(train) if train else None
    rows = result_rows(top, low, report.labels_of(batch), train_labels, train if qc.explain else None, show)
    rendered = report.render_query(rows, batch, train, show, f"TRAK query: {qc.inputs} against {index.location}")
    files = report.write_query_report(rendered, qc.report_dir, Path(qc.inputs).stem) if qc.report_dir else []
    return {
        "store": index.location,
        "inputs": qc.inputs,
        "k": qc.k,
        "model_ids": list(index.model_ids),
        "rows": rows,
        "markdown": rendered["markdown"],
        "files": files,
        "text": rendered["text"],
        "pngs": rendered["pngs"],
    }


__all__ = ["QueryConfig", "load_inputs", "open_index", "result_rows", "run_query", "INPUT_SUFFIXES"]
