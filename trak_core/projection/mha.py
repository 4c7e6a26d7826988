"""The factored projector's fast path through ``nn.MultiheadAttention``.

``nn.MultiheadAttention`` applies its in-projection (``in_proj_weight`` / ``in_proj_bias``, or ``q_proj_weight``,
``k_proj_weight``, ``v_proj_weight`` when kdim or vdim differ from embed_dim) and ``out_proj``'s weight and bias with
``linear`` calls inside ``F.multi_head_attention_forward``, never through a module's forward: forward hooks cannot
see them. During the fast path's vmapped forward, :class:`AttentionHooks` (a ``TorchFunctionMode``) catches each call
of ``F.multi_head_attention_forward`` and runs torch's own function — a copy of its code (and of the in-projection
helpers it calls) whose ``linear`` is :meth:`AttentionHooks.linear` — so masks, causal attention, dropout, bias_k /
bias_v and the attention weights all behave exactly as in torch.

That ``linear(x, w, b)`` adds, for a weight ``w`` that is a registered block's weight W or a slice of its rows
W[r0:r1] (the packed in-projection splits W into q and k, v rows when query ≠ key, or into three when key ≠ value),
the term x Δ[r0:r1]ᵀ of W + Δ, Δ = P_out Z P_inᵀ (pairs: P_out diag(z) P_inᵀ), grouped (x P_in)(P_out[r0:r1] Z)ᵀ
with x detached; for a bias that is a registered block's bias rows b[s0:s1], P_out[s0:s1] Z p_in,last. These are
weight substitution's terms without the per-example weight, so ∂f/∂Z is the same: the projected block, exactly.
A block none of whose weights reached such a call is reported as not fired (the caller then substitutes it); a use
of the weights outside these calls is found by the caller's check (W + s·R).
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

#: the use kind of a matrix block served here (see :func:`trak_core.projection.layout.matrix_uses`)
ATTENTION = "attention"
#: nn.MultiheadAttention's own weight attributes, each applied by a linear call of the attention function
_WEIGHTS = {"in_proj_weight": "in_proj_bias", "q_proj_weight": None, "k_proj_weight": None, "v_proj_weight": None}


#: the passes inside :func:`differentiable_attention` now (threads of one process), and what they changed
_DIFFERENTIABLE = {"lock": threading.Lock(), "users": 0, "fastpath": True, "sdpa": None}


@contextlib.contextmanager
def differentiable_attention():
    """Attention that vmap batches and autograd differentiates, for a pass that takes gradients of a model in eval
    mode (featurizing, a K-FAC fit): ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer``'s fused inference
    kernel, which has no derivative and is taken when no argument reports requires_grad (vmap's per-example views
    do not), off; scaled dot-product attention on its math backend: on the CPU vmap has no batching rule for the
    fused kernel (it would run example by example), on CUDA the fused kernels' backward passes fail under vmap
    (memory-efficient attention: "LSE is not correctly aligned (strideH)", H100, torch 2.11). Both are process-wide
    switches: the first pass in changes them, the last one out restores them, whatever the order threads leave in."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    st = _DIFFERENTIABLE
    with st["lock"]:
        if st["users"] == 0:
            st["fastpath"] = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)
            st["sdpa"] = sdpa_kernel(SDPBackend.MATH)
            st["sdpa"].__enter__()
        st["users"] += 1
    try:
        yield
    finally:
        with st["lock"]:
            st["users"] -= 1
            if st["users"] == 0:
                st["sdpa"].__exit__(None, None, None)
                torch.backends.mha.set_fastpath_enabled(st["fastpath"])


def attention_owners(model: nn.Module) -> dict[int, str]:
    """{id(module): how its parameters are used}: "mha" for each ``nn.MultiheadAttention``, "out_proj" for their
    ``out_proj`` (a Linear whose forward the attention never calls)."""
    out: dict[int, str] = {}
    for mod in model.modules():
        if isinstance(mod, nn.MultiheadAttention):
            out[id(mod)] = "mha"
            if isinstance(getattr(mod, "out_proj", None), nn.Linear):
                out[id(mod.out_proj)] = "out_proj"
    return out


def attention_bias(role: str, weight_attr: str) -> str | None:
    """The attribute of the bias applied with ``weight_attr`` by an owner of that ``role`` (None: none, or not a
    weight the attention function applies)."""
    if role == "out_proj":
        return "bias" if weight_attr == "weight" else None
    return _WEIGHTS.get(weight_attr)


def is_attention_weight(role: str | None, weight_attr: str) -> bool:
    """Whether an owner of ``role`` (from :func:`attention_owners`) applies its ``weight_attr`` by a linear call
    of the attention function."""
    return (role == "out_proj" and weight_attr == "weight") or (role == "mha" and weight_attr in _WEIGHTS)


