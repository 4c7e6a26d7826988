"""Register trakflow's flows as deployments and serve them (no work pool needed)::

    prefect server start                       # terminal 1: local server + UI on http://127.0.0.1:4200
    export PREFECT_API_URL=http://127.0.0.1:4200/api
    python -m deployments.serve                # terminal 2 (or `trakflow serve`), from the repo root

Deployments (``flow/deployment``):

* ``digits-demo/nightly``   the embedded default end to end, on a cron schedule (03:00 UTC daily), over the
                            train files of ``<demo_dir>/train`` (``trakflow_demo_data.folder_data``; seeded with the
                            digits train set): files added there since are appended to the store, and the run
                            featurizes only their rows, solves each checkpoint again and refreshes the report;
* ``attribute/digits``      the attribute flow, its config pre-filled with the digits demo (UI form);
* ``train/digits``          the train flow for the digits checkpoints;
* ``query/digits``          top-k train digits of new inputs against the demo's store (UI form: the inputs file
                            and k). The demo writes ``<demo_dir>/query.pt`` (its held-out targets), so a run works
                            right after ``trakflow demo``; ``trakflow trigger query/digits --inputs FILE`` asks
                            about another file;
* ``select/digits``         data selection: the train digits with the largest summed influence on the inputs of that
                            file (UI form: the file, the fraction kept, the output folder).

Trigger one from the UI (Deployments → Run), the CLI (``prefect deployment run 'attribute/digits'`` or
``trakflow trigger attribute/digits``) or Python (``prefect.deployments.run_deployment("attribute/digits")``).
Relative paths in the parameters resolve against the serving process's working directory; set
TRAKFLOW_DEMO_DIR to put the demo elsewhere. A run's tasks run on the runner its ``config`` asks for
(``task_runner``, ``max_workers``, ``gpus``, ...: the flows' ``ConfigTaskRunner``), so the run form sets it.
"""

from __future__ import annotations

import os

NIGHTLY_CRON = "0 3 * * *"


def build_deployments(demo_dir: str | None = None) -> list:
    from prefect.types.entrypoint import EntrypointType

    from flows import attribute, digits_demo, train
    from flows.query import query
    from flows.selection import select
    from trakflow_demo_data.digits import demo_configs

    demo_dir = demo_dir or os.environ.get("TRAKFLOW_DEMO_DIR", "trakflow_demo")
    train_cfg, attr = demo_configs(demo_dir)
    common = dict(tags=["trakflow"], entrypoint_type=EntrypointType.MODULE_PATH)  # flows.x.y: no file loading
    return [
        digits_demo.to_deployment(
            name="nightly",
            cron=NIGHTLY_CRON,
            parameters={"demo_dir": demo_dir, "train_folder": True},
            description="digits demo end to end: train checkpoints if absent, attribute the train files of "
            "<demo_dir>/train (new files are appended: only their rows are featurized)",
            **common,
        ),
        attribute.to_deployment(
            name="digits",
            parameters={"config": attr},
            description="TRAK attribution (config pre-filled with the digits demo)",
            **common,
        ),
        train.to_deployment(
            name="digits",
            parameters={"config": train_cfg.model_dump(mode="json")},
            description="train the digits checkpoints (skips complete ones)",
            **common,
        ),
        query.to_deployment(
            name="digits",
            parameters={"request": query_request(attr)},
            description="top-k train digits (proponents / opponents) of the inputs in a .pt/.npz file",
            **common,
        ),
        select.to_deployment(
            name="digits",
            parameters={"request": select_request(attr)},
            description="data selection: the train digits with the largest summed influence on the inputs of a file",
            **common,
        ),
    ]


def query_request(attr: dict) -> dict:
    """The query form pre-filled for a demo store (``attr``: its attribute config as a dict)."""
    return {
        "store": attr["store"],
        "inputs": os.path.join(os.path.dirname(attr["store"]), "query.pt"),
        "k": 5,
        "model": attr["model"],
        "train_data": None,  # the store's recorded train data (after a nightly append, the train folder)
        "show": attr.get("show"),
        "report_dir": attr.get("report_dir"),
    }


def select_request(attr: dict) -> dict:
    """The select form pre-filled for a demo store: the query's inputs file as the targets, 10 % kept."""
    folder = os.path.dirname(attr["store"])
    return {
        "store": attr["store"],
        "inputs": os.path.join(folder, "query.pt"),
        "fraction": 0.1,
        "out_dir": os.path.join(folder, "selection"),
        "model": attr["model"],
        "train_data": attr["train_data"],
    }


def main() -> None:
    from prefect import serve

    serve(*build_deployments())


if __name__ == "__main__":
    main()
