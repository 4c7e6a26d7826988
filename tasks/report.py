"""Top proponents/opponents per target: a markdown table, PNGs, a histogram of the scores, and a
label-agreement sanity check (no Prefect import; tasks/attribution.py turns the result into artifacts).

The config's ``show`` callable turns an input row (the first tensor of the data tuple, one row) into
either a 2-D array — drawn as an image — or a string — drawn as text (e.g. ``examples.text:decode``);
with text, the markdown and ``trakflow show`` also list the sentences."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

from trak_core.scoring.topk import top_k as core_top_k
from trak_core.store import RunStore, open_store

from .common import adopt_train_source, cached_data
from .config import AttributeConfig, load_object


def labels_of(data: tuple) -> np.ndarray | None:
    """The last tensor of a data tuple when it looks like class labels (1-d integers)."""
    y = data[-1]
    if len(data) >= 2 and isinstance(y, torch.Tensor) and y.dim() == 1 and not y.dtype.is_floating_point:
        return y.cpu().numpy()
    return None


def top_k(scores: np.ndarray, target: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(proponents: highest scores first, opponents: lowest scores first) train indices for one target: the core's
    one top-k (:func:`trak_core.scoring.topk.top_k`, equal scores ranked by the lower row), which the index's queries
    use."""
    col = scores[:, target : target + 1]
    return core_top_k(col, k)[0][0], core_top_k(col, k, opponents=True)[0][0]


def top_k_table(
    store: RunStore,
    exp_name: str,
    targets: list[int],
    k: int,
    train_labels: np.ndarray | None = None,
    target_labels: np.ndarray | None = None,
) -> list[dict]:
    scores = store.scores(exp_name)[:]
    rows = []
    for j in targets:
        pro, opp = top_k(scores, j, k)
        row = {
            "target": int(j),
            "label": None if target_labels is None else int(target_labels[j]),
            "proponents": [_entry(i, scores[i, j], train_labels) for i in pro],
            "opponents": [_entry(i, scores[i, j], train_labels) for i in opp],
        }
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
    lines += ["| target | label | top proponents (train index, label, score) | top opponents |", "|---:|---:|---|---|"]
    for r in rows:
        lab = "" if r["label"] is None else str(r["label"])
        lines.append(
            f"| {r['target']} | {lab} | "
            + ", ".join(_fmt(e) for e in r["proponents"])
            + " | "
            + ", ".join(_fmt(e) for e in r["opponents"])
            + " |"
        )
    agree = [r["label_agreement"] for r in rows if "label_agreement" in r]
    if agree:
        lines += ["", f"Fraction of top proponents sharing the target's label: **{np.mean(agree):.2f}**"]
    for r in rows:
        if r.get("text") is None:
            continue
        lab = "" if r["label"] is None else f" (label {r['label']})"
        lines += [
            "",
            f"### target {r['target']}{lab}: {_md(r['text'])}",
            "",
            "| rank | proponent | score | text | opponent | score | text |",
            "|---:|---|---:|---|---|---:|---|",
        ]
        for i in range(max(len(r["proponents"]), len(r["opponents"]))):
            cells = [str(i + 1)]
            for key in ("proponents", "opponents"):
                if i < len(r[key]):
                    e = r[key][i]
                    y = "" if e["label"] is None else f" y={e['label']}"
                    cells += [f"#{e['index']}{y}", f"{e['score']:+.3g}", _md(e.get("text") or "")]
                else:
                    cells += ["", "", ""]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def is_text(shown) -> bool:
    return isinstance(shown, str)


