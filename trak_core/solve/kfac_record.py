"""The record of a K-FAC store's factors (:mod:`trak_core.solve.kfac`): each checkpoint's A and S as arrays beside
the store's records and their record (layout, info and sha256) with them (``store.write_factor_arrays``), one
checkpoint's apart from another's, so that its tasks run at once; the fit
step that records them, or each shard's sums of them reduced at finalize; finalize's inverse from them, and the
eigenbasis a store's rows are projected in."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from trak_core.errors import StateError, StoreDamageError
from trak_core.solve.kfac import (
    FIT_BEFORE_FEATURIZE,
    FOLDED_CURVATURES,
    KFAC_CURVATURES,
    RECORDED_SIDES,
    FactorFold,
    FactorSums,
    KroneckerFactors,
    Site,
    bind_eigen,
    block_inverse,
    check_damping,
    default_damping,
    finish_factors,
    fit_factors,
)

#: the form of a recorded fit: per-layer A and S as arrays beside the records (``store.write_factor_arrays``), sealed
#: by the record's sha256; INLINE_FORM's carry them in the record itself (base64; still read); any other form was
#: written by an earlier version
RECORD_FORM, INLINE_FORM = "factors-v3", "factors-v2"
#: the key of the store's pipeline record under which earlier versions kept every model's record (still read)
RECORD_KEY = "curvature_factors"


def _decode(d: dict) -> np.ndarray:
    """A factor of an earlier record form (inline, base64)."""
    return np.frombuffer(base64.b64decode(d["data"]), dtype="<f8").reshape(d["shape"]).copy()


def _inline_digest(blocks: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(blocks):
        h.update(name.encode())
        for part in ("a", "s"):
            h.update(blocks[name][part]["data"].encode())
    return h.hexdigest()


def _digest(names: list[str], arrays: dict[str, np.ndarray]) -> str:
    """sha256 of the factor arrays in block order (their names, shapes and little-endian float64 bytes)."""
    h = hashlib.sha256()
    for i, name in enumerate(names):
        h.update(name.encode())
        for part in ("a", "s"):
            m = np.ascontiguousarray(arrays[f"{part}{i}"], dtype="<f8")
            h.update(str(m.shape).encode())
            h.update(m.tobytes())
    return h.hexdigest()


def _sealed(names: list[str], arrays: dict[str, np.ndarray], sha256) -> bool:
    """Whether ``arrays`` hold every block of ``names`` and match the digest ``sha256``."""
    present = all(f"{p}{i}" in arrays for i in range(len(names)) for p in "as")
    return present and _digest(names, arrays) == sha256


def to_record(pre: KroneckerFactors) -> tuple[dict, dict[str, np.ndarray]]:
    """(the record of ``pre``: its info, each block's layer and the digest, a small JSON record;
    the factor arrays it seals, ``a<i>`` / ``s<i>`` for the i-th block in name order)."""
    names = sorted(pre.blocks)
    arrays: dict[str, np.ndarray] = {}
    blocks = {}
    for i, n in enumerate(names):
        site, a, sm = pre.blocks[n]
        arrays[f"a{i}"], arrays[f"s{i}"] = np.asarray(a, dtype=np.float64), np.asarray(sm, dtype=np.float64)
        blocks[n] = {"weight": site.weight, "bias": site.bias, "d_out": site.d_out, "d_in": site.d_in} | (
            {"transposed": True} if site.transposed else {}
        )
    return {**pre.info, "form": RECORD_FORM, "blocks": blocks, "sha256": _digest(names, arrays)}, arrays


def from_record(rec: dict, arrays: dict[str, np.ndarray] | None = None, where: str = "") -> KroneckerFactors:
    """The factors of a record and its arrays (a record of the earlier inline form carries them itself)."""
    form, blocks = rec.get("form"), rec.get("blocks", {})
    if form not in (RECORD_FORM, INLINE_FORM):
        raise StateError(
            f"curvature factors{where} were recorded by an earlier trakflow (preconditioning before the projection); "
            "fit them again in a new store"
        )
    names = sorted(blocks)
    if form == INLINE_FORM:
        ok = _inline_digest(blocks) == rec.get("sha256")
        arrays = {f"{p}{i}": _decode(blocks[n][p]) for i, n in enumerate(names) for p in "as"} if ok else {}
    else:
        arrays = arrays or {}
        ok = _sealed(names, arrays, rec.get("sha256"))
    if not ok:
        raise StoreDamageError(f"curvature factors{where}: their arrays do not match the record's sha256 (damaged)")
    out = {}
    for i, n in enumerate(names):
        b = blocks[n]
        site = Site(n, b["weight"], b["bias"], int(b["d_out"]), int(b["d_in"]), bool(b.get("transposed", False)))
        out[n] = (site, arrays[f"a{i}"], arrays[f"s{i}"])
    info = {k: v for k, v in rec.items() if k not in ("blocks", "sha256", "form")}
    return KroneckerFactors(out, info)


def factor_record(store, model_id: int) -> dict | None:
    """``model_id``'s factor record: the one written with its arrays, or (a store of an earlier version) the one in
    the pipeline record; None when it has none."""
    rec = store.read_factor_record(model_id)
    if rec is None:
        rec = store.pipeline_info().get(RECORD_KEY, {}).get(str(int(model_id)))
    return rec


def has_factors(store, model_id: int) -> bool:
    return factor_record(store, model_id) is not None


def _checkpoint_of(store, model_id: int) -> str | None:
    """The state digest of ``model_id``'s recorded checkpoint (None: none recorded)."""
    rec = store.checkpoint_record(model_id) if store.has_model(model_id) else None
    return None if rec is None else rec.get("state_sha256")


