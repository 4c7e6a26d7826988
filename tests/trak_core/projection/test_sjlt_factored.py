"""SJLT and factored projections: the definitions, the fast path, TRAKer end to end, bad input.

(The shared contract — shapes, batch invariance, dict == flat, JL inner products — is checked for both
kinds by tests/trak_core/test_projector_contract.py.)
"""

import logging
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import trak_core
from trak_core.errors import BadInputError, NonFiniteGradientError
from trak_core.featurize.featurizer import Featurizer
from trak_core.featurize.gradients import FunctionalGradientComputer, vectorize
from trak_core.featurize.modelout import ImageClassificationModelOutput
from trak_core.projection import counter_rng
from trak_core.projection import layout as factored
from trak_core.projection.factored import (
    OTHER,
    SIDE_IN,
    SIDE_OUT,
    FactoredProjector,
    factor_key,
    factor_matrix,
    model_layout,
)
from trak_core.projection.projectors import DenseProjector, NoOpProjector, ProjectionType, make_projector
from trak_core.projection.sjlt import SJLTProjector

TASK = ImageClassificationModelOutput()


# ---------------------------------------------------------------------------- SJLT
def _sjlt_reference(seed, model_id, grad_dim, proj_dim, c):
    """The matrix rebuilt entry by entry from counter_rng.sjlt_block (repeated columns add up)."""
    cols, signs = counter_rng.sjlt_block(seed, model_id, 0, grad_dim, proj_dim, c)
    m = np.zeros((grad_dim, proj_dim))
    for i in range(grad_dim):
        for r in range(c):
            m[i, int(cols[i, r])] += int(signs[i, r]) * math.sqrt(proj_dim / c)
    return torch.from_numpy(m)


