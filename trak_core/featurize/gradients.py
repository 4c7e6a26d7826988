"""Per-example gradients of a model output function.

``FunctionalGradientComputer`` vectorizes with ``torch.func`` (grad of ``task.get_output`` w.r.t. the
parameter dict, vmapped over the batch, buffers held fixed). ``IterativeGradientComputer`` is the loop
fallback for models torch.func cannot trace. Both return a dict {param name: (B, *shape)} restricted to
``grad_wrt`` (None: the trainable parameters, a PEFT model's adapters, see :func:`grad_param_names`), in the
model's parameter order; :func:`vectorize` flattens it to (B, grad_dim).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from trak_core.errors import BadInputError
from trak_core.featurize.adapters import adapter_param_names, is_peft_model
from trak_core.featurize.modelout import AbstractModelOutput, check_devices


def grad_param_names(model: torch.nn.Module, grad_wrt: Iterable[str] | None) -> list[str]:
    """Names of the parameters gradients are taken for, in the model's order; validates ``grad_wrt``.

    ``grad_wrt=None``: a PEFT model's adapter parameters (:func:`trak_core.featurize.adapters.adapter_param_names`,
    trainable
    or not); another model's trainable parameters (``requires_grad``), all of them when none is (a model frozen as
    a whole) or all are (the usual case)."""
    named = list(model.named_parameters())
    names = [n for n, _ in named]
    if grad_wrt is None:
        if is_peft_model(model):
            return adapter_param_names(model) or names
        trainable = [n for n, p in named if p.requires_grad]
        return trainable or names
    wanted = list(grad_wrt)
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise BadInputError(f"grad_wrt names parameters the model does not have: {unknown}")
    if not wanted:
        raise BadInputError("grad_wrt is empty")
    keep = set(wanted)
    return [n for n in names if n in keep]


def grad_dim_of(model: torch.nn.Module, grad_wrt: Iterable[str] | None = None) -> int:
    params = dict(model.named_parameters())
    return sum(params[n].numel() for n in grad_param_names(model, grad_wrt))


def vectorize(grads: dict[str, Tensor] | Tensor, device=None, dtype=None) -> Tensor:
    """Flatten {name: (B, *shape)} into (B, grad_dim) in dict order (a tensor passes through)."""
    if isinstance(grads, Tensor):
        out = grads
    else:
        parts = [g.reshape(g.shape[0], -1) for g in grads.values()]
        out = torch.cat(parts, dim=1)
    if device is not None or dtype is not None:
        out = out.to(device=device if device is not None else out.device, dtype=dtype or out.dtype)
    return out


class AbstractGradientComputer(ABC):
    def __init__(
        self,
        model: torch.nn.Module,
        task: AbstractModelOutput,
        grad_dim: int | None = None,
        dtype: torch.dtype = torch.float16,
        device="cpu",
        grad_wrt: Iterable[str] | None = None,
    ) -> None:
        self.model = model
        self.modelout_fn = task
        self.dtype = dtype
        self.device = device
        self.grad_wrt = list(grad_wrt) if grad_wrt is not None else None
        self.param_names = grad_param_names(model, self.grad_wrt)
        self.grad_dim = grad_dim if grad_dim is not None else grad_dim_of(model, self.grad_wrt)

    @abstractmethod
    def load_model_params(self, model: torch.nn.Module) -> None: ...

    @abstractmethod
    def compute_per_sample_grad(self, batch: Sequence[Tensor]) -> dict[str, Tensor]: ...

    def compute_loss_grad(self, batch: Sequence[Tensor]) -> Tensor:
        """Q for each example, shape (B,) (flattened)."""
        self._check_devices(batch)
        with torch.no_grad():
            q = self.modelout_fn.get_out_to_loss_grad(self.model, self._weights(), self._buffers(), batch)
        return q.reshape(-1)

    def _weights(self):
        return dict(self.model.named_parameters())

    def _check_devices(self, batch: Sequence[Tensor]) -> None:
        check_devices((w.device for w in self._weights().values()), batch)

    def _buffers(self):
        return dict(self.model.named_buffers())


class FunctionalGradientComputer(AbstractGradientComputer):
    """torch.func: ``vmap(grad(get_output))`` over the batch; only ``grad_wrt`` parameters are differentiated."""

    def __init__(self, model, task, grad_dim=None, dtype=torch.float16, device="cpu", grad_wrt=None) -> None:
        super().__init__(model, task, grad_dim, dtype, device, grad_wrt)
        self.load_model_params(model)

    def load_model_params(self, model: torch.nn.Module) -> None:
        self.model = model
        params = {n: p.detach() for n, p in model.named_parameters()}
        keep = set(self.param_names)
        self.func_weights = {n: p for n, p in params.items() if n in keep}
        self.fixed_weights = {n: p for n, p in params.items() if n not in keep}
        self.func_buffers = {n: b.detach() for n, b in model.named_buffers()}

    def _weights(self):
        return {**self.func_weights, **self.fixed_weights}

    def _buffers(self):
        return self.func_buffers

    def compute_per_sample_grad(self, batch: Sequence[Tensor], with_output: bool = False):
        """{name: (B, *shape)} per-example gradients of ``task.get_output``; with ``with_output``, (those, the
        outputs f (B,) of the same forward, detached)."""
        self._check_devices(batch)
        task, model, fixed = self.modelout_fn, self.model, self.fixed_weights

        def output(weights, buffers, *sample):
            return task.get_output(model, {**weights, **fixed}, buffers, *sample)

        per_sample = torch.func.vmap(
            torch.func.grad_and_value(output), in_dims=(None, None, *([0] * len(batch))), randomness="different"
        )
        grads, out = per_sample(self.func_weights, self.func_buffers, *batch)
        grads = {n: grads[n] for n in self.param_names}
        return (grads, out.detach().reshape(-1)) if with_output else grads


class IterativeGradientComputer(AbstractGradientComputer):
    """A per-example autograd loop. ``task.get_output`` is called on the whole batch and must return (B,)
    outputs (use :class:`IterativeImageClassificationModelOutput` or your own); ``grad_wrt`` is honoured."""

    def __init__(self, model, task, grad_dim=None, dtype=torch.float16, device="cpu", grad_wrt=None) -> None:
        super().__init__(model, task, grad_dim, dtype, device, grad_wrt)
        self.load_model_params(model)

    def load_model_params(self, model: torch.nn.Module) -> None:
        self.model = model
        named = dict(model.named_parameters())
        self.params = [named[n] for n in self.param_names]

    def compute_per_sample_grad(self, batch: Sequence[Tensor]) -> dict[str, Tensor]:
        self._check_devices(batch)
        with torch.enable_grad():
            outputs = self.modelout_fn.get_output(self.model, None, None, *batch)
            if outputs.dim() != 1 or outputs.shape[0] != batch[0].shape[0]:
                raise BadInputError(
                    "IterativeGradientComputer needs a task whose get_output returns one output per example "
                    f"(shape (B,)), got shape {tuple(outputs.shape)}"
                )
            rows = []
            for i in range(outputs.shape[0]):
                g = torch.autograd.grad(
                    outputs[i], self.params, retain_graph=i + 1 < outputs.shape[0], allow_unused=True
                )
                rows.append([torch.zeros_like(p) if gi is None else gi for gi, p in zip(g, self.params, strict=True)])
        return {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(self.param_names)}
