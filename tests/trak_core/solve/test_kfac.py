"""Kronecker-factored curvature in the projected space (``curvature="kfac"`` / ``"ekfac"``): the factors, their
projection into the factored projection's blocks (grid, pairs and identity sides) and the block-diagonal inverse,
against a float64 brute force with explicit per-example gradients, the projection as an explicit matrix (each
gradient coordinate projected on its own) and an explicit Kronecker H, on a tiny MLP and sequence models (a Linear,
or transformers' Conv1D, applied at every position)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from trak_core.errors import BadInputError
from trak_core.featurize.featurizer import Featurizer
from trak_core.projection.projectors import make_projector
from trak_core.solve import kfac, kfac_record
from trak_core.store import StoreMetadata

N, D_IN, H, C = 24, 6, 5, 3


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, H), nn.Tanh(), nn.Linear(H, C)).double()


class SeqModel(nn.Module):
    """A Linear at each of T positions, mean-pooled, then a head: the layer sees T positions per example."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.tok = nn.Linear(D_IN, H)
        self.head = nn.Linear(H, C, bias=False)

    def forward(self, x):  # x (B, T, D_IN)
        return self.head(torch.tanh(self.tok(x)).mean(-2))


class Conv1DSeq(nn.Module):
    """transformers' ``Conv1D`` (weight [d_in, d_out], y = x W + b) at each of T positions, mean-pooled, then a head
    (``width`` = D_IN: a square Conv1D, whose projection block carries its bias)."""

    def __init__(self, width: int = H) -> None:
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        torch.manual_seed(2)
        self.tok = Conv1D(width, D_IN)
        nn.init.normal_(self.tok.weight, std=0.5)  # (Conv1D starts at std 0.02 and a zero bias)
        nn.init.normal_(self.tok.bias, std=0.3)
        self.head = nn.Linear(width, C, bias=False)

    def forward(self, x):  # x (B, T, D_IN)
        return self.head(torch.tanh(self.tok(x)).mean(-2))


def sites(model) -> dict:
    """{module name: (module, d_in, d_out, whether its bias is part of the site)} of the Linear and Conv1D layers."""
    out = {}
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear):
            out[n] = (m, m.in_features, m.out_features, m.bias is not None)
        elif type(m).__name__ == "Conv1D":
            out[n] = (m, m.weight.shape[0], m.nf, False)
    return out


def data(seq: bool = False):
    g = torch.Generator().manual_seed(3)
    x = (
        torch.randn(N, 4, D_IN, generator=g, dtype=torch.float64)
        if seq
        else torch.randn(N, D_IN, generator=g, dtype=torch.float64)
    )
    return x, torch.randint(0, C, (N,), generator=g)


def batches(x, y, size=10):
    return lambda: [[x[s : s + size], y[s : s + size]] for s in range(0, len(y), size)]


def featurizer(model, kind="noop", proj_dim=None):
    gd = sum(p.numel() for p in model.parameters())
    proj_dim = gd if proj_dim is None else proj_dim
    kw = {"model": model} if kind == "factored" else {}
    proj = make_projector(kind, gd, proj_dim, 0, "rademacher", device="cpu", **kw)
    feat = Featurizer(model, "image_classification", proj, dtype=torch.float64)
    feat.load_state(model.state_dict())
    return feat


def featurizer32(model):
    gd = sum(p.numel() for p in model.parameters())
    feat = Featurizer(model, "image_classification", make_projector("noop", gd, gd, 0, "rademacher", device="cpu"))
    feat.load_state(model.state_dict())
    return feat


