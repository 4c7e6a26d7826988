"""The embedded default: scikit-learn's handwritten digits (8×8 images shipped inside scikit-learn)
and a small MLP (64 → 32 → 10, 2,410 parameters).

Import paths for the pipeline config (see ``tasks.config``)::

    model:       trakflow_demo_data.digits:make_model
    train_data:  trakflow_demo_data.digits:train_data     # (1500, 64) float32 pixels, (1500,) int64 labels
    target_data: trakflow_demo_data.digits:target_data    # 5 held-out digits
    show:        trakflow_demo_data.digits:as_image       # a row back to its 8×8 image

Pixels are scaled from 0..16 to [-1, 1]. The 1,797 digits are permuted with a fixed seed; the first
1,500 are the train set, the next ones are held out (the targets are the first ``NUM_TARGETS``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
from torch import nn

NUM_TRAIN = 1500
NUM_TARGETS = 5
SPLIT_SEED = 0


@functools.lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data.astype(np.float32) / 8.0) - 1.0
    y = d.target.astype(np.int64)
    perm = np.random.RandomState(SPLIT_SEED).permutation(len(y))
    return x[perm], y[perm]


def train_data() -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs (1500, 64) float32, labels (1500,) int64)."""
    x, y = _digits()
    return torch.from_numpy(x[:NUM_TRAIN].copy()), torch.from_numpy(y[:NUM_TRAIN].copy())


def heldout_data() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _digits()
    return torch.from_numpy(x[NUM_TRAIN:].copy()), torch.from_numpy(y[NUM_TRAIN:].copy())


def target_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``NUM_TARGETS`` held-out digits."""
    x, y = heldout_data()
    return x[:NUM_TARGETS], y[:NUM_TARGETS]


def write_query_inputs(demo_dir: str | Path = "trakflow_demo") -> Path:
    """``<demo_dir>/query.pt``, the inputs the ``query/digits`` deployment asks about: the held-out targets
    (``torch.save(target_data(), ...)``), written when absent (a file put there by hand is kept)."""
    path = Path(demo_dir) / "query.pt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(target_data(), path)
    return path


def make_model() -> nn.Module:
    """A fresh 64 → 32 → 10 MLP (seed torch before calling it for a reproducible init)."""
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def as_image(row) -> np.ndarray:
    """One input row back to its 8×8 image (for the report's PNGs)."""
    return np.asarray(row, dtype=np.float32).reshape(8, 8)


def demo_configs(
    demo_dir: str | Path = "trakflow_demo",
    num_models: int = 3,
    epochs: int = 4,
    proj_dim: int = 512,
    lambda_reg: float | str = "adaptive",
):
    """(TrainConfig, AttributeConfig dict) of the demo; the attribute config is returned as a dict because
    its validation needs the checkpoints to exist, which the train flow makes first.

    Why these numbers: TRAK weighs each train example by Q = 1 - p(correct class), so a model trained to
    ~100 % train accuracy gives nearly all weight to its few misfit examples, and those then top every
    target's proponents whatever its class. Four epochs at lr 0.01 (about 90 % train accuracy) keep Q
    spread out. Measured on 50 held-out digits with 3 checkpoints (lambda_reg 1.0, dense): 0.93 of the
    top-5 proponents share the target's label (0.29 after 15 epochs at lr 0.05, 99.6 % train accuracy).
    lambda_reg "adaptive" (the default; on these far-from-converged checkpoints its ``cresid`` part sets λ) scores
    LDS 0.373 against 0.215 with "auto" on the demo's own checkpoints (benchmarks/RESULTS.md, "Attribution
    quality", the digits demo check)."""
    from tasks.config import TrainConfig

    demo_dir = Path(demo_dir).absolute()
    train = TrainConfig(
        model="trakflow_demo_data.digits:make_model",
        train_data="trakflow_demo_data.digits:train_data",
        out_dir=str(demo_dir / "checkpoints"),
        num_models=num_models,
        epochs=epochs,
        batch_size=64,
        optimizer="sgd",
        lr=0.01,
        momentum=0.9,
        subset_fraction=1.0,
        alpha_every=2,
        device="cpu",
    )
    attribute = dict(
        model="trakflow_demo_data.digits:make_model",
        train_data="trakflow_demo_data.digits:train_data",
        target_data="trakflow_demo_data.digits:target_data",
        task="image_classification",
        checkpoints=str(demo_dir / "checkpoints" / "manifest.json"),
        store=str(demo_dir / "store.zarr"),
        exp_name="digits",
        proj_dim=proj_dim,
        lambda_reg=lambda_reg,
        dtype="float32",
        batch_size=100,
        shard_size=500,
        chunk_rows=100,
        device="cpu",
        top_k=5,
        report_targets=NUM_TARGETS,
        report_dir=str(demo_dir / "report"),
        show="trakflow_demo_data.digits:as_image",
    )
    return train, attribute