@pytest.mark.parametrize("c", [1, 3, 8])
def test_sjlt_is_the_counter_rng_definition(c):
    g = torch.randn(7, 300, dtype=torch.float64)
    ref = g @ _sjlt_reference(5, 2, 300, 64, c)
    p = SJLTProjector(300, 64, seed=5, c=c, block_rows=50)
    torch.testing.assert_close(p.project(g.float(), model_id=2).double(), ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(p.matrix(2).double(), _sjlt_reference(5, 2, 300, 64, c))


def test_sjlt_segmenting_and_cache_do_not_change_the_result():
    g = torch.randn(9, 1000)
    a = SJLTProjector(1000, 128, seed=1, c=4).project(g, 3)
    for kw in ({"block_rows": 7}, {"block_rows": 1000, "cache_bytes": 0}, {"block_rows": 333}):
        torch.testing.assert_close(SJLTProjector(1000, 128, seed=1, c=4, **kw).project(g, 3), a, rtol=1e-5, atol=1e-4)
    p = SJLTProjector(1000, 128, seed=1, c=4)
    p.project(g, 3)
    assert p._cache and p._cache_model == 3
    p.project(g, 4)  # another model_id replaces the cache
    assert p._cache_model == 4
    p.free_memory()
    assert not p._cache
    assert p.spec()["c"] == 4 and p.spec()["kind"] == "sjlt"


def test_sjlt_columns_are_spread_and_signs_balanced():
    cols, signs = counter_rng.sjlt_block(0, 0, 0, 20000, 256, 4)
    counts = torch.bincount(cols.reshape(-1), minlength=256).double()
    assert float(counts.std() / counts.mean()) < 0.1  # uniform: ~1/sqrt(312) ≈ 0.057
    assert abs(float(signs.double().mean())) < 0.02


@pytest.mark.parametrize("c", [0, -1, 1.5, True, "4", 65])
def test_sjlt_bad_c(c):
    with pytest.raises(BadInputError, match="c"):
        SJLTProjector(100, 64, c=c)


def test_sjlt_bad_type_and_dims():
    with pytest.raises(BadInputError, match="proj_type"):
        SJLTProjector(100, 64, proj_type="normal")
    with pytest.raises(BadInputError, match="proj_dim"):
        SJLTProjector(100, 0)
    with pytest.raises(BadInputError, match="block_rows"):
        SJLTProjector(100, 8, block_rows=0)


# ---------------------------------------------------------------------------- factored: definition
def test_factored_equals_explicit_kronecker_on_a_tiny_layer(monkeypatch):
    monkeypatch.setattr(factored, "PAIRS_MAX_MACS", 0)  # the k_out × k_in grid even for this tiny layer
    monkeypatch.setattr(factored, "PAIRS_MAX_RATIO", 0)
    layer = nn.Linear(3, 4)  # weight (4, 3), bias (4,): grad_dim 16; augmented G is 4 × 4
    p = FactoredProjector.from_model(layer, 5, seed=7, proj_type="rademacher")
    (b,) = p.blocks
    assert (b.kind, b.d_out, b.d_in, b.bias, b.k, b.pairs) == ("linear", 4, 3, True, 5, False)
    assert (b.k_out, b.k_in, b.id_out, b.id_in) == (3, 2, False, False)  # both sides random (narrower than 4)
    p_in = factor_matrix(7, 1, "", SIDE_IN, 4, b.k_in, ProjectionType.rademacher)
    p_out = factor_matrix(7, 1, "", SIDE_OUT, 4, b.k_out, ProjectionType.rademacher)
    kron = torch.kron(p_out, p_in)[:, :5] * math.sqrt(5 / 5)  # rows: (o, i) of the augmented 4 × 4 matrix
    # the gradient vector is [weight (o, i) row-major, bias o]: reorder kron's rows to it
    order = _aug_order(4, 3)
    explicit = kron[order]
    torch.testing.assert_close(p.matrix(1), explicit)
    g = torch.randn(4, 16)
    torch.testing.assert_close(p.project(g, 1), g @ explicit, rtol=1e-5, atol=1e-5)


def test_factored_pairs_equal_explicit_khatri_rao_columns(monkeypatch):
    """A linear block with pairs: kept coordinate j is its own pair, column j = p_outⱼ ⊗ p_inⱼ (Khatri-Rao)."""
    monkeypatch.setattr(factored, "PAIRS_MAX_RATIO", 100.0)  # pairs for this tiny layer (5 · 6 > 3 · 8 otherwise)
    layer = nn.Linear(3, 2)
    p = FactoredProjector.from_model(layer, 5, seed=7, proj_type="rademacher")
    (b,) = p.blocks
    assert (b.pairs, b.k, b.k_out, b.k_in) == (True, 5, 5, 5)
    assert p.spec()["layout"][0][-1] == "pairs"
    p_in = factor_matrix(7, 1, "", SIDE_IN, 4, 5, ProjectionType.rademacher)
    p_out = factor_matrix(7, 1, "", SIDE_OUT, 2, 5, ProjectionType.rademacher)
    cols = torch.stack([torch.kron(p_out[:, j], p_in[:, j]) for j in range(5)], dim=1)  # rows (o, i) of 2 × 4
    order = [o * 4 + i for o in range(2) for i in range(3)] + [o * 4 + 3 for o in range(2)]
    torch.testing.assert_close(p.matrix(1), cols[order])
    g = torch.randn(4, 8)
    torch.testing.assert_close(p.project(g, 1), g @ cols[order], rtol=1e-5, atol=1e-5)


def test_factored_pairs_only_where_cheap():
    """Pairs cost k · (d_in + 1 + d_out) per position: linear / conv / matrix blocks get them where that is at most
    PAIRS_MAX_RATIO × their own forward (d_out · (d_in + 1)), whatever the number of positions; small blocks of other
    kinds where it is at most PAIRS_MAX_MACS; the others the grid."""
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10))
    for p in (64, 512, 2048):
        for b in FactoredProjector.from_model(model, p).blocks:
            macs = b.k * (b.in_rows + b.d_out)
            small = b.size <= factored.PAIRS_MAX_WEIGHTS and macs <= factored.PAIRS_MAX_MACS
            assert b.pairs == (small or macs <= factored.PAIRS_MAX_RATIO * b.size), (p, b)
            assert b.pairs or b.k_out * b.k_in >= b.k
    big, small = FactoredProjector.from_model(model, 512).blocks  # 256 each; the small one: 134k multiply-adds
    assert big.pairs and not small.pairs and (small.id_out, small.k_in) == (True, 26)
    assert not any(b.pairs for b in FactoredProjector.from_model(model, 2048).blocks)  # 1,024 each: 3.3× the forward
    assert FactoredProjector.from_model(model, 64).blocks[1].pairs  # 32 · 523 multiply-adds: small
    assert FactoredProjector.from_model(nn.Linear(2, 3), 8).blocks[0].pairs  # small linear: 8 · 6, 2× its forward
    assert not FactoredProjector.from_model(nn.Conv2d(1, 2, 3), 16).blocks[0].pairs  # a conv: 9.6×, however small
    assert FactoredProjector.from_model(nn.Conv2d(64, 128, 3), 256).blocks[0].pairs  # 2.4×
    wide = FactoredProjector.from_model(nn.Conv2d(64, 128, 3), 2048).blocks[0]  # 19×: the grid
    assert not wide.pairs and wide.k_out * wide.k_in >= wide.k
    emb = FactoredProjector.from_model(nn.Embedding(11, 5), 16).blocks[0]  # small, 16 · 6 multiply-adds: pairs
    assert emb.pairs and (emb.k_out, emb.k_in) == (16, 16)


