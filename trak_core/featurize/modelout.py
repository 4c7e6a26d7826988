"""Model output functions f(θ; z) and their out-to-loss weights Q.

TRAK attributes a *model output function* f (whose per-example gradient is projected) and weighs each
train example by Q = ∂loss/∂f. For classification f is the margin log(p/(1-p)) of the correct class and
Q = 1 - p (p the softmax probability at ``temperature``).

``get_output(model, weights, buffers, *sample)`` is called on ONE example (no batch dimension) inside
``torch.func.vmap``; ``get_out_to_loss_grad(model, weights, buffers, batch)`` is called on a batch and
returns Q with shape (B, 1) (CLIP: (B,)), as traker 0.3.2 does. Subclass :class:`AbstractModelOutput`
for your own task; where your Q is a function of f alone, ``out_to_loss_from_output(outputs)`` lets featurizing
take it from the outputs of the forward that gives the gradients (one forward per batch instead of two, as the
built-in classification tasks do at temperature 1).

Causal language models: ``task="causal_lm"`` (:class:`CausalLMModelOutput`, the log-odds of the target sequence;
:mod:`trak_core.featurize.lm` builds batches and per-token targets). transformers models (a causal LM, or a sequence
classifier for ``text_classification``) get their attention mask as a 4-D additive mask (:func:`additive_mask`):
their own mask code reads the mask's values, which ``torch.func.vmap`` does not allow.

Modes, BatchNorm, dropout and buffers: features are computed in eval mode. ``TRAKer.load_checkpoint`` /
``start_scoring_checkpoint`` and the pipeline's featurizer load the checkpoint and call ``model.eval()`` (the model
stays in eval mode afterwards), so BatchNorm normalizes with its running statistics and dropout is off (the same
example always gives the same features). Buffers are passed to ``get_output`` as fixed inputs: never
differentiated, never updated (featurizing leaves ``running_mean`` / ``running_var`` / ``num_batches_tracked`` as
the checkpoint has them). A :class:`~trak_core.featurize.featurizer.Featurizer` used directly, without ``load_state``,
computes
in whatever mode the model is in: put it in eval mode first.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor
from torch.func import functional_call

from trak_core.errors import BadInputError
from trak_core.featurize.adapters import inner_model
from trak_core.featurize.hf_fixes import transformers_fixes


def _margin(logits: Tensor, label: Tensor) -> Tensor:
    """log(p_y / (1 - p_y)) = logit_y - logsumexp(other logits), for logits of shape (1, C); NaN for a label outside
    [0, C) (a value is computed per example inside vmap, where nothing can be raised: the caller sees NaN)."""
    num_classes = logits.shape[-1]
    mask = torch.arange(num_classes, device=logits.device) == label.reshape(1, 1)
    correct = (logits * mask).sum(dim=-1)
    others = logits.masked_fill(mask, float("-inf")).logsumexp(dim=-1)
    margin = (correct - others).sum()
    return torch.where(mask.any(), margin, torch.full_like(margin, float("nan")))


def _softmax_margin_q(task: AbstractModelOutput, cls: type, outputs: Tensor) -> Tensor | None:
    """Q = 1 − p_y = sigmoid(−f) from margins f = log(p_y/(1 − p_y)) (B,) — exact, and without the cancellation of
    1 − p_y near p_y = 1 — for a ``cls`` task at temperature 1 whose get_output / get_out_to_loss_grad are cls's
    own; None otherwise (another temperature, or a subclass that redefines either)."""
    own = all(getattr(type(task), name) is getattr(cls, name) for name in ("get_output", "get_out_to_loss_grad"))
    if not own or getattr(task, "loss_temperature", None) != 1.0:
        return None
    return _sigmoid_of_minus(outputs)


def _sigmoid_of_minus(outputs: Tensor) -> Tensor:
    """sigmoid(−f) (B,), in float64 rounded once to the outputs' dtype: the same bits whether torch's loop computes
    a row's exp in its vectorized body or in its scalar tail, which depends on the batch's size."""
    f = outputs.detach()
    return torch.sigmoid(-f.double()).to(f.dtype).reshape(-1)


def _check_labels(labels: Tensor, num_classes: int | None) -> None:
    """Labels in [0, num_classes) (``None``: no upper bound yet, before the logits are known), any integer dtype."""
    labels = labels.reshape(-1).long()  # compared as int64, whatever the labels' integer dtype
    out = (labels < 0) | (labels >= num_classes) if num_classes is not None else labels < 0
    bad = out.nonzero().reshape(-1)
    if bad.numel():
        allowed = f"[0, {num_classes})" if num_classes is not None else "[0, number of classes)"
        raise BadInputError(
            f"labels out of range {allowed} at batch positions {bad.tolist()[:20]} (values {labels[bad].tolist()[:20]})"
        )


def is_transformers_model(model) -> bool:
    """True for a transformers model (a class from the ``transformers`` package in its bases), also inside a peft
    wrapper; no import."""
    return any(c.__module__.startswith("transformers.") for c in type(inner_model(model)).__mro__)


def is_causal(model) -> bool:
    """True when one of the model's attention modules says ``is_causal`` (transformers' convention)."""
    return any(getattr(m, "is_causal", False) is True for m in model.modules())


def additive_mask(attention_mask: Tensor, causal: bool, dtype: torch.dtype) -> Tensor:
    """A (…, T) 0/1 padding mask as the (…, 1, T, T) additive float mask transformers takes as it is: 0 where query
    t may attend to key s (s a real token, and s ≤ t when ``causal``; and s = t, so that a padding query attends to
    itself rather than to nothing), the dtype's most negative finite number elsewhere (its softmax weight is
    exactly 0, so padding neither reaches a real token nor gets a gradient). A query with no key left would be a
    row of ``-inf`` in the models that add the mask twice or cap their scores (Gemma 2, MPT): NaN at padding,
    which a real token's zero attention weight on it turns into NaN gradients.

    transformers builds this mask itself from a 2-D one, but reads the mask's values to decide whether it can skip
    it (``padding_mask.all()``), which fails under ``torch.func.vmap`` ("data-dependent control flow"); a 4-D mask
    is used as given."""
    keys = attention_mask.bool().unsqueeze(-2)  # (…, 1, T): key s is a real token
    t = attention_mask.shape[-1]
    if causal:
        keys = keys & torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).tril()
    else:
        keys = keys.expand(*attention_mask.shape[:-1], t, t)
    keys = keys | torch.eye(t, dtype=torch.bool, device=attention_mask.device)
    zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
    return torch.where(keys, zero, torch.finfo(dtype).min).unsqueeze(-3)


def _float_dtype(weights: dict) -> torch.dtype:
    return next((w.dtype for w in weights.values() if w.is_floating_point()), torch.get_default_dtype())


def _call_logits(model, weights, buffers, kwargs: dict) -> Tensor:
    """``model(**kwargs)``'s logits (the output, or its ``.logits``, or its first element) through functional_call,
    with scaled dot-product attention's math backend (vmap has no batching rule for the fused CPU kernel and the
    fused CUDA kernels' backward passes fail under it; the numbers are the same up to rounding)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _check_forward_takes(model, kwargs)
    check_devices((w.device for w in (weights or {}).values()), [v for v in kwargs.values() if isinstance(v, Tensor)])
    try:
        with sdpa_kernel(SDPBackend.MATH), transformers_fixes(model):
            out = functional_call(model, (weights, buffers), args=(), kwargs=kwargs)
    except IndexError as e:  # an embedding given an id outside its table
        vocab = _input_vocab_size(model) if "input_ids" in kwargs else None
        if vocab is None:
            raise
        msg = _out_of_vocabulary(kwargs["input_ids"], vocab, e)
        if msg is None:  # every id is in range: another IndexError of the model's own
            raise
        raise BadInputError(msg) from e
    if hasattr(out, "logits"):
        return out.logits
    return out[0] if isinstance(out, (tuple, list)) else out