# ------------------------------------------------------------------------------------------ brute force
def brute(model, x, y):
    """Per example: the flat gradient of the margin (parameter order), Q, and per Linear or Conv1D layer ã (T,
    in_rows) and δ = ∂f/∂(layer output) (T, d_out) — one example at a time, plain autograd, float64."""
    lins = {n: site[0] for n, site in sites(model).items()}
    out = []
    for i in range(len(y)):
        acts, outs = {}, {}

        def hook(name):
            def h(mod, inp, o):
                acts[name] = inp[0].detach()
                o.retain_grad()
                outs[name] = o

            return h

        hs = [m.register_forward_hook(hook(n)) for n, m in lins.items()]
        logits = model(x[i : i + 1])[0]
        for h in hs:
            h.remove()
        yi = int(y[i])
        others = torch.cat([logits[:yi], logits[yi + 1 :]])
        f = logits[yi] - torch.logsumexp(others, 0)
        model.zero_grad()
        f.backward()
        g = torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()])
        q = np.float32(1 - torch.softmax(logits.detach(), 0)[yi])  # Q as stored (float32), as TRAK weights with it
        per = {}
        for n, (_, d_in, d_out, bias) in sites(model).items():
            a = acts[n].reshape(-1, d_in)
            if bias:
                a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], 1)
            per[n] = (a.numpy(), outs[n].grad.reshape(-1, d_out).numpy())
        out.append((g.numpy(), float(q), per))
    return out


def brute_factors(rows):
    """{layer: (A, S)}: A = Σ ããᵀ / positions, S = Σ r δδᵀ / N (r = Q(1 − Q))."""
    res = {}
    for name in rows[0][2]:
        a_sum = sum(p[name][0].T @ p[name][0] for _, _, p in rows)
        t = sum(p[name][0].shape[0] for _, _, p in rows)
        s_sum = sum(q * (1 - q) * p[name][1].T @ p[name][1] for _, q, p in rows)
        a, s = a_sum / t, s_sum / len(rows)
        res[name] = (a, s)
    return res


def layer_grads(model, g):
    """{layer: its augmented gradient [∂W | ∂b] row-major} of the flat gradient g (parameter order)."""
    off, params = 0, {}
    for n, p in model.named_parameters():
        params[n] = g[off : off + p.numel()].reshape(p.shape)
        off += p.numel()
    out = {}
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear):
            w = params[f"{n}.weight" if n else "weight"]
            out[n] = np.concatenate([w, params[f"{n}.bias"][:, None]], 1) if m.bias is not None else w
    return out


def flat_of(model, blocks):
    """The flat vector (parameter order) of {layer: augmented matrix}."""
    parts = []
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear):
            parts.append(blocks[n][:, : m.in_features].reshape(-1))
            if m.bias is not None:
                parts.append(blocks[n][:, m.in_features])
    return np.concatenate(parts)


def projection_matrix(feat) -> np.ndarray:
    """The factored projection as a (proj_dim × grad_dim) float64 matrix: each gradient coordinate projected alone."""
    model, gd = feat.model, feat.grad_dim
    eye = torch.eye(gd, dtype=torch.float64)
    grads, off = {}, 0
    for n, p in model.named_parameters():
        grads[n] = eye[:, off : off + p.numel()].reshape(gd, *p.shape)
        off += p.numel()
    return feat.projector.project(grads, model_id=0).double().numpy().T


def kron_of(model, fac) -> np.ndarray:
    """blockdiag over the Linear layers of S ⊗ A in the gradient's parameter coordinates (grad_dim²); a Conv1D's
    weight [d_in, d_out] (row-major): A ⊗ S."""
    gd = sum(p.numel() for p in model.parameters())
    k = np.zeros((gd, gd))
    offs, off = {}, 0
    for n, p in model.named_parameters():
        offs[n] = off
        off += p.numel()
    for name, m in model.named_modules():
        if type(m).__name__ == "Conv1D":
            a, s = fac[name]
            w = offs[f"{name}.weight"]
            k[w : w + m.weight.numel(), w : w + m.weight.numel()] = np.kron(a, s)
        if not isinstance(m, nn.Linear):
            continue
        a, s = fac[name]
        pre = f"{name}." if name else ""
        idx = []  # the gradient coordinate of augmented entry (o, i), row-major
        for o in range(m.out_features):
            for i in range(m.in_features + (m.bias is not None)):
                if i < m.in_features:
                    idx.append(offs[pre + "weight"] + o * m.in_features + i)
                else:
                    idx.append(offs[pre + "bias"] + o)
        k[np.ix_(idx, idx)] = np.kron(s, a)
    return k


