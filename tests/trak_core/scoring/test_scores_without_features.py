"""Scores from the projected gradients without features (the store keeps no Φ):
X (A Gᵀ) streamed through trak_core.scoring.streaming, as finalize_scores and the pipeline compute it, against the plain
unpipelined loop (bit for bit), the features path Φ Gᵀ = (X A) Gᵀ (Φ on demand, and Φ rounded to float16 as traker
stores it) and a float64 brute force, for 1–3 checkpoints, float16/float32 stores and block sizes that do not
divide n."""

import numpy as np
import pytest
import torch

from trak_core.scoring.combine import combine_checkpoints
from trak_core.solve import reduce
from trak_core.store import StoreMetadata, TrakStore

N, P, M, LAM = 300, 24, 9, 0.5


def featurized_store(path, dtype: str, ckpts: int, finalize: bool = True) -> TrakStore:
    """X, Q, the XᵀX partials and G written for ``ckpts`` checkpoints; the inverse only with ``finalize``."""
    rng = np.random.default_rng(11)
    meta = StoreMetadata(train_set_size=N, grad_dim=100, proj_dim=P, dtype=dtype, chunk_rows=16)
    st = TrakStore.create_or_open(str(path), meta)
    st.init_experiment("e", M)
    for mid in range(ckpts):
        st.init_model(mid)
        x = rng.standard_normal((N, P)) * rng.uniform(0.2, 3.0, P)  # columns of different scales
        st.write_train_rows(mid, slice(0, N), x.astype(np.float32), rng.uniform(0.1, 1, N).astype(np.float32))
        for s in range(st.meta.num_shards):
            reduce.ensure_partial(st, mid, s)
        if finalize:
            reduce.finalize_model(st, mid, lambda_reg=LAM)
        st.init_experiment_model("e", mid)
        st.write_target_rows("e", mid, slice(0, M), rng.standard_normal((M, P)).astype(np.float32))
    return st


def inverses(st: TrakStore, ckpts: int) -> dict[int, np.ndarray]:
    return {mid: reduce.solve_model(st, mid, LAM)[0] for mid in range(ckpts)}


def brute_force(st: TrakStore, ckpts: int) -> np.ndarray:
    """float64 throughout, from the stored (rounded) X, Q and G: A = (XᵀX + λI)⁻¹ / mean|·|, S = combine(Σ X A Gᵀ)."""
    acc, qsum = np.zeros((N, M)), np.zeros(N)
    for mid in range(ckpts):
        x = st.model(mid).grads[:].astype(np.float64)
        g = st.target_grads("e", mid)[:].astype(np.float64)
        a = np.linalg.inv(x.T @ x + LAM * np.eye(P))
        a /= np.abs(a).mean()
        acc += (x @ a) @ g.T
        qsum += st.model(mid).out_to_loss[:].astype(np.float64)
    return combine_checkpoints(acc, qsum, ckpts)


def plain_grads_loop(st: TrakStore, ckpts: int, step: int) -> np.ndarray:
    """The unpipelined X·W loop: per block, fresh float32 copies, one addmm_ per checkpoint, then the combination."""
    inv = inverses(st, ckpts)
    w = {mid: torch.mm(torch.from_numpy(inv[mid]).float(), reduce.load_targets(st, "e", [mid])[mid]) for mid in inv}
    out = np.empty((N, M), dtype=np.float32)
    for a in range(0, N, step):
        b = min(a + step, N)
        acc = torch.zeros(b - a, M)
        qsum = np.zeros(b - a)
        for mid in range(ckpts):
            acc.addmm_(torch.from_numpy(st.model(mid).grads[a:b].astype(np.float32)), w[mid])
            qsum += st.model(mid).out_to_loss[a:b].astype(np.float64)
        out[a:b] = combine_checkpoints(acc.numpy(), qsum.astype(np.float32), ckpts)
    return out


def rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got.astype(np.float64) - want).max() / np.abs(want).max())


@pytest.mark.parametrize("dtype,ckpts", [("float16", 1), ("float16", 3), ("float32", 1), ("float32", 2)])
@pytest.mark.parametrize("block_rows", [None, 7, 64, 1000])
def test_finalize_scores_match_features_path_and_float64(tmp_path, dtype, ckpts, block_rows):
    st = featurized_store(tmp_path / "s", dtype, ckpts)
    got = reduce.finalize_scores(st, "e", block_rows=block_rows).copy()
    np.testing.assert_array_equal(st.scores("e")[:], got)  # the store holds the returned bits
    assert st.scored_with("e") == list(range(ckpts))
    exact = brute_force(st, ckpts)
    assert rel(got, exact) < 5e-6  # X (A Gᵀ) is float32 round-off away from the float64 scores
    # traker's path Φ Gᵀ, Φ = X A computed on demand (float32) and as traker stores it (rounded to the dtype)
    acc, acc_stored, qsum = np.zeros((N, M)), np.zeros((N, M)), np.zeros(N)
    for mid in range(ckpts):
        phi = reduce.features_rows(st, mid)
        g = st.target_grads("e", mid)[:].astype(np.float64)
        acc += phi.astype(np.float64) @ g.T
        acc_stored += phi.astype(dtype).astype(np.float64) @ g.T
        qsum += st.model(mid).out_to_loss[:].astype(np.float64)
    via_features = combine_checkpoints(acc, qsum, ckpts)
    via_stored = combine_checkpoints(acc_stored, qsum, ckpts)
    assert rel(via_features, exact) < 5e-6 and rel(got, via_features) < 1e-5
    if dtype == "float16":  # the features' float16 rounding is visible; the X·W path does not have it
        assert rel(got, exact) < rel(via_stored, exact) / 5


@pytest.mark.parametrize("ckpts", [1, 3])
@pytest.mark.parametrize("block_rows", [None, 7, 48, 1000])
def test_finalize_scores_bit_identical_to_plain_loop(tmp_path, ckpts, block_rows):
    """The pipelined X·W stream computes exactly the plain loop's arithmetic, whatever the block size (the stored
    inverse and G·A are the bits solve_model and grads_right_hand give); no features array is written."""
    st = featurized_store(tmp_path / "s", "float16", ckpts)
    want = plain_grads_loop(st, ckpts, st.meta.shard_rows)
    got = reduce.finalize_scores(st, "e", block_rows=block_rows)
    np.testing.assert_array_equal(got, want)
    assert all("features" not in st.model(mid).group for mid in range(ckpts))
