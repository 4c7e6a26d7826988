"""The per-position split of a proponent's score (trak_core.scoring.explain, TrakIndex.query(explain=True)) on a tiny
GPT-2
built from a config: per-position projected gradients against a float64 brute force (each position's gradient taken
alone, by perturbing the parameters at that position only), shares summing to the index's scores, padding at 0, and
bad requests refused before compute."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from trak_core import TRAKer, TrakIndex  # noqa: E402
from trak_core.errors import BadInputError, StoreMismatchError  # noqa: E402
from trak_core.featurize.featurizer import Featurizer  # noqa: E402
from trak_core.featurize.gradients import grad_dim_of, grad_param_names  # noqa: E402
from trak_core.featurize.lm import causal_lm_batch  # noqa: E402
from trak_core.featurize.modelout import CausalLMModelOutput  # noqa: E402
from trak_core.projection.factored import FactoredProjector  # noqa: E402
from trak_core.projection.projectors import make_projector  # noqa: E402
from trak_core.scoring.explain import position_features  # noqa: E402
from trak_core.scoring.streaming import grads_right_hand  # noqa: E402

VOCAB, PAD, T = 24, 0, 10
N, M, K = 16, 3, 4
transformers.logging.set_verbosity_error()


def tiny_gpt2(dtype=torch.float32, seed: int = 0):
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=8, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=1, pad_token_id=0
    )
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # larger than the default init, so that every position's share is far from rounding
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model.to(dtype)


def sequences(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, T + 1, (n,), generator=g).tolist()
    return [torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in lengths]


def mixed_batch(seqs):
    """Rows alternately right- and left-padded to length T."""
    rows = [causal_lm_batch([s], T, PAD, "right" if i % 2 == 0 else "left") for i, s in enumerate(seqs)]
    return tuple(torch.cat([r[k] for r in rows]) for k in range(3))


def brute_force_positions(model, sample, names) -> dict:
    """{parameter name: (T, *shape)} float64: the gradient of f through the parameters' use at position t alone, for
    each t. Every module owning a parameter recomputes its output at position t with the parameters plus a zero
    perturbation E (shared by the modules that share a parameter); ∂f/∂E is position t's gradient."""
    params = dict(model.named_parameters())
    task = CausalLMModelOutput()
    owners = {}
    for mname, mod in model.named_modules():
        own = {a: n for n in names for a, p in mod.named_parameters(recurse=False) if p is params[n]}
        if own:
            owners[mname] = (mod, own)
    out = {n: torch.zeros(T, *params[n].shape, dtype=torch.float64) for n in names}
    for t in range(T):
        pert = {n: torch.zeros_like(params[n], requires_grad=True) for n in names}
        handles, busy = [], []
        for mod, own in owners.values():

            def hook(m, inputs, output, own=own):
                if busy:  # the call below
                    return output
                p = {a: q.detach() for a, q in m.named_parameters(recurse=False)}
                p.update({a: p[a] + pert[n] for a, n in own.items()})
                busy.append(1)
                try:
                    at_t = torch.func.functional_call(m, p, (inputs[0][:, t : t + 1],))
                finally:
                    busy.pop()
                return torch.cat([output[:, :t], at_t, output[:, t + 1 :]], dim=1)

            handles.append(mod.register_forward_hook(hook))
        try:
            weights = {n: p.detach() for n, p in model.named_parameters()}
            f = task.get_output(model, weights, dict(model.named_buffers()), *sample)
            grads = torch.autograd.grad(f, [pert[n] for n in names], allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        for n, g in zip(names, grads, strict=True):
            if g is not None:
                out[n][t] = g
    return out


@pytest.mark.parametrize("kind", ["factored", "dense"])
def test_position_features_equal_float64_brute_force(kind):
    """x_t of each position = the projection of the gradient of position t's term alone (float64), and Σ_t x_t =
    the featurizer's row; padding positions 0."""
    model = tiny_gpt2(torch.float64)
    names = grad_param_names(model, None)
    d = grad_dim_of(model)
    if kind == "factored":
        proj = FactoredProjector.from_model(model, 48, seed=3, dtype=torch.float64)
    else:
        proj = make_projector("dense", d, 48, 3, "rademacher", "cpu", dtype=torch.float64)
    batch = mixed_batch(sequences(2, seed=1))
    fz = Featurizer(model, "causal_lm", proj, device="cpu", dtype=torch.float64)
    fz.load_state(model.state_dict())
    rows = fz.project_batch(batch, 0, range(2)).to(torch.float64)  # the fast path's rows, unrounded
    for r in range(2):
        sample = tuple(t[r] for t in batch)
        got = position_features(model, CausalLMModelOutput(), proj, sample, 0)
        assert got.shape == (T, 48) and got.dtype == torch.float64
        bf = brute_force_positions(model, sample, names)
        want = proj.project({n: bf[n] for n in names}, model_id=0).to(torch.float64) / math.sqrt(d)
        scale = float(want.abs().max())
        assert scale > 0
        assert float((got - want).abs().max()) <= 1e-10 * scale
        assert float((got.sum(0) - rows[r]).abs().max()) <= 1e-6 * float(rows[r].abs().max())
        pad = batch[1][r] == 0
        assert bool(pad.any()) == (len(sequences(2, seed=1)[r]) < T)
        assert float(got[pad].abs().sum()) == 0.0
        # every real position contributes (not a split that puts everything on one position)
        assert int((got[~pad].abs().sum(1) > 1e-8 * scale).sum()) >= int((~pad).sum()) - 1


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A TRAKer store (float32, factored projector) of 2 checkpoints of the tiny GPT-2 over N padded sequences."""
    d = tmp_path_factory.mktemp("explain")
    model = tiny_gpt2()
    ckpts = [{k: v.clone() for k, v in model.state_dict().items()}]
    torch.manual_seed(1)
    ckpts.append({k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in ckpts[0].items()})
    train, targets = mixed_batch(sequences(N, seed=5)), mixed_batch(sequences(M, seed=6))
    tr = TRAKer(
        model=model,
        task="causal_lm",
        train_set_size=N,
        save_dir=str(d / "s.zarr"),
        device="cpu",
        proj_dim=32,
        use_half_precision=False,
        lambda_reg=1e-2,
        logging_level=logging.ERROR,
    )
    for mid, ck in enumerate(ckpts):
        tr.load_checkpoint(ck, model_id=mid)
        tr.featurize(train, num_samples=N)
    tr.finalize_features()
    return d / "s.zarr", ckpts, train, targets


def open_index(built) -> TrakIndex:
    store, ckpts, _, _ = built
    return TrakIndex(store, model=tiny_gpt2(), checkpoints=ckpts, task="causal_lm", device="cpu")


def assert_sums(res) -> None:
    """Σ_t share_t = the score, up to float32 rounding of the shares (relative to their magnitudes: shares of both
    signs cancel)."""
    shares = res.shares.astype(np.float64)
    err = np.abs(shares.sum(-1) - res.scores)
    assert (err <= 1e-5 * np.abs(shares).sum(-1) + 1e-7 * np.abs(res.scores).max()).all()
    assert (err <= 1e-3 * np.abs(res.scores)).all()


def test_query_shares_sum_to_scores(built):
    _, _, train, targets = built
    index = open_index(built)
    plain = index.query(targets, k=K)
    res = index.query(targets, k=K, explain=True, train_data=train)
    np.testing.assert_array_equal(res.indices, plain.indices)
    np.testing.assert_array_equal(res.scores, plain.scores)
    assert res.shares is not None and res.shares.shape == (M, K, T) and res.shares.dtype == np.float32
    assert_sums(res)
    pad = train[1][res.indices] == 0  # (M, K, T)
    assert pad.any() and np.abs(res.shares[pad]).max() == 0.0
    top, low = index.query_both(targets, k=K, explain=True, train_data=train)
    for r in (top, low):
        assert_sums(r)
    np.testing.assert_array_equal(top.shares, res.shares)
    d = res.to_dict()
    assert len(d["results"][0]["shares"]) == K and len(d["results"][0]["shares"][0]) == T


def test_each_share_is_the_score_of_that_position_alone(built):
    """share[j, r, t] = the score row i would get if its gradient were position t's term alone: the brute-force
    per-position gradient (float64 autograd) projected, against the index's inverses and the inputs' features."""
    _, ckpts, train, targets = built
    index = open_index(built)
    res = index.query(targets, k=2, explain=True, train_data=train)
    vectors = index.featurize(targets)
    model = tiny_gpt2(torch.float64)
    names = grad_param_names(model, None)
    d = grad_dim_of(model)
    store = index.store
    for j in range(M):
        for r in range(1 if j else 2):
            i = int(res.indices[j, r])
            acc, q = np.zeros(T), 0.0
            for mid, ck in enumerate(ckpts):
                model.load_state_dict({k: v.to(torch.float64) if v.is_floating_point() else v for k, v in ck.items()})
                bf = brute_force_positions(model, tuple(t[i] for t in train), names)
                x = index.projector.project({n: bf[n].float() for n in names}, model_id=mid).double() / math.sqrt(d)
                w = grads_right_hand(index._inverses[mid], torch.as_tensor(vectors[mid]).T).double()
                acc += (x @ w[:, j]).numpy()
                q += float(store.model(mid).out_to_loss[i : i + 1][0])
            want = acc / 2 * (q / 2)
            assert np.abs(res.shares[j, r] - want).max() <= 1e-4 * np.abs(want).max()


def test_explain_refuses_bad_requests_before_compute(built):
    _, _, train, targets = built
    index = open_index(built)
    with pytest.raises(BadInputError, match="train_data: explain=True"):
        index.query(targets, k=2, explain=True)
    with pytest.raises(BadInputError, match="store's 16 rows"):
        index.query(targets, k=2, explain=True, train_data=tuple(t[:5] for t in train))
    with pytest.raises(BadInputError, match="tuple of tensors"):
        index.query(targets, k=2, explain=True, train_data=train[0])
    shuffled = tuple(t.roll(1, 0) for t in train)  # another row order: not the store's rows
    with pytest.raises(StoreMismatchError, match="not the one the store was featurized from"):
        index.query(targets, k=2, explain=True, train_data=shuffled)


def test_explain_applies_to_sequence_inputs_only(tmp_path):
    from trak_fixtures import checkpoints, make_data, make_model, run_traker

    data = make_data(n=40, m=3)
    ck = checkpoints(1)
    run_traker(TRAKer, tmp_path / "s.zarr", ck, data, half=False, lambda_reg=1e-2, proj_dim=16)
    index = TrakIndex(
        tmp_path / "s.zarr", model=make_model(), checkpoints=ck, task="image_classification", device="cpu"
    )
    x, y, xt, yt = data
    with pytest.raises(BadInputError, match="applies to sequence inputs"):
        index.query((xt, yt), k=2, explain=True, train_data=(x, y))


class AttentionLM(torch.nn.Module):
    """A causal LM whose attention layer owns parameters and mixes positions (nn.MultiheadAttention)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids, attention_mask):
        h = self.emb(input_ids)
        n = input_ids.shape[-1]
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
        h = h + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return self.head(h)


