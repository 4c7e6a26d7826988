"""examples/lora_instruct.py end to end at a reduced size: the LoRA fine-tune lowers the answer loss, the adapter
checkpoints are save_pretrained's files, TRAKer's scores have the target set's shape, the selection is the top of
the summed finalize_scores columns, and each explained proponent's token shares sum to its score."""

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from examples import lora_instruct  # noqa: E402

N, K, FRACTION = 64, 3, 0.25


@pytest.fixture
def one_thread():
    """As the example's main() runs it: a model this small is faster on one thread of shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_lora_example_end_to_end(tmp_path, one_thread):
    printed: list[str] = []
    res = lora_instruct.run(
        tmp_path, pretrain_steps=30, steps=25, checkpoints=2, num_train=N, proj_dim=32, fraction=FRACTION,
        k=K, echo=printed.append,
    )  # fmt: skip

    # the adapters learned: the train rows' answer loss is lower at every checkpoint than before fine-tuning
    assert len(res.losses) == 3 and all(np.isfinite(res.losses))
    assert max(res.losses[1:]) < res.losses[0] - 0.05, res.losses
    for c in range(2):
        assert (tmp_path / f"adapter_{c}" / "adapter_model.safetensors").is_file()

    train_rows, targets, queries = lora_instruct.split(N)
    for name, rows in (("targets.pt", targets), ("queries.pt", queries)):  # the CLI commands' inputs
        for saved, want in zip(torch.load(tmp_path / name), lora_instruct.encode(rows), strict=True):
            assert torch.equal(saved, want)
    assert res.scores.shape == (N, len(targets)) == (N, lora_instruct.NUM_TARGETS)
    assert np.isfinite(res.scores).all() and np.abs(res.scores).max() > 0

    # the selection against the brute force: every row's summed influence, and the top rows
    sel = res.selection
    brute = res.scores.astype(np.float64).sum(axis=1)
    tol = 1e-4 * np.abs(brute).max()
    np.testing.assert_allclose(sel.row_scores, brute, rtol=0, atol=tol)
    k = round(FRACTION * N)
    assert sel.k == k and sel.num_targets == len(targets) and sel.model_ids == (0, 1)
    kth = np.sort(brute)[::-1][k - 1]
    assert (brute[sel.indices] >= kth - 2 * tol).all()  # the top k of the summed columns (up to float32 ties)
    assert set(sel.indices) == set(np.argsort(-brute, kind="stable")[:k]) or np.sort(brute)[::-1][k] >= kth - 2 * tol
    assert np.all(np.diff(sel.scores) <= 0)

    # the explained query: shares per position sum to the scores, padding carries none
    top = res.top
    assert top.indices.shape == (len(queries), K) and top.shares.shape == (len(queries), K, lora_instruct.SEQ_LEN)
    np.testing.assert_allclose(top.shares.sum(axis=-1), top.scores, rtol=2e-3, atol=1e-3 * np.abs(top.scores).max())
    mask = lora_instruct.train_data(N)[1].numpy()
    assert np.all(top.shares[:, :, :][mask[top.indices] == 0] == 0)

    # what is rendered: each proponent's tokens (its text back), and the report file
    for j, row in enumerate(res.rows):
        for e, i in zip(row["proponents"], top.indices[j], strict=True):
            _, prompt, answer = train_rows[i]
            assert "".join(t["text"] for t in e["tokens"] if not t["text"].startswith("⟨")) == prompt + answer
    report = (tmp_path / "report" / "lora_query.md").read_text()
    assert "which tokens carry each proponent's score" in report
    assert any(line.startswith("select: the top 25% (16 rows)") for line in (p.strip() for p in printed))


def test_readme_command_is_this_example():
    """The README's command names this module, and its options parse (the run itself is the test above)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "python -m examples.lora_instruct" in readme
    with pytest.raises(SystemExit) as e:
        lora_instruct.main(["--help"])
    assert e.value.code == 0


def test_cli_config_names_the_example_store(tmp_path, monkeypatch):
    """examples/lora_instruct.yaml (what the README's query and select commands read) is a valid config whose store,
    adapter files, proj_dim and functions are the ones the example writes and defines."""
    from pathlib import Path

    from tasks.config import AttributeConfig

    path = Path(__file__).resolve().parents[2] / "examples" / "lora_instruct.yaml"
    monkeypatch.chdir(tmp_path)
    out = lora_instruct.OUT
    for c in range(3):  # the files the example writes, as it names them
        (out / f"adapter_{c}").mkdir(parents=True)
        (out / f"adapter_{c}" / "adapter_model.safetensors").write_bytes(b"")
    cfg = AttributeConfig.from_yaml(str(path))
    assert cfg.task == "causal_lm" and cfg.model == "examples.lora_instruct:make_model"
    assert Path(cfg.store).resolve() == (tmp_path / out / "store.zarr").resolve() and cfg.proj_dim == 128
    assert cfg.checkpoints == str(out / "adapter_*" / "adapter_model.safetensors")  # validated: it matches them
    assert (cfg.train_data, cfg.show) == ("examples.lora_instruct:train_data", "examples.lora_instruct:decode")
