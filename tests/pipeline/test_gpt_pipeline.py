"""The pipeline on a causal LM: examples/gpt.yaml (task causal_lm, a transformers GPT-2) through the featurize,
finalize and score flows, on a few rows of the example's docstring corpus, against TRAKer on the same inputs."""

import logging

import numpy as np
import pytest
import torch
import yaml

pytest.importorskip("transformers")

from trak_fixtures import REPO_ROOT

from examples import gpt  # noqa: E402
from tasks.config import AttributeConfig  # noqa: E402
from trak_core import TRAKer  # noqa: E402
from trak_core.featurize.gradients import grad_dim_of  # noqa: E402
from trak_core.projection.projectors import make_projector, rebuild_kwargs  # noqa: E402
from trak_core.store import TrakStore  # noqa: E402

pytestmark = pytest.mark.usefixtures("prefect_harness")
YAML = REPO_ROOT / "examples" / "gpt.yaml"
N, M, PROJ, LAM = 32, 4, 32, 1e-2


def train_rows():
    return tuple(t[:N] for t in gpt.train_data())


def target_rows():
    return tuple(t[:M] for t in gpt.target_data())


def test_example_config_validates(tmp_path):
    """examples/gpt.yaml as it is, but for its checkpoints (written by `python -m examples.gpt`)."""
    torch.save(gpt.make_model().state_dict(), tmp_path / "model_0.pt")
    raw = {**yaml.safe_load(YAML.read_text()), "checkpoints": str(tmp_path / "model_*.pt")}
    cfg = AttributeConfig.model_validate(raw)
    assert cfg.task == "causal_lm" and cfg.model == "examples.gpt:make_model"


def test_featurize_finalize_score_flows_equal_traker(tmp_path):
    from flows import featurize, finalize, score

    torch.manual_seed(0)
    model, _ = gpt.train(seed=0, steps=3)
    ckpt = tmp_path / "model_0.pt"
    torch.save(model.state_dict(), ckpt)
    raw = yaml.safe_load(YAML.read_text())
    raw.update(
        train_data="test_gpt_pipeline:train_rows",
        target_data="test_gpt_pipeline:target_rows",
        checkpoints=[str(ckpt)],
        store=str(tmp_path / "store.zarr"),
        proj_dim=PROJ,
        lambda_reg=LAM,
        batch_size=8,
        shard_size=16,
        chunk_rows=8,
        max_workers=1,
        report_targets=0,
        report_dir=None,
    )
    cfg = AttributeConfig.model_validate(raw)
    assert featurize(cfg)["computed"] == N // 16
    finalize(cfg)
    score(cfg)
    got = TrakStore.open(cfg.store, mode="r").scores(cfg.exp_name)[:]

    fresh = gpt.make_model()
    kw = rebuild_kwargs("factored", TrakStore.open(cfg.store, mode="r").meta.projector_params)  # the plan's split
    proj = make_projector("factored", grad_dim_of(fresh), PROJ, 0, "rademacher", "cpu", model=fresh, **kw)
    tr = TRAKer(
        fresh,
        "causal_lm",
        N,
        save_dir=str(tmp_path / "traker.zarr"),
        device="cpu",
        projector=proj,
        use_half_precision=False,  # the config's dtype: float32
        lambda_reg=LAM,
        chunk_rows=8,
        shard_rows=16,
        logging_level=logging.ERROR,
    )
    sd = torch.load(ckpt, weights_only=True)
    tr.load_checkpoint(sd, 0)
    train, targets = train_rows(), target_rows()
    for a in range(0, N, 8):
        tr.featurize(tuple(t[a : a + 8] for t in train), inds=np.arange(a, a + 8))
    tr.finalize_features()
    tr.start_scoring_checkpoint(cfg.exp_name, sd, 0, M)
    tr.score(targets, num_samples=M)
    want = np.asarray(tr.finalize_scores(cfg.exp_name))
    assert got.shape == (N, M)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
