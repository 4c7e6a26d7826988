"""Factored (Kronecker-structured, LoGra-style) projection of per-layer gradients, and the fast path that
never materializes per-example gradients.

The projection
--------------
The gradient is cut into *blocks*, in the order of the gradient vector's parameters. A block is one
2-D view of a weight W (d_out × d_in) with an optional bias b (d_out), whose gradient is the augmented
matrix G = [∂W | ∂b] (d_out × (d_in + 1)): the bias is one more input coordinate that is constantly 1.
The block is projected to

    vec(P_outᵀ G P_in)[:k] · √(proj_dim / k)

with P_in ((d_in [+1]) × k_in) and P_out (d_out × k_out) random (±1 or N(0, 1)), k_in · k_out ≥ k, and
the first k entries of the row-major (k_out, k_in) result kept (a side as wide as its dimension is the
identity instead, with per-coordinate weights: "Identity sides" below). Each kept entry is a column p ⊗ q of
P_out ⊗ P_in with E[(p⊗q)(p⊗q)ᵀ] = I, so E⟨Px, Py⟩ = proj_dim · ⟨x, y⟩ over the whole gradient
(``scale`` = proj_dim, as the dense kinds) whatever the split.

Block kinds (``Layout.describe()`` names them; the store records the description, see "Layouts" below):

* ``"linear"``: an ``nn.Linear`` (weight + its bias); ``"conv"``: an ``nn.Conv1d/2d/3d`` with ``groups=1``
  (weight viewed as C_out × C_in·∏kernel, the ``unfold`` order, + its bias). Both used through the
  module's forward, their weight not shared with another module.
* ``"embedding"``: an ``nn.Embedding`` table E (num_embeddings × dim; d_out = the vocabulary rows, no
  bias), used through its module's forward, not shared, without ``max_norm``, ``scale_grad_by_freq`` or
  ``sparse`` (those tables go to ``"__other__"``); ``padding_idx`` is supported (that row gets no
  gradient, as in torch).
* ``"matrix"``: every other parameter with at least 2 dimensions and at least 2 rows and 2 columns in
  ``grad_wrt`` (``nn.MultiheadAttention``'s ``in_proj_weight`` and ``out_proj.weight``, a position table
  ``nn.Parameter``, weights shared between modules, grouped convolutions, transformers' ``Conv1D`` weights
  [in, out], ...), viewed as shape[0] × ∏shape[1:]. Its bias is the 1-D parameter named like the weight with
  ``bias`` for ``weight`` (``in_proj_bias`` for ``in_proj_weight``, ``out_proj.bias`` for ``out_proj.weight``)
  when that parameter is in ``grad_wrt``, has shape[0] entries and is not claimed by a layer above. The pairing
  is a layout choice only: the projection is exact for any use of the two parameters.
* ``"other"``: the one ``"__other__"`` block of the remaining parameters (1-D norms and biases, scalars,
  tiny matrices, unsupported embeddings), projected densely (±1 or N(0, 1) entries, materialized
  per-example gradients of those parameters only) — or refused with ``other="error"``.

For one example and one position, ∂W = g aᵀ (g the output gradient, a the input), so a linear block is
(P_outᵀ g) ⊗ (P_inᵀ [a; 1]) — the per-example weight gradient is never needed; for sequences and
convolutions (positions t) it is Σ_t (P_outᵀ g_t) ⊗ (P_inᵀ [a_t; 1]). For an embedding, ∂E = Σ_t e_{id_t}
g_tᵀ, so its block is Σ_t P_out[id_t] ⊗ (P_inᵀ g_t): rows of P_out gathered by token id.

The split of proj_dim
---------------------
``split="energy"`` (the default of TRAKer and the pipeline): shares ∝ each block's gradient energy, the mean
per-example ‖∂f/∂θ_b‖² (estimated by :func:`trak_core.projection.energy.sketched_energies`), at least min(4, the block's
size) each; ``split="layer"``: equal shares. Either way a block with fewer gradient coordinates than its share keeps
all of them (k_b = its size; for a factored block both sides are then the identity: the block itself, exactly) and
the others share the rest again (water-filling); largest-remainder rounding, Σ k_b = proj_dim exactly. A grid block
is factored as k_out = min(d_out, ⌈√k_b⌉), k_in = ⌈k_b / k_out⌉ (if k_in > d_in [+1]: k_in = d_in [+1], k_out =
⌈k_b / k_in⌉) — balanced factors minimize the distortion of rank-one gradients, whose relative error is
≈ √(2/k_in + 2/k_out) (dense: √(2/k)). Why energy: the error of ⟨Px, Py⟩ is Σ_b ‖x_b‖²‖y_b‖²·c_b/k_b, least
for k_b ∝ a block's share of the gradient's energy, which follows neither its size nor the number of blocks (a
language model's energy sits in its embedding, position table and first attention); version 4's equal split
(``split="layer"``) and version 3's split ∝ size (``split="size"``) are kept for comparison.

Identity sides
--------------
A side whose width reaches its dimension (k_out = d_out, or k_in = d_in [+1]) would be a random *square*
matrix: it rotates without reducing, and only adds its distortion √(2/k_out) (a 10-class output layer:
k_out = 10, ≈ 0.45). That side is the identity instead (``id_out`` / ``id_in`` in ``describe()``), exact on
that side. With P_out = I, kept coordinate (i, j) is G[i, :] · p_inⱼ: row i's inner product is estimated from
the c_i kept coordinates of row i of the (k_out, k_in) grid (the first k row-major: c_i = k_in for every full
row, less for the last), so coordinate (i, j) is weighted √(proj_dim / c_i) instead of √(proj_dim / k):
E⟨Px, Py⟩ = Σ_i (proj_dim / c_i) · c_i · ⟨G_x[i], G_y[i]⟩ = proj_dim · ⟨G_x, G_y⟩, still unbiased. Likewise
P_in = I with c_j the kept coordinates of column j. Used only where every row (column) of the identity side
keeps at least one coordinate; when both sides reach their dimensions, both are the identity only when k =
d_out · (d_in [+1]) (the block itself, exactly, weighted √proj_dim); otherwise the side with the smaller
dimension is (its rows then get the most coordinates each). Pairs (below) never use an identity side. The cost
is that of the square random factor it replaces (the fast path multiplies by I).

Pairs
-----
The grid's coordinates share rows: the error of ⟨Px, Py⟩ on rank-one gradients is that of two JL sketches of
widths k_out and k_in ≈ √k multiplied, ≈ √(2/k_in + 2/k_out), far above dense's √(2/k). A block therefore gets k
independent pairs instead (``pairs``, a Khatri-Rao product; P_in (d_in [+1]) × k and P_out d_out × k) wherever
they are cheap: a linear, conv or matrix block whose pairs cost at most ``PAIRS_MAX_RATIO`` × its own forward per
position, k · (d_in [+1] + d_out) ≤ ``PAIRS_MAX_RATIO`` · d_out · (d_in [+1]) — at most about that layer's share
of a training pass, whatever its number of positions (an absolute bound would let a small conv layer seen at
thousands of positions cost many times the model's forward) — and a small block that is not a conv (at most
``PAIRS_MAX_WEIGHTS`` weights, k · (d_in [+1] + d_out) ≤ ``PAIRS_MAX_MACS`` multiply-adds per position).
Coordinate j is p_outⱼᵀ G p_inⱼ · √(proj_dim/k), for one position (p_outⱼᵀ g)(p_inⱼᵀ [a; 1]) — Z = diag(z) in the
fast path's hooks (conv: P_out diag(z) applied to the conv of the input with P_in; embedding: (P_out[ids] ⊙ z)
P_inᵀ) — still unbiased (E[(p⊗q)(p⊗q)ᵀ] = I) with an error ∝ 1/√k like dense. (An embedding's output side is a
gather, so its cost per position is k · (d_in + 1).) Other blocks keep the grid, whose cost per position is
(d_in + d_out)·√k instead of (d_in + d_out)·k. For a linear layer seen once per example (an MLP) the grid's
P_out Z, d_out · k per example, costs about as much as the pairs: there the pairs are no slower.

The random numbers (deterministic under the rules of :mod:`trak_core.projection.counter_rng`)
------------------------------------------------------------------------------
Per (seed, model_id, block name, side) a 32-bit key:
``base = stream_key(seed, model_id, STREAM_FACTOR)``, ``h = FNV-1a-32(utf-8 block name)``,
``key = mix32(mix32(base ^ h) + (4·side + sub + 1)·0x9E3779B9)`` with side 0 = P_in, 1 = P_out,
2 = the dense ``"__other__"``/unstructured block, and sub 0/1 the two uniform streams of Box–Muller
(Rademacher uses sub 0 only). Entry (i, j) of a rows × cols factor then follows the dense definitions
of :mod:`trak_core.projection.counter_rng` with that key: Rademacher bit j % 32 of word hash(i·⌈cols/32⌉ + j//32),
normal Box–Muller of hash(i·cols + j) under the two keys. Block names are module names (linear, conv,
embedding) or the weight's parameter name (matrix), stable across processes, batch sizes and machines, so
the matrices are a pure function of (seed, model_id, layout). A process keeps the factors it generated in
a cache bounded by :data:`FACTOR_CACHE_BYTES` (keyed by all the inputs of :func:`factor_matrix`), so a new
projector for the same model does not regenerate them; :func:`clear_factor_cache` empties it.

Without a model (``FactoredProjector(grad_dim, proj_dim, ...)``) the layout is one ``"__flat__"`` block
that views the gradient vector as a d_out × d_in matrix (d_in = ⌈√grad_dim⌉, zero-padded): a generic
Kronecker JL projection for any vector, but no fast path. Build it with :meth:`FactoredProjector.from_model`
(or ``make_projector("factored", ..., model=model, grad_wrt=...)``) to get the per-layer layout and the
fast path (:meth:`FactoredProjector.featurize_batch`, used by :class:`trak_core.featurize.featurizer.Featurizer`).

Layouts
-------
``spec()`` carries ``layout_version`` (:data:`LAYOUT_VERSION`), the ``split`` and, for the energy split, the
``energies`` it used (what :func:`record_kwargs` turns back into the same projector, from the model alone), and the
block table; all go into a store's metadata, and a store is refused (``StoreMismatchError``) when any differs.
Version 2 added the embedding and matrix kinds: a model with embeddings, attention or other 2-D parameters outside
``nn.Linear``/``nn.Conv`` now projects them per block instead of in ``"__other__"``, so its stores from
version 1 (no ``layout_version`` recorded) are refused rather than mixed with the new projection. Version 3
added the identity sides (see "Identity sides"): a block whose k_out = d_out or k_in = d_in [+1] projects
differently, so stores of version 2 are refused likewise (even where no block has an identity side). Version 4
split proj_dim equally between blocks and gave pairs to linear and conv blocks where they are cheap: stores of
version 3 are refused likewise. Version 5 records the split (version 4's layout rules are unchanged for
``split="layer"``): a version-4 store is rebuilt with ``layout_version=4``, whose spec is exactly what version 4
recorded, and keeps working.

The fast path
-------------
``featurize_batch`` runs the task's model output f per example under ``vmap`` (buffers fixed, exactly as
the gradient computer) with a zero k_out × k_in matrix Z per block and differentiates with respect to Z:

* linear / conv / embedding blocks: forward hooks add ``P_out Z P_inᵀ [a; 1]`` (convs: the conv of the
  input with P_in as kernel; embeddings: ``P_out[ids] Z P_inᵀ``) to the layer's output, which is zero in
  value. Cost per example: one forward and backward plus O((d_in + d_out)·√k) per position. A hook sees
  only the module's forward: on the first batch of each model a projector checks that the hooked weights
  have no other use (``F.linear(x, layer.weight)``, a functionally tied output layer) by comparing
  ⟨∂F/∂W, R⟩ over all uses (a shared zero scalar s in W + s·R) with what the hooks saw; blocks that fail,
  or whose hook never fires, switch to weight substitution below (the same projection) with a warning;
* matrix blocks whose weight (and bias) the model holds only as the ``weight`` (``bias``) of ``nn.Linear``,
  ``nn.Embedding`` or transformers' ``Conv1D`` modules (recognized by duck typing: class name ``Conv1D``, attribute
  ``nf``, weight [nx, nf], y = x W + b): forward hooks on each of those modules add what W + P_out Z P_inᵀ would
  add to its output (a Conv1D: a (P_out Z) P_inᵀ [+ P_out Z p_in,last], the block's nx × nf view being the
  weight's own), so the projection is the matrix block's, unchanged. A weight tied between modules (a token
  embedding and an output head) gets one hook per module on the same Z: ∂f/∂Z sums both uses, as the gradient
  does. The check above covers these hooks too;
* ``nn.MultiheadAttention``'s in-projection (``in_proj_weight`` + ``in_proj_bias``, or ``q/k/v_proj_weight``) and
  ``out_proj`` weight and bias, which its attention function applies with ``F.linear``: a ``TorchFunctionMode``
  runs torch's own attention function with a ``linear`` that adds the same term to each call whose weight is the
  block's (or a slice of its rows, as the packed in-projection splits it for cross-attention); see
  :mod:`trak_core.projection.mha`. The check above covers these too;
* the other matrix blocks ("weight substitution"): the output function gets W + P_out Z P_inᵀ (and b + P_out Z
  p_in,last) in place of W (and b) through ``functional_call``; this works for any use of the parameter.
  Cost per example: the d_out × d_in perturbed weight (materialized per example, as the per-example
  gradient of that one parameter would be) and its use through batched instead of shared matmuls.

In both cases ∂f/∂Z = P_outᵀ (∂f/∂W_aug) P_in — the projected block — exactly. ``"__other__"``'s
parameters get materialized per-example gradients (small by construction). On the CPU, scaled dot-product
attention runs its math backend during the fast path (vmap has no batching rule for the fused CPU
kernel: it would loop over examples); the numbers are the same up to rounding.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from trak_core.errors import BadInputError
from trak_core.featurize.gradients import vectorize
from trak_core.projection.base import AbstractProjector, ProjectionType, as_proj_type, check_dims
from trak_core.projection.embed import EMBEDDING, EmbeddingHooks, looks_up_inside
from trak_core.projection.layout import (
    FLAT,
    HOOKED,
    LAYOUT_VERSION,
    MATRIX,
    OTHER,
    SIDE_DENSE,
    SIDE_IN,
    SIDE_OUT,
    Block,
    Layout,
    clear_factor_cache,
    coordinate_counts,
    coordinate_weights,
    factor_key,
    factor_matrix,
    flat_layout,
    matrix_uses,
    model_layout,
    name_hash,
)
from trak_core.projection.mha import (
    ATTENTION,
    AttentionHooks,
    attention_blocks,
    chain_product,
    differentiable_attention,
)

#: the layout's public names (trak_core.projection.layout) are importable from here too
__all__ = [
    "FactoredProjector",
    "Block",
    "FLAT",
    "HOOKED",
    "LAYOUT_VERSION",
    "Layout",
    "MATRIX",
    "OTHER",
    "SIDE_DENSE",
    "SIDE_IN",
    "SIDE_OUT",
    "clear_factor_cache",
    "coordinate_counts",
    "coordinate_weights",
    "factor_key",
    "factor_matrix",
    "flat_layout",
    "model_layout",
    "name_hash",
    "record_kwargs",
]


def record_kwargs(params: dict) -> dict:
    """The :meth:`FactoredProjector.from_model` keywords that rebuild the projector recorded by ``params`` (a
    factored spec less its base fields, as a store's ``projector_params`` holds it): ``split``, ``energies``,
    ``layout_version``. A record of another layout version is refused (BadInputError)."""
    version = params.get("layout_version")
    if version == 4:
        return {"split": "layer", "layout_version": 4}
    if version != LAYOUT_VERSION:
        raise BadInputError(
            f"factored projection: the record has layout_version={version!r}; this version rebuilds versions 4 "
            f"and {LAYOUT_VERSION} only (featurize into a new store)"
        )
    return {"split": params.get("split", "layer"), "energies": params.get("energies"), "layout_version": version}


# ---------------------------------------------------------------------------- the projector
class FactoredProjector(AbstractProjector):
    """Kronecker-structured per-layer projection (kind ``"factored"``); see the module docstring.

    ``layout`` comes from :meth:`from_model`; without it the projector is the generic ``"__flat__"``
    Kronecker projection of the whole vector.
    """

    kind = "factored"

    def __init__(
        self,
        grad_dim: int,
        proj_dim: int,
        seed: int = 0,
        proj_type: str | ProjectionType = ProjectionType.rademacher,
        device="cpu",
        layout: Layout | None = None,
        dtype: torch.dtype = torch.float32,
        model_id: int = 0,
        *args,
        split: str = "layer",
        energies: dict | None = None,
        layout_version: int = LAYOUT_VERSION,
        **kwargs,
    ) -> None:
        check_dims(grad_dim, proj_dim)
        super().__init__(grad_dim, proj_dim, seed, as_proj_type(proj_type), device)
        if layout_version not in (4, LAYOUT_VERSION) or (layout_version == 4 and split != "layer"):
            raise BadInputError(
                f"factored projection: layout_version={layout_version!r} with split={split!r}: this version builds "
                f"layout version {LAYOUT_VERSION} (any split) and reads version 4 (split='layer')"
            )
        if layout is None:
            layout = flat_layout(grad_dim, proj_dim)
        if layout.grad_dim != grad_dim:
            raise BadInputError(f"factored layout has {layout.grad_dim} gradient coordinates but grad_dim={grad_dim}")
        if sum(b.k for b in layout.blocks) != proj_dim:
            raise BadInputError(
                f"factored layout splits {sum(b.k for b in layout.blocks)} dimensions, not proj_dim={proj_dim}"
            )
        self.layout = layout
        self.split = split
        self.energies = None if energies is None else {k: float(v) for k, v in energies.items()}
        self.layout_version = layout_version
        self.dtype = dtype
        self.model_id = model_id
        self._offsets = layout.offsets()
        self._factors: tuple[int, dict] | None = None
        self._side_override: Callable[[int], dict] | None = None
        self._verified: set[int] = set()  # id() of the models whose hooked weights have no other use (checked)
        self._substitute: set[str] = set()  # hooked blocks found used outside their forward: weight substitution

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        proj_dim: int,
        seed: int = 0,
        proj_type: str | ProjectionType = ProjectionType.rademacher,
        device="cpu",
        grad_wrt: Iterable[str] | None = None,
        other: str = "dense",
        split: str | None = None,
        energies: dict | None = None,
        **kwargs,
    ) -> FactoredProjector:
        """The per-layer projector of ``model`` (see the module docstring). ``split``: how proj_dim is shared
        between blocks (:data:`~trak_core.projection.layout.SPLITS`); None: ``"energy"`` when ``energies`` are given
        ({parameter name: mean per-example ‖∂f/∂θ‖²}, :func:`trak_core.projection.energy.sketched_energies`), else
        ``"layer"``. ``layout_version=4`` (with ``split="layer"``) rebuilds a version-4 store's projector."""
        check_dims(proj_dim, proj_dim)
        if split is None:
            split = "layer" if energies is None else "energy"
        layout = model_layout(model, proj_dim, grad_wrt, other, split, energies)
        return cls(
            layout.grad_dim, proj_dim, seed, proj_type, device, layout=layout, split=split, energies=energies, **kwargs
        )

    @property
    def blocks(self) -> tuple:
        return self.layout.blocks

    def spec(self) -> dict:
        """The base spec, ``layout_version``, the split (version 5: ``split``, and ``energies`` for the energy split:
        what rebuilds the same layout from the model alone, :func:`record_kwargs`) and the block table."""
        if self.layout_version == 4:  # exactly what version 4 recorded
            return {**super().spec(), "layout_version": 4, "layout": self.layout.describe()}
        split: dict = {"split": self.split}
        if self.energies is not None:
            split["energies"] = dict(self.energies)
        return {**super().spec(), "layout_version": self.layout_version, **split, "layout": self.layout.describe()}

    def free_memory(self) -> None:
        self._factors = None

    @property
    def side_override(self) -> Callable[[int], dict] | None:
        """None, or a callable model_id → {block name: (P_in, P_out)} whose side matrices replace those blocks'
        random ones (and their coordinate weights by 1) in :meth:`factors`, hence in :meth:`project` and the fast
        path alike: ``curvature="kfac-eigen"``'s eigenbases (:func:`trak_core.solve.kfac.bind_eigen`). P_in is
        (d_in [+1]) × (k for pairs, else k_in), P_out d_out × (k, else k_out); any float dtype (cast to the
        projector's). Setting it drops the matrices cached here; errors it raises reach the caller."""
        return self._side_override

    @side_override.setter
    def side_override(self, fn: Callable[[int], dict] | None) -> None:
        self._side_override = fn
        self._factors = None

    # ------------------------------------------------------------------ matrices
    def factors(self, model_id: int) -> dict:
        """{block name: (P_in, P_out, weight)} for ``model_id`` (P_out is None for dense blocks; an identity side
        is torch.eye; weight: a float, or a (k,) tensor per kept coordinate with one identity side); cached here
        and in the process's factor cache (:func:`factor_matrix`)."""
        if self._factors is not None and self._factors[0] == model_id:
            return self._factors[1]
        out: dict[str, tuple[Tensor, Tensor | None, float | Tensor]] = {}
        dev = torch.device(self.device)
        over = self._overridden_sides(model_id)
        for b in self.layout.blocks:
            if b.name in over:
                p_in, p_out = over[b.name]
                out[b.name] = (p_in.to(self.device, self.dtype), p_out.to(self.device, self.dtype), 1.0)
                continue
            if b.kind == "other":
                p_in = factor_matrix(self.seed, model_id, b.name, SIDE_DENSE, b.size, b.k, self.proj_type, dev)
                out[b.name] = (p_in.to(self.device, self.dtype), None, math.sqrt(self.proj_dim / b.k))
                continue
            cw = coordinate_weights(b, self.proj_dim)
            w = cw.to(self.device, self.dtype) if isinstance(cw, Tensor) else cw
            if b.id_in:
                p_in = torch.eye(b.in_rows, device=dev)
            else:
                p_in = factor_matrix(self.seed, model_id, b.name, SIDE_IN, b.in_rows, b.k_in, self.proj_type, dev)
            if b.id_out:
                p_out = torch.eye(b.d_out, device=dev)
            else:
                p_out = factor_matrix(self.seed, model_id, b.name, SIDE_OUT, b.d_out, b.k_out, self.proj_type, dev)
            out[b.name] = (p_in.to(self.device, self.dtype), p_out.to(self.device, self.dtype), w)
        self._factors = (model_id, out)
        return out

    def _overridden_sides(self, model_id: int) -> dict[str, tuple[Tensor, Tensor]]:
        """{block name: (P_in, P_out)} of :attr:`side_override` for ``model_id`` as tensors, their shapes checked."""
        if self._side_override is None:
            return {}
        by_name = {b.name: b for b in self.layout.blocks}
        out = {}
        for name, (p_in, p_out) in self._side_override(model_id).items():
            b = by_name.get(name)
            if b is None or b.kind in ("other", "flat"):
                raise BadInputError(f"factored projector: side_override names {name!r}, not a factored block")
            p_in, p_out = torch.as_tensor(p_in), torch.as_tensor(p_out)
            want_in = (b.in_rows, b.k if b.pairs else b.k_in)
            want_out = (b.d_out, b.k if b.pairs else b.k_out)
            if tuple(p_in.shape) != want_in or tuple(p_out.shape) != want_out:
                raise BadInputError(
                    f"factored projector: side_override of {name!r} has P_in {tuple(p_in.shape)} and P_out "
                    f"{tuple(p_out.shape)}; its block needs {want_in} and {want_out}"
                )
            out[name] = (p_in, p_out)
        return out

    def matrix(self, model_id: int) -> Tensor:
        """The explicit grad_dim × proj_dim matrix (tiny sizes and tests only)."""
        eye = torch.eye(self.grad_dim, dtype=self.dtype)
        return self.project(eye, model_id)

    # ------------------------------------------------------------------ projection of materialized gradients
    def _pieces(self, grads) -> dict:
        """{param name: (B, *shape)} in the layout's names."""
        names = [n for n, _ in self.layout.param_shapes]
        if isinstance(grads, dict) and set(grads) == set(names):
            return grads
        flat = vectorize(grads)  # unknown names: the dict's order is the vector's order (documented)
        return {n: flat[:, o : o + math.prod(s)] for n, (o, s) in self._offsets.items()}

    def project(self, grads, model_id: int) -> Tensor:
        self._check_input(grads)
        pieces = self._pieces(grads)
        batch = next(iter(pieces.values())).shape[0]
        facs = self.factors(model_id)
        return torch.cat([self.project_block(b, pieces, facs[b.name], batch) for b in self.layout.blocks], dim=1)

    def project_block(self, b: Block, pieces: dict, factors: tuple, batch: int, dtype=None) -> Tensor:
        """Block ``b``'s k coordinates (batch, k) of the materialized gradients ``pieces`` ({param name: (batch,
        *shape)}, the block's parameters at least), with its ``factors`` (:meth:`factors`' entry); ``dtype``: the
        arithmetic's (default: the projector's)."""
        dt = self.dtype if dtype is None else dtype
        p_in, p_out, w = factors
        if b.kind == "other":
            g = torch.cat([pieces[n].reshape(batch, -1) for n in b.params], dim=1).to(self.device, dt)
            return (g @ p_in) * w
        if b.kind == "flat":
            g = pieces[b.params[0]].reshape(batch, -1).to(self.device, dt)
            g = torch.nn.functional.pad(g, (0, b.d_out * b.d_in - g.shape[1])).reshape(batch, b.d_out, b.d_in)
            t = g @ p_in
        else:
            g = pieces[b.params[0]].reshape(batch, b.d_out, b.d_in).to(self.device, dt)
            t = g @ p_in[: b.d_in]
            if b.bias:
                t = t + pieces[b.params[1]].reshape(batch, b.d_out, 1).to(self.device, dt) * p_in[b.d_in]
        if b.pairs:  # coordinate j = p_outⱼᵀ G p_inⱼ: the diagonal of P_outᵀ G P_in
            return (t * p_out).sum(1) * w
        u = p_out.T @ t  # (B, k_out, k_in)
        return u.reshape(batch, -1)[:, : b.k] * w

    # ------------------------------------------------------------------ the fast path
    def featurize_batch(
        self,
        model: nn.Module,
        task,
        weights: dict,
        buffers: dict,
        batch: Sequence[Tensor],
        model_id: int,
        with_output: bool = False,
        tap=None,
    ) -> Tensor | tuple[Tensor, Tensor] | None:
        """Projected per-example gradients (B, proj_dim) of ``task.get_output`` without materializing them;
        with ``with_output``, (those, the outputs f (B,) of the same forward, detached).

        Returns None when the layout is not bound to a model (the caller then projects materialized
        gradients). ``weights`` holds all the model's parameters (detached), ``buffers`` its buffers. ``tap``: a
        :class:`~trak_core.solve.kfac_tap.FactorTap` that takes its layers' inputs and output gradients from the same
        forward and backward (K-FAC's factor sums), handed to it by ``tap.collect``.
        """
        if not self.layout.model_bound:
            return None
        for n, shape in self.layout.param_shapes:
            if n not in weights or tuple(weights[n].shape) != tuple(shape):
                got = None if n not in weights else tuple(weights[n].shape)
                raise BadInputError(
                    f"factored projector: its layout expects parameter {n!r} with shape {shape}, "
                    f"the model has {got}; build the projector from this model"
                )
        facs = self.factors(model_id)
        wdt = next((w.dtype for w in weights.values() if w.is_floating_point()), self.dtype)
        if wdt != self.dtype:  # e.g. a float64 model: the factors follow the model's dtype
            facs = {k: tuple(t.to(wdt) if torch.is_tensor(t) else t for t in f) for k, f in facs.items()}
        uses = matrix_uses(model, self.layout)
        hooked = [
            b for b in self.layout.blocks if (b.kind in HOOKED or b.name in uses) and b.name not in self._substitute
        ]
        subst = [b for b in self.layout.blocks if b.kind in (*HOOKED, MATRIX) and b not in hooked]
        verify = bool(hooked) and id(model) not in self._verified
        gz, go, fired, extra, out = self._grads(
            model, task, weights, buffers, batch, facs, hooked, subst, verify, wdt, uses, tap
        )
        fallback = [b.name for b in hooked if b.name not in fired or b.name in extra]
        if fallback:  # a weight used outside its module's forward: weight substitution is exact for any use
            warnings.warn(
                f"factored projector: the weights of layers {fallback[:10]} are used outside (or without) the "
                "module's forward (e.g. F.linear(x, layer.weight), a functionally tied output layer): their forward "
                "hooks would miss that use, so these blocks are projected by weight substitution (the same "
                "projection, exact for any use; per-example weights: slower)",
                stacklevel=2,
            )
            self._substitute.update(fallback)
            return self.featurize_batch(model, task, weights, buffers, batch, model_id, with_output, tap)
        if verify:
            self._verified.add(id(model))
        bsz = batch[0].shape[0]
        outs = []
        for b in self.layout.blocks:
            p_in, _, w = facs[b.name]
            if b.kind == "other":
                g = torch.cat([go[n].reshape(bsz, -1) for n in b.params], dim=1).to(wdt)
                outs.append((g @ p_in) * w)
            else:
                outs.append(gz[b.name].reshape(bsz, -1)[:, : b.k] * w)
        x = torch.cat(outs, dim=1)
        return (x, out) if with_output else x

    def _grads(
        self,
        model: nn.Module,
        task,
        weights: dict,
        buffers: dict,
        batch: Sequence[Tensor],
        facs: dict,
        hooked: list,
        subst: list,
        verify: bool,
        wdt: torch.dtype,
        uses: dict,
        tap=None,
    ) -> tuple[dict, dict, set, set, Tensor]:
        """(∂f_b/∂Z_b per factored block, ∂f_b/∂w per "__other__" parameter, the hooked layers whose hook
        fired, the hooked layers whose weight has a use the hook missed (checked when ``verify``), the outputs f_b
        (B,), detached).

        The check: the hooked weights get W + s·R (s a zero scalar shared by the batch, R = P_out D P_inᵀ for
        a fixed ±1 matrix D); ∂(Σ_b f_b)/∂s = ⟨∂F/∂W over all uses, R⟩ while Σ_b ⟨D, ∂f_b/∂Z_b⟩ = ⟨∂F/∂W
        through the module's forward, R⟩: they differ when the weight has another use. Costs one batch-summed
        weight gradient of those layers, once per model and projector. ``tap``: see :meth:`featurize_batch`."""
        tapped = {} if tap is None else tap.shapes(model, task, weights, buffers, batch)  # its probes' shapes
        other = next((b for b in self.layout.blocks if b.kind == "other"), None)
        other_names = list(other.params) if other is not None else []
        substituted = {n for b in subst for n in b.params}
        ctx: dict = {"z": None, "fired": set()}
        signs: dict[str, Tensor] = {}
        probes: list = []
        if verify:
            gen = torch.Generator().manual_seed(0)
            for b in hooked:
                p_in, p_out, _ = facs[b.name]
                shape = (b.k,) if b.pairs else (b.k_out, b.k_in)  # pairs: D = diag(d)
                d = (2 * torch.randint(0, 2, shape, generator=gen) - 1).to(p_in.device, wdt)
                r = ((p_out * d) if b.pairs else (p_out @ d)) @ p_in.T
                signs[b.name] = d
                probes.append((b, r[:, : b.d_in].reshape(weights[b.params[0]].shape), r[:, b.d_in] if b.bias else None))
        handles = []
        inside: list = []  # (block, hook) of embedding subclasses: EmbeddingHooks below
        try:
            for b in hooked:
                for mname, use, with_bias in uses.get(b.name, ((b.name, b.kind, b.bias),)):
                    if use == ATTENTION:  # applied inside the attention function: AttentionHooks below
                        continue
                    hook = _make_hook(b, facs[b.name], ctx, use, with_bias)
                    if use == EMBEDDING and looks_up_inside(model.get_submodule(mname)):
                        inside.append((b, hook))
                        continue
                    handles.append(model.get_submodule(mname).register_forward_hook(hook))
            per_example = substituted | set(other_names)
            for mname, mod in model.named_modules():
                if (
                    isinstance(mod, nn.Embedding)
                    and mod.padding_idx is not None
                    and (f"{mname}." if mname else "") + "weight" in per_example
                ):
                    handles.append(mod.register_forward_hook(_padding_hook))
            handles += [] if tap is None else tap.hooks(model)
            fixed = {n: w for n, w in weights.items() if n not in set(other_names) and n not in substituted}
            subs = [
                (b, weights[b.params[0]], weights[b.params[1]] if b.bias else None, *facs[b.name][:2]) for b in subst
            ]
            attn = attention_blocks(hooked, uses)
            mode: AttentionHooks | _Both | None = (
                AttentionHooks([(b, facs[b.name]) for b in attn], ctx) if attn else None
            )
            if inside:
                mode = _Both(mode, EmbeddingHooks(inside))

            def out_fn(zs, other_w, shared, es, *sample):
                ctx["z"] = zs
                taken = {} if tap is None else tap.bind(es)  # filled by the tap's hooks: each layer's input
                w = {**fixed, **other_w}
                for b, wt, bias, p_in, p_out in subs:  # W + P_out Z P_inᵀ (and b + P_out Z p_in,last)
                    z = zs[b.name]
                    delta = ((p_out * z) if b.pairs else (p_out @ z)) @ p_in.T
                    w[b.params[0]] = wt + delta[:, : b.d_in].reshape(wt.shape)
                    if bias is not None:
                        w[b.params[1]] = bias + delta[:, b.d_in]
                for b, r_w, r_b in probes:  # W + s·R, the same value (s = 0)
                    w[b.params[0]] = fixed[b.params[0]] + shared[b.name] * r_w
                    if r_b is not None:
                        w[b.params[1]] = fixed[b.params[1]] + shared[b.name] * r_b
                if mode is None:
                    return task.get_output(model, w, buffers, *sample), taken
                mode.bind(w)
                with mode:
                    return task.get_output(model, w, buffers, *sample), taken

            shared = {b.name: torch.zeros((), device=self.device, dtype=wdt) for b, _, _ in probes}
            gz, go, gs, out, taken = _per_example_grads(
                out_fn, hooked + subst, {n: weights[n] for n in other_names}, shared, batch, self.device, wdt, tapped
            )
            if tap is not None:
                tap.collect(*taken)
        finally:
            for h in handles:
                h.remove()
        extra = set()
        sums = {n: (float(gs[n]), float((gz[n] * d).sum()), float((gz[n] * d).abs().sum())) for n, d in signs.items()}
        ref = max((abs(t) + a for t, _, a in sums.values()), default=0.0)
        # rounding: relative to the terms (at least the model dtype's: bfloat16's 2⁻⁷) and the largest block
        rel = max(1e-4, torch.finfo(wdt).eps)
        for name, (total, hooks, terms) in sums.items():
            if abs(total - hooks) > 1e-3 * max(abs(total), abs(hooks)) + rel * terms + 1e-6 * ref:
                extra.add(name)
        return gz, go, ctx["fired"], extra, out


def _per_example_grads(
    out_fn, blocks: list, other_w: dict, shared: dict, batch: Sequence[Tensor], device, dtype, probes: dict
) -> tuple[dict, dict, dict, Tensor, tuple[dict, dict]]:
    """(∂f_b/∂Z_b per factored block, ∂f_b/∂w per "__other__" parameter w), each (B, ...), for every example b,
    ∂(Σ_b f_b)/∂s for the ``shared`` scalars s (one value for the whole batch), the outputs f_b (B,), detached, and
    (what ``out_fn`` returned beside f_b, stacked; ∂f_b/∂e_b for the zero ``probes`` e_b, {name: shape per example}).

    Without ``torch.func.grad``: vmap runs the forward of each example with its own zero Z_b and its own
    copy of the other parameters (broadcast views of one tensor, so vmap's per-example semantics hold: no
    example sees another's), then ONE reverse pass of Σ_b f_b gives all per-example gradients at once,
    since f_b depends on example b's Z_b and weights only. The same numbers as ``vmap(grad(f))`` up to
    rounding, without the double-backward bookkeeping of ``grad`` inside ``vmap`` and without
    ``torch.func.grad``'s first-use cost (it imports torch._dynamo: about a second per process)."""
    bsz = batch[0].shape[0]
    with differentiable_attention():
        return _per_example_grads_impl(out_fn, blocks, other_w, shared, batch, device, dtype, bsz, probes)


def _per_example_grads_impl(
    out_fn, blocks, other_w, shared, batch, device, dtype, bsz, probes
) -> tuple[dict, dict, dict, Tensor, tuple[dict, dict]]:
    with torch.enable_grad():
        zl = {
            b.name: torch.zeros(
                *((b.k,) if b.pairs else (b.k_out, b.k_in)), device=device, dtype=dtype, requires_grad=True
            )
            for b in blocks
        }
        wl = {n: w.detach().requires_grad_(True) for n, w in other_w.items()}
        sl = {n: s.detach().requires_grad_(True) for n, s in shared.items()}
        zb = {n: z.expand(bsz, *z.shape) for n, z in zl.items()}
        wb = {n: w.expand(bsz, *w.shape) for n, w in wl.items()}
        el = {n: torch.zeros(bsz, *s, device=device, dtype=dtype, requires_grad=True) for n, s in probes.items()}
        out, aux = torch.func.vmap(out_fn, in_dims=(0, 0, None, 0, *([0] * len(batch))), randomness="different")(
            zb, wb, sl, el, *batch
        )
        inputs = [*zb.values(), *wb.values(), *sl.values(), *el.values()]
        grads = (
            torch.autograd.grad(out.sum(), inputs, allow_unused=True) if out.requires_grad else [None] * len(inputs)
        )  # nothing differentiable was used: the caller reports the layers
    leaves = [*zl.values(), *wl.values()]
    full = [
        torch.zeros(bsz, *leaf.shape, device=leaf.device, dtype=leaf.dtype) if g is None else g
        for g, leaf in zip(grads[: len(leaves)], leaves, strict=True)
    ]
    gs_, es_ = grads[len(leaves) : len(leaves) + len(sl)], grads[len(leaves) + len(sl) :]
    gs = {n: torch.zeros((), dtype=dtype) if g is None else g for n, g in zip(sl, gs_, strict=True)}
    zs, ws = dict(zip(zl, full[: len(zl)], strict=True)), dict(zip(wl, full[len(zl) :], strict=True))
    es = dict(zip(el, es_, strict=True))
    return zs, ws, gs, out.detach().reshape(bsz), (aux, es)


class _Both:
    """Two modes bound and entered together (the attention one, if any, outermost)."""

    def __init__(self, *modes) -> None:
        self.modes = [m for m in modes if m is not None]

    def bind(self, weights: dict) -> None:
        for m in self.modes:
            m.bind(weights)

    def __enter__(self):
        for m in self.modes:
            m.__enter__()
        return self

    def __exit__(self, *exc):
        for m in reversed(self.modes):
            m.__exit__(*exc)
        return False


def _padding_hook(mod, inputs, output):
    """No gradient from padding tokens to an embedding table given per example (matrix or "__other__" block):
    vmap's rule for ``embedding`` with a batched table ignores ``padding_idx`` (torch 2.x), so the padded
    positions' outputs are detached here — the same numbers, torch's gradient semantics."""
    pad = (inputs[0] == mod.padding_idx).unsqueeze(-1)
    return torch.where(pad, output.detach(), output)


def _make_hook(b: Block, factors, ctx: dict, use: str, with_bias: bool):
    """The forward hook of a linear / conv / embedding block, or of one module using a matrix block's weight
    (``use``: its kind, or "conv1d"; ``with_bias``: the module's bias is the block's): output + P_out Z P_inᵀ [a; 1]
    per position (conv1d, whose weight is the block's view in × out: output + aᵀ P_out Z P_inᵀ [+ P_out Z p_in,last]).

    The layer's input is detached: ∂(P_out Z P_inᵀ a)/∂a = P_out Z P_inᵀ is zero at Z = 0, so no gradient
    flows back through the added term but the one to Z (exact, and no backward pass through P_in). With u = P_inᵀ a,
    the product is grouped as u (P_out Z)ᵀ (d_out·k_in multiply-adds per position, plus d_out·k_out·k_in per
    example: Z is the example's own) or as (u Zᵀ) P_outᵀ (k_in·k_out + k_out·d_out per position), whichever is
    fewer (:func:`~trak_core.projection.mha.chain_product`): the first for many positions, the second for an MLP's
    one (embeddings: P_out[ids] Z P_inᵀ, likewise)."""
    p_in, p_out, _ = factors
    p_w = p_in[: b.d_in]
    p_b = p_in[b.d_in] if b.bias and with_bias else None

    if use == "conv1d":

        def conv1d_hook(mod, inputs, output):
            ctx["fired"].add(b.name)
            z = ctx["z"][b.name]
            a = inputs[0].detach()  # (…, d_in of the module = the block's d_out)
            if b.pairs:
                m = p_out * z
                v = (a @ m) @ p_w.T
                return output + (v if p_b is None else v + m @ p_b)
            v = chain_product(a, p_out, z) @ p_w.T
            return output + (v if p_b is None else v + p_out @ (z @ p_b))

        return conv1d_hook

    if use == "linear":

        def hook(mod, inputs, output):
            ctx["fired"].add(b.name)
            z = ctx["z"][b.name]
            u = inputs[0].detach() @ p_w
            if p_b is not None:
                u = u + p_b
            if b.pairs:  # Z = diag(z): ∂f/∂zⱼ = Σₜ (p_outⱼᵀ gₜ)(p_inⱼᵀ [aₜ; 1])
                return output + (u * z) @ p_out.T
            return output + chain_product(u, z.T, p_out.T)

        return hook

    if use == "embedding":

        def emb_hook(mod, inputs, output):
            ctx["fired"].add(b.name)
            z = ctx["z"][b.name]
            ids = inputs[0]
            rows = torch.nn.functional.embedding(ids, p_out)  # P_out[ids]: (*ids, k_out)
            if mod.padding_idx is not None:  # torch gives the padding row no gradient
                rows = rows * (ids != mod.padding_idx).unsqueeze(-1).to(rows.dtype)
            if b.pairs:  # Z = diag(z)
                return output + (rows * z) @ p_w.T
            return output + chain_product(rows, z, p_w.T)

        return emb_hook

    def conv_hook(mod, inputs, output):
        ctx["fired"].add(b.name)
        z = ctx["z"][b.name]
        kernel = p_w.T.reshape(b.k_in, *mod.weight.shape[1:])
        u = mod._conv_forward(inputs[0].detach(), kernel, None)  # (n, k_in, *spatial): the module's padding/stride
        unbatched = u.dim() == mod.weight.dim() - 1  # a conv also takes (C, *spatial)
        if unbatched:
            u = u.unsqueeze(0)
        shape = u.shape
        u = u.flatten(2)
        if p_b is not None:
            u = u + p_b.unsqueeze(-1)
        if b.pairs:
            v = (p_out * z) @ u
        else:  # (P_out Z) u, or P_out (Z u) where fewer multiply-adds (few positions)
            v = chain_product(u.transpose(-1, -2), z.T, p_out.T).transpose(-1, -2)
        v = v.reshape(shape[0], b.d_out, *shape[2:])
        return output + (v.squeeze(0) if unbatched else v)

    return conv_hook
