"""A small text example: generated three-way sentiment sentences and an embedding-bag classifier.

The data is generated from a seed (no download): each sentence has 10–14 tokens drawn from a neutral
vocabulary with 0–3 sentiment words mixed in; the label is negative (0), neutral (1, no sentiment
words) or positive (2) by the majority of sentiment words ("not" before a sentiment word flips it).
The model is called like a Hugging Face sequence classifier —
``model(input_ids=, token_type_ids=, attention_mask=)`` — so TRAK's ``text_classification`` task
applies unchanged.

Import paths for the pipeline config::

    model:       examples.text:make_model
    train_data:  examples.text:train_data      # (input_ids, token_type_ids, attention_mask, labels)
    target_data: examples.text:target_data
    task:        text_classification
    show:        examples.text:decode          # a row back to its sentence
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

PAD, CLS, NOT = 0, 1, 2
POSITIVE = [
    "good",
    "great",
    "excellent",
    "happy",
    "love",
    "wonderful",
    "nice",
    "fine",
    "superb",
    "enjoyable",
    "pleasant",
    "brilliant",
]
NEGATIVE = ["bad", "awful", "terrible", "sad", "hate", "poor", "boring", "ugly", "horrible", "dull", "weak", "annoying"]
NEUTRAL = [
    "the",
    "a",
    "movie",
    "book",
    "plot",
    "was",
    "is",
    "it",
    "this",
    "that",
    "actor",
    "story",
    "and",
    "with",
    "very",
    "quite",
    "scene",
    "ending",
    "music",
    "of",
    "in",
    "on",
    "for",
    "to",
    "my",
    "friend",
    "said",
    "we",
    "saw",
    "read",
    "today",
    "again",
    "really",
    "some",
    "parts",
    "overall",
]
VOCAB = ["[PAD]", "[CLS]", "not"] + POSITIVE + NEGATIVE + NEUTRAL
INDEX = {w: i for i, w in enumerate(VOCAB)}
SEQ_LEN = 16
NUM_CLASSES = 3
NUM_TRAIN = 1200
NUM_TARGETS = 20
SEED = 0


def _sentence(rng: np.random.Generator) -> tuple[list[str], int]:
    length = int(rng.integers(10, 15))
    words = list(rng.choice(NEUTRAL, size=length))
    k = int(rng.choice([0, 1, 2, 3], p=[0.3, 0.3, 0.25, 0.15]))
    score = 0
    for _ in range(k):
        positive = bool(rng.integers(0, 2))
        word = str(rng.choice(POSITIVE if positive else NEGATIVE))
        pos = int(rng.integers(0, len(words)))
        negate = rng.random() < 0.2
        words[pos:pos] = ["not", word] if negate else [word]
        score += (1 if positive else -1) * (-1 if negate else 1)
    if k and score == 0:  # a tie: add one more positive word to break it
        words.append(str(rng.choice(POSITIVE)))
        score = 1
    label = 1 if k == 0 else (2 if score > 0 else 0)
    return words[: SEQ_LEN - 1], label


def encode(sentences: list[list[str]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(sentences), SEQ_LEN, dtype=torch.long)
    mask = torch.zeros(len(sentences), SEQ_LEN, dtype=torch.long)
    for r, words in enumerate(sentences):
        toks = [CLS] + [INDEX[w] for w in words][: SEQ_LEN - 1]
        ids[r, : len(toks)] = torch.tensor(toks)
        mask[r, : len(toks)] = 1
    return ids, torch.zeros_like(ids), mask


@functools.lru_cache(maxsize=1)
def _dataset():
    rng = np.random.default_rng(SEED)
    pairs = [_sentence(rng) for _ in range(NUM_TRAIN + NUM_TARGETS)]
    ids, types, mask = encode([p[0] for p in pairs])
    labels = torch.tensor([p[1] for p in pairs], dtype=torch.long)
    return ids, types, mask, labels


def train_data():
    return tuple(t[:NUM_TRAIN] for t in _dataset())


def target_data():
    return tuple(t[NUM_TRAIN : NUM_TRAIN + NUM_TARGETS] for t in _dataset())


def decode(row) -> str:
    ids = row[0] if isinstance(row, (tuple, list)) else row
    return " ".join(VOCAB[int(i)] for i in ids if int(i) not in (PAD, CLS))


class EmbeddingBagClassifier(nn.Module):
    """Embeddings (token + token type + position) → masked mean → MLP head."""

    def __init__(self, vocab: int = len(VOCAB), dim: int = 24, hidden: int = 24, classes: int = NUM_CLASSES):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.typ = nn.Embedding(2, dim)
        self.pos = nn.Embedding(SEQ_LEN, dim)
        self.hidden = nn.Linear(dim, hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, input_ids, token_type_ids=None, attention_mask=None):
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        if attention_mask is None:
            attention_mask = (input_ids != PAD).long()
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
        h = self.tok(input_ids) + self.typ(token_type_ids) + self.pos(positions)
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(-2) / m.sum(-2).clamp(min=1.0)
        return self.out(torch.tanh(self.hidden(pooled)))


def make_model() -> nn.Module:
    return EmbeddingBagClassifier()


def train_model(seed: int = 0, epochs: int = 60, rows=None, lr: float = 0.05) -> nn.Module:
    """Full-batch Adam on the train rows (all, or the given indices); a few seconds on CPU."""
    torch.manual_seed(seed)
    model = make_model()
    ids, types, mask, labels = train_data()
    if rows is not None:
        rows = torch.as_tensor(rows)
        ids, types, mask, labels = ids[rows], types[rows], mask[rows], labels[rows]
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(epochs):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(ids, types, mask), labels)
        loss.backward()
        opt.step()
    return model.eval()