def _check_forward_takes(model, kwargs: dict) -> None:
    """Refuse (BadInputError) a model whose ``forward`` cannot take the keyword arguments a task calls it with."""
    try:
        params = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError, AttributeError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    names = [n for n, p in params.items() if p.kind is not inspect.Parameter.POSITIONAL_ONLY]
    missing = [k for k in kwargs if k not in names]
    if missing:
        takes = ", ".join(n for n in params if n != "self")
        raise BadInputError(
            f"{type(model).__name__}.forward({takes}) takes no {', '.join(missing)} argument: the task calls "
            f"model({', '.join(k + '=' for k in kwargs)}); give forward a parameter of each name (it may ignore "
            "attention_mask where no row is padded)"
        )


def _input_vocab_size(model) -> int | None:
    """The number of rows of the model's input embedding (transformers' ``get_input_embeddings()``, or the only
    ``nn.Embedding`` of the model), or None when there is no one such table."""
    emb = None
    try:
        emb = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    except (NotImplementedError, AttributeError):
        emb = None
    if emb is None:
        tables = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
        emb = tables[0] if len(tables) == 1 else None
    n = getattr(emb, "num_embeddings", None)
    return n if isinstance(n, int) else None


def _out_of_vocabulary(input_ids: Tensor, vocab: int, e: Exception | None = None) -> str | None:
    """The message for input ids outside [0, vocab): the (row, position) pairs that hold one and their values, rows
    counted in the batch (inside ``torch.func.vmap``, the batch the vmap runs over: :func:`_concrete`); None when all
    are in range."""
    try:
        ids = _concrete(input_ids).long()
    except (RuntimeError, AttributeError):  # a wrapper this torch cannot unwrap: the ids cannot be read
        return f"input_ids must be in [0, {vocab}), the rows of the model's input embedding" + (
            f" (the forward raised IndexError: {e})" if e is not None else ""
        )
    ids = ids.reshape(ids.shape[0], -1) if ids.dim() else ids.reshape(1, 1)
    where = ((ids < 0) | (ids >= vocab)).nonzero()
    if not where.numel():
        return None
    rows = sorted({int(r) for r in where[:, 0].tolist()})
    pairs = [tuple(p) for p in where.tolist()[:20]]
    values = ids[where[:20, 0], where[:20, 1]].tolist()
    return (
        f"input_ids must be in [0, {vocab}), the rows of the model's input embedding; rows {rows[:20]} hold such "
        f"ids: (row, position) {pairs} (values {values})"
    )


