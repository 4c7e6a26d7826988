"""PEFT models (LoRA and the other adapters of the ``peft`` package) as they come, recognized without importing peft.

* Gradients: by default with respect to the adapter parameters (:func:`adapter_param_names`: what the adapter
  state dict holds, LoRA's A and B and any ``modules_to_save`` copy), trainable or not, so a model loaded for
  inference (``PeftModel.from_pretrained(..., is_trainable=False)``) gives the gradient of the same parameters as
  the model in training. ``grad_wrt`` overrides it.
* Checkpoints: an adapter state dict (what ``save_pretrained`` writes to ``adapter_model.safetensors``, what
  ``peft.get_peft_model_state_dict`` returns: no base weights, no adapter name in its keys) or the model's full
  state dict. :func:`load_state` loads either; :func:`read_state_file` reads a ``.safetensors`` file or a
  ``torch.save`` file. An adapter checkpoint says nothing about the base model: the model given must carry the
  base weights the adapters were trained on.
"""

from __future__ import annotations

import os

import torch

from trak_core.errors import BadInputError


class AdapterStateError(BadInputError, RuntimeError):
    """A state dict that is neither a PEFT model's full state dict nor its adapter state dict (a RuntimeError too,
    as ``load_state_dict``'s own, so callers that name the checkpoint catch both)."""


def is_peft_model(model) -> bool:
    """True for a peft ``PeftModel`` (duck typing: ``peft_config`` and ``get_base_model``; no import)."""
    return isinstance(getattr(model, "peft_config", None), dict) and callable(getattr(model, "get_base_model", None))


def inner_model(model):
    """The model a peft wrapper calls (itself for any other model): its forward's signature is the one to read."""
    while is_peft_model(model):
        inner = model.get_base_model()
        if inner is model:
            break
        model = inner
    return model


def adapter_param_names(model) -> list[str]:
    """The parameters of a peft model's adapters, in the model's order: those with a name component equal to an
    adapter's name (``...lora_A.default.weight``, ``...modules_to_save.default.weight``)."""
    adapters = set(model.peft_config)
    return [n for n, _ in model.named_parameters() if adapters.intersection(n.split("."))]


def _adapter_keys(model) -> dict:
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def load_state(model: torch.nn.Module, state_dict: dict) -> None:
    """``model.load_state_dict(state_dict)`` (strict), or for a peft model given an adapter state dict, peft's
    ``set_peft_model_state_dict`` after checking that the keys are exactly the adapter's. Raises
    :class:`AdapterStateError` (a RuntimeError, as ``load_state_dict``'s) naming the missing and unexpected keys or
    the shapes that do not fit."""
    if not is_peft_model(model) or set(state_dict) == set(model.state_dict()):
        model.load_state_dict(state_dict)
        return
    from peft import set_peft_model_state_dict

    want = _adapter_keys(model)
    missing, unexpected = sorted(set(want) - set(state_dict)), sorted(set(state_dict) - set(want))
    if missing or unexpected:
        raise AdapterStateError(
            "neither the model's state dict nor its adapter state dict (get_peft_model_state_dict): "
            f"missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected keys "
            f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    bad = [
        f"{k}: {tuple(state_dict[k].shape)} against {tuple(v.shape)}"
        for k, v in want.items()
        if torch.is_tensor(state_dict[k]) and tuple(state_dict[k].shape) != tuple(v.shape)
    ]
    if bad:
        raise AdapterStateError(f"adapter state dict: size mismatch for {bad[:5]}")
    set_peft_model_state_dict(model, state_dict)


def read_state_file(path: str | os.PathLike, device: str = "cpu") -> dict:
    """A state dict from a file: ``.safetensors`` (what ``save_pretrained`` writes) or ``torch.save``'s format
    (``weights_only``). Errors are the readers' own."""
    if os.fspath(path).endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(os.fspath(path), device=device)
    return torch.load(path, map_location=device, weights_only=True)
