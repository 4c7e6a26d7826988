"""Scoped stand-ins for the few pieces of transformers models that ``torch.func.vmap`` or a 4-D attention mask
cannot run, applied to one model for the duration of one call (instance attributes, removed afterwards; the
classes and other models are never touched).

* Bloom's GELU is an ``autograd.Function`` without ``setup_context``, which functorch refuses: its forward is
  replaced by the same tanh formula (``bloom_gelu_forward``), whose autograd derivative is the one the Function's
  backward computes.
* Bloom's ALiBi bias is built from the 2-D padding mask (``build_alibi_tensor``) while the model gets the 4-D
  additive mask (:func:`trak_core.featurize.modelout.additive_mask`): the 2-D mask is read back from the 4-D one (the
  keys a
  sequence's last query may attend to are its real tokens).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

#: model → [(module, attribute, replacement)], found once per model
_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _bloom_gelu(mod: nn.Module):
    formula = getattr(sys.modules.get(type(mod).__module__), "bloom_gelu_forward", None)
    if formula is None:
        return None

    def forward(x: Tensor) -> Tensor:
        return formula(x)

    return forward


def _alibi_from_4d(mod: nn.Module):
    method = vars(type(mod)).get("build_alibi_tensor")  # the class's, never a stand-in set on the instance
    build: Callable = method.__get__(mod) if method is not None else mod.build_alibi_tensor  # type: ignore[assignment]

    def build_alibi_tensor(attention_mask: Tensor, num_heads: int, dtype: torch.dtype) -> Tensor:
        if attention_mask.dim() == 4:  # (B, 1, T, T) additive: the last query row marks the real keys
            attention_mask = (attention_mask[:, 0, -1, :] == 0).to(torch.long)
        return build(attention_mask, num_heads, dtype)

    return build_alibi_tensor


def _fixes(model: nn.Module) -> list:
    try:
        return _FOUND[model]
    except (KeyError, TypeError):
        pass
    found = []
    for mod in model.modules():
        name, where = type(mod).__name__, type(mod).__module__
        if not where.startswith("transformers."):
            continue
        if name == "BloomGelu" and (fwd := _bloom_gelu(mod)) is not None:
            found.append((mod, "forward", fwd))
        if name == "BloomModel" and callable(getattr(mod, "build_alibi_tensor", None)):
            found.append((mod, "build_alibi_tensor", _alibi_from_4d(mod)))
    with contextlib.suppress(TypeError):
        _FOUND[model] = found
    return found


_LOCK = threading.Lock()
#: id(model) → how many calls are inside transformers_fixes (threads may share a model): set by the first, removed
#: by the last
_ACTIVE: dict[int, int] = {}


@contextlib.contextmanager
def transformers_fixes(model: nn.Module) -> Iterator[None]:
    """Apply the stand-ins this module knows to ``model``'s modules while the block runs."""
    fixes = _fixes(model)
    if not fixes:
        yield
        return
    with _LOCK:
        if _ACTIVE.get(id(model), 0) == 0:
            for mod, attr, value in fixes:
                object.__setattr__(mod, attr, value)
        _ACTIVE[id(model)] = _ACTIVE.get(id(model), 0) + 1
    try:
        yield
    finally:
        with _LOCK:
            _ACTIVE[id(model)] -= 1
            if _ACTIVE[id(model)] == 0:
                del _ACTIVE[id(model)]
                for mod, attr, _ in fixes:
                    mod.__dict__.pop(attr, None)
