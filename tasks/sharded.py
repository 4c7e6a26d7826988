"""One (checkpoint, shard) featurized by ``processes_per_task`` processes with the model sharded across them
(torch FSDP2; :mod:`trak_core.featurize.sharded`): the task starts the processes (one per GPU: rank r uses cuda:r; gloo
on
the CPU), waits for them, and re-raises the first rank's error. Rank 0 is the store's one writer for the shard; the
store's flags make it resume after a crash like any shard."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException, ProcessRaisedException

from trak_core import engine
from trak_core.errors import BadInputError, TrakError
from trak_core.featurize import sharded
from trak_core.plan import read_checkpoint
from trak_core.store import model_array

from .common import cached_data, open_store
from .config import AttributeConfig

#: how the ranks are started: "forkserver" (a server process started once, torch and the model's module imported
#: there; each rank is a fork of it: safe with CUDA and with the threads of the task runner, and only the first
#: shard of a process pays the imports)
START_METHOD = "forkserver"
#: how long a rank waits for the others in a collective before it fails (a lost rank)
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unused(*_):  # the featurizer of a complete shard is never built
    raise AssertionError("a complete shard is not featurized again")


def featurize_shard(config: AttributeConfig, model_id: int, checkpoint: str, shard: int, projector: Callable) -> bool:
    """Featurize one shard with ``config.processes_per_task`` ranks. ``projector(config, meta, device, model)``:
    the store's projector for the model (tasks.core's). Returns True when the store held the shard already (a
    missing XᵀX partial is then computed here from the stored rows, as an unsharded task does)."""
    store = open_store(config)
    a, b = store.meta.shard_range(shard)
    device = config.resolved_device()
    if store.read_rows(model_array(model_id, "featurized"), slice(a, b)).astype(bool).all():
        return engine.featurize_shard(store, model_id, shard, _unused, _unused, config.batch_size, device=device)
    engine.require_not_finalized(store, model_id)
    n = config.processes_per_task
    if device == "cuda" and torch.cuda.device_count() < n:
        raise BadInputError(
            f"processes_per_task: {n} processes need {n} GPUs (one each), this worker sees "
            f"{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES)"
        )
    if START_METHOD == "forkserver":  # (read once, when this process starts its fork server)
        import multiprocessing

        model_module = config.model.split(":")[0]
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed.fsdp", "tasks.sharded", model_module])
    with tempfile.TemporaryDirectory(prefix="trakflow-ranks-") as tmp:
        try:
            mp.start_processes(
                _rank_main,
                args=(n, _free_port(), config, model_id, checkpoint, shard, tmp, projector),
                nprocs=n,
                start_method=START_METHOD,
            )
        except ProcessException as e:
            lines = str(e).strip().splitlines() or [type(e).__name__]
            first = lines[-1] if isinstance(e, ProcessRaisedException) else lines[0]  # the error, not its traceback
            raise _rank_error(tmp, n) or RuntimeError(
                f"featurize model_id={model_id} shard {shard}: its {n} processes stopped (first seen: {first}); "
                "what was written is kept, rerun to resume"
            ) from None
    return False


def _rank_error(tmp: str, n: int) -> BaseException | None:
    """The trakflow error (bad input, a store's state) a rank recorded, the lowest rank's; None for others (a rank
    that lost another sees a connection error, which is not the cause)."""
    for r in range(n):
        path = os.path.join(tmp, f"rank{r}.err")
        if os.path.exists(path):
            with open(path, "rb") as f:
                try:
                    err = pickle.load(f)
                except Exception:  # noqa: BLE001 - an error that does not unpickle
                    continue
            if isinstance(err, TrakError):
                return err
    return None


def _rank_main(
    rank: int,
    n: int,
    port: int,
    config: AttributeConfig,
    model_id: int,
    checkpoint: str,
    shard: int,
    tmp: str,
    projector,
) -> None:
    device = config.resolved_device()
    if device == "cuda":
        torch.cuda.set_device(rank)
        device, backend = f"cuda:{rank}", "nccl"
    else:
        backend = "gloo"
        torch.set_num_threads(max(1, torch.get_num_threads() // n))
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n, timeout=COLLECTIVE_TIMEOUT
    )
    try:
        store = open_store(config) if rank == 0 else open_store(config, mode="r")
        model = config.build_model()
        model.load_state_dict(read_checkpoint(checkpoint, "cpu"))
        model.eval()
        proj = projector(config, store.meta, device, model)  # from the full model's shapes, before it is sharded
        from torch.distributed.device_mesh import init_device_mesh

        # each unit moved to the device as it is sharded: a rank holds 1/n of the model there, never all of it
        sharded.shard_model(model, init_device_mesh("cuda" if backend == "nccl" else "cpu", (n,)))
        data = cached_data(config.train_data, "train_data")
        sharded.featurize_shard(
            store if rank == 0 else None,
            model_id,
            shard,
            lambda: sharded.ShardedFeaturizer(model, config.build_task(), proj, device),
            lambda a, b: [t[a:b] for t in data],
            config.batch_size,
            device=device,
        )
    except BaseException as e:
        if isinstance(e, TrakError):
            try:
                with open(os.path.join(tmp, f"rank{rank}.err"), "wb") as f:
                    pickle.dump(e, f)
            except Exception:  # noqa: BLE001, S110 - an error that does not pickle: the parent reports the exit
                pass
        raise
    finally:
        dist.destroy_process_group()
