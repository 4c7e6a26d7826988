"""Streaming reductions over a store: per-shard XᵀX partials, the inverse, and combined scores.

Scores are X (A Gᵀ): per checkpoint, finalize solves A = (XᵀX + λI)⁻¹ (p × p, nothing per row), the targets
are multiplied by it once (G A, :func:`solve_targets`) and the stored gradients X are streamed against it
(:func:`trak_core.scoring.streaming.stream_scores`). The features Φ = X A of traker are
never stored; :func:`features_rows` computes them for the rows a caller asks for.

Memory is O(block × (p + m) + p²) whatever the number of train rows n.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch

from trak_core.errors import BadInputError, StateError
from trak_core.scoring.combine import features_block
from trak_core.scoring.streaming import grads_right_hand, page_array, stream_scores
from trak_core.solve.damping import LambdaRule, loss_curvature, parse_lambda_reg, solve
from trak_core.solve.kfac import KFAC_CURVATURES
from trak_core.solve.kfac_record import finalize_inverse as kfac_finalize
from trak_core.solve.lambda_rules import unfit_share_of_task
from trak_core.store import RunStore, experiment_array, model_array, pack_upper, target_array, unpack_upper

#: bytes of one float64 block of rows in :func:`shard_partial` on a GPU (4,096 rows at proj_dim 2048)
DEVICE_BLOCK_BYTES = 64 << 20


def shard_partial(
    store: RunStore, model_id: int, shard: int, rows: np.ndarray | None = None, device=None, weights=None
) -> np.ndarray:
    """Xₛᵀ Xₛ (float64) of one shard, from the stored (rounded) gradients or the given rows; with ``weights``
    (rᵢ ≥ 0 per row, float64) Xₛᵀ Rₛ Xₛ, the rows scaled by √rᵢ in float64 first.

    On a non-CPU ``device`` (TRAKer's or the featurize task's GPU) the float64 product runs there, in blocks of
    rows: the same float64 sum in another order (measured on an H100: 0.15 µs per row at proj_dim 2048 against
    11.6 µs for the float64 syrk on that machine's 16 host cores); the upper triangle is mirrored so that the result
    is exactly symmetric, as the host's syrk."""
    if rows is None:
        a, b = store.meta.shard_range(shard)
        rows = store.read_rows(model_array(model_id, "grads"), slice(a, b))
    return _grams(np.asarray(rows).astype(store.meta.np_dtype, copy=False), device, weights, both=False)[0]


def shard_grams(
    store: RunStore,
    model_id: int,
    shard: int,
    rows: np.ndarray | None,
    q,
    device=None,
    packed: bool = False,
    buffers: GramBuffers | None = None,
    sums: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """(Xₛᵀ Xₛ, Xₛᵀ Rₛ Xₛ or None) of one shard: the Gram partials its store keeps, :func:`shard_partial`'s bits.
    XᵀRX (rᵢ = :func:`~trak_core.solve.damping.loss_curvature` of the shard's ``q``) only in a store of
    ``curvature="ggn"``; on the host both come from one float64 copy of the rows.

    Args:
        packed: return them packed (:func:`~trak_core.store.pack_upper`, as stored); on a device they are packed
            there and only the triangle comes back to the host.
        buffers: with ``packed``, the host buffers to return them in (reused shard after shard; else new arrays).
        sums: with ``packed`` on a device, a (p + 3,) float64 host array that gets the shard's row sums
            (:func:`row_sums_vec`'s quantities) summed in float64 there, from the same copy of the rows; left as it
            is on the host.
    """
    both = store.meta.curvature == "ggn"
    weights = loss_curvature(q) if both else None
    if rows is None:
        a, b = store.meta.shard_range(shard)
        rows = store.read_rows(model_array(model_id, "grads"), slice(a, b))
    x = np.asarray(rows).astype(store.meta.np_dtype, copy=False)
    if not packed:
        return _grams(x, device, weights, both)
    size = x.shape[1] * (x.shape[1] + 1) // 2
    if device is not None and torch.device(device).type != "cpu":
        dev = torch.device(device)
        scale = None if weights is None else _sqrt_weights(weights)
        grams = [_device_upper(x, dev, q=q, sums=sums)]
        grams += [_device_upper(x, dev, scale)] if both else []
        host = [_host_copy(g, None if buffers is None else buffers.take(i, size, dev)) for i, g in enumerate(grams)]
        return host[0], (host[1] if both else None)
    full = [g for g in _grams(x, None, weights, both) if g is not None]
    out = [pack_upper(g, None if buffers is None else buffers.take(i, size, "cpu")) for i, g in enumerate(full)]
    return out[0], (out[1] if both else None)


def _sqrt_weights(weights) -> np.ndarray:
    return np.sqrt(np.asarray(weights, dtype=np.float64)).reshape(-1, 1)


def _grams(x: np.ndarray, device, weights, both: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """(XᵀX, XᵀRX) of rows ``x`` (in the store's dtype) when ``both``, else (XᵀX or XᵀRX by ``weights``, None):
    see :func:`shard_partial`."""
    scale = None if weights is None else _sqrt_weights(weights)
    if device is not None and torch.device(device).type != "cpu":
        dev = torch.device(device)
        if both:
            return _device_gram(x, dev), _device_gram(x, dev, scale)
        return _device_gram(x, dev, scale), None
    x = x.astype(np.float64)
    # numpy turns ``x.T @ x`` into one BLAS syrk (half the flops of a GEMM; the result is exactly symmetric):
    # float64 XᵀX at the cost of a float32 GEMM
    if scale is None:
        return x.T @ x, None
    plain = x.T @ x if both else None
    x *= scale  # the rows times √w: (√w X)ᵀ(√w X) = XᵀWX, again one syrk
    if plain is None:
        return x.T @ x, None
    return plain, x.T @ x


def _device_product(
    x: np.ndarray,
    device: torch.device,
    scale: np.ndarray | None = None,
    q: np.ndarray | None = None,
    sums: np.ndarray | None = None,
) -> torch.Tensor:
    """xᵀx in float64 on ``device``, block by block of rows (each row times ``scale`` (n, 1) first, if given); its
    upper triangle is the result (the strict lower one the same sums in another order). With ``q`` (the rows'
    out-to-loss weights), ``sums`` (a (p + 3,) float64 host array) gets the rows' [Xᵀq, qᵀq, Σ‖xᵢ‖⁴, Σqᵢ²‖xᵢ‖²]
    (before ``scale``) summed in float64 on the device, block by block in the same order."""
    n, p = x.shape
    step = max(1, DEVICE_BLOCK_BYTES // (8 * max(p, 1)))
    acc = torch.zeros(p, p, dtype=torch.float64, device=device)
    want = q is not None and sums is not None
    if want:
        qd = torch.from_numpy(np.asarray(q, dtype=np.float32).reshape(-1).astype(np.float64)).to(device)
        xtq = torch.zeros(p, dtype=torch.float64, device=device)
        sq = torch.empty(n, dtype=torch.float64, device=device)
    for a in range(0, n, step):
        t = torch.from_numpy(np.ascontiguousarray(x[a : a + step])).to(device).double()
        if want:
            sq[a : a + step] = (t * t).sum(1)
            xtq.addmv_(t.T, qd[a : a + step])
        if scale is not None:
            t *= torch.from_numpy(scale[a : a + step]).to(device)
        acc.addmm_(t.T, t)
    if want:
        tail = torch.stack([qd @ qd, sq @ sq, (qd * qd) @ sq])
        torch.from_numpy(sums).copy_(torch.cat([xtq, tail]))
    return acc


def _device_gram(x: np.ndarray, device: torch.device, scale: np.ndarray | None = None) -> np.ndarray:
    """xᵀx in float64 on ``device`` (:func:`_device_product`), mirrored from its upper triangle, on the host."""
    acc = _device_product(x, device, scale)
    upper = torch.triu(acc)
    return (upper + torch.triu(acc, 1).T).cpu().numpy()


def _device_upper(
    x: np.ndarray,
    device: torch.device,
    scale: np.ndarray | None = None,
    q: np.ndarray | None = None,
    sums: np.ndarray | None = None,
) -> torch.Tensor:
    """:func:`_device_product`'s upper triangle packed row by row on ``device`` (:func:`pack_upper`'s layout; the
    bits :func:`_device_gram` mirrors: each entry plus +0.0, so a −0.0 is stored as +0.0 there too)."""
    acc = _device_product(x, device, scale, q, sums)
    p = acc.shape[0]
    keep = torch.ones(p, p, dtype=torch.bool, device=acc.device).triu_()
    return acc[keep] + 0.0


def _host_copy(t: torch.Tensor, out: np.ndarray | None) -> np.ndarray:
    """``t`` (1-d float64 on a device) on the host: copied into ``out`` when given, else a new array."""
    if out is None:
        return t.cpu().numpy()
    torch.from_numpy(out).copy_(t)
    return out


class GramBuffers:
    """Host buffers for a shard's packed Gram partials, reused shard after shard (page-locked when the Grams come
    from a CUDA device: the copy from it runs at full speed). A buffer is only read until the next shard's
    partials are computed into it (the partial is written to the store in between)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple, np.ndarray] = {}

    def take(self, i: int, size: int, device) -> np.ndarray:
        """The ``i``-th buffer of ``size`` float64 values for Grams from ``device``."""
        pinned = torch.device(device).type == "cuda"
        key = (i, size, pinned)
        buf = self._bufs.get(key)
        if buf is None:
            self._bufs = {k: v for k, v in self._bufs.items() if k[1:] == key[1:]}  # another size: the old ones go
            buf = self._bufs[key] = host_empty((size,), np.float64, device)
        return buf


def host_empty(shape: tuple, dtype, device) -> np.ndarray:
    """A new host array for data going to or coming from ``device``: page-locked when it is a CUDA device (copies
    run at full speed), pageable where that is refused (a locked-memory limit) or on any other device."""
    t = torch.from_numpy(np.empty(0, dtype=dtype))
    if torch.device(device).type == "cuda":
        try:
            return torch.empty(shape, dtype=t.dtype, pin_memory=True).numpy()
        except RuntimeError:  # refused: pageable, a slower copy
            pass
    return np.empty(shape, dtype=dtype)


class RowSums(NamedTuple):
    """The sums over train rows that damping rules need beside XᵀX (x_i a row of X, q the out-to-loss weights Q):
    Xᵀq and qᵀq ('resid', 'cresid'), Σ‖xᵢ‖⁴ ('neff'), Σqᵢ²‖xᵢ‖² ('cresid'); float64."""

    xtq: np.ndarray
    qtq: float
    row_norm4: float
    q2x2: float

    @classmethod
    def of(cls, vec: np.ndarray) -> RowSums:
        """From the (p + 3,) vector :func:`shard_row_sums` returns (or a sum of such vectors)."""
        return cls(vec[:-3].copy(), float(vec[-3]), float(vec[-2]), float(vec[-1]))

    @classmethod
    def of_rows(cls, x: np.ndarray, q: np.ndarray, dtype=np.float32) -> RowSums:
        """The sums of rows ``x`` (rounded to ``dtype`` first) and their ``q``, in one block."""
        return cls.of(row_sums_vec(x, q, dtype))


#: rows per float64 block of :func:`row_sums_vec` (2 MiB at proj_dim 1024: stays in cache)
ROW_SUMS_BLOCK = 256


def _widen(x: np.ndarray, out: np.ndarray | None = None, scratch: np.ndarray | None = None) -> np.ndarray:
    """``x`` as float64 (exact for float16/float32 input), into ``out`` when given; float16 through torch's float32
    conversion (into ``scratch``, float32 of ``x``'s shape, when given), 4× faster than numpy's float16 → float64
    and the same values."""
    if x.dtype == np.float16:
        src = torch.from_numpy(np.ascontiguousarray(x))
        x = src.float().numpy() if scratch is None else torch.from_numpy(scratch).copy_(src).numpy()
    if out is None:
        return x.astype(np.float64)
    np.copyto(out, x)
    return out


def row_sums_vec(x: np.ndarray, q: np.ndarray, dtype) -> np.ndarray:
    """[Xᵀq, qᵀq, Σ‖xᵢ‖⁴, Σqᵢ²‖xᵢ‖²] ((p + 3,) float64) of rows ``x`` (rounded to the store ``dtype`` first, as
    stored) and their ``q``. The rows are widened to float64 a block of :data:`ROW_SUMS_BLOCK` at a time into one
    reused buffer (not the whole shard at once: 1.7× faster at 8,192 × 2,048 and 4 MiB instead of 128 MiB of
    scratch); Xᵀq is summed block by block in order. (On a device the shard's partial sums them there:
    :func:`shard_grams`' ``sums``.)"""
    from threadpoolctl import threadpool_limits

    x = np.asarray(x).astype(dtype, copy=False)
    qd = np.asarray(q, dtype=np.float32).astype(np.float64).reshape(-1)
    n, p = x.shape
    rn = np.empty(n, dtype=np.float64)  # ‖xᵢ‖²
    out = np.zeros(p + 3, dtype=np.float64)
    wide = np.empty((min(n, ROW_SUMS_BLOCK), p), dtype=np.float64)
    half = np.empty(wide.shape, dtype=np.float32) if x.dtype == np.float16 else None
    # one BLAS thread: the small gemv below spins a second thread for little work (5× slower on a busy machine)
    with threadpool_limits(limits=1, user_api="blas"):
        for a in range(0, n, ROW_SUMS_BLOCK):
            k = min(ROW_SUMS_BLOCK, n - a)
            xb = _widen(x[a : a + k], wide[:k], None if half is None else half[:k])
            np.einsum("ij,ij->i", xb, xb, out=rn[a : a + k])
            out[:-3] += qd[a : a + k] @ xb
    out[-3] = qd @ qd
    out[-2] = rn @ rn
    out[-1] = (qd * qd) @ rn
    return out


def shard_row_sums(store: RunStore, model_id: int, shard: int, rows=None, q=None) -> np.ndarray:
    """:class:`RowSums` of one shard as a (p + 3,) float64 vector, from the stored (rounded) gradients and Q or
    the given ones (:func:`rows_row_sums`' arithmetic shard by shard); stored beside the shard's XᵀX partial."""
    a, b = store.meta.shard_range(shard)
    if rows is None:
        rows = store.read_rows(model_array(model_id, "grads"), slice(a, b))
    if q is None:
        q = store.read_rows(model_array(model_id, "out_to_loss"), slice(a, b))
    return row_sums_vec(rows, q, store.meta.np_dtype)


def ensure_partial(
    store: RunStore,
    model_id: int,
    shard: int,
    device=None,
    rows: np.ndarray | None = None,
    q=None,
    buffers: GramBuffers | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Store the shard's XᵀX partial and row sums unless they are there; from ``rows``/``q`` (the shard's rows as
    written, still in the caller's memory) or read back from the store. ``buffers``: the caller's reused host
    buffers for the packed partials (:class:`GramBuffers`). Returns (the partial as stored, its row sums) when it
    stored them, else None."""
    if not store.partial_done(model_id, shard):
        if not store.shard_featurized(model_id, shard):
            a, b = store.meta.shard_range(shard)
            raise StateError(f"model_id={model_id}: rows {a}..{b - 1} of shard {shard} are not all featurized")
        a, b = store.meta.shard_range(shard)
        if rows is None:
            rows = store.read_rows(model_array(model_id, "grads"), slice(a, b))
        if q is None:
            q = store.read_rows(model_array(model_id, "out_to_loss"), slice(a, b))
        part, sums, ggn = shard_partials(store, model_id, shard, rows, q, device, buffers)
        store.write_partial(model_id, shard, part, sums, ggn)
        return part, sums
    return None


def shard_partials(
    store: RunStore, model_id: int, shard: int, rows, q, device=None, buffers: GramBuffers | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(Xₛᵀ Xₛ packed, the row sums, Xₛᵀ Rₛ Xₛ packed or None) of a shard from its rows as stored and its Q: what
    :meth:`~trak_core.store.RowAccess.write_partial` stores. On a device the row sums are summed there with the
    Gram, from the rows it has anyway; on the host, here."""
    on_device = device is not None and torch.device(device).type != "cpu"
    dev_sums = np.empty(store.meta.proj_dim + 3, dtype=np.float64) if on_device else None
    part, ggn = shard_grams(store, model_id, shard, rows, q, device, packed=True, buffers=buffers, sums=dev_sums)
    sums = shard_row_sums(store, model_id, shard, rows, q) if dev_sums is None else dev_sums
    return part, sums, ggn


class PartialSums:
    """The running sum of one model's XᵀX partials and row sums as they are stored, shard 0, 1, … in order (the
    additions :func:`finalize_model` makes reading them back, so the same bits): a featurizing process that
    stored every shard's partial hands it to finalize, which then reads none of them. A shard out of order, or
    another model's, ends the sum (finalize reads the partials as before)."""

    def __init__(self) -> None:
        self.model_id: int | None = None
        self.shards = 0
        self.total: np.ndarray | None = None
        self.sums: np.ndarray | None = None

    def add(self, model_id: int, shard: int, part: np.ndarray, sums: np.ndarray) -> None:
        """Add shard ``shard``'s stored partial (packed as stored) and row sums ((p + 3,) float64)."""
        if shard == 0:
            self.model_id, self.shards = model_id, 1
            self.total, self.sums = part.copy(), np.zeros_like(sums) + sums
        elif self.model_id == model_id and shard == self.shards and self.total is not None and self.sums is not None:
            self.total += part
            self.sums += sums
            self.shards += 1
        else:
            self.end()

    def end(self) -> None:
        """Drop the sum (a shard's partial was stored by someone else: finalize reads them all)."""
        self.model_id, self.shards, self.total, self.sums = None, 0, None, None

    def covers(self, store: RunStore, model_id: int) -> bool:
        """Whether it is the sum of all of ``model_id``'s shards (a store without Gauss-Newton partials)."""
        return self.model_id == model_id and self.shards == store.meta.num_shards and store.meta.curvature != "ggn"


def _sum_shard_grams(store: RunStore, path: str) -> np.ndarray:
    """The sum of one Gram partial array's shards (at ``path``) in shard order (the one canonical order; packed
    partials are summed packed, entry by entry the same additions), unpacked."""
    meta = store.meta
    total = np.zeros(meta.partial_shape, dtype=np.float64)
    for s in range(meta.num_shards):
        total += store.read_rows(path, slice(s, s + 1))[0]
    return unpack_upper(total, meta.proj_dim) if meta.packed_partials else total


def total_xtx(store: RunStore, model_id: int) -> np.ndarray:
    """XᵀX as the sum of the shard partials in shard order."""
    return _sum_shard_grams(store, model_array(model_id, "xtx_partials"))


def total_ggn(store: RunStore, model_id: int) -> np.ndarray:
    """XᵀRX as the sum of the shards' ``ggn_partials`` in shard order (a store of ``curvature="ggn"``)."""
    return _sum_shard_grams(store, model_array(model_id, "ggn_partials"))


def total_row_sums(store: RunStore, model_id: int) -> RowSums:
    """:class:`RowSums` as the sum of the shards' partials in shard order: the bits of :func:`rows_row_sums`."""
    path = model_array(model_id, "rowsum_partials")
    total = np.zeros(store.meta.proj_dim + 3, dtype=np.float64)
    for s in range(store.meta.num_shards):
        total += store.read_rows(path, slice(s, s + 1))[0]
    return RowSums.of(total)


def require_featurized(store: RunStore, model_id: int) -> None:
    mask = store.featurized_mask(model_id)
    if not mask.all():
        missing = np.flatnonzero(~mask)
        raise StateError(
            f"model_id={model_id} is not fully featurized: {missing.size} of {mask.size} rows "
            f"missing (first: {missing[:10].tolist()}); featurize them before finalizing"
        )


def rows_row_sums(store: RunStore, model_id: int, block_rows: int | None = None) -> RowSums:
    """:class:`RowSums` by a pass over the stored train rows in blocks (of a shard by default); the reference that
    the per-shard partials (:func:`total_row_sums`) reproduce bit for bit."""
    step = block_rows or store.meta.rows_per_shard
    total = np.zeros(store.meta.proj_dim + 3, dtype=np.float64)
    for a in range(0, store.meta.train_set_size, step):
        b = min(a + step, store.meta.train_set_size)
        x, q = store.read_train_rows(model_id, a, b)
        total += row_sums_vec(x, q, store.meta.np_dtype)
    return RowSums.of(total)


def solve_model(
    store: RunStore,
    model_id: int,
    lambda_reg=0.0,
    rescale: bool = True,
    xtx=None,
    sums: RowSums | None = None,
    ggn=None,
) -> tuple[np.ndarray, dict]:
    """(inverse (p, p) float64, finalize's record) of one model: the store's inputs of :func:`damping.solve`.

    Args:
        lambda_reg: a setting or a parsed rule (:func:`~trak_core.solve.damping.parse_lambda_reg`).
        xtx, sums, ggn: XᵀX, the row sums and XᵀRX when the caller has them (their sums in shard order, as
            :func:`total_xtx`, :func:`total_row_sums` and :func:`total_ggn` compute them from the store).
    """
    rule = lambda_reg if isinstance(lambda_reg, LambdaRule) else parse_lambda_reg(lambda_reg)
    xtx_np = total_xtx(store, model_id) if xtx is None else xtx
    sums = total_row_sums(store, model_id) if sums is None and _needs_row_sums(rule) else sums
    ggn = total_ggn(store, model_id) if ggn is None and store.meta.curvature == "ggn" else ggn
    kw = _solve_inputs(store, model_id, rule, sums, ggn)
    return solve(xtx_np, store.meta.train_set_size, rule, rescale, model_id=model_id, **kw)


def _needs_row_sums(rule: LambdaRule) -> bool:
    return bool(rule.needs_xtq or rule.needs_row_norm4 or rule.needs_q2x2)


def _solve_inputs(store: RunStore, model_id: int, rule: LambdaRule, sums: RowSums | None, ggn) -> dict[str, Any]:
    """The keyword inputs of :func:`damping.solve` besides XᵀX: the row sums ``rule`` reads and, in a store of
    ``curvature="ggn"``, XᵀRX and the stored Q."""
    kw: dict[str, Any] = {}
    if _needs_row_sums(rule) and sums is not None:  # sums over the rows, from the shard partials
        if rule.needs_xtq:
            kw["xtq"], kw["qtq"] = sums.xtq, sums.qtq
        if rule.needs_row_norm4:
            kw["row_norm4"] = sums.row_norm4
        if rule.needs_q2x2:
            kw["q2x2"] = sums.q2x2
    unfit = unfit_share_of_task(store.meta.task) if rule.has_unfit_share else None
    if unfit is not None:  # a causal LM's q (≈ 1) says nothing of its fit
        kw["unfit"] = unfit
    if store.meta.curvature == "ggn":
        kw["ggn"], kw["out_to_loss"] = ggn, store.read_rows(model_array(model_id, "out_to_loss"), slice(None))
    return kw


def finalized_settings(info: dict | None) -> tuple[Any, bool | None]:
    """(λ setting, rescale) that a finalize record (:func:`solve_model`'s ``info``) says the inverse was computed
    with; (None, None) for no record."""
    if info is None:
        return None, None
    had = info.get("lambda_setting", info.get("lambda_reg"))
    return (None if had is None else parse_lambda_reg(had).setting), info.get("rescale")


def features_rows(store: RunStore, model_id: int, a: int = 0, b: int | None = None) -> np.ndarray:
    """traker's features Φ = X A of train rows [a, b) of a finalized ``model_id`` ((b − a, p) float32), computed
    on demand from the stored gradients and inverse (the store keeps no Φ)."""
    n = store.meta.train_set_size
    b = n if b is None else b
    if not 0 <= a <= b <= n:
        raise BadInputError(f"features_rows: rows [{a}, {b}) are not within the {n} train rows")
    inv = torch.from_numpy(store.inverse(model_id)).to(torch.float32)
    grads = model_array(model_id, "grads")
    store.check_present([(grads, np.arange(a, b)), (model_array(model_id, "inverse"), np.zeros(1, dtype=np.int64))])
    x = torch.from_numpy(store.read_rows(grads, slice(a, b)).astype(np.float32, copy=False))
    return features_block(x, inv).numpy()


#: stored XᵀX partials finalize reads ahead of the one it adds (each in its own thread and buffer of p² float64)
READ_AHEAD = 2


def _sum_partials(
    store: RunStore, model_id: int, writer, device=None, known: PartialSums | None = None
) -> tuple[np.ndarray, RowSums, list, np.ndarray | None]:
    """XᵀX and the :class:`RowSums` exactly as :func:`total_xtx` and :func:`total_row_sums` sum them (the shard
    partials in shard order), computing the missing partials on the way (:func:`ensure_partial`) and summing them
    from memory instead of reading them back. Their writes go to ``writer`` (one background thread) so that they
    overlap the next shard's work and the solve; returns (XᵀX, the row sums, the write futures, XᵀRX as
    :func:`total_ggn` sums it in a store of ``curvature="ggn"``, else None). Missing
    partials are computed on ``device`` (:func:`shard_partial`). ``known``: the featurizing process's running sum
    of the partials it stored, used instead of reading them back when it covers every shard."""
    p, shards, packed = store.meta.proj_dim, store.meta.num_shards, store.meta.packed_partials
    xtx_path = model_array(model_id, "xtx_partials")
    if known is not None and known.covers(store, model_id) and known.total is not None and known.sums is not None:
        whole = unpack_upper(known.total, p) if packed else known.total.copy()
        return whole, RowSums.of(known.sums), [], None
    total, owned = None, False  # the running sum (packed as stored); 0 + P₀ is P₀ itself (total_xtx's bits)
    sums = np.zeros(p + 3, dtype=np.float64)
    ggn_total = np.zeros(store.meta.partial_shape, dtype=np.float64) if store.meta.curvature == "ggn" else None
    writes: list = []
    done = np.asarray(store.read_rows(model_array(model_id, "partial_done"), slice(None)), dtype=bool)  # one read
    # every partial computed here (none stored): summed unpacked, each one exactly symmetric, so every entry is
    # the same additions as the packed sum's and nothing is packed on this thread or unpacked at the end (the
    # store packs each one in the writer thread)
    full = packed and not done.any()
    stored_sums = (
        np.asarray(store.read_rows(model_array(model_id, "rowsum_partials"), slice(None)), dtype=np.float64)
        if done.any()
        else None
    )
    # the stored partials are read into reused buffers by READ_AHEAD background threads, the next ones while this
    # one is added (a 32 MiB partial, 16 MiB packed, takes ~20 ms to read, 1 ms to add: the reads bound the sum)
    shape = (1, *store.meta.partial_shape)
    bufs = [np.empty(shape, dtype=np.float64) for _ in range(READ_AHEAD + 1 if done.any() else 0)]
    free = list(range(len(bufs)))
    queue = iter(np.flatnonzero(done).tolist())
    reads: dict[int, tuple] = {}
    reader = ThreadPoolExecutor(max_workers=READ_AHEAD, thread_name_prefix="trak-partial-read")

    def read_next() -> None:
        while free and len(reads) < READ_AHEAD:
            s = next(queue, None)
            if s is None:
                return
            k = free.pop()
            reads[s] = (reader.submit(store.read_rows, xtx_path, slice(s, s + 1), bufs[k]), k)

    def add(part: np.ndarray, reused: bool) -> None:
        nonlocal total, owned
        if total is None:  # not modified in place while its write may be in flight, nor overwritten when reused
            total, owned = (part.copy(), True) if reused else (part, False)
        elif owned:
            total += part
        else:
            total, owned = total + part, True

    read_next()
    try:
        for s in range(shards):
            if done[s]:
                fut, k = reads.pop(s)
                fut.result()
                add(bufs[k][0], reused=True)
                free.append(k)
                read_next()  # into the buffer just added, while the next ones are read
                sums += stored_sums[s]  # type: ignore[index]
                if ggn_total is not None:
                    ggn_total += store.read_rows(model_array(model_id, "ggn_partials"), slice(s, s + 1))[0]
                continue
            a, b = store.meta.shard_range(s)
            if not store.shard_featurized(model_id, s):
                raise StateError(f"model_id={model_id}: rows {a}..{b - 1} of shard {s} are not all featurized")
            rows, q = store.read_train_rows(model_id, a, b)
            part, part_r = shard_grams(store, model_id, s, rows, q, device)
            part_q = shard_row_sums(store, model_id, s, rows, q)
            for w in writes:  # one partial (p² float64) in flight at a time
                w.result()
            part = pack_upper(part) if packed and not full else part  # packed once: written and summed as stored
            if part_r is not None:
                part_r = pack_upper(part_r) if packed else part_r
                ggn_total += part_r
            writes = [writer.submit(store.write_partial, model_id, s, part, part_q, part_r)]
            add(part, reused=False)
            sums += part_q
    finally:
        for fut, _ in reads.values():
            fut.cancel()
        reader.shutdown(wait=True)
    if total is None:
        total, full = np.zeros(store.meta.partial_shape, dtype=np.float64), False
    if ggn_total is not None and packed:
        ggn_total = unpack_upper(ggn_total, p)
    return (unpack_upper(total, p) if packed and not full else total), RowSums.of(sums), writes, ggn_total


def finalize_model(
    store: RunStore,
    model_id: int,
    lambda_reg=0.0,
    rescale: bool = True,
    progress=None,
    device=None,
    known: PartialSums | None = None,
) -> dict:
    """Partials → XᵀX → A = (XᵀX + λI)⁻¹, written to the store; returns finalize's record. Idempotent.
    ``progress(n)`` once the inverse is written (finalize makes no pass over the rows). Partials not yet in the
    store are computed on ``device`` (:func:`shard_partial`), and on a GPU the solve's eigenvalues and inverses
    too (:func:`damping.solve`'s ``linalg_device``; on the CPU, LAPACK through scipy is the faster). ``known``:
    the partials' running sum kept by the process that stored them (:class:`PartialSums`)."""
    recorded = store.finalize_info(model_id) if store.has_model(model_id) else None  # as store.is_finalized
    if recorded is not None:
        return recorded
    require_featurized(store, model_id)
    rows = np.arange(store.meta.train_set_size)
    done = np.flatnonzero(store.read_rows(model_array(model_id, "partial_done"), slice(None)))
    names = ["xtx_partials", "rowsum_partials"] + (["ggn_partials"] if store.meta.curvature == "ggn" else [])
    partials = [(model_array(model_id, name), done) for name in names]
    store.check_present(
        [(model_array(model_id, "grads"), rows), (model_array(model_id, "out_to_loss"), rows), *partials]
    )
    # the settings are recorded before anything is written: a rerun with another λ or rescale is refused naming
    # the field, never finalized with two settings
    rule = parse_lambda_reg(lambda_reg)
    store.record_feature_settings(model_id, rule.setting, rescale)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="trak-partial") as writer:
        total, sums, writes, ggn = _sum_partials(store, model_id, writer, device, known)
        kw = _solve_inputs(store, model_id, rule, sums, ggn)
        linalg_device = None if device is None or torch.device(device).type == "cpu" else torch.device(device)
        if store.meta.curvature in KFAC_CURVATURES:  # block-diagonal: Kronecker factors in the projected space
            inv, info = kfac_finalize(store, model_id, total, rule, rescale)
        else:
            inv, info = solve(
                total, store.meta.train_set_size, rule, rescale, model_id=model_id, linalg_device=linalg_device, **kw
            )
        for w in writes:  # the partials are in the store before the inverse is
            w.result()
    store.write_inverse(model_id, inv)
    store.set_finalize_info(model_id, info)
    if progress:
        progress(store.meta.train_set_size)
    return info


def usable_models(
    store: RunStore, exp_name: str, model_ids: Iterable[int] | None = None, allow_skip: bool = False
) -> list[int]:
    """Models that are finalized and whose target gradients are complete."""
    ids = list(model_ids) if model_ids is not None else store.experiment_model_ids(exp_name)
    if not ids:
        raise StateError(f"experiment {exp_name!r} has no scored checkpoints")
    used = []
    for mid in ids:
        problem = None
        if not store.is_finalized(mid):
            problem = f"model_id={mid} is not finalized"
        elif not store.targets_complete(exp_name, mid):
            problem = f"target gradients of experiment {exp_name!r} for model_id={mid} are incomplete or missing"
        if problem:
            if allow_skip:
                warnings.warn(f"{problem}; skipping it (allow_skip=True)", stacklevel=2)
                continue
            raise StateError(problem)
        used.append(mid)
    if not used:
        raise StateError(f"no usable checkpoint for experiment {exp_name!r}")
    rows, targets = np.arange(store.meta.train_set_size), np.arange(store.num_targets(exp_name))
    for mid in used:  # a chunk lost after its rows were marked done is damage, never read back as zeros
        store.check_present(
            [
                (model_array(mid, "grads"), rows),
                (model_array(mid, "out_to_loss"), rows),
                (model_array(mid, "inverse"), np.zeros(1, dtype=np.int64)),
                (target_array(exp_name, mid, "grads"), targets),
            ]
        )
    return used


def load_targets(store: RunStore, exp_name: str, model_ids: list[int]) -> dict[int, torch.Tensor]:
    """Each model's target gradients, transposed and contiguous: (p, m) float32."""
    return {
        mid: torch.from_numpy(
            store.read_rows(target_array(exp_name, mid, "grads"), slice(None)).astype(np.float32)
        ).T.contiguous()
        for mid in model_ids
    }


def solve_targets(store: RunStore, exp_name: str, model_ids: list[int]) -> None:
    """G A for each model's targets (one float32 GEMM of m × p by p × p,
    :func:`trak_core.scoring.streaming.grads_right_hand`),
    written to the experiment (``solved``) where it is not already: call once before streaming scores (the
    pipeline's ``prepare_scores``), so that every block of rows multiplies by the same bits."""
    for mid in model_ids:
        if store.solved_complete(exp_name, mid):
            continue
        store.check_present([(model_array(mid, "inverse"), np.zeros(1, dtype=np.int64))])
        g_t = load_targets(store, exp_name, [mid])[mid]
        store.write_solved(exp_name, mid, grads_right_hand(store.inverse(mid), g_t).T.numpy())


def load_solved(store: RunStore, exp_name: str, model_ids: list[int]) -> dict[int, torch.Tensor]:
    """Each model's W = A Gᵀ ((p, m) float32, contiguous), the right-hand side that the stored gradients X
    are multiplied by (:func:`solve_targets` writes it)."""
    out = {}
    targets = np.arange(store.num_targets(exp_name))
    for mid in model_ids:
        if not store.solved_complete(exp_name, mid):
            raise StateError(
                f"experiment {exp_name!r}, model_id={mid}: the targets times the inverse (G·A) are not written; "
                "prepare the scores first (reduce.solve_targets; the pipeline's prepare_scores)"
            )
        path = target_array(exp_name, mid, "solved")
        store.check_present([(path, targets)])
        out[mid] = torch.from_numpy(np.asarray(store.read_rows(path, slice(None)), dtype=np.float32)).T.contiguous()
    return out


def score_rows(
    store: RunStore,
    exp_name: str,
    model_ids: list[int],
    a: int,
    b: int,
    targets: dict | None = None,
    block_rows: int | None = None,
    progress=None,
) -> None:
    """Combined scores for train rows [a, b) written to the experiment's score array: X_c (A_c G_cᵀ) summed
    over the checkpoints as traker combines them. ``targets``: :func:`load_solved`'s W per model (read from
    the store when not given; :func:`solve_targets` must have written them). ``progress(rows)`` is called as
    rows are written.

    Streams in blocks of ``block_rows`` rows (default: chosen from the cache and memory sizes), reading the
    next block while multiplying this one (:func:`trak_core.scoring.streaming.stream_scores`)."""
    with store.pinned():
        right = targets if targets is not None else load_solved(store, exp_name, model_ids)
        stream_scores(store, exp_name, model_ids, a, b, right, block_rows=block_rows, progress=progress)


def unscored_ranges(store: RunStore, exp_name: str, a: int, b: int) -> list[tuple[int, int]]:
    """The runs [s, e) of train rows in [a, b) not marked scored, in order (empty when all are)."""
    done = store.read_rows(experiment_array(exp_name, "scores_done"), slice(a, b))
    todo = np.flatnonzero(np.diff(np.r_[0, done == 0, 0].astype(np.int8)))
    return [(a + int(s), a + int(e)) for s, e in zip(todo[::2], todo[1::2], strict=True)]


def finalize_scores(
    store: RunStore,
    exp_name: str,
    model_ids: Iterable[int] | None = None,
    allow_skip: bool = False,
    block_rows: int | None = None,
    progress=None,
) -> np.ndarray:
    """Stream over train rows; returns the (n, m) float32 scores (also stored).

    ``block_rows``: rows per GEMM (default: chosen from the cache and memory sizes,
    :func:`trak_core.scoring.streaming.score_block_rows`). The returned array is the one the blocks were computed
    into (the store holds the same bits), not a read-back of the store."""
    with store.pinned():  # one call of the run: its groups and arrays opened once
        used = usable_models(store, exp_name, model_ids, allow_skip)
        solve_targets(store, exp_name, used)
        right = load_solved(store, exp_name, used)
        n = store.meta.train_set_size
        store.reset_scores(exp_name)  # a new combination: recompute all rows
        out = page_array((n, store.num_targets(exp_name)), np.float32)
        stream_scores(store, exp_name, used, 0, n, right, block_rows=block_rows, out=out, progress=progress)
        store.set_scored_with(exp_name, used)
    return out
