"""PEFT (LoRA) models as they come: gradients with respect to the adapters by default (a model loaded for inference
too), per-example adapter gradients and factored features against float64 autograd on the unpadded sequences
(LoRA on a GPT-2 causal LM with Conv1D base layers, on a Llama causal LM with nn.Linear base layers, on a GPT-2
sequence classifier with its head in ``modules_to_save``), LoRA's A and B served by the factored fast path's hooks;
adapter state dicts (objects and ``save_pretrained``'s safetensors file) as checkpoints of TRAKer and TrakIndex,
against a float64 brute force."""

import logging
import math
import warnings

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from test_causal_lm import PAD, VOCAB, gpt2_config, mixed_batch, sequences  # noqa: E402

from trak_core import TRAKer, TrakIndex  # noqa: E402
from trak_core.errors import BadInputError, StoreMismatchError  # noqa: E402
from trak_core.featurize.adapters import adapter_param_names, is_peft_model, load_state, read_state_file  # noqa: E402
from trak_core.featurize.featurizer import Featurizer  # noqa: E402
from trak_core.featurize.gradients import FunctionalGradientComputer, grad_param_names, vectorize  # noqa: E402
from trak_core.featurize.lm import causal_lm_batch  # noqa: E402
from trak_core.featurize.modelout import CausalLMModelOutput, TextClassificationModelOutput  # noqa: E402
from trak_core.projection.factored import MATRIX, OTHER, FactoredProjector  # noqa: E402
from trak_core.projection.projectors import NoOpProjector  # noqa: E402
from trak_core.scoring.combine import combine_checkpoints  # noqa: E402

transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")


def lora(base, task_type, targets, seed=0):
    """LoRA of rank 2 with random A and B (B = 0 at peft's default init would make ∂f/∂A zero), dropout on."""
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(
        task_type=task_type, r=2, lora_alpha=4, target_modules=targets, lora_dropout=0.1, init_lora_weights=False
    )
    return peft.get_peft_model(base, cfg)


def gpt2_lora(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    base = transformers.GPT2LMHeadModel(gpt2_config())
    return lora(base, peft.TaskType.CAUSAL_LM, ["c_attn", "c_fc"], seed).to(dtype).eval()


def llama_lora(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=8,
        intermediate_size=12,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        pad_token_id=PAD,
    )
    base = transformers.LlamaForCausalLM(cfg)
    return lora(base, peft.TaskType.CAUSAL_LM, ["q_proj", "v_proj", "down_proj"], seed).to(dtype).eval()


MODELS = {"gpt2": gpt2_lora, "llama": llama_lora}


def named(model, names):
    params = dict(model.named_parameters())
    return [params[n] for n in names]


def lm_reference(model, seqs, names):
    """float64 autograd of f = log(p/(1−p)) on each unpadded sequence, w.r.t. the parameters ``names``."""
    params = named(model, names)
    rows = []
    for seq in seqs:
        logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0, :-1].double(), -1)
        ll = sum(logp[t - 1, seq[t]] for t in range(1, len(seq)))
        f = ll - torch.log1p(-torch.exp(ll))
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(f, params)]))
    return torch.stack(rows)


def as_pieces(model, names, g):
    shapes = [p.shape for p in named(model, names)]
    parts = torch.split(g, [math.prod(s) for s in shapes], dim=1)
    return {n: p.reshape(g.shape[0], *s) for n, p, s in zip(names, parts, shapes, strict=True)}


def fast(proj, model, task, batch, model_id=0):
    gc = FunctionalGradientComputer(model, task)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to weight substitution
        return proj.featurize_batch(model, task, gc._weights(), gc._buffers(), batch, model_id)


def test_default_gradients_are_the_adapters_also_when_loaded_for_inference(tmp_path):
    model = gpt2_lora(torch.float32)
    assert is_peft_model(model) and not is_peft_model(model.get_base_model())
    names = grad_param_names(model, None)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names == adapter_param_names(model) == trainable and len(names) == 2 * 2 * 2  # A, B × 2 modules × 2
    assert all(".lora_A.default." in n or ".lora_B.default." in n for n in names)
    sd = peft.get_peft_model_state_dict(model)
    assert sum(v.numel() for v in sd.values()) == sum(p.numel() for p in named(model, names))
    model.save_pretrained(tmp_path / "adapter")
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(gpt2_config())
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")  # inference: nothing requires grad
    assert not any(p.requires_grad for p in loaded.parameters())
    assert grad_param_names(loaded, None) == names
    assert grad_param_names(loaded, names[:1]) == names[:1]  # grad_wrt still decides when given


