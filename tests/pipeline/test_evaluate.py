"""The evaluate flow (counterfactual LDS) and planted-attribution checks.

* trak_core.lds against scipy / explicit formulas (no Prefect);
* the evaluate flow on examples.tiny: its LDS equals an independent scipy computation on the stored
  masks / margins / scores, its margins equal an independent retraining, a re-run (here through
  ``trakflow evaluate``) trains nothing, a larger M trains only the new subsets;
* planted cases through trak_core.TRAKer: a duplicated target is its top proponent, a mislabeled copy of a
  target is its top opponent.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from scipy.stats import spearmanr

from examples import tiny
from tasks.config import EvaluateConfig
from trak_core import lds as L
from trak_core.errors import BadInputError
from trak_core.store import TrakStore

RECIPE = dict(epochs=40, batch_size=64, optimizer="adam", lr=0.05, momentum=0.0)


@pytest.fixture(autouse=True, scope="module")
def _restore_global_rng():
    """Leave torch's global RNG as found: training seeds it (torch.manual_seed), and later tests that draw
    unseeded must not depend on whether this module ran."""
    with torch.random.fork_rng(devices=[]):
        yield


# ---------------------------------------------------------------------------- pure LDS
def test_lds_per_target_equals_scipy_spearman():
    rng = np.random.default_rng(0)
    n, m, M = 30, 7, 12
    scores = rng.normal(size=(n, m))
    masks = L.subset_masks(n, M, 0.5, seed=3)
    margins = L.predicted_effects(scores, masks) + rng.normal(scale=2.0, size=(M, m))
    margins[:, 2] = np.round(margins[:, 2])  # ties
    per = L.lds_per_target(scores, masks, margins)
    ref = [spearmanr(masks.astype(float) @ scores[:, j], margins[:, j]).statistic for j in range(m)]
    np.testing.assert_allclose(per, ref, atol=1e-12)
    value, _ = L.lds(scores, masks, margins)
    assert value == pytest.approx(np.mean(ref), abs=1e-12)
    # a constant target has no correlation: NaN, and the mean skips it
    margins[:, 0] = 1.0
    value, per = L.lds(scores, masks, margins)
    assert np.isnan(per[0]) and value == pytest.approx(np.mean(per[1:]))


def test_subset_masks_sizes_determinism_and_prefix():
    a = L.subset_masks(101, 9, 0.5, seed=7)
    assert a.shape == (9, 101) and a.dtype == bool
    assert set(a.sum(axis=1).tolist()) == {50}  # round(0.5 · 101) = 50 (banker's rounding)
    np.testing.assert_array_equal(a, L.subset_masks(101, 9, 0.5, seed=7))
    np.testing.assert_array_equal(a[:4], L.subset_masks(101, 4, 0.5, seed=7))  # M extends, not reshuffles
    assert not np.array_equal(a, L.subset_masks(101, 9, 0.5, seed=8))
    assert L.subset_masks(10, 3, 0.3).sum(axis=1).tolist() == [3, 3, 3]
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(BadInputError, match="subset_fraction"):
            L.subset_masks(10, 3, bad)


def test_margins_from_logits_is_log_odds_of_the_label():
    logits = torch.tensor([[2.0, -1.0, 0.5], [0.0, 0.0, 0.0], [-3.0, 4.0, 1.0]])
    labels = torch.tensor([0, 2, 1])
    p = torch.softmax(logits.double(), dim=1)[torch.arange(3), labels]
    np.testing.assert_allclose(L.margins_from_logits(logits, labels), torch.log(p / (1 - p)).numpy(), atol=1e-12)


def test_lds_refuses_mismatched_shapes():
    masks = L.subset_masks(10, 5)
    with pytest.raises(BadInputError, match="train rows"):
        L.lds(np.zeros((9, 2)), masks, np.zeros((5, 2)))
    with pytest.raises(BadInputError, match="margins"):
        L.lds(np.zeros((10, 2)), masks, np.zeros((5, 3)))
    with pytest.raises(BadInputError, match="at least 3"):
        L.lds(np.zeros((10, 2)), masks[:2], np.zeros((2, 2)))


# ---------------------------------------------------------------------------- the flow
def _checkpoints(folder: Path) -> list[str]:
    """Two tiny models trained with RECIPE (the train flow's training code, no files but the state_dicts)."""
    from tasks.config import TrainConfig
    from tasks.trainer import train_on_rows

    folder.mkdir(parents=True, exist_ok=True)
    cfg = TrainConfig(
        model="examples.tiny:make_model",
        train_data="examples.tiny:train_data",
        out_dir=str(folder),
        alpha_every=0,
        device="cpu",
        **RECIPE,
    )
    paths = []
    for seed in (0, 1):
        p = folder / f"model_{seed:03d}.pt"
        torch.save(train_on_rows(cfg, seed).state_dict(), p)
        paths.append(str(p))
    return paths


def _eval_dict(tmp: Path, ckpts, **over) -> dict:
    attr = dict(
        model="examples.tiny:make_model",
        train_data="examples.tiny:train_data",
        target_data="examples.tiny:target_data",
        checkpoints=ckpts,
        store=str(tmp / "store.zarr"),
        exp_name="tiny",
        proj_dim=16,
        lambda_reg="rel:0.1",
        batch_size=32,
        shard_size=32,
        chunk_rows=32,
        device="cpu",
        report_targets=0,
    )
    cfg = dict(
        attribute=attr,
        num_subsets=10,
        subset_fraction=0.5,
        seeds_per_subset=1,
        cache_dir=str(tmp / "cache"),
        report_dir=str(tmp / "report"),
        **RECIPE,
    )
    cfg.update(over)
    return cfg


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, prefect_harness):
    from flows import evaluate

    tmp = tmp_path_factory.mktemp("evaluate")
    cfg = EvaluateConfig.model_validate(_eval_dict(tmp, _checkpoints(tmp / "ck")))
    return tmp, cfg, evaluate(cfg)


