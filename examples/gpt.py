"""A small GPT (transformers' GPT-2, ~60k parameters, characters as tokens) trained on the docstrings of the
standard library, then TRAK (``task="causal_lm"``): which training texts made the model predict a held-out text?

Nothing is downloaded: the corpus is the docstrings of the modules in :data:`MODULES` (they ship with Python, so the
texts change a little with its version), the model is built from a ``GPT2Config``, each checkpoint is written with
``save_pretrained`` and read back with ``from_pretrained`` (and as a state_dict, which the pipeline loads).

Run it (measured: 25 CPU-seconds in all, 107 s wall on 2 cores shared with a load average of 9)::

    python -m examples.gpt                   # train 2 checkpoints, attribute, print proponent texts
    python -m examples.gpt --per-token       # also: the top proponent of each character of one target
    trakflow run examples/gpt.yaml           # the pipeline on the checkpoints the first command wrote

Import paths for the pipeline config::

    model:       examples.gpt:make_model      # a GPT2LMHeadModel from the config (weights from the checkpoints)
                 examples.gpt:wide_model      # the same at width 128 (415,360 parameters; benchmarks/quality.py)
    train_data:  examples.gpt:train_data      # (input_ids, attention_mask, labels) [N, T], right-padded
    target_data: examples.gpt:target_data
    task:        causal_lm
    show:        examples.gpt:decode          # a row of input_ids back to its text
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import logging
import re
import time
from pathlib import Path

import numpy as np
import torch

from trak_core.featurize.lm import causal_lm_batch, per_token_targets

#: standard-library modules whose docstrings (module, classes, functions) are the corpus
MODULES = ("json", "textwrap", "string", "functools", "itertools", "collections", "heapq", "bisect", "shlex", "fnmatch")
PAD, BOS, FIRST = 0, 1, 2  # ids 2.. are the printable ASCII characters
VOCAB = FIRST + 95
SEQ_LEN = 48  # tokens per row: BOS + up to 47 characters
NUM_TRAIN, NUM_TARGETS = 480, 6
OUT = Path("trakflow_gpt")


def config(n_embd: int = 48):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ_LEN,
        n_embd=n_embd,
        n_layer=2,
        n_head=4,
        bos_token_id=BOS,
        eos_token_id=BOS,
        pad_token_id=PAD,
        resid_pdrop=0.0,  # no dropout: a short run on a small corpus does not need it (and it costs time)
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def make_model(n_embd: int = 48):
    """A GPT2LMHeadModel built from :func:`config` (random weights: a checkpoint replaces them), in eval mode."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(config(n_embd)).eval()


def wide_model():
    """The same GPT at width 128: 415,360 parameters (the attribution-quality case ``small-lm``)."""
    return make_model(n_embd=128)


