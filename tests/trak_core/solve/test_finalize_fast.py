"""finalize's fast solve against float64 references: the LAPACK Cholesky inverse, the deff λ
from float32 eigenvalues checked against the exact effective dimension, and the partials summed from memory."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from trak_core.errors import IllConditionedWarning
from trak_core.solve import damping, reduce
from trak_core.solve.damping import parse_lambda_reg, resolve_lambda
from trak_core.store import StoreMetadata, TrakStore, mirror_upper


def _x(n: int, p: int, *, alpha: float = 0.0, rank: int | None = None, seed: int = 0) -> np.ndarray:
    """n × p rows (float32-representable) whose XᵀX has a power-law spectrum σᵢ ∝ i^-alpha (0: Gaussian), of
    the given rank (default min(n, p))."""
    g = np.random.default_rng(seed)
    r = rank or min(n, p)
    s = np.arange(1, r + 1, dtype=np.float64) ** (-alpha / 2)
    basis = np.linalg.qr(g.standard_normal((p, r)))[0]
    x = (g.standard_normal((n, r)) * s) @ basis.T
    return x.astype(np.float32).astype(np.float64)


def test_lapack_inverse_is_the_float64_inverse_and_exactly_symmetric():
    for p in (7, 300, 777):  # 777: panels of the mirror copy that do not divide p
        x = _x(2 * p, p, alpha=1.0, seed=p)
        a = x.T @ x
        lam = 1e-3 * np.trace(a) / p
        inv = damping.lapack_inverse(a, lam)
        ref = np.linalg.inv(a + lam * np.eye(p))
        assert inv.flags.c_contiguous and np.array_equal(inv, inv.T)
        np.testing.assert_allclose(inv, ref, rtol=1e-9, atol=1e-12 * np.abs(ref).max())
    bad = -np.eye(5)
    assert damping.lapack_inverse(bad, 0.0) is None


def test_mirror_upper_fills_the_lower_triangle():
    a = np.arange(49.0).reshape(7, 7)
    want = np.triu(a) + np.triu(a, 1).T
    np.testing.assert_array_equal(mirror_upper(a.copy(), block=3), want)
    from trak_core.solve import linalg_device as dl

    t = torch.from_numpy(a.copy())
    assert dl.mirror_upper(t) is t  # the device path's mirror, in place
    np.testing.assert_array_equal(t.numpy(), want)


CASES = [
    # (n, p, alpha, rank): n = p like the benchmark, n > 10 p (target = rank / 2), n < p (rank n), power laws
    (768, 768, 0.0, None),
    (12000, 640, 0.0, None),
    (400, 768, 0.0, None),
    (3000, 768, 1.0, None),
    (3000, 768, 1.5, None),
    (20000, 640, 1.0, None),
    (2000, 768, 2.0, None),
    (1500, 600, 3.0, None),  # λ far below float32 round-off of σ_max: Newton steps or the float64 path
]


@pytest.mark.parametrize("n,p,alpha,rank", CASES)
@pytest.mark.parametrize("c", [0.1, 0.3])
def test_fast_deff_lambda_matches_the_float64_rule(n, p, alpha, rank, c):
    x = _x(n, p, alpha=alpha, rank=rank, seed=n + p)
    a = x.T @ x
    ref = resolve_lambda(f"deff:{c}", torch.from_numpy(a), n_rows=n)
    out = damping.solve_deff_fast(a, [c], n)
    if out is None:  # it could not decide: solve_model takes the float64 path
        assert alpha >= 3.0, "the fast path should decide these spectra"
        return
    lam, inv, _ = out
    assert lam == pytest.approx(ref, rel=1e-3)
    np.testing.assert_allclose(inv, np.linalg.inv(a + lam * np.eye(p)), rtol=1e-6, atol=1e-9 * np.abs(inv).max())


def test_rank_deficient_with_many_rows_is_decided_exactly():
    """n ≫ p but rank r < p: the target min(c·n, r/2) needs the float64 rank; the fast path declines (its
    Cholesky rank test fails) and solve_model resolves λ on the float64 eigenvalues, as scoring does."""
    n, p, r = 6000, 640, 200
    x = _x(n, p, rank=r, seed=1)
    a = x.T @ x
    assert damping.solve_deff_fast(a, [0.1], n) is None
    st = _store_with_rows(None, x.astype(np.float32), chunk_rows=1000, shard_rows=2000)
    inv, info = reduce.solve_model(st, 0, "adaptive", rescale=False)
    assert info["lambda_reg"] == pytest.approx(_reference_lambda("adaptive", x, n), rel=1e-12)


def test_an_uncertain_rank_under_a_higher_floor_needs_no_float64_eigenvalues(monkeypatch):
    """Rank r < p with n ≫ p: the deff target min(c·n, r/2) depends on the rank, but when the exact d_eff at the
    other parts' λ (the floor) is already below the smallest target a possible rank gives, λ is the floor, found
    with one factorization; a floor under the deff λ still declines (the float64 path decides)."""
    n, p, r = 6000, 640, 200
    a = (x := _x(n, p, rank=r, seed=1)).T @ x
    ref = resolve_lambda("deff:0.1", torch.from_numpy(a), n_rows=n)
    lam, inv, ev = damping.solve_deff_fast(a, [0.1], n, 2.0 * ref)
    assert lam == 2.0 * ref
    np.testing.assert_allclose(inv, np.linalg.inv(a + lam * np.eye(p)), rtol=1e-6, atol=1e-9 * np.abs(inv).max())
    assert damping.solve_deff_fast(a, [0.1], n, 0.5 * ref) is None
    # through solve: a rel part whose λ (twice the deff one) decides, and no float64 eigendecomposition
    rule = parse_lambda_reg(f"deff:0.1,rel:{2.0 * ref * p / np.trace(a):.6f}")
    want = rule.resolve(torch.from_numpy(a), n_rows=n)
    assert want == pytest.approx(2.0 * ref, rel=1e-5)
    monkeypatch.setattr(damping, "symmetric_eigenvalues", lambda m: pytest.fail("float64 eigenvalues computed"))
    _, info = damping.solve(a, n, rule, rescale=False)
    assert info["lambda_reg"] == pytest.approx(want, rel=1e-12)


def _reference_lambda(setting, x: np.ndarray, n: int) -> float:
    """The float64 rule on all rows (float64 eigenvalues; Xᵀq, qᵀq with q = 1 where the rule needs them)."""
    rule = parse_lambda_reg(setting)
    xd = np.asarray(x, dtype=np.float64)
    kw = {}
    if rule.needs_xtq:
        kw = {"xtq": xd.sum(axis=0), "qtq": float(n)}
    rn = (xd**2).sum(axis=1)
    if rule.needs_row_norm4:
        kw["row_norm4"] = float(rn @ rn)
    if rule.needs_q2x2:
        kw["q2x2"] = float(rn.sum())  # q = 1 per row
    return rule.resolve(torch.from_numpy(xd.T @ xd), n_rows=n, **kw)


def test_deff_with_another_part_takes_the_larger_lambda():
    """λ = max(lam_floor, deff λ): a floor above the deff λ is returned exactly, one below it leaves the deff λ."""
    n, p = 3000, 768
    x = _x(n, p, alpha=1.0, seed=2)
    a = x.T @ x
    ref = resolve_lambda("deff:0.1", torch.from_numpy(a), n_rows=n)
    assert damping.solve_deff_fast(a, [0.1], n, 3.0 * ref)[0] == 3.0 * ref
    assert damping.solve_deff_fast(a, [0.1], n, 0.5 * ref)[0] == pytest.approx(ref, rel=1e-4)
    two = damping.solve_deff_fast(a, [0.1, 0.3], n)[0]  # the larger deff λ: the smaller fraction
    assert two == pytest.approx(ref, rel=1e-4)


def _store_with_rows(
    path, x: np.ndarray, *, chunk_rows: int, shard_rows: int, partials: bool = True, **meta_fields
) -> TrakStore:
    import tempfile

    n, p = x.shape
    meta = StoreMetadata(
        train_set_size=n,
        grad_dim=10 * p,
        proj_dim=p,
        dtype="float32",
        chunk_rows=chunk_rows,
        shard_rows=shard_rows,
        **meta_fields,
    )
    st = TrakStore.create_or_open(str(path or tempfile.mkdtemp()) + "/s", meta)
    st.init_model(0)
    st.write_train_rows(0, slice(0, n), x, np.ones(n, dtype=np.float32))
    if partials:
        for s in range(meta.num_shards):
            reduce.ensure_partial(st, 0, s)
    return st


@pytest.mark.parametrize("setting", ["adaptive", 0.5])
def test_finalize_sums_partials_from_memory_like_the_stored_ones(tmp_path, setting):
    """finalize_model computing the partials itself (summed from memory, written in the background) gives the
    same stored partials, λ and inverse, bit for bit, as finalizing from partials computed beforehand; the
    inverse is (XᵀX + λI)⁻¹ / mean|·| and the features on demand X times it to float32 round-off."""
    n, p = 2500, 600
    x = _x(n, p, alpha=1.0, seed=5).astype(np.float32)
    a = _store_with_rows(tmp_path / "a", x, chunk_rows=250, shard_rows=1000, partials=False)
    b = _store_with_rows(tmp_path / "b", x, chunk_rows=250, shard_rows=1000, partials=True)
    ia = reduce.finalize_model(a, 0, setting)
    ib = reduce.finalize_model(b, 0, setting)
    assert ia == ib
    assert a.model(0).partial_done[:].all()
    np.testing.assert_array_equal(a.model(0).xtx_partials[:], b.model(0).xtx_partials[:])
    np.testing.assert_array_equal(a.model(0).rowsum_partials[:], b.model(0).rowsum_partials[:])
    # the damping's sums over rows from the shard partials: the bits of a pass over the stored rows, and float64 math
    sums, ref = reduce.total_row_sums(a, 0), reduce.rows_row_sums(a, 0)
    np.testing.assert_array_equal(sums.xtq, ref.xtq)
    assert (sums.qtq, sums.row_norm4, sums.q2x2) == (ref.qtq, ref.row_norm4, ref.q2x2)
    x64 = x.astype(np.float64)
    rn = (x64**2).sum(axis=1)
    assert sums.qtq == float(n)  # q = 1 per row here
    np.testing.assert_allclose(sums.xtq, x64.sum(axis=0), rtol=1e-12, atol=1e-9)
    assert sums.row_norm4 == pytest.approx(float(rn @ rn), rel=1e-12)
    assert sums.q2x2 == pytest.approx(float(rn.sum()), rel=1e-12)
    np.testing.assert_array_equal(a.inverse(0), b.inverse(0))
    xd = x.astype(np.float64)
    lam = ia["lambda_reg"]
    if setting == "adaptive":
        assert lam == pytest.approx(_reference_lambda("adaptive", x, n), rel=1e-3)
    inv = np.linalg.inv(xd.T @ xd + lam * np.eye(p))
    np.testing.assert_allclose(a.inverse(0), inv / np.abs(inv).mean(), rtol=1e-6)  # stored in float32
    want = xd @ (inv / np.abs(inv).mean())
    np.testing.assert_allclose(reduce.features_rows(a, 0), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    assert 1.0 <= ia["condition"] < 1e7


@pytest.mark.parametrize("stored", [[0, 1, 2, 3, 4], [1, 2, 4], [0], [3, 4], []])
def test_finalize_reads_stored_partials_ahead_and_sums_in_shard_order(tmp_path, monkeypatch, stored):
    """Stored partials are read ahead into reused buffers (fewer buffers than shards here), the missing ones
    computed on the way: XᵀX has the bits of total_xtx (the shard partials summed in shard order) and the
    inverse the bits of a store whose partials were all computed beforehand (none stored: the unpacked sum)."""
    monkeypatch.setattr(reduce, "READ_AHEAD", 1)
    n, p = 1250, 64
    x = _x(n, p, alpha=1.0, seed=3).astype(np.float32)
    a = _store_with_rows(tmp_path / "a", x, chunk_rows=250, shard_rows=250, partials=False)
    b = _store_with_rows(tmp_path / "b", x, chunk_rows=250, shard_rows=250, partials=True)
    for s in stored:
        reduce.ensure_partial(a, 0, s)
    seen = {}
    real = reduce.solve

    def spy(xtx, *args, **kw):
        seen["xtx"] = np.array(xtx)
        return real(xtx, *args, **kw)

    monkeypatch.setattr(reduce, "solve", spy)
    assert reduce.finalize_model(a, 0, 0.5) == reduce.finalize_model(b, 0, 0.5)
    np.testing.assert_array_equal(seen["xtx"], reduce.total_xtx(b, 0))
    np.testing.assert_array_equal(a.inverse(0), b.inverse(0))
    np.testing.assert_array_equal(a.model(0).xtx_partials[:], b.model(0).xtx_partials[:])


def test_fast_condition_estimate_is_close_to_the_exact_one():
    n, p = 3000, 768
    x = _x(n, p, alpha=1.0, seed=9)
    a = x.T @ x
    lam, inv, ev = damping.solve_deff_fast(a, [0.1], n)
    _, cond = damping.cholesky_inverse(torch.from_numpy(a), lam, n, eigenvalues=ev, inverse=inv)
    assert cond == pytest.approx(np.linalg.cond(a + lam * np.eye(p)), rel=1e-3)


def test_pack_upper_round_trip_is_exact():
    from trak_core.store import pack_upper, unpack_upper

    for p in (1, 2, 7, 300):
        x = _x(3 * p, p, seed=p)
        a = x.T @ x  # one syrk: exactly symmetric
        v = pack_upper(a)
        assert v.shape == (p * (p + 1) // 2,) and v.dtype == np.float64
        np.testing.assert_array_equal(unpack_upper(v, p), a)
        assert v[0] == a[0, 0] and v[-1] == a[-1, -1]
        if p > 1:  # row 0 (p entries), then row 1 from its diagonal
            assert v[1] == a[0, 1] and v[p] == a[1, 1]


@pytest.mark.parametrize("computed", [False, True])
def test_packed_partials_are_each_shards_xtx_in_half_the_bytes(tmp_path, computed):
    """Each shard's XᵀX is stored as its packed upper triangle (p(p+1)/2 float64 entries, about half of p × p):
    unpacked, it is the float64 XₛᵀXₛ to round-off, with the partials stored beforehand or computed by finalize
    on the way; a store of the older, full-partial schema is refused in one line."""
    import json
    import os

    from trak_core.errors import StoreMismatchError
    from trak_core.store import SCHEMA_VERSION, unpack_upper

    n, p = 2400, 300
    x = _x(n, p, alpha=1.0, seed=9).astype(np.float32)
    st = _store_with_rows(tmp_path / "v", x, chunk_rows=200, shard_rows=800, partials=not computed)
    reduce.finalize_model(st, 0, "adaptive")
    packed = st.model(0).xtx_partials
    assert packed.shape == (3, p * (p + 1) // 2)
    for s in range(3):
        xs = x[800 * s : 800 * (s + 1)].astype(np.float64)
        np.testing.assert_allclose(unpack_upper(packed[s], p), xs.T @ xs, rtol=1e-9, atol=1e-9)
    d = os.path.join(st.location, "models", "0", "xtx_partials")
    stored = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs if f != "zarr.json")
    assert 0.49 < stored / (3 * p * p * 8) < 0.52
    root = os.path.join(st.location, "zarr.json")
    doc = json.load(open(root))
    doc["attributes"]["trakflow"]["schema_version"] = SCHEMA_VERSION - 1
    json.dump(doc, open(root, "w"))
    with pytest.raises(StoreMismatchError, match=r"^schema_version: .* reads \d+ only\. Use a new store location"):
        TrakStore.open(st.location)


@pytest.mark.parametrize("block", [1, 7, 256])
def test_row_sums_in_blocks_are_the_float64_sums(monkeypatch, block):
    """row_sums_vec widens the rows block by block (here blocks that do not divide n): the float64 sums of the
    rows as stored (float16 here), whatever the block."""
    monkeypatch.setattr(reduce, "ROW_SUMS_BLOCK", block)
    g = np.random.default_rng(block)
    x, q = g.standard_normal((50, 33)).astype(np.float32), g.standard_normal(50).astype(np.float32)
    got = reduce.row_sums_vec(x, q, np.float16)
    x64, q64 = x.astype(np.float16).astype(np.float64), q.astype(np.float64)
    rn = (x64 * x64).sum(axis=1)
    want = np.concatenate([x64.T @ q64, [q64 @ q64, rn @ rn, (q64 * q64) @ rn]])
    np.testing.assert_allclose(got, want, rtol=1e-13)


def test_float16_widening_is_numpys_exactly():
    """reduce._widen (float16 through torch's float32) gives numpy's float64 values bit for bit: every finite
    float16 (subnormals and -0 included), ±inf and NaN, from a strided view too."""
    every = np.arange(2**16, dtype=np.uint16).view(np.float16).reshape(256, 256)
    for x in (every, every[:, ::3], every[::2].T):
        got, want = reduce._widen(x), x.astype(np.float64)
        assert got.dtype == np.float64 and np.array_equal(
            got.view(np.uint64)[~np.isnan(want)], want.view(np.uint64)[~np.isnan(want)]
        )
        assert np.array_equal(np.isnan(got), np.isnan(want))


def test_row_sums_equal_the_numpy_blocked_sums_bit_for_bit():
    """row_sums_vec (torch widening, one BLAS thread) gives the bits of the same blocked sums done with numpy's
    widening and the default BLAS threads, at a store's width."""
    g = np.random.default_rng(5)
    x, q = g.standard_normal((700, 2048)).astype(np.float16), g.standard_normal(700).astype(np.float32)
    qd = q.astype(np.float64)
    rn, xtq = np.empty(700), np.zeros(2048)
    for a in range(0, 700, reduce.ROW_SUMS_BLOCK):
        xb = x[a : a + reduce.ROW_SUMS_BLOCK].astype(np.float64)
        rn[a : a + reduce.ROW_SUMS_BLOCK] = np.einsum("ij,ij->i", xb, xb)
        xtq += qd[a : a + reduce.ROW_SUMS_BLOCK] @ xb
    want = np.concatenate([xtq, [qd @ qd, rn @ rn, (qd * qd) @ rn]])
    assert np.array_equal(reduce.row_sums_vec(x, q, np.float16), want)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_device_gram_is_the_float64_gram_exactly_symmetric(monkeypatch, dtype):
    """The GPU path of shard_partial (here run on the CPU through torch): the float64 xᵀx of the rows as stored,
    summed over blocks of rows (a block size that does not divide n), mirrored from its upper triangle."""
    monkeypatch.setattr(reduce, "DEVICE_BLOCK_BYTES", 8 * 64 * 37)  # 37 rows per block at p = 64
    x = _x(500, 64, alpha=1.0, seed=3).astype(dtype)
    got = reduce._device_gram(x, torch.device("cpu"))
    want = x.astype(np.float64).T @ x.astype(np.float64)
    assert got.dtype == np.float64 and np.array_equal(got, got.T)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13 * np.abs(want).max())


