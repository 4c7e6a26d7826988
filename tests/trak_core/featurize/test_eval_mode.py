"""BatchNorm, dropout and buffers: features are computed in eval mode. TRAKer.load_checkpoint and
start_scoring_checkpoint (and the pipeline's featurizer) put the model in eval mode, whatever mode it came in:
BatchNorm normalizes with its running statistics, which featurizing leaves untouched (buffers are inputs, never
updated or differentiated); dropout is off, so the same example gives the same features every time. Checked
against float64 autograd on the model in eval mode, for the identity and the default (factored) projector."""

import logging
import math

import numpy as np
import pytest
import torch
from torch import nn

from trak_core import TRAKer
from trak_core.projection.projectors import NoOpProjector, make_projector

D_IN, CLASSES = 6, 3


def make_model(seed: int = 0) -> nn.Module:
    """Linear → BatchNorm1d → ReLU → Dropout(0.5) → Linear, with running statistics far from (0, 1)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(D_IN, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, CLASSES))
    model[1].running_mean.uniform_(-1, 1)
    model[1].running_var.uniform_(0.3, 3)
    model[1].num_batches_tracked.fill_(17)
    return model


def data(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D_IN, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def eval_reference(state: dict, x, y) -> np.ndarray:
    """∇ of the margin per example, float64, model in eval mode, divided by √grad_dim."""
    model = make_model().double()
    model.load_state_dict(state)
    model.eval()
    params = list(model.parameters())
    rows = []
    for xi, yi in zip(x.double(), y):
        logits = model(xi[None])[0]
        logp = torch.log_softmax(logits, -1)[yi]
        f = logp - torch.log(-torch.expm1(logp))
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(f, params)]))
    return torch.stack(rows).numpy() / math.sqrt(sum(p.numel() for p in params))


@pytest.mark.parametrize("kind", ["noop", "factored"])
def test_featurize_runs_in_eval_mode_and_leaves_buffers_alone(tmp_path, kind):
    model = make_model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()  # as a training loop would leave it
    x, y = data(24)
    xt, yt = data(5, seed=1)
    d = sum(p.numel() for p in model.parameters())
    proj = NoOpProjector() if kind == "noop" else make_projector("factored", d, 16, model=model)
    tr = TRAKer(
        model=model,
        task="image_classification",
        train_set_size=24,
        save_dir=str(tmp_path / "s"),
        device="cpu",
        projector=proj,
        use_half_precision=False,
        lambda_reg=0.1,
        logging_level=logging.ERROR,
    )
    tr.load_checkpoint(state, model_id=0)
    assert not model.training and not any(m.training for m in model.modules())
    tr.featurize((x[:12], y[:12]), num_samples=12)
    tr.featurize((x[12:], y[12:]), num_samples=12)
    tr.finalize_features()
    tr.start_scoring_checkpoint("e", state, 0, 5)
    tr.score((xt, yt), num_samples=5)
    tr.finalize_scores("e")
    for name, buf in model.named_buffers():  # running statistics untouched by featurizing and scoring
        torch.testing.assert_close(buf, state[name], rtol=0, atol=0)

    got = tr.store.model(0).grads[:]
    ref = eval_reference(state, x, y)
    if kind == "factored":
        names, shapes = zip(*[(n, p.shape) for n, p in model.named_parameters()])
        parts = torch.split(torch.from_numpy(ref).float(), [math.prod(s) for s in shapes], dim=1)
        ref = proj.project({n: p.reshape(24, *s) for n, p, s in zip(names, parts, shapes)}, model_id=0).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
    # dropout off: the same rows again give the same bits
    again = tr.featurizer.featurize((x[:12], y[:12]), model_id=0)[0]
    np.testing.assert_array_equal(again, got[:12])


def test_train_mode_would_give_other_gradients():
    """The check above can fail: in train mode BatchNorm uses the batch's statistics and dropout drops units, so
    the per-example gradients differ from eval mode's."""
    model = make_model().double()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = data(8)
    model.train()
    torch.manual_seed(3)
    logits = model(x.double())
    logp = torch.log_softmax(logits, -1)[0, y[0]]
    g = torch.autograd.grad(logp - torch.log(-torch.expm1(logp)), list(model.parameters()))
    train_row = torch.cat([t.reshape(-1) for t in g]).numpy() / math.sqrt(sum(p.numel() for p in model.parameters()))
    assert not np.allclose(train_row, eval_reference(state, x[:1], y[:1])[0], rtol=1e-2)
    assert not torch.equal(model[1].running_mean, state["1.running_mean"])  # a train-mode forward moves them
