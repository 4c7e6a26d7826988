"""select: the train rows with the largest summed influence on a target set (data selection), from a finalized store.

    from flows.selection import select
    select({"store": "trakflow_demo/attribute.yaml", "inputs": "val.pt", "fraction": 0.1, "out_dir": "selected"})

Reads the store only (one pass over its rows, no score array written; see trak_core.scoring.selection) and writes the
selected indices, their scores and, where the train data is known, the selected rows to ``out_dir``
(tasks.selection). Its artifact is a table of the selected rows, best first.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NONE

from tasks import report
from tasks.selection import SelectConfig, run_select

#: rows of the selection shown in the artifact (all of them are in out_dir)
ARTIFACT_ROWS = 1000


@task(name="select-rows", cache_policy=NONE, persist_result=False)
def select_rows(request: SelectConfig) -> dict:
    """The selection (tasks.selection.run_select) and its table artifact."""
    out = run_select(request)
    which = "lowest" if request.opponents else "highest"
    create_table_artifact(
        table=out["rows"][:ARTIFACT_ROWS],
        key=report.store_artifact_key(out["store"], "select", Path(request.inputs).stem),
        description=f"the {out['k']} of {out['n']} train rows with the {which} summed influence on the "
        f"{out['num_targets']} targets in {request.inputs} (first {ARTIFACT_ROWS} shown; all in {request.out_dir})",
    )
    return out


@flow(name="select", validate_parameters=True)
def select(request: SelectConfig) -> dict:
    """Rank the train rows by their summed influence on the targets in ``request.inputs`` and keep the top
    ``fraction`` (or ``k``): indices, scores and the selected rows written to ``request.out_dir``."""
    out = select_rows(request)
    get_run_logger().info(
        "select: %d of %d train rows (%.3g) against %d targets in %s (checkpoints %s); wrote %s",
        out["k"],
        out["n"],
        out["fraction"],
        out["num_targets"],
        out["store"],
        out["model_ids"],
        request.out_dir,
    )
    return out
