"""K-FAC's layer inputs and output gradients taken from the factored projection's own forward and backward, so that
``curvature="kfac"`` / ``"ekfac"`` sum their factors while featurizing without a pass of their own
(:meth:`trak_core.solve.kfac.FactorFold.featurize`).

A :class:`FactorTap` is set on a :class:`~trak_core.featurize.featurizer.Featurizer` (``Featurizer.tap``) for one
featurize call. The factored projector's fast path
(:meth:`~trak_core.projection.factored.FactoredProjector.featurize_batch`) asks it for the per-example output shapes
of its layers (:meth:`FactorTap.shapes`: one example's forward without gradients, once per input shape), registers
its forward hooks (:meth:`FactorTap.hooks`) beside its own, and gives each example's vmapped forward a zero probe e
per layer (:meth:`FactorTap.bind`): a hook records the layer's input a (detached) and adds e to the layer's output,
so the one backward of Σ_b f_b that gives each example's ∂f_b/∂Z also gives its δ_b = ∂f_b/∂e_b. The featurizer
then hands the tap the computed rows' Q (:meth:`FactorTap.settle`), and the tap hands the real rows not counted
before (padding rows and rows the fold holds left out) to its ``reduce``. The rules are those of the fold's own pass
(:func:`trak_core.solve.kfac.batch_sums`): the same hooks, and a layer called other than once in the forward of the
batch's first example is left out. A piece computed without the fast path (no factored projector, a memory budget's
probe aside) leaves the tap incomplete (:attr:`FactorTap.complete`): the fold then runs its own pass."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn


class FactorTap:
    """The inputs and output gradients of the layers ``names`` (module names) of one featurize call's fast path.

    ``new``: one flag per row of the call, whether its sums are wanted; ``reduce(batch, acts, grads, q, left_out)``
    is called once per computed piece with its wanted rows (the piece's tensors, each layer's input (n, ...) and
    ∂f/∂output (n, ...), Q (n,) as featurized, the layers left out). ``cache``: the shape passes' results, kept by the
    caller between featurize calls of the same model."""

    def __init__(self, names: Sequence[str], new: np.ndarray, reduce: Callable, cache: dict | None = None) -> None:
        self.names = list(names)
        self.new = np.asarray(new, dtype=bool).reshape(-1)
        self.reduce = reduce
        #: the call's rows settled so far, and whether each piece came with its tensors
        self.offset, self.complete = 0, True
        #: False while a memory budget's probe runs (its rows are not the call's): computed, not counted
        self.recording = True
        self._shapes: dict[tuple, tuple[dict, list]] = {} if cache is None else cache
        self._ctx: dict = {"e": None, "a": {}, "calls": {}, "shapes": {}}
        self._used: list[str] = []
        self._left: list[str] = []
        self._pending: tuple[dict, dict, list] | None = None

    # ------------------------------------------------------------------ the projector's side
    def shapes(self, model: nn.Module, task, weights: dict, buffers: dict, batch: Sequence[Tensor]) -> dict:
        """{layer: its output's shape per example} of the layers called once in one example's forward (cached per
        input shape); the others are left out of this batch."""
        from trak_core.projection.mha import differentiable_attention

        key = tuple((tuple(t.shape[1:]), t.dtype, str(t.device)) for t in batch)
        if key not in self._shapes:
            ctx = self._ctx
            ctx.update(e=None, calls={}, shapes={})
            handles = self.hooks(model)
            try:  # the layers the differentiated passes call (a fused attention kernel calls none of its own)
                with torch.no_grad(), differentiable_attention():
                    torch.func.vmap(lambda *s: task.get_output(model, weights, buffers, *s))(*[t[:1] for t in batch])
            finally:
                for h in handles:
                    h.remove()
            left = [n for n in self.names if ctx["calls"].get(n, 0) != 1]
            self._shapes[key] = ({n: ctx["shapes"][n] for n in self.names if n not in left}, left)
        shapes, self._left = self._shapes[key]
        self._used = list(shapes)
        return dict(shapes)

    def hooks(self, model: nn.Module) -> list:
        """The forward hooks on the layers (the caller removes them): in :meth:`shapes`' pass they count the calls
        and note the output's shape; in the projector's, each layer with a probe records its input and adds the
        example's probe to its output."""
        ctx = self._ctx

        def make(name: str):
            def hook(mod, inputs, output):
                if ctx["e"] is None:
                    ctx["calls"][name] = ctx["calls"].get(name, 0) + 1
                    ctx["shapes"][name] = tuple(output.shape)
                    return None
                if name not in ctx["e"]:  # left out (called other than once)
                    return None
                ctx["a"][name] = inputs[0].detach()
                return output + ctx["e"][name]

            return hook

        return [model.get_submodule(n).register_forward_hook(make(n)) for n in self.names]

    def bind(self, probes: dict) -> dict:
        """Inside one example's forward: its probes; returns the dict its layers' inputs are recorded in."""
        self._ctx["e"], self._ctx["a"] = probes, {}
        return self._ctx["a"]

    def collect(self, acts: dict, grads: dict) -> None:
        """After the backward: each layer's input (B, ...) and ∂f/∂output (B, ...) of the batch (None: unused)."""
        self._ctx.update(e=None, a={})
        if set(acts) != set(self._used):  # a layer that ran in the shape pass did not run here
            self._pending = None
            return
        self._pending = (acts, grads, list(self._left))

    # ------------------------------------------------------------------ the featurizer's side
    def settle(self, batch: Sequence[Tensor], q: Tensor, slots: Sequence[int]) -> None:
        """The piece just computed: its tensors and Q, padded, the piece's rows at rows ``slots`` of them."""
        pending, self._pending = self._pending, None
        if not self.recording:
            return
        rows = len(slots)
        want = self.new[self.offset : self.offset + rows]
        self.offset += rows
        if pending is None or len(want) != rows:  # not from the fast path: the fold runs its own pass
            self.complete = False
            return
        if not want.any():
            return
        acts, grads, left = pending
        keep = None
        if not (want.all() and list(slots) == list(range(rows))):
            keep = torch.as_tensor(np.asarray(slots)[want], device=q.device)

        def pick(t):  # the wanted rows: the first ``rows`` (a view), or those of ``keep``
            return None if t is None else t[:rows] if keep is None else t[keep.to(t.device)]

        acts, grads = {n: pick(a) for n, a in acts.items()}, {n: pick(g) for n, g in grads.items()}
        self.reduce([pick(t) for t in batch], acts, grads, pick(q), left)
