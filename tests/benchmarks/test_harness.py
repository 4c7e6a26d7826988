"""`python -m benchmarks`: each case is declared once, names scripts that exist, and RESULTS.md quotes its commands in
the section whose tables it regenerates; every section with a table has its case; `run` runs with this interpreter."""

import importlib
import re
import subprocess
import sys

import pytest
from trak_fixtures import REPO_ROOT

BENCH = REPO_ROOT / "benchmarks"
RESULTS = (BENCH / "RESULTS.md").read_text()


@pytest.fixture(scope="module")
def harness():
    sys.path.insert(0, str(REPO_ROOT))
    try:
        return importlib.import_module("benchmarks.__main__")
    finally:
        sys.path.remove(str(REPO_ROOT))


def sections(text: str) -> dict[str, str]:
    """{'## ' heading: its text up to the next '## ' heading}."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def test_sections_splits_at_second_level_headings():
    got = sections("# T\n\n## A\n\nx\n### A.1\ny\n## B\nz\n")
    assert list(got) == ["A", "B"] and "### A.1" in got["A"] and "z" in got["B"]


def test_cases_are_declared_once_and_name_scripts_that_exist(harness):
    names = [c.name for c in harness.CASES]
    assert len(names) == len(set(names)) == len(harness.BY_NAME)
    for case in harness.CASES:
        scripts = re.findall(r"benchmarks/(\w+\.(?:py|sh))", " ".join(case.commands))
        assert scripts, case.name
        assert all((BENCH / s).is_file() for s in scripts), (case.name, scripts)


def test_every_script_serves_a_case(harness):
    """No orphan: each script is run by a case or by gpu_session.sh, or imported by a script that is."""
    named = {s for c in harness.CASES for s in re.findall(r"benchmarks/(\w+)\.py", " ".join(c.commands))}
    named |= set(re.findall(r"benchmarks/(\w+)\.py", (BENCH / "gpu_session.sh").read_text()))
    used = set(named)
    for name in named:
        text = (BENCH / f"{name}.py").read_text()
        used |= {p.stem for p in BENCH.glob("*.py") if re.search(rf"^\s*(import|from) {p.stem}\b", text, re.M)}
    assert {p.stem for p in BENCH.glob("*.py")} - used == {"__main__"}


def test_results_quote_each_case_in_its_section(harness):
    by_section = sections(RESULTS)
    for case in harness.CASES:
        assert case.section in by_section, f"RESULTS.md has no section '## {case.section}' ({case.name})"
        text = by_section[case.section]
        assert f"python -m benchmarks run {case.name}" in text, case.name
        for command in case.commands:
            assert command in text, f"{case.name}: RESULTS.md does not quote `{command}`"


def test_every_results_section_with_a_table_has_a_case(harness):
    covered = {c.section for c in harness.CASES}
    with_tables = {h for h, body in sections(RESULTS).items() if re.search(r"^\|.*\|\n\|[-|: ]+\|$", body, re.M)}
    assert with_tables and with_tables <= covered, with_tables - covered


def test_list_and_show_from_the_command_line():
    def run(*a):
        argv = [sys.executable, "-m", "benchmarks", *a]
        return subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout

    listed = run("list")
    assert "featurize" in listed and "sizes-cuda" in listed
    assert run("show", "memory").splitlines()[1:] == [
        "python benchmarks/memory_flat.py --sizes 50000 200000 --proj-dim 512",
        "MALLOC_MMAP_THRESHOLD_=1048576 python benchmarks/memory_flat.py --sizes 50000 200000 --proj-dim 512",
    ]
    bad = subprocess.run([sys.executable, "-m", "benchmarks", "run", "nope"], cwd=REPO_ROOT, capture_output=True)
    assert bad.returncode != 0


def test_run_uses_this_interpreter_in_the_repository_root(harness, tmp_path):
    out = tmp_path / "out.txt"
    probe = "import os, sys; print(sys.prefix, os.getcwd(), 'benchmarks' in os.listdir())"
    case = harness.Case("probe", "-", "-", "-", (f'X=1 python -c "{probe}" > {out}', "python3 -c 'exit(3)'", "true"))
    assert harness.run(case) == 3  # stops at the first command that fails
    prefix, cwd, found = out.read_text().split()
    assert prefix == sys.prefix and cwd == str(REPO_ROOT) and found == "True"


def test_results_tables_have_no_columns_relative_to_past_commits():
    """A table compares what one run measured; no 'before', 'vs <commit>' or '<commit> → now' column."""
    headers = [line for line in RESULTS.splitlines() if re.match(r"^\|.*\|$", line)]
    headers = [h for h, nxt in zip(headers, headers[1:], strict=False) if re.fullmatch(r"\|[-|: ]+\|", nxt)]
    assert len(headers) >= 10
    commit = r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"
    bad = [h for h in headers if re.search(rf"{commit}|\bbefore:|\bprevious\b|→ now", h.lower())]
    assert bad == []
    assert re.search(rf"{commit}|\bbefore:", "| model | before: warm s | 0e36a0d → now |")
