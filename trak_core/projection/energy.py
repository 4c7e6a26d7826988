"""The gradient-energy probe behind the factored projector's default split: for each parameter, the mean over a
few examples of ‖∂f/∂θ‖², f the task's model output (:func:`gradient_energies`, exact), or for each of the
factored layout's blocks its unbiased estimate from a sketch (:func:`sketched_energies`, the default's: one
batched pass of the factored fast path, as cheap as featurizing the probe's rows).

Per-example gradients come from ``torch.func`` (``vmap(grad(f))``, as the gradient computer), in chunks of rows
whose gradients take at most ``budget_bytes`` together (one row per pass for a model larger than the budget), each
chunk reduced to its squared norms at once: memory stays flat in parameters × rows. The model runs in eval mode
(BatchNorm uses its running statistics, dropout is off, as when featurizing) on its own device; its training mode
is restored afterwards.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from trak_core.errors import BadInputError
from trak_core.featurize.gradients import grad_param_names
from trak_core.featurize.modelout import AbstractModelOutput, resolve_task

#: the rows the probe reads by default (the first ones of the batch)
PROBE_ROWS = 64
#: the most bytes of per-example gradients one pass of the probe holds
PROBE_BYTES = 256 * 2**20
#: significant digits the sketched energies keep (:func:`quantize_energies`)
ENERGY_DIGITS = 3


def quantize_energies(energies: dict[str, float], digits: int = ENERGY_DIGITS) -> dict[str, float]:
    """Each energy rounded to ``digits`` significant decimal digits (correctly rounded, so the same on every
    platform). The probe's floats depend on how its sums were blocked (batch size, BLAS kernel, thread count,
    CPU): two runs differ in the 8th or 9th digit. What decides the projection must not, so the split is computed
    from, and the store records, these rounded values; two probes then disagree only when a value lies within
    that noise of a rounding boundary (about one value in 10⁵), and a store is always rebuilt from its record."""
    return {k: float(f"{float(v):.{digits}g}") for k, v in energies.items()}


def probe_chunk(num_params: int, itemsize: int = 4, budget_bytes: int = PROBE_BYTES) -> int:
    """Rows per vmapped pass: as many as keep rows × ``num_params`` × ``itemsize`` within ``budget_bytes``, ≥ 1."""
    return max(1, budget_bytes // max(1, num_params * itemsize))


def _checked(task, batch, rows) -> tuple[AbstractModelOutput, int]:
    """(the resolved task, the number of rows probed) or a BadInputError naming what is wrong."""
    task = resolve_task(task)
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise BadInputError(f"energy probe: rows must be a positive integer, got {rows!r}")
    if not isinstance(batch, (list, tuple)) or not batch or not all(isinstance(t, Tensor) for t in batch):
        raise BadInputError("energy probe: the batch must be a non-empty list or tuple of tensors")
    n = min(int(batch[0].shape[0]), rows)
    if n < 1:
        raise BadInputError("energy probe: the batch has no examples")
    return task, n


def _refuse_nonfinite(ok: Tensor, skip_nonfinite: bool, first: int = 0) -> None:
    """Raise naming the probe rows (``first`` + index) whose ``ok`` is False, unless ``skip_nonfinite``."""
    if not skip_nonfinite and not bool(ok.all()):
        bad = (first + (~ok).nonzero().reshape(-1)).tolist()
        raise BadInputError(f"energy probe: the gradient of example(s) {bad[:10]} of the probe batch is not finite")


def _finite(out: dict[str, float]) -> dict[str, float]:
    """``out``, unless a value overflowed (each example's was finite, their sum in float64 is not)."""
    if not all(math.isfinite(v) for v in out.values()):
        raise BadInputError("energy probe: the summed squared gradients overflow float64")
    return out


def gradient_energies(
    model: torch.nn.Module,
    task: AbstractModelOutput | str,
    batch: Sequence[Tensor],
    rows: int = PROBE_ROWS,
    grad_wrt: Iterable[str] | None = None,
    budget_bytes: int = PROBE_BYTES,
    skip_nonfinite: bool = False,
) -> dict[str, float]:
    """{parameter name: mean over the first ≤ ``rows`` examples of ``batch`` of ‖∂f/∂θ‖²} for the parameters of
    ``grad_wrt`` (all trainable ones by default), f the task's output for one example.

    Args:
        model: the model at the checkpoint to probe (run in eval mode on its own device; its mode is restored).
        task: a model output function or a task name (:func:`trak_core.featurize.modelout.resolve_task`).
        batch: the task's batch (tensors with the examples along dimension 0).
        rows: how many examples (the first ones) the mean takes.
        budget_bytes: the most bytes of per-example gradients held at once.
        skip_nonfinite: leave examples whose gradient is not finite out of the mean (all energies 0 when no
            example is left) instead of raising.
    Returns:
        {name: energy} as Python floats (accumulated in float64).
    Raises:
        BadInputError: an empty batch, ``rows`` < 1, or (unless ``skip_nonfinite``) an example whose gradient is
            not finite.
    """
    task, n = _checked(task, batch, rows)
    names = grad_param_names(model, grad_wrt)
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device if params else torch.device("cpu")
    keep = set(names)
    weights = {k: v.detach() for k, v in params.items() if k in keep}
    fixed = {k: v.detach() for k, v in params.items() if k not in keep}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    itemsize = max((weights[k].element_size() for k in names), default=4)
    chunk = probe_chunk(sum(weights[k].numel() for k in names), itemsize, budget_bytes)

    def f(w, b, *sample):
        return task.get_output(model, {**w, **fixed}, b, *sample)

    per_example = torch.func.vmap(torch.func.grad(f), in_dims=(None, None, *([0] * len(batch))), randomness="different")
    total = {k: torch.zeros((), dtype=torch.float64, device=device) for k in names}
    was_training = model.training
    model.eval()
    used = n
    try:
        for a in range(0, n, chunk):
            sample = [t[a : min(a + chunk, n)].to(device) for t in batch]
            with sdpa_kernel(SDPBackend.MATH):  # vmap has no batching rule for the fused attention kernels
                grads = per_example(weights, buffers, *sample)
            sq = {k: grads[k].reshape(grads[k].shape[0], -1).double().pow(2).sum(1) for k in names}
            del grads
            ok = torch.stack([torch.isfinite(v) for v in sq.values()]).all(0) if sq else None
            if ok is not None and not bool(ok.all()):
                _refuse_nonfinite(ok, skip_nonfinite, a)
                sq = {k: v[ok] for k, v in sq.items()}
                used -= int((~ok).sum())
            for k in names:
                total[k] += sq[k].sum()
    finally:
        model.train(was_training)
    return _finite({k: float(v) / max(used, 1) for k, v in total.items()})


#: the sketch's width per block of the probe's equal split, and its bounds in all
SKETCH_PER_BLOCK, SKETCH_MIN, SKETCH_MAX = 32, 512, 8192


def sketched_energies(
    model: torch.nn.Module,
    task: AbstractModelOutput | str,
    batch: Sequence[Tensor],
    rows: int = PROBE_ROWS,
    grad_wrt: Iterable[str] | None = None,
    skip_nonfinite: bool = False,
    seed: int = 0,
    chunk_rows: int | None = None,
) -> dict[str, float]:
    """Each factored block's gradient energy, the mean over the first ≤ ``rows`` examples of ‖∂f/∂θ_block‖²,
    estimated as the mean ‖x_block‖² of the block's part of the factored projection x (equal split, version 4's
    rules, :data:`SKETCH_PER_BLOCK` dimensions a block, within [:data:`SKETCH_MIN`, :data:`SKETCH_MAX`]; a block
    that gets its whole size is exact). The projection preserves inner products in expectation block by block,
    so the estimate is unbiased; it comes from the factored fast path in one batched pass (no per-example gradient
    materialized), on the model's device, in eval mode.

    ``chunk_rows``: rows per pass (default: all ≤ ``rows`` at once); the pipeline passes its batch size.

    Returns:
        {parameter name: energy}, each block's on its first parameter (0.0 on its others): what
        ``split="energy"`` sums per block (a new store records them rounded: :func:`quantize_energies`).
        Arguments and errors as :func:`gradient_energies`.
    """
    from trak_core.projection.factored import FactoredProjector
    from trak_core.projection.layout import model_layout

    task, n = _checked(task, batch, rows)
    layout = model_layout(model, SKETCH_MIN, grad_wrt, "dense", "layer")  # its blocks are the same at any width
    width = min(layout.grad_dim, max(SKETCH_MIN, min(SKETCH_MAX, SKETCH_PER_BLOCK * len(layout.blocks))))
    if width != SKETCH_MIN:
        layout = model_layout(model, width, grad_wrt, "dense", "layer")
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device if params else torch.device("cpu")
    dtype = next((v.dtype for v in params.values() if v.is_floating_point()), torch.float32)
    proj = FactoredProjector(layout.grad_dim, width, seed, device=device, layout=layout, dtype=dtype)
    weights = {k: v.detach() for k, v in params.items()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    step = n if chunk_rows is None else max(1, int(chunk_rows))
    parts = []
    was_training = model.training
    model.eval()
    try:
        for a in range(0, n, step):  # batches of the caller's size: the activations' memory of one featurize batch
            sample = [t[a : min(a + step, n)].to(device) for t in batch]
            x = proj.featurize_batch(model, task, weights, buffers, sample, model_id=0)
            assert isinstance(x, Tensor)  # a layout built from the model is bound to it (no output asked for)
            parts.append(x.detach().double().pow(2))
    finally:
        model.train(was_training)
    sq = torch.cat(parts)
    ok = torch.isfinite(sq).all(1)
    _refuse_nonfinite(ok, skip_nonfinite)
    sq = sq[ok]
    used = max(int(sq.shape[0]), 1) * width  # the projection's inner products are width × the gradients' ones
    out: dict[str, float] = {}
    a = 0
    for b in layout.blocks:
        out[b.params[0]] = float(sq[:, a : a + b.k].sum()) / used
        out.update({name: 0.0 for name in b.params[1:]})
        a += b.k
    return _finite(out)