def test_flow_lds_equals_independent_computation(evaluated):
    tmp, cfg, res = evaluated
    truth = np.load(res["truth"])
    masks, margins = truth["masks"], truth["margins"]
    scores = TrakStore.open(cfg.attribute.store, mode="r").scores("tiny")[:].astype(np.float64)
    assert masks.shape == (10, tiny.NUM_TRAIN) and margins.shape == (10, tiny.NUM_TARGETS)
    np.testing.assert_array_equal(masks, L.subset_masks(tiny.NUM_TRAIN, 10, 0.5, cfg.subset_seed))
    ref = [spearmanr(masks.astype(np.float64) @ scores[:, j], margins[:, j]).statistic for j in range(scores.shape[1])]
    np.testing.assert_allclose([np.nan if v is None else v for v in res["per_target"]], ref, atol=1e-12)
    assert res["lds"] == pytest.approx(np.nanmean(ref), abs=1e-12)
    assert res["trained"] == 10 and res["train"]["computed"] == 10
    assert res["settings"]["lambda_reg"] == "rel:0.1" and all(x > 0 for x in res["settings"]["lambda_abs"])
    # trained models: the scores predict the counterfactuals (random scores: ≈ 0; 10 subsets × 8 targets at proj_dim
    # 16 leave a spread of a few hundredths between projections: 0.197 with the energy split)
    assert res["lds"] > 0.15
    assert {Path(f).name for f in res["files"]} == {"tiny_lds.md", "tiny_lds_per_target.png"}
    assert f"LDS = {res['lds']:.3f}" in Path(res["files"][0]).read_text()


def test_ground_truth_margins_are_those_of_retrained_models(evaluated):
    """Subset model 3 retrained independently (seed model_seed + 3, rows of subset 3) has the stored margins."""
    from tasks.trainer import train_on_rows

    tmp, cfg, res = evaluated
    truth = np.load(res["truth"])
    from tasks.evaluate import recipe_config

    model = train_on_rows(recipe_config(cfg), cfg.model_seed + 3, np.flatnonzero(truth["masks"][3]))
    xt, yt = tiny.target_data()
    with torch.no_grad():
        p = torch.softmax(model(xt).double(), dim=1)[torch.arange(len(yt)), yt]
    np.testing.assert_allclose(truth["margins"][3], torch.log(p / (1 - p)).numpy(), rtol=1e-6, atol=1e-9)


