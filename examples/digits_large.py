"""Larger models on the scikit-learn digits (evaluation cases of benchmarks/quality.py at realistic compression).

The same 1,500 train / 297 held-out split as ``trakflow_demo_data/digits.py``. Two models of a few hundred thousand
parameters, so that proj_dim 256–4096 compresses their gradients 70–1,700×, as TRAK on a ResNet does:

* ``mlp_model``: a deep, wide MLP 64 → 512 → 512 → 256 → 10 (ReLU), 429,834 parameters;
* ``bn_conv_model``: conv(1→32, 3×3) → BN → ReLU → conv(32→32, 3×3) → BN → ReLU → conv(32→64, 3×3, stride 2)
  → BN → ReLU → linear(64·4·4 → 256) → ReLU → linear(256 → 10), on the digits as 1×8×8 images, 293,290
  parameters (BatchNorm's running statistics are buffers: attribution runs the model in eval mode).

Import paths for the pipeline config::

    model:       examples.digits_large:mlp_model        or examples.digits_large:bn_conv_model
    train_data:  trakflow_demo_data.digits:train_data              or examples.digits_conv:train_data
    target_data: trakflow_demo_data.digits:target_data             or examples.digits_conv:target_data
    task:        image_classification
"""

from __future__ import annotations

from torch import nn


def mlp_model() -> nn.Module:
    """A fresh 64 → 512 → 512 → 256 → 10 MLP (429,834 parameters)."""
    return nn.Sequential(
        nn.Linear(64, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )


def bn_conv_model() -> nn.Module:
    """A fresh conv net with BatchNorm for 1×8×8 images (293,290 parameters)."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64 * 4 * 4, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )
