"""The trakflow command line (typer CliRunner, in process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from trak_fixtures import REPO_ROOT, tiny_attribute_config
from typer.testing import CliRunner

from examples import tiny
from trak_core import TRAKer
from trakflow_cli.main import app

REPO = REPO_ROOT

runner = CliRunner()
ENV = {"COLUMNS": "200", "NO_COLOR": "1"}


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], env=ENV)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A finished store made with trak_core.TRAKer (no Prefect involved)."""
    tmp = tmp_path_factory.mktemp("cli")
    x, y = tiny.train_data()
    xt, yt = tiny.target_data()
    loc = str(tmp / "store.zarr")
    tr = TRAKer(
        tiny.make_model(),
        "image_classification",
        tiny.NUM_TRAIN,
        save_dir=loc,
        device="cpu",
        proj_dim=16,
        lambda_reg=1e-3,
        chunk_rows=8,
        shard_rows=16,
    )
    sds = []
    for mid in range(2):
        torch.manual_seed(mid)
        sds.append(tiny.make_model().state_dict())
        tr.load_checkpoint(sds[-1], mid)
        tr.featurize((x, y), inds=np.arange(tiny.NUM_TRAIN))
    tr.finalize_features()
    for mid, sd in enumerate(sds):
        tr.start_scoring_checkpoint("tiny", sd, mid, tiny.NUM_TARGETS)
        tr.score((xt, yt), inds=np.arange(tiny.NUM_TARGETS))
    scores = tr.finalize_scores("tiny")
    return loc, np.asarray(scores)


def test_help_lists_commands():
    res = invoke("--help")
    assert res.exit_code == 0
    for cmd in ("demo", "run", "train", "show", "serve", "trigger"):
        assert cmd in res.output


def test_show_status(store):
    loc, _ = store
    res = invoke("show", loc)
    assert res.exit_code == 0, res.output
    out = res.output
    assert "64 train rows" in out and "proj_dim 16" in out
    assert re.search(r"│ 0\s+│ 64/64\s+│ 4/4\s+│ yes", out), out
    assert re.search(r"│ 1\s+│ 64/64\s+│ 4/4\s+│ yes", out), out
    assert re.search(r"│ tiny\s+│ 8\s+│ 2/2 checkpoints\s+│ 64/64\s+│ \[0, 1\]", out), out


def test_show_names_the_curvature(store, tmp_path):
    loc, _ = store
    assert "curvature" not in invoke("show", loc).output  # traker's XᵀX: nothing to say
    from trak_core.store import TrakStore

    meta = TrakStore.open(loc, mode="r").meta.model_copy(update={"curvature": "ggn"})
    TrakStore.create_or_open(str(tmp_path / "g.zarr"), meta)
    res = invoke("show", tmp_path / "g.zarr")
    assert res.exit_code == 0, res.output
    assert "curvature XᵀRX (ggn)" in res.output


def test_show_top_k(store):
    loc, scores = store
    res = invoke("show", loc, "--target", 3, "--top-k", 4)
    assert res.exit_code == 0, res.output
    rows = re.findall(r"│\s+(\d)\s+│\s+#(\d+)\s+│\s+([-+][\d.e+-]+)\s+│\s+#(\d+)\s+│", res.output)
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4]
    assert [int(r[1]) for r in rows] == list(np.argsort(-scores[:, 3], kind="stable")[:4])
    assert [int(r[3]) for r in rows] == list(np.argsort(scores[:, 3], kind="stable")[:4])
    assert float(rows[0][2]) == pytest.approx(scores[:, 3].max(), rel=1e-3)


def test_show_errors(store, tmp_path):
    loc, _ = store
    res = invoke("show", tmp_path / "nothing.zarr")
    assert res.exit_code == 2 and "no trakflow store" in res.output
    res = invoke("show", loc, "--target", 99)
    assert res.exit_code == 2 and "out of range" in res.output
    res = invoke("show", loc, "--target", 0, "--exp", "nope")
    assert res.exit_code == 2 and "nope" in res.output


