"""benchmarks/curvature.py: the Gauss-Newton curvature it measures is the one it says.

* rᵢ = Qᵢ(1 − Qᵢ) is the loss's second derivative in the margin, for the loss and margin of the built-in outputs;
* ``GGNSolver`` scores X (XᵀRX + β·mean(r)·XᵀX + λI)⁻¹ Gᵀ with traker's rescale, against a brute-force float64 inverse;
* its ``transfer`` λ is the XᵀX rule's λ times trace(XᵀRX) / trace(XᵀX).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest
import torch
from trak_fixtures import REPO_ROOT

from trak_core.featurize.modelout import ImageClassificationModelOutput

ROOT = str(REPO_ROOT)


@pytest.fixture(scope="module")
def curvature():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("curvature", os.path.join(ROOT, "benchmarks", "curvature.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))


def test_loss_curvature_is_the_second_derivative_of_the_loss_in_the_margin(curvature):
    """For logits z and label y: Q = out_to_loss of the built-in output, f its margin, loss = cross-entropy.
    ∂loss/∂f = −Q and ∂²loss/∂f² = Q(1 − Q) along the margin (the loss is log(1 + e^(−f)))."""
    torch.manual_seed(0)
    logits = torch.randn(6, 5, dtype=torch.float64) * 3
    labels = torch.randint(0, 5, (6,))
    model = torch.nn.Identity()  # the "model" returns its input: the logits
    out = ImageClassificationModelOutput()
    q = out.get_out_to_loss_grad(model, {}, {}, (logits, labels)).reshape(-1)
    for i in range(6):
        f = out.get_output(model, {}, {}, logits[i], labels[i]).detach().reshape(()).requires_grad_(True)
        loss = torch.nn.functional.softplus(-f)  # cross-entropy of the row, as a function of its margin
        (d1,) = torch.autograd.grad(loss, f, create_graph=True)
        (d2,) = torch.autograd.grad(d1, f)
        # the cross-entropy of the logits equals softplus(−margin)
        ce = torch.nn.functional.cross_entropy(logits[i : i + 1], labels[i : i + 1])
        assert float(loss.detach()) == pytest.approx(float(ce), rel=1e-12)
        assert float(-d1.detach()) == pytest.approx(float(q[i]), rel=1e-12)
        r = curvature.loss_curvature(q[i : i + 1].numpy())[0]
        assert float(d2) == pytest.approx(r, rel=1e-10)


def _features(seed: int, n: int = 40, p: int = 6, m: int = 3) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "X": rng.standard_normal((n, p)).astype(np.float32),
        "Q": rng.uniform(0.01, 0.99, n).astype(np.float32),
        "G": rng.standard_normal((m, p)).astype(np.float32),
    }


@pytest.mark.parametrize("setting", ["transfer", "rel:0.3"])
def test_ggn_solver_scores_against_a_brute_force_inverse(curvature, setting):
    import quality

    f = _features(1)
    base = quality.Solver(f)
    ggn = curvature.GGNSolver(f, base)
    x = f["X"].astype(np.float64)
    r = f["Q"].astype(np.float64) * (1 - f["Q"].astype(np.float64))
    r = r + curvature.GGN_FLOOR * r.mean()  # the floor on the weights, as trak_core's ggn_curvature
    h = x.T @ (x * r[:, None])
    lam = ggn.resolve(setting)  # to float32 rounding: GGNSolver keeps √R X in float32
    if setting == "transfer":
        assert lam == pytest.approx(base.resolve(curvature.RULE) * np.trace(h) / np.trace(x.T @ x), rel=1e-6)
    else:
        assert lam == pytest.approx(0.3 * np.trace(h) / h.shape[0], rel=1e-6)
    inv = np.linalg.inv(h + lam * np.eye(h.shape[0]))
    want = x @ (inv / np.abs(inv).mean()) @ f["G"].astype(np.float64).T
    got = ggn.scores(lam).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    # and not the XᵀX scores: the curvature matters on these rows
    plain = x @ np.linalg.inv(x.T @ x + lam * np.eye(h.shape[0])) @ f["G"].astype(np.float64).T
    assert not np.allclose(got / np.abs(got).max(), plain / np.abs(plain).max(), atol=1e-3)