def record_factors(store, model_id: int, pre: KroneckerFactors, replace: bool = False) -> None:
    """Record ``pre`` as ``model_id``'s factors (its arrays and their record: layout, digest, the digest of the
    checkpoint the store records for it) in the model's own group; a model that has factors keeps them (StateError
    when they differ: a store never mixes two fits) unless ``replace`` (a model started over, no row featurized with
    the old ones). A crash part way leaves no record (the fit runs again), never a record of other arrays."""
    pre.info["checkpoint"] = _checkpoint_of(store, model_id)
    rec, arrays = to_record(pre)
    old = factor_record(store, model_id)
    if old is not None and not replace:
        if old.get("sha256") != rec["sha256"]:
            raise StateError(
                f"model_id={model_id}: {store.location} holds curvature factors fitted before; a store keeps the "
                "factors it recorded (use a new store to fit them again)"
            )
        return
    legacy = store.pipeline_info()
    if str(int(model_id)) in legacy.get(RECORD_KEY, {}):  # an earlier version's record goes first
        legacy[RECORD_KEY] = {k: v for k, v in legacy[RECORD_KEY].items() if k != str(int(model_id))}
        store.set_pipeline_info(legacy)
    store.write_factor_arrays(model_id, arrays, rec)


def load_factors(store, model_id: int) -> KroneckerFactors:
    """``model_id``'s recorded factors, or StateError saying to fit them first."""
    rec = factor_record(store, model_id)
    if rec is None:
        raise StateError(
            f"model_id={model_id}: the store at {store.location} has curvature={store.meta.curvature!r} but no fitted "
            "factors for this checkpoint; fit them before finalizing (TRAKer.fit_curvature, or the pipeline's "
            "fit step)"
        )
    arrays = store.read_factor_arrays(model_id) if rec.get("form") == RECORD_FORM else None
    return from_record(rec, arrays, f" of model_id={model_id}")


def current_factors(store, model_id: int) -> KroneckerFactors | None:
    """``model_id``'s recorded factors when they were fitted at the checkpoint the store records for it, else None."""
    if not has_factors(store, model_id):
        return None
    pre = load_factors(store, model_id)
    return pre if pre.info.get("checkpoint") == _checkpoint_of(store, model_id) else None


def wants_factors(store, model_id: int) -> bool:
    """Whether the store's curvature is Kronecker-factored and ``model_id`` has no factors recorded yet (the fit
    step has work to do)."""
    return store.meta.curvature in KFAC_CURVATURES and not has_factors(store, model_id)