def _write_config(tmp_path: Path, **over) -> Path:
    paths = tiny.save_checkpoints(tmp_path / "ck", seeds=(0, 1))
    cfg = tiny_attribute_config(
        tmp_path / "store.zarr", paths, **{"exp_name": "default", "top_k": 3, "report_targets": 2, **over}
    )
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize(
    "over,field",
    [
        (dict(proj_dim=0), "proj_dim"),
        (dict(model="examples.tiny:nope"), "model"),
        (dict(checkpoints=["/nonexistent/model.pt"]), "checkpoints"),
    ],
)
def test_run_bad_config_fails_before_compute(tmp_path, over, field):
    path = _write_config(tmp_path, **over)
    res = invoke("run", path)
    assert res.exit_code == 2
    assert field in res.output and "invalid config" in res.output
    assert not os.path.exists(tmp_path / "store.zarr")


def test_run_missing_config_file(tmp_path):
    res = invoke("run", tmp_path / "none.yaml")
    assert res.exit_code == 2 and "does not exist" in res.output


@pytest.mark.usefixtures("prefect_harness")
def test_run_attribute(tmp_path):
    path = _write_config(tmp_path)
    res = invoke("run", path)
    assert res.exit_code == 0, res.output
    assert "featurize 8 computed / 0 skipped" in res.output
    assert "fraction of top-3 proponents sharing the target's label" in res.output
    again = invoke("run", path)  # complete store: answered without starting a flow
    assert again.exit_code == 0 and "complete" in again.output and "nothing to run" in again.output
    forced = invoke("run", path, "--always-run")
    assert forced.exit_code == 0 and "featurize 0 computed / 8 skipped" in forced.output
    shown = invoke("show", tmp_path / "store.zarr", "--target", 0)
    assert shown.exit_code == 0 and "experiment default" in shown.output

    # a fresh process, as a user runs it: the no-op run, a typo and show never import Prefect
    typo = tmp_path / "typo.yaml"
    typo.write_text(Path(path).read_text() + "projdim: 3\n")
    code = (
        "import sys\nfrom trakflow_cli.main import app\ntry:\n    app(sys.argv[1:])\n"
        "except SystemExit as e:\n    print('EXIT', e.code, 'prefect' in sys.modules)\n"
    )
    for args, want in (([str(path)], "nothing to run"), ([str(typo)], "projdim")):
        res = subprocess.run([sys.executable, "-c", code, "run", *args], capture_output=True, text=True, cwd=REPO)
        assert want in res.stdout + res.stderr, res.stdout + res.stderr
        assert res.stdout.strip().splitlines()[-1] in ("EXIT 0 False", "EXIT 2 False"), res.stdout
    res = subprocess.run(
        [sys.executable, "-c", code, "show", str(tmp_path / "store.zarr")], capture_output=True, text=True, cwd=REPO
    )
    assert res.stdout.strip().splitlines()[-1] == "EXIT 0 False", res.stdout + res.stderr


@pytest.mark.usefixtures("prefect_harness")
def test_demo_small(tmp_path):
    """`trakflow demo` end to end, shrunk (1 checkpoint, 1 epoch, proj_dim 64) to stay fast."""
    demo = tmp_path / "demo"
    res = invoke("demo", "--dir", demo, "--models", 1, "--epochs", 1, "--proj-dim", 64)
    assert res.exit_code == 0, res.output
    assert "training 1 checkpoints" in res.output
    m = re.search(r"fraction of top-5 proponents sharing the target's label: ([\d.]+)", res.output)
    assert m and 0.0 <= float(m.group(1)) <= 1.0
    assert (demo / "checkpoints" / "manifest.json").is_file()
    assert (demo / "report" / "digits_top_k.md").is_file()
    assert len(list((demo / "report").glob("digits_target_*.png"))) == 5
    assert (demo / "attribute.yaml").is_file()
    again = invoke("demo", "--dir", demo, "--models", 1, "--epochs", 1, "--proj-dim", 64)
    assert again.exit_code == 0 and "not retraining" in again.output and "featurize 0 computed" in again.output
