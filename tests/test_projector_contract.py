"""One contract, checked against every projector (scikit-learn's check_estimator, for projections)."""

import numpy as np
import pytest
import torch

from trak_core import counter_rng
from trak_core.errors import BadInputError
from trak_core.factored import FactoredProjector
from trak_core.sjlt import SJLTProjector
from trak_core.projectors import (BasicProjector, BasicSingleBlockProjector, DenseProjector, NoOpProjector,
                                  make_projector)

GRAD_DIM, PROJ_DIM = 1000, 256

FACTORIES = {
    "dense-rademacher": lambda: DenseProjector(GRAD_DIM, PROJ_DIM, seed=3, proj_type="rademacher"),
    "dense-normal": lambda: DenseProjector(GRAD_DIM, PROJ_DIM, seed=3, proj_type="normal"),
    "dense-rademacher-nocache-smallblocks": lambda: DenseProjector(GRAD_DIM, PROJ_DIM, seed=3, block_rows=97,
                                                                   cache_bytes=0),
    "basic": lambda: BasicProjector(GRAD_DIM, PROJ_DIM, seed=3, proj_type="rademacher"),
    "single-block-normal": lambda: BasicSingleBlockProjector(GRAD_DIM, PROJ_DIM, seed=3, proj_type="normal"),
    "noop": lambda: NoOpProjector(grad_dim=GRAD_DIM, proj_dim=GRAD_DIM),
    "sjlt-c4": lambda: SJLTProjector(GRAD_DIM, PROJ_DIM, seed=3),
    "sjlt-c1-nocache-smallblocks": lambda: SJLTProjector(GRAD_DIM, PROJ_DIM, seed=3, c=1, block_rows=97,
                                                         cache_bytes=0),
    "factored-flat-rademacher": lambda: FactoredProjector(GRAD_DIM, PROJ_DIM, seed=3, proj_type="rademacher"),
    "factored-flat-normal": lambda: FactoredProjector(GRAD_DIM, PROJ_DIM, seed=3, proj_type="normal"),
    # Linear(20, 30) + LayerNorm(30) (the dense "__other__" block) + Linear(30, 10): 630 + 60 + 310 = 1000
    "factored-mlp-layers": lambda: FactoredProjector.from_model(
        torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.LayerNorm(30), torch.nn.Linear(30, 10)),
        PROJ_DIM, seed=3),
}


def _grads(b, seed=0):
    return torch.randn(b, GRAD_DIM, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=sorted(FACTORIES))
def factory(request):
    return FACTORIES[request.param]


def test_shape_and_dtype(factory):
    p = factory()
    out = p.project(_grads(5), model_id=0)
    assert out.shape == (5, p.proj_dim)
    assert out.dtype == torch.float32


def test_same_vector_in_any_batch_split(factory):
    g = _grads(40)
    p = factory()
    whole = p.project(g, model_id=1)
    parts = torch.cat([factory().project(g[a:b], model_id=1) for a, b in [(0, 1), (1, 17), (17, 40)]])
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-4)
    # identical batches are bit-identical, also from a fresh instance (another process would be one)
    assert torch.equal(factory().project(g, model_id=1), whole)


def test_dict_input_equals_flat_input(factory):
    g = _grads(6)
    d = {"a.weight": g[:, :600].reshape(6, 20, 30), "a.bias": g[:, 600:]}
    p = factory()
    torch.testing.assert_close(p.project(d, model_id=2), p.project(g, model_id=2), rtol=1e-5, atol=1e-4)


def test_model_id_and_seed_change_the_matrix(factory):
    p = factory()
    if isinstance(p, NoOpProjector):
        pytest.skip("the identity has no randomness")
    g = _grads(4)
    assert not torch.allclose(p.project(g, 0), p.project(g, 1))
    other = type(p)(GRAD_DIM, PROJ_DIM, seed=4, proj_type=p.proj_type)
    assert not torch.allclose(p.project(g, 0), other.project(g, 0))


def test_inner_products_preserved(factory):
    """JL: ⟨Px, Py⟩ / scale ≈ ⟨x, y⟩ within a few 1/√k standard deviations."""
    p = factory()
    g = _grads(30, seed=5)
    out = p.project(g, model_id=0).double()
    ip = (out @ out.T) / p.scale
    ref = g.double() @ g.double().T
    norms = ref.diagonal().sqrt()
    err = (ip - ref) / (norms[:, None] * norms[None, :])
    assert float(err.abs().max()) < 6 / np.sqrt(p.proj_dim)
    assert float(err.abs().mean()) < 1.5 / np.sqrt(p.proj_dim)


def test_wrong_grad_dim_is_refused(factory):
    p = factory()
    with pytest.raises(BadInputError, match="grad_dim"):
        p.project(torch.randn(3, GRAD_DIM + 1), model_id=0)


def test_dense_entries_are_unit_variance_and_pure():
    for kind in ("rademacher", "normal"):
        p = DenseProjector(GRAD_DIM, PROJ_DIM, seed=11, proj_type=kind)
        mat = p.matrix(0)
        assert abs(float(mat.mean())) < 0.02 and abs(float(mat.var()) - 1) < 0.02
        # any row block equals the same rows of the whole matrix (pure function of the index)
        assert torch.equal(p.generate(0, 123, 456), mat[123:456])
        # and the definition does not depend on the instance's blocking
        q = DenseProjector(GRAD_DIM, PROJ_DIM, seed=11, proj_type=kind, block_rows=7, cache_bytes=0)
        assert torch.equal(q.matrix(0), mat)


def test_counter_rng_tensor_and_int_mixers_agree():
    xs = torch.tensor([0, 1, 2, 12345, 2**31, 2**32 - 1], dtype=torch.int64)
    assert counter_rng.mix32(xs).tolist() == [counter_rng.mix32_int(int(v)) for v in xs]


def test_rademacher_bits_follow_the_documented_layout():
    seed, mid, cols = 5, 2, 70
    mat = counter_rng.rademacher_block(seed, mid, 10, 12, cols)
    key = counter_rng.stream_key(seed, mid, counter_rng.STREAM_SIGN_WORDS)
    words = (cols + 31) // 32
    for r in (10, 11):
        for c in (0, 31, 32, 69):
            h = int(counter_rng.hash_counter(torch.tensor([r * words + c // 32]), key)[0])
            assert mat[r - 10, c] == (-1.0 if (h >> (c % 32)) & 1 else 1.0)


def test_64bit_counters():
    """Row indices beyond 2**32 / proj_dim work (no uint32 overflow) and differ from low rows."""
    big = 2**33 + 5
    a = counter_rng.rademacher_block(0, 0, big, big + 2, 64)
    b = counter_rng.rademacher_block(0, 0, 5, 7, 64)
    assert a.shape == (2, 64) and not torch.equal(a, b)


def test_make_projector_rejects_unknown_kind():
    with pytest.raises(BadInputError, match="unknown projector"):
        make_projector("fancy", 10, 5)
    with pytest.raises(BadInputError, match="proj_dim"):
        make_projector("dense", 10, 0)
