"""Token highlights of an explained query where users see them: ``trakflow query ... --explain`` (a rich text line
per proponent, the strongest token bold), the query report's markdown (run_query with report_dir) and the query
flow's markdown artifact; a query of a non-sequence store with --explain fails in one line."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

transformers = pytest.importorskip("transformers")

from tasks import report  # noqa: E402
from tasks.query import QueryConfig, run_query  # noqa: E402
from trak_core import TRAKer  # noqa: E402
from trak_core.featurize.lm import causal_lm_batch  # noqa: E402

VOCAB, PAD, T, N = 24, 0, 8, 12
ALPHABET = "abcdefghijklmnopqrstuvwxyz"
transformers.logging.set_verbosity_error()


def make_model():
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=8, n_layer=1, n_head=2, bos_token_id=1, eos_token_id=1, pad_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def _rows(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, T + 1, (n,), generator=g).tolist()
    return causal_lm_batch([torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in lengths], T, PAD)


def train_rows():
    return _rows(N, 1)


def target_rows():
    return _rows(2, 2)


def decode(row) -> str:
    """Token ids as letters (id 1 → 'a', ...; padding and nothing else → '')."""
    return "".join(ALPHABET[int(i) - 1] for i in np.asarray(row).reshape(-1) if int(i) >= 1)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("explainq")
    model = make_model()
    torch.save(model.state_dict(), d / "model_0.pt")
    tr = TRAKer(
        model=model,
        task="causal_lm",
        train_set_size=N,
        save_dir=str(d / "s.zarr"),
        device="cpu",
        proj_dim=16,
        use_half_precision=False,
        lambda_reg=1e-2,
        logging_level=logging.ERROR,
    )
    tr.load_checkpoint(model.state_dict(), model_id=0)
    tr.featurize(train_rows(), num_samples=N)
    tr.finalize_features()
    torch.save(target_rows(), d / "new.pt")
    return d


def request(d, **kw) -> QueryConfig:
    base = dict(
        store=str(d / "s.zarr"),
        inputs=str(d / "new.pt"),
        k=3,
        model="test_explain_query:make_model",
        checkpoints=[str(d / "model_0.pt")],
        task="causal_lm",
        train_data="test_explain_query:train_rows",
        explain=True,
    )
    return QueryConfig(**{**base, **kw})


def test_report_highlights_the_strongest_token(store, tmp_path):
    out = run_query(request(store, show="test_explain_query:decode", report_dir=str(tmp_path)))
    md = (tmp_path / "new_query.md").read_text()
    assert md == out["markdown"]
    train = train_rows()
    for r in out["rows"]:
        assert f"### input {r['target']}: which tokens carry each proponent's score" in md
        for e in r["proponents"]:
            toks = e["tokens"]
            real = int(train[1][e["index"]].sum())
            assert len(toks) == real  # padding left out
            assert abs(sum(t["share"] for t in toks) - e["score"]) <= 1e-3 * abs(e["score"]) + 1e-6
            best = max(toks, key=lambda t: t["share"])
            assert best["text"] == ALPHABET[int(train[0][e["index"]][best["position"]]) - 1]
            line = next(ln for ln in md.splitlines() if ln.split(" ", 1)[-1].startswith(f"#{e['index']} (score"))
            # the strongest token is the one bold span, and named after the text
            assert line.count(">**") == 1 and f">**{best['text']}**</span>" in line
            assert f"*strongest:* **{best['text']}** at position {best['position']}" in line


def test_cli_explain_prints_highlighted_tokens(store):
    from trakflow_cli.main import app

    args = [
        "query",
        str(store / "s.zarr"),
        "--inputs",
        str(store / "new.pt"),
        "--k",
        "2",
        "--model",
        "test_explain_query:make_model",
        "--checkpoint",
        str(store / "model_0.pt"),
        "--task",
        "causal_lm",
        "--train-data",
        "test_explain_query:train_rows",
        "--explain",
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    out = run_query(request(store, k=2))
    for r in out["rows"]:
        for rank, e in enumerate(r["proponents"], start=1):
            best = max(e["tokens"], key=lambda t: t["share"])
            assert f"{rank}. #{e['index']} ({e['score']:+.4g}): " in res.output
            assert f"strongest: {best['text']!r} at position {best['position']}" in res.output


def test_rich_text_styles_the_strongest_token():
    from trakflow_cli.query import token_text

    tokens = [
        {"position": 0, "text": "a", "share": 0.01},
        {"position": 1, "text": "b", "share": 0.9},
        {"position": 2, "text": "c", "share": -0.5},
        {"position": 3, "text": "d", "share": 0.3},
    ]
    text = token_text(tokens)
    styles = {text.plain[s.start : s.end]: str(s.style) for s in text.spans}
    assert "bold" in styles["b"] and "underline" in styles["b"] and "green" in styles["b"]
    assert "red" in styles["c"] and "bold" not in styles["c"]
    assert "a" not in styles  # a share under a tenth of the largest: unstyled
    assert "strongest: 'b' at position 1" in text.plain
    md = report.token_markdown(tokens)
    assert md.count(">**") == 1 and ">**b**</span>" in md and "rgba(215,58,73," in md  # the negative share on red


def test_explain_without_train_data_fails_before_compute(store):
    with pytest.raises(Exception, match="explain: splitting the proponents' scores by token"):
        run_query(request(store, train_data=None))


@pytest.mark.usefixtures("prefect_harness")
def test_query_flow_writes_the_token_artifact(store):
    import asyncio

    from prefect.client.orchestration import get_client

    from flows.query import query

    req = request(store, k=2, show="test_explain_query:decode").model_dump()
    out = query(req)
    key = report.store_artifact_key(out["store"], "query", "new")

    async def read():
        async with get_client() as client:
            return await client.read_latest_artifacts()

    arts = {a.key: a for a in asyncio.run(read())}
    art = arts[f"{key}-tokens"]
    assert art.type == "markdown" and art.data == report.explain_markdown(out["rows"])
    best = max(out["rows"][0]["proponents"][0]["tokens"], key=lambda t: t["share"])
    assert f">**{best['text']}**</span>" in art.data
