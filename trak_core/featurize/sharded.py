"""Featurization of a model sharded across processes (torch FSDP2, ``torch.distributed.fsdp.fully_shard``).

A model too large for one device is wrapped with FSDP2 over N processes (one per GPU; gloo on the CPU). Each
process (rank) featurizes its own share of a shard's train rows: the model is called on the rank's examples as in
training (FSDP2 gathers each layer's parameters for its forward and backward, then frees them), and the factored
projection of each example's per-layer gradient, P_outᵀ G P_in, is read off the gradient of the output with
respect to a per-example Z added by a forward hook (output + P_out Z_b P_inᵀ [a; 1], Z_b = 0): the activations a
and output gradients of the rank's own examples are all it uses. No rank ever forms a per-example gradient, and
no per-example quantity crosses ranks but the projected rows (proj_dim floats each), gathered by rank 0, the one
writer of the store, which writes the shard (rows, flags, XᵀX partial) exactly as an unsharded task does
(:func:`trak_core.engine.featurize_shard`).

What runs under sharding: the ``"factored"`` projector with blocks of ``nn.Linear``, ``nn.Conv1d/2d/3d``,
``nn.Embedding`` and transformers' ``Conv1D`` (and weights tied between such modules); the ``"__other__"`` block
(norms, loose biases) when its parameters belong to leaf modules that are not themselves FSDP units (their
per-example gradients are taken with a vmap of that module alone, inside its forward hook). The other projectors
project materialized per-example gradients through ``torch.func.vmap`` over the whole model, which cannot run on a
sharded model: :func:`check_sharded` refuses them, and attention weights used inside ``nn.MultiheadAttention``'s
fused function, in one line before any compute. The model output is computed for the whole batch at once
(:func:`batch_output`): the built-in image classification task (any model whose ``model(x)`` gives logits), the
causal language-model task, or a task with a ``get_batch_output(model, batch) -> (f (B,), Q (B,))`` method.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from trak_core.errors import BadInputError, NonFiniteGradientError, StateError
from trak_core.featurize.featurizer import _bad_rows
from trak_core.featurize.modelout import (
    CausalLMModelOutput,
    ImageClassificationModelOutput,
    _check_labels,
    _check_token_labels,
    _forward_parameters,
    additive_mask,
    is_transformers_model,
    log_odds,
    resolve_task,
    sequence_log_prob,
)
from trak_core.projection.layout import HOOKED, MATRIX, Block, is_conv1d, matrix_uses
from trak_core.projection.mha import ATTENTION

#: the one-line refusal of a projector that needs per-example gradients
VMAP_REFUSAL = (
    "processes_per_task > 1 (a model sharded with FSDP2) needs projector 'factored': projector {kind!r} projects "
    "per-example gradients made by torch.func.vmap over the whole model, which cannot run on a sharded model; "
    "use projector: factored, or processes_per_task: 1"
)


def _fsdp_module_type():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return ()
    return FSDPModule


# ---------------------------------------------------------------------------------------------- the output
def batch_output(task, model: nn.Module, batch: Sequence[Tensor]) -> tuple[Tensor, Tensor, Callable[[], None]]:
    """(f (B,), Q (B,), the labels' check) of one batch through ``model(...)`` called once for the whole batch (FSDP2
    runs its collectives in the module's own forward; ``functional_call`` and vmap over the model cannot be used).
    A task's ``get_batch_output(model, batch)`` is used when it has one; the built-in image classification task
    (margin f = logit_y − logsumexp(other logits), Q = 1 − softmax(logits / T)_y) otherwise. The check (labels out
    of the logits' range: BadInputError) is called after the backward pass: a rank that stopped between its forward
    and its backward would leave the others waiting in FSDP2's gathers of the backward."""
    own = getattr(task, "get_batch_output", None)
    if own is not None:
        f, q = own(model, batch)
        return f.reshape(-1), q.reshape(-1).float(), lambda: None
    if isinstance(task, CausalLMModelOutput):
        return _causal_lm_output(task, model, batch)
    x, labels = batch
    logits = model(x)
    if hasattr(logits, "logits"):
        logits = logits.logits
    num_classes = logits.shape[-1]
    lab = torch.where((labels >= 0) & (labels < num_classes), labels, 0).reshape(-1, 1).long()
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, lab, True)
    f = logits.gather(1, lab).reshape(-1) - logits.masked_fill(mask, float("-inf")).logsumexp(dim=-1)
    p_y = torch.softmax(logits.detach() / task.loss_temperature, dim=-1).gather(1, lab).reshape(-1)
    return f, (1 - p_y).float(), lambda: _check_labels(labels, num_classes)


def _causal_lm_output(
    task: CausalLMModelOutput, model: nn.Module, batch: Sequence[Tensor]
) -> tuple[Tensor, Tensor, Callable[[], None]]:
    """The causal LM task's f = log(p / (1 − p)) and Q = 1 − p for the whole batch: the model called with the inputs
    :class:`~trak_core.featurize.modelout.CausalLMModelOutput` gives it (a transformers model: the 4-D causal mask,
    position ids
    over the real tokens, no cache)."""
    input_ids, attention_mask, labels = batch
    kwargs: dict = {"input_ids": input_ids, "attention_mask": attention_mask}
    if task.transformers_inputs and is_transformers_model(model):
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        kwargs["attention_mask"] = additive_mask(attention_mask, True, dtype)
        accepts = _forward_parameters(type(model))
        if "position_ids" in accepts:
            kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        if "use_cache" in accepts:
            kwargs["use_cache"] = False
    out = model(**kwargs)
    logits = out.logits if hasattr(out, "logits") else (out[0] if isinstance(out, (tuple, list)) else out)
    vocab = logits.shape[-1]
    log_p = sequence_log_prob(logits, labels)  # NaN for a row with a label out of range, which the check names
    return log_odds(log_p), (-torch.expm1(log_p.detach())).float(), lambda: _check_token_labels(labels, vocab)


def _batch_task_ok(task) -> bool:
    if callable(getattr(task, "get_batch_output", None)):
        return True
    for cls in (ImageClassificationModelOutput, CausalLMModelOutput):
        if isinstance(task, cls) and all(
            getattr(type(task), n) is getattr(cls, n) for n in ("get_output", "get_out_to_loss_grad")
        ):
            return True
    return False


# ---------------------------------------------------------------------------------------------- the checks
def check_sharded(projector, model: nn.Module, task) -> None:
    """Refuse (BadInputError, one line) before any compute what cannot be featurized on a sharded model: a
    projector other than the model-bound factored one, a factored block whose weight is used other than through
    a hooked module forward, "__other__" parameters outside leaf modules, a task without a batched output."""
    kind = getattr(projector, "kind", type(projector).__name__)
    layout = getattr(projector, "layout", None)
    if kind != "factored" or layout is None or not layout.model_bound:
        raise BadInputError(VMAP_REFUSAL.format(kind=kind))
    task = resolve_task(task)
    if not _batch_task_ok(task):
        raise BadInputError(
            f"processes_per_task > 1: task {type(task).__name__} computes its output per example under vmap; a "
            "sharded model needs the built-in image_classification (model(x) gives logits) or causal_lm task, or a "
            "task with get_batch_output(model, batch) -> (f (B,), Q (B,))"
        )
    uses = matrix_uses(model, layout)
    bad = []
    for b in layout.blocks:
        if b.kind == MATRIX and (b.name not in uses or any(u == ATTENTION for _, u, _ in uses[b.name])):
            bad.append(b.name)
        elif b.kind not in (*HOOKED, MATRIX, "other"):
            bad.append(b.name)
    if bad:
        raise BadInputError(
            f"processes_per_task > 1: the weights {bad[:5]}{' ...' if len(bad) > 5 else ''} are not used through "
            "an nn.Linear / nn.Conv / nn.Embedding / Conv1D forward (e.g. nn.MultiheadAttention's in_proj_weight, a "
            "loose nn.Parameter): their projection needs per-example weights under vmap, which a sharded model "
            "cannot run; restrict grad_wrt to the layers' weights, or use processes_per_task: 1"
        )
    _other_owners(model, layout)


def _other_owners(model: nn.Module, layout) -> dict[str, list[str]]:
    """{module name: [its parameter attributes in "__other__"]}; refuses parameters of a module with children
    or of an FSDP unit (their per-example gradients are taken by re-running that one module)."""
    other = next((b for b in layout.blocks if b.kind == "other"), None)
    if other is None:
        return {}
    wanted = set(other.params)
    out: dict[str, list[str]] = {}
    bad = []
    fsdp = _fsdp_module_type()
    for mname, mod in model.named_modules():
        for pn, _ in mod.named_parameters(recurse=False):
            full = f"{mname}.{pn}" if mname else pn
            if full not in wanted:
                continue
            if any(True for _ in mod.children()) or (fsdp and isinstance(mod, fsdp)):
                bad.append(full)
            out.setdefault(mname, []).append(pn)
    if bad:
        raise BadInputError(
            f"processes_per_task > 1: the parameters {bad[:5]} (projected densely, '__other__') belong to a module "
            "with submodules or to an FSDP unit; a sharded model takes their per-example gradients from a leaf "
            "module's forward (e.g. nn.LayerNorm) only: restrict grad_wrt, or use processes_per_task: 1"
        )
    return out


def shard_model(model: nn.Module, mesh=None) -> nn.Module:
    """``model`` wrapped with FSDP2 in place: every element of an ``nn.ModuleList`` (a transformer's blocks) as its
    own unit, then the root (the rest: embeddings, head). Each rank then holds 1/N of every parameter; a unit's
    parameters are gathered for its forward and backward only."""
    from torch.distributed.fsdp import fully_shard

    kw = {} if mesh is None else {"mesh": mesh}
    for mod in list(model.modules()):
        if isinstance(mod, nn.ModuleList):
            for unit in mod:
                if any(True for _ in unit.parameters()):
                    fully_shard(unit, **kw)
    fully_shard(model, **kw)
    return model


# ---------------------------------------------------------------------------------------------- the hooks
def _rows(t: Tensor, bsz: int, what: str) -> Tensor:
    """``t`` with the batch first: a first dimension of 1 (an input shared by the batch, broadcast later, e.g.
    position ids) is expanded to the batch, as each example's term is its own."""
    if t.shape[0] == 1 and bsz > 1:
        return t.expand(bsz, *t.shape[1:])
    if t.shape[0] != bsz:
        raise BadInputError(
            f"processes_per_task > 1: {what} got an input of shape {tuple(t.shape)}, whose first dimension is not "
            f"the batch ({bsz}); the sharded path needs batch-first layers (e.g. batch_first=True)"
        )
    return t


def _hook(b: Block, factors, ctx: dict, use: str, with_bias: bool):
    """The forward hook adding P_out Z_b P_inᵀ [a; 1] to example b's outputs at every position (Z: (B, k_out, k_in),
    or (B, k) for a block of pairs, Z = diag(z)); the layer's input is detached (the added term is zero)."""
    p_in, p_out, _ = factors
    p_w = p_in[: b.d_in]
    p_b = p_in[b.d_in] if b.bias and with_bias else None

    def grid(u: Tensor, z: Tensor) -> Tensor:  # u (B, T, k_in) → (B, T, k_out): u_t Z_bᵀ
        return (u * z.unsqueeze(1)) if b.pairs else torch.bmm(u, z.transpose(1, 2))

    def hook(mod, inputs, output):
        if ctx["inside"]:  # a module run again by another's hook (_other_hook): no term there
            return None
        ctx["fired"].add(b.name)
        z = ctx["z"][b.name]
        bsz = z.shape[0]
        if use == "conv1d":  # y = x W + b, W [in, out] = the block's d_out × d_in view
            a = _rows(inputs[0].detach(), bsz, b.name)
            a3 = a.reshape(bsz, -1, a.shape[-1])
            r = a3 @ p_out  # (B, T, k_out)
            v = ((r * z.unsqueeze(1)) if b.pairs else torch.bmm(r, z)) @ p_w.T
            if p_b is not None:
                zb = (z * p_b) if b.pairs else z @ p_b  # (B, k_out)
                v = v + (zb @ p_out.T).unsqueeze(1)
            return _plus(output, v, bsz)
        if use == "linear":
            a = _rows(inputs[0].detach(), bsz, b.name)
            u = a.reshape(bsz, -1, a.shape[-1]) @ p_w
            if p_b is not None:
                u = u + p_b
            return _plus(output, grid(u, z) @ p_out.T, bsz)
        if use == "embedding":
            ids = _rows(inputs[0], bsz, b.name).reshape(bsz, -1)
            rows = nn.functional.embedding(ids, p_out)  # (B, T, k_out)
            if mod.padding_idx is not None:
                rows = rows * (ids != mod.padding_idx).unsqueeze(-1).to(rows.dtype)
            v = (rows * z.unsqueeze(1)) if b.pairs else torch.bmm(rows, z)
            return _plus(output, v @ p_w.T, bsz)
        # conv: u = conv(a, P_inᵀ as a kernel), (B, k_in, S)
        a = _rows(inputs[0].detach(), bsz, b.name)
        kernel = p_w.T.reshape(b.k_in, *mod.weight.shape[1:])
        u = mod._conv_forward(a, kernel, None).flatten(2)
        if p_b is not None:
            u = u + p_b.unsqueeze(-1)
        v = (z.unsqueeze(-1) * u) if b.pairs else torch.bmm(z, u)  # (B, k_out, S)
        return _plus(output, p_out @ v, bsz)

    return hook


def _plus(output: Tensor, v: Tensor, bsz: int) -> Tensor:
    """``output`` + the examples' terms ``v`` (B, ...): an output shared by the batch (first dimension 1) becomes
    one per example."""
    if output.shape[0] == 1 and bsz > 1:
        output = output.expand(bsz, *output.shape[1:])
    return output + v.reshape(output.shape)


def _other_hook(mname: str, attrs: list[str], ctx: dict):
    """The forward hook of a leaf module with "__other__" parameters θ: adds g(θ + E_b, a) − g(θ, a) (zero) to
    example b's output, with E_b = 0 one per example, so that ∂f/∂E_b is example b's gradient of θ (the input a
    detached: the gradient to it flows through the output as before). The bias of an ``nn.Linear`` / ``Conv1D``
    enters additively: E_b itself is added at every position; other parameters (norms) through a vmap of this
    module alone."""

    def hook(mod, args, output):
        if ctx["inside"]:
            return None
        bsz = ctx["bsz"]
        eps = {}
        for pn in attrs:
            p = getattr(mod, pn)
            eps[pn] = torch.zeros(bsz, *p.shape, dtype=p.dtype, device=p.device, requires_grad=True)
            ctx["e"][f"{mname}.{pn}" if mname else pn] = eps[pn]
        if output.shape[0] == 1 and bsz > 1:
            output = output.expand(bsz, *output.shape[1:])
        additive = [pn for pn in attrs if pn == "bias" and (isinstance(mod, nn.Linear) or is_conv1d(mod))]
        for pn in additive:
            e = eps[pn]
            output = output + e.reshape(bsz, *([1] * (output.dim() - 2)), e.shape[-1])
        rest = [pn for pn in attrs if pn not in additive]
        if not rest:
            return output
        fixed = {pn: getattr(mod, pn).detach() for pn in rest}
        xs = [_rows(a.detach(), bsz, mname) if torch.is_tensor(a) else a for a in args]
        dims = tuple(0 if torch.is_tensor(a) else None for a in xs)

        def one(e, *x1):
            x1 = tuple(x.unsqueeze(0) if d == 0 else x for x, d in zip(x1, dims, strict=True))
            moved = torch.func.functional_call(mod, {pn: fixed[pn] + e[pn] for pn in rest}, x1)
            still = torch.func.functional_call(mod, fixed, x1)
            return (moved - still).squeeze(0)

        ctx["inside"] = True
        try:
            delta = torch.func.vmap(one, in_dims=(0, *dims))({pn: eps[pn] for pn in rest}, *xs)
        finally:
            ctx["inside"] = False
        return output + delta.reshape(output.shape)

    return hook


# ---------------------------------------------------------------------------------------------- the batch
def project_batch(projector, model: nn.Module, task, batch: Sequence[Tensor], model_id: int) -> tuple[Tensor, Tensor]:
    """(X (B, proj_dim), unscaled, as the factored fast path gives it; Q (B,)) of one batch of this rank's
    examples, by one forward and one backward of the (sharded) model. :func:`check_sharded` first."""
    layout = projector.layout
    facs = projector.factors(model_id)
    wdt = next((p.dtype for p in model.parameters() if p.is_floating_point()), projector.dtype)
    if wdt != projector.dtype:
        facs = {k: tuple(t.to(wdt) if torch.is_tensor(t) else t for t in f) for k, f in facs.items()}
    uses = matrix_uses(model, layout)
    owners = _other_owners(model, layout)
    bsz = batch[0].shape[0]
    dev = torch.device(projector.device)
    ctx: dict = {"z": {}, "fired": set(), "e": {}, "inside": False, "bsz": bsz}
    hooked = [b for b in layout.blocks if b.kind != "other"]
    handles = []
    with torch.enable_grad():
        ctx["z"] = {
            b.name: torch.zeros(
                bsz, *((b.k,) if b.pairs else (b.k_out, b.k_in)), device=dev, dtype=wdt, requires_grad=True
            )
            for b in hooked
        }
        try:
            for b in hooked:
                for mname, use, with_bias in uses.get(b.name, ((b.name, b.kind, b.bias),)):
                    handles.append(
                        model.get_submodule(mname).register_forward_hook(_hook(b, facs[b.name], ctx, use, with_bias))
                    )
            for mname, attrs in owners.items():
                handles.append(model.get_submodule(mname).register_forward_hook(_other_hook(mname, attrs, ctx)))
            f, q, check_labels = batch_output(task, model, batch)
            missed = [b.name for b in hooked if b.name not in ctx["fired"]]
            if missed:
                raise BadInputError(
                    f"processes_per_task > 1: the layers {missed[:5]} were not called by the model's forward; "
                    "restrict grad_wrt to the layers the model uses"
                )
            other = next((b for b in layout.blocks if b.kind == "other"), None)
            other_names = list(other.params) if other is not None else []
            inputs = [ctx["z"][b.name] for b in hooked] + [ctx["e"][n] for n in other_names if n in ctx["e"]]
            grads = torch.autograd.grad(f.sum(), inputs, allow_unused=True) if f.requires_grad else [None] * len(inputs)
            check_labels()  # after the backward, which every rank runs
        finally:
            for h in handles:
                h.remove()
    got = dict(zip([b.name for b in hooked] + [n for n in other_names if n in ctx["e"]], grads, strict=True))
    outs = []
    for b in layout.blocks:
        p_in, _, w = facs[b.name]
        if b.kind == "other":
            gs = []
            for n in b.params:
                g = got.get(n)
                shape = dict(layout.param_shapes)[n]
                gs.append(
                    torch.zeros(bsz, math.prod(shape), device=dev, dtype=wdt) if g is None else g.reshape(bsz, -1)
                )
            outs.append((torch.cat(gs, dim=1).to(wdt) @ p_in) * w)
        else:
            g = got[b.name]
            if g is None:
                g = torch.zeros_like(ctx["z"][b.name])
            outs.append(g.reshape(bsz, -1)[:, : b.k] * w)
    return torch.cat(outs, dim=1), q.detach()


class ShardedFeaturizer:
    """The featurizer of one rank: (X (B, p) float32 scaled by 1/√grad_dim as :class:`~trak_core.featurize.featurizer.
    Featurizer`, Q (B,)) of this rank's examples. ``model``: wrapped with FSDP2 (or a plain model: one rank)."""

    def __init__(self, model: nn.Module, task, projector, device="cpu") -> None:
        self.model = model
        self.task = resolve_task(task)
        self.projector = projector
        self.device = device
        check_sharded(projector, model, self.task)
        self.normalize_factor = math.sqrt(projector.grad_dim)

    def featurize(
        self, batch: Sequence[Tensor], model_id: int, indices: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        self.task.validate_batch(batch)
        batch = [t.to(self.device) for t in batch]
        indices = [int(i) for i in indices]
        x, q = project_batch(self.projector, self.model, self.task, batch, model_id)
        bad = [] if bool(torch.isfinite(q).all()) else (~torch.isfinite(q)).nonzero().reshape(-1).tolist()
        if bad:
            raise NonFiniteGradientError(model_id, [indices[i] for i in bad], what="model outputs")
        x = x.float() / self.normalize_factor
        bad = _bad_rows(x)
        if bad:
            raise NonFiniteGradientError(model_id, [indices[i] for i in bad], what="projected gradients")
        return x.cpu().numpy(), q.float().cpu().numpy()


class _Gathered:
    """A featurizer of rows already computed (rank 0's rows of every rank), for the engine's shard writer."""

    def __init__(self, start: int, x: np.ndarray, q: np.ndarray, device) -> None:
        self.start, self.x, self.q, self.device = start, x, q, device

    def featurize(self, batch, model_id: int, indices) -> tuple[np.ndarray, np.ndarray]:
        a, b = indices[0] - self.start, indices[-1] + 1 - self.start
        if a < 0 or b > len(self.x):
            raise StateError(f"rows {indices[0]}..{indices[-1]} were not featurized by the ranks")
        return self.x[a:b], self.q[a:b]


# ---------------------------------------------------------------------------------------------- one shard
def featurize_shard(
    store,
    model_id: int,
    shard: int,
    featurizer: Callable[[], ShardedFeaturizer],
    batch: Callable[[int, int], list],
    batch_size: int,
    device=None,
    group=None,
) -> bool:
    """One shard featurized by every rank of ``group`` (call it on every rank, with the same arguments): rank r
    takes rows [s + r·batch_size, s + (r+1)·batch_size) of each step of world·batch_size rows (every rank runs
    as many forwards: a rank without rows in the last step runs one row again and drops it, as FSDP2's
    collectives need all ranks), the projected rows are gathered by rank 0, which writes them with
    :func:`trak_core.engine.featurize_shard` (rows, flags, then the XᵀX partial, marked after). ``store``: rank 0's
    (None on the others). Returns True when the store held the shard already (on every rank)."""
    from trak_core import engine
    from trak_core.store import model_array

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    plan: list = [None]
    if rank == 0:
        a, b = store.meta.shard_range(shard)
        done = store.read_rows(model_array(model_id, "featurized"), slice(a, b)).astype(bool)
        if done.all():
            plan[0] = ("done", a, b)
        elif store.is_finalized(model_id):
            plan[0] = ("finalized", a, b)
        else:
            plan[0] = ("todo", a + engine._featurized_prefix(done), b)
    dist.broadcast_object_list(plan, src=0, group=group)
    state, start, stop = plan[0]
    if state == "done" or state == "finalized":  # rank 0 completes a missing partial, or raises StateError
        if rank == 0:
            unused: Any = None  # (the featurizer of a complete shard is never built)
            return engine.featurize_shard(store, model_id, shard, unused, batch, batch_size, device)
        if state == "finalized":
            raise StateError(f"model_id={model_id} is already finalized")
        return True
    feat = featurizer()
    xs: list[np.ndarray] = []
    qs: list[np.ndarray] = []
    err: list = [None]
    for s in range(start, stop, world * batch_size):
        lo = min(s + rank * batch_size, stop)
        hi = min(lo + batch_size, stop)
        rows = range(lo, hi) if hi > lo else range(start, start + 1)  # a spare forward for the collectives
        x: np.ndarray | None = None
        try:
            x, q = feat.featurize(batch(rows.start, rows.stop), model_id, rows)
        except (BadInputError, NonFiniteGradientError) as e:
            err[0] = e
        if hi > lo and x is not None:
            xs.append(x)
            qs.append(q)
        flags = [err[0] is not None]
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, flags, group=group)
        if any(f[0] for f in everyone):
            if err[0] is not None:
                if isinstance(err[0], BadInputError) and not isinstance(err[0], NonFiniteGradientError):
                    raise BadInputError(
                        f"train_data rows {rows.start}..{rows.stop - 1} (model_id={model_id}): {err[0]}"
                    )
                raise err[0]
            raise StateError("another rank stopped on bad input (its error is in its log)")
    mine: tuple[Any, Any] = (np.concatenate(xs) if xs else None, np.concatenate(qs) if qs else None)
    parts: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, parts, dst=0, group=group)
    if parts is None:
        return False
    # rank r's rows, in order: its batch of each step
    x_all = np.empty((stop - start, next(p[0] for p in parts if p[0] is not None).shape[1]), np.float32)
    q_all = np.empty(stop - start, np.float32)
    offsets = [0] * world
    for s in range(start, stop, world * batch_size):
        for r in range(world):
            lo = min(s + r * batch_size, stop)
            hi = min(lo + batch_size, stop)
            if hi <= lo:
                continue
            k = offsets[r]
            x_all[lo - start : hi - start] = parts[r][0][k : k + hi - lo]
            q_all[lo - start : hi - start] = parts[r][1][k : k + hi - lo]
            offsets[r] += hi - lo
    gathered: Any = _Gathered(start, x_all, q_all, device or "cpu")
    return engine.featurize_shard(store, model_id, shard, lambda: gathered, batch, batch_size, device)
