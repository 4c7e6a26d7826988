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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor
from torch.func import functional_call

from .errors import BadInputError


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
    return torch.sigmoid(-outputs.detach()).reshape(-1)


def _check_labels(labels: Tensor, num_classes: int) -> None:
    labels = labels.reshape(-1)
    bad = ((labels < 0) | (labels >= num_classes)).nonzero().reshape(-1)
    if bad.numel():
        raise BadInputError(
            f"labels out of range [0, {num_classes}) at batch positions {bad.tolist()[:20]} "
            f"(values {labels[bad].tolist()[:20]})"
        )


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
        _check_labels(labels, 2**62)  # negative labels fail here; the upper bound once logits are known


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

    batch = (input_ids, token_type_ids, attention_mask, labels).
    """

    def __init__(self, temperature: float = 1.0) -> None:
        super().__init__()
        if not temperature > 0:
            raise BadInputError(f"temperature must be > 0, got {temperature}")
        self.loss_temperature = temperature

    @staticmethod
    def _logits(model, weights, buffers, input_ids, token_type_ids, attention_mask):
        kwargs = {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": attention_mask}
        out = functional_call(model, (weights, buffers), args=(), kwargs=kwargs)
        return out.logits if hasattr(out, "logits") else out

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
        _check_labels(batch[3], 2**62)


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
