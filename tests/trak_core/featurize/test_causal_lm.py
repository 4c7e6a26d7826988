"""task="causal_lm" on a transformers GPT-2 built from a config, saved and loaded with from_pretrained (nothing is
downloaded): the model output (sequence log-odds), Q, per-example gradients and projected features against
float64 autograd on the UNPADDED sequences called the transformers way (no mask, no vmap), for every projector
kind; padding left or right changes nothing; per-token targets; TRAKer end to end against a float64 brute force."""

import logging
import math
import warnings

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from trak_core import TRAKer  # noqa: E402
from trak_core.errors import BadInputError  # noqa: E402
from trak_core.featurize.featurizer import Featurizer  # noqa: E402
from trak_core.featurize.gradients import FunctionalGradientComputer, vectorize  # noqa: E402
from trak_core.featurize.lm import causal_lm_batch, per_token_targets  # noqa: E402
from trak_core.featurize.modelout import CausalLMModelOutput, additive_mask, resolve_task  # noqa: E402
from trak_core.projection.projectors import NoOpProjector, make_projector  # noqa: E402
from trak_core.scoring.combine import combine_checkpoints  # noqa: E402

VOCAB, PAD = 24, 0
transformers.logging.set_verbosity_error()


def gpt2_config(**over):
    kw = dict(
        vocab_size=VOCAB, n_positions=16, n_embd=8, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=1, pad_token_id=0
    )
    kw.update(over)
    return transformers.GPT2Config(**kw)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A random tiny GPT-2 saved with save_pretrained (the folder from_pretrained loads)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gpt2")
    transformers.GPT2LMHeadModel(gpt2_config()).save_pretrained(path)
    return path


def load(path, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(path).to(dtype).eval()


def sequences(n: int, seed: int = 0, lo: int = 3, hi: int = 9) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(1, VOCAB, (n_,), generator=g).tolist() for n_ in lengths]


def reference(model, seqs, scored=None, grads=True):
    """float64 autograd on each unpadded sequence, called as transformers runs it (no mask, no vmap): (f, Q, the
    flat gradient of f) per sequence. f = log(p/(1−p)), p = Π over the scored positions (default: all but the
    first) of p(token_t | tokens < t)."""
    params = list(model.parameters())
    fs, qs, gs = [], [], []
    for i, seq in enumerate(seqs):
        x = torch.tensor([seq])
        logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].double(), -1)
        pos = range(1, len(seq)) if scored is None else scored[i]
        ll = sum(logp[t - 1, seq[t]] for t in pos)
        p = torch.exp(ll)
        f = torch.log(p) - torch.log1p(-p)
        fs.append(float(f.detach()))
        qs.append(float(1 - p.detach()))
        if grads:
            gs.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(f, params)]).double())
    return np.array(fs), np.array(qs), torch.stack(gs) if grads else None


def mixed_batch(seqs, t=10):
    """Rows alternately right- and left-padded to length t."""
    rows = [causal_lm_batch([s], t, PAD, "right" if i % 2 == 0 else "left") for i, s in enumerate(seqs)]
    return tuple(torch.cat([r[k] for r in rows]) for k in range(3))


def test_resolves_by_name():
    assert isinstance(resolve_task("causal_lm"), CausalLMModelOutput)


