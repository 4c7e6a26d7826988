"""Kronecker-factored curvature (``curvature="kfac"`` / ``"ekfac"``): the factors, the preconditioned per-example
gradients (through the noop, dense and factored projectors, the factored one on its fast path) and the scores,
against a float64 brute force with explicit per-example gradients, an explicit Kronecker H and an explicit solve,
on a tiny MLP and a sequence model (a Linear applied at every position)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from trak_core.errors import BadInputError
from trak_core.featurize.featurizer import Featurizer
from trak_core.projection.projectors import make_projector
from trak_core.solve import kfac

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


# ------------------------------------------------------------------------------------------ brute force
def brute(model, x, y):
    """Per example: the flat gradient of the margin (parameter order), Q, and per Linear layer ã (T, in_rows) and
    δ = ∂f/∂(layer output) (T, d_out) — one example at a time, plain autograd, float64."""
    lins = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
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
        for n, m in lins.items():
            a = acts[n].reshape(-1, m.in_features)
            if m.bias is not None:
                a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], 1)
            per[n] = (a.numpy(), outs[n].grad.reshape(-1, m.out_features).numpy())
        out.append((g.numpy(), float(q), per))
    return out


def brute_factors(rows, damping=0.1):
    """{layer: (A, S, λ_A, λ_S)}: A = Σ ããᵀ / positions, S = Σ r δδᵀ / N (r = Q(1 − Q)), λ = damping × mean eig."""
    res = {}
    for name in rows[0][2]:
        a_sum = sum(p[name][0].T @ p[name][0] for _, _, p in rows)
        t = sum(p[name][0].shape[0] for _, _, p in rows)
        s_sum = sum(q * (1 - q) * p[name][1].T @ p[name][1] for _, q, p in rows)
        a, s = a_sum / t, s_sum / len(rows)
        res[name] = (a, s, damping * np.trace(a) / len(a), damping * np.trace(s) / len(s))
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


def inv_sqrt(h):
    e, u = np.linalg.eigh(h)
    return (u * e**-0.5) @ u.T


def brute_precondition(model, rows, hs):
    """H^(-1/2) g per example, H = blockdiag((S + λ_S I) ⊗ (A + λ_A I)) built explicitly: (N, grad_dim)."""
    roots = {n: inv_sqrt(h) for n, h in hs.items()}
    out = []
    for g, _, _ in rows:
        blocks = layer_grads(model, g)
        pre = {n: (roots[n] @ blocks[n].reshape(-1)).reshape(blocks[n].shape) for n in blocks}
        out.append(flat_of(model, pre))
    return np.stack(out)


def kfac_h(fac):
    return {n: np.kron(s + ls * np.eye(len(s)), a + la * np.eye(len(a))) for n, (a, s, la, ls) in fac.items()}


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("seq", [False, True])
def test_factors_match_brute_force(seq):
    model = SeqModel().double() if seq else mlp()
    x, y = data(seq)
    feat = featurizer(model)
    sites, others = kfac.linear_sites(model)
    assert others == []
    total = kfac.FactorSums()
    for b in batches(x, y)():
        total.add(kfac.batch_sums(feat, b, sites)[0])
    want = brute_factors(brute(model, x, y))
    for name, (a, s, la, ls) in want.items():
        np.testing.assert_allclose(total.a[name] / total.tokens[name], a, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(total.s[name] / total.examples, s, rtol=1e-10, atol=1e-14)
    pre = kfac.fit_factors(feat, batches(x, y), "kfac", 0.1)
    for name, (a, s, la, ls) in want.items():
        _, m_in, m_out = pre.blocks[name]
        np.testing.assert_allclose(m_in, inv_sqrt(a + la * np.eye(len(a))), rtol=1e-8, atol=1e-10)
        np.testing.assert_allclose(m_out, inv_sqrt(s + ls * np.eye(len(s))), rtol=1e-8, atol=1e-8)
        assert pre.info["layers"][name]["lambda_in"] == pytest.approx(la, rel=1e-10)


@pytest.mark.parametrize("seq", [False, True])
@pytest.mark.parametrize("kind", ["noop", "dense", "factored"])
def test_preconditioned_gradients_match_brute_force(seq, kind):
    """The featurizer's rows with the fitted curvature = P (H^(-1/2) g) / √grad_dim, P the projector's own explicit
    matrix (noop: I): the factored projector on its fast path (side matrices M P) included."""
    model = SeqModel().double() if seq else mlp()
    x, y = data(seq)
    rows = brute(model, x, y)
    want = brute_precondition(model, rows, kfac_h(brute_factors(rows)))
    feat = featurizer(model, kind, proj_dim=None if kind == "noop" else 16)
    pre = kfac.fit_factors(feat, batches(x, y), "kfac", 0.1)
    feat.curvature = lambda mid: pre
    gd = feat.grad_dim
    p = np.eye(gd) if kind == "noop" else feat.projector.project(torch.eye(gd, dtype=torch.float64), 0).numpy()
    xs, _ = feat.featurize([x, y], 0)
    tol = 2e-6 if kind == "noop" else 2e-5  # rows come back float32; dense and factored also compute in float32
    np.testing.assert_allclose(xs, want @ p / np.sqrt(gd), rtol=tol, atol=tol * np.abs(want @ p).max() / np.sqrt(gd))
    if kind == "factored":  # the fast path is what ran; the materialized path agrees
        assert hasattr(feat.projector_for(0), "featurize_batch")


def test_scores_equal_explicit_solve():
    """Noop projection: X c Xᵀ (c = grad_dim / scale, finalize's inverse) = g_xᵀ H⁻¹ g_y by an explicit solve."""
    model = mlp()
    x, y = data()
    rows = brute(model, x, y)
    hs = kfac_h(brute_factors(rows))
    feat = featurizer(model)
    pre = kfac.fit_factors(feat, batches(x, y), "kfac", 0.1)
    feat.curvature = lambda mid: pre
    xs, _ = feat.featurize([x, y], 0)
    inv, c = kfac.identity_inverse(feat.grad_dim, feat.grad_dim, feat.projector.scale)
    got = xs @ (c * np.eye(feat.grad_dim)) @ xs.T
    want = np.zeros((N, N))
    blocks = [layer_grads(model, g) for g, _, _ in rows]
    for n, h in hs.items():
        gb = np.stack([b[n].reshape(-1) for b in blocks])
        want += gb @ np.linalg.solve(h, gb.T)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())  # (float32 rows)