# ---------------------------------------------------------------------------------------------- the solve on a device
# trak_core.solve.linalg_device runs finalize's linear algebra with torch where XᵀX is on a GPU run; here on CPU tensors
# against the LAPACK primitives, and on a GPU by the cuda tests below.


def _host_lapack_forbidden(monkeypatch) -> None:
    """Make the host LAPACK primitives of the solve fail, so that a solve on a device proves it does not use them."""

    def forbidden(*_a, **_k):
        raise AssertionError("host LAPACK called by a solve on a device")

    for name in ("lapack_inverse", "_float32_eigenvalues", "_host_positive_definite"):
        monkeypatch.setattr(damping, name, forbidden)


def _check_primitives(device: str) -> None:
    from trak_core.solve import linalg_device as dl

    for n, p, alpha in ((40, 7, 0.0), (600, 300, 1.0), (1200, 530, 2.0)):
        x = _x(n, p, alpha=alpha, seed=p)
        a = x.T @ x
        ref = np.linalg.eigvalsh(a.astype(np.float32).astype(np.float64))
        ev = dl.float32_eigenvalues(a, device)
        assert isinstance(ev, np.ndarray) and ev.dtype == np.float64 and np.all(np.diff(ev) >= 0)
        # float32 eigenvalues: LAPACK's (and torch's on a CPU) within the documented ~2e-6 × σ_max of the float64
        # ones; a GPU's eigensolver is looser: on an H200 every eigenvalue came out ~1.3e-4 too large, relative
        # (the deff rules' exact check at λ absorbs that: test_solve_on_a_gpu_equals_the_host_solve)
        rtol = 0.0 if torch.device(device).type == "cpu" else 5e-4
        np.testing.assert_allclose(ev, ref, rtol=rtol, atol=2e-6 * ref[-1])
        np.testing.assert_allclose(damping._float32_eigenvalues(a), ref, rtol=0, atol=2e-6 * ref[-1])
        lam = 1e-3 * np.trace(a) / p
        want = damping.lapack_inverse(a, lam)
        for arg in (a, torch.from_numpy(a).to(device)):
            inv = dl.cholesky_inverse(arg, lam, device)
            assert inv.device.type == torch.device(device).type and inv.dtype == torch.float64
            assert torch.equal(inv, inv.T) and inv.is_contiguous()
            host = dl.to_host(inv)
            assert host.flags.c_contiguous and np.array_equal(host, host.T)
            np.testing.assert_allclose(host, want, rtol=1e-10, atol=1e-10 * np.abs(want).max())
            d, slope = dl.exact_deff_terms(inv, lam)
            d_ref, slope_ref = damping._exact_deff_terms(want, lam)
            assert d == pytest.approx(d_ref, rel=1e-10) and slope == pytest.approx(slope_ref, rel=1e-9)
        low = float(np.linalg.eigvalsh(a)[0])  # > 0: n > p, full rank
        t = torch.from_numpy(a).to(device)
        for shift in (-0.5 * low, -2.0 * low):
            assert dl.positive_definite(t, shift) == damping._host_positive_definite(a, shift) == (shift > -low)
    assert dl.cholesky_inverse(-np.eye(5), 0.0, device) is None  # not positive definite, like lapack_inverse
    assert damping.lapack_inverse(-np.eye(5), 0.0) is None
    nan = np.eye(5)
    nan[1, 2] = nan[2, 1] = np.nan
    assert dl.cholesky_inverse(nan, 0.0, device) is None
    zero_col = np.eye(6)
    zero_col[3, 3] = 0.0  # exactly singular at λ = 0
    assert dl.cholesky_inverse(zero_col, 0.0, device) is None and damping.lapack_inverse(zero_col, 0.0) is None


