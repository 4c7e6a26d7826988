"""trak_core.featurize.sharded: featurization of a model sharded with FSDP2 across processes. Its per-example
projection (a
batched forward with per-example Z terms, no vmap over the model) equals the factored fast path's, for every hooked
kind in pairs and grid form; 2 CPU ranks (gloo) featurize a tiny GPT-2 classifier wrapped with FSDP2 into a store
whose finalized scores equal the unsharded run's within float32 rounding; what cannot run sharded is refused in one
line before any compute."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("torch.distributed.fsdp")

import sharded_models as sm  # noqa: E402

from trak_core import engine  # noqa: E402
from trak_core.errors import BadInputError  # noqa: E402
from trak_core.featurize import sharded  # noqa: E402
from trak_core.featurize.featurizer import Featurizer  # noqa: E402
from trak_core.featurize.modelout import ImageClassificationModelOutput  # noqa: E402
from trak_core.projection.factored import FactoredProjector  # noqa: E402
from trak_core.projection.layout import Layout  # noqa: E402
from trak_core.projection.projectors import make_projector  # noqa: E402


def _conv_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 4 * 4, 12),
        nn.LayerNorm(12),
        nn.ReLU(),
        nn.Linear(12, 4),
    ).eval()


def _conv_data(n=10):
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 4, (n,), generator=g)


def _grid(proj: FactoredProjector) -> FactoredProjector:
    """``proj`` with every factored block as a grid (k_out × k_in ≥ k), not pairs: the other form of each hook."""
    blocks = []
    for b in proj.layout.blocks:
        if b.kind != "other":
            k_out = min(b.d_out, math.isqrt(b.k - 1) + 1)
            k_in = min(b.in_rows, -(-b.k // k_out))
            b = dataclasses.replace(
                b, pairs=False, k_out=k_out, k_in=k_in, k=min(b.k, k_out * k_in), id_out=False, id_in=False
            )
        blocks.append(b)
    layout = Layout(tuple(blocks), proj.layout.param_shapes, True)
    return FactoredProjector(layout.grad_dim, sum(b.k for b in blocks), seed=proj.seed, layout=layout)


@pytest.mark.parametrize("form", ["pairs", "grid"])
@pytest.mark.parametrize("which", ["gpt2", "conv"])
def test_batched_projection_equals_the_factored_fast_path(which, form):
    """One process, a plain model: the sharded path's rows and Q equal the vmap fast path's (the same projector)."""
    model, (x, y) = (sm.make_model(), sm.train_data()) if which == "gpt2" else (_conv_model(), _conv_data())
    proj = FactoredProjector.from_model(model, 48, seed=2)
    if form == "grid":
        proj = _grid(proj)
    assert any(b.pairs for b in proj.blocks) == (form == "pairs")
    assert any(b.kind == "other" for b in proj.blocks)  # LayerNorm weights and loose biases: the per-module hook
    task = ImageClassificationModelOutput()
    want_x, want_q = Featurizer(model, task, proj).featurize((x[:10], y[:10]), 0, range(10))
    got_x, got_q = sharded.ShardedFeaturizer(model, task, proj).featurize((x[:10], y[:10]), 0, range(10))
    np.testing.assert_allclose(got_x, want_x, rtol=1e-4, atol=1e-6 * np.abs(want_x).max())
    np.testing.assert_allclose(got_q, want_q, rtol=1e-5, atol=1e-7)


def test_causal_lm_with_a_tied_head_equals_the_factored_fast_path():
    """transformers' GPT2LMHeadModel (its head tied to the token embedding: one block, two hooked uses), padded rows
    left and right: the causal LM task's batched output gives the fast path's rows and Q."""
    from test_causal_lm import gpt2_config, mixed_batch, sequences

    from trak_core.featurize.modelout import CausalLMModelOutput

    torch.manual_seed(0)
    model = __import__("transformers").GPT2LMHeadModel(gpt2_config()).eval()
    batch = mixed_batch(sequences(6))
    task = CausalLMModelOutput()
    for proj in (
        FactoredProjector.from_model(model, 40, seed=1),
        _grid(FactoredProjector.from_model(model, 40, seed=1)),
    ):
        want_x, want_q = Featurizer(model, task, proj).featurize(batch, 0, range(6))
        got_x, got_q = sharded.ShardedFeaturizer(model, task, proj).featurize(batch, 0, range(6))
        np.testing.assert_allclose(got_x, want_x, rtol=1e-4, atol=1e-5 * np.abs(want_x).max())
        np.testing.assert_allclose(got_q, want_q, rtol=1e-4, atol=1e-6)


def test_what_cannot_run_sharded_is_refused_before_any_compute():
    model = sm.make_model()
    task = ImageClassificationModelOutput()
    dense = make_projector("dense", sum(p.numel() for p in model.parameters()), 16, 0)
    with pytest.raises(BadInputError, match=r"needs projector 'factored': projector 'dense' projects per-example"):
        sharded.ShardedFeaturizer(model, task, dense)
    mha = nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True))
    with pytest.raises(BadInputError, match=r"in_proj_weight.*not used through an nn.Linear"):
        sharded.check_sharded(FactoredProjector.from_model(mha, 16), mha, task)
    ln3 = nn.Sequential(nn.Linear(4, 12), nn.Unflatten(1, (3, 4)), nn.LayerNorm([3, 4]), nn.Flatten(), nn.Linear(12, 2))
    with pytest.raises(BadInputError, match=r"2.weight"):
        sharded.check_sharded(FactoredProjector.from_model(ln3, 16), ln3, task)


# ---------------------------------------------------------------------------------------------- 2 ranks
N, SHARD, P, LAM = sm.NUM_TRAIN, 16, 24, 1e-2


def _store(path):
    model = sm.make_model()
    proj = FactoredProjector.from_model(model, P, seed=0)
    meta = engine.store_metadata(
        proj, train_set_size=N, dtype="float32", task=ImageClassificationModelOutput(), chunk_rows=8, shard_rows=SHARD
    )
    store = engine.open_run(str(path), meta)
    engine.plan_model(store, 0, lambda_setting=LAM, rescale=False)
    return store, model, proj


def _finish(store, model, proj) -> np.ndarray:
    engine.finalize(store, 0, LAM, False)
    tx, ty = sm.target_data()
    engine.begin_targets(store, "s", 0, sm.NUM_TARGETS)
    feat = Featurizer(model, ImageClassificationModelOutput(), proj)
    engine.featurize_targets(store, "s", 0, lambda: feat, lambda a, b: [tx[a:b], ty[a:b]], 4)
    used = engine.prepare_scores(store, "s", [0])
    engine.score_block(store, "s", used, 0, N)
    return store.scores("s")[:]


def test_two_fsdp2_ranks_featurize_a_transformer_as_one_process(tmp_path):
    from sharded_ranks import run_ranks

    x, y = sm.train_data()
    store, model, proj = _store(tmp_path / "ref")
    feat = Featurizer(model, ImageClassificationModelOutput(), proj)
    for s in range(N // SHARD):
        engine.featurize_shard(store, 0, s, lambda: feat, lambda a, b: [x[a:b], y[a:b]], 4)
    want = _finish(store, model, proj)

    store2, model2, proj2 = _store(tmp_path / "sharded")  # the arrays created by the parent: one writer
    bad = _store(tmp_path / "bad")[0]
    # steps of 2 × 3 rows: rank 1 has no rows in a shard's last step (a spare forward)
    run_ranks(2, str(tmp_path / "sharded"), N // SHARD, batch_size=3, lm_out=str(tmp_path), bad_store=bad.location)
    # bad input on rank 1: it names the rows, rank 0 stops too, nothing of the shard is marked
    raised = [(tmp_path / f"bad.rank{r}").read_text() for r in range(2)]
    assert raised[1].startswith("BadInputError: train_data rows 3..5 (model_id=0): labels out of range"), raised[1]
    assert raised[0].startswith("StateError: another rank stopped on bad input"), raised[0]
    assert not bad.model(0).featurized[:].any()
    assert store2.model(0).featurized[:].all()
    np.testing.assert_allclose(
        store2.read_train_rows(0, 0, N)[0], store.read_train_rows(0, 0, N)[0], rtol=1e-4, atol=1e-6
    )
    got = _finish(store2, model2, proj2)
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())

    # the causal LM with its head tied to the token embedding, sharded over the 2 ranks (3 rows each)
    from test_causal_lm import gpt2_config, mixed_batch, sequences
    from transformers import GPT2LMHeadModel

    from trak_core.featurize.modelout import CausalLMModelOutput

    torch.manual_seed(0)
    lm = GPT2LMHeadModel(gpt2_config()).eval()
    want_x, want_q = Featurizer(lm, CausalLMModelOutput(), FactoredProjector.from_model(lm, 40, seed=1)).featurize(
        mixed_batch(sequences(6)), 0, range(6)
    )
    got_x = np.concatenate([np.load(tmp_path / f"x{r}.npy") for r in range(2)])
    got_q = np.concatenate([np.load(tmp_path / f"q{r}.npy") for r in range(2)])
    np.testing.assert_allclose(got_x, want_x, rtol=1e-4, atol=1e-5 * np.abs(want_x).max())
    np.testing.assert_allclose(got_q, want_q, rtol=1e-4, atol=1e-6)
