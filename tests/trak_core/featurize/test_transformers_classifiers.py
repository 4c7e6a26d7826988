"""task="text_classification" on transformers' AutoModelForSequenceClassification models as they come (an output
object with .logits, an attention mask, padding): a bidirectional BERT and a causal GPT-2 classifier, saved and
loaded with from_pretrained. Per-example gradients, Q and projected features against float64 autograd on each
unpadded example called the transformers way (no mask, no vmap)."""

import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from trak_core.featurize.featurizer import Featurizer  # noqa: E402
from trak_core.featurize.gradients import FunctionalGradientComputer, vectorize  # noqa: E402
from trak_core.featurize.modelout import TextClassificationModelOutput, is_causal  # noqa: E402
from trak_core.projection.projectors import make_projector  # noqa: E402

VOCAB, CLASSES, T = 20, 3, 9
transformers.logging.set_verbosity_error()


def configs():
    return {
        "bert": transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=8,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=16,
            max_position_embeddings=16,
            type_vocab_size=2,
            num_labels=CLASSES,
            pad_token_id=0,
        ),
        "gpt2": transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=8, n_layer=2, n_head=2, num_labels=CLASSES, pad_token_id=0
        ),
    }


@pytest.fixture(scope="module", params=["bert", "gpt2"])
def classifier_dir(request, tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param)
    transformers.AutoModelForSequenceClassification.from_config(configs()[request.param]).save_pretrained(path)
    return request.param, path


def load(path, dtype=torch.float32):
    return transformers.AutoModelForSequenceClassification.from_pretrained(path).to(dtype).eval()


def examples(n: int, seed: int = 0):
    """(unpadded (ids, types) pairs, the right-padded batch (input_ids, token_type_ids, attention_mask, labels))."""
    g = torch.Generator().manual_seed(seed)
    rows, batch = [], [torch.zeros(n, T, dtype=torch.long) for _ in range(3)]
    for i in range(n):
        length = int(torch.randint(3, T + 1, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (length,), generator=g)
        types = (torch.arange(length) >= length // 2).long()
        rows.append((ids, types))
        batch[0][i, :length], batch[1][i, :length], batch[2][i, :length] = ids, types, 1
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    return rows, (*batch, labels)


def reference(model, rows, labels):
    """float64 autograd per unpadded example: (Q = 1 − p_y, the flat gradient of the margin log(p_y/(1−p_y)))."""
    params = list(model.parameters())
    qs, gs = [], []
    for (ids, types), y in zip(rows, labels):
        logits = model(input_ids=ids[None], token_type_ids=types[None]).logits[0].double()
        logp = torch.log_softmax(logits, -1)[y]
        f = logp - torch.log(-torch.expm1(logp))
        qs.append(float(1 - torch.exp(logp).detach()))
        gs.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(f, params)]).double())
    return np.array(qs), torch.stack(gs)


def test_causality_is_read_from_the_attention_modules(classifier_dir):
    name, path = classifier_dir
    assert is_causal(load(path)) is (name == "gpt2")


def test_gradients_and_q_match_float64_autograd(classifier_dir):
    _, path = classifier_dir
    model = load(path, torch.float64)
    rows, batch = examples(6)
    fc = FunctionalGradientComputer(model, TextClassificationModelOutput())
    q, g = reference(model, rows, batch[3])
    torch.testing.assert_close(vectorize(fc.compute_per_sample_grad(batch)), g, rtol=1e-8, atol=1e-11)
    np.testing.assert_allclose(fc.compute_loss_grad(batch).numpy(), q, rtol=1e-9)


@pytest.mark.parametrize("kind", ["dense", "factored"])
def test_features_match_the_projected_reference(classifier_dir, kind):
    _, path = classifier_dir
    model = load(path)
    grad_dim = sum(p.numel() for p in model.parameters())
    proj = make_projector(kind, grad_dim, 48, seed=2, **({"model": model} if kind == "factored" else {}))
    rows, batch = examples(5, seed=1)
    x, q = Featurizer(model, "text_classification", proj).featurize(batch, model_id=0)
    q_ref, g = reference(load(path, torch.float64), rows, batch[3])
    names, shapes = zip(*[(n, p.shape) for n, p in model.named_parameters()])
    parts = torch.split(g, [math.prod(s) for s in shapes], dim=1)
    grads = {n: p.reshape(len(rows), *s).float() for n, p, s in zip(names, parts, shapes)}
    want = proj.project(grads, model_id=0).double().numpy() / math.sqrt(grad_dim)
    np.testing.assert_allclose(x, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())
    np.testing.assert_allclose(q, q_ref, rtol=1e-5)
