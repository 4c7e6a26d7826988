"""Docs that cannot drift: the generated references are current, the README's snippet runs, every command and
link in the docs exists, the stated defaults are the code's, RESULTS.md gives each table its command, and the
README and RESULTS.md stay short and free of issue numbers."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest
import yaml

from tasks import config_docs
from tasks.config import AttributeConfig, TrainConfig

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
RESULTS = REPO / "benchmarks" / "RESULTS.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
ALL_DOCS = [README, RESULTS, *DOCS]


def _rel(p: Path) -> str:
    return str(p.relative_to(REPO))


# ----------------------------------------------------------------------------------------- generated references
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
    block = re.search(r"```yaml\n(model: trakflow_demo_data\.digits.*?)```", doc, re.S).group(1)
    assert yaml.safe_load(block) == yaml.safe_load((REPO / "examples" / "digits.yaml").read_text())


def test_prefect_yaml_deploys_the_demo_configs(monkeypatch):
    """The work-pool route (prefect.yaml) and the serve route (deployments/serve.py) run the same configs."""
    from deployments.serve import NIGHTLY_CRON
    from trakflow_demo_data.digits import demo_configs

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
        ("flows/selection.py:select", "digits"),
    }

    def full(cls, d: dict) -> dict:  # every field, defaults filled in (validation would need the checkpoints)
        return {k: d.get(k, f.get_default(call_default_factory=True)) for k, f in cls.model_fields.items()}

    got = deps[("flows/attribute.py:attribute", "digits")]["parameters"]["config"]
    assert full(AttributeConfig, got) == full(AttributeConfig, rel(attr))
    got = deps[("flows/train.py:train", "digits")]["parameters"]["config"]
    assert full(TrainConfig, got) == full(TrainConfig, rel(train.model_dump(mode="json", exclude_unset=True)))
    assert deps[("flows/demo.py:digits_demo", "nightly")]["schedules"][0]["cron"] == NIGHTLY_CRON
    # the README names the schedule the code serves
    assert f"`{NIGHTLY_CRON}`" in README.read_text()
    from deployments.serve import query_request, select_request

    assert deps[("flows/query.py:query", "digits")]["parameters"]["request"] == rel(query_request(attr))
    assert deps[("flows/selection.py:select", "digits")]["parameters"]["request"] == rel(select_request(attr))


def test_cli_reference_is_current():
    """Fails when a command or option changed without `python -m trakflow_cli.reference`."""
    from trakflow_cli import reference

    assert reference.main(["--check"]) == 0
    doc = (REPO / "docs" / "pipeline.md").read_text()
    for name in ("demo", "run", "train", "evaluate", "show", "verify", "unlock", "serve", "trigger"):
        assert f"`trakflow {name}" in doc


def test_cli_page_lists_every_command():
    """docs/cli.md's table names every command of the CLI, and the page gives the inputs-file format."""
    import typer.main

    from trakflow_cli.main import app

    doc = (REPO / "docs" / "cli.md").read_text()
    for name in typer.main.get_command(app).commands:  # type: ignore[attr-defined]
        assert f"| `trakflow {name}" in doc, f"docs/cli.md's table lacks `trakflow {name}`"
    assert "## Inputs files" in doc and "np.savez" in doc and "torch.save" in doc


# ------------------------------------------------------------------------------------------------ size and form
def test_readme_and_results_are_short():
    assert len(README.read_text().splitlines()) <= 300
    assert len(RESULTS.read_text().splitlines()) <= 500


ISSUE_REF = re.compile(r"[Ii]ssues? ?#?[0-9]|(?<![\w&/])#[0-9]{1,4}\b")


def issue_refs(text: str) -> list[str]:
    """Lines that cite an issue number ('issue 14', 'issues 2 and 15', '(#15)')."""
    return [line.strip() for line in text.splitlines() if ISSUE_REF.search(line)]


def test_issue_reference_check_finds_them():
    assert issue_refs("fixed in issue 14\nsee (#15)\nissues 2 and 15")
    assert len(issue_refs("fixed in issue 14\nsee (#15)\nissues 2 and 15")) == 3
    assert not issue_refs("a [link](docs/store.md#the-lock), `&#8203;`, a path a/#1, rank 2")


@pytest.mark.parametrize("path", ALL_DOCS, ids=_rel)
def test_no_issue_numbers(path):
    assert issue_refs(path.read_text()) == []


COMMAND = re.compile(
    r"(\.venv/bin/python|python3?)\s+(-m\s+pytest|benchmarks/\w+\.py)|\bbash\s+benchmarks/\w+\.sh\b"
    r"|\btrakflow\s+(run|evaluate|demo)\b"
)


