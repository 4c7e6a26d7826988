"""Reports a person can look at: the text example end to end (train flow → attribute flow with
text_classification → markdown with sentences, text PNGs, score histogram, artifacts) and
``trakflow show`` printing the same table; score statistics and the histogram on known arrays."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from examples import text

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True, scope="module")
def _restore_global_rng():
    """Leave torch's global RNG as found: training seeds it (torch.manual_seed), and later tests that draw
    unseeded must not depend on whether this module ran."""
    with torch.random.fork_rng(devices=[]):
        yield


@pytest.fixture(scope="module")
def text_run(tmp_path_factory, prefect_harness):
    """2 checkpoints of the text example (the train flow, text's full-batch Adam recipe), then the attribute
    flow on its 1,200 sentences and 20 targets with a sentence report."""
    from flows import attribute, train
    from tasks.config import AttributeConfig, TrainConfig

    tmp = tmp_path_factory.mktemp("text")
    tc = TrainConfig(
        model="examples.text:make_model",
        train_data="examples.text:train_data",
        out_dir=str(tmp / "ck"),
        num_models=2,
        epochs=60,
        batch_size=text.NUM_TRAIN,
        optimizer="adam",
        lr=0.05,
        alpha_every=5,
        device="cpu",
    )
    trained = train(tc)
    cfg = AttributeConfig(
        model="examples.text:make_model",
        train_data="examples.text:train_data",
        target_data="examples.text:target_data",
        task="text_classification",
        checkpoints=trained["manifest"],
        store=str(tmp / "store.zarr"),
        exp_name="text",
        proj_dim=64,
        lambda_reg="auto",
        dtype="float32",
        batch_size=300,
        shard_size=600,
        chunk_rows=300,
        device="cpu",
        top_k=3,
        report_targets=4,
        report_dir=str(tmp / "report"),
        show="examples.text:decode",
    )
    return tmp, trained, cfg, attribute(cfg)


def test_text_example_trains_with_the_train_flow(text_run):
    tmp, trained, cfg, _ = text_run
    assert trained["computed"] == 2
    for rec in trained["models"]:
        assert rec["train_accuracy"] > 0.85 and rec["alpha_mean"] is None  # α: single-input models only
    model = text.make_model()
    model.load_state_dict(torch.load(cfg.checkpoint_paths[0], weights_only=True))
    ids, types, mask, labels = text.target_data()
    with torch.no_grad():
        acc = (model(input_ids=ids, token_type_ids=types, attention_mask=mask).argmax(1) == labels).float().mean()
    assert acc >= 0.75


def test_text_report_lists_sentences_and_draws_them(text_run):
    tmp, _, cfg, res = text_run
    rep = res["report"]
    assert rep["text"] is True and len(rep["rows"]) == 4
    train, targets = text.train_data(), text.target_data()
    md = (tmp / "report" / "text_top_k.md").read_text()
    scores = np.asarray(__import__("trak_core").TrakStore.open(cfg.store, mode="r").scores("text")[:])
    for row in rep["rows"]:
        j = row["target"]
        assert (
            row["text"] == text.decode(targets[0][j])
            and f"### target {j} (label {int(targets[3][j])}): {row['text']}" in md
        )
        best = int(np.argmax(scores[:, j]))
        assert row["proponents"][0]["index"] == best
        assert row["proponents"][0]["text"] == text.decode(train[0][best]) and row["proponents"][0]["text"] in md
        worst = int(np.argmin(scores[:, j]))
        assert row["opponents"][0]["text"] == text.decode(train[0][worst])
    for j in range(4):
        assert (tmp / "report" / f"text_target_{j}.png").read_bytes().startswith(PNG)
    assert (tmp / "report" / "text_score_histogram.png").read_bytes().startswith(PNG)
    stats = rep["score_stats"]
    assert stats["count"] == text.NUM_TRAIN * text.NUM_TARGETS
    assert stats["max"] == pytest.approx(float(scores.max()), rel=1e-6)
    assert "% positive" in md


def test_text_report_artifacts(text_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def keys():
        async with get_client() as client:
            arts = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_="trakflow-")))
        return {a.key: a for a in arts}

    from tasks.common import store_identity

    p = f"trakflow-{store_identity(text_run[2].store)}-text"
    arts = asyncio.run(keys())
    assert {f"{p}-top-k", f"{p}-score-histogram", f"{p}-target-0"} <= set(arts)
    assert text.decode(text.target_data()[0][0]) in arts[f"{p}-top-k"].data


def test_show_prints_the_report_table_with_text(text_run):
    from typer.testing import CliRunner

    from trakflow_cli.main import app

    tmp, _, cfg, res = text_run
    path = tmp / "text.yaml"
    path.write_text(cfg.to_yaml())
    out = CliRunner().invoke(app, ["show", str(path), "--target", "1"], env={"COLUMNS": "250", "NO_COLOR": "1"})
    assert out.exit_code == 0, out.output
    row = res["report"]["rows"][1]
    flat = " ".join(out.output.split())
    assert f"target 1 (label {row['label']}): {row['text']}" in flat
    for key in ("proponents", "opponents"):
        e = row[key][0]
        assert f"#{e['index']} y={e['label']}" in flat and e["text"] in flat
    # the store alone: indices and scores, no text
    out = CliRunner().invoke(
        app, ["show", cfg.store, "--target", "1", "--top-k", "2"], env={"COLUMNS": "250", "NO_COLOR": "1"}
    )
    assert out.exit_code == 0, out.output and f"#{row['proponents'][0]['index']}" in out.output
    assert row["text"] not in " ".join(out.output.split())


def test_score_stats_and_histogram_on_known_scores():
    from tasks.report import score_histogram_png, score_stats

    scores = np.arange(-50, 50, dtype=np.float32).reshape(20, 5)
    st = score_stats(scores)
    assert st["count"] == 100 and st["min"] == -50 and st["max"] == 49
    assert st["median"] == pytest.approx(-0.5) and st["positive_fraction"] == pytest.approx(0.49)
    assert score_histogram_png(scores, "t").startswith(PNG)
    assert score_stats(np.full((2, 2), np.nan)) == {}


def test_text_png_wraps_long_sentences():
    from tasks.report import target_text_png

    row = {
        "target": 0,
        "label": 1,
        "text": "word " * 80,
        "proponents": [{"index": 3, "score": 1.5, "label": 1, "text": "good " * 50}],
        "opponents": [{"index": 4, "score": -2.0, "label": 0, "text": "bad"}],
    }
    short = target_text_png({**row, "text": "short"})
    long = target_text_png(row)
    assert short.startswith(PNG) and long.startswith(PNG)
    import io

    from matplotlib.image import imread

    assert imread(io.BytesIO(long)).shape[0] > imread(io.BytesIO(short)).shape[0]  # more lines, taller
