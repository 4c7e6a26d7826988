"""Mixed precision: a bfloat16 / float16 model featurizes in its own dtype (weights not upcast), every projector
kind takes it on the CPU, and its scores follow a float64 run of the same model (benchmarks/mixed_precision.py
gives the numbers of docs/scaleout.md).

The threshold: bfloat16 keeps 8 significant bits, so each activation and gradient entry carries ~2⁻⁹ relative
rounding, which through the forward and backward passes adds up to 1–2% of a score (measured: 0.7–1.8% at most).
The score columns' correlation with float64 measured 0.99981–0.99995 (MLP, 2-layer GPT-2); 0.999 leaves a margin
of 5–20× on 1 − corr, and stays far above what a different projection of the same gradients gives (0.95–0.98),
so a path that silently changed the projection or dropped a layer fails it."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from benchmarks.mixed_precision import build, compare, run
from trak_core.featurize.featurizer import Featurizer
from trak_core.featurize.gradients import grad_dim_of
from trak_core.projection.factored import FactoredProjector
from trak_core.projection.projectors import make_projector

HALF = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("model", ["mlp", "gpt2-tiny"])
def test_bf16_scores_follow_float64(model):
    make, task, data, targets = build(model, 64, 4, 8)
    ref = run(make, task, data, targets, torch.float64, "cpu", 32, "fixed")
    got = run(make, task, data, targets, torch.bfloat16, "cpu", 32, "fixed")  # asserts the weights stay bf16
    c = compare(got, ref)
    assert c["min_corr"] > 0.999, c
    assert c["rel_err"] < 0.05, c


@pytest.mark.parametrize("kind", ["factored", "dense", "sjlt"])
@pytest.mark.parametrize("dtype", HALF)
def test_every_projector_kind_takes_a_half_model(kind, dtype):
    """Rows of a bf16 / fp16 MLP: finite float32 X, each row's direction within rounding of the float64 model's."""
    make, task, (x, y), _ = build("mlp", 16, 1, 1)
    rows = {}
    for dt in (torch.float64, dtype):
        m = make().to(dt)
        proj = make_projector(kind, grad_dim_of(m), 64, 0, "rademacher", device="cpu", model=m)
        rows[dt], _ = Featurizer(m, task, proj).featurize((x.to(dt), y), 0)
        assert all(p.dtype == dt for p in m.parameters())
    half, ref = rows[dtype], rows[torch.float64]
    assert half.dtype == np.float32 and np.isfinite(half).all()
    cos = (half * ref).sum(1) / np.linalg.norm(half, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() > 0.999, cos.min()


def test_the_fast_path_gets_the_model_in_its_dtype(monkeypatch):
    """The factored fast path is handed the bf16 weights themselves (no float32 copy of the model), and the hook
    check's rounding tolerance follows the dtype: no bf16 batch falls back to weight substitution."""
    seen = []
    real = FactoredProjector.featurize_batch

    def spy(self, model, task, weights, *a, **k):
        seen.append({w.dtype for w in weights.values()})
        seen.append({w.data_ptr() for w in weights.values()} <= {p.data_ptr() for p in model.parameters()})
        return real(self, model, task, weights, *a, **k)

    monkeypatch.setattr(FactoredProjector, "featurize_batch", spy)
    make, task, _, _ = build("mlp", 1, 1, 1)
    for seed in range(5):  # seeds 2 and 4 tripped a float32-sized tolerance
        m = make().to(torch.bfloat16)
        torch.manual_seed(seed)
        m[0].weight.data.normal_(0, 0.2)
        x, y = torch.randn(64, 32).to(torch.bfloat16), torch.randint(0, 10, (64,))
        proj = make_projector("factored", grad_dim_of(m), 64, 0, "rademacher", device="cpu", model=m)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the fallback's warning would fail here
            Featurizer(m, task, proj).featurize((x, y), 0)
        assert not proj._substitute
    assert seen[0] == {torch.bfloat16} and seen[1] is True