def test_output_q_and_gradients_match_float64_autograd(gpt2_dir):
    model = load(gpt2_dir, torch.float64)
    seqs = sequences(6)
    batch = mixed_batch(seqs)
    task = CausalLMModelOutput()
    fc = FunctionalGradientComputer(model, task)
    grads, out = fc.compute_per_sample_grad(batch, with_output=True)
    f, q, g = reference(model, seqs)
    np.testing.assert_allclose(out.numpy(), f, rtol=1e-10)
    np.testing.assert_allclose(fc.compute_loss_grad(batch).numpy(), q, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(task.out_to_loss_from_output(out).numpy(), q, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(vectorize(grads), g, rtol=1e-8, atol=1e-11)


def test_single_token_targets_give_token_margins_and_informative_q(gpt2_dir):
    """One scored token: f is that token's margin log(p_t/(1−p_t)), Q = 1 − p_t well away from 1."""
    model = load(gpt2_dir, torch.float64)
    seqs = sequences(4, seed=3)
    (ids, mask, labels), rows = per_token_targets(causal_lm_batch(seqs, 10, PAD, "left"))
    assert rows.shape[0] == sum(len(s) - 1 for s in seqs) == ids.shape[0]
    fc = FunctionalGradientComputer(model, CausalLMModelOutput())
    grads, out = fc.compute_per_sample_grad((ids, mask, labels), with_output=True)
    pad = 10 - torch.tensor([len(s) for s in seqs])
    seq_of = [seqs[int(i)] for i in rows[:, 0]]
    pos = [[int(t - pad[i])] for i, t in rows.tolist()]  # the position in the unpadded sequence
    f, q, g = reference(model, seq_of, pos)
    np.testing.assert_allclose(out.numpy(), f, rtol=1e-10)
    np.testing.assert_allclose(fc.compute_loss_grad((ids, mask, labels)).numpy(), q, rtol=1e-10)
    assert q.min() < 0.99  # the tiny model's vocabulary makes some tokens likely enough to test Q
    torch.testing.assert_close(vectorize(grads), g, rtol=1e-8, atol=1e-11)


@pytest.mark.parametrize("kind", ["noop", "dense", "sjlt", "factored"])
def test_padding_changes_no_feature_for_any_projector(gpt2_dir, kind):
    """X of each sequence, padded right or left in a batch or alone without padding, equals the projection of its
    float64 autograd gradient (divided by √grad_dim); the same for Q."""
    model = load(gpt2_dir)
    grad_dim = sum(p.numel() for p in model.parameters())
    proj_dim = grad_dim if kind == "noop" else 64
    kw = {"model": model} if kind == "factored" else {}
    proj = make_projector(kind, grad_dim, proj_dim, seed=5, **kw)
    feat = Featurizer(model, "causal_lm", proj)
    seqs = sequences(5, seed=1)
    x_mixed, q_mixed = feat.featurize(mixed_batch(seqs), model_id=0)
    for i, s in enumerate(seqs):
        x_alone, q_alone = feat.featurize(causal_lm_batch([s]), model_id=0)
        np.testing.assert_allclose(x_alone[0], x_mixed[i], rtol=1e-4, atol=1e-5 * np.abs(x_alone).max())
        np.testing.assert_allclose(q_alone[0], q_mixed[i], rtol=1e-5)
    _, q, g = reference(load(gpt2_dir, torch.float64), seqs)
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    parts = dict(zip(names, torch.split(g, [math.prod(s) for s in shapes], dim=1)))
    want = proj.project({n: parts[n].reshape(len(seqs), *sh).float() for n, sh in zip(names, shapes)}, model_id=0)
    want = want.double().numpy() / math.sqrt(grad_dim)
    np.testing.assert_allclose(x_mixed, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())
    np.testing.assert_allclose(q_mixed, q, rtol=1e-5)


def test_additive_mask_is_what_transformers_builds(gpt2_dir):
    """The 4-D mask gives the logits of transformers' own 2-D mask path at every real position (outside vmap)."""
    model = load(gpt2_dir, torch.float64)
    ids, mask, _ = mixed_batch(sequences(4, seed=2))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    want = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    got = model(input_ids=ids, attention_mask=additive_mask(mask, True, torch.float64), position_ids=pos).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-10, atol=1e-12)


def test_eager_attention_and_a_plain_module(gpt2_dir, tmp_path):
    """attn_implementation="eager" gives the sdpa numbers; a model that is not a transformers one gets the 2-D
    mask as it is (here: a wrapper calling the GPT-2 the transformers way, checked against float64 autograd)."""
    seqs = sequences(3, seed=4)
    batch = causal_lm_batch(seqs, 10)
    sdpa = load(gpt2_dir, torch.float64)
    eager = transformers.AutoModelForCausalLM.from_pretrained(gpt2_dir, attn_implementation="eager").double().eval()
    got = {}
    for name, m in (("sdpa", sdpa), ("eager", eager)):
        got[name] = vectorize(FunctionalGradientComputer(m, CausalLMModelOutput()).compute_per_sample_grad(batch))
    torch.testing.assert_close(got["eager"], got["sdpa"], rtol=1e-8, atol=1e-11)

    class Wrapper(torch.nn.Module):  # right padding: positions need no mask-derived ids
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask).logits

    wrapped = Wrapper(eager)
    plain = vectorize(FunctionalGradientComputer(wrapped, CausalLMModelOutput()).compute_per_sample_grad(batch))
    torch.testing.assert_close(plain, got["eager"], rtol=1e-8, atol=1e-11)