@pytest.mark.parametrize("layer", ["conv", "embedding"])
def test_pairs_fast_path_equals_definition_for_conv_and_embedding(monkeypatch, layer):
    """Conv and embedding blocks with pairs: the fast path (hooks with Z = diag(z)) equals the projector applied
    to brute-force per-example gradients, and that equals column j = p_outⱼ ⊗ p_inⱼ (float64)."""
    monkeypatch.setattr(factored, "PAIRS_MAX_RATIO", 100.0)  # pairs for this small conv too
    torch.manual_seed(0)
    if layer == "conv":
        model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 5 * 5, 4))
        batch = [torch.randn(6, 2, 5, 5, dtype=torch.float64), torch.randint(0, 4, (6,))]
    else:
        model = nn.Sequential(nn.Embedding(11, 5), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 5, 4))
        ids = torch.randint(0, 11, (6, 4))
        ids[0, :2] = 3  # a repeated token
        batch = [ids, torch.randint(0, 4, (6,))]
    model = model.double().eval()
    p = FactoredProjector.from_model(model, 24, seed=3, dtype=torch.float64)
    first = p.blocks[0]
    assert first.pairs and first.kind == layer
    task = ImageClassificationModelOutput()
    gc = FunctionalGradientComputer(model, task, dtype=torch.float64)
    grads = gc.compute_per_sample_grad(batch)
    slow = p.project(grads, 2)
    m = p.matrix(2).double()
    torch.testing.assert_close(slow, vectorize(grads) @ m, rtol=1e-9, atol=1e-9)
    fast = p.featurize_batch(model, task, gc._weights(), gc._buffers(), batch, 2)
    torch.testing.assert_close(fast, slow, rtol=1e-8, atol=1e-10)
    # the first block's columns are Khatri-Rao columns: p_outⱼ ⊗ p_inⱼ over the (out, in) layout of the weight
    p_in, p_out, w = p.factors(2)[first.name]
    cols = torch.stack([torch.kron(p_out[:, j], p_in[:, j]) for j in range(first.k)], 1) * w
    aug = cols.reshape(first.d_out, first.in_rows, first.k)
    n_w = first.d_out * first.d_in
    torch.testing.assert_close(m[:n_w, : first.k], aug[:, : first.d_in].reshape(n_w, first.k))


def _aug_order(d_out, d_in):
    """Rows of the augmented d_out × (d_in + 1) matrix in the gradient vector's order [weight (o, i), bias o]."""
    return [o * (d_in + 1) + i for o in range(d_out) for i in range(d_in)] + [
        o * (d_in + 1) + d_in for o in range(d_out)
    ]