# ---------------------------------------------------------------------------- corpus
def _docstrings(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    docs = [inspect.getdoc(module) or ""]
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
            continue
        docs.append(inspect.getdoc(obj) or "")
    return docs


def _chunks(text: str) -> list[str]:
    """Sentences of a docstring, ASCII only, cut at word boundaries into pieces of at most SEQ_LEN − 1 characters."""
    text = re.sub(r"\s+", " ", text.encode("ascii", "ignore").decode()).strip()
    out = []
    for sentence in re.split(r"(?<=[.!?])\s+", text):
        piece = ""
        for word in sentence.split(" "):
            if len(piece) + len(word) + 1 > SEQ_LEN - 1:
                if len(piece) >= 12:
                    out.append(piece)
                piece = word[: SEQ_LEN - 1]
            else:
                piece = f"{piece} {word}" if piece else word
        if len(piece) >= 12:
            out.append(piece)
    return out


@functools.lru_cache(maxsize=1)
def all_texts() -> tuple[str, ...]:
    """Every text of the corpus (unique, in a fixed shuffled order; 745 with CPython 3.12)."""
    seen: dict[str, None] = {}
    for name in MODULES:
        for doc in _docstrings(name):
            for chunk in _chunks(doc):
                seen.setdefault(chunk, None)
    texts = list(seen)
    order = np.random.default_rng(0).permutation(len(texts))
    return tuple(texts[i] for i in order)


def corpus(num_targets: int = NUM_TARGETS) -> tuple[str, ...]:
    """NUM_TRAIN train texts, then ``num_targets`` held-out ones."""
    texts = all_texts()
    if len(texts) < NUM_TRAIN + num_targets:
        need = NUM_TRAIN + num_targets
        raise RuntimeError(f"the docstrings of {MODULES} give {len(texts)} texts, fewer than the {need} needed")
    return texts[: NUM_TRAIN + num_targets]


def encode(texts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) [N, SEQ_LEN], right-padded: BOS then the characters, each scored."""
    seqs = [[BOS] + [FIRST + ord(c) - 32 for c in t if 32 <= ord(c) < 127] for t in texts]
    return causal_lm_batch(seqs, SEQ_LEN, PAD)


def decode(row) -> str:
    ids = row[0] if isinstance(row, (tuple, list)) else row
    return "".join(chr(int(i) - FIRST + 32) for i in np.asarray(ids).reshape(-1) if int(i) >= FIRST)


def train_data():
    return encode(corpus()[:NUM_TRAIN])


def target_data(num: int = NUM_TARGETS):
    return encode(corpus(num)[NUM_TRAIN:])


# ---------------------------------------------------------------------------- training
def train(seed: int, steps: int = 300, batch: int = 32, lr: float = 3e-3, rows=None, model_fn=make_model):
    """AdamW on the train rows (the loss of transformers' causal LM: mean cross-entropy over scored tokens);
    each step a batch drawn with replacement from ``rows`` (indices; default all)."""
    model = model_fn()
    torch.manual_seed(seed)
    for p in model.parameters():  # each checkpoint from its own initialization
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    ids, mask, labels = train_data()
    pool = torch.arange(ids.shape[0]) if rows is None else torch.as_tensor(np.asarray(rows), dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        pick = pool[torch.randint(0, pool.numel(), (batch,), generator=g)]
        loss = model(input_ids=ids[pick], attention_mask=mask[pick], labels=labels[pick]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), float(loss.detach())


def save_checkpoints(out: Path = OUT, seeds=(0, 1), steps: int = 300) -> list[Path]:
    """Train one model per seed; each saved with save_pretrained (out/ckpt_i/) and as a state_dict (out/model_i.pt)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, seed in enumerate(seeds):
        model, loss = train(seed, steps)
        model.save_pretrained(out / f"ckpt_{i}")
        torch.save(model.state_dict(), out / f"model_{i}.pt")
        paths.append(out / f"ckpt_{i}")
        print(f"checkpoint {i}: seed {seed}, {steps} steps, last batch loss {loss:.2f} nats/char")
    return paths


# ---------------------------------------------------------------------------- attribution
def attribute(paths: list[Path], proj_dim: int = 512, per_token: bool = False, top_k: int = 3) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    from trak_core import TRAKer

    train, targets = train_data(), target_data()
    model = AutoModelForCausalLM.from_pretrained(paths[0]).eval()
    tr = TRAKer(
        model=model,
        task="causal_lm",
        train_set_size=NUM_TRAIN,
        save_dir=str(OUT / "traker.zarr"),
        proj_dim=proj_dim,
        device="cpu",
        load_from_save_dir=False,
        logging_level=logging.WARNING,
    )
    ckpts = [AutoModelForCausalLM.from_pretrained(p).state_dict() for p in paths]
    for mid, ck in enumerate(ckpts):
        tr.load_checkpoint(ck, model_id=mid)
        for a in range(0, NUM_TRAIN, 64):
            tr.featurize(tuple(t[a : a + 64] for t in train), num_samples=min(64, NUM_TRAIN - a))
    tr.finalize_features()
    for mid, ck in enumerate(ckpts):
        tr.start_scoring_checkpoint("targets", ck, mid, NUM_TARGETS)
        tr.score(targets, num_samples=NUM_TARGETS)
    scores = np.asarray(tr.finalize_scores("targets"))
    texts = corpus()
    for j in range(NUM_TARGETS):
        print(f"\ntarget {j}: {texts[NUM_TRAIN + j]!r}")
        for rank, i in enumerate(np.argsort(-scores[:, j])[:top_k]):
            print(f"  proponent {rank + 1} (score {scores[i, j]:+.3g}): {texts[i]!r}")
    if per_token:
        one = tuple(t[:1] for t in targets)
        rows_batch, rows = per_token_targets(one)
        for mid, ck in enumerate(ckpts):
            tr.start_scoring_checkpoint("tokens", ck, mid, rows.shape[0])
            tr.score(rows_batch, num_samples=rows.shape[0])
        tok = np.asarray(tr.finalize_scores("tokens"))
        text = texts[NUM_TRAIN]
        print(f"\nper token (target 0, {rows.shape[0]} target rows): the top proponent of each character")
        for r, (_, t) in enumerate(rows.tolist()):
            best = int(np.argmax(tok[:, r]))
            print(f"  {text[: t - 1]!r} -> {text[t - 1]!r}: {texts[best]!r}")
    return scores


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="training steps per checkpoint")
    ap.add_argument("--proj-dim", type=int, default=512)
    ap.add_argument("--per-token", action="store_true", help="also score each character of one target")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    paths = save_checkpoints(OUT, steps=args.steps)
    trained = time.perf_counter()
    attribute(paths, args.proj_dim, args.per_token)
    print(f"\ntrain {trained - start:.0f} s, attribute {time.perf_counter() - trained:.0f} s")


if __name__ == "__main__":
    main()
