"""The factored projector's fast path through ``nn.Embedding`` subclasses whose forward does more than look rows up.

A plain ``nn.Embedding`` is served by a forward hook that reads the ids from the module's input and adds
P_out[ids] Z P_inᵀ to its output. A subclass may take something else as input or transform the rows: OPT's and
BioGPT's learned positions take the attention mask (or position ids) and add an offset before the lookup; Gemma's
scaled word embedding multiplies the rows by √dim after it. There the term must be added where the table is read.
During the fast path's vmapped forward, :class:`EmbeddingHooks` (a ``TorchFunctionMode``) catches each
``F.embedding(ids, weight, ...)`` whose ``weight`` is a registered block's weight tensor (matched by identity: the
tensor ``functional_call`` puts in the module) and adds the term for the ids of that call, so whatever the forward
does around the lookup, ∂f/∂Z is the projected gradient of the table. A block whose weight reached no such call is
reported as not fired (the caller then substitutes it); a use outside the lookup is found by the caller's check.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

#: the use kind of a block's embedding module (see :func:`trak_core.projection.layout.matrix_uses`)
EMBEDDING = "embedding"


def looks_up_inside(mod: nn.Module) -> bool:
    """True for an ``nn.Embedding`` whose class redefines ``forward`` (its input need not be the ids, its output
    need not be the rows): served by :class:`EmbeddingHooks` instead of a forward hook."""
    return isinstance(mod, nn.Embedding) and type(mod).forward is not nn.Embedding.forward


class EmbeddingHooks(TorchFunctionMode):
    """Adds the registered blocks' terms to the ``F.embedding`` calls that read their tables. ``blocks``:
    [(block, hook)], hook(module-like, (ids,), rows) → rows + term, the forward hook of a plain embedding
    (:func:`trak_core.projection.factored._make_hook`); call :meth:`bind` with the tensors the model gets before each
    forward
    run under the mode."""

    def __init__(self, blocks: list[tuple[object, Callable]]) -> None:
        super().__init__()
        self.blocks = blocks
        self._weights: list = []

    def bind(self, weights: dict) -> None:
        """The tensors standing for each block's table in this forward, matched by identity."""
        self._weights = [(weights[b.params[0]], hook) for b, hook in self.blocks]  # type: ignore[attr-defined]

    def __torch_function__(self, func, types_=(), args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is not F.embedding or len(args) < 2:
            return out
        ids, weight = args[0], args[1]
        hook = next((h for w, h in self._weights if w is weight), None)
        if hook is None:
            return out
        pad = kwargs.get("padding_idx", args[2] if len(args) > 2 else None)
        if pad is not None and pad < 0:
            pad += weight.shape[0]
        return hook(types.SimpleNamespace(padding_idx=pad), (ids,), out)
