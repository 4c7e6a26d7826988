"""The attribution steps as plain functions over trak_core (no Prefect import; tasks/attribution.py wraps
them). Each step maps onto the store exactly as trak_core.TRAKer does, so the scores are equal:

* plan: metadata built like ``TRAKer.__init__`` (projector spec, task class name, shard_rows =
  shard_size, chunk_rows); arrays created once, here, before any fan-out; ``model_id`` = index of the
  checkpoint in the sorted list;
* featurize: one call per (model_id, shard), batches of ``batch_size`` from the shard's first row,
  whole shards written at once, then the shard's XᵀX partial from the rounded rows
  (``trak_core.reduce.shard_partial``);
* finalize: ``trak_core.reduce.finalize_model`` (partials summed in shard order, solve, features);
* targets: batches of ``batch_size`` from row 0; scores: ``trak_core.reduce.score_rows`` per shard.

Every step first reads the store and returns ``skipped=True`` when its output is already complete.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
import warnings
from typing import Optional

import numpy as np
import torch

from trak_core.config import AttributeConfig, file_fingerprint
from trak_core.errors import BadInputError, NonFiniteGradientError, StateError, StoreMismatchError
from trak_core.featurize import Featurizer
from trak_core.gradients import FunctionalGradientComputer, grad_dim_of
from trak_core.projectors import make_projector
from trak_core.reduce import (ensure_partial, finalize_model, load_targets, score_rows, shard_partial,
                              usable_models)
from trak_core.store import StoreMetadata, TrakStore

from . import progress
from .common import cached_data, load_checkpoint, manifest, open_store

PIPELINE_ATTR = "trakflow_pipeline"


# ---------------------------------------------------------------------------- helpers
_crash_lock = threading.Lock()
_crash_counts: dict[str, int] = {}
#: test hooks: SIGKILL this process right after its N-th featurized shard / scored block is complete
CRASH_ENV = {"featurize": "TRAKFLOW_TEST_KILL_AFTER_SHARDS", "score": "TRAKFLOW_TEST_KILL_AFTER_SCORE_BLOCKS"}


def _crash_point(stage: str) -> None:
    """Simulate a crash (SIGKILL, no cleanup) at a deterministic point, for the resume tests."""
    limit = os.environ.get(CRASH_ENV[stage])
    if not limit:
        return
    with _crash_lock:
        _crash_counts[stage] = _crash_counts.get(stage, 0) + 1
        if _crash_counts[stage] >= int(limit):
            os.kill(os.getpid(), signal.SIGKILL)


def _lambda_setting(value):
    """A lambda_reg setting in comparable form: a float, or a normalized 'auto' / 'rel:<f>' string."""
    if value is None:
        return None
    if isinstance(value, str):
        return value.strip().lower()
    return float(value)


def _prefixed(field: str, e: Exception) -> BadInputError:
    msg = str(e)
    return BadInputError(msg if msg.startswith(field) else f"{field}: {msg}")


def data_fingerprint(data: tuple) -> str:
    h = hashlib.sha256()
    for t in data:
        a = t.detach().cpu().contiguous().numpy()
        h.update(str((a.dtype, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def build_projector(config: AttributeConfig, grad_dim: int, device: str, model: torch.nn.Module):
    """The projector of the config (``factored`` takes its blocks from the model's layers)."""
    try:
        return make_projector(config.projector, grad_dim, config.proj_dim, config.proj_seed, config.proj_type,
                              device=device, model=model, grad_wrt=config.grad_wrt)
    except BadInputError as e:
        raise _prefixed("projector", e) from None


def build_metadata(config: AttributeConfig, train_set_size: int, model: torch.nn.Module, task) -> StoreMetadata:
    """The store metadata, built the way trak_core.TRAKer.__init__ builds it."""
    try:
        grad_dim = grad_dim_of(model, config.grad_wrt)
    except BadInputError as e:
        raise _prefixed("grad_wrt", e) from None
    spec = build_projector(config, grad_dim, "cpu", model).spec()
    return StoreMetadata.from_projector(spec, train_set_size=train_set_size, dtype=config.dtype,
                                        chunk_rows=config.effective_chunk_rows, shard_rows=config.shard_size,
                                        task=type(task).__name__)


def build_featurizer(config: AttributeConfig, checkpoint: str, grad_dim: Optional[int] = None) -> Featurizer:
    device = config.resolved_device()
    model = config.build_model().to(device)
    grad_dim = grad_dim or grad_dim_of(model, config.grad_wrt)
    feat = Featurizer(model, config.build_task(), build_projector(config, grad_dim, device, model),
                      FunctionalGradientComputer, config.grad_wrt, device)
    feat.load_state(load_checkpoint(checkpoint, device))
    return feat


def _check_batch(task, data: tuple, rows: int, field: str) -> None:
    try:
        task.validate_batch([t[:rows] for t in data])
    except BadInputError as e:
        raise _prefixed(field, e) from None


def _check_finite(data: tuple, field: str) -> None:
    """NaN/inf anywhere in the inputs is refused by the plan (before anything is written), naming rows."""
    for i, t in enumerate(data):
        if t.is_floating_point() or t.is_complex():
            bad = (~torch.isfinite(t.reshape(t.shape[0], -1)).all(dim=1)).nonzero().reshape(-1).tolist()
            if bad:
                more = f" (and {len(bad) - 20} more)" if len(bad) > 20 else ""
                raise BadInputError(f"{field}: NaN or inf in tensor {i} at example indices {bad[:20]}{more}; "
                                    "nothing was written")


# ---------------------------------------------------------------------------- plan
def make_plan(config: AttributeConfig) -> dict:
    """Check everything that can be checked without computing gradients, then create the store's arrays.

    Raises (BadInputError / StoreMismatchError, naming the field) before writing anything when the model,
    data, task, checkpoints or an existing store do not fit together.
    """
    checkpoints = config.checkpoint_paths
    model = config.build_model()
    task = config.build_task()
    train = cached_data(config.train_data, "train_data")
    targets = cached_data(config.target_data, "target_data")
    _check_batch(task, train, config.batch_size, "train_data")
    _check_batch(task, targets, config.batch_size, "target_data")
    _check_finite(train, "train_data")
    _check_finite(targets, "target_data")
    n, m = int(train[0].shape[0]), int(targets[0].shape[0])
    meta = build_metadata(config, n, model, task)
    if config.projector != "noop" and meta.proj_dim >= n and config.lambda_reg == 0:
        raise BadInputError(f"proj_dim: {meta.proj_dim} ≥ number of train examples n={n} makes XᵀX singular "
                            "(scores would be noise); use a proj_dim well below n, or lambda_reg > 0")
    records = []
    for i, path in enumerate(checkpoints):
        sd = load_checkpoint(path, "cpu", field=f"checkpoints[{i}]")
        try:
            model.load_state_dict(sd)
        except RuntimeError as e:
            raise BadInputError(f"checkpoints[{i}]: {path} does not fit the model {config.model!r}: {e}") from None
        bad = [k for k, v in sd.items() if torch.is_tensor(v) and v.is_floating_point() and not torch.isfinite(v).all()]
        if bad:
            raise BadInputError(f"checkpoints[{i}]: {path} has NaN or inf in {bad[:5]}; nothing was written")
        records.append({"path": path, "sha256": file_fingerprint(path)})
    train_sha, target_sha = data_fingerprint(train), data_fingerprint(targets)

    existing = TrakStore.exists(config.store, config.storage_options)
    if existing:  # refuse mismatches before writing anything
        store = TrakStore.open(config.store, config.storage_options)
        store.validate(meta)
        have = store.root.attrs.get(PIPELINE_ATTR, {}).get("train_data_sha256")
        if have is not None and have != train_sha:
            raise StoreMismatchError(f"train_data: the store at {config.store} was featurized with different "
                                     "train data (its fingerprint differs); use a new store")
        for mid, rec in enumerate(records):
            fin = store.finalize_info(mid) if store.has_model(mid) else None
            if fin is not None:
                for field, want, have in (
                        ("lambda_reg", _lambda_setting(config.lambda_reg),
                         _lambda_setting(fin.get("lambda_setting", fin.get("lambda_reg")))),
                        ("rescale_inverse", config.rescale_inverse, fin.get("rescale"))):
                    if have is not None and have != want:
                        raise StoreMismatchError(
                            f"{field}: model_id={mid} in {config.store} was finalized with {field}={have!r}, not "
                            f"{want!r}; use a new store (or the same {field})")
            if store.has_model(mid):
                old = store.model(mid).group.attrs.get("checkpoint")
                if old is not None and old.get("sha256") != rec["sha256"]:
                    raise StoreMismatchError(
                        f"checkpoints: model_id={mid} in {config.store} was featurized from {old.get('path')} "
                        f"but checkpoint {mid} in sorted order is now {rec['path']} (different content); "
                        "use a new store or the same checkpoints")
        if config.exp_name in store.experiments():
            e = store.experiment(config.exp_name)
            if int(e.attrs.get("num_targets", -1)) != m or e.attrs.get("target_data_sha256", target_sha) != target_sha:
                raise StoreMismatchError(f"exp_name: experiment {config.exp_name!r} in {config.store} was made "
                                         "with other targets; choose a new exp_name")
    store = TrakStore.create_or_open(config.store, meta, config.storage_options)
    if not existing:
        store.root.attrs[PIPELINE_ATTR] = {"train_data_sha256": train_sha}
    for mid, rec in enumerate(records):
        store.init_model(mid)
        g = store.model(mid).group
        if g.attrs.get("checkpoint") is None:
            g.attrs["checkpoint"] = rec
    e = store.init_experiment(config.exp_name, m)
    if e.attrs.get("target_data_sha256") is None:
        e.attrs["target_data_sha256"] = target_sha
    for mid in range(len(records)):
        store.init_experiment_model(config.exp_name, mid)
    store.init_scores(config.exp_name)
    return {"store": config.store, "exp_name": config.exp_name, "train_set_size": n, "num_targets": m,
            "grad_dim": meta.grad_dim, "proj_dim": meta.proj_dim, "shard_rows": meta.shard_rows,
            "chunk_rows": meta.chunk_rows, "num_shards": meta.num_shards,
            "models": [{"model_id": mid, "checkpoint": rec["path"]} for mid, rec in enumerate(records)]}


# ---------------------------------------------------------------------------- featurize
def featurize_shard(config: AttributeConfig, model_id: int, checkpoint: str, shard: int) -> dict:
    """Projected gradients X and weights Q of one shard of train rows, then its XᵀX partial."""
    t0 = time.perf_counter()
    store = open_store(config)
    a, b = store.meta.shard_range(shard)
    if store.shard_featurized(model_id, shard):
        if not store.partial_done(model_id, shard):
            ensure_partial(store, model_id, shard)
        progress.advance("featurize", b - a)
        return manifest("featurize", t0, True, model_id=model_id, shard=shard, rows=[a, b])
    if store.is_finalized(model_id):
        raise StateError(f"model_id={model_id} is finalized but rows {a}..{b - 1} are not featurized")
    feat = build_featurizer(config, checkpoint, store.meta.grad_dim)
    data = cached_data(config.train_data, "train_data")
    xs, qs = [], []
    for s in range(a, b, config.batch_size):
        e = min(s + config.batch_size, b)
        try:
            x, q = feat.featurize([t[s:e] for t in data], model_id, range(s, e))
        except NonFiniteGradientError:
            raise  # names the example indices already
        except BadInputError as err:  # e.g. a label out of range: say which rows
            raise BadInputError(f"train_data rows {s}..{e - 1} (model_id={model_id}): {err}") from None
        xs.append(x)
        qs.append(q)
        progress.advance("featurize", e - s)
    x, q = np.concatenate(xs), np.concatenate(qs)
    store.write_train_rows(model_id, slice(a, b), x, q)
    store.write_partial(model_id, shard, shard_partial(store, model_id, shard, rows=x))
    _crash_point("featurize")
    return manifest("featurize", t0, False, model_id=model_id, shard=shard, rows=[a, b])


# ---------------------------------------------------------------------------- finalize
def finalize_checkpoint(config: AttributeConfig, model_id: int) -> dict:
    """Σ shard partials (in shard order) → (XᵀX + λI)⁻¹ → features Φ of one checkpoint."""
    t0 = time.perf_counter()
    store = open_store(config)
    if store.is_finalized(model_id):
        progress.advance("finalize", 1)
        return manifest("finalize", t0, True, model_id=model_id, info=store.finalize_info(model_id))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = finalize_model(store, model_id, config.lambda_reg, config.rescale_inverse)
    for w in caught:  # re-issue (the record hides them) and keep the text in the manifest
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    progress.advance("finalize", 1)
    return manifest("finalize", t0, False, model_id=model_id, info=info,
                    warnings=[str(w.message) for w in caught])


# ---------------------------------------------------------------------------- targets and scores
def featurize_targets(config: AttributeConfig, model_id: int, checkpoint: str) -> dict:
    """Projected gradients G of all targets of the experiment for one checkpoint."""
    t0 = time.perf_counter()
    store = open_store(config)
    exp = config.exp_name
    if store.targets_complete(exp, model_id):
        progress.advance("targets", 1)
        return manifest("targets", t0, True, model_id=model_id, exp_name=exp)
    feat = build_featurizer(config, checkpoint, store.meta.grad_dim)
    data = cached_data(config.target_data, "target_data")
    m = store.num_targets(exp)
    gs = []
    for s in range(0, m, config.batch_size):
        e = min(s + config.batch_size, m)
        gs.append(feat.target_features([t[s:e] for t in data], model_id, range(s, e)))
    store.write_target_rows(exp, model_id, slice(0, m), np.concatenate(gs))
    progress.advance("targets", 1)
    return manifest("targets", t0, False, model_id=model_id, exp_name=exp)


def prepare_scores(config: AttributeConfig, model_ids: list[int]) -> dict:
    """Which checkpoints are combined, and score blocks (one per shard). Forgets rows scored with
    another combination of checkpoints. Call once, before fanning out score_block."""
    store = open_store(config)
    exp = config.exp_name
    used = usable_models(store, exp, model_ids)
    store.init_scores(exp)
    e = store.experiment(exp)
    if [int(x) for x in e.attrs.get("scored_with", [])] != used:
        e["scores_done"][:] = 0
        e.attrs["scored_with"] = used
    blocks = [list(store.meta.shard_range(s)) for s in range(store.meta.num_shards)]
    return {"model_ids": used, "blocks": blocks}


def score_block(config: AttributeConfig, model_ids: list[int], a: int, b: int) -> dict:
    """Combined scores of train rows [a, b) against all targets."""
    t0 = time.perf_counter()
    store = open_store(config)
    exp = config.exp_name
    e = store.experiment(exp)
    if bool(e["scores_done"][a:b].all()):
        progress.advance("score", b - a)
        return manifest("score", t0, True, rows=[a, b])
    score_rows(store, exp, model_ids, a, b, load_targets(store, exp, model_ids))
    _crash_point("score")
    progress.advance("score", b - a)
    return manifest("score", t0, False, rows=[a, b])