def meta_of(feat) -> StoreMetadata:
    return StoreMetadata.from_projector(feat.projector.spec(), train_set_size=N)


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("seq", [False, True])
def test_factors_match_brute_force(seq):
    model = SeqModel().double() if seq else mlp()
    x, y = data(seq)
    want = brute_factors(brute(model, x, y))
    pre = kfac.fit_factors(featurizer(model), batches(x, y), "kfac")
    assert set(pre.blocks) == set(want)
    for name, (a, s) in want.items():
        _, got_a, got_s = pre.blocks[name]
        np.testing.assert_allclose(got_a, a, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(got_s, s, rtol=1e-10, atol=1e-12)
    assert pre.info["rows"] == N and pre.info["damping"] == kfac.DEFAULT_DAMPING


@pytest.mark.parametrize("seq", [False, True])
def test_a_float32_models_factors_match_float64_brute_force(seq):
    """A float32 model's factors are float64 products of its float32 activations and output gradients: they match
    the float64 brute force of the same model to float32 precision."""
    model = SeqModel().double() if seq else mlp()
    x, y = data(seq)
    want = brute_factors(brute(model, x, y))
    single = (SeqModel() if seq else mlp()).float()
    single.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    pre = kfac.fit_factors(featurizer32(single), batches(x.float(), y), "kfac")
    for name, (a, s) in want.items():
        _, got_a, got_s = pre.blocks[name]
        assert got_a.dtype == got_s.dtype == np.float64
        np.testing.assert_allclose(got_a, a, rtol=2e-5, atol=2e-6 * np.abs(a).max())
        np.testing.assert_allclose(got_s, s, rtol=2e-5, atol=2e-6 * np.abs(s).max())


@pytest.mark.parametrize("seq", [False, True])
def test_folded_sums_in_any_order_and_overlap_match_brute_force(seq):
    """The factors summed while featurizing (:class:`kfac.FactorFold`): rows added out of order, in uneven batches,
    some twice, give the brute-force factors of the rows counted once; covers() says which rows those are."""
    model = SeqModel().double() if seq else mlp()
    x, y = data(seq)
    want = brute_factors(brute(model, x, y))
    feat = featurizer(model)
    fold = kfac.FactorFold(N)
    for rows in (np.arange(N // 2, N), np.arange(0, 7), np.arange(3, N // 2 + 4)[::-1].copy()):  # 3..6 and N//2.. again
        fold.add(feat, [x[rows], y[rows]], rows)
    assert fold.covers(np.ones(N, bool)) and not fold.covers(np.arange(N) < N - 1)
    pre = fold.factors("ekfac", 0.01)
    assert set(pre.blocks) == set(want) and pre.info["rows"] == N and pre.info["damping"] == 0.01
    for name, (a, s) in want.items():
        _, got_a, got_s = pre.blocks[name]
        np.testing.assert_allclose(got_a, a, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(got_s, s, rtol=1e-10, atol=1e-12)
    with pytest.raises(BadInputError, match="featurizing"):
        fold.factors("kfac-eigen")
    with pytest.raises(BadInputError, match="no train rows"):
        kfac.FactorFold(N).factors("kfac")


def forms(model, proj_dim) -> set:
    out = set()
    for b in featurizer(model, "factored", proj_dim).projector.layout.blocks:
        if b.kind == "linear":
            out.add("pairs" if b.pairs else "identity side" if (b.id_in or b.id_out) else "grid")
    return out


@pytest.mark.parametrize("proj_dim", [7, 12, 20])
@pytest.mark.parametrize("seq", [False, True])
def test_projected_factors_match_brute_force(seq, proj_dim, block_form):
    """F_b = Π_b (S ⊗ A) Π_bᵀ, Π the factored projection as an explicit matrix, for every Linear block."""
    model = SeqModel().double() if seq else mlp()
    x, y = data(seq)
    feat = featurizer(model, "factored", proj_dim)
    pre = kfac.fit_factors(feat, batches(x, y), "kfac")
    pi = projection_matrix(feat)
    full = pi @ kron_of(model, {n: (a, s) for n, (_, a, s) in pre.blocks.items()}) @ pi.T
    got = kfac.projected_factors(meta_of(feat), 0, pre)
    layout = feat.projector.layout
    assert set(got) == {b.name for b in layout.blocks if b.kind == "linear"}
    off = 0
    for b in layout.blocks:
        if b.name in got:
            o, f = got[b.name]
            assert o == off
            np.testing.assert_allclose(
                f, full[off : off + b.k, off : off + b.k], rtol=1e-6, atol=1e-9 * np.abs(f).max()
            )
        off += b.k


@pytest.mark.parametrize("proj_dim", [7, 20])
def test_conv1d_factors_and_projected_factors_match_brute_force(proj_dim, block_form):
    """A transformers Conv1D gets K-FAC factors (A of its input, S of its output), and its block, the weight's
    d_in × d_out view, gets Π_b (A ⊗ S) Π_bᵀ; its bias keeps its XᵀX block (in the "other" block here)."""
    model = Conv1DSeq().double()
    x, y = data(seq=True)
    want = brute_factors(brute(model, x, y))
    feat = featurizer(model, "factored", proj_dim)
    with pytest.warns(UserWarning, match="tok.bias"):
        pre = kfac.fit_factors(feat, batches(x, y), "kfac")
    assert set(pre.blocks) == {"tok", "head"} and pre.blocks["tok"][0].transposed
    for name, (a, s) in want.items():
        np.testing.assert_allclose(pre.blocks[name][1], a, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(pre.blocks[name][2], s, rtol=1e-10, atol=1e-12)
    pi = projection_matrix(feat)
    full = pi @ kron_of(model, {n: (a, s) for n, (_, a, s) in pre.blocks.items()}) @ pi.T
    got = kfac.projected_factors(meta_of(feat), 0, pre)
    assert set(got) == {"tok.weight", "head"}
    off = 0
    for b in feat.projector.layout.blocks:
        if b.name in got:
            assert got[b.name][0] == off
            f = got[b.name][1]
            np.testing.assert_allclose(f, full[off : off + b.k, off : off + b.k], rtol=1e-6, atol=1e-9 * abs(f).max())
        off += b.k
    assert kfac_record.from_record(*kfac_record.to_record(pre)).blocks["tok"][0].transposed


def test_square_conv1d_with_its_bias_in_the_block_keeps_xtx():
    """A square Conv1D's block carries its bias as one more column: not S ⊗ A, so the block keeps XᵀX."""
    model = Conv1DSeq(width=D_IN).double()
    x, y = data(seq=True)
    feat = featurizer(model, "factored", 12)
    assert [b.bias for b in feat.projector.layout.blocks if b.name == "tok.weight"] == [True]
    with pytest.warns(UserWarning):
        pre = kfac.fit_factors(feat, batches(x, y), "kfac")
    xs, _ = feat.featurize([x, y], 0)
    _, per = kfac.block_inverse(meta_of(feat), 0, pre, xs.astype(np.float64).T @ xs.astype(np.float64))
    assert per["tok.weight"]["block"] == "xtx" and per["head"]["block"] == "kfac"


def test_layouts_cover_grid_pairs_and_identity_sides(monkeypatch):
    """The cases above exercise each way a block keeps its coordinates: pairs, a grid of random sides, and a grid
    with an identity side."""
    seen = {f for seq in (False, True) for p in (7, 12, 20) for f in forms(SeqModel() if seq else mlp(), p)}
    assert "pairs" in seen
    from trak_core.projection import layout

    for name in ("PAIRS_MAX_WEIGHTS", "PAIRS_MAX_MACS", "PAIRS_MAX_RATIO"):
        monkeypatch.setattr(layout, name, 0)
    seen = {f for seq in (False, True) for p in (7, 12, 20) for f in forms(SeqModel() if seq else mlp(), p)}
    assert {"grid", "identity side"} <= seen


def brute_inverse(model, feat, fac, xtx, kind, damping=kfac.DEFAULT_DAMPING):
    """The block-diagonal inverse by its definition, from the explicit projection and Kronecker matrix."""
    pi = projection_matrix(feat)
    full = pi @ kron_of(model, fac) @ pi.T
    inv, off = np.zeros_like(xtx), 0
    for b in feat.projector.layout.blocks:
        sl = slice(off, off + b.k)
        g = xtx[sl, sl]
        if b.kind == "linear":
            f = full[sl, sl]
            if kind == "ekfac":
                _, u = np.linalg.eigh(f)
                h = u @ np.diag(np.diag(u.T @ g @ u)) @ u.T
            else:
                h = f * np.trace(g) / np.trace(f)
            lam = damping * np.trace(h) / b.k
        else:
            h, lam = g, kfac.EMPIRICAL_DAMPING * np.trace(g) / b.k
        inv[sl, sl] = np.linalg.inv(h + lam * np.eye(b.k))
        off += b.k
    return inv


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_block_inverse_matches_brute_force(kind):
    """A Linear layer's block: K-FAC's shape (or EK-FAC's corrected eigenvalues) from the factors; the conv's block:
    its XᵀX block; all damped, as defined, against the explicit projection of an explicit S ⊗ A."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(1, 2, 3), nn.Flatten(), nn.Linear(16, C)).double()
    x, y = torch.randn(N, 1, 10, dtype=torch.float64), torch.randint(0, C, (N,))
    feat = featurizer(model, "factored", 14)
    with pytest.warns(UserWarning, match="keep their block of XᵀX"):
        pre = kfac.fit_factors(feat, batches(x, y), kind)
    assert pre.info["identity"] == ["0.bias", "0.weight"]
    xs, _ = feat.featurize([x, y], 0)
    xtx = xs.astype(np.float64).T @ xs.astype(np.float64)
    got, per = kfac.block_inverse(meta_of(feat), 0, pre, xtx)
    want = brute_inverse(model, feat, {n: (a, s) for n, (_, a, s) in pre.blocks.items()}, xtx, kind)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9 * np.abs(want).max())
    assert per["2"]["block"] == kind and per["0"]["block"] == "xtx"


def test_ekfac_equals_kfac_when_the_rows_follow_the_factors():
    """EK-FAC's corrected eigenvalues are K-FAC's own when XᵀX is (a multiple of) the projected Kronecker matrix."""
    model = mlp()
    x, y = data()
    feat = featurizer(model, "factored", 12)
    pre = kfac.fit_factors(feat, batches(x, y), "kfac")
    blocks = kfac.projected_factors(meta_of(feat), 0, pre)
    xtx = np.zeros((12, 12))
    for o, f in blocks.values():
        xtx[o : o + len(f), o : o + len(f)] = 3.0 * f
    inv_k, _ = kfac.block_inverse(meta_of(feat), 0, pre, xtx)
    pre.info["kind"] = "ekfac"
    inv_e, _ = kfac.block_inverse(meta_of(feat), 0, pre, xtx)
    np.testing.assert_allclose(inv_e, inv_k, rtol=1e-8, atol=1e-12 * np.abs(inv_k).max())


def test_scores_equal_brute_force(tmp_path):
    """TRAKer(curvature="kfac") end to end: Q · X_target H⁻¹ X_trainᵀ, with X the explicit projection of the brute
    force's float64 gradients (/√grad_dim, as TRAK normalizes) and H⁻¹ the block inverse by its definition."""
    from trak_core.compat.traker import TRAKer

    model = mlp()
    x, y = data()
    rows = brute(model, x, y)
    fac = brute_factors(rows)
    feat = featurizer(model, "factored", 12)
    pi = projection_matrix(feat)
    g = np.stack([r[0] for r in rows])
    xs = g @ pi.T / np.sqrt(feat.grad_dim)
    want = (xs @ brute_inverse(model, feat, fac, xs.T @ xs, "kfac") @ xs.T) * np.array([r[1] for r in rows])[:, None]
    tr = TRAKer(model=model, task="image_classification", train_set_size=N, save_dir=str(tmp_path / "s"), device="cpu",
                projector=make_projector("factored", feat.grad_dim, 12, 0, "rademacher", model=model),
                proj_dim=12, use_half_precision=False, curvature="kfac", logging_level=40)  # fmt: skip
    tr.load_checkpoint(model.state_dict(), model_id=0)
    tr.fit_curvature([[x, y]])
    tr.featurize([x, y], num_samples=N)
    tr.finalize_features()
    tr.start_scoring_checkpoint("e", model.state_dict(), 0, N)
    tr.score([x, y], num_samples=N)
    got = np.asarray(tr.finalize_scores("e"), dtype=np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())  # (float32 rows and inverse)


def test_record_round_trip_and_damage():
    """The record (layout, info, digest) and its arrays round-trip bit for bit; a changed array, a missing one or a
    changed shape is damage; a record of the earlier inline form is still read, one of an older form refused."""
    import base64

    from trak_core.errors import StateError, StoreDamageError

    model = mlp()
    x, y = data()
    pre = kfac.fit_factors(featurizer(model), batches(x, y), "kfac")
    rec, arrays = kfac_record.to_record(pre)
    assert all(isinstance(v, (str, int, float, list, dict, type(None))) for v in rec.values())
    assert len(json.dumps(rec)) < 2000  # the matrices are not in the record
    back = kfac_record.from_record(rec, arrays)
    for n, (_, a, s) in pre.blocks.items():
        np.testing.assert_array_equal(back.blocks[n][1], a)
        np.testing.assert_array_equal(back.blocks[n][2], s)
    assert back.info == pre.info
    for bad in ({**arrays, "a0": arrays["a0"] * 2}, {k: v for k, v in arrays.items() if k != "s1"},
                {**arrays, "a0": arrays["a0"].reshape(1, -1)}, None):  # fmt: skip
        with pytest.raises(StoreDamageError, match="sha256"):
            kfac_record.from_record(rec, bad)

    def inline(m):
        m = np.ascontiguousarray(m, dtype="<f8")
        return {"shape": list(m.shape), "data": base64.b64encode(m.tobytes()).decode("ascii")}

    blocks = {n: {**rec["blocks"][n], "a": inline(a), "s": inline(s)} for n, (_, a, s) in pre.blocks.items()}
    old = {**rec, "form": kfac_record.INLINE_FORM, "blocks": blocks, "sha256": kfac_record._inline_digest(blocks)}
    again = kfac_record.from_record(old)
    for n, (_, a, s) in pre.blocks.items():
        np.testing.assert_array_equal(again.blocks[n][1], a)
        np.testing.assert_array_equal(again.blocks[n][2], s)
    with pytest.raises(StoreDamageError, match="sha256"):
        kfac_record.from_record({**old, "sha256": "0" * 64})
    older = {k: v for k, v in rec.items() if k != "form"}  # a record of the earliest form (whitening first)
    with pytest.raises(StateError, match="earlier trakflow"):
        kfac_record.from_record(older, arrays)


@pytest.mark.parametrize("bad", [0, -0.1, float("nan"), float("inf"), "0.1", True, None])
def test_bad_damping_names_the_field(bad):
    with pytest.raises(BadInputError, match="curvature_damping"):
        kfac.check_damping(bad)


@pytest.mark.parametrize("kind", ["dense", "noop", "sjlt"])
def test_a_projector_without_layers_is_refused(kind):
    from trak_core.rules import check_projection

    with pytest.raises(BadInputError, match="needs the factored projector"):
        check_projection(kind, 8, 100, "adaptive", "kfac")
    check_projection("factored", 8, 100, "adaptive", "kfac")


def test_unknown_kind_and_no_rows():
    model = mlp()
    feat = featurizer(model)
    with pytest.raises(BadInputError, match="curvature"):
        kfac.fit_factors(feat, lambda: [], "kfacc")
    with pytest.raises(BadInputError, match="no train rows"):
        kfac.fit_factors(feat, lambda: [], "kfac")


def test_a_causal_lm_s_factors_do_not_depend_on_its_padding():
    """A text task's factors sum over its real tokens: the same texts right-padded to 6 or to 9 positions give the
    same A and S (a padding position's input would otherwise weigh in A), and A's positions are the real tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=11, n_positions=12, n_embd=8, n_layer=1, n_head=2)).double().eval()
    lengths = [6, 3, 5, 2, 6, 4]

    def padded(width):
        ids = torch.zeros(len(lengths), width, dtype=torch.long)
        for i, n in enumerate(lengths):
            ids[i, :n] = torch.randint(2, 11, (n,), generator=torch.Generator().manual_seed(10 + i))
        mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
        return [ids, mask, torch.where(mask.bool(), ids, torch.full_like(ids, -100))]

    fits = []
    for width in (6, 9):
        gd = sum(p.numel() for p in model.parameters())
        feat = Featurizer(model, "causal_lm", make_projector("noop", gd, gd, 0, "rademacher", device="cpu"),
                          dtype=torch.float64)  # fmt: skip
        feat.load_state(model.state_dict())
        batch = padded(width)
        with pytest.warns(UserWarning):
            fits.append(kfac.fit_factors(feat, lambda b=batch: [[t[:4] for t in b], [t[4:] for t in b]], "kfac"))
    layers = {f"transformer.h.0.{n}" for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert set(fits[0].blocks) == layers
    for name in fits[0].blocks:
        for part in (1, 2):
            np.testing.assert_allclose(fits[1].blocks[name][part], fits[0].blocks[name][part], rtol=1e-9, atol=1e-12)
    # A of the first layer: the mean over the real tokens of its input's outer product (ln_1 of the embeddings)
    ids, mask, _ = padded(9)
    with torch.no_grad():
        h = model.transformer.h[0].ln_1(model.transformer.wte(ids) + model.transformer.wpe(torch.arange(9)))
    real = h[mask.bool()]
    np.testing.assert_allclose(fits[1].blocks["transformer.h.0.attn.c_attn"][1], (real.T @ real / len(real)).numpy(),
                               rtol=1e-9, atol=1e-12)  # fmt: skip


def test_a_causal_lm_s_is_its_output_gradients_second_moment():
    """A causal LM's q = 1 − p(sequence) is near 1 (1 in float32 for real texts), so S weighted by q(1 − q) would
    vanish: S is Σ_t δ_t δ_tᵀ / N of the sequence output's own gradients δ_t with respect to the layer's output at
    each real token (brute force: autograd per text), unweighted."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from trak_core.featurize.modelout import CausalLMModelOutput

    torch.manual_seed(1)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=13, n_positions=12, n_embd=8, n_layer=1, n_head=2)).double().eval()
    lengths = [7, 4, 6, 3, 7]
    ids = torch.zeros(len(lengths), 7, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(2, 13, (n,), generator=torch.Generator().manual_seed(30 + i))
    mask = (torch.arange(7) < torch.tensor(lengths)[:, None]).long()
    batch = [ids, mask, torch.where(mask.bool(), ids, torch.full_like(ids, -100))]
    gd = sum(p.numel() for p in model.parameters())
    feat = Featurizer(model, "causal_lm", make_projector("noop", gd, gd, 0, "rademacher", device="cpu"),
                      dtype=torch.float64)  # fmt: skip
    feat.load_state(model.state_dict())
    r = feat.out_to_loss(batch, 0, range(5)).double().numpy()
    assert np.all(r * (1 - r) < 0.01)  # the weights S would have had
    with pytest.warns(UserWarning):
        pre = kfac.fit_factors(feat, lambda: [[t[:3] for t in batch], [t[3:] for t in batch]], "kfac")
    task = CausalLMModelOutput()
    params = dict(model.named_parameters())
    for name in ("transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_proj"):
        layer, s = model.get_submodule(name), 0
        for i in range(len(lengths)):
            kept = {}
            handle = layer.register_forward_hook(lambda m, a, o: (o.retain_grad(), kept.setdefault("o", o))[1])
            try:
                out = task.get_output(model, params, {}, *[t[i] for t in batch])
            finally:
                handle.remove()
            (d,) = torch.autograd.grad(out, kept["o"])
            d = d.reshape(-1, d.shape[-1])[: lengths[i]].detach().numpy()
            s = s + d.T @ d
        got = pre.blocks[name][2]
        assert np.abs(got).max() > 0
        np.testing.assert_allclose(got, s / len(lengths), rtol=1e-8, atol=1e-12 * np.abs(s).max())


class Encoder(nn.Module):
    """Two transformer encoder layers in eval mode (the second's attention would take torch's fused inference
    kernel: batch_first, no mask), pooled, then a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer
        self.enc = nn.Sequential(*[layer(D_IN, 2, 16, dropout=0.0, batch_first=True) for _ in range(2)])
        self.head = nn.Linear(D_IN, C)

    def forward(self, x):
        return self.head(self.enc(x).mean(1))


def test_attention_fused_kernel_is_not_taken_by_the_fit(request):
    """A fit (and the folded sums) of a model whose attention layer would take torch's fused inference kernel (no
    derivative; its inner Linears never called): the same factors as with that kernel turned off by the caller, with
    the feed-forward layers fitted, and the same factors folded while featurizing."""
    model = Encoder().eval()
    x, y = torch.randn(N, 4, D_IN, generator=torch.Generator().manual_seed(5)), torch.randint(0, C, (N,))
    was = torch.backends.mha.get_fastpath_enabled()
    request.addfinalizer(lambda: torch.backends.mha.set_fastpath_enabled(was))
    torch.backends.mha.set_fastpath_enabled(True)  # torch's default, whatever ran before in this process
    gd = sum(p.numel() for p in model.parameters())

    def feat():
        f = Featurizer(model, "image_classification", make_projector("factored", gd, 24, 0, "rademacher", model=model))
        f.load_state(model.state_dict())
        return f

    with pytest.warns(UserWarning, match="keep their block"):  # the in-projection is no Linear module's forward
        got = kfac.fit_factors(feat(), batches(x, y), "kfac")
    want_sites = {f"enc.{i}.linear{j}" for i in (0, 1) for j in (1, 2)} | {"head"}
    assert set(got.blocks) == want_sites  # not out_proj: the attention function applies its weights
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with pytest.warns(UserWarning, match="keep their block"):
            want = kfac.fit_factors(feat(), batches(x, y), "kfac")
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    assert got.blocks.keys() == want.blocks.keys()
    for name, (_, a, s) in want.blocks.items():  # scaled dot-product attention's backends round differently
        np.testing.assert_allclose(got.blocks[name][1], a, rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(got.blocks[name][2], s, rtol=1e-5, atol=1e-9)
    fold, f = kfac.FactorFold(N), feat()
    for i, b in enumerate(batches(x, y)()):
        kfac.featurize_folded(fold, f, b, 0, list(range(10 * i, 10 * i + len(b[1]))))
    with pytest.warns(UserWarning, match="keep their block"):
        folded = fold.factors("kfac")
    assert folded.blocks.keys() == want.blocks.keys()
    for name, (_, a, s) in want.blocks.items():
        np.testing.assert_allclose(folded.blocks[name][1], a, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(folded.blocks[name][2], s, rtol=1e-5, atol=1e-7)