def _concrete(t: Tensor) -> Tensor:
    """``t`` itself, or inside ``torch.func`` transforms the tensor they wrap: with the batch dimension of each
    ``vmap`` moved to the front, so that rows count the examples of the outermost vmap (its per-example shape
    follows the inner batch dimensions). Raises RuntimeError (torch's) where a wrapper cannot be read."""
    from torch._C import _functorch as ft

    while True:  # each step goes one transform level down
        if ft.is_batchedtensor(t):
            bdim = ft.maybe_get_bdim(t)
            t = ft.get_unwrapped(t)
            t = t.movedim(bdim, 0) if bdim is not None else t
        elif ft.is_gradtrackingtensor(t) or ft.is_functionaltensor(t):
            t = ft.get_unwrapped(t)
        else:
            return t


class AbstractModelOutput(ABC):
    """A model output function. Implement ``get_output`` (one example) and ``get_out_to_loss_grad``."""

    def __init__(self) -> None:  # noqa: B027 - concrete on purpose: subclasses need not call or override it
        pass

    @abstractmethod
    def get_output(self, model, weights, buffers, *sample) -> Tensor:
        """The scalar model output f for one example (inputs without batch dimension)."""

    @abstractmethod
    def get_out_to_loss_grad(self, model, weights, buffers, batch: Sequence[Tensor]) -> Tensor:
        """Q = ∂loss/∂f for each example of the batch, shape (B, 1) or (B,)."""

    def out_to_loss_from_output(self, outputs: Tensor) -> Tensor | None:
        """Q (B,) from the outputs f (B,) of ``get_output`` alone, where Q is a function of f (the built-in
        classification tasks at temperature 1: Q = sigmoid(−f)); None (the default), whatever the outputs, where
        it is not — the caller then runs ``get_out_to_loss_grad``, a forward pass of its own. A non-finite Q (e.g.
        a label out of range) makes the caller run ``get_out_to_loss_grad`` too, for its error."""
        return None

    def validate_batch(self, batch: Sequence[Tensor]) -> None:
        """Raise :class:`BadInputError` for malformed batches (called before any compute)."""
        check_batch(batch)

    def validate_inputs(self, model, batch: Sequence[Tensor]) -> None:  # noqa: B027 - optional: nothing by default
        """Raise :class:`BadInputError` for a batch (already :meth:`validate_batch`-checked) that ``model`` cannot
        take, e.g. token ids outside its vocabulary; called before any compute, where the model is known."""