def _identity_columns(b, p_in, p_out, proj_dim):
    """Kept coordinate t = (i, j) of the row-major (k_out, k_in) grid: column w_t · (p_out_i ⊗ p_in_j), an identity
    side I, w_t = √(proj_dim / c_t), c_t the kept coordinates sharing t's identity index (k without one, 1 with two)."""
    p_out = torch.eye(b.d_out, dtype=torch.float64) if b.id_out else p_out.double()
    p_in = torch.eye(b.in_rows, dtype=torch.float64) if b.id_in else p_in.double()
    ij = [divmod(t, b.k_in) for t in range(b.k)]
    side = [i if b.id_out else j for i, j in ij]
    cols = []
    for t, (i, j) in enumerate(ij):
        c = b.k if not (b.id_out or b.id_in) else 1 if b.id_out and b.id_in else side.count(side[t])
        cols.append(torch.kron(p_out[:, i], p_in[:, j]) * math.sqrt(proj_dim / c))
    return torch.stack(cols, 1)


@pytest.mark.parametrize(
    "d_in, d_out, proj_dim, sides",
    [(5, 3, 7, (True, False)), (2, 6, 10, (False, True)), (3, 2, 8, (True, True)), (5, 3, 4, (False, False))],
    ids=["id_out", "id_in", "both-exact", "none"],
)
def test_identity_sides_equal_the_definition_and_are_unbiased(monkeypatch, d_in, d_out, proj_dim, sides):
    """A side as wide as its dimension is the identity: the matrix equals the definition column by column, and
    its exact expectation over the random side (E[q qᵀ] = I) is proj_dim · I — the weights √(proj_dim / c) make the
    unequal rows (columns) of kept coordinates unbiased, where the plain √(proj_dim / k) would not be."""
    monkeypatch.setattr(factored, "PAIRS_MAX_MACS", 0)  # the grid
    monkeypatch.setattr(factored, "PAIRS_MAX_RATIO", 0)
    p = FactoredProjector.from_model(nn.Linear(d_in, d_out), proj_dim, seed=4, dtype=torch.float64)
    (b,) = p.blocks
    assert (b.id_out, b.id_in) == sides
    row = p.spec()["layout"][0]
    assert ("id_out" in row, "id_in" in row) == sides
    p_in = factor_matrix(4, 2, "", SIDE_IN, b.in_rows, b.k_in, ProjectionType.rademacher)
    p_out = factor_matrix(4, 2, "", SIDE_OUT, b.d_out, b.k_out, ProjectionType.rademacher)
    cols = _identity_columns(b, p_in, p_out, proj_dim)
    order = _aug_order(d_out, d_in)
    torch.testing.assert_close(p.matrix(2), cols[order], rtol=1e-12, atol=1e-12)
    if sides == (True, True):  # k = d_out · (d_in + 1): the block itself, exactly (· √proj_dim, augmented order)
        torch.testing.assert_close(p.matrix(2), math.sqrt(proj_dim) * torch.eye(b.size, dtype=torch.float64)[order])
    # exact expectation: column t = w_t (u_i ⊗ v_j), u_i = column i of P_out, v_j of P_in, independent, so
    # E[col colᵀ] = w_t² E[u_i u_iᵀ] ⊗ E[v_j v_jᵀ], with E[u uᵀ] = e_i e_iᵀ on an identity side and I on a random one
    ident = _identity_columns(b, torch.eye(b.in_rows), torch.eye(b.d_out), proj_dim)  # w_t (e_i ⊗ e_j): w_t²
    expect = torch.zeros(b.size, b.size, dtype=torch.float64)
    for t in range(b.k):
        i, j = divmod(t, b.k_in)
        w2 = float(ident[:, t].norm() ** 2)
        eo = torch.zeros(b.d_out, b.d_out, dtype=torch.float64)
        ei = torch.zeros(b.in_rows, b.in_rows, dtype=torch.float64)
        if b.id_out:
            eo[i, i] = 1
        else:
            eo = torch.eye(b.d_out, dtype=torch.float64)
        if b.id_in:
            ei[j, j] = 1
        else:
            ei = torch.eye(b.in_rows, dtype=torch.float64)
        expect += w2 * torch.kron(eo, ei)
    torch.testing.assert_close(expect, proj_dim * torch.eye(b.size, dtype=torch.float64))