def add_texts(rows: list[dict], show, train: tuple, targets: tuple) -> bool:
    """Attach ``text`` to every target and entry when ``show`` returns strings; False (nothing attached)
    when it returns images."""
    if not rows or not is_text(show(targets[0][rows[0]["target"]].cpu().numpy())):
        return False
    for r in rows:
        r["text"] = str(show(targets[0][r["target"]].cpu().numpy()))
        for key in ("proponents", "opponents"):
            for e in r[key]:
                e["text"] = str(show(train[0][e["index"]].cpu().numpy()))
    return True


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
    axes[1, 0].text(
        0.5,
        0.75,
        "top: proponents\nbottom: opponents",
        ha="center",
        va="center",
        fontsize=7,
        transform=axes[1, 0].transAxes,
    )
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


def target_text_png(row: dict, width: int = 110) -> bytes:
    """One PNG for text inputs: the target sentence, then its top proponents (green) and opponents (red),
    one line each with train index, label and score."""
    import textwrap

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def wrap(t: str) -> list[str]:
        return textwrap.wrap(t, width=width) or [""]

    lab = "" if row["label"] is None else f" (label {row['label']})"
    lines: list[tuple[str, str, str]] = [(f"target {row['target']}{lab}", "", "bold")]
    lines += [(t, "black", "normal") for t in wrap(row.get("text") or "")]
    for key, color in (("proponents", "tab:green"), ("opponents", "tab:red")):
        lines.append(("", "", "normal"))
        lines.append((f"top {key}", color, "bold"))
        for i, e in enumerate(row[key]):
            y = "" if e["label"] is None else f" y={e['label']}"
            head = f"{i + 1}. #{e['index']}{y} ({e['score']:+.3g})  "
            body = wrap(head + (e.get("text") or ""))
            lines += [(body[0], color, "normal")] + [("      " + t, color, "normal") for t in body[1:]]
    height = 0.24 * len(lines) + 0.3
    fig = Figure(figsize=(0.075 * width + 0.5, height))
    FigureCanvasAgg(fig)
    for i, (text, color, weight) in enumerate(lines):
        fig.text(
            0.02,
            1 - (0.15 + 0.24 * (i + 0.5)) / height,
            text,
            color=color or "black",
            fontsize=9,
            fontweight=weight,
            family="monospace",
            va="center",
            ha="left",
        )
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()


