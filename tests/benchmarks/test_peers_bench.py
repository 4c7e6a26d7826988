"""benchmarks/peers.py: the harness declares the case and the columns take trakflow's curvature options by name; the
kronfluence adapter's scores are the influence of each train example on each target's margin (brute force on a tiny
MLP, averaged over checkpoints; on a tiny GPT, of each train sequence on each target's log-odds), skipped where
kronfluence is not installed."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from trak_fixtures import REPO_ROOT

ROOT = str(REPO_ROOT)


@pytest.fixture(scope="module")
def peers():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("peers", os.path.join(ROOT, "benchmarks", "peers.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))


def test_harness_runs_peers_and_columns_name_each_curvature(peers):
    sys.path.insert(0, ROOT)
    try:
        harness = importlib.import_module("benchmarks.__main__")
    finally:
        sys.path.remove(ROOT)
    assert "benchmarks/peers.py" in " ".join(harness.BY_NAME["peers"].commands)
    for c in peers.CURVATURES:
        assert f"trakflow curvature={c}" in peers.COLUMNS
    assert {"trakflow defaults", "trakflow dense", "kronfluence kfac", "kronfluence ekfac"} <= set(peers.COLUMNS)


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _brute(states, train, targets) -> np.ndarray:
    """mean over checkpoints of −∇margin(target) · ∇CE(train example), float64, one example at a time: the margin's
    first-order increase when the example's loss is upweighted (θ moves along −∇CE), with the identity curvature."""
    out = 0.0
    for st in states:
        model = _model().double()
        model.load_state_dict(st)

        def grad(loss):
            return torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))])

        ce = torch.nn.functional.cross_entropy
        gt = torch.stack([grad(ce(model(x[None].double()), y[None], reduction="sum")) for x, y in zip(*train)])
        logits = lambda x: model(x[None].double())  # noqa: E731
        gq = torch.stack([grad(torch.sum(_margin(logits(x), y[None]))) for x, y in zip(*targets)])
        out = out - (gt @ gq.T).numpy()
    return out / len(states)


def _margin(logits, labels):
    idx = torch.arange(len(labels))
    other = logits.clone()
    other[idx, labels] = -torch.inf
    return logits[idx, labels] - other.logsumexp(-1)


def test_kronfluence_adapter_scores_are_margin_influence(peers):
    pytest.importorskip("kronfluence")
    g = torch.Generator().manual_seed(0)
    train = (torch.randn(7, 4, generator=g), torch.randint(0, 3, (7,), generator=g))
    targets = (torch.randn(3, 4, generator=g), torch.randint(0, 3, (3,), generator=g))
    states = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        states.append(_model().state_dict())
    want = _brute(states, train, targets)
    case = SimpleNamespace(make_model=_model, train=lambda: train, targets=lambda: targets, task="image_classification")
    got = peers.kron_scores(case, states, "identity", batch=4)
    assert got.shape == (7, 3)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    # K-FAC with a damping far above the factors' eigenvalues: the identity's scores divided by the damping
    big = 1e6
    kfac = peers.kron_scores(case, states[:1], "kfac", batch=4, damping_factor=big)
    np.testing.assert_allclose(kfac * big, _brute(states[:1], train, targets), rtol=1e-3, atol=1e-5)


def _gpt():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=7, n_positions=6, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(cfg).eval()


def test_kronfluence_adapter_on_a_causal_lm_is_log_odds_influence_through_its_conv1d_layers(peers):
    """identity curvature: −∇f(target) · ∇(summed next-token cross-entropy of the train sequence), over the GPT's
    Conv1D weights and biases only (the layers kronfluence fits, as nn.Linear), f the target's sequence log-odds."""
    pytest.importorskip("kronfluence")
    from trak_core.featurize.modelout import log_odds, sequence_log_prob

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 7, (9, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[::2, -2:] = 0  # padded rows: their last two positions are neither attended to nor scored
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    train, targets = (ids[:6], mask[:6], labels[:6]), (ids[6:], mask[6:], labels[6:])
    torch.manual_seed(3)
    state = _gpt().state_dict()
    case = SimpleNamespace(make_model=_gpt, train=lambda: train, targets=lambda: targets, task="causal_lm")
    got = peers.kron_scores(case, [state], "identity", batch=4)

    model = _gpt().double()
    model.load_state_dict(state)
    params = [p for n, p in model.named_parameters() if ".attn.c_" in n or ".mlp.c_" in n]
    assert len(params) == 8

    def grad(out):
        return torch.cat([x.flatten() for x in torch.autograd.grad(out, params)])

    def logits(t, i):
        return model(input_ids=t[0][i : i + 1], attention_mask=t[1][i : i + 1]).logits

    gt = torch.stack([grad(-sequence_log_prob(logits(train, i), train[2][i : i + 1]).sum()) for i in range(6)])
    gq = torch.stack([grad(log_odds(sequence_log_prob(logits(targets, i), targets[2][i : i + 1])).sum())
                      for i in range(3)])  # fmt: skip
    assert got.shape == (6, 3)
    np.testing.assert_allclose(got, -(gt @ gq.T).numpy(), rtol=1e-3, atol=1e-6)
