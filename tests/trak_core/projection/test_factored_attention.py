"""The factored projector on transformer-style models: embedding blocks (a forward hook gathering rows of
P_out by token id) and matrix blocks (2-D parameters used outside a module's forward: nn.MultiheadAttention's
in_proj_weight / out_proj, served inside its attention function (more cases: test_factored_mha.py), position
tables and tied weights, by weight substitution).

Every fast-path result is checked in float64 against two references: the projector applied to per-example
gradients materialized by brute force (torch.func vmap(grad)), and the block definition
vec(P_outᵀ [∂W | ∂b] P_in)[:k] · √(proj_dim / k) written out with the factor matrices.
"""

import logging
import math
import warnings

import pytest
import torch
from torch import nn
from torch.func import grad, vmap
from trak_fixtures import REPO_ROOT

import trak_core
from trak_core.errors import BadInputError, StoreMismatchError
from trak_core.featurize.gradients import FunctionalGradientComputer
from trak_core.featurize.modelout import ImageClassificationModelOutput
from trak_core.projection import counter_rng
from trak_core.projection import layout as factored
from trak_core.projection.factored import (
    LAYOUT_VERSION,
    OTHER,
    SIDE_DENSE,
    SIDE_IN,
    SIDE_OUT,
    FactoredProjector,
    clear_factor_cache,
    factor_matrix,
)
from trak_core.store import StoreMetadata, TrakStore
from trak_core.testing import ProjectorCase, parametrize_with_checks

TASK = ImageClassificationModelOutput()
VOCAB, SEQ, DIM, HEADS, CLASSES = 11, 6, 8, 2, 3


# ---------------------------------------------------------------------------- models
class Text(nn.Module):
    """Token embedding (optional padding_idx) + a bare position table + attention + a classifier head.

    attn: "mha" (nn.MultiheadAttention, batch_first or not), "encoder" (nn.TransformerEncoderLayer, batch_first
    or not, post- or pre-norm), "tied" (an output layer over the vocabulary shares the embedding table)."""

    def __init__(self, attn="encoder", batch_first=True, padding_idx=None, norm_first=False, dim=DIM, vocab=VOCAB):
        super().__init__()
        self.attn_kind, self.batch_first = attn, batch_first
        self.tok = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.pos = nn.Parameter(0.3 * torch.randn(SEQ, dim))
        if attn == "mha":
            self.attn = nn.MultiheadAttention(dim, HEADS, batch_first=batch_first)
        elif attn == "encoder":
            self.attn = nn.TransformerEncoderLayer(
                dim, HEADS, 2 * dim, dropout=0.0, batch_first=batch_first, norm_first=norm_first
            )
        self.head = nn.Linear(dim, CLASSES)
        if attn == "tied":
            self.out = nn.Linear(dim, vocab, bias=False)
            self.out.weight = self.tok.weight

    def forward(self, ids):
        h = self.tok(ids) + self.pos[: ids.shape[-1]]
        if self.attn_kind == "tied":
            return self.out(torch.tanh(h).mean(-2))[..., :CLASSES] + self.head(h.mean(-2))
        if not self.batch_first:
            h = h.transpose(0, 1)
        h = self.attn(h, h, h, need_weights=False)[0] if self.attn_kind == "mha" else self.attn(h)
        if not self.batch_first:
            h = h.transpose(0, 1)
        return self.head(torch.tanh(h).mean(-2))


def _data(n=5, padding_idx=None):
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    ids[0, :3] = 7  # a token repeated within one example
    ids[1, 2] = ids[1, 4] = 2
    if padding_idx is not None:
        ids[:3, -2:] = padding_idx  # padded tails
    return ids, torch.randint(0, CLASSES, (n,), generator=g)