def score_histogram_png(scores: np.ndarray, title: str = "") -> bytes:
    """Histogram of all scores of an experiment (log count axis), with the 1st/99th percentiles marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    vals = np.asarray(scores, dtype=np.float64).ravel()
    vals = vals[np.isfinite(vals)]
    fig = Figure(figsize=(6, 3.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if vals.size:
        ax.hist(vals, bins=100, color="tab:blue", log=True)
        for q, style in ((1, ":"), (99, ":")):
            v = float(np.percentile(vals, q))
            ax.axvline(v, color="black", linestyle=style, linewidth=1)
        ax.axvline(0.0, color="gray", linewidth=0.8)
    ax.set_xlabel("TRAK score (dotted: 1st / 99th percentile)")
    ax.set_ylabel("(train, target) pairs")
    ax.set_title(title or "scores", fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()


def score_stats(scores: np.ndarray) -> dict:
    v = np.asarray(scores, dtype=np.float64).ravel()
    v = v[np.isfinite(v)]
    if not v.size:
        return {}
    return {
        "count": int(v.size),
        "mean": float(v.mean()),
        "std": float(v.std()),
        "min": float(v.min()),
        "p01": float(np.percentile(v, 1)),
        "median": float(np.median(v)),
        "p99": float(np.percentile(v, 99)),
        "max": float(v.max()),
        "positive_fraction": float((v > 0).mean()),
    }


def build_report(config: AttributeConfig) -> tuple[dict, dict[int, bytes]]:
    """(summary with the table rows and file paths, {target: PNG bytes})."""
    store = open_store(config.store, config.storage_options, mode="r")
    exp = config.exp_name
    m = store.num_targets(exp)
    adopt_train_source(config)
    train = cached_data(config.train_data, "train_data")
    targets = cached_data(config.target_data, "target_data")
    shown = list(range(min(config.report_targets, m)))
    rows = top_k_table(store, exp, shown, config.top_k, labels_of(train), labels_of(targets))
    show = load_object(config.show, "show") if config.show else None
    text = add_texts(rows, show, train, targets) if show is not None else False
    md = markdown_table(rows, f"TRAK attribution: experiment {exp!r}, store {config.store}")
    scores = store.scores(exp)[:]
    stats = score_stats(scores)
    hist = score_histogram_png(
        scores, f"scores of experiment {exp!r} ({scores.shape[0]} train × {scores.shape[1]} targets)"
    )
    if stats:
        md += (
            f"\nScores: mean {stats['mean']:+.3g}, std {stats['std']:.3g}, 1st/50th/99th percentile "
            f"{stats['p01']:+.3g} / {stats['median']:+.3g} / {stats['p99']:+.3g}, range [{stats['min']:+.3g}, "
            f"{stats['max']:+.3g}], {100 * stats['positive_fraction']:.1f} % positive.\n"
        )
    pngs: dict[int, bytes] = {}
    if show is not None:
        for r in rows:
            pngs[r["target"]] = target_text_png(r) if text else target_png(r, show, train, targets)
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
        (out / f"{exp}_score_histogram.png").write_bytes(hist)
        files.append(str(out / f"{exp}_score_histogram.png"))
    agree = [r["label_agreement"] for r in rows if "label_agreement" in r]
    summary = {
        "exp_name": exp,
        "rows": rows,
        "markdown": md,
        "files": files,
        "text": text,
        "score_stats": stats,
        "histogram_png": hist,
        "label_agreement": float(np.mean(agree)) if agree else None,
    }
    return summary, pngs


def render_query(rows: list[dict], inputs: tuple, train: tuple | None, show, title: str) -> dict:
    """A query's answer drawn as the attribute report draws targets: ``{"markdown", "pngs": {input: PNG},
    "text"}``. ``rows``: :func:`top_k_table`'s form, one per input (``target`` = the input's position);
    ``show`` (with ``train``) turns an input row into an image or a text, None for the table alone."""
    text = add_texts(rows, show, train, inputs) if show is not None and train is not None else False
    md = markdown_table(rows, title).replace("| target | label |", "| input | label |", 1) + explain_markdown(rows)
    pngs: dict[int, bytes] = {}
    if show is not None and train is not None:
        for r in rows:
            pngs[r["target"]] = target_text_png(r) if text else target_png(r, show, train, inputs)
    return {"markdown": md, "pngs": pngs, "text": text}


def token_texts(ids, show=None) -> list[str]:
    """Each token of a sequence as text: ``show`` applied to the one token where it returns a non-empty string (a
    decoder such as ``examples.gpt:decode``), else ``⟨id⟩``."""
    out = []
    for i in np.asarray(ids).reshape(-1).tolist():
        text = show(np.asarray([i])) if show is not None else None
        out.append(text if isinstance(text, str) and text else f"⟨{int(i)}⟩")
    return out


def token_entries(shares, ids, mask, show=None) -> list[dict]:
    """``[{"position", "text", "share"}]`` of one train sequence's real tokens (``mask`` 1; padding left out, its
    shares are 0)."""
    texts = token_texts(ids, show)
    keep = np.asarray(mask).reshape(-1) != 0
    return [
        {"position": t, "text": texts[t], "share": float(v)}
        for t, v in enumerate(np.asarray(shares).reshape(-1).tolist())
        if keep[t]
    ]


def strongest_token(tokens: list[dict]) -> dict | None:
    """The token with the largest share (the first of equals), None for no tokens."""
    return max(tokens, key=lambda e: (e["share"], -e["position"])) if tokens else None


_ESCAPE = str.maketrans({c: "\\" + c for c in "\\`*_{}[]<>()#+-.!|~"})


def _md_token(text: str, visible: bool = False) -> str:
    """A token safe inline in markdown (special characters escaped, newlines as ⏎; ``visible``: spaces as ␣)."""
    text = text.replace("\n", "⏎")
    return (text.replace(" ", "␣") if visible else text).translate(_ESCAPE)


def token_markdown(tokens: list[dict]) -> str:
    """One train sequence with each token on a background whose strength follows its share of the score (green:
    positive, red: negative; relative to the largest |share|), the strongest token in bold; then the strongest
    token, its position and share."""
    if not tokens:
        return ""
    top = max(abs(e["share"]) for e in tokens) or 1.0
    best = strongest_token(tokens)
    parts = []
    for e in tokens:
        a = abs(e["share"]) / top
        rgb = "46,160,67" if e["share"] >= 0 else "215,58,73"
        text = _md_token(e["text"], visible=e is best)
        text = f"**{text}**" if e is best else text  # inside the span: "**" beside the tags would not parse as bold
        parts.append(
            f'<span style="background-color:rgba({rgb},{0.85 * a:.2f})" title="{e["share"]:+.3g}">{text}</span>'
        )
    assert best is not None
    total = sum(e["share"] for e in tokens)
    return (
        "".join(parts)
        + f" — *strongest:* **{_md_token(best['text'], visible=True)}** at position {best['position']}, "
        + f"share {best['share']:+.3g} of {total:+.3g}"
    )


def explain_markdown(rows: list[dict]) -> str:
    """The section of a query report that shows which tokens carry each proponent's score (rows whose entries have
    ``tokens``, see :func:`token_entries`); empty when none has."""
    lines: list[str] = []
    for r in rows:
        entries = [e for e in r["proponents"] if e.get("tokens")]
        if not entries:
            continue
        lines += ["", f"### input {r['target']}: which tokens carry each proponent's score", ""]
        for rank, e in enumerate(entries, start=1):
            lines.append(f"{rank}. #{e['index']} (score {e['score']:+.3g}): {token_markdown(e['tokens'])}")
    return "\n".join(lines) + "\n" if lines else ""


def write_query_report(rendered: dict, out_dir: str, stem: str) -> list[str]:
    """:func:`render_query`'s table and PNGs as files ``<stem>_query.md``, ``<stem>_input_<j>.png`` in
    ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / f"{stem}_query.md"]
    files[0].write_text(rendered["markdown"])
    for j, png in rendered["pngs"].items():
        files.append(out / f"{stem}_input_{j}.png")
        files[-1].write_bytes(png)
    return [str(f) for f in files]