def fit_step(store, model_id: int, feat, batches, damping=None, grad_wrt=None) -> KroneckerFactors | None:
    """Fit and record ``model_id``'s factors in a store of K-FAC curvature (None for another curvature); a model
    with factors recorded at its checkpoint keeps them (read back). The rows of ``"kfac"`` / ``"ekfac"`` do not depend
    on the factors, so they may be featurized before (``"kfac-eigen"``'s do: rows featurized without factors are
    refused); factors recorded at another checkpoint (the model was started over) are fitted again, unless
    rows are featurized already (they are then of another checkpoint than the factors: refused)."""
    if store.meta.curvature not in KFAC_CURVATURES:
        return None
    stale = False
    featurized = store.has_model(model_id) and bool(store.featurized_mask(model_id).any())
    if store.meta.curvature in FIT_BEFORE_FEATURIZE and featurized and not has_factors(store, model_id):
        raise StateError(
            f"model_id={model_id}: {store.location} holds rows featurized without curvature factors, but "
            f"curvature={store.meta.curvature!r} projects with them; use a new store"
        )
    if has_factors(store, model_id):
        pre = load_factors(store, model_id)
        if pre.info.get("checkpoint") == _checkpoint_of(store, model_id):
            return pre
        stale = True
        if featurized:
            raise StateError(
                f"model_id={model_id}: {store.location} holds featurized rows and factors fitted at another "
                "checkpoint; use a new store"
            )
    pre = fit_factors(feat, batches, store.meta.curvature, damping, grad_wrt)
    record_factors(store, model_id, pre, replace=stale)
    return pre


def bind_recorded(projector, store) -> None:
    """:func:`bind_eigen` with the factors ``store`` records at each model's checkpoint (the pipeline's tasks and the
    query index); a model without them is refused (StateError naming the fit) when its rows are projected."""

    def factors_of(model_id: int) -> KroneckerFactors:
        pre = current_factors(store, model_id)
        if pre is None:
            raise StateError(
                f"model_id={model_id}: the store at {store.location} has curvature={store.meta.curvature!r} but no "
                "curvature factors fitted at its checkpoint; its rows are projected with them, so they are fitted "
                "first (TRAKer.fit_curvature, or the pipeline's fit step)"
            )
        return pre

    bind_eigen(projector, factors_of, RECORDED_SIDES)


def finalize_inverse(store, model_id: int, xtx: np.ndarray, rule, rescale: bool) -> tuple[np.ndarray, dict]:
    """Finalize of a K-FAC store's model: :func:`block_inverse` of its recorded factors and XᵀX (float32);
    ``lambda_reg`` and ``rescale_inverse`` are recorded, not applied."""
    meta = store.meta
    inv, per = block_inverse(meta, model_id, load_factors(store, model_id), np.asarray(xtx, dtype=np.float64))
    info = {
        "curvature": meta.curvature,
        "lambda_reg": 0.0,
        "lambda_setting": rule.setting,
        "rescale": bool(rescale),
        "blocks": per,
    }
    return inv.astype(np.float32), info


# ---------------------------------------------------------------------------------------------- sums per shard
def folds(store, model_id: int) -> bool:
    """Whether featurizing ``model_id``'s shards sums its factors (:class:`~trak_core.solve.kfac.FactorFold`): a
    ``"kfac"`` / ``"ekfac"`` store whose model has no factors fitted at its checkpoint."""
    return store.meta.curvature in FOLDED_CURVATURES and current_factors(store, model_id) is None


def fit_first(curvature: str, rows: int | None) -> bool:
    """Whether a run fits each checkpoint's factors in a pass of their own before its rows: ``"kfac-eigen"`` (its
    rows need them), or a declared sample of ``rows``; else ``"kfac"`` / ``"ekfac"`` sum them as shards are
    featurized, reduced at finalize (:func:`record_folded`)."""
    return curvature in FIT_BEFORE_FEATURIZE or (curvature in KFAC_CURVATURES and rows is not None)