def _brute_grads(model, batch, names):
    """Per-example gradients {name: (B, *shape)} by torch.func: vmap(grad(f)) over the examples."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.detach() for n, b in model.named_buffers()}

    def f(w, ids, label):
        return TASK.get_output(model, {**params, **w}, buffers, ids, label)

    with warnings.catch_warnings():  # the fused CPU attention kernel has no batching rule: vmap loops
        warnings.simplefilter("ignore")
        return vmap(grad(f), in_dims=(None, 0, 0))({n: params[n] for n in names}, *batch)


def _weights(b, proj_dim: int) -> torch.Tensor:
    """Per kept coordinate t = (i, j) of the row-major (k_out, k_in) grid: √(proj_dim / k), √proj_dim with both
    sides the identity, √(proj_dim / c) with one (c: the kept coordinates of row i for id_out, column j for id_in),
    counted here coordinate by coordinate."""
    ij = [divmod(t, b.k_in) for t in range(b.k)]
    if b.id_out and b.id_in:
        return torch.full((b.k,), math.sqrt(proj_dim), dtype=torch.float64)
    if not (b.id_out or b.id_in):
        return torch.full((b.k,), math.sqrt(proj_dim / b.k), dtype=torch.float64)
    side = [i if b.id_out else j for i, j in ij]
    return torch.tensor([math.sqrt(proj_dim / side.count(s)) for s in side], dtype=torch.float64)


def _definition(p: FactoredProjector, grads: dict, model_id: int) -> torch.Tensor:
    """The projection written out from the module docstring's definition, block by block (float64)."""
    outs = []
    bsz = next(iter(grads.values())).shape[0]
    for b in p.blocks:
        w = math.sqrt(p.proj_dim / b.k) if b.kind == "other" or b.pairs else _weights(b, p.proj_dim)
        if b.kind == "other":
            g = torch.cat([grads[n].reshape(bsz, -1) for n in b.params], 1)
            m = factor_matrix(p.seed, model_id, b.name, SIDE_DENSE, b.size, b.k, p.proj_type).double()
            outs.append(g @ m * w)
            continue
        cols = [grads[b.params[0]].reshape(bsz, b.d_out, b.d_in)]
        if b.bias:
            cols.append(grads[b.params[1]].reshape(bsz, b.d_out, 1))
        g_aug = torch.cat(cols, 2)  # [∂W | ∂b]
        p_in = factor_matrix(p.seed, model_id, b.name, SIDE_IN, b.in_rows, b.k_in, p.proj_type).double()
        p_out = factor_matrix(p.seed, model_id, b.name, SIDE_OUT, b.d_out, b.k_out, p.proj_type).double()
        if b.id_in:  # a side as wide as its dimension: the identity ("Identity sides")
            p_in = torch.eye(b.in_rows, dtype=torch.float64)
        if b.id_out:
            p_out = torch.eye(b.d_out, dtype=torch.float64)
        full = p_out.T @ g_aug @ p_in  # (B, k_out, k_in); pairs: k_out = k_in = k, coordinate j = its (j, j) entry
        outs.append((torch.diagonal(full, dim1=1, dim2=2) if b.pairs else full.reshape(bsz, -1)[:, : b.k]) * w)
    return torch.cat(outs, 1)


def _fast(p, model, batch, model_id=3):
    gc = FunctionalGradientComputer(model, TASK, dtype=torch.float64)
    return p.featurize_batch(model, TASK, gc._weights(), gc._buffers(), batch, model_id)


