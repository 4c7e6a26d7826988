"""The ranks of the 2-process FSDP2 test (trak_core level, without the pipeline): started from a fork server, each
builds the tiny GPT-2 classifier, wraps it with FSDP2 and featurizes every shard of the store together with the
others (trak_core.featurize.sharded.featurize_shard; rank 0 writes), and featurizes a few rows of a sharded causal
LM."""

from __future__ import annotations

import multiprocessing
import os
import socket

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(
    rank: int,
    world: int,
    port: int,
    location: str,
    shards: int,
    batch_size: int,
    lm_out: str | None,
    bad_store: str | None,
) -> None:
    import sharded_models as sm

    from trak_core.featurize import sharded
    from trak_core.projection.factored import FactoredProjector
    from trak_core.store import TrakStore

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = sm.make_model()
        proj = FactoredProjector.from_model(model, 24, seed=0)
        sharded.shard_model(model)
        assert type(next(model.parameters())).__name__ == "DTensor"  # each rank holds a shard of each parameter
        store = TrakStore.open(location) if rank == 0 else None
        x, y = sm.train_data()
        for s in range(shards):
            sharded.featurize_shard(
                store,
                0,
                s,
                lambda: sharded.ShardedFeaturizer(model, "image_classification", proj),
                lambda a, b: [x[a:b], y[a:b]],
                batch_size,
            )
        if lm_out is not None:  # a causal LM whose head is tied to its token embedding, sharded: this rank's rows
            from test_causal_lm import gpt2_config, mixed_batch, sequences
            from transformers import GPT2LMHeadModel

            torch.manual_seed(0)
            lm = GPT2LMHeadModel(gpt2_config()).eval()
            lm_proj = FactoredProjector.from_model(lm, 40, seed=1)
            sharded.shard_model(lm)
            rows = slice(3 * rank, 3 * rank + 3)
            batch = [t[rows] for t in mixed_batch(sequences(6))]
            lx, lq = sharded.ShardedFeaturizer(lm, "causal_lm", lm_proj).featurize(
                batch, 0, range(rows.start, rows.stop)
            )
            np.save(f"{lm_out}/x{rank}.npy", lx)
            np.save(f"{lm_out}/q{rank}.npy", lq)
        if bad_store is not None:  # train row 4 (rank 1's first batch) has a label out of range: every rank stops
            yb = y.clone()
            yb[4] = 7
            try:
                sharded.featurize_shard(
                    TrakStore.open(bad_store) if rank == 0 else None,
                    0,
                    0,
                    lambda: sharded.ShardedFeaturizer(model, "image_classification", proj),
                    lambda a, b: [x[a:b], yb[a:b]],
                    batch_size,
                )
            except Exception as e:  # noqa: BLE001 - what each rank raised, for the test
                with open(f"{bad_store}.rank{rank}", "w") as f:
                    f.write(f"{type(e).__name__}: {e}")
    finally:
        dist.destroy_process_group()


def run_ranks(
    world: int, location: str, shards: int, batch_size: int, lm_out: str | None = None, bad_store: str | None = None
) -> None:
    """``world`` ranks featurize every shard of the store at ``location``; with ``lm_out``, each also featurizes 3
    rows of a sharded GPT2LMHeadModel into ``lm_out``/x{rank}.npy, q{rank}.npy; with ``bad_store``, they featurize
    its shard 0 with a label out of range in train row 4 and write what each raised to ``bad_store``.rank{r}."""
    multiprocessing.set_forkserver_preload(
        ["torch", "torch.distributed.fsdp", "sharded_models", "trak_core.featurize.sharded"]
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(
        _rank,
        args=(world, _port(), location, shards, batch_size, lm_out, bad_store),
        nprocs=world,
        start_method="forkserver",
    )
