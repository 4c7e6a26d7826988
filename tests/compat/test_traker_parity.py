"""trak_core.TRAKer against traker 0.3.2 (the oracle), configured the same way."""

import warnings

import numpy as np
import pytest
import torch

trak = pytest.importorskip("trak", reason="traker 0.3.2 is the oracle (make test installs it)")
from trak.projectors import NoOpProjector as TrakNoOp  # noqa: E402
from trak_fixtures import checkpoints, make_data, rel_err, run_traker  # noqa: E402

import trak_core  # noqa: E402

FIRST_LAYER = ["0.weight", "0.bias"]  # margin gradients of the last layer are exactly rank-deficient


def _both(tmp_path, k, **kw):
    data = make_data()
    ckpts = checkpoints(k)
    ours, _ = run_traker(trak_core.TRAKer, tmp_path / "ours", ckpts, data, projector=trak_core.NoOpProjector(), **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs, _ = run_traker(trak.TRAKer, tmp_path / "theirs", ckpts, data, projector=TrakNoOp(device="cpu"), **kw)
    return ours, theirs


@pytest.mark.parametrize("k", [1, 3])
def test_identity_float32_no_reg(tmp_path, k):
    ours, theirs = _both(tmp_path, k, grad_wrt=FIRST_LAYER)
    assert ours.shape == theirs.shape == (120, 7)
    assert rel_err(ours, theirs) < 1e-4


@pytest.mark.parametrize("k", [1, 3])
def test_identity_float32_with_lambda(tmp_path, k):
    # all parameters: singular XᵀX, made invertible by λ
    ours, theirs = _both(tmp_path, k, lambda_reg=1e-2)
    assert rel_err(ours, theirs) < 1e-4


def test_identity_float16_documented_tolerance(tmp_path):
    # traker accumulates XᵀX in float16 and inverts in float32; we accumulate in float64.
    # Documented tolerance (README): 2e-2 of the largest |score|.
    ours, theirs = _both(tmp_path, 3, grad_wrt=FIRST_LAYER, half=True)
    assert rel_err(ours, theirs) < 2e-2
    # and our float16 run stays close to our float32 run
    data = make_data()
    ours32, _ = run_traker(
        trak_core.TRAKer,
        tmp_path / "o32",
        checkpoints(3),
        data,
        projector=trak_core.NoOpProjector(),
        grad_wrt=FIRST_LAYER,
    )
    assert rel_err(ours, ours32) < 2e-2


def test_scores_match_brute_force_float64(tmp_path):
    """Exact math: S = mean_c(X_c (X_cᵀX_c + λI)⁻¹/r_c G_cᵀ) ⊙ mean_c(Q_c), r_c = mean|inverse| (traker's rescale)."""

    data = make_data()
    x, y, xt, yt = data
    ckpts = checkpoints(2)
    lam = 1e-2
    ours, _ = run_traker(
        trak_core.TRAKer, tmp_path / "o", ckpts, data, projector=trak_core.NoOpProjector(), lambda_reg=lam
    )
    from trak_fixtures import make_model

    acc, qacc = 0, 0
    for ck in ckpts:
        model = make_model().double()
        model.load_state_dict({k: v.double() for k, v in ck.items()})
        params = list(model.parameters())

        def feats(xs, ys):
            rows = []
            for xi, yi in zip(xs.double(), ys):
                p = torch.softmax(model(xi[None]), -1)[0, yi]
                f = torch.log(p) - torch.log1p(-p)  # the margin log(p / (1 - p)), written independently
                rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(f, params)]))
            flat = torch.stack(rows)
            return flat / np.sqrt(flat.shape[1])

        X, G = feats(x, y), feats(xt, yt)
        inv = torch.linalg.inv(X.T @ X + lam * torch.eye(X.shape[1], dtype=torch.float64))
        inv = inv / inv.abs().mean()
        acc = acc + X @ inv @ G.T
        with torch.no_grad():
            p = torch.softmax(model(x.double()), -1)[torch.arange(len(y)), y]
        qacc = qacc + (1 - p)
    expected = (acc / 2) * (qacc / 2)[:, None]
    assert rel_err(ours, expected.detach().numpy()) < 1e-5


def test_no_rescale_option(tmp_path):
    """rescale_inverse=False gives the plain (XᵀX+λI)⁻¹: the single-checkpoint scores scale by mean|inv|."""
    data = make_data()
    ck = checkpoints(1)
    a, tr = run_traker(
        trak_core.TRAKer, tmp_path / "a", ck, data, projector=trak_core.NoOpProjector(), grad_wrt=FIRST_LAYER
    )
    b, _ = run_traker(
        trak_core.TRAKer,
        tmp_path / "b",
        ck,
        data,
        projector=trak_core.NoOpProjector(),
        grad_wrt=FIRST_LAYER,
        rescale_inverse=False,
    )
    r = float((a * b).sum() / (a * a).sum())  # the best single scale from a to b
    assert not np.isclose(r, 1.0, rtol=1e-2)
    assert rel_err(r * a, b) < 1e-4  # b is a scaled copy of a: only the global scale of Φ changed


def test_warns_on_rank_deficiency_where_traker_is_silent(tmp_path):
    data = make_data()
    with pytest.warns(trak_core.IllConditionedWarning, match="lambda_reg"):
        run_traker(trak_core.TRAKer, tmp_path / "w", checkpoints(1), data, projector=trak_core.NoOpProjector())


def test_proj_dim_over_train_size_is_refused_undamped_and_warned_damped(tmp_path):
    """traker returns noise at lambda_reg=0: refused before anything is created, as the pipeline refuses it; with a
    damping that leaves XᵀX close to singular, finalize warns."""
    data = make_data(n=40)
    with pytest.raises(trak_core.BadInputError, match="proj_dim: 64 ≥ number of train examples n=40"):
        run_traker(trak_core.TRAKer, tmp_path / "p", checkpoints(1), data, proj_dim=64)
    assert not (tmp_path / "p" / "zarr.json").exists()
    with pytest.warns(trak_core.IllConditionedWarning, match="badly conditioned .* proj_dim=64, n=40"):
        run_traker(trak_core.TRAKer, tmp_path / "q", checkpoints(1), data, proj_dim=64, lambda_reg=1e-12)
