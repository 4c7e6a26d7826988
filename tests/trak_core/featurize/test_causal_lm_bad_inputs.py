"""causal_lm inputs a model cannot take, on the routes that reach the model inside ``torch.func.vmap`` (the
per-example gradient path, the factored projector's, the energy probe) and outside it: token ids outside the
vocabulary or negative give one line naming the (row, position) and the value, never a raw IndexError; a batch on
another device than the model (emulated on the CPU with the "meta" device) gives one line naming both devices, never
a raw NotImplementedError or RuntimeError. A tiny transformers GPT-2 (its own mask path replaced under vmap) and a
plain module."""

from __future__ import annotations

import pytest
import torch

from trak_core.errors import BadInputError
from trak_core.featurize.featurizer import Featurizer
from trak_core.featurize.gradients import FunctionalGradientComputer, IterativeGradientComputer, grad_dim_of
from trak_core.featurize.lm import causal_lm_batch
from trak_core.featurize.modelout import CausalLMModelOutput
from trak_core.projection.energy import gradient_energies
from trak_core.projection.projectors import make_projector

VOCAB = 24
SEQS = [[1, 2, 3, 4, 5], [5, 6, 7], [3, 4, 5, 6, 7], [9, 8, 7, 6]]


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 6)
        self.head = torch.nn.Linear(6, VOCAB)

    def forward(self, input_ids, attention_mask=None):
        return self.head(torch.tanh(self.emb(input_ids)))


def gpt2():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=8, n_layer=1, n_head=2, pad_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


MODELS = {"plain": TinyLM, "gpt2": gpt2}


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def bad_ids(row: int, pos: int, value: int):
    ids, mask, labels = causal_lm_batch(SEQS)
    ids[row, pos] = value
    return ids, mask, labels


@pytest.mark.parametrize("which", sorted(MODELS))
@pytest.mark.parametrize("value", [VOCAB + 5, -4])
def test_ids_outside_the_vocabulary_inside_vmap_name_row_and_position(which, value):
    """The per-example gradient path (vmap over the batch; no validate_batch before it) names the row, the
    position and the value of the id; so does the energy probe (vmap(grad) over the probe's rows)."""
    model = MODELS[which]()
    batch = bad_ids(2, 3, value)
    gc = FunctionalGradientComputer(model, CausalLMModelOutput(), dtype=torch.float32)
    want = rf"input_ids must be in \[0, {VOCAB}\).*rows \[2\] hold such ids: \(row, position\) \[\(2, 3\)\] "
    want += rf"\(values \[{value}\]\)"
    with pytest.raises(BadInputError, match=want) as e:
        gc.compute_per_sample_grad(batch)
    one_line(e)
    with pytest.raises(BadInputError, match=want) as e:
        gc.compute_per_sample_grad(batch, with_output=True)
    one_line(e)
    with pytest.raises(BadInputError, match=want) as e:
        gradient_energies(model, "causal_lm", batch, rows=len(SEQS))
    one_line(e)
    with pytest.raises(BadInputError, match=want) as e:  # Q's forward, outside vmap
        gc.compute_loss_grad(batch)
    one_line(e)


@pytest.mark.parametrize("kind", ["dense", "factored"])
def test_featurizer_names_the_rows_of_the_batch_it_was_given(kind):
    """The featurizer refuses the ids before any compute, naming the batch's own rows: the factored path computes
    a batch padded with copies of its last row, which must not be named."""
    model = TinyLM()
    grad_dim = grad_dim_of(model)
    kw = {"model": model} if kind == "factored" else {}
    proj = make_projector(kind, grad_dim, 4, seed=0, device="cpu", **kw)
    feat = Featurizer(model, "causal_lm", proj, device="cpu")
    with pytest.raises(BadInputError, match=r"causal_lm: input_ids .*rows \[3\] hold such ids: .*\[\(3, 1\)\]") as e:
        feat.featurize(bad_ids(3, 1, VOCAB), model_id=0)
    one_line(e)


def test_a_models_own_index_error_inside_vmap_is_not_blamed_on_the_ids():
    class Buggy(TinyLM):
        def forward(self, input_ids, attention_mask=None):
            return [self.head(self.emb(input_ids))][1]

    gc = FunctionalGradientComputer(Buggy(), CausalLMModelOutput(), dtype=torch.float32)
    with pytest.raises(IndexError, match="list index out of range"):
        gc.compute_per_sample_grad(causal_lm_batch(SEQS))


@pytest.mark.parametrize("which", sorted(MODELS))
def test_batch_on_another_device_than_the_model_names_both(which):
    """A batch on "meta" and a model on the CPU (as a CUDA batch and a CPU model): each route that runs the model
    on the batch refuses it in one line naming both devices, before the forward."""
    model = MODELS[which]()
    task = CausalLMModelOutput()
    meta = tuple(t.to("meta") for t in causal_lm_batch(SEQS))
    want = r"the batch is on meta but the model's parameters are on cpu"
    weights = {k: v.detach() for k, v in model.named_parameters()}
    routes = {
        "per-example grads": lambda: FunctionalGradientComputer(model, task).compute_per_sample_grad(meta),
        "Q": lambda: FunctionalGradientComputer(model, task).compute_loss_grad(meta),
        "task's Q": lambda: task.get_out_to_loss_grad(model, weights, {}, meta),
        "iterative grads": lambda: IterativeGradientComputer(model, task).compute_per_sample_grad(meta),
    }
    for name, call in routes.items():
        with pytest.raises(BadInputError, match=want) as e:
            call()
        assert "model.to('meta')" in one_line(e), name


def test_featurizer_device_other_than_the_models_names_both():
    """The featurizer moves the batch to its device: a model left elsewhere is named with that device."""
    model = TinyLM()
    proj = make_projector("dense", grad_dim_of(model), 4, seed=0, device="cpu")
    feat = Featurizer(model, "causal_lm", proj, device="meta")
    with pytest.raises(BadInputError, match=r"batch is on meta but the model's parameters are on cpu.*device='meta'"):
        feat.featurize(causal_lm_batch(SEQS), model_id=0)
    feat = Featurizer(TinyLM().to("meta"), "causal_lm", proj, device="cpu")
    with pytest.raises(BadInputError, match=r"batch is on cpu but the model's parameters are on meta") as e:
        feat.featurize(causal_lm_batch(SEQS), model_id=0)
    one_line(e)
