"""Factored (Kronecker-structured, LoGra-style) projection of per-layer gradients, and the fast path that
never materializes per-example gradients.

The projection
--------------
The gradient is cut into *blocks*, one per supported layer (``nn.Linear``, ``nn.Conv1d/2d/3d`` with
``groups=1``), in the order of the gradient vector's parameters. For a layer with weight W (d_out × d_in;
conv weights viewed as C_out × C_in·∏kernel, the ``unfold`` order) and optional bias b, the block's
gradient is the augmented matrix G = [∂W | ∂b] (d_out × (d_in + 1)): the bias is one more input
coordinate that is constantly 1. The block is projected to

    vec(P_outᵀ G P_in)[:k] · √(proj_dim / k)

with P_in ((d_in [+1]) × k_in) and P_out (d_out × k_out) random (±1 or N(0, 1)), k_in · k_out ≥ k, and
the first k entries of the row-major (k_out, k_in) result kept. Each kept entry is a column p ⊗ q of
P_out ⊗ P_in with E[(p⊗q)(p⊗q)ᵀ] = I, so E⟨Px, Py⟩ = proj_dim · ⟨x, y⟩ over the whole gradient
(``scale`` = proj_dim, as the dense kinds) whatever the split.

For one example and one position, ∂W = g aᵀ (g the output gradient, a the input), so the block is
(P_outᵀ g) ⊗ (P_inᵀ [a; 1]) — the per-example weight gradient is never needed; for sequences and
convolutions (positions t) it is Σ_t (P_outᵀ g_t) ⊗ (P_inᵀ [a_t; 1]).

Parameters outside supported layers (norms, embeddings, grouped convs, weights shared between modules,
biases whose weight is not in ``grad_wrt``) form one ``"__other__"`` block projected densely (±1 or
N(0, 1) entries, materialized per-example gradients of those parameters only) — or are refused with
``other="error"``.

The split of proj_dim
---------------------
k_b ∝ the block's number of gradient coordinates (largest-remainder rounding, at least 1 per block);
Σ k_b = proj_dim exactly. Each block is factored as k_out = min(d_out, ⌈√k_b⌉), k_in = ⌈k_b / k_out⌉
(if k_in > d_in [+1]: k_in = d_in [+1], k_out = ⌈k_b / k_in⌉) — balanced factors minimize the
distortion of rank-one gradients, whose relative error is ≈ √(2/k_in + 2/k_out) (dense: √(2/k)).

The random numbers (deterministic under the rules of :mod:`trak_core.counter_rng`)
------------------------------------------------------------------------------
Per (seed, model_id, block name, side) a 32-bit key:
``base = stream_key(seed, model_id, STREAM_FACTOR)``, ``h = FNV-1a-32(utf-8 block name)``,
``key = mix32(mix32(base ^ h) + (4·side + sub + 1)·0x9E3779B9)`` with side 0 = P_in, 1 = P_out,
2 = the dense ``"__other__"``/unstructured block, and sub 0/1 the two uniform streams of Box–Muller
(Rademacher uses sub 0 only). Entry (i, j) of a rows × cols factor then follows the dense definitions
of :mod:`trak_core.counter_rng` with that key: Rademacher bit j % 32 of word hash(i·⌈cols/32⌉ + j//32),
normal Box–Muller of hash(i·cols + j) under the two keys. Block names are module names (stable across
processes, batch sizes and machines), so the matrices are a pure function of (seed, model_id, layout).

Without a model (``FactoredProjector(grad_dim, proj_dim, ...)``) the layout is one ``"__flat__"`` block
that views the gradient vector as a d_out × d_in matrix (d_in = ⌈√grad_dim⌉, zero-padded): a generic
Kronecker JL projection for any vector, but no fast path. Build it with :meth:`FactoredProjector.from_model`
(or ``make_projector("factored", ..., model=model, grad_wrt=...)``) to get the per-layer layout and the
fast path (:meth:`FactoredProjector.featurize_batch`, used by :class:`trak_core.featurize.Featurizer`).

The fast path
-------------
``featurize_batch`` runs ``vmap(grad(f))`` of the task's model output f (per example, buffers fixed,
exactly as the gradient computer) with respect to a zero k_out × k_in matrix Z per layer: forward hooks
add ``P_out Z P_inᵀ [a; 1]`` (for convs: the conv of the input with P_in as kernel) to each layer's
output, which is zero in value, and ∂f/∂Z = P_outᵀ (∂f/∂W_aug) P_in — the projected block, computed from
the layer's input and output gradient only. Cost per example: one forward and backward plus O((d_in +
d_out)·√k) per position, instead of grad_dim · proj_dim. The weights must be used through the module's
forward (a weight also used by ``F.linear(x, layer.weight)`` elsewhere would be missed; a hook that never
fires raises an error).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from . import counter_rng
from .errors import BadInputError
from .gradients import grad_param_names, vectorize
from .projectors import AbstractProjector, ProjectionType, as_proj_type, check_dims

FLAT = "__flat__"
OTHER = "__other__"
SIDE_IN, SIDE_OUT, SIDE_DENSE = 0, 1, 2
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


# ---------------------------------------------------------------------------- random factors
def name_hash(name: str) -> int:
    """FNV-1a (32-bit) of the UTF-8 name."""
    h = 0x811C9DC5
    for byte in name.encode("utf-8"):
        h = ((h ^ byte) * 0x01000193) & counter_rng.MASK32
    return h


def factor_key(seed: int, model_id: int, name: str, side: int, sub: int = 0) -> int:
    """The 32-bit key of one factor stream (see the module docstring)."""
    base = counter_rng.stream_key(seed, model_id, counter_rng.STREAM_FACTOR)
    k = counter_rng.mix32_int(base ^ name_hash(name))
    return counter_rng.mix32_int((k + (4 * side + sub + 1) * counter_rng.GOLDEN) & counter_rng.MASK32)


def factor_matrix(
    seed: int, model_id: int, name: str, side: int, rows: int, cols: int, proj_type: str | ProjectionType, device=None
) -> Tensor:
    """rows × cols float32 factor of block ``name`` (±1 or standard normal entries), on ``device``.

    The dense matrices of :mod:`trak_core.counter_rng` under the block's keys (see the module docstring).
    """
    if as_proj_type(proj_type) == ProjectionType.rademacher:
        return counter_rng.rademacher_from_key(factor_key(seed, model_id, name, side, 0), 0, rows, cols, device=device)
    return counter_rng.normal_from_keys(
        factor_key(seed, model_id, name, side, 0),
        factor_key(seed, model_id, name, side, 1),
        0,
        rows,
        cols,
        device=device,
    )


# ---------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class Block:
    """One block of the gradient vector.

    kind: "linear" | "conv" (factored), "flat" (the vector as a d_out × d_in matrix) or "other" (dense).
    params: the parameter names in the block ((weight[, bias]) or the other parameters).
    d_out, d_in: the factored shape (d_in without the bias coordinate); for "other" d_in = size, d_out = 1.
    k, k_out, k_in: its share of proj_dim and the factor widths (k ≤ k_out · k_in).
    """

    name: str
    kind: str
    params: tuple
    d_out: int
    d_in: int
    bias: bool
    size: int
    k: int = 0
    k_out: int = 0
    k_in: int = 0

    @property
    def in_rows(self) -> int:
        return self.d_in + int(self.bias)


@dataclass(frozen=True)
class Layout:
    """Blocks and the parameter order of the gradient vector ((name, shape) in vector order)."""

    blocks: tuple
    param_shapes: tuple
    model_bound: bool

    @property
    def grad_dim(self) -> int:
        return sum(math.prod(s) for _, s in self.param_shapes)

    def offsets(self) -> dict:
        out, o = {}, 0
        for n, s in self.param_shapes:
            out[n] = (o, tuple(s))
            o += math.prod(s)
        return out

    def describe(self) -> list:
        return [[b.name, b.kind, b.d_out, b.d_in, b.bias, b.k, b.k_out, b.k_in] for b in self.blocks]


def _apportion(sizes: Sequence[int], total: int) -> list[int]:
    """Largest-remainder split of ``total`` ∝ sizes, at least 1 each (ties: lower index first)."""
    n = len(sizes)
    if total < n:
        raise BadInputError(
            f"factored projection: proj_dim={total} is smaller than the number of blocks ({n}); "
            "each layer needs at least one dimension"
        )
    s = sum(sizes)
    spare = total - n  # 1 each, the rest proportional
    raw = [spare * x / s for x in sizes]
    base = [int(math.floor(r)) for r in raw]
    left = spare - sum(base)
    order = sorted(range(n), key=lambda i: (-(raw[i] - base[i]), i))
    for i in order[:left]:
        base[i] += 1
    return [b + 1 for b in base]


def _factor(k: int, out_dim: int, in_dim: int) -> tuple[int, int]:
    k_out = min(out_dim, math.isqrt(k - 1) + 1)
    k_in = -(-k // k_out)
    if k_in > in_dim:
        k_in = in_dim
        k_out = -(-k // k_in)
    return k_out, k_in


def _with_split(blocks: list[Block], proj_dim: int) -> tuple:
    ks = _apportion([b.size for b in blocks], proj_dim)
    out = []
    for b, k in zip(blocks, ks, strict=True):
        if b.kind == "other":
            out.append(Block(**{**asdict(b), "k": k, "k_out": 1, "k_in": k}))
        else:
            ko, ki = _factor(k, b.d_out, b.in_rows)
            out.append(Block(**{**asdict(b), "k": k, "k_out": ko, "k_in": ki}))
    names = [b.name for b in out]
    hashes = {name_hash(n) for n in names}
    if len(hashes) != len(names):
        raise BadInputError(f"factored projection: two block names share a 32-bit hash ({names}); rename a module")
    return tuple(out)


def flat_layout(grad_dim: int, proj_dim: int) -> Layout:
    d_in = math.isqrt(grad_dim - 1) + 1
    d_out = -(-grad_dim // d_in)
    blocks = _with_split([Block(FLAT, "flat", ("<vector>",), d_out, d_in, False, grad_dim)], proj_dim)
    return Layout(blocks, (("<vector>", (grad_dim,)),), False)


def _supported(mod: nn.Module) -> str | None:
    if type(mod).__name__ == "NonDynamicallyQuantizableLinear":  # used by MultiheadAttention without forward
        return None
    if isinstance(mod, nn.Linear):
        return "linear"
    if isinstance(mod, _CONV) and mod.groups == 1:
        return "conv"
    return None


def model_layout(
    model: nn.Module, proj_dim: int, grad_wrt: Iterable[str] | None = None, other: str = "dense"
) -> Layout:
    """The per-layer layout of ``model``'s gradient (restricted to ``grad_wrt``), proj_dim split."""
    if other not in ("dense", "error"):
        raise BadInputError(f"other must be 'dense' or 'error', got {other!r}")
    names = grad_param_names(model, grad_wrt)
    params = dict(model.named_parameters())
    keep = set(names)
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    layer_of: dict[str, Block] = {}
    for mname, mod in model.named_modules():
        kind = _supported(mod)
        if kind is None:
            continue
        prefix = f"{mname}." if mname else ""
        wname, bname = prefix + "weight", prefix + "bias"
        if wname not in keep or params.get(wname) is not mod.weight or uses[id(mod.weight)] > 1:
            continue
        has_bias = mod.bias is not None and bname in keep and params.get(bname) is mod.bias and uses[id(mod.bias)] == 1
        w = params[wname]  # mod.weight (checked above), as the named parameter (never None)
        d_out, d_in = w.shape[0], math.prod(w.shape[1:])
        blk = Block(
            mname, kind, (wname, bname) if has_bias else (wname,), d_out, d_in, has_bias, d_out * (d_in + int(has_bias))
        )
        layer_of[wname] = blk
        if has_bias:
            layer_of[bname] = blk
    blocks: list[Block] = []
    seen: set[str] = set()
    rest: list[str] = []
    for n in names:  # blocks in the order of their first parameter in the gradient vector
        layer = layer_of.get(n)
        if layer is None:
            rest.append(n)
        elif layer.name not in seen:
            seen.add(layer.name)
            blocks.append(layer)
    if rest:
        if other == "error":
            kinds = {}
            for mname, mod in model.named_modules():
                for pn, _ in mod.named_parameters(recurse=False):
                    kinds[f"{mname}.{pn}" if mname else pn] = type(mod).__name__
            shown = [f"{n} ({kinds.get(n, '?')})" for n in rest[:10]]
            raise BadInputError(
                "factored projection supports nn.Linear and nn.Conv1d/2d/3d (groups=1) layers; these parameters "
                f"are outside them: {shown}{' ...' if len(rest) > 10 else ''}. Restrict grad_wrt, or pass "
                "other='dense' to project them densely"
            )
        size = sum(params[n].numel() for n in rest)
        blocks.append(Block(OTHER, "other", tuple(rest), 1, size, False, size))
    shapes = tuple((n, tuple(params[n].shape)) for n in names)
    return Layout(_with_split(blocks, proj_dim), shapes, True)


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
        **kwargs,
    ) -> None:
        check_dims(grad_dim, proj_dim)
        super().__init__(grad_dim, proj_dim, seed, as_proj_type(proj_type), device)
        if layout is None:
            layout = flat_layout(grad_dim, proj_dim)
        if layout.grad_dim != grad_dim:
            raise BadInputError(f"factored layout has {layout.grad_dim} gradient coordinates but grad_dim={grad_dim}")
        if sum(b.k for b in layout.blocks) != proj_dim:
            raise BadInputError(
                f"factored layout splits {sum(b.k for b in layout.blocks)} dimensions, not proj_dim={proj_dim}"
            )
        self.layout = layout
        self.dtype = dtype
        self.model_id = model_id
        self._offsets = layout.offsets()
        self._factors: tuple[int, dict] | None = None

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
        **kwargs,
    ) -> FactoredProjector:
        check_dims(proj_dim, proj_dim)
        layout = model_layout(model, proj_dim, grad_wrt, other)
        return cls(layout.grad_dim, proj_dim, seed, proj_type, device, layout=layout, **kwargs)

    @property
    def blocks(self) -> tuple:
        return self.layout.blocks

    def spec(self) -> dict:
        return {**super().spec(), "layout": self.layout.describe()}

    def free_memory(self) -> None:
        self._factors = None

    # ------------------------------------------------------------------ matrices
    def factors(self, model_id: int) -> dict:
        """{block name: (P_in, P_out, weight)} for ``model_id`` (P_out is None for dense blocks); cached."""
        if self._factors is not None and self._factors[0] == model_id:
            return self._factors[1]
        out: dict[str, tuple[Tensor, Tensor | None, float]] = {}
        for b in self.layout.blocks:
            w = math.sqrt(self.proj_dim / b.k)
            if b.kind == "other":
                p_in = factor_matrix(self.seed, model_id, b.name, SIDE_DENSE, b.size, b.k, self.proj_type)
                out[b.name] = (p_in.to(self.device, self.dtype), None, w)
            else:
                p_in = factor_matrix(self.seed, model_id, b.name, SIDE_IN, b.in_rows, b.k_in, self.proj_type)
                p_out = factor_matrix(self.seed, model_id, b.name, SIDE_OUT, b.d_out, b.k_out, self.proj_type)
                out[b.name] = (p_in.to(self.device, self.dtype), p_out.to(self.device, self.dtype), w)
        self._factors = (model_id, out)
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
        outs = []
        for b in self.layout.blocks:
            p_in, p_out, w = facs[b.name]
            if b.kind == "other":
                g = torch.cat([pieces[n].reshape(batch, -1) for n in b.params], dim=1).to(self.device, self.dtype)
                outs.append((g @ p_in) * w)
                continue
            if b.kind == "flat":
                g = pieces[b.params[0]].reshape(batch, -1).to(self.device, self.dtype)
                g = torch.nn.functional.pad(g, (0, b.d_out * b.d_in - g.shape[1])).reshape(batch, b.d_out, b.d_in)
                t = g @ p_in
            else:
                g = pieces[b.params[0]].reshape(batch, b.d_out, b.d_in).to(self.device, self.dtype)
                t = g @ p_in[: b.d_in]
                if b.bias:
                    t = t + pieces[b.params[1]].reshape(batch, b.d_out, 1).to(self.device, self.dtype) * p_in[b.d_in]
            u = p_out.T @ t  # (B, k_out, k_in)
            outs.append(u.reshape(batch, -1)[:, : b.k] * w)
        return torch.cat(outs, dim=1)

    # ------------------------------------------------------------------ the fast path
    def featurize_batch(
        self, model: nn.Module, task, weights: dict, buffers: dict, batch: Sequence[Tensor], model_id: int
    ) -> Tensor | None:
        """Projected per-example gradients (B, proj_dim) of ``task.get_output`` without materializing them.

        Returns None when the layout is not bound to a model (the caller then projects materialized
        gradients). ``weights`` holds all the model's parameters (detached), ``buffers`` its buffers.
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
        layers = [b for b in self.layout.blocks if b.kind in ("linear", "conv")]
        other = next((b for b in self.layout.blocks if b.kind == "other"), None)
        other_names = list(other.params) if other is not None else []
        ctx: dict = {"z": None, "fired": set()}
        handles = []
        try:
            for b in layers:
                mod = model.get_submodule(b.name)
                handles.append(mod.register_forward_hook(_make_hook(b, facs[b.name], ctx)))
            fixed = {n: w for n, w in weights.items() if n not in set(other_names)}

            def out_fn(zs, other_w, *sample):
                ctx["z"] = zs
                return task.get_output(model, {**fixed, **other_w}, buffers, *sample)

            gz, go = _per_example_grads(out_fn, layers, {n: weights[n] for n in other_names}, batch, self.device, wdt)
        finally:
            for h in handles:
                h.remove()
        missing = [b.name for b in layers if b.name not in ctx["fired"]]
        if missing:
            raise BadInputError(
                f"factored fast path: the forward of layers {missing[:10]} was not called by the "
                "task's model output function (weights used outside the module's forward?); "
                "use another projector or restrict grad_wrt"
            )
        bsz = batch[0].shape[0]
        outs = []
        for b in self.layout.blocks:
            p_in, _, w = facs[b.name]
            if b.kind == "other":
                g = torch.cat([go[n].reshape(bsz, -1) for n in b.params], dim=1).to(wdt)
                outs.append((g @ p_in) * w)
            else:
                outs.append(gz[b.name].reshape(bsz, -1)[:, : b.k] * w)
        return torch.cat(outs, dim=1)


def _per_example_grads(
    out_fn, layers: list, other_w: dict, batch: Sequence[Tensor], device, dtype
) -> tuple[dict, dict]:
    """(∂f_b/∂Z_b per layer, ∂f_b/∂w per "__other__" parameter w), each (B, ...), for every example b.

    Without ``torch.func.grad``: vmap runs the forward of each example with its own zero Z_b and its own
    copy of the other parameters (broadcast views of one tensor, so vmap's per-example semantics hold: no
    example sees another's), then ONE reverse pass of Σ_b f_b gives all per-example gradients at once,
    since f_b depends on example b's Z_b and weights only. The same numbers as ``vmap(grad(f))`` up to
    rounding, without the double-backward bookkeeping of ``grad`` inside ``vmap`` and without
    ``torch.func.grad``'s first-use cost (it imports torch._dynamo: about a second per process)."""
    bsz = batch[0].shape[0]
    # nn.MultiheadAttention / nn.TransformerEncoderLayer take a fused inference kernel without a derivative when
    # no argument reports requires_grad (vmap's per-example views do not): off while we differentiate
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        return _per_example_grads_impl(out_fn, layers, other_w, batch, device, dtype, bsz)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)


