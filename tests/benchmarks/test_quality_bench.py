"""benchmarks/quality.py's causal-LM case: its ground truth is the model output TRAK attributes, and its subset
models learn from their subset only.

* ``_lm_outputs`` (the subset models' outputs on the targets) equals ``CausalLMModelOutput.get_output`` (the f whose
  gradients the case featurizes), computed one sequence at a time in float64;
* ``examples.gpt.train(rows=...)`` draws every batch from those rows.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest
import torch
from trak_fixtures import REPO_ROOT

pytest.importorskip("transformers")

from examples import gpt  # noqa: E402
from trak_core.featurize.modelout import CausalLMModelOutput  # noqa: E402

ROOT = str(REPO_ROOT)


@pytest.fixture(scope="module")
def quality():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        yield importlib.import_module("quality")
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))


def test_lm_ground_truth_is_the_causal_lm_model_output(quality):
    torch.manual_seed(0)
    model, _ = gpt.train(seed=3, steps=2)
    model = model.double()
    targets = tuple(t[:5] for t in gpt.target_data(5))
    got, acc = quality._lm_outputs(model, targets)
    assert acc is None and got.dtype == np.float64 and got.shape == (5,)
    task = CausalLMModelOutput()
    weights = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v for k, v in model.named_buffers()}
    want = [float(task.get_output(model, weights, buffers, *(t[i] for t in targets))) for i in range(5)]
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-8)
    # the targets' texts differ: so do their outputs (the comparison is not between constants)
    assert np.ptp(got) > 1.0


def test_subset_training_sees_only_its_rows(monkeypatch):
    seen: list[torch.Tensor] = []
    real = gpt.make_model

    def recording_model():
        model = real()
        forward = model.forward

        def spy(input_ids=None, **kw):
            seen.append(input_ids.clone())
            return forward(input_ids=input_ids, **kw)

        model.forward = spy
        return model

    rows = [3, 17, 40]
    gpt.train(seed=0, steps=4, batch=8, rows=rows, model_fn=recording_model)
    ids = gpt.train_data()[0]
    allowed = {tuple(ids[r].tolist()) for r in rows}
    got = [tuple(r.tolist()) for batch in seen for r in batch]
    assert len(got) == 4 * 8 and set(got) <= allowed
    assert len(set(got)) > 1  # drawn from the subset, not one row repeated