def test_identity_side_inner_products_are_unbiased_monte_carlo(monkeypatch):
    """Float64 Monte Carlo over model_ids of E⟨Px, Py⟩ / scale = ⟨x, y⟩ for a layer whose output side is the
    identity with unequal rows of kept coordinates (10 × 138 grid, k = 1,377: the last row keeps 135), where x, y
    put most of ⟨x, y⟩ in that last row: the per-row weights are unbiased, the plain √(proj_dim / k) is not."""
    monkeypatch.setattr(factored, "PAIRS_MAX_MACS", 0)  # the grid
    monkeypatch.setattr(factored, "PAIRS_MAX_RATIO", 0)
    layer = nn.Linear(256, 10)
    proj_dim = 1377
    (b,) = model_layout(layer, proj_dim).blocks
    assert (b.id_out, b.id_in, b.k_out, b.k_in) == (True, False, 10, 138)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, b.size, generator=gen, dtype=torch.float64)
    y = x + 0.5 * torch.randn(1, b.size, generator=gen, dtype=torch.float64)
    rows = torch.arange(b.size)
    last = torch.where(rows < 10 * 256, rows // 256, rows - 10 * 256) == 9  # weight row 9 and bias 9
    x[:, ~last] *= 0.1
    exact = float(x @ y.T)
    vals, naive = [], []
    for m in range(300):
        p = FactoredProjector.from_model(layer, proj_dim, seed=0, dtype=torch.float64)
        px, py = p.project(torch.cat([x, y]), m)
        vals.append(float(px @ py) / p.scale)
        w = p.factors(m)[""][2]
        naive.append(float((px / w) @ (py / w)) / b.k)  # the same coordinates weighted √(proj_dim / k)
    v, nv = torch.tensor(vals), torch.tensor(naive)
    se = float(v.std()) / math.sqrt(len(vals))
    assert abs(float(v.mean()) - exact) < 4 * se, (float(v.mean()), exact, se)
    assert abs(float(nv.mean()) - exact) > 10 * se  # √(proj_dim / k): row i weighted c_i / k ≈ 1/10, biased


def test_identity_sides_are_chosen_only_where_unbiased_and_exact():
    """Which side is the identity: a side as wide as its dimension whose indices all keep a coordinate; both
    only when k = d_out · (d_in + 1); else the smaller side."""
    for k in range(1, 300):
        for d_out, in_rows in ((10, 257), (3, 19), (8, 9), (6, 8), (11, 8), (4, 4)):
            ko, ki = factored._factor(k, d_out, in_rows)
            io, ii = factored._identity_sides(k, ko, ki, d_out, in_rows)
            if io and ii:
                assert k == d_out * in_rows == ko * ki
                continue
            assert not io or (ko == d_out and (ko - 1) * ki < k)  # the last row keeps ≥ 1
            assert not ii or (ki == in_rows and k >= ki)  # every column keeps ≥ 1
            if ko == d_out and ki == in_rows and k != d_out * in_rows:
                assert (io, ii) == (d_out <= in_rows, d_out > in_rows)
            b = factored.Block(
                "x", "linear", ("w",), d_out, in_rows - 1, True, d_out * in_rows, k, ko, ki, False, io, ii
            )
            c = factored.coordinate_counts(b)
            if io != ii:
                assert c is not None and int(c.min()) >= 1 and c.shape == (k,)


def test_factored_keys_are_distinct_and_stable():
    keys = {factor_key(0, 0, n, s, u) for n in ("0", "2", "fc", OTHER) for s in (0, 1, 2) for u in (0, 1)}
    assert len(keys) == 24
    assert factor_key(3, 1, "layer.0", SIDE_IN) == factor_key(3, 1, "layer.0", SIDE_IN)
    a = factor_matrix(0, 0, "x", SIDE_IN, 50, 40, ProjectionType.normal)
    assert abs(float(a.mean())) < 0.05 and abs(float(a.var()) - 1) < 0.1
    assert not torch.equal(a, factor_matrix(0, 1, "x", SIDE_IN, 50, 40, ProjectionType.normal))


def test_factored_split_totals_proj_dim_and_is_equal_per_block():
    """Equal shares per block, a block smaller than its share kept whole (both sides the identity, exact) and the
    rest shared again; ``split="size"`` (layout version 3) is ∝ the block sizes."""
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))  # blocks of 2,080 and 330
    for p in (2, 12, 100, 512, 661, 2410):
        lay = model_layout(model, p)
        assert sum(b.k for b in lay.blocks) == p
        for b in lay.blocks:
            assert 1 <= b.k <= b.size and b.k <= b.k_out * b.k_in
    assert [b.k for b in model_layout(model, 512).blocks] == [256, 256]
    assert [b.k for b in model_layout(model, 661).blocks] == [331, 330]
    first, second = model_layout(model, 2048).blocks  # 330 < 1,024: kept whole, 1,718 for the first
    assert (first.k, second.k) == (1718, 330) and (second.id_out, second.id_in) == (True, True)
    assert [b.k for b in model_layout(model, 2410).blocks] == [2080, 330]
    k1, k2 = (b.k for b in model_layout(model, 512, split="size").blocks)
    assert abs(k1 / 512 - 2080 / 2410) < 0.01 and abs(k2 / 512 - 330 / 2410) < 0.01
    three = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))  # 20 each: ties by lower index
    assert [b.k for b in model_layout(three, 8).blocks] == [3, 3, 2]
    assert [b.k for b in model_layout(model, 4820).blocks] == [4159, 661]  # above grad_dim: 1 each, the rest ∝ size
    with pytest.raises(BadInputError, match="split must be one of"):
        model_layout(model, 64, split="variance")
    with pytest.raises(BadInputError, match="split='energy' needs energies"):
        model_layout(model, 64, split="energy")
    with pytest.raises(BadInputError, match="smaller than the number of blocks"):
        model_layout(model, 1)


