"""Docs that cannot drift: the config reference is generated from the pydantic models, the YAML example in
docs/pipeline.md is examples/digits.yaml, and deployments/prefect.yaml deploys the demo's configs."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tasks import config_docs
from tasks.config import AttributeConfig, TrainConfig

REPO = Path(__file__).resolve().parent.parent


def test_config_reference_is_current():
    """Fails when a config field, type, default or description changed without `python -m tasks.config_docs`."""
    assert config_docs.main(["--check"]) == 0
    doc = (REPO / "docs" / "pipeline.md").read_text()
    for name in AttributeConfig.model_fields:
        assert f"| `{name}` |" in doc


def test_stale_reference_is_detected(tmp_path, monkeypatch):
    stale = tmp_path / "pipeline.md"
    stale.write_text((REPO / "docs" / "pipeline.md").read_text().replace("| `proj_dim` |", "| `projdim` |"))
    monkeypatch.setattr(config_docs, "DOC", stale)
    assert config_docs.main(["--check"]) == 1


def test_yaml_example_is_the_digits_config():
    doc = (REPO / "docs" / "pipeline.md").read_text()
    block = re.search(r"```yaml\n(model: examples\.digits.*?)```", doc, re.S).group(1)
    assert yaml.safe_load(block) == yaml.safe_load((REPO / "examples" / "digits.yaml").read_text())


def test_prefect_yaml_deploys_the_demo_configs(monkeypatch):
    """The work-pool route (prefect.yaml) and the serve route (deployments/serve.py) run the same configs."""
    from deployments.serve import NIGHTLY_CRON
    from examples.digits import demo_configs

    monkeypatch.chdir(REPO)
    train, attr = demo_configs("trakflow_demo")
    here = str(Path("trakflow_demo").absolute())

    def rel(d: dict) -> dict:
        return {k: v.replace(here, "trakflow_demo") if isinstance(v, str) else v for k, v in d.items()}

    deps = {
        (d["entrypoint"], d["name"]): d
        for d in yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())["deployments"]
    }
    assert set(deps) == {
        ("flows/demo.py:digits_demo", "nightly"),
        ("flows/attribute.py:attribute", "digits"),
        ("flows/train.py:train", "digits"),
        ("flows/query.py:query", "digits"),
    }

    def full(cls, d: dict) -> dict:  # every field, defaults filled in (validation would need the checkpoints)
        return {k: d.get(k, f.get_default(call_default_factory=True)) for k, f in cls.model_fields.items()}

    got = deps[("flows/attribute.py:attribute", "digits")]["parameters"]["config"]
    assert full(AttributeConfig, got) == full(AttributeConfig, rel(attr))
    got = deps[("flows/train.py:train", "digits")]["parameters"]["config"]
    assert full(TrainConfig, got) == full(TrainConfig, rel(train.model_dump(mode="json", exclude_unset=True)))
    assert deps[("flows/demo.py:digits_demo", "nightly")]["schedules"][0]["cron"] == NIGHTLY_CRON
    from deployments.serve import query_request

    assert deps[("flows/query.py:query", "digits")]["parameters"]["request"] == rel(query_request(attr))


def test_cli_reference_is_current():
    """Fails when a command or option changed without `python -m trakflow_cli.reference`."""
    from trakflow_cli import reference

    assert reference.main(["--check"]) == 0
    doc = (REPO / "docs" / "pipeline.md").read_text()
    for name in ("demo", "run", "train", "evaluate", "show", "verify", "unlock", "serve", "trigger"):
        assert f"`trakflow {name}" in doc
