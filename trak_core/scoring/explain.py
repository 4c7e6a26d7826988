"""Which positions of a train sequence carry its score: the per-position split of a proponent's score.

A train sequence's gradient is a sum over the positions where its parameters are used: for a layer applied per
position (a linear map, transformers' ``Conv1D``, an embedding, a norm) ∂f/∂θ = Σ_t ∂f/∂θ|_t, with ∂f/∂W|_t = δ_t a_tᵀ
for a linear map (δ_t the gradient of f at the layer's output at position t, a_t its input there). The projection is
linear, so the projected row splits the same way, x = Σ_t x_t, and so does every score, which is linear in x:

    S(i, j)       = (1/C Σ_c x_{c,i}ᵀ W_c[:, j]) · (1/C Σ_c Q_{c,i}),
    share_t(i, j) = (1/C Σ_c x_{c,i,t}ᵀ W_c[:, j]) · (1/C Σ_c Q_{c,i})

(W_c = A_c G_cᵀ the checkpoint's right-hand matrix, :func:`trak_core.scoring.streaming.grads_right_hand`), and Σ_t
share_t =
S(i, j). Position t's share is the score the train row would have if its gradient were the term of position t alone.
Padding positions (no gradient reaches them) get 0.

:func:`position_features` computes the x_t of one sequence from one forward and backward pass: it records each
parameter-owning layer's input a and output gradient δ, then

* with the factored projector (:mod:`trak_core.projection.factored`), a linear, ``Conv1D`` or embedding block is
projected per
  position from (P_outᵀ δ_t, P_inᵀ a_t) (an embedding: P_out[id_t] and P_inᵀ δ_t): no per-position weight gradient
  is formed; other blocks (norms, biases: ``"__other__"``) from their per-position gradients, materialized;
* with any other projector, the per-position gradients are materialized (positions in chunks) and projected.

A parameter-owning layer must be applied per position: its input and output are (1, T, ...) (T the sequence's
length) and its parameters' gradient at position t depends on position t only. Linear maps, ``Conv1D``, embeddings
and ``nn.LayerNorm`` are split exactly by construction; any other layer (e.g. an RMS norm) by differentiating it at
each position alone, checked against its gradient over all positions (a layer that mixes positions is refused, and
so is one whose forward does not map one tensor to one, e.g. ``nn.MultiheadAttention``).
Only the proponents' sequences are featurized again: nothing per position is stored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import numpy as np
import torch
from torch import Tensor, nn

from trak_core.errors import BadInputError, StateError, StoreMismatchError
from trak_core.featurize.gradients import grad_param_names
from trak_core.featurize.modelout import AbstractModelOutput, CausalLMModelOutput, log_odds, sequence_log_prob
from trak_core.projection.factored import FactoredProjector
from trak_core.projection.layout import is_conv1d, matrix_uses
from trak_core.projection.mha import ATTENTION
from trak_core.projection.projectors import AbstractProjector
from trak_core.scoring.streaming import grads_right_hand
from trak_core.store import model_array

#: train rows featurized together (one forward and backward pass) by an explained query
EXPLAIN_BATCH = 16
#: the most gradient coordinates materialized at once (positions × materialized parameters), about 128 MiB in float32
CHUNK_COORDS = 1 << 25


def check_sequence_task(task: AbstractModelOutput) -> None:
    """Refuse (BadInputError) a task whose inputs are not token sequences: the per-position split applies to
    sequence models (``task="causal_lm"``)."""
    if not isinstance(task, CausalLMModelOutput):
        raise BadInputError(
            f"explain=True: the per-position split of scores applies to sequence inputs (task 'causal_lm', "
            f"token sequences); this index's task is {type(task).__name__}"
        )


class _Call:
    """One forward call of a parameter-owning module: its name, the module, its first input, its output's zero
    perturbation (whose gradient is δ) and, after the backward pass, δ."""

    def __init__(self, name: str, module: nn.Module, inp: Tensor, zero: Tensor):
        self.name, self.module, self.inp, self.zero = name, module, inp, zero
        self.delta: Tensor | None = None

    def row(self, b: int) -> _Call:
        """The call as row ``b`` of a batched forward saw it (batch dimension 1)."""
        one = _Call(self.name, self.module, self.inp[b : b + 1], self.zero)
        one.delta = None if self.delta is None else self.delta[b : b + 1]
        return one


def _record(model: nn.Module, output, owners: dict[str, nn.Module], length: int, rows: int) -> list:
    """One forward and backward pass of ``output(weights, buffers)`` (the sum of the outputs of ``rows`` examples)
    with every module in ``owners`` recorded (input, δ at its output; each (rows, T, ...))."""
    calls: list[_Call] = []
    handles = []

    def make_hook(name: str):
        def hook(mod, inputs, output):
            if not isinstance(output, Tensor) or not inputs or not isinstance(inputs[0], Tensor):
                raise BadInputError(
                    f"explain: module {name!r} ({type(mod).__name__}) owns parameters of the gradient but its forward "
                    "does not map one tensor to one tensor; the per-position split needs layers applied per position"
                )
            inp = inputs[0].detach()
            for what, t in (("input", inp), ("output", output)):
                if t.dim() < 2 or t.shape[0] != rows or t.shape[1] != length:
                    raise BadInputError(
                        f"explain: module {name!r} ({type(mod).__name__}) has an {what} of shape {tuple(t.shape)}, "
                        f"not ({rows}, {length}, ...): the per-position split needs layers applied per position"
                    )
            zero = torch.zeros_like(output, requires_grad=True)
            calls.append(_Call(name, mod, inp, zero))
            return output + zero

        return hook

    weights = {n: p.detach() for n, p in model.named_parameters()}
    buffers = dict(model.named_buffers())
    try:
        for name, mod in owners.items():
            handles.append(mod.register_forward_hook(make_hook(name)))
        with torch.enable_grad():
            out = output(weights, buffers)
            if not calls:
                raise BadInputError("explain: no parameter-owning module of the gradient ran in the forward")
            grads = torch.autograd.grad(out, [c.zero for c in calls], allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for c, g in zip(calls, grads, strict=True):
        c.delta = torch.zeros_like(c.zero) if g is None else g.detach()
    return calls


def _owners(model: nn.Module, names: Sequence[str]) -> dict[str, nn.Module]:
    """{module name: module} of the modules owning (directly) a parameter in ``names``."""
    params = dict(model.named_parameters())
    wanted = {id(params[n]) for n in names}
    out = {}
    for mname, mod in model.named_modules():
        if any(id(p) in wanted for p in mod.parameters(recurse=False)):
            out[mname] = mod
    return out


def _direct(mod: nn.Module, model_params: dict, names: set) -> dict[str, str]:
    """{attribute of ``mod``: parameter name in the gradient} for the module's own parameters in ``names``."""
    by_id: dict[int, str] = {}
    for n, p in model_params.items():
        if n in names:
            by_id.setdefault(id(p), n)
    return {a: by_id[id(p)] for a, p in mod.named_parameters(recurse=False) if id(p) in by_id}