def test_factored_is_unbiased_for_rank_one_gradients():
    """E‖Px‖² = scale ‖x‖² also for the rank-one per-example gradients of a layer (over model_ids)."""
    layer = nn.Linear(40, 30)
    p = FactoredProjector.from_model(layer, 64, seed=0)
    gen = torch.Generator().manual_seed(0)  # a fixed draw: the bound below is statistical
    g, a = torch.randn(30, generator=gen), torch.randn(40, generator=gen)
    x = torch.cat([torch.outer(g, a).reshape(-1), g])[None]
    ratios = [float((p.project(x, m) ** 2).sum() / p.scale / (x**2).sum()) for m in range(200)]
    assert abs(np.mean(ratios) - 1) < 0.08


# ---------------------------------------------------------------------------- factored: the fast path
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 5, 3, stride=2, padding=1, padding_mode="reflect", bias=False)
        self.norm = nn.LayerNorm(5 * 4 * 4)
        self.fc = nn.Linear(5 * 4 * 4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.relu(self.conv2(torch.relu(self.conv1(x)))).flatten(1)
        return self.head(torch.tanh(self.fc(self.norm(h))))


def _fast_and_slow(model, x, y, proj_dim=48, grad_wrt=None, **kw):
    model.eval()
    p = FactoredProjector.from_model(model, proj_dim, seed=2, grad_wrt=grad_wrt, **kw)
    gc = FunctionalGradientComputer(model, TASK, grad_wrt=grad_wrt, dtype=torch.float32)
    slow = p.project(gc.compute_per_sample_grad((x, y)), model_id=3)
    fast = p.featurize_batch(model, TASK, gc._weights(), gc._buffers(), (x, y), model_id=3)
    return p, fast, slow


@pytest.mark.parametrize("case", ["mlp", "convnet", "conv1d", "grad_wrt"])
def test_fast_path_equals_projecting_materialized_gradients(case):
    torch.manual_seed(0)
    y = torch.randint(0, 3, (6,))
    kw = {}
    if case == "mlp":
        model, x = nn.Sequential(nn.Linear(7, 9), nn.LayerNorm(9), nn.Tanh(), nn.Linear(9, 3)), torch.randn(6, 7)
    elif case == "convnet":
        model, x = _Net(), torch.randn(6, 2, 8, 8)
    elif case == "conv1d":
        model = nn.Sequential(nn.Conv1d(3, 4, 3, dilation=2), nn.ReLU(), nn.Flatten(), nn.Linear(16, 3))
        x = torch.randn(6, 3, 8)
    else:
        model, x = _Net(), torch.randn(6, 2, 8, 8)
        kw["grad_wrt"] = ["conv1.weight", "fc.weight", "fc.bias", "head.bias"]  # head.bias alone: dense block
    p, fast, slow = _fast_and_slow(model, x, y, **kw)
    assert fast.shape == (6, 48)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4 * float(slow.abs().max()))
    kinds = [b.kind for b in p.blocks]
    if case in ("mlp", "grad_wrt"):
        assert kinds[-1] == "other"