def _check_all_paths(model, batch, proj_dim=40, proj_type="rademacher"):
    torch.manual_seed(0)
    model = model.double().eval()
    batch = tuple(t.double() if t.is_floating_point() else t for t in batch)
    p = FactoredProjector.from_model(model, proj_dim, seed=5, proj_type=proj_type, dtype=torch.float64)
    names = [n for n, _ in p.layout.param_shapes]
    grads = _brute_grads(model, batch, names)
    want = _definition(p, grads, 3)
    slow = p.project(grads, model_id=3)
    fast = _fast(p, model, batch)
    assert fast.dtype == torch.float64 and fast.shape == (batch[0].shape[0], proj_dim)
    assert float(want.abs().max()) > 0
    torch.testing.assert_close(slow, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(fast, want, rtol=1e-8, atol=1e-10 * float(want.abs().max()))
    return p, grads


# ---------------------------------------------------------------------------- the fast path = the definition
@pytest.mark.parametrize(
    "kw",
    [
        {"attn": "mha", "batch_first": True},
        {"attn": "mha", "batch_first": False},
        {"attn": "encoder", "batch_first": True},
        {"attn": "encoder", "batch_first": False, "norm_first": True},
        {"attn": "encoder", "batch_first": True, "padding_idx": 0},
        {"attn": "tied", "padding_idx": 3},
    ],
    ids=["mha-batch-first", "mha-seq-first", "encoder", "encoder-seq-first-prenorm", "padding-idx", "tied-weights"],
)
def test_fast_path_equals_brute_force_and_definition(kw):
    torch.manual_seed(0)
    model = Text(**kw)
    p, grads = _check_all_paths(model, _data(padding_idx=kw.get("padding_idx")))
    kinds = {b.name: b.kind for b in p.blocks}
    if kw["attn"] == "tied":  # the shared table: a matrix block (substitution), not the embedding hook
        assert kinds["tok.weight"] == "matrix"
        assert "out" not in kinds and "head" in kinds
    else:
        assert kinds["tok"] == "embedding"
    assert kinds["pos"] == "matrix"
    if kw["attn"] == "mha":
        blk = next(b for b in p.blocks if b.name == "attn.in_proj_weight")
        assert blk.kind == "matrix" and blk.params == ("attn.in_proj_weight", "attn.in_proj_bias") and blk.bias
        assert kinds["attn.out_proj.weight"] == "matrix"
    if kw["attn"] == "encoder":
        assert kinds["attn.self_attn.in_proj_weight"] == "matrix"
        assert kinds["attn.linear1"] == "linear" and kinds["attn.linear2"] == "linear"
        other = next(b for b in p.blocks if b.kind == "other")  # the LayerNorms only
        assert all(".norm" in n for n in other.params) and other.size == 4 * DIM
    if kw.get("padding_idx") is not None and kw["attn"] != "tied":
        assert float(grads["tok.weight"][:, kw["padding_idx"]].abs().max()) == 0  # torch: no gradient there


def test_normal_factors_and_grad_wrt_subsets():
    torch.manual_seed(1)
    model = Text("encoder")
    _check_all_paths(model, _data(), proj_type="normal")
    # in_proj_bias without its weight, a LayerNorm and the head: the bias alone goes to the dense block
    model = Text("mha").double().eval()
    wrt = ["attn.in_proj_bias", "pos", "head.weight"]
    p = FactoredProjector.from_model(model, 12, seed=2, grad_wrt=wrt, dtype=torch.float64)
    assert [(b.name, b.kind, b.params) for b in p.blocks] == [
        ("pos", "matrix", ("pos",)),
        ("head", "linear", ("head.weight",)),
        (OTHER, "other", ("attn.in_proj_bias",)),
    ]
    batch = _data()
    grads = _brute_grads(model, batch, [n for n, _ in p.layout.param_shapes])
    want = _definition(p, grads, 3)
    torch.testing.assert_close(_fast(p, model, batch), want, rtol=1e-8, atol=1e-10 * float(want.abs().max()))


def test_separate_qkv_weights_and_bias_kv():
    """kdim/vdim ≠ embed_dim: q/k/v_proj_weight are three matrix blocks (no bias of their own: in_proj_bias,
    3·E entries, goes to the dense block); bias_k / bias_v (1 × 1 × E) are too small to factor."""

    class Cross(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, DIM)
            self.mem = nn.Linear(DIM, 5)
            self.attn = nn.MultiheadAttention(DIM, HEADS, kdim=5, vdim=5, add_bias_kv=True, batch_first=True)
            self.head = nn.Linear(DIM, CLASSES)

        def forward(self, ids):
            h = self.tok(ids)
            m = torch.tanh(self.mem(h))
            return self.head(self.attn(h, m, m, need_weights=False)[0].mean(-2))

    torch.manual_seed(2)
    p, _ = _check_all_paths(Cross(), _data())
    kinds = {b.name: b.kind for b in p.blocks}
    assert [kinds[f"attn.{x}_proj_weight"] for x in "qkv"] == ["matrix"] * 3
    other = next(b for b in p.blocks if b.kind == "other")
    assert set(other.params) == {"attn.in_proj_bias", "attn.bias_k", "attn.bias_v"}


def _featurize_bench():
    """benchmarks/featurize_bench.py as a module (its models and data)."""
    import sys

    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        import featurize_bench
    finally:
        sys.path.pop(0)
    return featurize_bench


def test_benchmark_transformer_layout_and_fast_path():
    """The text model of benchmarks/featurize_bench.py: everything but the LayerNorms is factored."""
    fb = _featurize_bench()
    model, shape, _ = fb.make_model("transformer")
    p = FactoredProjector.from_model(model, 2048)
    other = next(b for b in p.blocks if b.kind == "other")
    assert other.size == 2 * 4 * fb.TRANSFORMER["DIM"]  # norm1/norm2 weight + bias per encoder layer
    assert {b.kind for b in p.blocks} == {"embedding", "matrix", "linear", "other"}
    x, y = fb.make_data(shape, "tokens", 3)
    model = model.double()
    small = FactoredProjector.from_model(model, 64, dtype=torch.float64)
    grads = _brute_grads(model, (x, y), [n for n, _ in small.layout.param_shapes])
    want = _definition(small, grads, 3)
    torch.testing.assert_close(_fast(small, model, (x, y)), want, rtol=1e-8, atol=1e-10 * float(want.abs().max()))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_benchmark_transformer_fast_path_on_cuda_equals_the_cpu():
    """On CUDA, scaled dot-product attention's fused kernels have backward passes that fail under the fast
    path's vmap (memory-efficient attention: "LSE is not correctly aligned (strideH)", seen on an H100 with
    torch 2.11): the fast path takes the math backend there too, and gives the CPU's numbers."""
    from trak_core.featurize.featurizer import Featurizer

    fb = _featurize_bench()
    model, shape, _ = fb.make_model("transformer")
    x, y = fb.make_data(shape, "tokens", 64)
    out = {}
    for dev in ("cpu", "cuda"):
        model = model.to(dev)
        f = Featurizer(model, "image_classification", FactoredProjector.from_model(model, 512, device=dev), device=dev)
        f.load_state(model.state_dict())
        out[dev] = f.project_batch([x.to(dev), y.to(dev)], 0, list(range(64))).cpu().double()
    assert float((out["cuda"] - out["cpu"]).abs().max() / out["cpu"].abs().max()) < 1e-4


# ---------------------------------------------------------------------------- the projector contract
def _text_projector(seed=3):
    """(blocks of a few rows, as in the tests above, are legal but distort Gaussian vectors more than the
    contract's JL bound allows at proj_dim 256: Kronecker sketches need some width; measured max relative
    error 0.28-0.42 at 6 × 8 blocks vs 0.22 on the benchmark's transformer)"""
    torch.manual_seed(0)
    return FactoredProjector.from_model(Text("encoder", padding_idx=0, dim=32, vocab=50), 256, seed=seed)


@parametrize_with_checks([ProjectorCase(_text_projector, id="factored-transformer-layout")])
def test_contract(obj, check):
    check(obj)


def test_inner_products_are_unbiased_on_gradients():
    """E⟨Px, Py⟩ = proj_dim · ⟨x, y⟩ over the whole gradient (``scale``): the mean over 200 seeds of
    ⟨Px, Py⟩ / scale is within 4 standard errors of ⟨x, y⟩, for real per-example gradients."""
    torch.manual_seed(0)
    model = Text("encoder").double().eval()
    batch = _data(2)
    names = [n for n, _ in model.named_parameters()]
    grads = _brute_grads(model, batch, names)
    flat = torch.cat([grads[n].reshape(2, -1) for n in names], 1)
    exact = float(flat[0] @ flat[1])
    vals = []
    for seed in range(200):
        p = FactoredProjector.from_model(model, 24, seed=seed, dtype=torch.float64)
        out = _fast(p, model, batch)
        vals.append(float(out[0] @ out[1]) / p.scale)
    v = torch.tensor(vals)
    se = float(v.std()) / math.sqrt(len(vals))
    assert p.scale == 24
    assert abs(float(v.mean()) - exact) < 4 * se, (float(v.mean()), exact, se)


# ---------------------------------------------------------------------------- errors
class _OutsideUse(Text):
    """Weights of hooked layers used outside their module's forward."""

    def forward(self, ids):
        if self.attn_kind == "functional":  # the embedding's forward is never called
            h = nn.functional.embedding(ids, self.tok.weight) + self.pos
            return self.head(h.mean(-2))
        h = self.tok(ids) + self.pos
        if self.attn_kind == "functied":  # the hook fires, but the table is also the output layer
            return self.head(h.mean(-2)) + torch.tanh(h).mean(-2) @ self.tok.weight[:CLASSES].T
        # "twice": the head through its forward and once more functionally
        return self.head(h.mean(-2)) + nn.functional.linear(torch.tanh(h[..., 0, :]), self.head.weight)


@pytest.mark.parametrize("use", ["functional", "functied", "twice"])
def test_weights_used_outside_their_forward_fall_back_to_substitution(use):
    """The hook of a layer misses uses of its weight outside the module's forward. The first batch checks
    for such uses (and for hooks that never fire); those blocks then take weight substitution — the same
    projection — with a warning, once."""
    torch.manual_seed(0)
    model = _OutsideUse(use).double().eval()
    batch = _data()
    p = FactoredProjector.from_model(model, 40, seed=5, dtype=torch.float64)
    grads = _brute_grads(model, batch, [n for n, _ in p.layout.param_shapes])
    want = _definition(p, grads, 3)
    culprit = "head" if use == "twice" else "tok"
    with pytest.warns(UserWarning, match=rf"layers \['{culprit}'\] are used outside"):
        got = _fast(p, model, batch)
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10 * float(want.abs().max()))
    assert p._substitute == {culprit}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # remembered: no second warning
        torch.testing.assert_close(_fast(p, model, batch), want, rtol=1e-8, atol=1e-10 * float(want.abs().max()))


