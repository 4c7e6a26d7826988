"""The factored projector's fast path on transformers' GPT-2: its Conv1D layers (weight [in, out], y = x W + b) and
its output head tied to the token embedding are served by forward hooks (no per-example weight), and the features
equal the factored projection's definition (``FactoredProjector.project``) of float64 per-example gradients."""

import math
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from test_causal_lm import PAD, gpt2_config, mixed_batch, reference, sequences  # noqa: E402

import trak_core.projection.factored as factored_mod  # noqa: E402
import trak_core.projection.layout as factored_layout  # noqa: E402
from trak_core.featurize.gradients import FunctionalGradientComputer, vectorize  # noqa: E402
from trak_core.featurize.modelout import (  # noqa: E402
    CausalLMModelOutput,
    ImageClassificationModelOutput,
    TextClassificationModelOutput,
)
from trak_core.projection.factored import MATRIX, FactoredProjector  # noqa: E402
from trak_core.projection.layout import is_conv1d, matrix_uses  # noqa: E402

transformers.logging.set_verbosity_error()


def lm(dtype=torch.float64, **over):
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(gpt2_config(**over)).to(dtype).eval()


def as_pieces(model, g):
    """{parameter name: (B, *shape)} of flat gradients g (B, grad_dim) in the model's parameter order."""
    names, shapes = zip(*[(n, p.shape) for n, p in model.named_parameters()])
    parts = torch.split(g, [math.prod(s) for s in shapes], dim=1)
    return {n: p.reshape(g.shape[0], *s) for n, p, s in zip(names, parts, shapes, strict=True)}


def fast(proj, model, task, batch, model_id=0):
    gc = FunctionalGradientComputer(model, task)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to weight substitution
        return proj.featurize_batch(model, task, gc._weights(), gc._buffers(), batch, model_id)


def test_conv1d_and_tied_head_are_hooked_and_counted_once():
    model = lm()
    proj = FactoredProjector.from_model(model, 96, seed=1, dtype=torch.float64)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert proj.layout.grad_dim == sum(p.numel() for p in model.parameters())  # the tied table once
    assert proj.layout.grad_dim < sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    uses = matrix_uses(model, proj.layout)
    conv1d = [n for n, m in model.named_modules() if is_conv1d(m)]
    assert len(conv1d) == 4 * 2
    blocks = {b.name: b for b in proj.blocks}
    for n in conv1d:  # a bias pairs only with a square Conv1D (the bias has the weight's shape[0] entries)
        assert blocks[n + ".weight"].bias == (model.get_submodule(n).weight.shape[0] == model.get_submodule(n).nf)
        assert uses[n + ".weight"] == ((n, "conv1d", blocks[n + ".weight"].bias),)
    assert uses["transformer.wte.weight"] == (("transformer.wte", "embedding", False), ("lm_head", "linear", False))
    assert {b.name for b in proj.blocks if b.kind == MATRIX} == set(uses)  # the position table is an nn.Embedding


@pytest.mark.parametrize("over", [{}, {"n_embd": 6, "n_inner": 10}], ids=["square", "rect"])
@pytest.mark.parametrize("proj_dim", [40, 400])
def test_gpt2_lm_features_equal_the_definition_on_float64_autograd(monkeypatch, over, proj_dim):
    """Mixed left/right padding in one batch; each row against float64 autograd on its unpadded sequence."""
    if proj_dim == 400:  # pairs for the Conv1D matrix blocks too (their cost bound relaxed), not only the grid
        monkeypatch.setattr(factored_layout, "PAIRS_MAX_RATIO", 100.0)
    model = lm(**over)
    proj = FactoredProjector.from_model(model, proj_dim, seed=4, dtype=torch.float64)
    seqs = sequences(5, seed=2)
    x = fast(proj, model, CausalLMModelOutput(), mixed_batch(seqs), model_id=3)
    _, _, g = reference(model, seqs)
    want = proj.project(as_pieces(model, g), model_id=3)
    assert proj._substitute == set()
    torch.testing.assert_close(x, want, rtol=1e-9, atol=1e-10 * float(want.abs().max()))
    if proj_dim == 400:  # pairs; the bias of a square Conv1D paired along its input dimension
        assert any(b.pairs for b in proj.blocks if b.kind == MATRIX)
    if not over:
        assert any(b.bias for b in proj.blocks if b.kind == MATRIX)