def test_plain_models_default_to_their_trainable_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert grad_param_names(model, None) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    model[0].requires_grad_(False)
    assert grad_param_names(model, None) == ["2.weight", "2.bias"]
    model.requires_grad_(False)  # frozen as a whole: all, as before
    assert grad_param_names(model, None) == ["0.weight", "0.bias", "2.weight", "2.bias"]


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_adapter_gradients_and_factored_features_match_float64_autograd(arch):
    """Mixed left/right padding, LoRA dropout configured (off in eval mode): per-example gradients of the adapters
    equal float64 autograd on the unpadded sequences; the factored fast path hooks every A and B as an nn.Linear
    (the frozen base layers are not in its layout) and its features equal the projection of those gradients."""
    model = MODELS[arch]()
    names = grad_param_names(model, None)
    seqs = sequences(5, seed=2)
    batch = mixed_batch(seqs)
    want = lm_reference(model, seqs, names)
    task = CausalLMModelOutput()
    grads = FunctionalGradientComputer(model, task).compute_per_sample_grad(batch)
    assert list(grads) == names
    torch.testing.assert_close(vectorize(grads), want, rtol=1e-8, atol=1e-11 * float(want.abs().max()))

    proj = FactoredProjector.from_model(model, 24, seed=3, dtype=torch.float64)
    blocks = {b.name: b for b in proj.blocks}
    assert OTHER not in blocks and proj.layout.grad_dim == want.shape[1]
    lora_modules = {n.rsplit(".", 1)[0] for n in names}
    assert set(blocks) == lora_modules and all(b.kind == "linear" for b in blocks.values())
    x = fast(proj, model, task, batch, model_id=2)
    assert proj._substitute == set()
    ref = proj.project(as_pieces(model, names, want), model_id=2)
    torch.testing.assert_close(x, ref, rtol=1e-9, atol=1e-10 * float(ref.abs().max()))


def test_lora_sequence_classifier_adapters_and_head():
    """LoRA on a GPT-2 sequence classifier: the adapters and the trainable copy of the head (modules_to_save) get
    gradients, the original head does not; against float64 autograd on the unpadded sequences (right padding: the
    classifier reads the last real token); the factored fast path hooks all of them."""
    torch.manual_seed(0)
    base = transformers.GPT2ForSequenceClassification(gpt2_config(num_labels=3))
    model = lora(base, peft.TaskType.SEQ_CLS, ["c_attn"]).double().eval()
    names = grad_param_names(model, None)
    assert [n for n in names if "score" in n] == ["base_model.model.score.modules_to_save.default.weight"]
    assert len(peft.get_peft_model_state_dict(model)) == len(names)
    seqs, labels = sequences(4, seed=5), torch.tensor([0, 2, 1, 2])
    ids, mask, _ = causal_lm_batch(seqs, 10, PAD, "right")
    batch = (ids, torch.zeros_like(ids), mask, labels)
    params = named(model, names)
    rows = []
    for s, y in zip(seqs, labels, strict=True):
        x = torch.tensor([s])  # token_type_ids as the batch gives them (GPT-2 embeds them with its token table)
        logits = model(input_ids=x, token_type_ids=torch.zeros_like(x)).logits[0]
        f = logits[y] - torch.logsumexp(torch.cat([logits[:y], logits[y + 1 :]]), 0)
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(f, params)]))
    want = torch.stack(rows)
    task = TextClassificationModelOutput()
    got = vectorize(FunctionalGradientComputer(model, task).compute_per_sample_grad(batch))
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-11 * float(want.abs().max()))
    proj = FactoredProjector.from_model(model, 20, seed=1, dtype=torch.float64)
    assert {b.kind for b in proj.blocks} == {"linear"}
    x = fast(proj, model, task, batch)
    ref = proj.project(as_pieces(model, names, want), model_id=0)
    torch.testing.assert_close(x, ref, rtol=1e-9, atol=1e-10 * float(ref.abs().max()))


def test_adapter_state_dicts_load_and_refuse_what_does_not_fit(tmp_path):
    model = gpt2_lora(torch.float32)
    sd = {k: v + 1 for k, v in peft.get_peft_model_state_dict(model).items()}
    load_state(model, sd)
    np.testing.assert_array_equal(
        peft.get_peft_model_state_dict(model)["base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"],
        sd["base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"],
    )
    load_state(model, model.state_dict())  # the full state dict too
    model.save_pretrained(tmp_path / "a")
    from_file = read_state_file(tmp_path / "a" / "adapter_model.safetensors")
    assert set(from_file) == set(sd)
    feat = Featurizer(model, "causal_lm", NoOpProjector())
    with pytest.raises(BadInputError, match="missing keys"):
        feat.load_state(dict(list(sd.items())[1:]))
    with pytest.raises(BadInputError, match="unexpected keys"):
        feat.load_state({**sd, "nope.weight": torch.zeros(1)})
    bad = dict(sd)
    k = next(iter(bad))
    bad[k] = torch.zeros(7, 7)
    with pytest.raises(BadInputError, match="size mismatch"):
        feat.load_state(bad)


