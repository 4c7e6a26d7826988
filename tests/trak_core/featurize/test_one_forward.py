"""Featurizing with the factored projector runs the model's forward once per batch: Q = 1 − p_y comes from the
margins f of the projection's own forward (Q = sigmoid(−f)) for the built-in classification tasks at temperature 1;
every other task, temperature or subclass keeps its own ``get_out_to_loss_grad`` forward. The projected gradients
are the same bits either way; Q is the same to float32 rounding, and exact where 1 − p_y rounds to 0."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from trak_fixtures import make_data, make_model

import trak_core
from trak_core.errors import BadInputError
from trak_core.featurize.gradients import grad_dim_of
from trak_core.featurize.modelout import ImageClassificationModelOutput, TextClassificationModelOutput
from trak_core.projection.projectors import make_projector


def _traker(tmp_path, task="image_classification", model=None, name="s", kind="factored"):
    model = model if model is not None else make_model()
    kw = {}
    if kind != "factored":  # TRAKer's default
        gd = grad_dim_of(model)
        kw["projector"] = make_projector(kind, gd, gd if kind == "noop" else 16, 0, "rademacher", "cpu", model=model)
    return trak_core.TRAKer(
        model=model,
        task=task,
        train_set_size=40,
        save_dir=str(tmp_path / name),
        device="cpu",
        proj_dim=16,
        logging_level=logging.ERROR,
        use_half_precision=False,
        **kw,
    )


def _featurize(tr, model, x, y) -> tuple[np.ndarray, np.ndarray, int]:
    """(X, Q) stored for rows 0..len(y)-1, and the number of forward passes the model ran for them."""
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        tr.load_checkpoint(model.state_dict(), model_id=0)
        tr.featurize((x, y), num_samples=len(y))
        tr._flush_rows()
    finally:
        handle.remove()
    m = tr.store.model(0)
    return np.asarray(m.grads[: len(y)]), np.asarray(m.out_to_loss[: len(y)]), len(calls)


class OwnQ(ImageClassificationModelOutput):
    """A subclass with its own Q: it must be the Q used (no closed form assumed)."""

    def get_out_to_loss_grad(self, model, weights, buffers, batch):
        return 0.5 * super().get_out_to_loss_grad(model, weights, buffers, batch)


@pytest.mark.parametrize("kind", ["factored", "dense", "sjlt", "noop"])
def test_one_forward_same_features_and_q(tmp_path, monkeypatch, kind):
    """Factored: the fast path's forward; the others: torch.func's per-example gradients and values."""
    model = make_model(1)
    x, y, _, _ = make_data(n=40)
    # the default projector: rows held for its probe are checked at their call (as featurizing them), then probed
    probe = int(kind == "factored")
    x1, q1, calls1 = _featurize(_traker(tmp_path, model=model, name="a", kind=kind), model, x[:8], y[:8])
    assert calls1 == 1 + 2 * probe  # the projection's forward only (factored: its check and the probe first)
    monkeypatch.setattr(ImageClassificationModelOutput, "out_to_loss_from_output", lambda self, out: None)
    x2, q2, calls2 = _featurize(_traker(tmp_path, model=model, name="b", kind=kind), model, x[:8], y[:8])
    assert calls2 == 2 + 3 * probe  # the projection's forward and get_out_to_loss_grad's (factored: check them too)
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_allclose(q1, q2, rtol=1e-6, atol=1e-7)
    with torch.no_grad():
        p = torch.softmax(model(x[:8]).double(), -1)[torch.arange(8), y[:8]]
    np.testing.assert_allclose(q1, (1 - p).numpy(), rtol=1e-5)


def test_confident_rows_keep_their_q(tmp_path):
    """Where p_y rounds to 1 in float32, 1 − p_y is 0; sigmoid(−f) keeps Q (float64 reference)."""
    model = make_model(1)
    with torch.no_grad():
        model[-1].weight.mul_(60.0)
    x, y, _, _ = make_data(n=40)
    with torch.no_grad():
        y = model(x[:8]).argmax(-1)  # every row confidently right
        logits = model(x[:8]).double()
    want = (1 - torch.softmax(logits, -1)[torch.arange(8), y]).numpy()
    old = 1 - torch.softmax(logits.float(), -1)[torch.arange(8), y].numpy()
    assert (old == 0).any() and (want > 0).all()  # the case: float32 loses these Q entirely
    _, q, _ = _featurize(_traker(tmp_path, model=model), model, x[:8], y)
    np.testing.assert_allclose(q, want, rtol=1e-4)


@pytest.mark.parametrize(
    "task",
    [ImageClassificationModelOutput(temperature=2.0), OwnQ()],
    ids=["temperature", "subclass"],
)
def test_other_tasks_keep_their_own_q(tmp_path, task):
    model = make_model(1)
    x, y, _, _ = make_data(n=40)
    _, q, calls = _featurize(_traker(tmp_path, task=task, model=model), model, x[:8], y[:8])
    # the held rows' check (projection and Q forwards), the energy probe, then the projection's forward and Q's
    assert calls == 5
    w = dict(model.named_parameters())
    want = task.get_out_to_loss_grad(model, w, {}, (x[:8], y[:8])).reshape(-1).numpy()
    np.testing.assert_allclose(q, want, rtol=1e-6)


@pytest.mark.parametrize("kind", ["factored", "noop"])
def test_label_out_of_range_still_named(tmp_path, kind):
    """Inside vmap nothing can be raised: the margin is NaN, and the task's own Q names the label."""
    model = make_model(1)
    x, y, _, _ = make_data(n=40)
    bad = y[:8].clone()
    bad[5] = 9
    tr = _traker(tmp_path, model=model, kind=kind)
    tr.load_checkpoint(model.state_dict(), model_id=0)
    with pytest.raises(BadInputError, match=r"labels out of range \[0, 3\) at batch positions \[5\]"):
        tr.featurize((x[:8], bad), num_samples=8)
    f = ImageClassificationModelOutput.get_output(model, dict(model.named_parameters()), {}, x[0], torch.tensor(9))
    assert torch.isnan(f)


