"""Top proponents/opponents per target: a markdown table, PNGs, and a label-agreement sanity check
(no Prefect import; tasks/attribution.py turns the result into artifacts)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from trak_core.config import AttributeConfig, load_object
from trak_core.store import TrakStore

from .common import cached_data


def labels_of(data: tuple) -> Optional[np.ndarray]:
    """The last tensor of a data tuple when it looks like class labels (1-d integers)."""
    y = data[-1]
    if len(data) >= 2 and isinstance(y, torch.Tensor) and y.dim() == 1 and not y.dtype.is_floating_point:
        return y.cpu().numpy()
    return None


def top_k(scores: np.ndarray, target: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(proponents: highest scores first, opponents: lowest scores first) train indices for one target."""
    col = scores[:, target]
    k = min(k, col.shape[0])
    order = np.argsort(-col, kind="stable")
    pro = order[:k]
    opp = np.argsort(col, kind="stable")[:k]
    return pro, opp


def top_k_table(store: TrakStore, exp_name: str, targets: list[int], k: int,
                train_labels: Optional[np.ndarray] = None, target_labels: Optional[np.ndarray] = None) -> list[dict]:
    scores = store.scores(exp_name)[:]
    rows = []
    for j in targets:
        pro, opp = top_k(scores, j, k)
        row = {"target": int(j), "label": None if target_labels is None else int(target_labels[j]),
               "proponents": [_entry(i, scores[i, j], train_labels) for i in pro],
               "opponents": [_entry(i, scores[i, j], train_labels) for i in opp]}
        if train_labels is not None and target_labels is not None and len(pro):
            row["label_agreement"] = float(np.mean(train_labels[pro] == target_labels[j]))
        rows.append(row)
    return rows


def _entry(i, score, labels) -> dict:
    return {"index": int(i), "score": float(score), "label": None if labels is None else int(labels[i])}


def _fmt(e: dict) -> str:
    lab = "" if e["label"] is None else f" y={e['label']}"
    return f"#{e['index']}{lab} ({e['score']:+.3g})"


def markdown_table(rows: list[dict], title: str = "") -> str:
    lines = [f"## {title}", ""] if title else []
    lines += ["| target | label | top proponents (train index, label, score) | top opponents |",
              "|---:|---:|---|---|"]
    for r in rows:
        lab = "" if r["label"] is None else str(r["label"])
        lines.append(f"| {r['target']} | {lab} | " + ", ".join(_fmt(e) for e in r["proponents"]) + " | "
                     + ", ".join(_fmt(e) for e in r["opponents"]) + " |")
    agree = [r["label_agreement"] for r in rows if "label_agreement" in r]
    if agree:
        lines += ["", f"Fraction of top proponents sharing the target's label: **{np.mean(agree):.2f}**"]
    return "\n".join(lines) + "\n"


def target_png(row: dict, show, train: tuple, targets: tuple) -> bytes:
    """One PNG: the target, then its top proponents (top row) and opponents (bottom row)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    k = max(len(row["proponents"]), 1)
    fig = Figure(figsize=(1.5 * (k + 1), 3.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, k + 1)

    def draw(ax, img, title, color="black"):
        ax.imshow(np.asarray(img), cmap="gray_r")
        ax.set_title(title, fontsize=8, color=color)
        ax.set_xticks([])
        ax.set_yticks([])

    lab = "" if row["label"] is None else f"\nlabel {row['label']}"
    draw(axes[0, 0], show(targets[0][row["target"]].cpu().numpy()), f"target {row['target']}{lab}")
    axes[1, 0].axis("off")
    axes[1, 0].text(0.5, 0.75, "top: proponents\nbottom: opponents", ha="center", va="center", fontsize=7,
                    transform=axes[1, 0].transAxes)
    for r, key, color in ((0, "proponents", "tab:green"), (1, "opponents", "tab:red")):
        for c in range(k):
            ax = axes[r, c + 1]
            if c >= len(row[key]):
                ax.axis("off")
                continue
            e = row[key][c]
            y = "" if e["label"] is None else f" y={e['label']}"
            draw(ax, show(train[0][e["index"]].cpu().numpy()), f"#{e['index']}{y}\n{e['score']:+.2g}", color)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()


def build_report(config: AttributeConfig) -> tuple[dict, dict[int, bytes]]:
    """(summary with the table rows and file paths, {target: PNG bytes})."""
    store = TrakStore.open(config.store, config.storage_options, mode="r")
    exp = config.exp_name
    m = store.num_targets(exp)
    train = cached_data(config.train_data, "train_data")
    targets = cached_data(config.target_data, "target_data")
    shown = list(range(min(config.report_targets, m)))
    rows = top_k_table(store, exp, shown, config.top_k, labels_of(train), labels_of(targets))
    md = markdown_table(rows, f"TRAK attribution: experiment {exp!r}, store {config.store}")
    pngs: dict[int, bytes] = {}
    if config.show:
        show = load_object(config.show, "show")
        for r in rows:
            pngs[r["target"]] = target_png(r, show, train, targets)
    files = []
    if config.report_dir:
        out = Path(config.report_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{exp}_top_k.md").write_text(md)
        files.append(str(out / f"{exp}_top_k.md"))
        for j, png in pngs.items():
            p = out / f"{exp}_target_{j}.png"
            p.write_bytes(png)
            files.append(str(p))
    agree = [r["label_agreement"] for r in rows if "label_agreement" in r]
    summary = {"exp_name": exp, "rows": rows, "markdown": md, "files": files,
               "label_agreement": float(np.mean(agree)) if agree else None}
    return summary, pngs


def data_url(png: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def artifact_key(*parts) -> str:
    """Prefect artifact keys: lowercase letters, digits and dashes."""
    raw = "-".join(str(p) for p in parts).lower()
    key = "".join(ch if ch.isalnum() and ch.isascii() else "-" for ch in raw)
    while "--" in key:
        key = key.replace("--", "-")
    return key.strip("-")


__all__ = ["build_report", "top_k", "top_k_table", "markdown_table", "labels_of", "data_url", "artifact_key",
           "target_png"]
