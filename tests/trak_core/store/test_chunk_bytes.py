"""Zarr chunks are sized in bytes: a NoOpProjector on a multi-million-parameter model
featurizes within a few hundred MiB, as traker does (1,024 rows × proj_dim per chunk asked for GiBs)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from trak_core.store import CHUNK_TARGET_BYTES, MAX_CHUNK_ROWS, StoreMetadata, TrakStore, choose_chunk_rows


def test_choose_chunk_rows_bounds_bytes_rows_and_data():
    assert choose_chunk_rows(row_bytes=2 * 512, rows=100_000) == MAX_CHUNK_ROWS  # small rows: the row cap
    assert choose_chunk_rows(row_bytes=2 * 11_700_000, rows=100_000) == 1  # a ResNet-18 noop row: 22 MiB
    assert choose_chunk_rows(row_bytes=2 * 100_000, rows=100_000) == CHUNK_TARGET_BYTES // 200_000
    assert choose_chunk_rows(row_bytes=64, rows=40) == 40  # never more rows than the data has
    assert choose_chunk_rows(row_bytes=2 * 100_000, rows=100_000, multiple_of=4096) == 128  # divides the shard
    assert choose_chunk_rows(row_bytes=64, rows=40, multiple_of=16) == 16


def test_metadata_records_the_layout_and_every_chunk_is_bounded(tmp_path):
    meta = StoreMetadata(
        train_set_size=50, grad_dim=3_000_000, proj_dim=3_000_000, projector="noop", chunk_bytes=8 << 20
    )
    assert meta.chunk_rows == 1 and meta.shard_rows == 8
    st = TrakStore.create_or_open(str(tmp_path / "s"), meta)
    reopened = TrakStore.open(str(tmp_path / "s")).meta
    assert (reopened.chunk_rows, reopened.shard_rows, reopened.chunk_bytes) == (1, 8, 8 << 20)
    m = st.init_model(0)
    assert m.grads.chunks == (1, 3_000_000)  # one 6 MB row per chunk
    st.init_experiment("e", 100_000)
    scores, _ = st.init_scores("e")
    for arr in (m.grads, scores):
        nbytes = arr.dtype.itemsize
        for c in arr.chunks:
            nbytes *= c
        assert nbytes <= 8 << 20, (arr.chunks, nbytes)
    # writers of whole shards still own whole chunks: whole chunk_rows that divide the shard
    assert scores.chunks[0] % meta.chunk_rows == 0 and meta.shard_rows % scores.chunks[0] == 0
    small = StoreMetadata(train_set_size=50_000, grad_dim=10, proj_dim=8, chunk_rows=64, chunk_bytes=16 << 10)
    assert small.shard_rows == 512 and small.score_chunk_rows(16) == 256  # 16 KiB of 16 float32 targets
    assert small.score_chunk_rows(1) == 512  # at most a shard


def test_explicit_layout_is_kept_and_checked():
    meta = StoreMetadata(train_set_size=100, grad_dim=10, proj_dim=8, chunk_rows=5, shard_rows=10)
    assert (meta.chunk_rows, meta.shard_rows) == (5, 10)
    with pytest.raises(ValueError, match="multiple of chunk_rows"):
        StoreMetadata(train_set_size=100, grad_dim=10, proj_dim=8, chunk_rows=3, shard_rows=10)


SCRIPT = textwrap.dedent("""
    import json, logging, resource, sys, warnings
    import torch
    warnings.simplefilter("ignore")
    import trak_core
    from trak_core.projection.projectors import NoOpProjector
    torch.manual_seed(0)
    def hwm():  # this process's own high-water mark (KiB): ru_maxrss also holds the test process's, inherited
        try:
            return next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
        except OSError:  # no /proc: ru_maxrss (bytes on macOS)
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // (1024 if sys.platform == "darwin" else 1)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 1000), torch.nn.ReLU(),
                                torch.nn.Linear(1000, 10))
    n = 8
    x, y = torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))
    base = hwm()
    tr = trak_core.TRAKer(model=model, task="image_classification", train_set_size=n, save_dir=sys.argv[1],
                          device="cpu", projector=NoOpProjector(), logging_level=logging.ERROR)
    tr.load_checkpoint(model.state_dict(), model_id=0)
    for s in range(0, n, 4):
        tr.featurize((x[s:s + 4], y[s:s + 4]), num_samples=4)
    grads = tr.store.model(0).grads
    peak = hwm()
    print(json.dumps({"params": sum(p.numel() for p in model.parameters()), "chunks": list(grads.chunks),
                      "itemsize": grads.dtype.itemsize, "featurized": int(tr.store.featurized_mask(0).sum()),
                      "base_kib": base, "peak_kib": peak, "meta_chunk_bytes": tr.store.meta.chunk_bytes}))
""")


def test_noop_projector_on_a_3m_parameter_model_stays_within_a_few_hundred_mib(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "store")], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["params"] > 3_000_000 and r["featurized"] == 8
    chunk_bytes = r["itemsize"] * r["chunks"][0] * r["chunks"][1]
    assert r["chunks"][1] == r["params"]  # one row of 6 MiB fits the byte target: rows are not split
    assert r["chunks"][0] <= 8  # never more rows than the data has (was 1024 rows × proj_dim: 6 GiB)
    assert chunk_bytes <= r["meta_chunk_bytes"] == CHUNK_TARGET_BYTES
    grown_mib = (r["peak_kib"] - r["base_kib"]) / 1024
    assert grown_mib < 600, r  # measured ~370 MiB (was 5.9 GiB asked for one chunk); traker: ~120 MB for ResNet-18
