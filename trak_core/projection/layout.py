"""The factored projection's layout: how a model's parameters are cut into blocks (one 2-D view of a weight and
its bias each), how each block's k output coordinates are split between its two sides, and the random side
matrices (a pure function of seed, model id, parameter name and side, cached per process). The projection
itself is :class:`trak_core.projection.factored.FactoredProjector`; its module docstring describes both.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from trak_core.errors import BadInputError
from trak_core.featurize.gradients import grad_param_names
from trak_core.projection import counter_rng
from trak_core.projection.base import ProjectionType, as_proj_type
from trak_core.projection.mha import ATTENTION, attention_bias, attention_owners, is_attention_weight

FLAT = "__flat__"
# a linear, conv or matrix block whose paired projection costs at most PAIRS_MAX_RATIO × its own forward per position,
# k · (d_in [+1] + d_out) ≤ PAIRS_MAX_RATIO · d_out · (d_in [+1]), gets one (p_j, q_j) pair per kept coordinate
# instead of the k_out × k_in grid (see "Pairs" in the module docstring); so does a small block that is not a conv
# (at most PAIRS_MAX_WEIGHTS weights and biases, pairs costing at most PAIRS_MAX_MACS multiply-adds per position)
PAIRS_MAX_WEIGHTS = 1 << 13
PAIRS_MAX_MACS = 1 << 16
PAIRS_MAX_RATIO = 3.0
#: how proj_dim is split between blocks: "energy" (∝ each block's gradient energy, at most its size and at least
#: MIN_SHARE each; needs the energies), "layer" (equal shares, at most a block's size each; layout version 4) or "size"
#: (∝ the blocks' sizes, layout version 3 and before)
SPLITS = ("energy", "layer", "size")
#: the fewest coordinates a block gets from the energy split (fewer where the block has fewer, or proj_dim is short)
MIN_SHARE = 4
OTHER = "__other__"
SIDE_IN, SIDE_OUT, SIDE_DENSE = 0, 1, 2
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
#: recorded in spec(): 5 = the split named in the spec (the energy split, with the energies it used), 4 = equal
#: shares per block and pairs for large layers, 3 = identity sides, 2 = the embedding and matrix block kinds (1,
#: unrecorded: linear/conv + "__other__")
LAYOUT_VERSION = 5
#: the kinds the fast path serves through forward hooks, and through weight substitution
HOOKED = ("linear", "conv", "embedding")
MATRIX = "matrix"
#: the most bytes of factor matrices a process keeps for new projectors (least recently used dropped first)
FACTOR_CACHE_BYTES = 256 * 2**20


# ---------------------------------------------------------------------------- random factors
def name_hash(name: str) -> int:
    """FNV-1a (32-bit) of the UTF-8 name."""
    h = 0x811C9DC5
    for byte in name.encode("utf-8"):
        h = ((h ^ byte) * 0x01000193) & counter_rng.MASK32
    return h


def factor_key(seed: int, model_id: int, name: str, side: int, sub: int = 0) -> int:
    """The 32-bit key of one factor stream (see the module docstring)."""
    base = counter_rng.stream_key(seed, model_id, counter_rng.STREAM_FACTOR)
    k = counter_rng.mix32_int(base ^ name_hash(name))
    return counter_rng.mix32_int((k + (4 * side + sub + 1) * counter_rng.GOLDEN) & counter_rng.MASK32)


_CACHE: OrderedDict[tuple, Tensor] = OrderedDict()
_CACHE_LOCK = threading.Lock()


def clear_factor_cache() -> None:
    """Drop the factor matrices this process keeps (:data:`FACTOR_CACHE_BYTES`)."""
    with _CACHE_LOCK:
        _CACHE.clear()


def _cache_bytes() -> int:
    return sum(t.numel() * t.element_size() for t in _CACHE.values())


def factor_matrix(
    seed: int, model_id: int, name: str, side: int, rows: int, cols: int, proj_type: str | ProjectionType, device=None
) -> Tensor:
    """rows × cols float32 factor of block ``name`` (±1 or standard normal entries), on ``device``.

    The dense matrices of :mod:`trak_core.projection.counter_rng` under the block's keys (see the module docstring).
    Kept in a per-process LRU cache of at most :data:`FACTOR_CACHE_BYTES` (a pure function of the
    arguments): the returned tensor is shared, callers must not modify it in place.
    """
    pt = as_proj_type(proj_type)
    dev = torch.device("cpu") if device is None else torch.device(device)
    key = (int(seed), int(model_id), name, int(side), int(rows), int(cols), pt.value, str(dev))
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit
    if pt == ProjectionType.rademacher:
        out = counter_rng.rademacher_from_key(factor_key(seed, model_id, name, side, 0), 0, rows, cols, device=dev)
    else:
        out = counter_rng.normal_from_keys(
            factor_key(seed, model_id, name, side, 0),
            factor_key(seed, model_id, name, side, 1),
            0,
            rows,
            cols,
            device=dev,
        )
    size = out.numel() * out.element_size()
    if size <= FACTOR_CACHE_BYTES:
        with _CACHE_LOCK:
            _CACHE[key] = out
            while _cache_bytes() > FACTOR_CACHE_BYTES:
                _CACHE.popitem(last=False)
    return out


# ---------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class Block:
    """One block of the gradient vector.

    kind: "linear" | "conv" | "embedding" | "matrix" (factored), "flat" (the vector as a d_out × d_in matrix)
    or "other" (dense); see the module docstring.
    params: the parameter names in the block ((weight[, bias]) or the other parameters).
    d_out, d_in: the factored shape (d_in without the bias coordinate); for "other" d_in = size, d_out = 1.
    k, k_out, k_in: its share of proj_dim and the factor widths (k ≤ k_out · k_in).
    pairs: k independent (p_outⱼ, p_inⱼ) pairs instead of the grid; id_out / id_in: that side is the identity
    (k_out = d_out / k_in = d_in [+1]; "Identity sides" in the module docstring).
    """

    name: str
    kind: str
    params: tuple
    d_out: int
    d_in: int
    bias: bool
    size: int
    k: int = 0
    k_out: int = 0
    k_in: int = 0
    pairs: bool = False
    id_out: bool = False
    id_in: bool = False

    @property
    def in_rows(self) -> int:
        return self.d_in + int(self.bias)


@dataclass(frozen=True)
class Layout:
    """Blocks and the parameter order of the gradient vector ((name, shape) in vector order)."""

    blocks: tuple
    param_shapes: tuple
    model_bound: bool

    @property
    def grad_dim(self) -> int:
        return sum(math.prod(s) for _, s in self.param_shapes)

    def offsets(self) -> dict:
        out, o = {}, 0
        for n, s in self.param_shapes:
            out[n] = (o, tuple(s))
            o += math.prod(s)
        return out

    def describe(self) -> list:
        # "pairs", "id_out", "id_in" are appended only where used, so that other blocks describe themselves as before
        return [
            [
                b.name,
                b.kind,
                b.d_out,
                b.d_in,
                b.bias,
                b.k,
                b.k_out,
                b.k_in,
                *(["pairs"] if b.pairs else []),
                *(["id_out"] if b.id_out else []),
                *(["id_in"] if b.id_in else []),
            ]
            for b in self.blocks
        ]


def recorded_blocks(params: dict) -> list[Block]:
    """The blocks of a recorded factored projection (its spec's ``"layout"`` table, :meth:`Layout.describe`), in
    row order, without their parameter names: what regenerates the side matrices and the coordinate weights."""
    out = []
    for row in params.get("layout", []):
        name, kind, d_out, d_in, bias, k, k_out, k_in, *flags = row
        size = int(d_in) if kind == "other" else int(d_out) * (int(d_in) + int(bool(bias)))
        out.append(Block(str(name), str(kind), (), int(d_out), int(d_in), bool(bias), size, int(k), int(k_out),
                         int(k_in), "pairs" in flags, "id_out" in flags, "id_in" in flags))  # fmt: skip
    return out


def _apportion(sizes: Sequence[int], total: int) -> list[int]:
    """Largest-remainder split of ``total`` ∝ sizes, at least 1 each (ties: lower index first)."""
    n = len(sizes)
    if total < n:
        raise BadInputError(
            f"factored projection: proj_dim={total} is smaller than the number of blocks ({n}); "
            "each layer needs at least one dimension"
        )
    s = sum(sizes)
    spare = total - n  # 1 each, the rest proportional
    raw = [spare * x / s for x in sizes]
    base = [int(math.floor(r)) for r in raw]
    left = spare - sum(base)
    order = sorted(range(n), key=lambda i: (-(raw[i] - base[i]), i))
    for i in order[:left]:
        base[i] += 1
    return [b + 1 for b in base]


def _split_equal(sizes: Sequence[int], total: int) -> list[int]:
    """Equal shares of ``total``, none above its size (water-filling: a block smaller than its share keeps its
    size, the rest is shared again), rounded by largest remainder (ties: lower index first), at least 1 each;
    ∝ size (:func:`_apportion`) when ``total`` exceeds all the sizes together."""
    n = len(sizes)
    if total < n:
        raise BadInputError(
            f"factored projection: proj_dim={total} is smaller than the number of blocks ({n}); "
            "each layer needs at least one dimension"
        )
    if total > sum(sizes):  # more dimensions than coordinates: every block is over its size, ∝ size as before
        return _apportion(sizes, total)
    share = [0.0] * n
    free, left = list(range(n)), float(total)
    while free:
        each = left / len(free)
        full = [i for i in free if sizes[i] <= each]
        if not full:
            for i in free:
                share[i] = each
            break
        for i in full:
            share[i] = float(sizes[i])
            left -= sizes[i]
        free = [i for i in free if sizes[i] > each]
    out = [max(1, math.floor(x)) for x in share]
    order = sorted(range(n), key=lambda i: (-(share[i] - math.floor(share[i])), i))
    spare = total - sum(out)
    while spare > 0:  # the floors' remainder, one each by largest fraction, never above a block's size
        for i in order:
            if spare > 0 and out[i] < sizes[i]:
                out[i] += 1
                spare -= 1
    return out


def _fill(weights: Sequence[float], lo: Sequence[int], hi: Sequence[int], total: int) -> list[float]:
    """x_i = clamp(c · w_i, lo_i, hi_i) (lo_i where w_i = 0) with the c that makes Σ x_i = ``total`` (water-filling);
    needs Σ lo ≤ total ≤ Σ_{w>0} hi + Σ_{w=0} lo."""
    n = len(weights)

    def at(c: float) -> list[float]:
        return [
            min(float(hi[i]), max(float(lo[i]), c * weights[i])) if weights[i] > 0 else float(lo[i]) for i in range(n)
        ]

    live = [i for i in range(n) if weights[i] > 0]
    points = sorted({0.0} | {lo[i] / weights[i] for i in live} | {hi[i] / weights[i] for i in live})
    prev = 0.0
    for t in points:  # g(c) = Σ x_i(c) is continuous, nondecreasing and linear between consecutive points
        if sum(at(t)) >= total:
            below = sum(at(prev))
            slope = sum(weights[i] for i in live if lo[i] <= prev * weights[i] and t * weights[i] <= hi[i])
            return at(prev + (total - below) / slope if slope > 0 and t > prev else t)
        prev = t
    return at(points[-1])


def _round_shares(x: Sequence[float], lo: Sequence[int], hi: Sequence[int], total: int) -> list[int]:
    """Integers within [lo_i, hi_i] summing to ``total``: the floors of ``x``, then one more each by largest
    fraction (ties: lower index first)."""
    n = len(x)
    out = [min(hi[i], max(lo[i], math.floor(x[i] + 1e-9))) for i in range(n)]
    frac = [x[i] - math.floor(x[i] + 1e-9) for i in range(n)]
    order = sorted(range(n), key=lambda i: (-frac[i], i))
    spare = total - sum(out)
    while spare > 0:
        for i in order:
            if spare > 0 and out[i] < hi[i]:
                out[i] += 1
                spare -= 1
    while spare < 0:  # rounding put a floor above its share: one less each, smallest fraction first
        for i in reversed(order):
            if spare < 0 and out[i] > lo[i]:
                out[i] -= 1
                spare += 1
    return out


def _split_energy(energy: Sequence[float], sizes: Sequence[int], total: int) -> list[int]:
    """``total`` split ∝ ``energy`` (a block's mean ‖∂f/∂θ_block‖²), water-filled at each block's size and at least
    min(MIN_SHARE, size, ⌊total / blocks⌋) each (a block of zero energy gets that floor); when the blocks with
    energy are all whole, the blocks without share the rest equally; equal shares when no block has energy; ∝ size
    (:func:`_apportion`) when ``total`` exceeds all the sizes together. Largest-remainder rounding, Σ = total."""
    n = len(sizes)
    if total < n:
        raise BadInputError(
            f"factored projection: proj_dim={total} is smaller than the number of blocks ({n}); "
            "each layer needs at least one dimension"
        )
    if total > sum(sizes):
        return _apportion(sizes, total)
    lo = [min(MIN_SHARE, s, total // n) for s in sizes]
    w = [float(e) for e in energy] if any(e > 0 for e in energy) else [1.0] * n
    whole = sum(sizes[i] if w[i] > 0 else lo[i] for i in range(n))
    if whole < total:  # every block with energy whole: the rest is shared equally by those without
        x = _fill(
            [0.0 if w[i] > 0 else 1.0 for i in range(n)],
            [sizes[i] if w[i] > 0 else lo[i] for i in range(n)],
            sizes,
            total,
        )
    else:
        x = _fill(w, lo, sizes, total)
    return _round_shares(x, lo, sizes, total)


def block_energies(blocks: Sequence[Block], energies: dict, names: Iterable[str]) -> list[float]:
    """Each block's energy: the sum of its parameters' entries of ``energies`` ({parameter name: mean per-example
    ‖∂f/∂θ‖²}; a parameter left out counts 0). Refuses (BadInputError) names that are not among ``names`` (the
    parameters of the gradient) and values that are not finite and ≥ 0."""
    if not isinstance(energies, dict):
        raise BadInputError(
            f"factored projection: energies must be a dict {{parameter name: energy}}, got {type(energies).__name__}"
        )
    known = set(names)
    unknown = [k for k in energies if k not in known]
    if unknown:
        raise BadInputError(
            f"factored projection: energies name parameters that are not in the gradient (grad_wrt): "
            f"{sorted(map(str, unknown))[:10]}"
        )
    bad = [
        k
        for k, v in energies.items()
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
    ]
    if bad:
        raise BadInputError(f"factored projection: energies must be finite numbers ≥ 0; not so for {sorted(bad)[:10]}")
    return [sum(float(energies.get(p, 0.0)) for p in b.params) for b in blocks]


def _pairs(b: Block, k: int) -> bool:
    """Whether block ``b`` with ``k`` coordinates gets pairs (see "Pairs" in the module docstring)."""
    macs = k * (b.in_rows + (1 if b.kind == "embedding" else b.d_out))
    if b.kind in ("linear", "conv", MATRIX) and macs <= PAIRS_MAX_RATIO * b.d_out * b.in_rows:
        return True  # relative to the layer's forward, whatever its number of positions
    # small blocks, except convs (a conv may run at thousands of positions: its cost is bounded by the ratio only)
    return b.kind != "conv" and b.size <= PAIRS_MAX_WEIGHTS and macs <= PAIRS_MAX_MACS


def _pairs_v3(b: Block, k: int) -> bool:
    """Layout version 3's rule (``split="size"``): small blocks only."""
    return b.size <= PAIRS_MAX_WEIGHTS and k * (b.in_rows + (1 if b.kind == "embedding" else b.d_out)) <= PAIRS_MAX_MACS


def _factor(k: int, out_dim: int, in_dim: int) -> tuple[int, int]:
    k_out = min(out_dim, math.isqrt(k - 1) + 1)
    k_in = -(-k // k_out)
    if k_in > in_dim:
        k_in = in_dim
        k_out = -(-k // k_in)
    return k_out, k_in


def _identity_sides(k: int, k_out: int, k_in: int, d_out: int, in_rows: int) -> tuple[bool, bool]:
    """(id_out, id_in) of a grid block (see "Identity sides" in the module docstring)."""
    full_out, full_in = k_out == d_out, k_in == in_rows
    if full_out and full_in and k == d_out * in_rows:  # the block itself, exactly
        return True, True
    # one identity side: each of its indices keeps ≥ 1 of the first k row-major coordinates (then unbiased)
    out_ok = full_out and (k_out - 1) * k_in < k
    in_ok = full_in and k >= k_in
    if out_ok and in_ok:  # the smaller side: the random side then gets the most coordinates per identity index
        return d_out <= in_rows, d_out > in_rows
    return out_ok, in_ok


def coordinate_counts(b: Block) -> Tensor | None:
    """For a block with exactly one identity side: per kept coordinate (k,), the number c of kept coordinates
    that share its identity index (row i for ``id_out``, column j for ``id_in`` of the row-major
    (k_out, k_in) grid); None otherwise."""
    if b.id_out == b.id_in:
        return None
    t = torch.arange(b.k)
    idx = t // b.k_in if b.id_out else t % b.k_in
    return torch.bincount(idx)[idx]


def coordinate_weights(b: Block, proj_dim: int) -> float | Tensor:
    """The weight of each kept coordinate of a factored block: √(proj_dim / k) (a float), √proj_dim when both
    sides are the identity, and a (k,) float64 tensor √(proj_dim / c) with one identity side (the unbiased
    weights of "Identity sides" in the module docstring)."""
    if b.id_out and b.id_in:
        return math.sqrt(proj_dim)
    c = coordinate_counts(b)
    if c is None:
        return math.sqrt(proj_dim / b.k)
    return torch.sqrt(proj_dim / c.to(torch.float64))


def check_split(split: str, energies: dict | None) -> None:
    """Refuse (BadInputError) an unknown split, "energy" without energies and energies with another split."""
    if split not in SPLITS:
        raise BadInputError(f"factored projection: split must be one of {SPLITS}, got {split!r}")
    if split == "energy" and energies is None:
        raise BadInputError(
            "factored projection: split='energy' needs energies= ({parameter name: mean per-example ‖∂f/∂θ‖²}, "
            "trak_core.projection.energy.sketched_energies); or pass split='layer'"
        )
    if split != "energy" and energies is not None:
        raise BadInputError(f"factored projection: energies= are used by split='energy' only, not split={split!r}")


def _with_split(blocks: list[Block], proj_dim: int, split: str = "layer", energy: Sequence[float] = ()) -> tuple:
    """The blocks with their shares of ``proj_dim`` (``energy``: each block's, for ``split="energy"``)."""
    check_split(split, {} if split == "energy" else None)
    sizes = [b.size for b in blocks]
    if split == "energy":
        ks = _split_energy(energy, sizes, proj_dim)
    else:
        ks = _split_equal(sizes, proj_dim) if split == "layer" else _apportion(sizes, proj_dim)
    v3 = split == "size"
    out = []
    for b, k in zip(blocks, ks, strict=True):
        if b.kind == "other":
            out.append(Block(**{**asdict(b), "k": k, "k_out": 1, "k_in": k}))
        elif not v3 and b.kind != "flat" and k == b.size:  # the whole block, exactly
            out.append(
                Block(**{**asdict(b), "k": k, "k_out": b.d_out, "k_in": b.in_rows, "id_out": True, "id_in": True})
            )
        elif _pairs_v3(b, k) if v3 else _pairs(b, k):
            out.append(Block(**{**asdict(b), "k": k, "k_out": k, "k_in": k, "pairs": True}))
        else:
            ko, ki = _factor(k, b.d_out, b.in_rows)
            io, ii = _identity_sides(k, ko, ki, b.d_out, b.in_rows)
            out.append(Block(**{**asdict(b), "k": k, "k_out": ko, "k_in": ki, "id_out": io, "id_in": ii}))
    names = [b.name for b in out]
    hashes = {name_hash(n) for n in names}
    if len(hashes) != len(names):
        raise BadInputError(f"factored projection: two block names share a 32-bit hash ({names}); rename a module")
    return tuple(out)


def flat_layout(grad_dim: int, proj_dim: int) -> Layout:
    d_in = math.isqrt(grad_dim - 1) + 1
    d_out = -(-grad_dim // d_in)
    blocks = _with_split([Block(FLAT, "flat", ("<vector>",), d_out, d_in, False, grad_dim)], proj_dim)
    return Layout(blocks, (("<vector>", (grad_dim,)),), False)


def _embedding_ok(mod: nn.Embedding) -> bool:
    """An embedding the hook reproduces exactly (max_norm renormalizes the table in place, scale_grad_by_freq
    rescales by in-batch counts, sparse gradients: those tables stay in "__other__")."""
    return mod.max_norm is None and not mod.scale_grad_by_freq and not mod.sparse


def _supported(mod: nn.Module) -> str | None:
    if type(mod).__name__ == "NonDynamicallyQuantizableLinear":  # used by MultiheadAttention without forward
        return None
    if isinstance(mod, nn.Linear):
        return "linear"
    if isinstance(mod, _CONV) and mod.groups == 1:
        return "conv"
    if isinstance(mod, nn.Embedding) and _embedding_ok(mod):
        return "embedding"
    return None


def _bias_name(wname: str) -> str | None:
    """``x.bias`` for ``x.weight``, ``in_proj_bias`` for ``in_proj_weight`` (None: no such pairing)."""
    if not wname.endswith("weight"):
        return None
    prefix = wname[: -len("weight")]
    return prefix + "bias" if prefix == "" or prefix.endswith((".", "_")) else None


def model_layout(
    model: nn.Module,
    proj_dim: int,
    grad_wrt: Iterable[str] | None = None,
    other: str = "dense",
    split: str = "layer",
    energies: dict | None = None,
) -> Layout:
    """The per-layer layout of ``model``'s gradient (restricted to ``grad_wrt``), proj_dim split (``split``:
    one of :data:`SPLITS`; ``"energy"`` by ``energies``, {parameter name: mean per-example ‖∂f/∂θ‖²})."""
    if other not in ("dense", "error"):
        raise BadInputError(f"other must be 'dense' or 'error', got {other!r}")
    check_split(split, energies)
    names = grad_param_names(model, grad_wrt)
    if energies is not None:
        block_energies([], energies, names)  # refuse unknown names and bad values before any work
    params = dict(model.named_parameters())
    keep = set(names)
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    layer_of: dict[str, Block] = {}
    dense_only: set[int] = set()  # tables of unsupported embeddings: "__other__" as before
    for mname, mod in model.named_modules():
        if isinstance(mod, nn.Embedding) and not _embedding_ok(mod):
            dense_only.add(id(mod.weight))
        kind = _supported(mod)
        if kind is None:
            continue
        prefix = f"{mname}." if mname else ""
        wname, bname = prefix + "weight", prefix + "bias"
        if wname not in keep or params.get(wname) is not mod.weight or uses[id(mod.weight)] > 1:
            continue
        bias = getattr(mod, "bias", None)
        has_bias = bias is not None and bname in keep and params.get(bname) is bias and uses[id(bias)] == 1
        w = params[wname]  # mod.weight (checked above), as the named parameter (never None)
        d_out, d_in = w.shape[0], math.prod(w.shape[1:])
        blk = Block(
            mname, kind, (wname, bname) if has_bias else (wname,), d_out, d_in, has_bias, d_out * (d_in + int(has_bias))
        )
        layer_of[wname] = blk
        if has_bias:
            layer_of[bname] = blk
    for n in names:  # every other parameter of ≥ 2 dimensions (≥ 2 rows and columns): weight substitution
        w = params[n]
        if n in layer_of or id(w) in dense_only or w.dim() < 2 or w.shape[0] < 2 or w[0].numel() < 2:
            continue
        bn = _bias_name(n) or ""
        b = params.get(bn)
        has_bias = b is not None and bn in keep and bn not in layer_of and b.dim() == 1 and b.shape[0] == w.shape[0]
        d_out, d_in = w.shape[0], w[0].numel()
        blk = Block(n, MATRIX, (n, bn) if has_bias else (n,), d_out, d_in, has_bias, d_out * (d_in + int(has_bias)))
        layer_of[n] = blk
        if has_bias:
            layer_of[bn] = blk
    blocks: list[Block] = []
    seen: set[str] = set()
    rest: list[str] = []
    for n in names:  # blocks in the order of their first parameter in the gradient vector
        layer = layer_of.get(n)
        if layer is None:
            rest.append(n)
        elif layer.name not in seen:
            seen.add(layer.name)
            blocks.append(layer)
    if rest:
        if other == "error":
            kinds = {}
            for mname, mod in model.named_modules():
                for pn, _ in mod.named_parameters(recurse=False):
                    kinds[f"{mname}.{pn}" if mname else pn] = type(mod).__name__
            shown = [f"{n} {tuple(params[n].shape)} ({kinds.get(n, '?')})" for n in rest[:10]]
            raise BadInputError(
                "factored projection factors nn.Linear, nn.Conv1d/2d/3d (groups=1), nn.Embedding (without "
                "max_norm, scale_grad_by_freq, sparse) layers and parameters of at least 2 rows and 2 columns; "
                f"these parameters are none of them: {shown}{' ...' if len(rest) > 10 else ''}. Restrict "
                "grad_wrt, or pass other='dense' to project them densely"
            )
        size = sum(params[n].numel() for n in rest)
        blocks.append(Block(OTHER, "other", tuple(rest), 1, size, False, size))
    shapes = tuple((n, tuple(params[n].shape)) for n in names)
    energy = block_energies(blocks, energies, names) if energies is not None else []
    return Layout(_with_split(blocks, proj_dim, split, energy), shapes, True)


# ---------------------------------------------------------------------------- hooked matrix blocks
def is_conv1d(mod: nn.Module) -> bool:
    """transformers' ``Conv1D`` (recognized by duck typing: class name, ``nf``, weight [nx, nf]; y = x W + b)."""
    w = getattr(mod, "weight", None)
    return (
        type(mod).__name__ == "Conv1D"
        and isinstance(getattr(mod, "nf", None), int)
        and isinstance(w, Tensor)
        and w.dim() == 2
        and w.shape[1] == mod.nf
    )


def _use_kind(mod: nn.Module) -> str | None:
    """How a module uses its ``weight`` in its forward, where the fast path can hook it (None: it cannot)."""
    if is_conv1d(mod):
        return "conv1d"
    kind = _supported(mod)
    return kind if kind in ("linear", "embedding") else None


def matrix_uses(model: nn.Module, layout: Layout) -> dict[str, tuple]:
    """The matrix blocks whose weight (and bias) the model uses only through module forwards the fast path hooks,
    or through ``nn.MultiheadAttention``'s attention function: {block name: ((module name, use, with_bias), ...)},
    use "linear" / "embedding" (the block's d_out × d_in view is the module's), "conv1d" (transformers' Conv1D:
    W [in, out], the view in × out) or "attention" (an attention's in-projection or out_proj weight,
    :mod:`trak_core.projection.mha`); with_bias: that module's bias is the block's bias. A weight tied between modules
    (an embedding and an output head) lists each.
    """
    if not layout.model_bound:
        return {}
    blocks = {b.params[0]: b for b in layout.blocks if b.kind == MATRIX}
    if not blocks:
        return {}
    params = dict(model.named_parameters())
    roles = attention_owners(model)
    owners: dict[int, list] = {}  # id(parameter) → [(module name, module, attribute)]
    for mname, mod in model.named_modules():
        for pn, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((mname, mod, pn))
    out: dict[str, tuple] = {}
    for wname, b in blocks.items():
        w = params[wname]
        uses = [(mname, mod, pn, _weight_use(mod, pn, roles)) for mname, mod, pn in owners.get(id(w), [])]
        if not uses or any(kind is None for *_, kind in uses):
            continue
        bias = params[b.params[1]] if b.bias else None
        battr = {id(mod): _bias_attr(mod, pn, roles) for _, mod, pn, _ in uses}
        if bias is not None and any(battr.get(id(mod)) != pn for _, mod, pn in owners.get(id(bias), [])):
            continue
        out[b.name] = tuple(
            (mname, kind, bias is not None and getattr(mod, battr[id(mod)] or "", None) is bias)
            for mname, mod, _, kind in uses
        )
    return out


def _weight_use(mod: nn.Module, attr: str, roles: dict) -> str | None:
    """How ``mod`` uses its parameter ``attr`` where the fast path can hook it (None: it cannot)."""
    if is_attention_weight(roles.get(id(mod)), attr):
        return ATTENTION
    return _use_kind(mod) if attr == "weight" else None


def _bias_attr(mod: nn.Module, attr: str, roles: dict) -> str | None:
    """The attribute of the bias ``mod`` applies with its weight ``attr`` (None: none)."""
    role = roles.get(id(mod))
    return attention_bias(role, attr) if role is not None else "bias"