class _BNNet(nn.Module):
    """A conv with BatchNorm (eval mode: running statistics, a per-example function) and two linear layers."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2))
        self.fc = nn.Linear(8 * 4 * 4, 256)
        self.head = nn.Linear(256, 10)

    def forward(self, x):
        return self.head(torch.relu(self.fc(self.conv(x).flatten(1))))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("proj_dim", [64, 512, 2048])  # all pairs; pairs and a grid; grids with identity sides
def test_fast_path_on_cuda_equals_the_cpu_definition(proj_dim):
    """On a GPU the hooked fast path (grids and pairs) gives the CPU's projection of the materialized gradients."""
    torch.manual_seed(0)
    model, x, y = _BNNet(), torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,))
    model.conv[1].running_mean.uniform_(-0.5, 0.5)  # statistics as after training, not the init's 0 / 1
    model.conv[1].running_var.uniform_(0.5, 2.0)
    p, _, slow = _fast_and_slow(model, x, y, proj_dim=proj_dim)
    if proj_dim == 512:
        assert {b.pairs for b in p.blocks if b.kind != "other"} == {True, False}
    gpu = model.to("cuda")
    pg = FactoredProjector.from_model(gpu, proj_dim, seed=2, device="cuda")
    gc = FunctionalGradientComputer(gpu, TASK, dtype=torch.float32)
    fast = pg.featurize_batch(gpu, TASK, gc._weights(), gc._buffers(), (x.cuda(), y.cuda()), model_id=3).cpu()
    torch.testing.assert_close(fast, slow, rtol=1e-3, atol=1e-4 * float(slow.abs().max()))


def test_featurizer_uses_the_fast_path_and_keeps_nan_checks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    p = FactoredProjector.from_model(model, 16)
    f = Featurizer(model, "image_classification", p)
    f.load_state(model.state_dict())
    x, y = torch.randn(10, 5), torch.randint(0, 3, (10,))

    def refuse(*a, **k):
        raise AssertionError("project() called: the fast path was not used")

    slow = p.project(f.gradient_computer.compute_per_sample_grad((x, y)), 0) / math.sqrt(f.grad_dim)
    p.project = refuse
    feats, q = f.featurize((x, y), model_id=0, indices=range(100, 110))
    np.testing.assert_allclose(feats, slow.numpy(), rtol=1e-4, atol=1e-5)
    x[3, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"\[103\]"):
        f.featurize((x, y), model_id=0, indices=range(100, 110))


# ---------------------------------------------------------------------------- TRAKer end to end
def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 3, generator=torch.Generator().manual_seed(99))
    x = torch.randn(n, 8, generator=g)
    return x, (x @ w + 0.5 * torch.randn(n, 3, generator=g)).argmax(1)


