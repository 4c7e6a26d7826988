"""Batches for causal language models (``task="causal_lm"``, :class:`trak_core.featurize.modelout.CausalLMModelOutput`).

A batch is ``(input_ids, attention_mask, labels)``, each [B, T], with transformers' conventions: labels -100 where
a token is not scored, label t predicted from the tokens before t. :func:`causal_lm_batch` builds one from token
lists; :func:`per_token_targets` turns target sequences into one target row per scored token.

Per-token attribution costs one target row per scored token: a target of L scored tokens is L rows to featurize
(each a forward and backward pass of the whole sequence) and L columns of scores, against one of each per
sequence. The train side is unchanged (train rows stay sequences).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from trak_core.errors import BadInputError
from trak_core.featurize.modelout import IGNORE_INDEX, CausalLMModelOutput


def causal_lm_batch(
    sequences: Sequence[Sequence[int]], length: int | None = None, pad_id: int = 0, padding_side: str = "right"
) -> tuple[Tensor, Tensor, Tensor]:
    """(input_ids, attention_mask, labels) [B, T] from token lists; every real token after a sequence's first is
    scored (labels = input_ids there, -100 at the first token and at padding).

    Args:
        sequences: token ids, each at least 2 and at most ``length`` long.
        length: T (default: the longest sequence).
        pad_id: the id written at padded positions (never scored, masked out).
        padding_side: ``"right"`` or ``"left"``.
    """
    if padding_side not in ("right", "left"):
        raise BadInputError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    if not sequences:
        raise BadInputError("causal_lm_batch: no sequences")
    lengths = [len(s) for s in sequences]
    t = max(lengths) if length is None else int(length)
    bad = [i for i, n in enumerate(lengths) if n < 2 or n > t]
    if bad:
        raise BadInputError(f"causal_lm_batch: sequences {bad[:20]} are not 2 to {t} tokens long")
    ids = torch.full((len(sequences), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), t), dtype=torch.long)
    labels = torch.full((len(sequences), t), IGNORE_INDEX, dtype=torch.long)
    for r, seq in enumerate(sequences):
        n = len(seq)
        cols = slice(0, n) if padding_side == "right" else slice(t - n, t)
        ids[r, cols] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[r, cols] = 1
        labels[r, cols] = ids[r, cols]
        labels[r, cols.start] = IGNORE_INDEX
    return ids, mask, labels


def per_token_targets(batch: Sequence[Tensor]) -> tuple[tuple[Tensor, Tensor, Tensor], Tensor]:
    """One target row per scored token: row (i, t) is sequence i with only label t scored, so its model output is
    log(p_t / (1 − p_t)), the margin of token t (see :class:`~trak_core.featurize.modelout.CausalLMModelOutput`).

    Args:
        batch: (input_ids, attention_mask, labels) [B, T] of target sequences.

    Returns:
        ((input_ids, attention_mask, labels) [R, T], rows): R = the number of scored tokens, in order of sequence
        then position; ``rows`` (R, 2) holds each row's (sequence index, position t).
    """
    CausalLMModelOutput().validate_batch(batch)
    input_ids, attention_mask, labels = batch
    scored = labels != IGNORE_INDEX
    scored[:, 0] = False  # never scored (the shift): validate_batch has checked the rest
    rows = scored.nonzero()
    seq, pos = rows[:, 0], rows[:, 1]
    one = torch.full((rows.shape[0], labels.shape[1]), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
    one[torch.arange(rows.shape[0], device=labels.device), pos] = labels[seq, pos]
    return (input_ids[seq], attention_mask[seq], one), rows