def test_traker_end_to_end_matches_float64_brute_force(gpt2_dir, tmp_path):
    """TRAKer(task="causal_lm") with the identity projector on a from_pretrained GPT-2, two checkpoints, padded
    batches: scores = combine(Σ_c X_c A_c G_cᵀ, Σ_c Q_c), X = ∇f/√d from float64 autograd,
    A = (XᵀX + λI)⁻¹ / mean|·|."""
    model = load(gpt2_dir)
    ckpts = [{k: v.clone() for k, v in model.state_dict().items()}]  # copies: load_checkpoint writes the model
    torch.manual_seed(1)
    ckpts.append({k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in ckpts[0].items()})
    train, targets = sequences(20, seed=5), sequences(3, seed=6)
    d = sum(p.numel() for p in model.parameters())
    lam = 1e-3
    tr = TRAKer(
        model=model,
        task="causal_lm",
        train_set_size=len(train),
        save_dir=str(tmp_path / "s"),
        device="cpu",
        projector=NoOpProjector(),
        use_half_precision=False,
        lambda_reg=lam,
        logging_level=logging.ERROR,
    )
    for mid, ck in enumerate(ckpts):
        tr.load_checkpoint(ck, model_id=mid)
        for a in range(0, len(train), 8):
            tr.featurize(mixed_batch(train[a : a + 8]), num_samples=len(train[a : a + 8]))
    tr.finalize_features()
    for mid, ck in enumerate(ckpts):
        tr.start_scoring_checkpoint("e", ck, mid, len(targets))
        tr.score(mixed_batch(targets), num_samples=len(targets))
    got = np.asarray(tr.finalize_scores("e"), dtype=np.float64)

    acc, qsum = np.zeros((len(train), len(targets))), np.zeros(len(train))
    for ck in ckpts:
        ref = load(gpt2_dir, torch.float64)
        ref.load_state_dict(ck)
        _, q, g = reference(ref, train)
        _, _, gt = reference(ref, targets)
        x, xt = g.numpy() / math.sqrt(d), gt.numpy() / math.sqrt(d)
        inv = np.linalg.inv(x.T @ x + lam * np.eye(d))
        inv /= np.abs(inv).mean()
        acc += x @ inv @ xt.T
        qsum += q
    want = combine_checkpoints(acc, qsum, len(ckpts))
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max()


def test_traker_default_projector_per_token_targets(gpt2_dir, tmp_path):
    """The default (factored) projector; targets per token: one score column per scored token, each equal to a
    float64 brute force from the stored X, Q and G; the column of a single-token target is its sequence's."""
    model = load(gpt2_dir)
    train, targets = sequences(16, seed=7), sequences(2, seed=8)
    tok_batch, rows = per_token_targets(causal_lm_batch(targets, 10, PAD, "left"))
    tr = TRAKer(
        model=model,
        task="causal_lm",
        train_set_size=len(train),
        save_dir=str(tmp_path / "s"),
        device="cpu",
        proj_dim=32,
        use_half_precision=False,
        lambda_reg=1e-2,
        logging_level=logging.ERROR,
    )
    tr.load_checkpoint(model.state_dict(), model_id=0)
    tr.featurize(mixed_batch(train), num_samples=len(train))
    tr.finalize_features()
    tr.start_scoring_checkpoint("tok", model.state_dict(), 0, rows.shape[0])
    tr.score(tok_batch, num_samples=rows.shape[0])
    got = np.asarray(tr.finalize_scores("tok"), dtype=np.float64)
    assert got.shape == (len(train), rows.shape[0])
    st = tr.store
    x = st.model(0).grads[:].astype(np.float64)
    g = st.target_grads("tok", 0)[:].astype(np.float64)
    inv = np.linalg.inv(x.T @ x + 1e-2 * np.eye(x.shape[1]))
    inv /= np.abs(inv).mean()
    want = combine_checkpoints(x @ inv @ g.T, st.model(0).out_to_loss[:].astype(np.float64), 1)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    # a target whose one scored token is the last one of targets[0]: the same features as that per-token row
    last = int((rows[:, 0] == 0).nonzero().max())
    feat = tr.featurizer.featurize(tuple(t[last : last + 1] for t in tok_batch), model_id=0)[0]
    one = causal_lm_batch([targets[0]], 10, PAD, "right")
    one[2][0, : len(targets[0]) - 1] = -100
    np.testing.assert_allclose(tr.featurizer.featurize(one, model_id=0)[0], feat, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda b: (b[0], b[1], b[2][:, :-1]), "one shape"),
        (lambda b: (b[0], b[1].float(), b[2]), "attention_mask must be an integer"),
        (lambda b: (b[0], b[1] * 2, b[2]), "0 and 1 only"),
        (lambda b: (b[0], b[1], torch.where(b[2] >= 0, -7, b[2])), r"-100 or in \[0"),
        (lambda b: (b[0], b[1], torch.full_like(b[2], -100)), "score no token"),
        (lambda b: (b[0], b[1], torch.where(b[1] == 0, 3, b[2])), "padding or follows padding"),
        (lambda b: (b[0], b[1], b[2]), None),
    ],
)
def test_bad_batches_fail_before_compute(gpt2_dir, tmp_path, mutate, match):
    batch = mutate(mixed_batch(sequences(4, seed=9)))
    task = CausalLMModelOutput()
    if match is None:
        task.validate_batch(batch)
        return
    with pytest.raises(BadInputError, match=match):
        task.validate_batch(batch)