def _flat(t: Tensor, length: int) -> Tensor:
    """(1, T, ..., d) → (T, s, d): positions first, every other index of a position in s."""
    return t.reshape(length, -1, t.shape[-1])


def _call_grads(c: _Call, attrs: dict[str, str], length: int, sl: slice) -> dict[str, Tensor]:
    """Per-position gradients {parameter name: (positions, *shape)} of the call's parameters ``attrs`` at positions
    ``sl`` (materialized)."""
    mod = c.module
    assert c.delta is not None
    out: dict[str, Tensor] = {}
    if isinstance(mod, nn.Linear) or is_conv1d(mod):
        a, d = _flat(c.inp, length)[sl], _flat(c.delta, length)[sl]
        for attr, name in attrs.items():
            if attr == "weight":  # Linear: δ aᵀ [out, in]; Conv1D: a δᵀ [in, out]
                eq = "tso,tsi->toi" if isinstance(mod, nn.Linear) else "tso,tsi->tio"
                out[name] = torch.einsum(eq, d, a.to(d.dtype))
            elif attr == "bias":
                out[name] = d.sum(1)
            else:
                raise BadInputError(f"explain: parameter {name!r} of {c.name!r} is not the layer's weight or bias")
        return out
    if isinstance(mod, nn.Embedding):
        ids = c.inp.reshape(length, -1)[sl]
        d = _flat(c.delta, length)[sl]
        if mod.padding_idx is not None:
            d = d * (ids != mod.padding_idx).unsqueeze(-1).to(d.dtype)
        name = attrs["weight"]
        g = torch.zeros(ids.shape[0], mod.num_embeddings, mod.embedding_dim, dtype=d.dtype, device=d.device)
        g.scatter_add_(1, ids.unsqueeze(-1).expand(*ids.shape, d.shape[-1]), d)
        return {name: g}
    if type(mod) is nn.LayerNorm:  # y = x̂ ⊙ γ + β per position: γ_t = δ_t ⊙ x̂_t, β_t = δ_t
        shape = tuple(mod.normalized_shape)
        x = c.inp[0, sl]
        d = c.delta[0, sl]
        xhat = torch.nn.functional.layer_norm(x, shape, None, None, mod.eps).to(d.dtype)
        lead = tuple(range(1, d.dim() - len(shape)))  # indices of a position other than the normalized ones
        for attr, name in attrs.items():
            g = d * xhat if attr == "weight" else d
            out[name] = g.sum(dim=lead) if lead else g
        return out
    return _generic_grads(c, attrs, length, sl)