def tables_without_command(text: str) -> list[str]:
    """The first row of every markdown table whose section (from the `#`/`##` heading before it to the next one)
    names no command that regenerates it: a benchmarks/ script, pytest, or a trakflow run."""
    lines = text.splitlines()
    fence = [line.startswith("```") for line in lines]
    inside = [sum(fence[: i + 1]) % 2 == 1 or fence[i] for i in range(len(lines))]
    heads = [i for i, line in enumerate(lines) if line.startswith(("# ", "## ")) and not inside[i]]
    in_code, missing, i = False, [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            in_code = not in_code
        if not in_code and lines[i].lstrip().startswith("|") and i + 1 < len(lines) and "---" in lines[i + 1]:
            start = max([h for h in heads if h < i], default=0)
            end = min([h for h in heads if h > i], default=len(lines))
            if not COMMAND.search("\n".join(lines[start:end])):
                missing.append(lines[i].strip())
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                i += 1
            continue
        i += 1
    return missing


def test_table_command_check_finds_a_table_without_one():
    ok = "## A\n\n`.venv/bin/python benchmarks/x.py`\n\n### A.1\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    bad = "## B\n\n```bash\n# not a heading\n```\n\nmeasured once\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    assert tables_without_command(ok) == []
    assert tables_without_command(ok + bad) == ["| a | b |"]


def test_every_results_table_has_its_command():
    assert tables_without_command(RESULTS.read_text()) == []


# ------------------------------------------------------------------------------------ what the docs say is true
def test_readme_snippet_runs(tmp_path, monkeypatch):
    """The README's drop-in example, run as it is, gives (n_train, n_targets) scores."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    snippet = next(b for b in blocks if "from trak_core import TRAKer" in b)
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(snippet.replace("print(", "(lambda *a: None)("), "README.md", "exec"), ns)
    assert ns["scores"].shape == (len(ns["x_train"]), len(ns["x_test"]))
    assert (tmp_path / "trak_results").is_dir()


def _commands() -> dict[str, set[str]]:
    import typer.main

    from trakflow_cli.main import app

    group = typer.main.get_command(app)
    return {
        name: {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
        for name, cmd in group.commands.items()  # type: ignore[attr-defined]
    }


def _code_lines(text: str):
    """Lines of fenced code blocks and inline code spans."""
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        yield from block.splitlines()
    yield from re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))


def cli_mistakes(text: str, commands: dict[str, set[str]]) -> list[str]:
    """`trakflow NAME --option` in code that names a command or an option the CLI does not have."""
    bad = []
    for line in _code_lines(text):
        for m in re.finditer(r"(?<![\w/-])trakflow ([a-z][a-z_-]*)([^#|;&`]*)", line):
            name, rest = m.group(1), m.group(2)
            if name not in commands:
                bad.append(f"trakflow {name}")
                continue
            opts = re.findall(r"(?<!\S)(--?[a-z][\w-]*)", rest)
            bad += [f"trakflow {name} {o}" for o in opts if o not in commands[name]]
    return bad


def test_cli_check_finds_a_wrong_command():
    cmds = _commands()
    assert cli_mistakes("`trakflow run x.yaml --always-run`", cmds) == []
    text = "`trakflow launch x.yaml`\n```bash\ntrakflow show S --tagret 1\n```"
    assert sorted(cli_mistakes(text, cmds)) == ["trakflow launch", "trakflow show --tagret"]


@pytest.mark.parametrize("path", ALL_DOCS, ids=_rel)
def test_cli_commands_in_docs_exist(path):
    assert cli_mistakes(path.read_text(), _commands()) == []


def test_readme_lists_every_command():
    text = README.read_text()
    for name in _commands():
        assert f"`{name}`" in text or f"trakflow {name}" in text, name


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    s = heading.strip().lower()
    s = "".join(c for c in s if c in " -_" or unicodedata.category(c)[0] in "LN")
    return s.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.*)$", text, re.M)}


def broken_links(path: Path) -> list[str]:
    """Relative links of a markdown file whose file is missing, or whose #anchor is no heading there."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(target)
    return bad


def test_link_check_finds_a_broken_link(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text("# Top part\n\n[ok](#top-part) [gone](b.md) [anchor](a.md#nowhere)\n")
    assert broken_links(doc) == ["b.md", "a.md#nowhere"]


@pytest.mark.parametrize("path", ALL_DOCS, ids=_rel)
def test_links_resolve(path):
    assert broken_links(path) == []


def test_every_docs_page_is_linked_from_the_readme():
    text = README.read_text()
    for page in DOCS:
        assert f"(docs/{page.name})" in text, page.name


ADAPTIVE_CLAIM = re.compile(
    r"adaptive`?\)?\s*(?:=|means|is)\s*[`\"]?((?:deff|neff):[0-9.]+,[cu]?resid:[0-9.]+(?:/[0-9.]*[0-9])?)"
)


def test_adaptive_claim_check_finds_a_stale_one():
    assert ADAPTIVE_CLAIM.findall("it says `adaptive` is `deff:0.1,resid:3`") == ["deff:0.1,resid:3"]
    assert ADAPTIVE_CLAIM.findall("`adaptive` = `neff:0.12,cresid:10` and deff:0.1,resid:3 before") == [
        "neff:0.12,cresid:10"
    ]
    assert ADAPTIVE_CLAIM.findall("`adaptive` = `neff:0.12,uresid:10/0.3`.") == ["neff:0.12,uresid:10/0.3"]


def test_stated_defaults_are_the_codes():
    """What the docs call `adaptive`, the floor β of `ggn` and `auto` are the values in trak_core.solve.damping."""
    from trak_core.settings import TrakSettings
    from trak_core.solve.damping import ADAPTIVE, AUTO_DAMPING, GGN_FLOOR

    assert TrakSettings.model_fields["lambda_reg"].default == "adaptive"
    damping = (REPO / "docs" / "damping.md").read_text()
    assert f"| `adaptive` (the default; also the bare `deff`) | `{ADAPTIVE}` |" in damping
    assert f"## `adaptive` = `{ADAPTIVE}`" in damping
    assert f"β = {GGN_FLOOR:g}" in damping
    assert f"| `auto` | `rel:{AUTO_DAMPING:g}` |" in damping
    claims = {(_rel(p), rule) for p in ALL_DOCS for rule in ADAPTIVE_CLAIM.findall(p.read_text())}
    assert claims and {rule for _, rule in claims} == {ADAPTIVE}, claims