def test_hooks_give_what_weight_substitution_gives(monkeypatch):
    """The same projection as the weight substitution used before for these blocks (float64: to rounding)."""
    model = lm()
    batch = mixed_batch(sequences(4, seed=5))
    proj = FactoredProjector.from_model(model, 64, seed=7, dtype=torch.float64)
    hooked = fast(proj, model, CausalLMModelOutput(), batch)
    monkeypatch.setattr(factored_mod, "matrix_uses", lambda model, layout: {})
    again = FactoredProjector.from_model(model, 64, seed=7, dtype=torch.float64)
    subst = fast(again, model, CausalLMModelOutput(), batch)
    torch.testing.assert_close(hooked, subst, rtol=1e-10, atol=1e-12 * float(subst.abs().max()))


def test_gpt2_sequence_classifier_equals_materialized_gradients():
    torch.manual_seed(0)
    cfg = gpt2_config(num_labels=3)
    model = transformers.GPT2ForSequenceClassification(cfg).double().eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, cfg.vocab_size, (4, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    ids[1, 5:] = PAD
    batch = (ids, torch.zeros_like(ids), mask, torch.tensor([0, 2, 1, 2]))
    task = TextClassificationModelOutput()
    proj = FactoredProjector.from_model(model, 48, seed=3, dtype=torch.float64)
    x = fast(proj, model, task, batch)
    grads = FunctionalGradientComputer(model, task).compute_per_sample_grad(batch)
    want = proj.project(as_pieces(model, vectorize(grads)), model_id=0)
    torch.testing.assert_close(x, want, rtol=1e-9, atol=1e-10 * float(want.abs().max()))


class _Tied(nn.Module):
    """A plain model whose output head shares the embedding table (and a bias of the head's rows)."""

    def __init__(self, sneaky=False):
        super().__init__()
        self.head = nn.Linear(6, 11)  # first: the table is named head.weight and pairs with head.bias
        self.emb = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.emb.weight = self.head.weight
        self.sneaky = sneaky

    def forward(self, x):
        h = torch.tanh(self.mid(self.emb(x).mean(1)))
        out = self.head(h)
        if self.sneaky:  # a third use, outside any module's forward
            out = out + nn.functional.linear(h, self.head.weight)
        return out


@pytest.mark.parametrize("sneaky", [False, True])
def test_tied_plain_model_sums_both_uses(sneaky):
    torch.manual_seed(0)
    model = _Tied(sneaky).double().eval()
    task = ImageClassificationModelOutput()
    proj = FactoredProjector.from_model(model, 30, seed=2, dtype=torch.float64)
    blk = next(b for b in proj.blocks if b.kind == MATRIX)
    assert blk.params == ("head.weight", "head.bias")  # the head's bias pairs with the table's rows
    assert matrix_uses(model, proj.layout)[blk.name] == (("head", "linear", True), ("emb", "embedding", False))
    batch = (torch.randint(0, 11, (5, 4)), torch.randint(0, 11, (5,)))
    gc = FunctionalGradientComputer(model, task)
    want = proj.project(gc.compute_per_sample_grad(batch), model_id=0)
    if sneaky:
        with pytest.warns(UserWarning, match="used outside"):
            x = proj.featurize_batch(model, task, gc._weights(), gc._buffers(), batch, 0)
        assert blk.name in proj._substitute
    else:
        x = fast(proj, model, task, batch)
    torch.testing.assert_close(x, want, rtol=1e-9, atol=1e-10 * float(want.abs().max()))
