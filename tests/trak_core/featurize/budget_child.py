"""A child process for tests/trak_core/test_budget.py: TRAKer featurizes one batch of ``rows`` rows of an MLP (with
``max_memory``, or none: "-"), then prints one JSON line: its resident memory before featurizing, the peak since then
(the high-water mark, reset just before), the rows a budget allowed, and the projected rows' checksum.

    python budget_child.py STORE ROWS WIDTH MAX_MEMORY
"""

import json
import logging
import sys

import torch

from trak_core import TRAKer
from trak_core.featurize.budget import _reset_peak_rss, _status_kib, process_rss


def main() -> None:
    store, rows, width, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )
    x, y = torch.randn(rows, 64), torch.randint(0, 10, (rows,))
    tr = TRAKer(
        model=model,
        task="image_classification",
        train_set_size=rows,
        save_dir=store,
        device="cpu",
        proj_dim=256,
        logging_level=logging.ERROR,
        max_memory=None if budget == "-" else budget,
    )
    tr.load_checkpoint(model.state_dict(), model_id=0)
    before = process_rss()
    out = {"before": before, "setup_peak": _status_kib("VmHWM")}
    _reset_peak_rss()
    try:
        tr.featurize((x, y), num_samples=rows)
        tr._flush_rows()
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(e).__name__}: {e}"
    out["peak"] = _status_kib("VmHWM")
    out["budget_rows"] = tr.featurizer.budget_rows
    out["fit"] = repr(tr.featurizer.memory_fit)
    if "error" not in out:
        out["x"] = tr.store.model(0).grads[:].astype("float64").sum(axis=1).tolist()
        out["featurized"] = int(tr.store.model(0).featurized[:].sum())
    else:
        out["featurized"] = int(tr.store.model(0).featurized[:].sum()) if tr._store is not None else 0
    out["end_peak"] = _status_kib("VmHWM")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
