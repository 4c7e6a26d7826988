"""Model families of the benchmark matrix, built without downloads (random init: cost, not quality).

``make_model(name)`` returns (model in eval mode, input shape, input kind), seeded, and ``make_data`` random
inputs for it. ``featurize_bench.py`` (the featurize table) uses ``mlp400k``, ``convnet`` and ``transformer``; the
matrix (``matrix.py``) its families: MLPs of depth 2–4 on 784 inputs, a held-out 3-layer MLP on 256 inputs
(``mlp3w``: chosen after the defaults, a shape where finalize dominates), a conv net with BatchNorm, a CIFAR-style
ResNet-18 (11.2M parameters), a transformer encoder classifier, and a small GPT-style decoder (causal
self-attention) that classifies from its last token.
"""

from __future__ import annotations

import torch
from torch import nn

SEQ, VOCAB = 32, 1000

LABELS = {
    "mlp2": "MLP 784-512-10",
    "mlp3": "MLP 784-384-256-10",
    "mlp4": "MLP 784-320-256-128-10",
    "mlp3w": "MLP 256-512-512-10 (held out)",
    "convbn": "ConvNet + BatchNorm 3×32×32",
    "resnet18": "ResNet-18 (CIFAR stem) 3×32×32",
    "encoder": "Transformer encoder, 2 layers, d 64",
    "gpt": "GPT-style decoder, 4 layers, d 128",
}


def _mlp(*widths: int) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:], strict=True):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.short = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x):
        h = torch.relu(self.b1(self.c1(x)))
        return torch.relu(self.b2(self.c2(h)) + self.short(x))


class ResNet18(nn.Module):
    """The ResNet-18 layout (2-2-2-2 basic blocks, 64-512 channels) with a 3×3 stem for 32×32 inputs, or
    (``imagenet``) its 7×7 stride-2 stem and max-pool: 11.69M parameters at 1000 classes."""

    def __init__(self, classes: int = 10, imagenet: bool = False):
        super().__init__()
        if imagenet:
            stem = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
        else:
            stem = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
        self.stem = nn.Sequential(*stem)
        blocks, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [_Block(cin, cout, stride), _Block(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(512, classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


class Decoder(nn.Module):
    """Token + position embeddings → causal pre-norm blocks → logits of the last position's class head."""

    def __init__(self, dim: int = 128, heads: int = 4, layers: int = 4, classes: int = 10):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(SEQ, dim))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, ids):
        t = ids.shape[-1]
        h = self.tok(ids) + self.pos[:t]
        for blk in self.blocks:
            h = blk(h, src_mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h)[..., -1, :])


TRANSFORMER = {"VOCAB": 1000, "DIM": 64, "HEADS": 4, "FF": 256, "LAYERS": 2, "SEQ": 32, "CLASSES": 10}


class TinyTransformer(nn.Module):
    """Token + position embeddings → 2 × nn.TransformerEncoderLayer (4 heads) → mean over tokens → linear."""

    VOCAB, DIM, HEADS, FF, LAYERS, SEQ, CLASSES = TRANSFORMER.values()

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(self.VOCAB, self.DIM)
        self.pos = nn.Parameter(0.02 * torch.randn(self.SEQ, self.DIM))
        self.blocks = nn.ModuleList(
            [
                nn.TransformerEncoderLayer(self.DIM, self.HEADS, self.FF, dropout=0.0, batch_first=True)
                for _ in range(self.LAYERS)
            ]
        )
        self.head = nn.Linear(self.DIM, self.CLASSES)

    def forward(self, ids):
        h = self.tok(ids) + self.pos[: ids.shape[-1]]
        for blk in self.blocks:
            h = blk(h)
        return self.head(h.mean(dim=-2))


def make_data(shape, kind, n):
    """(x, y): n random inputs of the shape (token ids below the vocabulary for ``tokens``), labels in 0..9."""
    g = torch.Generator().manual_seed(1)
    if kind == "tokens":
        x = torch.randint(0, TRANSFORMER["VOCAB"], (n, *shape), generator=g)
    else:
        x = torch.randn(n, *shape, generator=g)
    return x, torch.randint(0, 10, (n,), generator=g)


def make_model(name: str):
    """(model, input shape, input kind) — seeded, in eval mode."""
    if name in ("mlp400k", "transformer"):  # the matrix's MLP 784-512-10 and its encoder
        return make({"mlp400k": "mlp2", "transformer": "encoder"}[name])
    torch.manual_seed(0)
    if name == "convnet":
        model = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 8 * 8, 10),
        )
        return model.eval(), (3, 32, 32), "float"
    return make(name)


def make(name: str):
    """A family of the benchmark matrix (seeded, in eval mode)."""
    torch.manual_seed(0)
    if name == "mlp2":
        return _mlp(784, 512, 10).eval(), (784,), "float"
    if name == "mlp3":
        return _mlp(784, 384, 256, 10).eval(), (784,), "float"
    if name == "mlp4":
        return _mlp(784, 320, 256, 128, 10).eval(), (784,), "float"
    if name == "mlp3w":
        return _mlp(256, 512, 512, 10).eval(), (256,), "float"
    if name == "convbn":
        model = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(64 * 8 * 8, 10),
        )
        return model.eval(), (3, 32, 32), "float"
    if name == "resnet18":
        return ResNet18().eval(), (3, 32, 32), "float"
    if name == "encoder":
        return TinyTransformer().eval(), (SEQ,), "tokens"
    if name == "gpt":
        return Decoder().eval(), (SEQ,), "tokens"
    raise ValueError(f"unknown model {name!r}; known: {', '.join(LABELS)}")