def test_torch_linalg_primitives_on_the_cpu_equal_lapacks():
    """linalg_device's eigenvalues, Cholesky inverse, rank test and exact d_eff terms (on CPU tensors here) equal
    damping's LAPACK ones: float32 eigenvalues within their round-off, the inverse within 1e-10 relative and exactly
    symmetric, None where XᵀX + λI is not positive definite."""
    _check_primitives("cpu")


SOLVE_CASES = [
    # (n, p, alpha, zero_columns): the fast deff path (p > 512), rank-deficient n < p, the float64 path (p ≤ 512),
    # an exactly singular XᵀX at p > 512 (a dead coordinate: the general path at λ = 0)
    (1200, 560, 1.0, 0),
    (300, 560, 0.0, 0),
    (500, 200, 1.5, 0),
    (900, 560, 1.0, 1),
]


def _check_solve_on(device: str, n: int, p: int, alpha: float, zero_columns: int, setting, monkeypatch) -> None:
    x = _x(n, p, alpha=alpha, seed=n + p)
    x[:, :zero_columns] = 0.0
    a = x.T @ x
    rule = parse_lambda_reg(setting)
    rn = (x**2).sum(axis=1)
    kw = {"xtq": x.sum(axis=0), "qtq": float(n), "row_norm4": float(rn @ rn), "q2x2": float(rn.sum())}  # q = 1
    with warnings.catch_warnings(record=True) as host_warned:
        warnings.simplefilter("always")
        inv_h, info_h = damping.solve(a.copy(), n, rule, **kw)
    _host_lapack_forbidden(monkeypatch)
    with warnings.catch_warnings(record=True) as dev_warned:
        warnings.simplefilter("always")
        inv_d, info_d = damping.solve(a.copy(), n, rule, linalg_device=device, **kw)
    if p > damping.EXACT_CONDITION_MAX_P and n > p and not zero_columns:  # the fast path decides on the device
        assert damping.solve_deff_fast(a, [0.1], n, linalg_device=device) is not None
    monkeypatch.undo()
    ill = [[str(w.message) for w in ws if w.category is IllConditionedWarning] for ws in (host_warned, dev_warned)]
    assert len(ill[0]) == len(ill[1]) and [m.split(" (")[0] for m in ill[0]] == [m.split(" (")[0] for m in ill[1]]
    assert isinstance(inv_d, np.ndarray) and inv_d.dtype == np.float64 and inv_d.flags.c_contiguous
    assert info_d.keys() == info_h.keys() and info_d["lambda_setting"] == info_h["lambda_setting"]
    lam = info_d["lambda_reg"]
    if rule.deff or rule.neff or any(r.deff or r.neff for r in rule.parts):
        # float32 eigenvalues from another algorithm: λ is the rule's to within the fast path's acceptance
        # (a Newton step of at most DEFF_LOG_TOL in log λ), like the host's
        ref = _reference_lambda(setting, x, n)
        assert lam == pytest.approx(ref, rel=2 * damping.DEFF_LOG_TOL)
        assert lam == pytest.approx(info_h["lambda_reg"], rel=4 * damping.DEFF_LOG_TOL)
    else:
        assert lam == pytest.approx(info_h["lambda_reg"], rel=1e-12)
    if zero_columns and lam == 0:  # singular: the pseudo-inverse of the general path, on either side
        assert np.isinf(info_d["condition"]) and np.isinf(info_h["condition"]) and ill[1]
        np.testing.assert_allclose(inv_d, inv_h, rtol=1e-9, atol=1e-9 * np.abs(inv_h).max())
        return
    assert np.array_equal(inv_d, inv_d.T)  # the Cholesky inverse, mirrored
    want = np.linalg.inv(a + lam * np.eye(p))
    want /= np.abs(want).mean()
    np.testing.assert_allclose(inv_d, want, rtol=1e-9, atol=1e-12 * np.abs(want).max())
    if lam == info_h["lambda_reg"]:
        np.testing.assert_allclose(inv_d, inv_h, rtol=1e-10, atol=1e-12 * np.abs(inv_h).max())
    assert info_d["condition"] == pytest.approx(info_h["condition"], rel=1e-3)