def check_devices(model_devices: Iterable[torch.device], batch: Sequence[Tensor], hint: str = "") -> None:
    """Refuse (BadInputError, naming both) a batch with a tensor on a device where the model has no parameter."""
    have = sorted({str(d) for d in model_devices})
    if not have:
        return
    off = sorted({str(x.device) for x in batch if isinstance(x, Tensor) and str(x.device) not in have})
    if off:
        raise BadInputError(
            f"the batch is on {', '.join(off)} but the model's parameters are on {', '.join(have)}: put them on one "
            f"device{hint or f' (model.to({off[0]!r}), or each batch tensor .to({have[0]!r}))'}"
        )


def check_batch(batch: Sequence[Tensor], expected_len: int | None = None) -> int:
    """The common batch checks: a non-empty sequence of tensors with one leading batch size."""
    if isinstance(batch, Tensor) or not isinstance(batch, (list, tuple)):
        raise BadInputError(f"batch must be a list or tuple of tensors, got {type(batch).__name__}")
    if expected_len is not None and len(batch) != expected_len:
        raise BadInputError(f"batch must have {expected_len} elements, got {len(batch)}")
    sizes = []
    for i, x in enumerate(batch):
        if not isinstance(x, Tensor):
            raise BadInputError(f"batch element {i} must be a tensor, got {type(x).__name__}")
        if x.dim() == 0:
            raise BadInputError(f"batch element {i} is a scalar; every element needs a batch dimension")
        if x.is_meta:
            raise BadInputError(f"batch element {i} is on the meta device: it holds no values (move it to cpu or cuda)")
        sizes.append(x.shape[0])
    if len(set(sizes)) != 1:
        raise BadInputError(f"batch elements have different batch sizes {sizes}")
    if sizes[0] == 0:
        raise BadInputError("batch is empty")
    return sizes[0]


class ImageClassificationModelOutput(AbstractModelOutput):
    """Margin f = log(p/(1-p)) of the correct class; Q = 1 - softmax(logits / temperature)_y.

    batch = (images, labels); ``model(images)`` returns logits (B, C).
    """

    def __init__(self, temperature: float = 1.0) -> None:
        super().__init__()
        if not temperature > 0:
            raise BadInputError(f"temperature must be > 0, got {temperature}")
        self.loss_temperature = temperature

    @staticmethod
    def get_output(model, weights, buffers, image: Tensor, label: Tensor) -> Tensor:
        logits = functional_call(model, (weights, buffers), (image.unsqueeze(0),))
        return _margin(logits, label)

    def get_out_to_loss_grad(self, model, weights, buffers, batch) -> Tensor:
        images, labels = batch
        logits = functional_call(model, (weights, buffers), (images,))
        _check_labels(labels, logits.shape[-1])
        p = torch.softmax(logits / self.loss_temperature, dim=-1)
        p_y = p.gather(-1, labels.reshape(-1, 1).long())
        return (1 - p_y).detach()

    def out_to_loss_from_output(self, outputs: Tensor) -> Tensor | None:
        return _softmax_margin_q(self, ImageClassificationModelOutput, outputs)

    def validate_batch(self, batch) -> None:
        check_batch(batch, expected_len=2)
        labels = batch[1]
        if labels.dim() != 1 or labels.dtype.is_floating_point:
            raise BadInputError(
                f"labels must be a 1-d integer tensor, got shape {tuple(labels.shape)} dtype {labels.dtype}"
            )
        _check_labels(labels, None)  # negative labels fail here; the upper bound once logits are known