def _run(projector, tmp_path, name, lam=0.01):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    x, y = _data(400, 0)
    xt, yt = _data(10, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = trak_core.TRAKer(
            model=model,
            task="image_classification",
            train_set_size=400,
            save_dir=str(tmp_path / name),
            device="cpu",
            projector=projector,
            use_half_precision=False,
            logging_level=logging.ERROR,
            chunk_rows=100,
            lambda_reg=lam * projector.scale,
        )  # the margin's gradients are rank-deficient
        tr.load_checkpoint(model.state_dict(), model_id=0)
        for a in range(0, 400, 100):
            tr.featurize((x[a : a + 100], y[a : a + 100]), num_samples=100)
        tr.finalize_features()
        tr.start_scoring_checkpoint("e", model.state_dict(), 0, 10)
        tr.score((xt, yt), num_samples=10)
        return tr.finalize_scores("e")


def test_traker_end_to_end_each_projector_close_to_exact(tmp_path):
    """195 parameters, 400 train rows, proj_dim 160, the same relative damping: every kind's scores correlate
    with the exact-gradient ones (measured: dense 0.95, sjlt 0.95, factored 0.84 — the Kronecker sketch of
    rank-one gradients is noisier; see benchmarks/RESULTS.md for the LDS, where it costs little)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    exact = _run(NoOpProjector(), tmp_path, "noop")
    corr = {}
    for kind in ("dense", "sjlt", "factored"):
        proj = make_projector(kind, 195, 160, seed=1, model=model)
        s = _run(proj, tmp_path, kind)
        assert s.shape == (400, 10) and np.isfinite(s).all()
        corr[kind] = float(np.corrcoef(s.reshape(-1), exact.reshape(-1))[0, 1])
    assert corr["dense"] > 0.9, corr
    assert corr["sjlt"] > 0.9, corr
    assert corr["factored"] > 0.75, corr


# ---------------------------------------------------------------------------- bad input
def test_unsupported_layers_with_other_error_name_the_parameters():
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Flatten(), nn.Linear(8, 3))
    with pytest.raises(BadInputError, match=r"0\.weight \(10, 4\) \(Embedding\)"):
        FactoredProjector.from_model(model, 16, other="error")
    normed = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 3))
    with pytest.raises(BadInputError, match=r"1\.weight \(4,\) \(LayerNorm\)"):
        FactoredProjector.from_model(normed, 16, other="error")
    grouped = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.Flatten(), nn.Linear(4, 3))
    p = FactoredProjector.from_model(grouped, 16)  # the grouped conv: a matrix block (weight substitution)
    assert [b.kind for b in p.blocks] == ["matrix", "linear"]
    assert p.blocks[0].params == ("0.weight", "0.bias") and (p.blocks[0].d_out, p.blocks[0].d_in) == (4, 18)
    with pytest.raises(BadInputError, match="other"):
        FactoredProjector.from_model(grouped, 16, other="ignore")


def test_layer_used_outside_its_forward_is_detected():
    class Sneaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return nn.functional.linear(x, self.fc.weight, self.fc.bias)

    model = Sneaky().eval()
    p = FactoredProjector.from_model(model, 6)
    gc = FunctionalGradientComputer(model, TASK, dtype=torch.float32)
    batch = (torch.randn(2, 4), torch.tensor([0, 1]))
    with pytest.warns(UserWarning, match=r"layers \['fc'\] are used outside"):  # weight substitution instead
        fast = p.featurize_batch(model, TASK, gc._weights(), gc._buffers(), batch, 0)
    torch.testing.assert_close(fast, p.project(gc.compute_per_sample_grad(batch), 0), rtol=1e-5, atol=1e-6)


def test_factored_bad_construction():
    mlp = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    with pytest.raises(BadInputError, match="needs the model"):
        make_projector("factored", 43, 8)
    with pytest.raises(BadInputError, match="grad_dim"):
        make_projector("factored", 44, 8, model=mlp)
    with pytest.raises(BadInputError, match="smaller than the number of blocks"):
        FactoredProjector.from_model(mlp, 1)
    other = FactoredProjector.from_model(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3, bias=False)), 8)
    gc = FunctionalGradientComputer(mlp, TASK, dtype=torch.float32)
    with pytest.raises(BadInputError, match="layout"):
        FactoredProjector(43, 8, layout=other.layout)
    p = FactoredProjector.from_model(mlp, 8)
    bad_weights = {**gc._weights(), "2.weight": torch.zeros(3, 6)}
    with pytest.raises(BadInputError, match="2.weight"):
        p.featurize_batch(mlp, TASK, bad_weights, {}, (torch.randn(2, 4), torch.tensor([0, 1])), 0)
    assert FactoredProjector(43, 8).featurize_batch(mlp, TASK, gc._weights(), {}, (torch.randn(2, 4),), 0) is None


def test_dense_projector_still_the_reference_scale():
    """SJLT and factored report the dense kinds' scale, so lambda_reg means the same for all three."""
    mlp = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    assert DenseProjector(43, 8).scale == SJLTProjector(43, 8).scale == FactoredProjector.from_model(mlp, 8).scale