SOLVE_SETTINGS = [(*case, setting) for case in SOLVE_CASES for setting in ("adaptive", "deff:0.1", 0.5)] + [
    (*SOLVE_CASES[-1], 0.0)
]


@pytest.mark.parametrize("n,p,alpha,zero_columns,setting", SOLVE_SETTINGS)
def test_solve_with_torch_on_the_cpu_equals_the_host_solve(n, p, alpha, zero_columns, setting, monkeypatch):
    """damping.solve with linalg_device="cpu" (torch's linalg, no host LAPACK call) gives the host solve's λ
    (the deff rules: both within their tolerance of the float64 rule) and its inverse: (XᵀX + λI)⁻¹ / mean|·| to
    float64 round-off, exactly symmetric, the same warnings; the pseudo-inverse where XᵀX is singular at λ = 0."""
    _check_solve_on("cpu", n, p, alpha, zero_columns, setting, monkeypatch)


def test_ggn_solve_with_torch_on_the_cpu_equals_the_host_solve(monkeypatch):
    """curvature="ggn" (XᵀRX + β·mean(r)·XᵀX, λ transferred from XᵀX's rule) solved with torch: the host's λ to the
    deff tolerance and (H + λ'I)⁻¹ to float64 round-off."""
    n, p = 1000, 560
    x = _x(n, p, alpha=1.0, seed=11)
    q = np.random.default_rng(11).uniform(0, 1, n).astype(np.float32)
    r = damping.loss_curvature(q)
    ggn = x.T @ (x * r[:, None])
    a = x.T @ x
    inv_h, info_h = damping.solve(a, n, parse_lambda_reg("deff:0.1"), ggn=ggn, out_to_loss=q)
    _host_lapack_forbidden(monkeypatch)
    inv_d, info_d = damping.solve(a, n, parse_lambda_reg("deff:0.1"), ggn=ggn, out_to_loss=q, linalg_device="cpu")
    assert info_d["curvature"] == "ggn" and info_d.keys() == info_h.keys()
    assert info_d["lambda_reg"] == pytest.approx(info_h["lambda_reg"], rel=4 * damping.DEFF_LOG_TOL)
    h = damping.ggn_curvature(ggn, a, float(r.mean()))
    want = np.linalg.inv(h + info_d["lambda_reg"] * np.eye(p))
    assert np.array_equal(inv_d, inv_d.T)
    np.testing.assert_allclose(inv_d, want / np.abs(want).mean(), rtol=1e-9, atol=1e-12)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_torch_linalg_primitives_on_a_gpu_equal_lapacks():
    """linalg_device on the GPU: the float32 eigenvalues within their round-off of the float64 ones, the Cholesky
    inverse within 1e-10 of LAPACK's and exactly symmetric, None where not positive definite (or not finite)."""
    _check_primitives("cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,p,alpha,zero_columns,setting", SOLVE_SETTINGS)
