"""What a user waits for when there is nothing to compute: the `trakflow` CLI's fixed overhead.

Measures, on a small complete store (examples.tiny, 2 checkpoints), the wall time of
  * `trakflow run cfg.yaml` on the complete store (a no-op run), with no server (Prefect's ephemeral
    one) and with a running local `prefect server start` (PREFECT_API_URL set),
  * `trakflow run typo.yaml` (a misspelt field: the error should come before any heavy import),
  * `trakflow show STORE`.
Each is a fresh process (what a user pays), median of --repeats. `--repo` points at another checkout (e.g. a
`git worktree` of an older commit) to measure it with this venv for a before/after table.

    .venv/bin/python benchmarks/cli_overhead.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE / "tests"))


def timed(cmd: list[str], env: dict, cwd: Path, repeats: int, ok_codes=(0,)) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
        times.append(time.perf_counter() - t0)
        if res.returncode not in ok_codes:
            raise SystemExit(f"{' '.join(cmd)} exited {res.returncode}:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--repo", type=Path, default=HERE, help="checkout to measure (default: this one)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    repo = args.repo.resolve()
    trakflow = [sys.executable, "-c", "import sys; from trakflow_cli.main import app; sys.exit(app())"]
    from services import prefect_env, prefect_server  # tests/services.py: a real server on a free port
    from trak_fixtures import tiny_attribute_config  # tests/trak_fixtures.py: the flow tests' config

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        env = prefect_env(tmp / "home")
        env["PYTHONPATH"] = f"{repo}{os.pathsep}{repo / 'tests'}"
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from examples import tiny; tiny.save_checkpoints(sys.argv[1], seeds=(0, 1))",
                str(tmp / "ck"),
            ],
            env=env,
            cwd=repo,
            check=True,
        )
        cfg = tiny_attribute_config(tmp / "store.zarr", str(tmp / "ck" / "model_*.pt"))
        (tmp / "cfg.yaml").write_text(json.dumps(cfg))
        (tmp / "typo.yaml").write_text(json.dumps({**cfg, "projdim": 16}))
        timed(trakflow + ["run", str(tmp / "cfg.yaml")], env, repo, 1)  # fill the store
        rows = {
            "no-op run, no server": timed(trakflow + ["run", str(tmp / "cfg.yaml")], env, repo, args.repeats),
            "config typo": timed(trakflow + ["run", str(tmp / "typo.yaml")], env, repo, args.repeats, (1, 2)),
            "show": timed(trakflow + ["show", str(tmp / "store.zarr")], env, repo, args.repeats),
        }
        with prefect_server(tmp / "server") as server:
            senv = {**env, "PREFECT_API_URL": server.api_url}
            rows["no-op run, running server"] = timed(
                trakflow + ["run", str(tmp / "cfg.yaml")], senv, repo, args.repeats
            )
    out = {
        "repo": str(repo),
        "repeats": args.repeats,
        "load": os.getloadavg()[0],
        "seconds": {k: round(v, 2) for k, v in rows.items()},
    }
    print(f"| case | seconds (median of {args.repeats}) |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.2f} |")
    print(f"(1-min load average at the end: {out['load']:.2f}; {repo})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