def _site_record(site: Site) -> dict:
    return {"name": site.name, "weight": site.weight, "bias": site.bias, "d_out": site.d_out, "d_in": site.d_in,
            "transposed": site.transposed}  # fmt: skip


def write_shard_sums(store, model_id: int, shard: int, fold: FactorFold, damping: float | None) -> None:
    """Write a shard's factor sums (``fold``: its rows') with their layout, the damping, the checkpoint and a sha256
    over them."""
    sites, others = fold.layout()
    names = sorted(fold.total.a)
    arrays = {f"{p}{i}": (fold.total.a if p == "a" else fold.total.s)[n] for i, n in enumerate(names) for p in "as"}
    info = {
        "names": names,
        "tokens": {n: int(fold.total.tokens[n]) for n in names},
        "examples": int(fold.total.examples),
        "skipped": sorted(fold.skipped),
        "sites": [_site_record(s) for s in sites],
        "others": list(others),
        "damping": check_damping(default_damping(store.meta.curvature) if damping is None else damping),
        "checkpoint": _checkpoint_of(store, model_id),
        "sha256": _digest(names, arrays),
    }
    store.write_factor_partial(model_id, shard, arrays, info)


def record_folded(store, model_id: int) -> KroneckerFactors | None:
    """At finalize, a ``"kfac"`` / ``"ekfac"`` model without factors: its shards' sums added in shard order, the
    factors of all its rows (:func:`~trak_core.solve.kfac.fit_factors`' over the same rows, to float64 rounding)
    recorded. StateError naming the shards featurized without their sums (at another checkpoint, or by a version
    that fitted first), before anything is written; None where nothing is to do (or rows are missing: finalize
    names them)."""
    if not folds(store, model_id) or not store.featurized_mask(model_id).all():
        return None
    total, skipped, layout, missing = FactorSums(), set[str](), None, []
    checkpoint = _checkpoint_of(store, model_id)
    for shard in range(store.meta.num_shards):
        got = store.read_factor_partial(model_id, shard)
        if got is None or got[1].get("checkpoint") != checkpoint:
            missing.append(shard)
            continue
        arrays, info = got
        if not _sealed(info["names"], arrays, info.get("sha256")):
            raise StoreDamageError(
                f"model_id={model_id}: the curvature factor sums of shard {shard} in {store.location} do not match "
                "their sha256 (damaged); featurize that shard again into a new store, or fit the factors"
            )
        here = (info["sites"], info["others"], info["damping"])
        if layout is not None and here != layout:
            raise StateError(f"model_id={model_id}: the factor sums of shard {shard} were made with other layers")
        layout = here
        names = info["names"]
        total.add(
            FactorSums(
                a={n: arrays[f"a{i}"] for i, n in enumerate(names)},
                s={n: arrays[f"s{i}"] for i, n in enumerate(names)},
                tokens={n: int(info["tokens"][n]) for n in names},
                examples=int(info["examples"]),
            )
        )
        skipped.update(info["skipped"])
    if missing or layout is None:
        raise StateError(
            f"model_id={model_id}: shards {missing[:10]}{' and more' if len(missing) > 10 else ''} of "
            f"{store.location} were featurized without their sums of the curvature factors; fit the factors in a "
            "pass of their own (curvature_rows, or TRAKer.fit_curvature), or featurize into a new store"
        )
    sites = [Site(**d) for d in layout[0]]
    pre = finish_factors(total, sites, layout[1], skipped, store.meta.curvature, layout[2], warn=True)
    record_factors(store, model_id, pre, replace=has_factors(store, model_id))
    return pre


def curvature_batches(train: Sequence[torch.Tensor], rows: int | None, batch_size: int):
    """The factor fit's batches over ``train``: every row, or ``rows`` of them evenly spaced (a declared sample), in
    order, ``batch_size`` at a time; a function returning a fresh iterator (the fit's ``batches``)."""
    n = int(train[0].shape[0])
    pick = torch.arange(n)
    if rows is not None and rows < n:
        pick = torch.linspace(0, n - 1, rows).round().long().unique()
    return lambda: ([t[pick[a : a + batch_size]] for t in train] for a in range(0, len(pick), batch_size))
