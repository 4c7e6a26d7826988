"""The query/digits deployment works right after the demo: the demo writes the inputs file its request names
(``<demo_dir>/query.pt``, the held-out targets), and a run of that request answers from the demo's store."""

from __future__ import annotations

import pytest
import torch

from examples import digits


@pytest.mark.usefixtures("prefect_harness")
def test_query_deployment_answers_right_after_the_demo(tmp_path, monkeypatch):
    from deployments.serve import build_deployments
    from flows import digits_demo
    from flows.query import query

    monkeypatch.delenv("TRAKFLOW_TRAIN_DIR", raising=False)
    demo = tmp_path / "demo"
    digits_demo(demo_dir=str(demo), num_models=1, epochs=1, proj_dim=64, lambda_reg=1.0)
    request = next(d for d in build_deployments(str(demo)) if d.flow_name == "query").parameters["request"]
    assert request["inputs"] == str(demo.absolute() / "query.pt")
    x, y = torch.load(request["inputs"], weights_only=True)
    want = digits.target_data()
    assert torch.equal(x, want[0]) and torch.equal(y, want[1])
    out = query(request)  # the deployment's request as it stands
    assert [r["label"] for r in out["rows"]] == want[1].tolist()
    assert all(len(r["proponents"]) == request["k"] for r in out["rows"])
    (demo / "query.pt").write_bytes(b"mine")  # a file put there by hand is kept on the next run
    digits.write_query_inputs(demo)
    assert (demo / "query.pt").read_bytes() == b"mine"