def _generic_grads(c: _Call, attrs: dict[str, str], length: int, sl: slice) -> dict[str, Tensor]:
    """Per-position gradients of a layer applied per position: the layer differentiated at each position alone
    (vmap over positions of the vector-Jacobian product with δ_t)."""
    mod = c.module
    assert c.delta is not None
    own = {a: p.detach() for a, p in mod.named_parameters(recurse=False)}
    x = c.inp[0, sl].unsqueeze(1)  # (positions, 1, ...): one position at a time, batch of 1
    d = c.delta[0, sl].unsqueeze(1)

    def one(xt: Tensor, dt: Tensor) -> dict:
        def f(p: dict) -> Tensor:
            return torch.func.functional_call(mod, p, (xt,))

        vjp = torch.func.vjp(f, own)[1]
        return vjp(dt)[0]

    g = torch.func.vmap(one)(x, d)
    return {name: g[a] for a, name in attrs.items()}


def _check_generic(c: _Call, attrs: dict[str, str], length: int) -> None:
    """A layer split by :func:`_generic_grads` must give, summed over positions, its gradient over all positions:
    otherwise it mixes positions (BadInputError naming it)."""
    mod = c.module
    summed = {n: g.sum(0) for n, g in _generic_grads(c, attrs, length, slice(None)).items()}
    own = {a: p.detach() for a, p in mod.named_parameters(recurse=False)}
    vjp = torch.func.vjp(lambda p: torch.func.functional_call(mod, p, (c.inp,)), own)[1]
    full = vjp(c.delta)[0]
    for a, name in attrs.items():
        ref, got = full[a], summed[name]
        tol = 1e-4 if ref.dtype == torch.float32 else 1e-9
        if not torch.allclose(got, ref, rtol=tol, atol=tol * float(ref.abs().max()) + 1e-30):
            raise BadInputError(
                f"explain: module {c.name!r} ({type(mod).__name__}) is not applied per position (its gradient is not "
                "the sum of its gradients at each position): the per-position split needs layers applied per "
                "position (linear maps, Conv1D, embeddings, norms)"
            )


def _is_explicit(mod: nn.Module) -> bool:
    """Layers whose per-position gradients have a closed form here (no check needed)."""
    return isinstance(mod, (nn.Linear, nn.Embedding)) or is_conv1d(mod) or type(mod) is nn.LayerNorm


def _materialized(calls: list, names: set, model_params: dict, length: int, sl: slice, checked: set) -> dict:
    """{parameter name: (positions, *shape)} per-position gradients of ``names`` at positions ``sl``, summed over
    the calls of the modules owning them; a generic layer's split is checked once per call (``checked``)."""
    out: dict[str, Tensor] = {}
    for c in calls:
        attrs = _direct(c.module, model_params, names)
        if not attrs:
            continue
        g = _call_grads(c, attrs, length, sl)
        if not _is_explicit(c.module) and id(c) not in checked:
            checked.add(id(c))
            _check_generic(c, attrs, length)
        for n, t in g.items():
            out[n] = out[n] + t if n in out else t
    return out