def _rows(v: Tensor, w: Tensor) -> tuple[int, int] | None:
    """(r0, r1) when ``v`` is ``w`` or a view of the rows w[r0:r1] of the same memory (None otherwise)."""
    if v is w:
        return 0, w.shape[0]
    root = w if w._base is None else w._base
    if v._base is None or v._base is not root or v.dim() != w.dim() or v.dim() == 0:
        return None
    if tuple(v.shape[1:]) != tuple(w.shape[1:]) or v.stride() != w.stride() or v.dtype != w.dtype:
        return None
    step, off = w.stride(0), v.storage_offset() - w.storage_offset()
    if step <= 0 or off % step:
        return None
    r0 = off // step
    r1 = r0 + v.shape[0]
    return (r0, r1) if 0 <= r0 and r1 <= w.shape[0] else None


def _patched(linear: Callable) -> Callable | None:
    """A copy of ``F.multi_head_attention_forward`` (and of the in-projection helpers it calls) whose global
    ``linear`` is ``linear``; None if this torch has no such functions (the caller then falls back)."""
    src = vars(F)
    names = ("_in_projection_packed", "_in_projection", "multi_head_attention_forward")
    if any(not isinstance(src.get(n), types.FunctionType) for n in names) or "linear" not in src:
        return None
    g = dict(src)
    g["linear"] = linear
    for n in names:
        fn = src[n]
        copy = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
        copy.__kwdefaults__ = fn.__kwdefaults__
        g[n] = copy
    return g["multi_head_attention_forward"]


def chain_product(a: Tensor, m: Tensor, n: Tensor) -> Tensor:
    """a @ (m @ n) in the order of fewer multiply-adds: (a @ m) @ n when a has few rows (positions), as an MLP's
    example has one, else m @ n once and a times it. Inside vmap, m or n may be an example's own (its Z), so
    m @ n is made per example: for an MLP layer of 512 outputs and a 37 × 36 Z, 0.7 M multiply-adds against
    (a @ m) @ n's 20 k."""
    t = a.numel() // max(a.shape[-1], 1)  # rows of a (positions of the example)
    r, c, k = m.shape[0], m.shape[1], n.shape[1]
    if t * c * (r + k) < r * k * (c + t):
        return (a @ m) @ n
    return a @ (m @ n)


class AttentionHooks(TorchFunctionMode):
    """Adds the low-rank terms of the registered matrix blocks to the linear calls of ``F.multi_head_attention_forward``
    (see the module docstring). ``blocks``: [(block, (P_in, P_out, weight))]; ``ctx``: the fast path's context
    ({"z": {block name: Z}, "fired": set of block names}). Call :meth:`bind` with the tensors the model gets before
    each forward run under the mode."""

    def __init__(self, blocks: list, ctx: dict) -> None:
        super().__init__()
        self.blocks = blocks
        self.ctx = ctx
        self._weights: list = []
        self._biases: list = []
        self._forward = _patched(self.linear)

    def bind(self, weights: dict) -> None:
        """The tensors standing for each block's weight (and bias) in this forward, matched by identity."""
        self._weights = [(weights[b.params[0]], b, f) for b, f in self.blocks]
        self._biases = [(weights[b.params[1]], b, f) for b, f in self.blocks if b.bias]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward and self._forward is not None:
            return self._forward(*args, **kwargs)  # the mode is off in here: only our linear sees the weights
        return func(*args, **kwargs)

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """``F.linear(x, weight, bias)`` plus the terms of the registered weights and biases it applies."""
        out = F.linear(x, weight, bias)
        hit = next(((b, f, r) for w, b, f in self._weights if (r := _rows(weight, w)) is not None), None)
        bias_hit = None
        if bias is not None:
            bias_hit = next(((b, f, r) for t, b, f in self._biases if (r := _rows(bias, t)) is not None), None)
        if hit is not None:
            b, (p_in, p_out, _), (r0, r1) = hit
            self.ctx["fired"].add(b.name)
            z = self.ctx["z"][b.name]
            u = x.detach() @ p_in[: b.d_in]
            if bias_hit is not None and bias_hit[0] is b and bias_hit[2] == (r0, r1):
                u = u + p_in[b.d_in]  # the bias of the same rows: one product for both
                bias_hit = None
            rows = p_out[r0:r1]
            out = out + ((u * z) @ rows.T if b.pairs else chain_product(u, z.T, rows.T))
        if bias_hit is not None:
            b, (p_in, p_out, _), (s0, s1) = bias_hit
            z = self.ctx["z"][b.name]
            p_b = p_in[b.d_in]
            out = out + (p_out[s0:s1] @ (z * p_b) if b.pairs else p_out[s0:s1] @ (z @ p_b))
        return out


def attention_blocks(hooked: list, uses: dict) -> list:
    """The blocks of ``hooked`` that :class:`AttentionHooks` serves (a use of kind :data:`ATTENTION`)."""
    return [b for b in hooked if any(use == ATTENTION for _, use, _ in uses.get(b.name, ()))]
