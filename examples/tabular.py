"""Tabular MLPs on scikit-learn's bundled data sets (evaluation cases of benchmarks/quality.py).

* breast cancer: 569 rows, 30 features, 2 classes; 400 train rows, 169 held out; a 30 → 32 → 2 MLP.
* wine: 178 rows, 13 features, 3 classes; 100 train rows, 78 held out; a 13 → 64 → 3 MLP (1,091
  parameters) — the case with n ≤ proj_dim (n = 100 < 128).

Features are standardized with the train rows' mean and standard deviation; the split is a fixed
permutation. Import paths: ``examples.tabular:cancer_model`` / ``cancer_train`` / ``cancer_targets`` and
``wine_model`` / ``wine_train`` / ``wine_targets`` (task ``image_classification``: plain (x, y) batches).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

NUM_TARGETS = 8
SPLITS = {"cancer": 400, "wine": 100}


@functools.lru_cache(maxsize=2)
def _data(name: str) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_breast_cancer, load_wine

    d = load_breast_cancer() if name == "cancer" else load_wine()
    perm = np.random.RandomState(0).permutation(len(d.target))
    x, y = d.data[perm].astype(np.float64), d.target[perm].astype(np.int64)
    n = SPLITS[name]
    mu, sd = x[:n].mean(0), x[:n].std(0) + 1e-8
    return ((x - mu) / sd).astype(np.float32), y


def _split(name: str, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _data(name)
    n = SPLITS[name]
    sl = slice(0, n) if train else slice(n, None)
    return torch.from_numpy(x[sl].copy()), torch.from_numpy(y[sl].copy())


def cancer_train():
    return _split("cancer", True)


def cancer_heldout():
    return _split("cancer", False)


def cancer_targets():
    x, y = cancer_heldout()
    return x[:NUM_TARGETS], y[:NUM_TARGETS]


def cancer_model() -> nn.Module:
    return nn.Sequential(nn.Linear(30, 32), nn.ReLU(), nn.Linear(32, 2))


def wine_train():
    return _split("wine", True)


def wine_heldout():
    return _split("wine", False)


def wine_targets():
    x, y = wine_heldout()
    return x[:NUM_TARGETS], y[:NUM_TARGETS]


def wine_model() -> nn.Module:
    return nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 3))


def train_full_batch(make_model, train: tuple, seed: int, rows=None, steps: int = 200, lr: float = 0.01) -> nn.Module:
    """Full-batch Adam on (inputs..., labels) — all rows, or the given indices; deterministic in seed."""
    torch.manual_seed(seed)
    model = make_model()
    if rows is not None:
        rows = torch.as_tensor(rows)
        train = tuple(t[rows] for t in train)
    *inputs, labels = train
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(*inputs), labels).backward()
        opt.step()
    return model.eval()