def position_features(
    model: nn.Module,
    task: AbstractModelOutput,
    projector: AbstractProjector,
    sample: Sequence[Tensor],
    model_id: int,
    grad_wrt: Sequence[str] | None = None,
) -> Tensor:
    """The projected gradient of one sequence split by position: x_t (T, proj_dim) with Σ_t x_t = the row
    :class:`~trak_core.featurize.featurizer.Featurizer` computes (normalized by √grad_dim as it is), in the model's
    dtype.

    Args:
        model: the model, with the checkpoint loaded, in eval mode.
        task: the model output function (a sequence task: ``causal_lm``).
        projector: the store's projector.
        sample: one example without batch dimension, e.g. (input_ids, attention_mask, labels) each (T,).
        model_id: the checkpoint (the projection's matrices depend on it).
        grad_wrt: the parameters of the gradient (default: all).
    """
    batch = tuple(t.unsqueeze(0) for t in sample)
    return position_features_batch(model, task, projector, batch, model_id, grad_wrt)[0]


def _batched_output(task: AbstractModelOutput, model: nn.Module, batch: Sequence[Tensor]):
    """Σ_b f_b of a batch in one forward, for the built-in causal LM output (examples do not interact: ∂Σ_b f_b at
    row b's activations is ∂f_b); None for a task that defines its own ``get_output`` (then one example at a time)."""
    own = type(task).get_output is CausalLMModelOutput.get_output
    if not own or getattr(type(task), "_logits", None) is not CausalLMModelOutput._logits:
        return None
    ids, mask, labels = batch
    cl = cast(CausalLMModelOutput, task)

    def output(weights, buffers):
        return log_odds(sequence_log_prob(cl._logits(model, weights, buffers, ids, mask), labels)).sum()

    return output


def position_features_batch(
    model: nn.Module,
    task: AbstractModelOutput,
    projector: AbstractProjector,
    batch: Sequence[Tensor],
    model_id: int,
    grad_wrt: Sequence[str] | None = None,
) -> list[Tensor]:
    """:func:`position_features` of each row of ``batch`` (tensors (B, T)), from one forward and backward pass of
    the batch for the built-in ``causal_lm`` output (one per row for a task with its own ``get_output``)."""
    check_sequence_task(task)
    names = grad_param_names(model, grad_wrt)
    rows, length = int(batch[0].shape[0]), int(batch[0].shape[-1])
    model_params = dict(model.named_parameters())
    dtype = next((model_params[n].dtype for n in names if model_params[n].is_floating_point()), torch.float32)
    owners = _owners(model, names)
    together = _batched_output(task, model, batch)
    if together is not None:
        calls = _record(model, together, owners, length, rows)
        per_row = [[c.row(b) for c in calls] for b in range(rows)]
    else:
        per_row = []
        for b in range(rows):
            sample = tuple(t[b] for t in batch)
            per_row.append(
                _record(model, lambda w, bu, sample=sample: task.get_output(model, w, bu, *sample), owners, length, 1)
            )
    grad_dim = sum(model_params[n].numel() for n in names)
    out = []
    for calls in per_row:
        seen = {n for c in calls for n in _direct(c.module, model_params, set(names)).values()}
        unused = [n for n in names if n not in seen]
        if isinstance(projector, FactoredProjector) and projector.layout.model_bound:
            x = _factored(model, projector, calls, names, model_params, length, model_id, dtype)
        else:
            x = _dense(projector, calls, names, model_params, length, model_id, dtype, unused)
        out.append(x / math.sqrt(grad_dim))
    return out


def _zeros_for(names: Sequence[str], model_params: dict, rows: int, dtype, device) -> dict:
    return {n: torch.zeros(rows, *model_params[n].shape, dtype=dtype, device=device) for n in names}


