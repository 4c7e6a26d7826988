"""A seconds-fast synthetic example (used by the tests): 64 train rows, 8 targets, 8 features,
3 classes, an 8 → 6 → 3 MLP (75 parameters). Deterministic."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

NUM_TRAIN = 64
NUM_TARGETS = 8


def _make(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 3, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(n, 8, generator=g)
    y = (x @ w + 0.5 * torch.randn(n, 3, generator=g)).argmax(dim=1)
    return x, y.long()


def train_data() -> tuple[torch.Tensor, torch.Tensor]:
    return _make(NUM_TRAIN, 0)


def target_data() -> tuple[torch.Tensor, torch.Tensor]:
    return _make(NUM_TARGETS, 1)


def bad_labels() -> tuple[torch.Tensor, torch.Tensor]:
    """Train data whose labels are floats (rejected by the image-classification task)."""
    x, y = _make(NUM_TRAIN, 0)
    return x, y.float()


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3))


def as_image(row) -> np.ndarray:
    return np.asarray(row, dtype=np.float32).reshape(2, 4)


def save_checkpoints(folder, seeds=(0, 1)) -> list[str]:
    """Randomly initialized checkpoints (one per seed) as state_dict files; returns their paths."""
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in seeds:
        torch.manual_seed(s)
        p = folder / f"model_{s:03d}.pt"
        torch.save(make_model().state_dict(), p)
        paths.append(str(p))
    return paths
