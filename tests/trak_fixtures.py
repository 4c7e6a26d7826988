"""Tiny models and data shared by the trak_core tests (plain module, imported by the test files)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

D_IN, HIDDEN, CLASSES = 8, 4, 3


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, CLASSES))


def make_data(n: int = 120, m: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    xt = torch.randn(m, D_IN, generator=g)
    yt = torch.randint(0, CLASSES, (m,), generator=g)
    return x, y, xt, yt


def checkpoints(k: int):
    return [make_model(100 + i).state_dict() for i in range(k)]


def run_traker(
    cls, save_dir, ckpts, data, *, batch=32, projector=None, half=False, lambda_reg=0.0, grad_wrt=None, **kw
):
    """The standard TRAK recipe, identical for traker 0.3.2 and our facade."""
    x, y, xt, yt = data
    n, m = x.shape[0], xt.shape[0]
    tr = cls(
        model=make_model(),
        task="image_classification",
        train_set_size=n,
        save_dir=str(save_dir),
        device="cpu",
        projector=projector,
        use_half_precision=half,
        lambda_reg=lambda_reg,
        grad_wrt=grad_wrt,
        logging_level=logging.ERROR,
        **kw,
    )
    for i, ck in enumerate(ckpts):
        tr.load_checkpoint(ck, model_id=i)
        for a in range(0, n, batch):
            b = min(a + batch, n)
            tr.featurize((x[a:b], y[a:b]), num_samples=b - a)
    tr.finalize_features()
    for i, ck in enumerate(ckpts):
        tr.start_scoring_checkpoint("exp", ck, i, m)
        for a in range(0, m, batch):
            b = min(a + batch, m)
            tr.score((xt[a:b], yt[a:b]), num_samples=b - a)
    return np.asarray(tr.finalize_scores("exp"), dtype=np.float64), tr


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def tiny_attribute_config(store, checkpoints, /, **over) -> dict:
    """The pipeline config the flow tests start from, as plain (JSON-able) values: examples.tiny (64 train
    rows, 8 targets), proj_dim 16, λ = 1e-3, batches of 8, shards of 16 rows in chunks of 8, CPU, no report.
    ``over`` replaces any field, ``store`` and ``checkpoints`` included (the first two are positional-only)."""
    cfg = dict(
        model="examples.tiny:make_model",
        train_data="examples.tiny:train_data",
        target_data="examples.tiny:target_data",
        checkpoints=checkpoints,
        store=str(store),
        exp_name="tiny",
        proj_dim=16,
        lambda_reg=1e-3,
        batch_size=8,
        shard_size=16,
        chunk_rows=8,
        device="cpu",
        report_targets=0,
    )
    cfg.update(over)
    return cfg


#: the repository's root and the tests' root folder, for tests in any subfolder of tests/
TESTS_ROOT = Path(__file__).resolve().parent
REPO_ROOT = TESTS_ROOT.parent


def set_gpu_limit(limit: int | None) -> None:
    """Create the Prefect API's concurrency limit on the tag ``trakflow-gpu`` (``limit`` tasks at once), or delete it
    (None)."""
    import asyncio

    from prefect.client.orchestration import get_client

    from tasks.common import GPU_TAG

    async def run():
        async with get_client() as client:
            if limit is None:
                await client.delete_concurrency_limit_by_tag(tag=GPU_TAG)
            else:
                await client.create_concurrency_limit(tag=GPU_TAG, concurrency_limit=limit)

    asyncio.run(run())