def _dense(projector, calls, names, model_params, length, model_id, dtype, unused) -> Tensor:
    """Any projector: per-position gradients of every parameter, in chunks of positions, projected."""
    grad_dim = sum(model_params[n].numel() for n in names)
    step = max(1, CHUNK_COORDS // max(1, grad_dim))
    outs: list[Tensor] = []
    checked: set[int] = set()
    keep = set(names)
    device = calls[0].delta.device
    for t0 in range(0, length, step):
        sl = slice(t0, min(length, t0 + step))
        rows = sl.stop - sl.start
        got = _materialized(calls, keep, model_params, length, sl, checked)
        got.update(_zeros_for(unused, model_params, rows, dtype, device))
        pieces = {n: got[n].to(dtype) for n in names}
        outs.append(projector.project(pieces, model_id=model_id).to(dtype))
    return torch.cat(outs)


def _factored(model, projector: FactoredProjector, calls, names, model_params, length, model_id, dtype) -> Tensor:
    """The factored projector: linear / Conv1D / embedding uses of a block projected per position from their two
    sides; every other block from materialized per-position gradients of its parameters."""
    layout = projector.layout
    facs = {
        name: tuple(t.to(dtype) if torch.is_tensor(t) else t for t in f)
        for name, f in projector.factors(model_id).items()
    }
    uses = matrix_uses(model, layout)
    by_module: dict[str, list[_Call]] = {c.name: [] for c in calls}
    for c in calls:
        by_module[c.name].append(c)
    device = calls[0].delta.device
    outs = []
    checked: set[int] = set()
    for b in layout.blocks:
        p_in, p_out, w = facs[b.name]
        if b.kind in ("linear", "embedding"):
            block_uses = ((b.name, b.kind, b.bias),)
        elif b.kind == "matrix" and b.name in uses and all(u != ATTENTION for _, u, _ in uses[b.name]):
            block_uses = uses[b.name]
        else:
            block_uses = None
        if block_uses is None:  # materialized per-position gradients of this block's parameters
            bnames = set(b.params)
            per: list[Tensor] = []
            size = sum(model_params[n].numel() for n in b.params)
            step = max(1, CHUNK_COORDS // max(1, size))
            for t0 in range(0, length, step):
                sl = slice(t0, min(length, t0 + step))
                rows = sl.stop - sl.start
                sel = [c for c in calls if _direct(c.module, model_params, bnames)]
                got = _materialized(sel, bnames, model_params, length, sl, checked)
                missing = [n for n in b.params if n not in got]
                got.update(_zeros_for(missing, model_params, rows, dtype, device))
                pieces = {n: got[n].to(dtype) for n in b.params}
                per.append(projector.project_block(b, pieces, (p_in, p_out, w), rows, dtype=dtype))
            outs.append(torch.cat(per))
            continue
        acc = torch.zeros(length, b.k, dtype=dtype, device=device)
        for mname, use, with_bias in block_uses:
            for c in by_module.get(mname, []):
                acc += _rank_one(b, c, use, with_bias, p_in, p_out, w, length, dtype)
        outs.append(acc)
    return torch.cat(outs, dim=1)


def _rank_one(b, c: _Call, use: str, with_bias: bool, p_in, p_out, w, length: int, dtype) -> Tensor:
    """Block ``b``'s k coordinates per position (T, k) from one call of a linear / Conv1D / embedding use: each term
    of G_t = Σ left ⊗ right projected as (P_outᵀ left) ⊗ (P_inᵀ right)."""
    assert c.delta is not None
    d = _flat(c.delta, length).to(dtype)
    p_w = p_in[: b.d_in]
    terms: list[tuple[Tensor, Tensor]] = []  # (T, s, k_out), (T, s, k_in)
    if use == "linear":  # G_t = δ_t [a_t; 1]ᵀ
        a = _flat(c.inp, length).to(dtype)
        v = a @ p_w
        if b.bias and with_bias:
            v = v + p_in[b.d_in]
        terms.append((d @ p_out, v))
    elif use == "conv1d":  # W [in, out] viewed d_out = in: G_t = a_t δ_tᵀ, and the bias column δ_t
        a = _flat(c.inp, length).to(dtype)
        terms.append((a @ p_out, d @ p_w))
        if b.bias and with_bias:
            terms.append((d @ p_out, p_in[b.d_in].expand(*d.shape[:2], -1)))
    elif use == "embedding":  # G_t = e_{id_t} δ_tᵀ: P_outᵀ e_id = P_out[id]
        ids = c.inp.reshape(length, -1)
        rows = p_out[ids]
        pad = getattr(c.module, "padding_idx", None)
        if pad is not None:
            rows = rows * torch.ne(ids, int(pad)).unsqueeze(-1).to(dtype)
        terms.append((rows, d @ p_w))
    else:
        raise BadInputError(f"explain: block {b.name!r} is used as {use!r}, which the per-position split does not take")
    out = torch.zeros(length, b.k, dtype=dtype, device=d.device)
    for u, v in terms:
        if b.pairs:
            out += (u * v).sum(1)
        else:
            out += torch.einsum("tso,tsi->toi", u, v).reshape(length, -1)[:, : b.k]
    return out * w


def check_explain(index, train_data) -> None:
    """Refuse (before any compute) an explained query the index cannot answer: no model, a task whose inputs are not
    sequences, ``train_data`` that is not the store's n train rows as a tuple of tensors."""
    if index.featurizer is None:
        raise StateError("explain=True: this index has no model (TrakIndex(..., model=None))")
    check_sequence_task(index.task)
    n = index.n
    if train_data is None:
        raise BadInputError(
            "train_data: explain=True featurizes the proponents' train sequences again; pass the store's train data "
            f"(a tuple of tensors with its {n} rows, e.g. (input_ids, attention_mask, labels))"
        )
    if isinstance(train_data, Tensor) or not isinstance(train_data, Sequence) or not train_data:
        raise BadInputError(
            f"train_data: a tuple of tensors with the store's {n} rows, got {type(train_data).__name__}"
        )
    bad = [i for i, t in enumerate(train_data) if not isinstance(t, Tensor) or t.dim() == 0 or int(t.shape[0]) != n]
    if bad:
        shapes = [tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in train_data]
        raise BadInputError(f"train_data: tensors {bad} do not have the store's {n} rows (shapes {shapes})")
    try:
        index.task.validate_batch(tuple(t[:1] for t in train_data))
    except BadInputError as e:
        raise BadInputError(f"train_data: {e}") from None


#: how far Σ_t x_t of a train row may be from its stored row (relative, by the store's dtype) before the train data
#: is refused as not the store's
ROW_TOLERANCE = {"float32": 1e-3, "float16": 1e-2}


def query_shares(index, result, vectors, train_data: Sequence[Tensor]) -> np.ndarray:
    """(m, k, T) float32: each found row's score split by position (see the module docstring), for a
    :class:`~trak_core.scoring.index.TrakIndex` query's ``result`` from the inputs' projected gradients ``vectors``
    ({model_id: (m, p)}). Each row's Σ_t x_t is compared with its stored row first: train data that is not the
    store's (another row order, other texts) is refused."""
    featurizer = index.featurizer
    idx = np.asarray(result.indices)
    m, k = idx.shape
    length = int(train_data[0].shape[-1])
    rows = sorted({int(i) for i in idx.reshape(-1)})
    ids = list(index.model_ids)
    store = index.store
    dtype_name = np.dtype(store.meta.np_dtype).name
    tol = ROW_TOLERANCE.get(dtype_name, 1e-2)
    acc = {i: torch.zeros(length, m, dtype=torch.float64) for i in rows}
    qsum = dict.fromkeys(rows, 0.0)
    for mid in ids:
        featurizer.load_state(index._states[mid])
        right = grads_right_hand(index._inverses[mid], torch.as_tensor(np.asarray(vectors[mid]), dtype=torch.float32).T)
        grads = model_array(mid, "grads")
        xs: dict[int, Tensor] = {}
        for a in range(0, len(rows), EXPLAIN_BATCH):
            part = rows[a : a + EXPLAIN_BATCH]
            batch = tuple(t[part].to(index.device) for t in train_data)
            got = position_features_batch(featurizer.model, index.task, index.projector, batch, mid, index.grad_wrt)
            xs.update({i: x.detach().to(torch.float64).cpu() for i, x in zip(part, got, strict=True)})
        for i in rows:
            x = xs.pop(i)
            stored = torch.as_tensor(np.asarray(store.read_rows(grads, slice(i, i + 1)), dtype=np.float64)).reshape(-1)
            err = float((x.sum(0) - stored).norm()) / max(float(stored.norm()), 1e-30)
            if not err <= tol:
                raise StoreMismatchError(
                    f"train_data: row {i}'s per-position gradients sum to a projected row {err:.2g} (relative) away "
                    f"from the stored row of model_id={mid}: the train data is not the one the store was featurized "
                    "from (or the model uses a parameter outside its layers' per-position forward)"
                )
            acc[i] += x @ right.to(torch.float64)
            q = store.read_rows(model_array(mid, "out_to_loss"), slice(i, i + 1))
            qsum[i] += float(np.asarray(q, dtype=np.float64).reshape(-1)[0])
    c = len(ids)
    out = np.zeros((m, k, length), dtype=np.float32)
    for j in range(m):
        for r in range(k):
            i = int(idx[j, r])
            out[j, r] = (acc[i][:, j] / c * (qsum[i] / c)).numpy()
    return out


__all__ = [
    "CHUNK_COORDS",
    "check_explain",
    "check_sequence_task",
    "position_features",
    "position_features_batch",
    "query_shares",
]