def data_url(png: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def image_markdown(png: bytes, title: str) -> str:
    """A PNG as a markdown artifact's body: the Prefect UI shows the image alone (an image artifact prints
    its whole data URL under the picture)."""
    return f"![{title}]({data_url(png)})\n"


def store_artifact_key(location: str, *parts) -> str:
    """The key of an artifact that belongs to one store (or checkpoint folder): ``trakflow-<identity>-...``,
    so two stores reporting to one Prefect server never overwrite each other's latest artifact."""
    from .common import store_identity

    return artifact_key("trakflow", store_identity(location), *parts)


def artifact_key(*parts) -> str:
    """Prefect artifact keys: lowercase letters, digits and dashes."""
    raw = "-".join(str(p) for p in parts).lower()
    key = "".join(ch if ch.isalnum() and ch.isascii() else "-" for ch in raw)
    while "--" in key:
        key = key.replace("--", "-")
    return key.strip("-")


__all__ = [
    "build_report",
    "render_query",
    "explain_markdown",
    "token_entries",
    "token_markdown",
    "token_texts",
    "strongest_token",
    "write_query_report",
    "top_k",
    "top_k_table",
    "markdown_table",
    "labels_of",
    "data_url",
    "artifact_key",
    "store_artifact_key",
    "target_png",
    "target_text_png",
    "score_histogram_png",
    "score_stats",
    "add_texts",
    "is_text",
]
