"""Every causal-LM family of the installed transformers that runs in float64 from a tiny config: per-example
gradients of the sequence log-odds (left and right padding in one batch) against float64 autograd on the unpadded
sequences, and the default (factored) projector's fast path — no fallback to weight substitution — against the
projection of those gradients. OPT and BioGPT (learned positions, an nn.Embedding subclass taking the mask), Bloom
(a GELU autograd.Function, ALiBi from the 2-D mask), Gemma (a scaled embedding tied to the head), Gemma 2 and MPT
(scores capped or masked twice) included. TRAKer with its default projector on OPT and Bloom."""

import logging
import math
import warnings

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from trak_core import TRAKer  # noqa: E402
from trak_core.featurize.gradients import FunctionalGradientComputer, vectorize  # noqa: E402
from trak_core.featurize.lm import causal_lm_batch  # noqa: E402
from trak_core.featurize.modelout import CausalLMModelOutput  # noqa: E402
from trak_core.projection.factored import FactoredProjector  # noqa: E402

transformers.logging.set_verbosity_error()
V, T = 32, 9
COMMON = dict(
    vocab_size=V,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=24,
    max_position_embeddings=32,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=1,
)
#: the families' own keywords a tiny config needs
OVER = {
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=4),
    "gptj": dict(rotary_dim=4),
    "codegen": dict(rotary_dim=4),
}
#: families that compute parts in float32 whatever the model's dtype (RMSNorm / LayerNorm / ALiBi / Bloom's softmax):
#: relative error (a float32 rounding that lands on the other side in one of the two computations shows at ~1e-10)
FLOAT32_INSIDE = {"bloom": 1e-7, "gemma": 1e-7, "gemma2": 1e-7, "cohere": 1e-7, "mpt": 1e-6}
FAMILIES = [
    "bloom",
    "biogpt",
    "codegen",
    "cohere",
    "falcon",
    "gemma",
    "gemma2",
    "glm",
    "gpt2",
    "gpt_bigcode",
    "gpt_neo",
    "gpt_neox",
    "gptj",
    "granite",
    "llama",
    "mistral",
    "mpt",
    "nemotron",
    "olmo",
    "olmo2",
    "opt",
    "persimmon",
    "phi",
    "phi3",
    "qwen2",
    "qwen3",
    "stablelm",
    "starcoder2",
]
# not here: the mixture-of-experts families (mixtral, qwen2_moe, olmoe, granitemoe: torch's grouped matmul has no
# float64 kernel), xglm (its attention builds a float32 constant from the float64 minimum), openai-gpt (its
# attention fails under vmap)


def model_of(family: str, dtype=torch.float64):
    cfg = transformers.AutoConfig.for_model(family, **{**COMMON, **OVER.get(family, {})})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()


def sequences(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, V, (int(k),), generator=g).tolist() for k in torch.randint(3, 8, (n,), generator=g)]


def mixed(seqs):
    rows = [causal_lm_batch([s], T, 0, "right" if i % 2 == 0 else "left") for i, s in enumerate(seqs)]
    return tuple(torch.cat([r[k] for r in rows]) for k in range(3))


def reference(model, seqs):
    """float64 autograd of f = log(p/(1−p)) on each unpadded sequence (no mask, no vmap), all parameters."""
    params = list(model.parameters())
    rows = []
    for s in seqs:
        logp = torch.log_softmax(model(input_ids=torch.tensor([s])).logits[0, :-1].double(), -1)
        ll = sum(logp[t - 1, s[t]] for t in range(1, len(s)))
        f = ll - torch.log1p(-torch.exp(ll))
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(f, params)]))
    return torch.stack(rows)


def pieces(model, g):
    names, shapes = zip(*[(n, p.shape) for n, p in model.named_parameters()])
    parts = torch.split(g, [math.prod(s) for s in shapes], dim=1)
    return {n: p.reshape(g.shape[0], *s) for n, p, s in zip(names, parts, shapes, strict=True)}


@pytest.mark.parametrize("family", FAMILIES)
def test_family_gradients_and_factored_features_match_float64_autograd(family):
    model = model_of(family)
    seqs = sequences(3)
    batch = mixed(seqs)
    want = reference(model, seqs)
    assert torch.isfinite(want).all() and want.abs().max() > 0
    rel = FLOAT32_INSIDE.get(family, 1e-12)
    task = CausalLMModelOutput()
    gc = FunctionalGradientComputer(model, task)
    got = vectorize(gc.compute_per_sample_grad(batch))
    err = float((got - want).abs().max())
    assert err <= rel * float(want.abs().max()) + 1e-14, (family, err)

    proj = FactoredProjector.from_model(model, 48, seed=1, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to weight substitution
        x = proj.featurize_batch(model, task, gc._weights(), gc._buffers(), batch, 0)
    assert proj._substitute == set()
    ref = proj.project(pieces(model, want), 0)
    assert float((x - ref).abs().max()) <= 10 * rel * float(ref.abs().max()) + 1e-13


@pytest.mark.parametrize("family", ["opt", "bloom"])
def test_traker_default_projector(family, tmp_path):
    """TRAKer with its default projector (factored, split by the energy probe): the stored rows are the projection
    of the float64 per-example gradients / √grad_dim, the scores finite."""
    model = model_of(family, torch.float32)
    train, targets = sequences(12, seed=1), sequences(2, seed=2)
    tr = TRAKer(
        model=model,
        task="causal_lm",
        train_set_size=len(train),
        save_dir=str(tmp_path / "s"),
        device="cpu",
        proj_dim=16,
        use_half_precision=False,
        lambda_reg=1e-2,
        logging_level=logging.ERROR,
    )
    tr.load_checkpoint(model.state_dict(), model_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        tr.featurize(mixed(train), num_samples=len(train))
    tr.finalize_features()
    tr.start_scoring_checkpoint("e", model.state_dict(), 0, len(targets))
    tr.score(mixed(targets), num_samples=len(targets))
    assert np.isfinite(np.asarray(tr.finalize_scores("e"))).all()
    proj = tr.featurizer.projector
    assert isinstance(proj, FactoredProjector) and proj._substitute == set()
    ref = model_of(family)
    g = reference(ref, train)
    want = proj.project(pieces(ref, g.float()), 0).double().numpy() / math.sqrt(g.shape[1])
    x = tr.store.model(0).grads[:].astype(np.float64)
    np.testing.assert_allclose(x, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())


def test_bloom_stand_ins_are_scoped_to_the_call():
    """Bloom's stand-ins are set on its modules for a call only (a nested call keeps them until the outer one
    ends): afterwards the model is as it was, and its own GELU still refuses vmap (the stand-ins make it run)."""
    from trak_core.featurize.hf_fixes import transformers_fixes

    model = model_of("bloom")
    mods = [m for m in model.modules() if type(m).__name__ in ("BloomGelu", "BloomModel")]
    assert len(mods) == 3  # two GELUs, one model
    gelu = next(m for m in mods if type(m).__name__ == "BloomGelu")
    set_here = lambda: [bool({"forward", "build_alibi_tensor"} & set(vars(m))) for m in mods]  # noqa: E731
    with transformers_fixes(model):
        assert all(set_here())
        with transformers_fixes(model):
            pass
        assert all(set_here())
        torch.func.vmap(gelu)(torch.ones(2, 3, dtype=torch.float64))
    assert not any(set_here())
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.vmap(gelu)(torch.ones(2, 3, dtype=torch.float64))
