"""The factored projector's fast path through nn.MultiheadAttention (trak_core.projection.mha): the in-projection and
out_proj weights, applied by linear calls inside F.multi_head_attention_forward, get the low-rank term there instead
of weight substitution. Every result is checked in float64 against the block definition applied to per-example
gradients materialized by brute force (torch.func vmap(grad)), and the blocks are checked to be served by the
attention hooks (no substitution, no warning); uses the hooks cannot see fall back to substitution, exactly."""

import warnings

import pytest
import torch
from test_factored_attention import CLASSES, DIM, HEADS, SEQ, VOCAB, _brute_grads, _data, _definition, _fast
from torch import nn

import trak_core.projection.mha as factored_mha
from trak_core.projection.factored import FactoredProjector
from trak_core.projection.layout import matrix_uses
from trak_core.projection.mha import ATTENTION, _rows

KINDS = [
    "causal-prenorm",  # the benchmark's decoder block: src_mask + is_causal, norm_first
    "seq-first",
    "cross-kv",  # query ≠ key = value: the packed weight split into q and kv rows
    "cross-qkv",  # query ≠ key ≠ value: split into three
    "kdim",  # kdim, vdim ≠ embed_dim: q/k/v_proj_weight, with bias_k / bias_v
    "weights-mask",  # need_weights (per head) + key_padding_mask, the weights used by the output
    "decoder-layer",  # nn.TransformerDecoderLayer: self- and cross-attention, sequence first
    "shared",  # one attention module applied twice
    "no-bias",
]