def test_solve_on_a_gpu_equals_the_host_solve(n, p, alpha, zero_columns, setting, monkeypatch):
    """damping.solve with linalg_device="cuda" (no host LAPACK call): the host's λ (deff rules: within their
    tolerance) and (XᵀX + λI)⁻¹ / mean|·| to float64 round-off, exactly symmetric, on the host, the same warnings."""
    _check_solve_on("cuda", n, p, alpha, zero_columns, setting, monkeypatch)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("setting", ["adaptive", "deff:0.1", 0.5])
def test_finalize_on_a_gpu_equals_the_host(tmp_path, monkeypatch, setting):
    """Partials computed on a GPU (TRAKer's or a featurize task's device) are the host's float64 partials up to
    summation order; finalize on the GPU (TRAKer's call: engine.finalize with its device) solves there (no host
    LAPACK call) and gives the host's λ (deff rules: within their tolerance of the float64 rule) and the inverse
    (XᵀX + λI)⁻¹ / mean|·| as stored (float32)."""
    from trak_core import engine

    n, p = 2500, 600
    x = _x(n, p, alpha=1.0, seed=5).astype(np.float32)
    a = _store_with_rows(tmp_path / "a", x, chunk_rows=250, shard_rows=1000, partials=False)
    b = _store_with_rows(tmp_path / "b", x, chunk_rows=250, shard_rows=1000, partials=False)
    for s in range(a.meta.num_shards):
        host, gpu = reduce.shard_partial(a, 0, s), reduce.shard_partial(a, 0, s, device="cuda")
        assert np.array_equal(gpu, gpu.T)
        np.testing.assert_allclose(gpu, host, rtol=1e-12, atol=1e-13 * np.abs(host).max())
    ia = reduce.finalize_model(a, 0, setting)
    _host_lapack_forbidden(monkeypatch)
    ib, skipped, _ = engine.finalize(b, 0, setting, True, device="cuda")
    monkeypatch.undo()
    assert not skipped and ia.keys() == ib.keys()
    lam = ib["lambda_reg"]
    if isinstance(setting, float):
        assert lam == pytest.approx(ia["lambda_reg"], rel=1e-12)
    else:
        assert lam == pytest.approx(_reference_lambda(setting, x, n), rel=2 * damping.DEFF_LOG_TOL)
        assert lam == pytest.approx(ia["lambda_reg"], rel=4 * damping.DEFF_LOG_TOL)
    assert ib["condition"] == pytest.approx(ia["condition"], rel=1e-3)
    xd = x.astype(np.float64)
    inv = np.linalg.inv(xd.T @ xd + lam * np.eye(p))
    want = inv / np.abs(inv).mean()
    inv_b = b.inverse(0)
    np.testing.assert_allclose(inv_b, want, rtol=1e-6, atol=1e-9 * np.abs(want).max())  # stored in float32
    assert np.array_equal(inv_b, inv_b.T)


def test_mean_abs_is_numpys(monkeypatch):
    """The rescale's mean |entry| by BLAS asum: numpy's to 1e-14 relative, in chunks too (a chunk size that does not
    divide the length), on a transposed (non-contiguous) array too; NaN for an empty one."""
    x = np.random.default_rng(0).standard_normal((300, 200)) ** 3
    want = float(np.abs(x).mean())
    assert damping._mean_abs(x) == pytest.approx(want, rel=1e-14)
    assert damping._mean_abs(x.T) == pytest.approx(want, rel=1e-14)
    monkeypatch.setattr(damping, "ASUM_CHUNK", 7_001)
    assert damping._mean_abs(x) == pytest.approx(want, rel=1e-14)
    assert np.isnan(damping._mean_abs(np.zeros((0, 3))))