@pytest.mark.slow
def test_second_run_through_the_cli_trains_nothing(evaluated, monkeypatch):
    from typer.testing import CliRunner

    import tasks.evaluate as ev
    from trakflow_cli.main import app

    tmp, cfg, first = evaluated
    folder = Path(first["truth"]).parent
    before = {p: p.stat().st_mtime_ns for p in folder.rglob("*.npy")}

    def boom(*a, **k):
        raise AssertionError("a cached subset model was retrained")

    monkeypatch.setattr(ev, "train_on_rows", boom)
    path = tmp / "evaluate.yaml"
    # the fixture's run scored the experiment: the rerun reads it (the attribute flow's own rerun, which recomputes
    # nothing, is test_flows.py's test_second_run_recomputes_nothing)
    path.write_text(yaml.safe_dump(cfg.model_copy(update={"run_attribute": False}).model_dump(mode="json")))
    out = CliRunner().invoke(app, ["evaluate", str(path)], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert out.exit_code == 0, out.output
    assert "0 models trained now (10 reused)" in out.output
    m = re.search(r"LDS = (-?[0-9.]+)", out.output)
    assert m and float(m.group(1)) == pytest.approx(first["lds"], abs=1e-4)
    assert before == {p: p.stat().st_mtime_ns for p in folder.rglob("*.npy")}


def test_larger_m_trains_only_new_subsets_and_recipe_changes_the_key(evaluated):
    from flows import evaluate
    from tasks.evaluate import plan_truth

    tmp, cfg, first = evaluated
    # on a copy of the cache: the shared fixture's truth (10 subsets) stays as the other tests read it
    cache = tmp / "cache-larger"
    shutil.copytree(cfg.cache_dir, cache)
    more = cfg.model_copy(update={"num_subsets": 12, "run_attribute": False, "cache_dir": str(cache)})
    res = evaluate(more)
    assert res["trained"] == 2 and res["num_subsets"] == 12
    assert Path(res["truth"]).parent.name == Path(first["truth"]).parent.name
    np.testing.assert_array_equal(np.load(res["truth"])["margins"][:10], np.load(first["truth"])["margins"])
    assert np.load(first["truth"])["masks"].shape[0] == 10
    other = plan_truth(cfg.model_copy(update={"lr": 0.01}))
    assert other.folder != str(Path(first["truth"]).parent) and other.to_train == 10


def test_subset_models_train_with_their_share_of_the_cores(evaluated, monkeypatch):
    """The evaluate flow's subset models, two at a time on two cores, train with one torch thread each."""
    from flows import evaluate
    from tasks import common
    from tasks import evaluate as ev

    tmp, cfg, _ = evaluated
    monkeypatch.setattr(common, "cores", lambda: 2)
    seen: list[int] = []
    real = ev.train_subset_model
    monkeypatch.setattr(ev, "train_subset_model", lambda *a: seen.append(torch.get_num_threads()) or real(*a))
    before = torch.get_num_threads()
    threads = {"num_subsets": 4, "cache_dir": str(tmp / "cache-threads"), "max_workers": 2, "run_attribute": False}
    evaluate(cfg.model_copy(update=threads))  # the experiment is the fixture's, scored
    assert seen == [1, 1, 1, 1] and torch.get_num_threads() == before


def test_unscored_experiment_without_run_attribute_names_the_field(evaluated):
    from flows import evaluate

    tmp, cfg, _ = evaluated
    for update, field in (({"store": str(tmp / "other.zarr")}, "store"), ({"exp_name": "never-run"}, "exp_name")):
        bad = cfg.model_copy(update={"attribute": cfg.attribute.model_copy(update=update), "run_attribute": False})
        with pytest.raises(BadInputError, match=f"^{field}:"):
            evaluate(bad)
    assert not (tmp / "other.zarr").exists()


@pytest.mark.parametrize("task", ["causal_lm", "trak_core.featurize.modelout:CausalLMModelOutput"])
def test_evaluate_refuses_a_causal_lm_before_training(tmp_path, task):
    d = _eval_dict(tmp_path, tiny.save_checkpoints(tmp_path / "ck", seeds=(0,)))
    d["attribute"] = {**d["attribute"], "task": task}
    with pytest.raises(Exception, match="attribute.task: evaluate trains classifiers"):
        EvaluateConfig.model_validate(d)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "store.zarr").exists()
    d["attribute"]["task"] = "image_classification"  # the same config with a classifier's task is accepted
    assert EvaluateConfig.model_validate(d).attribute.task == "image_classification"


def test_evaluate_config_reads_the_recipe_of_a_train_manifest(tmp_path):
    ck = tiny.save_checkpoints(tmp_path / "ck", seeds=(0,))
    manifest = tmp_path / "ck" / "manifest.json"
    manifest.write_text(
        '{"config": {"epochs": 7, "lr": 0.02, "optimizer": "adam", "batch_size": 16}, "checkpoints": ["model_000.pt"]}'
    )
    d = _eval_dict(tmp_path, ck)
    for k in RECIPE:
        d.pop(k)
    cfg = EvaluateConfig.model_validate({**d, "recipe_from": str(manifest), "lr": 0.5})
    assert cfg.recipe() == {
        "epochs": 7,
        "batch_size": 16,
        "optimizer": "adam",
        "lr": 0.5,
        "momentum": 0.9,
        "weight_decay": 0.0,
    }
    with pytest.raises(Exception, match="recipe_from"):
        EvaluateConfig.model_validate({**d, "recipe_from": str(tmp_path / "missing.json")})
    with pytest.raises(Exception, match="subset_fraction"):
        EvaluateConfig.model_validate({**d, "subset_fraction": 1.0})