@pytest.mark.parametrize("seq", [False, True])
def test_ekfac_separable_fit_matches_brute_force(seq):
    """EK-FAC: corrected eigenvalues Λ_ij = mean_n (U_Sᵀ G_n U_A)²_ij in the K-FAC eigenbases, λ = damping × mean Λ,
    log(Λ + λ) fitted by α_i + β_j (least squares), M_S = U_S e^(−α/2) U_Sᵀ, M_A = U_A e^(−β/2) U_Aᵀ (one position
    per example, and several: G_n = Σ_t δ_t ã_tᵀ)."""
    model = SeqModel().double() if seq else mlp()
    x, y = data(seq)
    rows = brute(model, x, y)
    fac = brute_factors(rows)
    feat = featurizer(model)
    pre = kfac.fit_factors(feat, batches(x, y), "ekfac", 0.1)
    for name, (a, s, _, _) in fac.items():
        _, u_a = np.linalg.eigh(a)
        _, u_s = np.linalg.eigh(s)
        gs = [layer_grads(model, g)[name] * np.sqrt(q * (1 - q)) for g, q, _ in rows]
        lam = np.mean([(u_s.T @ g @ u_a) ** 2 for g in gs], axis=0)
        logs = np.log(lam + 0.1 * lam.mean())
        fit = logs.mean(1)[:, None] + logs.mean(0)[None, :] - logs.mean()
        # the preconditioner's Kronecker H⁻¹ = M_S² ⊗ M_A² has eigenvalues e^(−fit) in the (U_S, U_A) basis
        _, m_in, m_out = pre.blocks[name]
        h_inv = np.kron(m_out @ m_out, m_in @ m_in)
        basis = np.kron(u_s, u_a)
        np.testing.assert_allclose(
            basis.T @ h_inv @ basis, np.diag(np.exp(-fit.reshape(-1))), atol=1e-8 * np.exp(-fit).max()
        )
        assert 0 <= pre.info["layers"][name]["fit_residual"] < 1