class IterativeImageClassificationModelOutput(ImageClassificationModelOutput):
    """Same function, batched, for the loop gradient computer (``get_output`` returns one margin per row)."""

    @staticmethod
    def get_output(model, weights, buffers, images: Tensor, labels: Tensor) -> Tensor:
        logits = model(images)
        mask = torch.arange(logits.shape[-1], device=logits.device) == labels.reshape(-1, 1)
        correct = (logits * mask).sum(dim=-1)
        return correct - logits.masked_fill(mask, float("-inf")).logsumexp(dim=-1)


class TextClassificationModelOutput(AbstractModelOutput):
    """Margin for sequence classifiers called as ``model(input_ids=, token_type_ids=, attention_mask=)``.

    batch = (input_ids, token_type_ids, attention_mask, labels). The model returns logits (B, C) or an object
    with ``.logits`` (transformers' ``AutoModelForSequenceClassification``); a transformers model gets the
    attention mask as the 4-D additive mask of :func:`additive_mask` (causal where its attention modules are).
    """

    def __init__(self, temperature: float = 1.0) -> None:
        super().__init__()
        if not temperature > 0:
            raise BadInputError(f"temperature must be > 0, got {temperature}")
        self.loss_temperature = temperature

    @staticmethod
    def _logits(model, weights, buffers, input_ids, token_type_ids, attention_mask):
        if is_transformers_model(model):  # a 4-D mask: transformers' own mask code cannot run under vmap
            attention_mask = additive_mask(attention_mask, is_causal(model), _float_dtype(weights))
        kwargs = {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": attention_mask}
        return _call_logits(model, weights, buffers, kwargs)

    @staticmethod
    def get_output(model, weights, buffers, input_id, token_type_id, attention_mask, label) -> Tensor:
        logits = TextClassificationModelOutput._logits(
            model, weights, buffers, input_id.unsqueeze(0), token_type_id.unsqueeze(0), attention_mask.unsqueeze(0)
        )
        return _margin(logits, label)

    def get_out_to_loss_grad(self, model, weights, buffers, batch) -> Tensor:
        input_ids, token_type_ids, attention_mask, labels = batch
        logits = self._logits(model, weights, buffers, input_ids, token_type_ids, attention_mask)
        _check_labels(labels, logits.shape[-1])
        p = torch.softmax(logits / self.loss_temperature, dim=-1)
        return (1 - p.gather(-1, labels.reshape(-1, 1).long())).detach()

    def out_to_loss_from_output(self, outputs: Tensor) -> Tensor | None:
        return _softmax_margin_q(self, TextClassificationModelOutput, outputs)

    def validate_batch(self, batch) -> None:
        check_batch(batch, expected_len=4)
        shapes = [tuple(x.shape) for x in batch[:3]]
        if len(set(shapes)) != 1:
            raise BadInputError(f"input_ids, token_type_ids and attention_mask must have one shape, got {shapes}")
        _check_labels(batch[3], None)


IGNORE_INDEX = -100  # transformers' label for a token that is not scored


def sequence_log_prob(logits: Tensor, labels: Tensor) -> Tensor:
    """log p(target) = Σ_t log p(labels_t | tokens < t) over the scored tokens (labels ≠ -100, position 0 never:
    the shift inside, as transformers' causal-LM loss). logits (…, T, V), labels (…, T) → (…,); NaN for a row with
    a label outside [0, V) (computed inside vmap, where nothing can be raised)."""
    logp = torch.log_softmax(logits[..., :-1, :], dim=-1)
    target = labels[..., 1:]
    scored = target != IGNORE_INDEX
    valid = (target >= 0) & (target < logits.shape[-1])
    tok = logp.gather(-1, torch.where(valid, target, 0).unsqueeze(-1).long()).squeeze(-1)
    total = torch.where(scored, tok, torch.zeros_like(tok)).sum(-1)
    return torch.where((scored & ~valid).any(-1), torch.full_like(total, float("nan")), total)


def log_odds(log_p: Tensor) -> Tensor:
    """log(p / (1 − p)) from log p ≤ 0, without the cancellation of 1 − p near p = 1 or the underflow of p."""
    log1mp = torch.where(log_p > -math.log(2.0), torch.log(-torch.expm1(log_p)), torch.log1p(-torch.exp(log_p)))
    return log_p - log1mp


class CausalLMModelOutput(AbstractModelOutput):
    """The log-odds of a target sequence under a causal language model.

    f(θ; z) = log(p / (1 − p)), p = Π_t p_θ(y_t | y_<t) the probability of the scored tokens of z (labels ≠ -100):
    the model output function of the TRAK paper's fact-tracing experiments (Park et al., "TRAK: Attributing Model
    Behavior at Scale", ICML 2023). The training loss of z, −log p = Σ_t cross-entropy_t, is −log σ(f), whose
    derivative in f is −σ(−f): Q = 1 − p = σ(−f), as for classification. Per-token attribution: a sequence with ONE
    scored token gets f = log(p_t / (1 − p_t)), that token's margin; :func:`trak_core.featurize.lm.per_token_targets`
    makes
    one such target row per scored token.

    batch = (input_ids, attention_mask, labels), each [B, T], transformers' conventions: labels -100 where not
    scored, label t predicted from positions < t (the shift is inside), attention_mask 1 for real tokens. The model
    is called as ``model(input_ids=, attention_mask=)`` and returns logits (B, T, V) or an object with ``.logits``.
    A transformers model gets a 4-D additive causal mask (:func:`additive_mask`, vmap cannot run its own mask code),
    ``position_ids`` counted over the real tokens (so a sequence's features do not depend on its padding, left or
    right) and ``use_cache=False``, where its forward takes them; ``transformers_inputs=False`` passes the batch's
    2-D mask alone, as to any other model.
    """

    def __init__(self, transformers_inputs: bool = True) -> None:
        super().__init__()
        self.transformers_inputs = transformers_inputs

    def _logits(self, model, weights, buffers, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        kwargs: dict = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.transformers_inputs and is_transformers_model(model):
            kwargs["attention_mask"] = additive_mask(attention_mask, True, _float_dtype(weights))
            accepts = _forward_parameters(type(inner_model(model)))  # a peft wrapper passes them on
            if "position_ids" in accepts:
                kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            if "use_cache" in accepts:
                kwargs["use_cache"] = False
        return _call_logits(model, weights, buffers, kwargs)

    def get_output(self, model, weights, buffers, input_ids: Tensor, attention_mask: Tensor, labels: Tensor) -> Tensor:
        logits = self._logits(model, weights, buffers, input_ids.unsqueeze(0), attention_mask.unsqueeze(0))
        return log_odds(sequence_log_prob(logits, labels.unsqueeze(0))).sum()

    def get_out_to_loss_grad(self, model, weights, buffers, batch) -> Tensor:
        input_ids, attention_mask, labels = batch
        logits = self._logits(model, weights, buffers, input_ids, attention_mask)
        _check_token_labels(labels, logits.shape[-1])
        return (-torch.expm1(sequence_log_prob(logits, labels))).detach().reshape(-1, 1)

    def out_to_loss_from_output(self, outputs: Tensor) -> Tensor | None:
        own = all(
            getattr(type(self), n) is getattr(CausalLMModelOutput, n) for n in ("get_output", "get_out_to_loss_grad")
        )
        return _sigmoid_of_minus(outputs) if own else None

    def validate_batch(self, batch) -> None:
        check_batch(batch, expected_len=3)
        input_ids, attention_mask, labels = batch
        shapes = [tuple(x.shape) for x in batch]
        if len(set(shapes)) != 1 or len(shapes[0]) != 2 or shapes[0][1] < 2:
            raise BadInputError(
                f"causal_lm: input_ids, attention_mask and labels must have one shape [B, T] with T ≥ 2, got {shapes}"
            )
        for name, x in (("input_ids", input_ids), ("labels", labels), ("attention_mask", attention_mask)):
            if x.dtype.is_floating_point or x.dtype.is_complex:
                raise BadInputError(f"causal_lm: {name} must be an integer (or bool) tensor, got {x.dtype}")
        bad = ((attention_mask != 0) & (attention_mask != 1)).any(1).nonzero().reshape(-1).tolist()
        if bad:
            raise BadInputError(f"causal_lm: attention_mask must hold 0 and 1 only; rows {bad[:20]} do not")
        _check_token_labels(labels, None)
        neg = (input_ids.long() < 0).any(1).nonzero().reshape(-1).tolist()
        if neg:
            raise BadInputError(f"causal_lm: input_ids must be ≥ 0 (token ids); rows {neg[:20]} hold negative ids")
        scored = labels[:, 1:] != IGNORE_INDEX
        none = (~scored.any(1)).nonzero().reshape(-1).tolist()
        if none:
            raise BadInputError(
                f"causal_lm: rows {none[:20]} score no token (labels[:, 1:] all -100; the label at position 0 is "
                "never scored: label t is predicted from the tokens before t)"
            )
        real = (attention_mask[:, 1:] != 0) & (attention_mask[:, :-1] != 0)
        padded = (scored & ~real).any(1).nonzero().reshape(-1).tolist()
        if padded:
            raise BadInputError(
                f"causal_lm: rows {padded[:20]} score a token that is padding or follows padding (attention_mask 0 "
                "at t or t − 1; a left-padded row's first token, like position 0, has nothing to be predicted "
                "from): set those labels to -100"
            )

    def validate_inputs(self, model, batch) -> None:
        """Input ids in [0, the rows of the model's input embedding), where that table can be found."""
        vocab = _input_vocab_size(model)
        msg = None if vocab is None else _out_of_vocabulary(batch[0], vocab)
        if msg is not None:
            raise BadInputError(f"causal_lm: {msg}")


def _check_token_labels(labels: Tensor, vocab_size: int | None) -> None:
    """Token labels -100 or in [0, vocab_size) (``None``: no upper bound yet), any integer dtype."""
    labels = labels.long()  # compared as int64, whatever the labels' integer dtype
    out = (labels < 0) | (labels >= vocab_size) if vocab_size is not None else labels < 0
    bad = ((labels != IGNORE_INDEX) & out).nonzero()
    if bad.numel():
        where = [tuple(r) for r in bad.tolist()[:20]]
        allowed = f"in [0, {vocab_size})" if vocab_size is not None else "in [0, vocabulary size)"
        raise BadInputError(
            f"causal_lm: labels must be -100 or {allowed}; (row, position) {where} are not "
            f"(values {labels[bad[:, 0], bad[:, 1]].tolist()[:20]})"
        )


_FORWARD_PARAMETERS: dict[type, frozenset] = {}


def _forward_parameters(cls: type[torch.nn.Module]) -> frozenset:
    """The names ``cls.forward`` takes (kept per class)."""
    if cls not in _FORWARD_PARAMETERS:
        try:
            _FORWARD_PARAMETERS[cls] = frozenset(inspect.signature(cls.forward).parameters)
        except (TypeError, ValueError, AttributeError):
            _FORWARD_PARAMETERS[cls] = frozenset()
    return _FORWARD_PARAMETERS[cls]


class CLIPModelOutput(AbstractModelOutput):
    """CLIP's contrastive margin against a simulated batch of precomputed embeddings.

    ``model(image=, text=)`` returns (image_embeddings, text_embeddings, logit_scale). Call
    :meth:`get_embeddings` (or :meth:`set_embeddings`) first. The simulated batch of
    ``simulated_batch_size`` rows is drawn uniformly without replacement (traker 0.3.2 draws row i with
    probability ∝ i and never row 0; we document the difference). Pass ``seed`` for reproducible draws.
    """

    image_embeddings: Tensor | None = None
    text_embeddings: Tensor | None = None
    num_computed_embeddings: int = 0
    sim_batch_size: int = 0

    def __init__(
        self, temperature: float | None = None, simulated_batch_size: int = 300, seed: int | None = None
    ) -> None:
        super().__init__()
        self.temperature = temperature
        self.sim_batch_size = simulated_batch_size
        CLIPModelOutput.sim_batch_size = simulated_batch_size
        self.seed = seed

    @staticmethod
    def set_embeddings(image_embeddings: Tensor, text_embeddings: Tensor) -> None:
        if image_embeddings.shape != text_embeddings.shape:
            raise BadInputError(
                f"image and text embeddings differ in shape: {tuple(image_embeddings.shape)} vs "
                f"{tuple(text_embeddings.shape)}"
            )
        CLIPModelOutput.image_embeddings = image_embeddings
        CLIPModelOutput.text_embeddings = text_embeddings
        CLIPModelOutput.num_computed_embeddings = image_embeddings.shape[0]

    @staticmethod
    def get_embeddings(
        model,
        loader: Iterable,
        batch_size: int,
        embedding_dim: int,
        size: int = 50_000,
        preprocess_fn_img=None,
        preprocess_fn_txt=None,
    ) -> None:
        imgs, txts, seen = [], [], 0
        with torch.no_grad():
            for images, text in loader:
                if preprocess_fn_img is not None:
                    images = preprocess_fn_img(images)
                if preprocess_fn_txt is not None:
                    text = preprocess_fn_txt(text)
                ie, te, _ = model(images, text)
                imgs.append(ie.detach())
                txts.append(te.detach())
                seen += ie.shape[0]
                if seen >= size:
                    break
        ie, te = torch.cat(imgs)[:size], torch.cat(txts)[:size]
        if ie.shape[1] != embedding_dim:
            raise BadInputError(f"embedding_dim={embedding_dim} but the model returns {ie.shape[1]}")
        CLIPModelOutput.set_embeddings(ie, te)

    def _sample_indices(self) -> Tensor:
        n = CLIPModelOutput.num_computed_embeddings
        k = min(self.sim_batch_size, n)
        if k == n:
            return torch.arange(n)
        gen = None
        if self.seed is not None:
            gen = torch.Generator().manual_seed(self.seed)
        return torch.randperm(n, generator=gen)[:k]

    def get_output(self, model, weights, buffers, image: Tensor, label: Tensor) -> Tensor:
        all_im, all_txt = CLIPModelOutput.image_embeddings, CLIPModelOutput.text_embeddings
        if all_im is None or all_txt is None:  # set together by set_embeddings
            raise BadInputError("CLIPModelOutput: call get_embeddings (or set_embeddings) before featurizing")
        ii = self._sample_indices().to(all_im.device)
        ie, te, _ = functional_call(
            model, (weights, buffers), args=(), kwargs={"image": image.unsqueeze(0), "text": label.unsqueeze(0)}
        )
        out = -torch.logsumexp(-ie @ (te - all_txt[ii]).T, dim=1) - torch.logsumexp(-te @ (ie - all_im[ii]).T, dim=1)
        return out.sum()

    def get_out_to_loss_grad(self, model, weights, buffers, batch) -> Tensor:
        image, label = batch
        ie, te, scale = functional_call(model, (weights, buffers), args=(), kwargs={"image": image, "text": label})
        temperature = self.temperature if self.temperature is not None else scale
        res = temperature * ie @ te.T
        ps = (torch.softmax(res, dim=-1) + torch.softmax(res.T, dim=-1)).diag() / 2.0
        return (1 - ps).detach()

    def validate_batch(self, batch) -> None:
        check_batch(batch, expected_len=2)


TASK_TO_MODELOUT: dict[str, type[AbstractModelOutput]] = {
    "image_classification": ImageClassificationModelOutput,
    "text_classification": TextClassificationModelOutput,
    "clip": CLIPModelOutput,
    "iterative_image_classification": IterativeImageClassificationModelOutput,
    "causal_lm": CausalLMModelOutput,
}


def resolve_task(task) -> AbstractModelOutput:
    if isinstance(task, AbstractModelOutput):
        return task
    if isinstance(task, str):
        if task not in TASK_TO_MODELOUT:
            raise BadInputError(
                f"unknown task {task!r}; choose one of {sorted(TASK_TO_MODELOUT)} "
                "or pass an AbstractModelOutput instance"
            )
        return TASK_TO_MODELOUT[task]()
    raise BadInputError(f"task must be a string or an AbstractModelOutput, got {type(task).__name__}")
