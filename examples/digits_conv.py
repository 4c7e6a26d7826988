"""A small conv net on the scikit-learn digits as 1×8×8 images (an evaluation case of benchmarks/quality.py).

The same 1,500 train / 297 held-out split as ``examples/digits.py``; the model is conv(1→8, 3×3) → ReLU →
conv(8→16, 3×3, stride 2) → ReLU → linear(16·4·4 → 10), 3,818 parameters.

Import paths for the pipeline config::

    model:       examples.digits_conv:make_model
    train_data:  examples.digits_conv:train_data
    target_data: examples.digits_conv:target_data
    task:        image_classification
"""

from __future__ import annotations

import torch
from torch import nn

from trakflow_demo_data import digits

NUM_TARGETS = digits.NUM_TARGETS


def _images(pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = pair
    return x.reshape(-1, 1, 8, 8).contiguous(), y


def train_data() -> tuple[torch.Tensor, torch.Tensor]:
    """(images (1500, 1, 8, 8) float32, labels (1500,) int64)."""
    return _images(digits.train_data())


def heldout_data() -> tuple[torch.Tensor, torch.Tensor]:
    return _images(digits.heldout_data())


def target_data() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = heldout_data()
    return x[:NUM_TARGETS], y[:NUM_TARGETS]


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    )


def train_model(seed: int = 0, rows=None, steps: int = 200, lr: float = 0.01) -> nn.Module:
    """Full-batch Adam on the train rows (all, or the given indices)."""
    from examples.tabular import train_full_batch

    return train_full_batch(make_model, train_data(), seed, rows, steps, lr)
