"""Per-example gradients and model output functions against per-example autograd loops (float64)."""

import pytest
import torch
from trak_fixtures import make_data, make_model

from trak_core import (
    CLIPModelOutput,
    FunctionalGradientComputer,
    ImageClassificationModelOutput,
    IterativeGradientComputer,
    IterativeImageClassificationModelOutput,
    TextClassificationModelOutput,
    vectorize,
)
from trak_core.errors import BadInputError


def loop_grads(model, f, samples):
    params = list(model.parameters())
    rows = []
    for s in samples:
        gs = torch.autograd.grad(f(*s), params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(gs, params)]))
    return torch.stack(rows)


def test_image_margin_is_log_odds_and_q_is_one_minus_p():
    model = make_model().double()
    x, y, _, _ = make_data(n=10)
    x = x.double()
    task = ImageClassificationModelOutput(temperature=2.0)
    w, b = dict(model.named_parameters()), dict(model.named_buffers())
    for i in range(10):
        p = torch.softmax(model(x[i : i + 1]), -1)[0, y[i]]
        f = task.get_output(model, w, b, x[i], y[i])
        assert torch.isclose(f, torch.log(p / (1 - p)), rtol=1e-10)
    q = task.get_out_to_loss_grad(model, w, b, (x, y)).reshape(-1)
    p2 = torch.softmax(model(x) / 2.0, -1)[torch.arange(10), y]
    torch.testing.assert_close(q, (1 - p2).detach())


@pytest.mark.parametrize("grad_wrt", [None, ["2.weight"], ["0.bias", "2.bias"]])
def test_functional_and_loop_match_autograd(grad_wrt):
    model = make_model().double()
    x, y, _, _ = make_data(n=12)
    x = x.double()
    fc = FunctionalGradientComputer(model, ImageClassificationModelOutput(), grad_wrt=grad_wrt)
    lc = IterativeGradientComputer(model, IterativeImageClassificationModelOutput(), grad_wrt=grad_wrt)
    got_f = vectorize(fc.compute_per_sample_grad((x, y)))
    got_l = vectorize(lc.compute_per_sample_grad((x, y)))
    names = [n for n, _ in model.named_parameters() if grad_wrt is None or n in grad_wrt]
    params = dict(model.named_parameters())

    def f(xi, yi):
        p = torch.softmax(model(xi[None]), -1)[0, yi]
        return torch.log(p) - torch.log1p(-p)

    full = loop_grads(model, f, zip(x, y))
    offsets, o = {}, 0
    for n, p in model.named_parameters():
        offsets[n] = (o, o + p.numel())
        o += p.numel()
    want = torch.cat([full[:, offsets[n][0] : offsets[n][1]] for n in names], 1)
    assert got_f.shape == (12, sum(params[n].numel() for n in names))
    torch.testing.assert_close(got_f, want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got_l, want, rtol=1e-9, atol=1e-12)


def test_buffers_are_used_not_differentiated():
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 3)).double()
    model[1].running_mean.uniform_(-1, 1)
    model[1].running_var.uniform_(0.5, 2)
    model.eval()
    x, y, _, _ = make_data(n=5)
    x = x.double()
    fc = FunctionalGradientComputer(model, ImageClassificationModelOutput())
    got = vectorize(fc.compute_per_sample_grad((x, y)))

    def f(xi, yi):
        p = torch.softmax(model(xi[None]), -1)[0, yi]
        return torch.log(p) - torch.log1p(-p)

    torch.testing.assert_close(got, loop_grads(model, f, zip(x, y)), rtol=1e-9, atol=1e-12)


class TinyTextModel(torch.nn.Module):
    def __init__(self, vocab=20, dim=6, classes=3):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.type_emb = torch.nn.Embedding(2, dim)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, input_ids, token_type_ids, attention_mask):
        h = self.emb(input_ids) + self.type_emb(token_type_ids)
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1).clamp(min=1))


def test_text_classification_matches_loop():
    torch.manual_seed(0)
    model = TinyTextModel().double()
    ids = torch.randint(0, 20, (6, 5))
    types = torch.randint(0, 2, (6, 5))
    mask = torch.ones(6, 5, dtype=torch.long)
    mask[:, 4] = 0
    labels = torch.randint(0, 3, (6,))
    task = TextClassificationModelOutput()
    got = vectorize(FunctionalGradientComputer(model, task).compute_per_sample_grad((ids, types, mask, labels)))

    def f(i, t, m, lab):
        p = torch.softmax(model(i[None], t[None], m[None]), -1)[0, lab]
        return torch.log(p) - torch.log1p(-p)

    torch.testing.assert_close(got, loop_grads(model, f, zip(ids, types, mask, labels)), rtol=1e-9, atol=1e-12)
    q = task.get_out_to_loss_grad(model, dict(model.named_parameters()), {}, (ids, types, mask, labels))
    p = torch.softmax(model(ids, types, mask), -1)[torch.arange(6), labels]
    torch.testing.assert_close(q.reshape(-1), (1 - p).detach())
    with pytest.raises(BadInputError, match="one shape"):
        task.validate_batch((ids, types[:, :4], mask, labels))


class TinyCLIP(torch.nn.Module):
    def __init__(self, d_img=5, d_txt=4, dim=3):
        super().__init__()
        self.img = torch.nn.Linear(d_img, dim)
        self.txt = torch.nn.Linear(d_txt, dim)
        self.logit_scale = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, image, text):
        return self.img(image), self.txt(text), self.logit_scale.exp()


def test_clip_output_matches_brute_force():
    torch.manual_seed(1)
    model = TinyCLIP().double()
    n_emb = 9
    all_img, all_txt = torch.randn(n_emb, 3).double(), torch.randn(n_emb, 3).double()
    task = CLIPModelOutput(simulated_batch_size=n_emb)  # the whole bank: deterministic
    CLIPModelOutput.set_embeddings(all_img, all_txt)
    img, txt = torch.randn(4, 5).double(), torch.randn(4, 4).double()
    got = vectorize(FunctionalGradientComputer(model, task).compute_per_sample_grad((img, txt)))

    def f(i, t):
        ie, te, _ = model(i[None], t[None])
        a = -torch.logsumexp(-(ie @ (te - all_txt).T), dim=1)
        b = -torch.logsumexp(-(te @ (ie - all_img).T), dim=1)
        return (a + b).sum()

    torch.testing.assert_close(got, loop_grads(model, f, zip(img, txt)), rtol=1e-9, atol=1e-12)
    q = task.get_out_to_loss_grad(model, dict(model.named_parameters()), {}, (img, txt))
    ie, te, s = model(img, txt)
    res = s * ie @ te.T
    want = 1 - (torch.softmax(res, -1) + torch.softmax(res.T, -1)).diag() / 2
    torch.testing.assert_close(q, want.detach())


def test_clip_needs_embeddings():
    CLIPModelOutput.image_embeddings = None
    model = TinyCLIP()
    task = CLIPModelOutput()
    with pytest.raises(BadInputError, match="get_embeddings"):
        FunctionalGradientComputer(model, task).compute_per_sample_grad((torch.randn(2, 5), torch.randn(2, 4)))