class Attn(nn.Module):
    """Token embedding + position table, then one of the attention set-ups of KINDS, then a classifier head."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(0.3 * torch.randn(SEQ, DIM))
        self.mem = nn.Linear(DIM, 5 if kind == "kdim" else DIM)
        first = kind != "seq-first" and kind != "decoder-layer"
        if kind in ("causal-prenorm", "seq-first"):
            self.attn = nn.TransformerEncoderLayer(
                DIM, HEADS, 2 * DIM, dropout=0.0, batch_first=first, norm_first=kind == "causal-prenorm"
            )
        elif kind == "decoder-layer":
            self.attn = nn.TransformerDecoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0)
        elif kind == "kdim":
            self.attn = nn.MultiheadAttention(DIM, HEADS, kdim=5, vdim=5, add_bias_kv=True, batch_first=True)
        else:
            self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True, bias=kind != "no-bias")
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, ids):
        t = ids.shape[-1]
        h = self.tok(ids) + self.pos[:t]
        m = torch.tanh(self.mem(h))
        k = self.kind
        if k == "causal-prenorm":
            mask = nn.Transformer.generate_square_subsequent_mask(t, dtype=h.dtype)
            h = self.attn(h, src_mask=mask, is_causal=True)
        elif k == "seq-first":
            h = self.attn(h.transpose(0, 1)).transpose(0, 1)
        elif k == "decoder-layer":
            mask = nn.Transformer.generate_square_subsequent_mask(t, dtype=h.dtype)
            h = self.attn(h.transpose(0, 1), m.transpose(0, 1), tgt_mask=mask, tgt_is_causal=True).transpose(0, 1)
        elif k in ("cross-kv", "kdim"):
            h = self.attn(h, m, m, need_weights=False)[0]
        elif k == "cross-qkv":
            h = self.attn(h, m, torch.sin(m), need_weights=False)[0]
        elif k == "weights-mask":
            out, w = self.attn(h, h, h, key_padding_mask=ids == 0, need_weights=True, average_attn_weights=False)
            h = out + w.sum(-3) @ m
        elif k == "shared":
            h = self.attn(h, h, h, need_weights=False)[0]
            h = self.attn(torch.tanh(h), m, m, need_weights=False)[0]
        else:
            h = self.attn(h, h, h, need_weights=False)[0]
        return self.head(torch.tanh(h).mean(-2))


def _attention_names(model):
    """The attention weights of ``model``: in-projection and out_proj weights of every nn.MultiheadAttention."""
    out = []
    for mname, mod in model.named_modules():
        if isinstance(mod, nn.MultiheadAttention):
            pre = f"{mname}." if mname else ""
            for w in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
                if getattr(mod, w) is not None:
                    out.append(pre + w)
            out.append(pre + "out_proj.weight")
    return out


def _model(kind, seed=0):
    torch.manual_seed(seed)
    return Attn(kind).double().eval()


def _reference(p, model, batch):
    grads = _brute_grads(model, batch, [n for n, _ in p.layout.param_shapes])
    want = _definition(p, grads, 3)
    assert float(want.abs().max()) > 0
    return want


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10 * float(want.abs().max()))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("proj_dim", [40, 300])  # 300: pairs on the attention blocks, 40: the k_out × k_in grid
def test_attention_weights_are_hooked_and_exact(kind, proj_dim):
    model = _model(kind)
    batch = _data(padding_idx=0 if kind == "weights-mask" else None)
    p = FactoredProjector.from_model(model, proj_dim, seed=5, dtype=torch.float64)
    names = _attention_names(model)
    uses = matrix_uses(model, p.layout)
    assert names and all(n in uses and {u for _, u, _ in uses[n]} == {ATTENTION} for n in names), uses
    blocks = {b.name: b for b in p.blocks}
    if kind not in ("kdim", "no-bias"):  # the packed in-projection with its bias
        assert all(blocks[n].bias for n in names)
    if proj_dim == 300:
        assert any(blocks[n].pairs for n in names)
    want = _reference(p, model, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to substitution
        got = _fast(p, model, batch)
    _close(got, want)
    assert p._verified == {id(model)} and not p._substitute


def test_the_mode_is_off_for_models_without_attention(monkeypatch):
    """No nn.MultiheadAttention: no TorchFunctionMode in the forward (every torch call would pay for it)."""
    made, bind = [], factored_mha.AttentionHooks.bind
    monkeypatch.setattr(factored_mha.AttentionHooks, "bind", lambda self, w: (made.append(self), bind(self, w)))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, CLASSES)).double()
    p = FactoredProjector.from_model(model, 12, dtype=torch.float64)
    _fast(p, model, (torch.randn(4, 6, dtype=torch.float64), torch.tensor([0, 1, 2, 0])))
    assert made == []
    model = _model("no-bias")
    _fast(FactoredProjector.from_model(model, 12, dtype=torch.float64), model, _data())
    assert len(made) == 1


class _Outside(Attn):
    """Attention weights also used outside the attention function."""

    def forward(self, ids):
        h = self.tok(ids) + self.pos
        out = self.attn(h, h, h, need_weights=False)[0] + self.mem(h)
        if self.kind == "out_proj-forward":  # the Linear's own forward, which the attention never calls
            out = out + self.attn.out_proj(torch.tanh(h))
        else:  # "in_proj-slice": a slice of the packed weight through F.linear
            out = out + nn.functional.linear(torch.tanh(h), self.attn.in_proj_weight[DIM : 2 * DIM])
        return self.head(torch.tanh(out).mean(-2))


@pytest.mark.parametrize(
    "kind, culprit", [("out_proj-forward", "attn.out_proj.weight"), ("in_proj-slice", "attn.in_proj_weight")]
)
def test_uses_outside_the_attention_function_fall_back_to_substitution(kind, culprit):
    torch.manual_seed(0)
    model = _Outside(kind).double().eval()
    batch = _data()
    p = FactoredProjector.from_model(model, 40, seed=5, dtype=torch.float64)
    want = _reference(p, model, batch)
    with pytest.warns(UserWarning, match=rf"layers \['{culprit}'\] are used outside"):
        got = _fast(p, model, batch)
    _close(got, want)
    assert p._substitute == {culprit}
    _close(_fast(p, model, batch), want)


def test_without_the_patched_attention_function_every_attention_block_is_substituted(monkeypatch):
    """A torch whose attention function cannot be copied: the hooks never fire, the blocks take substitution."""
    monkeypatch.setattr(factored_mha, "_patched", lambda linear: None)
    model = _model("causal-prenorm")
    batch = _data()
    p = FactoredProjector.from_model(model, 40, seed=5, dtype=torch.float64)
    want = _reference(p, model, batch)
    with pytest.warns(UserWarning, match="used outside"):
        got = _fast(p, model, batch)
    _close(got, want)
    assert p._substitute == set(_attention_names(model))


def test_row_views():
    w = torch.arange(24.0).reshape(6, 4)
    q, kv = w.split([2, 4])
    assert _rows(w, w) == (0, 6) and _rows(q, w) == (0, 2) and _rows(kv, w) == (2, 6)
    assert [_rows(c, w) for c in w.chunk(3)] == [(0, 2), (2, 4), (4, 6)]
    assert _rows(w[:, :2], w) is None and _rows(w.T, w) is None and _rows(w.clone(), w) is None
    assert _rows(q, kv) is None  # rows of the same memory outside w[2:6]
    b = torch.arange(6.0)
    assert _rows(b.chunk(3)[1], b) == (2, 4) and _rows(torch.arange(6.0), b) is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["causal-prenorm", "cross-qkv", "kdim", "weights-mask", "decoder-layer"])
def test_attention_hooks_on_cuda_give_the_cpus_numbers(kind):
    """The hooked attention on a CUDA device (float64, where the fused kernels step aside) against the CPU run of
    the same projector: the attention blocks stay on the hooks there too."""
    model = _model(kind)
    batch = _data(padding_idx=0 if kind == "weights-mask" else None)
    out = {}
    for dev in ("cpu", "cuda"):
        model = model.to(dev)
        p = FactoredProjector.from_model(model, 300, seed=5, device=dev, dtype=torch.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out[dev] = _fast(p, model, tuple(t.to(dev) for t in batch)).cpu()
        assert not p._substitute
    _close(out["cuda"], out["cpu"])


@pytest.mark.parametrize("rows", [1, 3, 1024])
def test_chain_product_takes_the_cheaper_order_and_the_same_value(rows):
    """a @ (m @ n) with an MLP layer's shapes (512 outputs, a 37 × 36 Z): (a @ m) @ n for an example's one position,
    m @ n first for many; float64 values equal either way."""
    from torch.utils.flop_counter import FlopCounterMode

    gen = torch.Generator().manual_seed(rows)
    a, m, n = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((rows, 36), (36, 37), (37, 512)))
    with FlopCounterMode(display=False) as count:
        got = factored_mha.chain_product(a, m, n)
    left, right = 2 * rows * 37 * (36 + 512), 2 * 36 * 512 * (37 + rows)  # (a m) n, a (m n)
    assert count.get_total_flops() == min(left, right)
    assert (left < right) == (rows < 1024)  # the order changes between these shapes' few and many positions
    torch.testing.assert_close(got, a @ (m @ n), rtol=1e-12, atol=1e-12)
    one = factored_mha.chain_product(a[0], m, n)  # an example's one position as a vector
    torch.testing.assert_close(one, a[0] @ (m @ n), rtol=1e-12, atol=1e-12)


def test_differentiable_attention_restores_torch_switches_in_any_exit_order():
    """Two passes (threads) inside at once, leaving in the order they came: the fused-kernel switch and the SDPA
    backends are off / math-only while any is inside, and as before once both are out (each pass saving and restoring
    on its own would leave the fast path off for good)."""
    from torch.nn.attention import _cur_sdpa_kernel_backends

    from trak_core.projection.mha import differentiable_attention

    was, backends = torch.backends.mha.get_fastpath_enabled(), _cur_sdpa_kernel_backends()
    torch.backends.mha.set_fastpath_enabled(True)
    try:
        first, second = differentiable_attention(), differentiable_attention()
        first.__enter__()
        second.__enter__()
        assert not torch.backends.mha.get_fastpath_enabled()
        first.__exit__(None, None, None)
        assert not torch.backends.mha.get_fastpath_enabled() and len(_cur_sdpa_kernel_backends()) == 1
        second.__exit__(None, None, None)
        assert torch.backends.mha.get_fastpath_enabled() and _cur_sdpa_kernel_backends() == backends
    finally:
        torch.backends.mha.set_fastpath_enabled(was)