def test_the_outside_use_check_passes_clean_models_once():
    torch.manual_seed(0)
    model = Text("encoder").double().eval()
    p = FactoredProjector.from_model(model, 40, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fast(p, model, _data())
    assert p._verified == {id(model)} and not p._substitute


def test_unsupported_embeddings_and_other_error():
    torch.manual_seed(0)
    model = Text("encoder")
    with pytest.raises(BadInputError, match=r"attn\.norm1\.weight \(8,\) \(LayerNorm\)"):
        FactoredProjector.from_model(model, 64, other="error")
    for kw in ({"max_norm": 1.0}, {"scale_grad_by_freq": True}, {"sparse": True}):
        model.tok = nn.Embedding(VOCAB, DIM, **kw)
        p = FactoredProjector.from_model(model, 64)
        other = next(b for b in p.blocks if b.kind == "other")
        assert "tok.weight" in other.params and "tok" not in {b.name for b in p.blocks}, kw
        with pytest.raises(BadInputError, match=r"tok\.weight \(11, 8\) \(Embedding\)"):
            FactoredProjector.from_model(model, 64, other="error")
    model.tok = nn.Embedding(VOCAB, DIM, scale_grad_by_freq=True)  # the dense block still projects it exactly
    _check_all_paths(model, _data())


# ---------------------------------------------------------------------------- layouts in stores
def test_spec_records_the_layout_version_and_old_stores_are_refused(tmp_path):
    torch.manual_seed(0)
    model = Text("encoder")
    spec = FactoredProjector.from_model(model, 64).spec()
    assert spec["layout_version"] == LAYOUT_VERSION == 5 and spec["split"] == "layer"
    assert [row[1] for row in spec["layout"]][:2] == ["matrix", "embedding"]  # pos, tok

    def traker(path):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return trak_core.TRAKer(
                model=model,
                task="image_classification",
                train_set_size=8,
                proj_dim=64,
                save_dir=str(path),
                device="cpu",
                logging_level=logging.ERROR,
            )

    first = traker(tmp_path / "new")  # a store of this version (created by the first featurize) reopens
    first.load_checkpoint(model.state_dict(), model_id=0)
    first.featurize(_data(8), num_samples=8)
    stored = first.store.meta.projector_params
    assert stored["layout_version"] == 5 and stored["split"] == "energy"
    del first
    assert traker(tmp_path / "new").projector.spec()["layout"] == stored["layout"]
    old = {k: v for k, v in spec.items() if k not in ("layout_version", "split")}  # written before layout versions
    TrakStore.create_or_open(str(tmp_path / "old"), StoreMetadata.from_projector(old, train_set_size=8))
    with pytest.raises(StoreMismatchError, match="projector_params.*layout_version=None"):
        traker(tmp_path / "old")
    # layout 2 (before identity sides): refused the same way, the recorded version named in the message
    v2 = {**old, "layout_version": 2}
    TrakStore.create_or_open(str(tmp_path / "v2"), StoreMetadata.from_projector(v2, train_set_size=8))
    with pytest.raises(StoreMismatchError, match=r"projector_params.*layout_version=2"):
        traker(tmp_path / "v2")
    # layout 3 (shares ∝ block size): its block table differs, and so does its version; refused likewise
    v3 = {**old, "layout_version": 3, "layout": FactoredProjector.from_model(model, 64, split="size").spec()["layout"]}
    assert v3["layout"] != spec["layout"]
    TrakStore.create_or_open(str(tmp_path / "v3"), StoreMetadata.from_projector(v3, train_set_size=8))
    with pytest.raises(StoreMismatchError, match=r"projector_params.*layout_version=3"):
        traker(tmp_path / "v3")


# ---------------------------------------------------------------------------- the factor cache
def test_factor_cache_reuses_matrices_and_stays_bounded(monkeypatch):
    torch.manual_seed(0)
    model = Text("encoder")
    clear_factor_cache()
    calls = []
    real = counter_rng.rademacher_from_key

    def counting(*a, **k):
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setattr(counter_rng, "rademacher_from_key", counting)
    proj = FactoredProjector.from_model(model, 64, seed=1)
    a = proj.factors(0)
    first = len(calls)
    # P_in and P_out per factored block (none for an identity side), one dense matrix
    assert first == sum(1 if b.kind == "other" else (not b.id_in) + (not b.id_out) for b in proj.blocks)
    assert first >= len(a)
    b = FactoredProjector.from_model(model, 64, seed=1).factors(0)  # a new projector: nothing regenerated
    assert len(calls) == first
    assert all(torch.equal(x, y) for k in a for x, y in zip(a[k][:2], b[k][:2], strict=True) if x is not None)
    FactoredProjector.from_model(model, 64, seed=2).factors(0)  # another seed: new matrices
    assert len(calls) == 2 * first
    clear_factor_cache()
    fresh = FactoredProjector.from_model(model, 64, seed=1).factors(0)
    assert all(torch.equal(x, y) for k in a for x, y in zip(a[k][:2], fresh[k][:2], strict=True) if x is not None)
    monkeypatch.setattr(factored, "FACTOR_CACHE_BYTES", 4096)
    clear_factor_cache()
    FactoredProjector.from_model(model, 64, seed=3).factors(0)
    assert 0 < factored._cache_bytes() <= 4096
    big = factor_matrix(3, 0, "x", SIDE_IN, 64, 64, "rademacher")  # larger than the whole cache: not kept
    assert big.numel() * 4 > 4096 and all(t is not big for t in factored._CACHE.values())
    clear_factor_cache()


# ---------------------------------------------------------------------------- convolutions (the hook's layout cases)
class _UnbatchedConv(nn.Module):
    """A conv called on one (C, H, W) image (torch allows unbatched conv inputs) and one on a batch of 1."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 5, 3, padding=1)
        self.conv1d = nn.Conv1d(5, 3, 2, stride=2, bias=False)
        self.head = nn.Linear(3 * 8, CLASSES)

    def forward(self, x):
        h = torch.tanh(self.conv(x[0]))  # (5, 4, 4), unbatched
        h = torch.tanh(self.conv1d(h.flatten(1).unsqueeze(0)))  # (1, 3, 8)
        return self.head(h.flatten(1))


@pytest.mark.parametrize("proj_dim", [7, 40, 120])
def test_conv_hooks_unbatched_inputs(proj_dim):
    """Conv hooks on unbatched (C, H, W) and batched inputs, k_in below, at and above d_out."""
    torch.manual_seed(3)
    x = torch.randn(4, 2, 4, 4)
    p, _ = _check_all_paths(_UnbatchedConv(), (x, torch.randint(0, CLASSES, (4,))), proj_dim=proj_dim)
    assert [b.kind for b in p.blocks] == ["conv", "conv", "linear"]


# ---------------------------------------------------------------------------- identity sides
class _SmallVocab(nn.Module):
    """An embedding whose vocabulary (5 rows) is narrower than its dimension: its output side can be the identity."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(5, 12, padding_idx=1)
        self.head = nn.Linear(12, CLASSES)

    def forward(self, ids):
        return self.head(torch.tanh(self.tok(ids)).mean(-2))


def _conv_net():
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 5 * 5, CLASSES))


