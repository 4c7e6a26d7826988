"""The README's drop-in example run twice in one folder, as a user reruns a script: the second run succeeds,
prints the same answer and changes no byte of the store (rows already featurized and models already finalized are
skipped, as traker skips them; the same targets again leave their solve and scores as they are)."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys

from trak_fixtures import REPO_ROOT


def _store_bytes(root) -> dict:
    out = {}
    for folder, _, files in os.walk(root):
        for f in files:
            if f != "trakflow.lock":
                full = os.path.join(folder, f)
                with open(full, "rb") as fh:
                    out[os.path.relpath(full, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def test_readme_snippet_reruns_in_the_same_folder_and_recomputes_nothing(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)
    (tmp_path / "snippet.py").write_text(next(b for b in blocks if "from trak_core import TRAKer" in b))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))

    def run() -> str:
        out = subprocess.run(
            [sys.executable, "snippet.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout

    first = run()
    before = _store_bytes(tmp_path / "trak_results")
    second = run()
    assert second == first
    assert _store_bytes(tmp_path / "trak_results") == before
