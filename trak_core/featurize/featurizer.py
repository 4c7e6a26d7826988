"""Featurization of one batch: validated inputs → per-example gradients → projection → (X, Q).

Shared by the TRAKer facade and the pipeline's tasks so both compute the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from trak_core.errors import BadInputError, NonFiniteGradientError
from trak_core.featurize.adapters import load_state
from trak_core.featurize.budget import FIRST_USE_BYTES, MemoryFit, check_budget, fit_memory, release_free_memory
from trak_core.featurize.gradients import AbstractGradientComputer, FunctionalGradientComputer, grad_dim_of
from trak_core.featurize.modelout import AbstractModelOutput, check_devices, resolve_task
from trak_core.memory import format_bytes
from trak_core.projection.factored import FactoredProjector
from trak_core.projection.projectors import AbstractProjector

if TYPE_CHECKING:
    from trak_core.solve.kfac_tap import FactorTap


def _bad_rows(t: Tensor) -> list[int]:
    """The rows (first index) of ``t`` with a non-finite entry; one reduction when there are none."""
    if _all_finite(t):
        return []
    return (~torch.isfinite(t.reshape(t.shape[0], -1)).all(dim=1)).nonzero().reshape(-1).tolist()


def _all_finite(t: Tensor) -> bool:
    """Whether every entry of the floating tensor ``t`` is finite, by one sum: a NaN or an infinity makes the sum
    non-finite, so a finite sum proves it; a sum that is not finite (that may be an overflow of finite entries)
    is decided entry by entry."""
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


#: batches are computed in whole blocks of this many rows, each row at the place its index has in a block (index mod
#: ROW_BLOCK), the other places filled with copies of a row. BLAS picks its kernels (and so the order of its sums) by
#: the number of rows (one row goes through a matrix-vector kernel, a few through edge kernels) and, on some CPUs, by
#: a row's place among them (MKL on AMD EPYC computes the rows of a block of 16 in several ways); torch's CPU loops
#: compute whole vectors of floats with vectorized exp/tanh and the rest of a tensor with scalar ones. A row computed
#: at the same place of a block of 16 gets the same bits in every batch (Q's sigmoid is taken in float64 for the same
#: reason). Only the projected fast path (the factored projector) places rows so, and not under a memory budget: the
#: per-example-gradient paths would hold ROW_BLOCK gradients, and a budget may allow fewer rows
ROW_BLOCK = 16


def row_slots(indices: Sequence[int]) -> tuple[int, list[int]]:
    """(rows, slots): row ``i`` of a batch is computed at row ``slots[i]`` of a padded batch of ``rows`` rows (whole
    blocks of :data:`ROW_BLOCK`), where ``slots[i] ≡ indices[i]`` (mod ROW_BLOCK), in the first block whose place is
    free (so as few blocks as a place is wanted times; at least one)."""
    used = [0] * ROW_BLOCK
    slots = []
    for idx in indices:
        r = int(idx) % ROW_BLOCK
        slots.append(used[r] * ROW_BLOCK + r)
        used[r] += 1
    return max(1, max(used)) * ROW_BLOCK, slots


def _place(
    batch: Sequence[Tensor], indices: list[int], rows: int, slots: Sequence[int]
) -> tuple[list[Tensor], list[int]]:
    """``batch`` and its ``indices`` with row ``i`` at row ``slots[i]`` of ``rows``, the other rows copies of its
    first row."""
    src = [0] * rows
    for i, s in enumerate(slots):
        src[s] = i
    return [t.index_select(0, torch.as_tensor(src, device=t.device)) for t in batch], [indices[j] for j in src]


#: the largest batch of rows copied from a CUDA device into page-locked memory (torch keeps freed page-locked blocks
#: for reuse, rounded up to a power of two: a very wide batch, e.g. unprojected gradients, is copied as pageable)
PINNED_BATCH_BYTES = 256 << 20
#: rows per computation without a memory budget (no limit: a batch is computed as given)
MAX_ROWS = 1 << 62


def host_array(t: Tensor) -> np.ndarray:
    """``t`` as a host numpy array. From a CUDA device the copy lands in page-locked memory taken from torch's
    caching host allocator: a full-speed copy, and the same blocks come back batch after batch once the arrays
    holding them are dropped (a pageable copy runs at a fraction of the speed, into new pages each batch)."""
    if t.device.type != "cuda" or t.numel() * t.element_size() > PINNED_BATCH_BYTES:
        return t.cpu().numpy()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)
    return host.numpy()


class Featurizer:
    """Computes TRAK's projected gradients X (normalized by √grad_dim, as traker) and weights Q."""

    def __init__(
        self,
        model: torch.nn.Module,
        task,
        projector: AbstractProjector,
        gradient_computer: type[AbstractGradientComputer] = FunctionalGradientComputer,
        grad_wrt: Iterable[str] | None = None,
        device="cpu",
        dtype=torch.float32,
        stored_dtype: torch.dtype | None = None,
        max_memory: int | None = None,
    ) -> None:
        self.model = model
        # a memory budget (bytes, :mod:`trak_core.featurize.budget`): batches are computed in pieces of at most
        # :attr:`budget_rows` rows, measured on the first batch; ``memory_reserve``: bytes the caller holds beside
        self.max_memory = max_memory
        check_budget(max_memory, device)
        self.memory_reserve = 0
        self.memory_fit: MemoryFit | None = None
        self.budget_rows: int | None = None
        # the dtype train rows are stored in: on a CUDA device X is rounded to it there (the same IEEE rounding as
        # the host's conversion) and comes back in it (a float16 store: half the bytes, no host conversion)
        self.stored_dtype = stored_dtype
        self.task: AbstractModelOutput = resolve_task(task)
        self.projector = projector
        self.device = device
        self.grad_dim = grad_dim_of(model, grad_wrt)
        self.gradient_computer = gradient_computer(
            model=model, task=self.task, grad_dim=self.grad_dim, dtype=dtype, device=device, grad_wrt=grad_wrt
        )
        self.normalize_factor = math.sqrt(self.grad_dim)
        # K-FAC's factor sums taken from the fast path's forward and backward (:class:`trak_core.solve.kfac_tap.
        # FactorTap`, set for one featurize call by ``FactorFold.featurize``): handed each computed piece's Q
        self.tap: FactorTap | None = None
        self._fit_with_tap = False  # whether :attr:`memory_fit` was measured with a tap's tensors

    def load_state(self, state_dict: dict) -> None:
        try:
            load_state(self.model, state_dict)
        except RuntimeError as e:
            raise BadInputError(f"checkpoint does not fit the model: {e}") from None
        self.model.eval()
        self.gradient_computer.load_model_params(self.model)

    def _to_device(self, batch: Sequence[Tensor]) -> list[Tensor]:
        return [x.to(self.device) for x in batch]

    def out_to_loss(self, batch: Sequence[Tensor], model_id: int, indices: Sequence[int]) -> Tensor:
        q = self.gradient_computer.compute_loss_grad(batch).reshape(-1).float()
        bad = [] if _all_finite(q) else (~torch.isfinite(q)).nonzero().reshape(-1).tolist()
        if bad:
            raise NonFiniteGradientError(model_id, [indices[i] for i in bad], what="model outputs")
        return q

    def _fast_path(self, batch: Sequence[Tensor], model_id: int, with_output: bool = False):
        """A projector with ``featurize_batch`` (e.g. the factored one) projects without materialized
        per-example gradients; it returns None when it cannot (then: gradients + project). ``with_output``:
        (X, the outputs f of the same forward)."""
        fast = getattr(self.projector, "featurize_batch", None)
        if fast is None or not isinstance(self.gradient_computer, FunctionalGradientComputer):
            return None
        gc = self.gradient_computer
        tap: dict = {} if self.tap is None or not isinstance(self.projector, FactoredProjector) else {"tap": self.tap}
        if with_output:
            return fast(self.model, self.task, gc._weights(), gc._buffers(), batch, model_id, with_output=True, **tap)
        return fast(self.model, self.task, gc._weights(), gc._buffers(), batch, model_id, **tap)

    def project_batch(self, batch: Sequence[Tensor], model_id: int, indices: Sequence[int]) -> Tensor:
        x = self._fast_path(batch, model_id)
        if x is None:
            x = self._project(self.gradient_computer.compute_per_sample_grad(batch), model_id, indices)
        return self._scaled(x, model_id, indices)

    def _project(self, grads: dict[str, Tensor], model_id: int, indices: Sequence[int]) -> Tensor:
        bad = sorted({i for g in grads.values() for i in _bad_rows(g)})
        if bad:
            raise NonFiniteGradientError(model_id, [indices[i] for i in bad])
        return self.projector.project(grads, model_id=model_id)

    def _scaled(self, x: Tensor, model_id: int, indices: Sequence[int]) -> Tensor:
        x = x.float() / self.normalize_factor
        bad = _bad_rows(x)
        if bad:
            raise NonFiniteGradientError(model_id, [indices[i] for i in bad], what="projected gradients")
        return x

    def _one_forward(
        self, batch: Sequence[Tensor], model_id: int, indices: Sequence[int], given: int | None = None
    ) -> tuple[Tensor, Tensor] | None:
        """(X, Q) from one forward pass — the factored fast path's, or torch.func's per-example gradients and
        values — with Q from its outputs (the task's ``out_to_loss_from_output``), where the task allows it and the
        gradients come from torch.func; else None. Where that Q is not finite (a label out of range, a non-finite
        output) the task's own ``get_out_to_loss_grad`` runs, as :meth:`out_to_loss`: its error (or its Q) is what
        the separate forward gives, raised before any check of the gradients. ``given``: the rows of the batch before
        its padding (:data:`ROW_BLOCK`), which an error counts."""
        probe = getattr(self.task, "out_to_loss_from_output", None)
        gc = self.gradient_computer
        if probe is None or probe(torch.zeros(1)) is None or not isinstance(gc, FunctionalGradientComputer):
            return None  # (the task says so whatever the outputs)
        fast = self._fast_path(batch, model_id, with_output=True)
        grads = None
        if fast is None:
            grads, out = gc.compute_per_sample_grad(batch, with_output=True)
        else:
            x, out = fast
        q = probe(out)
        if q is None or q.numel() != out.numel():
            outputs = out.numel() if given is None else out.numel() * given // batch[0].shape[0]
            raise BadInputError(
                f"{type(self.task).__name__}.out_to_loss_from_output gave "
                f"{'None' if q is None else tuple(q.shape)} for {outputs} outputs: it must give one Q per "
                "output whenever it gives one for any"
            )
        q = q.reshape(-1).float()
        if not _all_finite(q):
            q = self.out_to_loss(batch, model_id, indices)
        if grads is not None:
            x = self._project(grads, model_id, indices)
        return self._scaled(x, model_id, indices), q

    def featurize(
        self, batch: Sequence[Tensor], model_id: int, indices: Sequence[int] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(X (B, p) float32, or :attr:`stored_dtype` on a CUDA device, Q (B,) float32) for one batch of train rows.
        Raises before returning anything on bad input."""
        x, q = self._compute(batch, model_id, indices)
        if self.stored_dtype is not None and x.device.type == "cuda":
            x = x.to(self.stored_dtype)  # finite (checked): rounded as the store would round it
        return host_array(x), host_array(q)

    def rows_within_budget(self, batch: Sequence[Tensor], model_id: int, out_rows: int = 0) -> int:
        """The most rows one computation may take under :attr:`max_memory` (None: no budget) with the outputs of
        ``out_rows`` rows held beside, probed once on rows of ``batch`` (repeated where it has fewer than the probe
        takes; :func:`trak_core.featurize.budget.fit_memory`)."""
        if self.max_memory is None:
            return MAX_ROWS
        if self.memory_fit is None or (self.tap is not None and not self._fit_with_tap):
            n = batch[0].shape[0]

            def run(rows: int) -> None:
                take = torch.arange(rows) % n
                if self.tap is not None:  # its tensors measured, the probe's rows not counted
                    self.tap.recording = False
                try:
                    self._compute_rows([t[take] for t in batch], model_id, [int(i) for i in take])
                finally:
                    if self.tap is not None:
                        self.tap.recording = True

            self.memory_fit = fit_memory(run, self.device, self.max_memory, self._reserve())
            self._fit_with_tap = self.tap is not None
        fit = self.memory_fit
        held = self._reserve() + out_rows * (self.projector.proj_dim + 1) * 4
        rows = fit.rows_within(self.max_memory, held)
        if rows < 1:
            raise BadInputError(
                f"max_memory: {format_bytes(self.max_memory)} leaves no room for one row's batch (measured: "
                f"{format_bytes(fit.base)} used, {format_bytes(max(0, fit.fixed) + fit.per_row)} more for one row at "
                f"the peak, {format_bytes(held)} held beside); raise max_memory. Nothing was featurized"
            )
        self.budget_rows = rows
        return rows

    def _reserve(self) -> int:
        """Bytes counted beside the batches under a budget: the caller's, and on the CPU what the process gains once
        on its first writes (:data:`trak_core.featurize.budget.FIRST_USE_BYTES`)."""
        once = FIRST_USE_BYTES if torch.device(self.device).type == "cpu" else 0
        return self.memory_reserve + once

    def _compute(
        self, batch: Sequence[Tensor], model_id: int, indices: Sequence[int] | None = None
    ) -> tuple[Tensor, Tensor]:
        self.task.validate_batch(batch)
        self.task.validate_inputs(self.model, batch)
        b = batch[0].shape[0]
        indices = list(range(b)) if indices is None else [int(i) for i in indices]
        if b <= self.rows_within_budget(batch, model_id):
            return self._compute_rows(batch, model_id, indices)
        # under a budget, in pieces, each one's rows copied into the batch's outputs (held beside the pieces)
        k = self.rows_within_budget(batch, model_id, out_rows=b)
        x = q = None
        for s in range(0, b, k):
            xs, qs = self._compute_rows([t[s : s + k] for t in batch], model_id, indices[s : s + k])
            if x is None or q is None:
                x, q = xs.new_empty((b, *xs.shape[1:])), qs.new_empty((b, *qs.shape[1:]))
            x[s : s + k], q[s : s + k] = xs, qs
            del xs, qs
            release_free_memory()  # the next piece grows from what is live, as the probe measured it
        assert x is not None and q is not None
        return x, q

    def _compute_rows(self, batch: Sequence[Tensor], model_id: int, indices: list[int]) -> tuple[Tensor, Tensor]:
        batch = self._to_device(batch)
        check_devices(
            (p.device for p in self.model.parameters()),
            batch,
            f" (the featurizer moves the batch to its device={str(self.device)!r}: move the model there, or give the "
            "model's device)",
        )
        b = batch[0].shape[0]
        # the projected fast path holds no per-example gradient: each row computed at its index's place in a block of
        # ROW_BLOCK rows gets the same bits whatever its batch (the paths that materialize per-example gradients keep
        # the batch's rows; under a memory budget a batch is computed in the pieces the budget allows, unpadded)
        fast = getattr(self.projector, "featurize_batch", None) is not None and self.max_memory is None
        if fast and isinstance(self.gradient_computer, FunctionalGradientComputer):
            rows, slots = row_slots(indices)
        else:
            rows, slots = b, list(range(b))
        placed = rows != b or slots != list(range(b))
        given, given_indices = batch, indices
        if placed:
            batch, indices = _place(batch, indices, rows, slots)
        try:
            both = self._one_forward(batch, model_id, indices, given=b)
            if both is None:
                q = self.out_to_loss(batch, model_id, indices)
                x = self.project_batch(batch, model_id, indices)
            else:
                x, q = both
        except BadInputError:
            if placed:  # an error naming batch positions names the batch's own: its separate forward's
                self.out_to_loss(given, model_id, given_indices)
            raise
        except RuntimeError as e:
            self._dtype_mismatch(batch, e)
            raise
        if self.tap is not None:
            self.tap.settle(batch, q, slots)
        if not placed:
            return x, q
        at = torch.as_tensor(slots, device=x.device)
        return x.index_select(0, at), q.index_select(0, at.to(q.device))

    def target_features(
        self, batch: Sequence[Tensor], model_id: int, indices: Sequence[int] | None = None
    ) -> np.ndarray:
        """X (float32) for targets: :meth:`featurize`'s (Q is not needed, but its checks — labels, finite outputs —
        run)."""
        return host_array(self._compute(batch, model_id, indices)[0])

    def _dtype_mismatch(self, batch: Sequence[Tensor], e: RuntimeError) -> None:
        """A dtype error of the model's forward on inputs of another floating dtype (float64 inputs, float32
        model) becomes a BadInputError saying what to cast."""
        model_dt = sorted({str(p.dtype) for p in self.model.parameters() if p.is_floating_point()})
        in_dt = sorted({str(t.dtype) for t in batch if t.is_floating_point()})
        if "dtype" in str(e).lower() and in_dt and model_dt and in_dt != model_dt:
            raise BadInputError(
                f"the batch's floating tensors are {', '.join(in_dt)} but the model's parameters are "
                f"{', '.join(model_dt)}: cast the inputs (x.to({model_dt[0]})) or the model (e.g. "
                f"model.to({in_dt[0]})) so that they match ({e})"
            ) from None