@pytest.mark.parametrize("kind", ["factored", "dense"])
def test_a_layer_that_mixes_positions_is_refused(kind):
    torch.manual_seed(0)
    model = AttentionLM().eval()
    d = grad_dim_of(model)
    if kind == "factored":
        proj = FactoredProjector.from_model(model, 32, seed=0)
    else:
        proj = make_projector("dense", d, 32, 0, "rademacher", "cpu")
    sample = tuple(t[0] for t in mixed_batch(sequences(1, seed=2)))
    with pytest.raises(BadInputError, match="per position"):
        position_features(model, CausalLMModelOutput(), proj, sample, 0)


def test_position_features_of_lora_adapters_equal_float64_brute_force():
    """LoRA adapters (peft, on GPT-2's Conv1D attention) as the gradient's parameters: the adapters' nn.Linear
    layers are split per position like any other."""
    peft = pytest.importorskip("peft")
    base = tiny_gpt2(torch.float64)
    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
    model = peft.get_peft_model(base, cfg).base_model.model.eval()  # the transformers model with adapters inside
    torch.manual_seed(4)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(0.3 * torch.randn_like(p))  # lora_B starts at 0: its A would get no gradient
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    d = grad_dim_of(model, names)
    proj = FactoredProjector.from_model(model, 24, seed=1, grad_wrt=names, dtype=torch.float64)
    sample = tuple(t[0] for t in mixed_batch(sequences(1, seed=3)))
    got = position_features(model, CausalLMModelOutput(), proj, sample, 0, grad_wrt=names)
    bf = brute_force_positions(model, sample, names)
    want = proj.project({n: bf[n] for n in names}, model_id=0).to(torch.float64) / math.sqrt(d)
    assert float(want.abs().max()) > 0
    assert float((got - want).abs().max()) <= 1e-10 * float(want.abs().max())