def test_ekfac_equals_kfac_on_separable_eigenvalues():
    """The separable fit is exact where the corrected eigenvalues are products (one example, one position: Λ = s ⊗ a
    in rank one): then the preconditioner is the exact (Λ + λ)^(-1/2) in the eigenbasis — checked by the solve."""
    sums = kfac.FactorSums()
    rng = np.random.default_rng(0)
    site = kfac.Site("l", "l.weight", None, 3, 4)
    q_a, _ = np.linalg.qr(rng.standard_normal((4, 4)))
    q_s, _ = np.linalg.qr(rng.standard_normal((3, 3)))
    ea, es = np.sort(rng.uniform(0.5, 2, 4)), np.sort(rng.uniform(0.5, 2, 3))  # (eigh's order)
    sums.a["l"], sums.s["l"], sums.tokens["l"], sums.examples = (q_a * ea) @ q_a.T, (q_s * es) @ q_s.T, 1, 1
    sums.lam["l"] = np.outer(es, ea)  # product eigenvalues, damped multiplicatively below
    pre = kfac.solve_factors(sums, [site], "ekfac", 0.1)
    _, m_in, m_out = pre.blocks["l"]
    e_s, u_s = np.linalg.eigh(sums.s["l"])
    e_a, u_a = np.linalg.eigh(sums.a["l"])
    got = np.diag(np.kron(u_s, u_a).T @ np.kron(m_out @ m_out, m_in @ m_in) @ np.kron(u_s, u_a))
    lam = np.outer(e_s, e_a)
    logs = np.log(lam + 0.1 * lam.mean())
    want = np.exp(-(logs.mean(1)[:, None] + logs.mean(0)[None, :] - logs.mean())).reshape(-1)
    np.testing.assert_allclose(got, want, rtol=1e-10)


def test_unsupported_layers_keep_identity_with_a_warning():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(1, 2, 3), nn.Flatten(), nn.Linear(16, C)).double()
    x = torch.randn(N, 1, 10, dtype=torch.float64)
    y = torch.randint(0, C, (N,))
    feat = featurizer(model)
    with pytest.warns(UserWarning, match="keep the identity"):
        pre = kfac.fit_factors(feat, batches(x, y), "kfac", 0.1)
    assert set(pre.blocks) == {"2"}
    assert pre.info["identity"] == ["0.bias", "0.weight"]
    feat.curvature = lambda mid: pre
    xs, _ = feat.featurize([x, y], 0)
    raw = featurizer(model).featurize([x, y], 0)[0]
    np.testing.assert_array_equal(xs[:, :8], raw[:, :8])  # the conv's coordinates as they were
    assert not np.allclose(xs[:, 8:], raw[:, 8:])


def test_record_round_trip_and_damage(tmp_path):
    from trak_core.errors import StoreDamageError

    model = mlp()
    x, y = data()
    pre = kfac.fit_factors(featurizer(model), batches(x, y), "kfac", 0.1)
    rec = kfac.to_record(pre)
    back = kfac.from_record(rec)
    for n, (_, m_in, m_out) in pre.blocks.items():
        np.testing.assert_array_equal(back.blocks[n][1], m_in)
        np.testing.assert_array_equal(back.blocks[n][2], m_out)
    rec["blocks"]["0"]["m_in"]["data"] = kfac._encode(pre.blocks["0"][1] * 2)["data"]
    with pytest.raises(StoreDamageError, match="sha256"):
        kfac.from_record(rec)


@pytest.mark.parametrize("bad", [0, -0.1, float("nan"), float("inf"), "0.1", True, None])
def test_bad_damping_names_the_field(bad):
    with pytest.raises(BadInputError, match="curvature_damping"):
        kfac.check_damping(bad)


def test_unknown_kind_and_no_rows():
    model = mlp()
    feat = featurizer(model)
    with pytest.raises(BadInputError, match="curvature"):
        kfac.fit_factors(feat, lambda: [], "kfacc")
    with pytest.raises(BadInputError, match="no train rows"):
        kfac.fit_factors(feat, lambda: [], "kfac")
