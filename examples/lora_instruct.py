"""Instruction tuning with LoRA, then TRAK through the adapters: which training answers made the model answer this,
which training rows to keep for a target task, and which characters of a proponent carry its score.

Nothing is downloaded. The data set is made from the standard library: for each documented public function or class
of :data:`MODULES`, the instruction ``Describe math.cos:`` and the answer, its docstring's first sentence
(``Return the cosine of x (measured in radians).``). Tokens are characters (the vocabulary of ``examples.gpt``).

1. A base GPT-2 (built from a config, ~60k parameters) is pretrained briefly on the docstrings' text and saved
   with ``save_pretrained`` (``trakflow_lora/base/``).
2. LoRA adapters (rank 4 on the attention and first MLP layers, 6,144 parameters) are fine-tuned on the instruction
   rows, the loss on the answers only (labels -100 on the instruction); an adapter checkpoint is saved with
   ``save_pretrained`` every ``--steps`` steps (``trakflow_lora/adapter_<c>/adapter_model.safetensors``).
3. ``TRAKer`` (the default projector; gradients of the adapters) featurizes the train rows at each checkpoint.
4. ``trak_core.scoring.selection.select`` ranks the train rows by their summed influence on a target set (held-out
   questions about :data:`TOPIC`) and keeps the top 10 %; the example checks the ranking against the summed
   columns of ``finalize_scores``.
5. ``TrakIndex.query_both(..., explain=True, train_data=...)`` gives held-out questions' proponents, each score
   split over the characters of its train row, printed as ``trakflow query --explain`` prints them and written as
   the query report (``trakflow_lora/report/lora_query.md``).

Run it (CPU; measured 45 s and 71 s wall, 27 s and 42 s of CPU, on 2 cores shared with other jobs)::

    python -m examples.lora_instruct              # everything above; --help for the sizes
    trakflow query examples/lora_instruct.yaml --inputs trakflow_lora/queries.pt --k 3 --explain
    trakflow select examples/lora_instruct.yaml --inputs trakflow_lora/targets.pt --fraction 0.1 --out trakflow_lora/sel

The two commands ask the store the first one wrote (examples/lora_instruct.yaml names its model, adapter files,
train data and decoder; ``queries.pt`` and ``targets.pt`` are written by the first command).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import logging
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trak_core.featurize.modelout import IGNORE_INDEX

#: the modules whose documented public functions and classes are the questions
MODULES = (
    "math", "operator", "statistics", "os.path", "shutil", "base64", "re", "calendar", "itertools", "csv",
    "functools", "urllib.parse", "difflib", "tempfile", "heapq", "json", "collections", "zlib", "textwrap",
    "bisect", "pprint", "secrets", "shlex", "struct", "fnmatch", "copy", "glob",
)  # fmt: skip
#: the module whose held-out questions are the selection's target set
TOPIC = "math"
PAD, BOS, FIRST = 0, 1, 2  # ids 2.. are the printable ASCII characters (examples.gpt's vocabulary); BOS ends a row
VOCAB = FIRST + 95
SEQ_LEN = 64
NUM_TRAIN = 256
OUT = Path("trakflow_lora")


# ---------------------------------------------------------------------------- data
def _first_sentence(doc: str) -> str:
    text = re.sub(r"\s+", " ", doc.split("\n\n")[0].encode("ascii", "ignore").decode()).strip()
    found = re.match(r"(.+?[.!?])(\s|$)", text)
    return found.group(1) if found else text


def _fit(prompt: str, answer: str) -> str:
    """The answer cut at a word boundary so that BOS + prompt + answer + BOS fits SEQ_LEN tokens."""
    room = SEQ_LEN - 2 - len(prompt)
    if len(answer) <= room:
        return answer
    return answer[: room + 1].rsplit(" ", 1)[0]


@functools.lru_cache(maxsize=1)
def pairs() -> tuple[tuple[str, str, str], ...]:
    """(module, instruction, answer) of every documented public function and class of :data:`MODULES` defined
    there, in a fixed shuffled order (302 with CPython 3.11; the docstrings change a little with Python)."""
    out = []
    for name in MODULES:
        module = importlib.import_module(name)
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            if str(getattr(obj, "__module__", "")).lstrip("_") != module.__name__:
                continue  # imported from elsewhere
            answer = _first_sentence(inspect.getdoc(obj) or "")
            prompt = f"Describe {name}.{attr}: "
            if len(answer) < 12 or "(" in answer[: len(attr) + 1] or len(prompt) > SEQ_LEN // 2:
                continue  # no docstring, or one that starts with a signature
            out.append((name, prompt, _fit(prompt, answer)))
    order = np.random.default_rng(0).permutation(len(out))
    return tuple(out[i] for i in order)


def encode(rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) [N, SEQ_LEN], right-padded: BOS, the instruction, the answer, BOS; only
    the answer and the final BOS are scored (labels -100 on the instruction and padding)."""
    ids = torch.full((len(rows), SEQ_LEN), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for r, (_, prompt, answer) in enumerate(rows):
        seq = [BOS] + [FIRST + ord(c) - 32 for c in prompt + answer] + [BOS]
        ids[r, : len(seq)] = torch.as_tensor(seq)
        mask[r, : len(seq)] = 1
        labels[r, 1 + len(prompt) : len(seq)] = ids[r, 1 + len(prompt) : len(seq)]
    return ids, mask, labels


def decode(row) -> str:
    """A row of input_ids (or one token) back to its text; BOS and padding give ''."""
    ids = row[0] if isinstance(row, (tuple, list)) else row
    return "".join(chr(int(i) - FIRST + 32) for i in np.asarray(ids).reshape(-1) if int(i) >= FIRST)


NUM_TARGETS, NUM_QUERIES = 8, 2


@functools.lru_cache(maxsize=4)
def split(num_train: int = NUM_TRAIN) -> tuple[tuple, tuple, tuple]:
    """(train, targets, queries) rows: the targets are the first NUM_TARGETS questions about :data:`TOPIC`, the
    queries the first NUM_QUERIES about other modules, the train rows the first ``num_train`` of the rest."""
    rows = pairs()
    targets = [r for r in rows if r[0] == TOPIC][:NUM_TARGETS]
    queries = [r for r in rows if r[0] != TOPIC][:NUM_QUERIES]
    rest = [r for r in rows if r not in targets and r not in queries]
    if len(targets) < NUM_TARGETS or len(rest) < num_train:
        raise RuntimeError(
            f"the docstrings of {MODULES} give {len(rows)} questions ({len(targets)} about {TOPIC}), too few for "
            f"{NUM_TARGETS} targets and {num_train} train rows"
        )
    return tuple(rest[:num_train]), tuple(targets), tuple(queries)


def train_data(num_train: int = NUM_TRAIN):
    """The train rows' batch (the store's train data)."""
    return encode(split(num_train)[0])


def target_data(num_train: int = NUM_TRAIN):
    """The target set's batch (held-out questions about :data:`TOPIC`)."""
    return encode(split(num_train)[1])


# ---------------------------------------------------------------------------- models
def config():
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=48, n_layer=2, n_head=4, bos_token_id=BOS, eos_token_id=BOS,
        pad_token_id=PAD, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip


def lora_config():
    import peft

    return peft.LoraConfig(
        task_type=peft.TaskType.CAUSAL_LM,
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["c_attn", "c_fc"],
        fan_in_fan_out=True,  # GPT-2's Conv1D stores its weight transposed
    )


def make_model(out: Path | str = OUT):
    """The LoRA model on the saved base (``out/base``), in eval mode; its adapters come from a checkpoint."""
    import peft
    from transformers import GPT2LMHeadModel

    base = GPT2LMHeadModel.from_pretrained(Path(out) / "base")
    return peft.get_peft_model(base, lora_config()).eval()


def _steps(model, params, rows, steps: int, lr: float, seed: int, batch: int = 16) -> None:
    ids, mask, labels = rows
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        pick = torch.randint(0, ids.shape[0], (batch,), generator=g)
        loss = model(input_ids=ids[pick], attention_mask=mask[pick], labels=labels[pick]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


@torch.no_grad()
def answer_loss(model, rows) -> float:
    """Mean cross-entropy (nats a character) over the scored tokens of ``rows``."""
    ids, mask, labels = rows
    return float(model(input_ids=ids, attention_mask=mask, labels=labels).loss)


def pretrain(out: Path, steps: int) -> None:
    """The base model: a GPT-2 trained on the docstrings' text (examples.gpt's corpus), saved with save_pretrained."""
    from transformers import GPT2LMHeadModel

    from examples import gpt

    torch.manual_seed(0)
    model = GPT2LMHeadModel(config())
    _steps(model, list(model.parameters()), gpt.encode(gpt.all_texts()), steps, 3e-3, seed=0)
    model.save_pretrained(out / "base")


def finetune(out: Path, steps: int, checkpoints: int, num_train: int) -> tuple[list[Path], list[float]]:
    """LoRA on the base: ``checkpoints`` × ``steps`` steps, an adapter checkpoint saved after each ``steps``.
    Returns the adapter files and the train rows' answer loss before and at each checkpoint."""
    model = make_model(out)
    rows = train_data(num_train)
    losses = [answer_loss(model, rows)]
    files = []
    params = [p for p in model.parameters() if p.requires_grad]
    for c in range(checkpoints):
        _steps(model, params, rows, steps, 1e-2, seed=c + 1)
        model.save_pretrained(out / f"adapter_{c}")
        files.append(out / f"adapter_{c}" / "adapter_model.safetensors")
        losses.append(answer_loss(model, rows))
    return files, losses


# ---------------------------------------------------------------------------- attribution
@dataclass
class Result:
    """What :func:`run` computed (the test reads it)."""

    losses: list[float]
    scores: np.ndarray  # (n, m) finalize_scores of the target set
    selection: object  # trak_core.scoring.selection.Selection
    top: object  # the explained QueryResult of the queries
    rows: list[dict]  # the query report's rows (tasks.query.result_rows)
    report: list[str]  # the files written


def run(
    out: Path = OUT,
    pretrain_steps: int = 200,
    steps: int = 100,
    checkpoints: int = 3,
    num_train: int = NUM_TRAIN,
    proj_dim: int = 128,
    fraction: float = 0.1,
    k: int = 3,
    echo=print,
) -> Result:
    from rich.console import Console

    from tasks import report
    from tasks.query import result_rows
    from trak_core import TRAKer, TrakIndex
    from trak_core.featurize.adapters import read_state_file
    from trak_core.scoring.selection import select
    from trakflow_cli.query import token_text

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    pretrain(out, pretrain_steps)
    files, losses = finetune(out, steps, checkpoints, num_train)
    echo(
        f"LoRA on a {num_train}-row instruction set: answer loss {losses[0]:.2f} → "
        + " → ".join(f"{x:.2f}" for x in losses[1:])
        + f" nats/char at {checkpoints} adapter checkpoints ({time.perf_counter() - t0:.0f} s)"
    )

    t1 = time.perf_counter()
    train = train_data(num_train)
    train_rows, targets, queries = split(num_train)
    states = [read_state_file(f) for f in files]
    store = str((out / "store.zarr").absolute())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the projector's probe says which layers it splits
        tr = TRAKer(
            model=make_model(out),
            task="causal_lm",
            train_set_size=num_train,
            save_dir=store,
            proj_dim=proj_dim,
            device="cpu",
            load_from_save_dir=False,
            logging_level=logging.WARNING,
        )
        for mid, state in enumerate(states):
            tr.load_checkpoint(state, model_id=mid)
            for a in range(0, num_train, 64):
                b = min(a + 64, num_train)
                tr.featurize(tuple(t[a:b] for t in train), num_samples=b - a)
        tr.finalize_features()
        target_batch = encode(targets)
        torch.save(target_batch, out / "targets.pt")  # the inputs of `trakflow select` and `trakflow query`
        torch.save(encode(queries), out / "queries.pt")
        for mid, state in enumerate(states):
            tr.start_scoring_checkpoint("targets", state, mid, len(targets))
            tr.score(target_batch, num_samples=len(targets))
        scores = np.asarray(tr.finalize_scores("targets"))
    del tr
    echo(f"TRAK: {num_train} train rows × {checkpoints} checkpoints at proj_dim {proj_dim}, scores {scores.shape}")

    index = TrakIndex(store, model=make_model(out), checkpoints=states, task="causal_lm", device="cpu")
    sel = select(index, target_batch, fraction=fraction)
    brute = scores.astype(np.float64).sum(axis=1)
    err = float(np.abs(sel.row_scores - brute).max() / max(np.abs(brute).max(), 1e-30))
    on_topic = sum(train_rows[i][0] == TOPIC for i in sel.indices)
    share = sum(r[0] == TOPIC for r in train_rows) / num_train
    echo(
        f"\nselect: the top {fraction:.0%} ({sel.k} rows) for {len(targets)} held-out {TOPIC} questions: "
        f"{on_topic} of them are {TOPIC} questions ({share:.0%} of the train set are); summed influence = Σ_j "
        f"finalize_scores[:, j] to {err:.1e} (relative)"
    )
    for i, s in zip(sel.indices[:5], sel.scores[:5], strict=True):
        _, prompt, answer = train_rows[i]
        echo(f"  #{i} ({s:+.3g}) {prompt}{answer}")

    top, low = index.query_both(encode(queries), k=k, explain=True, train_data=train)
    rows = result_rows(top, low, None, None, train, decode)
    rendered = report.render_query(rows, encode(queries), train, decode, f"TRAK query: {out / 'lora'}")
    written = report.write_query_report(rendered, str(out / "report"), "lora")
    console = Console(soft_wrap=True)
    for j, (_, prompt, answer) in enumerate(queries):
        echo(f"\nquery {j}: {prompt}{answer}")
        for rank, e in enumerate(rows[j]["proponents"], start=1):
            console.print(token_text(e["tokens"], f"{rank}. #{e['index']} ({e['score']:+.4g}): "))
    echo(f"\nattribute, select, explain {time.perf_counter() - t1:.0f} s; wrote {', '.join(written[:1])}")
    return Result(losses, scores, sel, top, rows, written)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT, help="folder for the models, the store and the report")
    ap.add_argument("--pretrain-steps", type=int, default=200, help="steps of the base model on the docstrings")
    ap.add_argument("--steps", type=int, default=100, help="LoRA steps between adapter checkpoints")
    ap.add_argument("--checkpoints", type=int, default=3, help="adapter checkpoints saved and attributed")
    ap.add_argument("--num-train", type=int, default=NUM_TRAIN, help="instruction rows to fine-tune on")
    ap.add_argument("--proj-dim", type=int, default=128)
    ap.add_argument("--fraction", type=float, default=0.1, help="share of the train rows to select")
    args = ap.parse_args(argv)
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.simplefilter("ignore", FutureWarning)  # peft asks transformers a deprecated question
    torch.set_num_threads(1)  # a model this small runs faster on one thread than on shared cores
    run(args.out, args.pretrain_steps, args.steps, args.checkpoints, args.num_train, args.proj_dim, args.fraction)


if __name__ == "__main__":
    main()