@pytest.mark.parametrize(
    "case, proj_dim, sides",
    [
        ("mha", 400, {("matrix", "id_out"), ("matrix", "id_in"), ("embedding", "id_in"), ("linear", "id_out")}),
        ("tied", 200, {("matrix", "id_in"), ("linear", "id_in")}),
        ("conv", 100, {("conv", "id_out"), ("linear", "id_out")}),
        ("conv", 400, {("conv", "id_in"), ("linear", "id_in")}),
        ("vocab", 60, {("embedding", "id_out")}),
    ],
)
def test_identity_sides_fast_path_equals_brute_force_and_definition(monkeypatch, case, proj_dim, sides):
    """Blocks with an identity side (linear, conv, embedding, matrix; output and input side): the fast path
    (hooks, weight substitution) and project() equal the definition (P = I on that side, coordinate (i, j)
    weighted √(proj_dim / c)) on brute-force per-example gradients, in float64."""
    monkeypatch.setattr(factored, "PAIRS_MAX_MACS", 0)  # the grid for these small blocks
    monkeypatch.setattr(factored, "PAIRS_MAX_RATIO", 0)
    torch.manual_seed(0)
    if case in ("mha", "tied"):
        model, batch = Text(case), _data()
    elif case == "conv":
        model = _conv_net()
        batch = (torch.randn(5, 2, 5, 5), torch.randint(0, CLASSES, (5,)))
    else:
        model = _SmallVocab()
        ids = torch.randint(0, 5, (5, SEQ), generator=torch.Generator().manual_seed(1))
        ids[0, :2] = 1  # padding
        batch = (ids, torch.randint(0, CLASSES, (5,)))
    p, _ = _check_all_paths(model, batch, proj_dim=proj_dim)
    got = {(b.kind, s) for b in p.blocks for s in ("id_out", "id_in") if getattr(b, s)}
    assert sides <= got, got
    for b in p.blocks:  # the description records the identity sides; the factor is I there
        row = next(r for r in p.spec()["layout"] if r[0] == b.name)
        assert ("id_out" in row, "id_in" in row) == (b.id_out, b.id_in)
        if b.id_out or b.id_in:
            p_in, p_out, _ = p.factors(3)[b.name]
            assert not b.id_out or torch.equal(p_out, torch.eye(b.d_out, dtype=p_out.dtype))
            assert not b.id_in or torch.equal(p_in, torch.eye(b.in_rows, dtype=p_in.dtype))
