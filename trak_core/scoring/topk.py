"""The top-k train rows per column of scores, one implementation for every reader: the index's queries (blocks of
rows streamed in any order) and the report's and the CLI's tables (a stored score array).

Each float32 score becomes an int64 key that sorts like the score (−0.0 counted as 0.0, NaN after every number at
either end) with the row index in its low 32 bits, so keys are distinct and equal scores rank by the lower row,
whatever order the blocks arrive in: the ranking of a stable sort (``np.argsort(-s, kind="stable")`` for the
proponents, ``np.argsort(s, kind="stable")`` for the opponents)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from trak_core.errors import BadInputError

__all__ = ["RunningTopK", "top_k"]

_LOW = (1 << 32) - 1
#: the key's high half for NaN: below every number for the proponents, above every number for the opponents
#: (an int32 NaN pattern, so :meth:`RunningTopK.result` gives NaN back)
_NAN_LOW, _NAN_HIGH = -(1 << 31), (1 << 31) - 1


class RunningTopK:
    """The k largest (or, ``opponents``, smallest) scores per column over blocks of rows added in any order."""

    def __init__(self, m: int, k: int, opponents: bool = False):
        self.m, self.k, self.opponents = int(m), int(k), bool(opponents)
        self._keys = torch.empty(0, self.m, dtype=torch.int64)

    def add(self, a: int, scores: np.ndarray | Tensor) -> None:
        """Rows [a, a + len(scores)) with their (rows, m) float32 scores."""
        s = torch.as_tensor(scores, dtype=torch.float32)
        if s.dim() != 2 or s.shape[1] != self.m:
            raise BadInputError(f"scores of shape {tuple(s.shape)}: expected (rows, {self.m})")
        bits = (s + 0.0).view(torch.int32).to(torch.int64)  # + 0.0: -0.0 becomes 0.0
        order = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # monotone in the float's value
        order = torch.where(s.isnan(), _NAN_HIGH if self.opponents else _NAN_LOW, order)
        rows = torch.arange(a, a + s.shape[0], dtype=torch.int64).unsqueeze(1)
        keys = (order << 32) + (rows if self.opponents else _LOW - rows)
        both = torch.cat([self._keys, keys]) if self._keys.numel() else keys
        take = min(self.k, both.shape[0])
        self._keys = torch.topk(both, take, dim=0, largest=not self.opponents, sorted=True).values

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(indices, scores), each (m, k), best first."""
        keys = self._keys.T.contiguous()
        hi = keys >> 32
        bits = hi ^ ((hi >> 31) & 0x7FFFFFFF)
        scores = bits.to(torch.int32).view(torch.float32)
        low = keys & _LOW
        rows = low if self.opponents else _LOW - low
        return rows.numpy().astype(np.int64), scores.numpy().copy()


def top_k(scores: np.ndarray | Tensor, k: int, opponents: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(indices, scores), each (m, min(k, n)), best first: the k largest (``opponents``: smallest) of each column
    of the (n, m) ``scores``, ranked as :class:`RunningTopK` ranks them."""
    s = torch.as_tensor(scores, dtype=torch.float32)
    if s.dim() != 2:
        raise BadInputError(f"scores of shape {tuple(s.shape)}: expected (rows, columns)")
    t = RunningTopK(s.shape[1], k, opponents)
    t.add(0, s)
    return t.result()