class _Text(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(20, 8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, input_ids, token_type_ids, attention_mask):
        return self.head(self.emb(input_ids * attention_mask))


def test_text_task_q_from_margins():
    torch.manual_seed(0)
    model = _Text()
    ids = torch.randint(0, 20, (6, 5))
    batch = (ids, torch.zeros_like(ids), torch.ones_like(ids), torch.randint(0, 4, (6,)))
    task = TextClassificationModelOutput()
    w = dict(model.named_parameters())
    f = torch.stack([task.get_output(model, w, {}, *(t[i] for t in batch)) for i in range(6)])
    want = task.get_out_to_loss_grad(model, w, {}, batch).reshape(-1)
    torch.testing.assert_close(task.out_to_loss_from_output(f), want, rtol=1e-5, atol=1e-7)
    assert TextClassificationModelOutput(temperature=0.5).out_to_loss_from_output(f) is None


def test_targets_one_forward_and_labels_checked(tmp_path):
    """Scoring's target rows take the same single forward; a target label out of range is still named."""
    model = make_model(1)
    x, y, xt, yt = make_data(n=40)
    tr = _traker(tmp_path, model=model)
    _featurize(tr, model, x, y)
    tr.finalize_features()
    tr.start_scoring_checkpoint("e", model.state_dict(), 0, num_targets=len(yt))
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        tr.score((xt, yt), num_samples=len(yt))
    finally:
        handle.remove()
    assert len(calls) == 1
    bad = yt.clone()
    bad[2] = 5
    tr.start_scoring_checkpoint("f", model.state_dict(), 0, num_targets=len(yt))
    with pytest.raises(BadInputError, match=r"labels out of range \[0, 3\) at batch positions \[2\]"):
        tr.score((xt, bad), num_samples=len(yt))


class BadQ(ImageClassificationModelOutput):
    """A task whose closed form gives the wrong number of Q."""

    def out_to_loss_from_output(self, outputs):
        return outputs[:1].clone()


def test_a_closed_form_of_the_wrong_size_is_refused(tmp_path):
    model = make_model(1)
    x, y, _, _ = make_data(n=40)
    tr = _traker(tmp_path, task=BadQ(), model=model)
    tr.load_checkpoint(model.state_dict(), model_id=0)
    with pytest.raises(BadInputError, match=r"BadQ.out_to_loss_from_output gave \(1,\) for 8 outputs"):
        tr.featurize((x[:8], y[:8]), num_samples=8)
    assert not (tmp_path / "s" / "zarr.json").exists()  # the default projector's store: not created


class _LogShift(torch.nn.Module):
    """The model plus log(x₀ + 1000): finite inputs, a non-finite output for a row whose x₀ is −1000."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) + torch.log(x[:, :1] + 1000.0)


@pytest.mark.parametrize("kind", ["factored", "noop"])
def test_non_finite_outputs_named_as_outputs(tmp_path, kind):
    """Finite inputs that make the outputs non-finite (a NaN input is refused before any forward): the error names
    the model outputs (the task's own Q check runs before any gradient is checked), as with a separate forward."""
    from trak_core.errors import NonFiniteGradientError

    model = _LogShift(make_model(1))
    x, y, _, _ = make_data(n=40)
    xb = x[:8].clone()
    xb[3, 0] = -1000.0
    tr = _traker(tmp_path, model=model, kind=kind)
    tr.load_checkpoint(model.state_dict(), model_id=0)
    with pytest.raises(NonFiniteGradientError, match="model outputs") as e:
        tr.featurize((xb, y[:8]), num_samples=8)
    assert e.value.indices == [3]