def _per_example_grads_impl(out_fn, layers, other_w, batch, device, dtype, bsz) -> tuple[dict, dict]:
    with torch.enable_grad():
        zl = {b.name: torch.zeros(b.k_out, b.k_in, device=device, dtype=dtype, requires_grad=True) for b in layers}
        wl = {n: w.detach().requires_grad_(True) for n, w in other_w.items()}
        zb = {n: z.expand(bsz, *z.shape) for n, z in zl.items()}
        wb = {n: w.expand(bsz, *w.shape) for n, w in wl.items()}
        out = torch.func.vmap(out_fn, in_dims=(0, 0, *([0] * len(batch))), randomness="different")(zb, wb, *batch)
        inputs = [*zb.values(), *wb.values()]
        grads = (
            torch.autograd.grad(out.sum(), inputs, allow_unused=True) if out.requires_grad else [None] * len(inputs)
        )  # nothing differentiable was used: the caller reports the layers
    leaves = [*zl.values(), *wl.values()]
    full = [
        torch.zeros(bsz, *leaf.shape, device=leaf.device, dtype=leaf.dtype) if g is None else g
        for g, leaf in zip(grads, leaves, strict=True)
    ]
    return dict(zip(zl, full[: len(zl)], strict=True)), dict(zip(wl, full[len(zl) :], strict=True))


def _make_hook(b: Block, factors, ctx: dict):
    p_in, p_out, _ = factors
    p_w = p_in[: b.d_in]
    p_b = p_in[b.d_in] if b.bias else None

    if b.kind == "linear":

        def hook(mod, inputs, output):
            ctx["fired"].add(b.name)
            z = ctx["z"][b.name]
            u = inputs[0] @ p_w
            if p_b is not None:
                u = u + p_b
            return output + (u @ z.T) @ p_out.T

        return hook

    def conv_hook(mod, inputs, output):
        ctx["fired"].add(b.name)
        z = ctx["z"][b.name]
        kernel = p_w.T.reshape(b.k_in, *mod.weight.shape[1:])
        u = mod._conv_forward(inputs[0], kernel, None)  # (n, k_in, *spatial), the module's padding/stride
        nd = u.dim() - 2
        if p_b is not None:
            u = u + p_b.reshape(b.k_in, *([1] * nd))
        v = torch.einsum("oi,ni...->no...", z, u)
        return output + torch.einsum("do,no...->nd...", p_out, v)

    return conv_hook