class RMSNorm(torch.nn.Module):
    """A norm the split has no closed form for: differentiated at each position alone."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.3 * torch.randn(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class CumulativeScale(torch.nn.Module):
    """Owns a parameter and mixes positions (a running sum): its split is refused."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.3 * torch.randn(dim))

    def forward(self, x):
        return torch.cumsum(x * self.weight, dim=1) / x.shape[1]


class NormLM(torch.nn.Module):
    def __init__(self, mixer: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.norm = RMSNorm(8)
        self.mix = CumulativeScale(8) if mixer else torch.nn.Identity()
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids, attention_mask):
        h = self.emb(input_ids)
        h = torch.tanh(self.mix(self.norm(h)))
        return self.head(h)


@pytest.mark.parametrize("kind", ["factored", "dense"])
def test_a_norm_without_closed_form_is_differentiated_per_position(kind):
    model = NormLM().double().eval()
    names = grad_param_names(model, None)
    d = grad_dim_of(model)
    if kind == "factored":
        proj = FactoredProjector.from_model(model, 24, seed=2, dtype=torch.float64)
    else:
        proj = make_projector("dense", d, 24, 2, "rademacher", "cpu", dtype=torch.float64)
    sample = tuple(t[0] for t in mixed_batch(sequences(1, seed=4)))
    got = position_features(model, CausalLMModelOutput(), proj, sample, 0)
    bf = brute_force_positions(model, sample, names)
    want = proj.project({n: bf[n] for n in names}, model_id=0).to(torch.float64) / math.sqrt(d)
    assert float((got - want).abs().max()) <= 1e-10 * float(want.abs().max())
    mixed = NormLM(mixer=True).double().eval()
    proj = make_projector("dense", grad_dim_of(mixed), 24, 2, "rademacher", "cpu", dtype=torch.float64)
    with pytest.raises(BadInputError, match="'mix' .* is not applied per position"):
        position_features(mixed, CausalLMModelOutput(), proj, sample, 0)


class OwnOutput(CausalLMModelOutput):
    """A task with its own get_output (the same numbers): featurized one example at a time."""

    def get_output(self, model, weights, buffers, input_ids, attention_mask, labels):
        return super().get_output(model, weights, buffers, input_ids, attention_mask, labels)


def test_a_batch_in_one_pass_equals_one_example_at_a_time():
    from trak_core.scoring.explain import position_features_batch

    model = tiny_gpt2(torch.float64)
    proj = FactoredProjector.from_model(model, 32, seed=5, dtype=torch.float64)
    batch = mixed_batch(sequences(3, seed=9))
    together = position_features_batch(model, CausalLMModelOutput(), proj, batch, 0)
    apart = position_features_batch(model, OwnOutput(), proj, batch, 0)
    for a, b in zip(together, apart, strict=True):
        assert float((a - b).abs().max()) <= 1e-12 * float(b.abs().max())