def test_traker_and_index_on_adapter_checkpoints_match_float64_brute_force(tmp_path):
    """TRAKer(task="causal_lm") on a LoRA GPT-2 with two adapter checkpoints (state dicts as
    get_peft_model_state_dict gives them) and the identity projector: scores = the float64 brute force on the
    adapters' gradients; TrakIndex with the same checkpoints (one a state dict, one the safetensors file
    save_pretrained writes) ranks as finalize_scores; another adapter for a featurized model_id is refused."""
    model = gpt2_lora(torch.float32)
    ck = [{k: v.clone() for k, v in peft.get_peft_model_state_dict(model).items()}]
    torch.manual_seed(1)
    ck.append({k: v + 0.3 * torch.randn_like(v) for k, v in ck[0].items()})
    names = grad_param_names(model, None)
    d = sum(p.numel() for p in named(model, names))
    train, targets = sequences(20, seed=5), sequences(3, seed=6)
    lam = 1e-3
    save = tmp_path / "s"
    tr = TRAKer(
        model=model,
        task="causal_lm",
        train_set_size=len(train),
        save_dir=str(save),
        device="cpu",
        projector=NoOpProjector(),
        use_half_precision=False,
        lambda_reg=lam,
        logging_level=logging.ERROR,
    )
    assert tr.num_params_for_grad == d
    for mid, c in enumerate(ck):
        tr.load_checkpoint(c, model_id=mid)
        for a in range(0, len(train), 8):
            tr.featurize(mixed_batch(train[a : a + 8]), num_samples=len(train[a : a + 8]))
    with pytest.raises(StoreMismatchError, match="model_id=0 .* content differs"):  # another adapter, same rows
        tr.load_checkpoint({k: v * 2 for k, v in ck[0].items()}, model_id=0)
    tr.finalize_features()
    for mid, c in enumerate(ck):
        tr.start_scoring_checkpoint("e", c, mid, len(targets))
        tr.score(mixed_batch(targets), num_samples=len(targets))
    got = np.asarray(tr.finalize_scores("e"), dtype=np.float64)

    acc, qsum = np.zeros((len(train), len(targets))), np.zeros(len(train))
    ref = gpt2_lora(torch.float64)
    for c in ck:
        load_state(ref, {k: v.double() for k, v in c.items()})
        g, gt = lm_reference(ref, train, names), lm_reference(ref, targets, names)
        with torch.no_grad():
            q = []
            for s in train:
                logp = torch.log_softmax(ref(input_ids=torch.tensor([s])).logits[0, :-1], -1)
                q.append(float(-torch.expm1(sum(logp[t - 1, s[t]] for t in range(1, len(s))))))
        x, xt = g.numpy() / math.sqrt(d), gt.numpy() / math.sqrt(d)
        inv = np.linalg.inv(x.T @ x + lam * np.eye(d))
        inv /= np.abs(inv).mean()
        acc += x @ inv @ xt.T
        qsum += np.array(q)
    want = combine_checkpoints(acc, qsum, len(ck))
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max()
    del tr

    load_state(model, ck[1])
    model.save_pretrained(tmp_path / "ck1")
    file1 = tmp_path / "ck1" / "adapter_model.safetensors"
    index = TrakIndex(save, model=gpt2_lora(torch.float32), checkpoints=[ck[0], file1], task="causal_lm", device="cpu")
    top = index.query(mixed_batch(targets), k=5)
    scores = np.asarray(got, dtype=np.float32)
    for j in range(len(targets)):
        np.testing.assert_array_equal(np.sort(top.indices[j]), np.sort(np.argsort(-scores[:, j], kind="stable")[:5]))
    with pytest.raises((BadInputError, StoreMismatchError)):
        TrakIndex(save, model=gpt2_lora(torch.float32), checkpoints=[ck[0], model.get_base_model().state_dict()])


def test_traker_default_projector_on_lora_is_factored(tmp_path):
    """TRAKer's default projector on a LoRA model: the factored one over the adapters alone (no dense block), its
    stored rows the projection of the float64 adapter gradients / √grad_dim."""
    model = gpt2_lora(torch.float32)
    train = sequences(12, seed=8)
    tr = TRAKer(
        model=model,
        task="causal_lm",
        train_set_size=len(train),
        save_dir=str(tmp_path / "s"),
        device="cpu",
        proj_dim=16,
        use_half_precision=False,
        logging_level=logging.ERROR,
    )
    tr.load_checkpoint(peft.get_peft_model_state_dict(model), model_id=0)
    tr.featurize(mixed_batch(train), num_samples=len(train))
    proj = tr.featurizer.projector
    assert isinstance(proj, FactoredProjector) and OTHER not in {b.name for b in proj.blocks}
    assert not any(b.kind == MATRIX for b in proj.blocks) and proj._substitute == set()
    x = tr.store.model(0).grads[:].astype(np.float64)
    names = grad_param_names(model, None)
    ref = gpt2_lora(torch.float64)
    g = lm_reference(ref, train, names)
    want = proj.project(as_pieces(ref, names, g.float()), model_id=0).double().numpy() / math.sqrt(g.shape[1])
    np.testing.assert_allclose(x, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())
