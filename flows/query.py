"""query: the top-k train examples of a batch of new inputs, from a finalized store (no score array written).

    from flows.query import query
    query({"store": "trakflow_demo/store.zarr", "inputs": "new.pt", "model": "trakflow_demo_data.digits:make_model"})

Reads the store only (no run lock: a run may hold the store meanwhile; see trak_core.scoring.index). Writes a table
artifact (one row per input and rank), where the inputs can be drawn (``show``) one image per input, and with
``explain`` (sequence models) a markdown artifact of each proponent's text with the tokens that carry its score
highlighted.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NONE

from tasks import report
from tasks.query import QueryConfig, run_query


def table_rows(rows: list[dict]) -> list[dict]:
    """One table row per input and rank: the proponent and the opponent at that rank."""
    out = []
    for r in rows:
        for rank in range(max(len(r["proponents"]), len(r["opponents"]))):
            row: dict = {"input": r["target"], "label": r["label"], "rank": rank + 1}
            for key, name in (("proponents", "proponent"), ("opponents", "opponent")):
                e = r[key][rank] if rank < len(r[key]) else None
                row[name] = None if e is None else e["index"]
                row[f"{name}_label"] = None if e is None else e["label"]
                row[f"{name}_score"] = None if e is None else round(e["score"], 6)
            out.append(row)
    return out


@task(name="answer-query", cache_policy=NONE, persist_result=False)
def answer_query(request: QueryConfig) -> dict:
    """The query's answer (tasks.query.run_query), and its artifacts."""
    out = run_query(request)
    key = report.store_artifact_key(out["store"], "query", Path(request.inputs).stem)
    create_table_artifact(
        table=table_rows(out["rows"]),
        key=key,
        description=f"top-{request.k} proponents / opponents of the inputs in {request.inputs}",
    )
    explained = report.explain_markdown(out["rows"])
    if explained:
        create_markdown_artifact(
            markdown=explained,
            key=f"{key}-tokens",
            description="which tokens of each proponent's train text carry its score",
        )
    for j, png in out["pngs"].items():
        create_markdown_artifact(
            markdown=report.image_markdown(png, f"input {j}"),
            key=f"{key}-input-{j}",
            description=f"input {j} and its top proponents / opponents",
        )
    return {k: v for k, v in out.items() if k != "pngs"}


@flow(name="query", validate_parameters=True)
def query(request: QueryConfig) -> dict:
    """Top-k proponents and opponents of each input in ``request.inputs`` (see tasks.query for the file
    format): the scores ``finalize_scores`` would give them, from one pass over the store."""
    out = answer_query(request)
    get_run_logger().info(
        "query: %d inputs against %s (checkpoints %s), top %d each end%s",
        len(out["rows"]),
        out["store"],
        out["model_ids"],
        request.k,
        f"; report: {out['files']}" if out["files"] else "",
    )
    return out