# ---------------------------------------------------------------------------- planted cases
CENTERS = torch.tensor([[3.0, 0, 0, 0], [0, 3.0, 0, 0], [0, 0, 3.0, 0]])
DUP, MISLABELED = 60, 61  # train rows planted after the 60 regular ones


def _planted_data():
    """60 train points in 3 Gaussian blobs, 4 targets; target 0 is atypical (off every blob). Train row 60
    is a copy of target 0 with its label (a duplicate); row 61 a copy of target 1 with a wrong label."""
    g = torch.Generator().manual_seed(0)
    y = torch.arange(60) % 3
    x = CENTERS[y] + torch.randn(60, 4, generator=g)
    yt = torch.tensor([0, 1, 2, 0])
    xt = CENTERS[yt] + torch.randn(4, 4, generator=g)
    xt[0] = torch.tensor([1.0, 1.0, 0.0, 3.0])
    x = torch.cat([x, xt[0:1], xt[1:2]])
    y = torch.cat([y, yt[0:1], torch.tensor([2])])
    return x, y, xt, yt


@pytest.fixture(scope="module")
def planted_checkpoints():
    from torch import nn

    x, y, _, _ = _planted_data()
    sds = []
    for seed in range(3):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        for _ in range(60):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        assert (model(x).argmax(1) == y).float().mean() >= 0.95
        sds.append(model.state_dict())
    return sds


# proj_dim 32 < n = 62 for λ = 0 (XᵀX invertible); 160 ≥ the 131 parameters for the damped settings: below that
# the projection noise decides the order of the two planted rows under damping for some projector seeds (at 64:
# 1–3 seeds of 10 for factored and dense alike)
@pytest.mark.parametrize(("proj_dim", "lambda_reg"), [(32, 0.0), (160, "rel:0.01"), (160, "rel:0.1"), (160, "auto")])
def test_planted_duplicate_is_top_proponent_and_mislabeled_copy_top_opponent(planted_checkpoints, proj_dim, lambda_reg):
    from torch import nn

    from trak_core import TRAKer

    x, y, xt, yt = _planted_data()
    with tempfile.TemporaryDirectory() as d:
        tr = TRAKer(
            nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)),
            "image_classification",
            len(x),
            save_dir=os.path.join(d, "s.zarr"),
            device="cpu",
            proj_dim=proj_dim,
            lambda_reg=lambda_reg,
            use_half_precision=False,
            logging_level=40,
        )
        for mid, sd in enumerate(planted_checkpoints):
            tr.load_checkpoint(sd, mid)
            tr.featurize((x, y), num_samples=len(x))
        tr.finalize_features()
        for mid, sd in enumerate(planted_checkpoints):
            tr.start_scoring_checkpoint("planted", sd, mid, len(xt))
            tr.score((xt, yt), num_samples=len(xt))
        scores = np.asarray(tr.finalize_scores("planted"))
    from tasks.report import top_k

    pro0, _ = top_k(scores, 0, 3)
    _, opp1 = top_k(scores, 1, 3)
    assert pro0[0] == DUP, f"top proponents of target 0: {pro0}"
    assert opp1[0] == MISLABELED, f"top opponents of target 1: {opp1}"
    # and they are not the top of the opposite list: the duplicate supports, the mislabeled copy opposes
    assert scores[DUP, 0] > 0 > scores[MISLABELED, 1]


# ---------------------------------------------------------------------------- damping settings in the config
def test_attribute_config_lambda_reg_settings(tmp_path):
    from tasks.config import AttributeConfig
    from trak_core.solve.damping import ADAPTIVE, AUTO_DAMPING, resolve_lambda

    ck = tiny.save_checkpoints(tmp_path / "ck", seeds=(0,))
    base = _eval_dict(tmp_path, ck)["attribute"]
    base.pop("lambda_reg")
    # the default chosen by leave-one-case-out, recorded as its parts ("neff:0.12,cresid:10")
    assert AttributeConfig.model_validate(base).lambda_reg == ADAPTIVE
    for given, want in (("REL:0.3", "rel:0.3"), ("2", 2.0), (0, 0.0), (" auto ", "auto"), ("Deff:0.2", "deff:0.2")):
        assert AttributeConfig.model_validate({**base, "lambda_reg": given}).lambda_reg == want
    for bad in ("-1", "rel:-1", "rel:x", "big"):
        with pytest.raises(Exception, match="lambda_reg"):
            AttributeConfig.model_validate({**base, "lambda_reg": bad})
    xtx = torch.diag(torch.tensor([4.0, 2.0, 0.0], dtype=torch.float64))
    assert resolve_lambda("auto", xtx) == pytest.approx(AUTO_DAMPING * 2.0)