def test_label_beyond_the_vocabulary_names_the_position(gpt2_dir, tmp_path):
    model = load(gpt2_dir)
    ids, mask, labels = causal_lm_batch(sequences(3, seed=10), 10)
    labels[1, 2] = VOCAB + 5
    tr = TRAKer(
        model=model,
        task="causal_lm",
        train_set_size=3,
        save_dir=str(tmp_path / "s"),
        device="cpu",
        proj_dim=8,
        logging_level=logging.ERROR,
    )
    tr.load_checkpoint(model.state_dict(), model_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(BadInputError, match=r"\(1, 2\)"):
            tr.featurize((ids, mask, labels), num_samples=3)
    assert not tr.store.model(0).featurized[:].any()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["noop", "dense", "sjlt", "factored"])
def test_cuda_features_equal_cpu_with_padding(gpt2_dir, kind):
    """On CUDA (attention's math backend under vmap), padded batches give the CPU's features of the unpadded
    sequences."""
    seqs = sequences(5, seed=11)
    out = {}
    for device in ("cpu", "cuda"):
        model = load(gpt2_dir).to(device)
        grad_dim = sum(p.numel() for p in model.parameters())
        kw = {"model": model} if kind == "factored" else {}
        proj = make_projector(kind, grad_dim, grad_dim if kind == "noop" else 64, seed=5, device=device, **kw)
        feat = Featurizer(model, "causal_lm", proj, device=device)
        if device == "cpu":
            out[device] = np.concatenate([feat.featurize(causal_lm_batch([s]), model_id=0)[0] for s in seqs])
        else:
            out[device] = feat.featurize(mixed_batch(seqs), model_id=0)[0]
    np.testing.assert_allclose(out["cuda"], out["cpu"], rtol=2e-3, atol=2e-4 * np.abs(out["cpu"]).max())


def test_model_output_contract(gpt2_dir):
    """trak_core.testing's model output checks on the causal-LM task (float64 GPT-2, padded batch), with the
    sequence log-odds of the unpadded sequences as the reference and the malformed batches refused."""
    from trak_core.testing import check_model_output

    model = load(gpt2_dir, torch.float64)
    seqs = sequences(3, seed=12)
    batch = mixed_batch(seqs)

    def ref(m, b):
        return torch.tensor(reference(m, seqs, grads=False)[0])

    ids, mask, labels = batch
    bad = [(ids, mask), (ids, mask.float(), labels), (ids, mask, torch.full_like(labels, -100))]
    check_model_output(CausalLMModelOutput(), model, batch, reference=ref, bad_batches=bad, rtol=1e-9, atol=1e-12)


def test_energy_probe_matches_float64_autograd_with_padding(gpt2_dir):
    """The factored split's probe on padded causal-LM batches: mean ‖∂f/∂θ‖² per parameter as float64 autograd on
    the unpadded sequences, whatever the chunk (all rows in one vmap; one row per pass)."""
    from trak_core.projection.energy import gradient_energies

    seqs = sequences(6, seed=3)
    ref = load(gpt2_dir, torch.float64)
    _, _, g = reference(ref, seqs)
    want, o = {}, 0
    for name, p in ref.named_parameters():
        want[name] = float((g[:, o : o + p.numel()] ** 2).sum(1).mean())
        o += p.numel()
    model = load(gpt2_dir)
    for budget in (2**28, 1):
        got = gradient_energies(model, "causal_lm", mixed_batch(seqs), budget_bytes=budget)
        assert set(got) == set(want)
        for name, w in want.items():
            assert math.isclose(got[name], w, rel_tol=1e-3, abs_tol=1e-9 * max(want.values())), (name, got[name], w)
