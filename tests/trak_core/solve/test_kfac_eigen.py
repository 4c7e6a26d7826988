"""``curvature="kfac-eigen"``: the Kronecker layers projected in their fitted factors' eigenbasis, against a float64
brute force: the side matrices and the projected rows against the explicitly rotated per-example gradients (pairs,
grid and identity-side blocks, a Linear with its bias, a transformers Conv1D), the fast path against project(), the
diagonal (EK-FAC) inverse by its formula, and TRAKer's scores end to end; featurizing without factors refused."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from test_kfac import (
    C,
    Conv1DSeq,
    N,
    SeqModel,
    batches,
    brute,
    brute_factors,
    data,
    featurizer,
    layer_grads,
    mlp,
)
from torch import nn

from trak_core.errors import BadInputError, StateError
from trak_core.projection.factored import FactoredProjector
from trak_core.projection.projectors import make_projector
from trak_core.solve import kfac, spectrum
from trak_core.store import StoreMetadata


# ------------------------------------------------------------------------------------------ brute force
def kron_sites(model) -> dict:
    """{block name: (module name, transposed)} of the blocks that are a Kronecker product of a layer's factors: a
    Linear's block (its module name), a Conv1D's weight view without its bias (a matrix block, the weight's name)."""
    out = {}
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear):
            out[n] = (n, False)
        elif type(m).__name__ == "Conv1D" and m.weight.shape[0] != m.nf:  # a square one carries its bias
            out[f"{n}.weight"] = (n, True)
    return out


def block_grads(model, g: np.ndarray) -> dict:
    """{block name: the block's gradient matrix (d_out × in_rows)} of the flat gradient g, for :func:`kron_sites`:
    a Linear's [∂W | ∂b], a Conv1D's weight gradient [d_in, d_out] as it is stored."""
    lin = layer_grads(model, g)
    off, params = 0, {}
    for n, p in model.named_parameters():
        params[n] = g[off : off + p.numel()].reshape(p.shape)
        off += p.numel()
    return {b: (params[b] if t else lin[m]) for b, (m, t) in kron_sites(model).items()}


def desc_eigh(m):
    e, u = np.linalg.eigh(m)
    return np.clip(e[::-1], 0, None), u[:, ::-1]


def brute_sides(model, layout, fac) -> dict:
    """{block name: (P_in, P_out)} of the eigenbasis projection by its definition, from brute-force factors."""
    out = {}
    for b in layout.blocks:
        if b.name not in kron_sites(model):
            continue
        mod, transposed = kron_sites(model)[b.name]
        a, s = fac[mod]
        r, c = (a, s) if transposed else (s, a)  # the factor of the block's rows, of its columns
        er, ur = desc_eigh(r)
        ec, uc = desc_eigh(c)
        if b.pairs:
            e = np.outer(er, ec)
            lam = kfac.EIGEN_DAMPING * e.mean()
            key = (e / (e + lam)).reshape(-1)
            order = sorted(range(key.size), key=lambda t: -key[t])
            if b.k < key.size:  # no tie at the cut: the selection is defined
                assert key[order[b.k - 1]] > key[order[b.k]] * (1 + 1e-6)
            pick = order[: b.k]
            out[b.name] = (uc[:, [t % len(ec) for t in pick]], ur[:, [t // len(ec) for t in pick]])
        else:
            out[b.name] = (uc[:, : b.k_in], ur[:, : b.k_out])
        k_in, k_out = (b.k, b.k) if b.pairs else (b.k_in, b.k_out)
        p_in, p_out = out[b.name]  # more coordinates than the eigenbasis has: zero columns
        out[b.name] = tuple(np.pad(m, ((0, 0), (0, k - m.shape[1]))) for m, k in ((p_in, k_in), (p_out, k_out)))
    return out


def aligned(want: np.ndarray, got: np.ndarray) -> np.ndarray:
    """``want``'s columns with the signs of ``got``'s (an eigenvector's sign is arbitrary)."""
    return want * np.where(np.sum(want * got, 0) < 0, -1.0, 1.0)


def random_rows(proj: FactoredProjector, model, g: np.ndarray) -> np.ndarray:
    """The rows of the plain (random) factored projection of the flat gradients g (n × grad_dim), float64."""
    plain = FactoredProjector(proj.grad_dim, proj.proj_dim, proj.seed, proj.proj_type, layout=proj.layout,
                              dtype=torch.float64)  # fmt: skip
    grads, off = {}, 0
    for n, p in model.named_parameters():
        grads[n] = torch.from_numpy(g[:, off : off + p.numel()]).reshape(len(g), *p.shape)
        off += p.numel()
    return plain.project(grads, model_id=0).numpy()


def brute_rows(model, proj, sides: dict, g: np.ndarray) -> tuple[np.ndarray, set]:
    """(the rows (n × proj_dim) of the eigen projection by its definition, from explicit per-example gradients g
    and the ``sides`` of :func:`brute_sides`; the eigen blocks' names): a Kronecker block's coordinates
    P_outᵀ G P_in (pairs: its diagonal; grid: the first k row-major), weight 1; every other block the plain random
    projection's."""
    rnd = random_rows(proj, model, g)
    per = [block_grads(model, gi) for gi in g]
    cols, off = [], 0
    for b in proj.layout.blocks:
        if b.name in sides:
            p_in, p_out = sides[b.name]
            t = np.stack([p_out.T @ d[b.name] @ p_in for d in per])  # (n, k_out, k_in)
            cols.append(np.diagonal(t, axis1=1, axis2=2) if b.pairs else t.reshape(len(g), -1)[:, : b.k])
        else:
            cols.append(rnd[:, off : off + b.k])
        off += b.k
    return np.concatenate(cols, 1), set(sides)


def pre_of(fac: dict, model) -> kfac.KroneckerFactors:
    """Brute-force factors as :class:`kfac.KroneckerFactors` (the sites of the fit's own)."""
    sites, _ = kfac.linear_sites(model)
    by = {s.name: s for s in sites}
    return kfac.KroneckerFactors({n: (by[n], a, s) for n, (a, s) in fac.items()}, {"kind": kfac.EIGEN,
                                 "damping": kfac.EIGEN_DAMPING})  # fmt: skip


def fast_rows(feat, x, y, model_id=0) -> np.ndarray:
    gc = feat.gradient_computer
    out = feat.projector.featurize_batch(feat.model, feat.task, gc._weights(), gc._buffers(), [x, y], model_id)
    return out.double().numpy()


def project_rows(feat, model, g: np.ndarray) -> np.ndarray:
    grads, off = {}, 0
    for n, p in model.named_parameters():
        grads[n] = torch.from_numpy(g[:, off : off + p.numel()]).reshape(len(g), *p.shape)
        off += p.numel()
    return feat.projector.project(grads, model_id=0).double().numpy()


MODELS = {
    "mlp": (mlp, False),
    "seq": (lambda: SeqModel().double(), True),
    "conv1d": (lambda: Conv1DSeq().double(), True),
}


# ------------------------------------------------------------------------------------------ the rows
@pytest.mark.filterwarnings("ignore:curvature=")
@pytest.mark.parametrize("proj_dim", [7, 12, 20, 80])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("reduced", [False, True], ids=["eigh", "tridiagonal"])
def test_rows_are_the_rotated_gradients_selected_coordinates(name, proj_dim, block_form, reduced, monkeypatch):
    """The projector's sides are the factors' eigenvectors as defined (up to sign), and its rows (fast path and
    project()) the explicitly rotated per-example gradients' selected coordinates; other blocks keep the random
    projection's rows. At proj_dim 80 (above the MLP's 53 gradient coordinates) a block has more coordinates than
    its eigenbasis: the rest are 0. ``tridiagonal``: every factor through the reduction that wide factors take
    (:class:`~trak_core.solve.spectrum.FactorSpectrum`), not numpy's full eigendecomposition."""
    if reduced:
        monkeypatch.setattr(spectrum, "DIRECT_MAX", 0)
    make, seq = MODELS[name]
    model = make()
    x, y = data(seq)
    feat = featurizer(model, "factored", proj_dim)
    feat.projector.dtype = torch.float64
    rows = brute(model, x, y)
    fac = brute_factors(rows)
    pre = kfac.fit_factors(feat, batches(x, y), kfac.EIGEN)
    kfac.bind_eigen(feat.projector, lambda mid: pre)
    want_sides = brute_sides(model, feat.projector.layout, fac)
    assert want_sides, "no Kronecker block"
    facs = feat.projector.factors(0)
    for bname, (w_in, w_out) in want_sides.items():
        p_in, p_out, w = facs[bname]
        assert w == 1.0
        w_in, w_out = aligned(w_in, p_in.numpy()), aligned(w_out, p_out.numpy())
        np.testing.assert_allclose(p_in.numpy(), w_in, atol=1e-8)
        np.testing.assert_allclose(p_out.numpy(), w_out, atol=1e-8)
        want_sides[bname] = (w_in, w_out)
    g = np.stack([r[0] for r in rows])
    want, eigen = brute_rows(model, feat.projector, want_sides, g)
    scale = np.abs(want).max()
    np.testing.assert_allclose(fast_rows(feat, x, y), want, rtol=1e-7, atol=1e-10 * scale)
    np.testing.assert_allclose(project_rows(feat, model, g), want, rtol=1e-7, atol=1e-10 * scale)
    if name == "conv1d":
        assert eigen == {"tok.weight", "head"}


def test_each_models_factors_are_decomposed_once(monkeypatch):
    """Switching between models (featurize, then score, checkpoint by checkpoint) reuses each model's sides; other
    factors for a model (a refit) are decomposed again."""
    model = mlp()
    x, y = data()
    feat = featurizer(model, "factored", 12)
    pre = kfac.fit_factors(feat, batches(x, y), kfac.EIGEN)
    other = kfac.fit_factors(feat, batches(x[:12], y[:12]), kfac.EIGEN)
    given = {0: pre, 1: other}
    calls = []
    real = kfac.eigen_sides
    monkeypatch.setattr(kfac, "eigen_sides", lambda *a, **k: calls.append(1) or real(*a, **k))
    kfac.bind_eigen(feat.projector, lambda mid: given[mid])
    first = {mid: feat.projector.factors(mid) for mid in (0, 1)}
    assert len(calls) == 2
    for mid in (0, 1, 0):
        again = feat.projector.factors(mid)
        assert all(torch.equal(again[b][0], first[mid][b][0]) for b in again)
    assert len(calls) == 2
    given[0] = other
    feat.projector.factors(1)
    assert len(calls) == 2
    feat.projector.factors(0)
    assert len(calls) == 3


def test_the_cases_cover_pairs_grid_and_identity_sides(monkeypatch):
    """The parametrization above meets each way a block keeps its coordinates, in a Kronecker block."""

    def forms():
        out = set()
        for make, _ in MODELS.values():
            for p in (7, 12, 20):
                model = make()
                for b in featurizer(model, "factored", p).projector.layout.blocks:
                    if b.name in kron_sites(model):
                        out.add("pairs" if b.pairs else "identity side" if (b.id_in or b.id_out) else "grid")
        return out

    assert "pairs" in forms()
    from trak_core.projection import layout

    for name in ("PAIRS_MAX_WEIGHTS", "PAIRS_MAX_MACS", "PAIRS_MAX_RATIO"):
        monkeypatch.setattr(layout, name, 0)
    assert {"grid", "identity side"} <= forms()


def test_square_conv1d_with_its_bias_keeps_random_sides():
    """A square Conv1D's block carries its bias (not a Kronecker product): random sides; the head gets the
    eigenbasis."""
    model = Conv1DSeq(width=6).double()
    x, y = data(seq=True)
    feat = featurizer(model, "factored", 12)
    with pytest.warns(UserWarning):
        pre = kfac.fit_factors(feat, batches(x, y), kfac.EIGEN)
    before = feat.projector.factors(0)
    kfac.bind_eigen(feat.projector, lambda mid: pre)
    after = feat.projector.factors(0)
    assert set(kfac.eigen_sides(feat.projector.layout.blocks, pre)) == {"head"}
    assert (
        torch.equal(after["tok.weight"][0], before["tok.weight"][0])
        and after["tok.weight"][2] == before["tok.weight"][2]
    )
    assert after["head"][2] == 1.0 and not torch.equal(after["head"][0], before["head"][0])


def test_side_override_shapes_and_names_are_checked():
    model = mlp()
    proj = featurizer(model, "factored", 12).projector
    b = next(b for b in proj.layout.blocks if b.kind == "linear")
    proj.side_override = lambda mid: {"nope": (np.eye(2), np.eye(2))}
    with pytest.raises(BadInputError, match="nope"):
        proj.factors(0)
    proj.side_override = lambda mid: {b.name: (np.eye(b.in_rows), np.eye(b.d_out + 1))}
    with pytest.raises(BadInputError, match="needs"):
        proj.factors(0)
    proj.side_override = None
    proj.factors(0)


# ------------------------------------------------------------------------------------------ the inverse
def test_block_inverse_is_the_diagonal_formula():
    """An eigen block's inverse is diag(1 / (diag(G_b) + λ_b)), λ_b = EIGEN_DAMPING × mean diag(G_b); the conv's
    block (no factors) its damped XᵀX block."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(1, 2, 3), nn.Flatten(), nn.Linear(16, C)).double()
    x, y = torch.randn(N, 1, 10, dtype=torch.float64), torch.randint(0, C, (N,))
    feat = featurizer(model, "factored", 14)
    with pytest.warns(UserWarning, match="keep their block of XᵀX"):
        pre = kfac.fit_factors(feat, batches(x, y), kfac.EIGEN)
    assert pre.info["kind"] == kfac.EIGEN
    kfac.bind_eigen(feat.projector, lambda mid: pre)
    xs, _ = feat.featurize([x, y], 0)
    xtx = xs.astype(np.float64).T @ xs.astype(np.float64)
    meta = StoreMetadata.from_projector(feat.projector.spec(), train_set_size=N, curvature=kfac.EIGEN)
    got, per = kfac.block_inverse(meta, 0, pre, xtx)
    want, off = np.zeros_like(xtx), 0
    for b in feat.projector.layout.blocks:
        sl = slice(off, off + b.k)
        g = xtx[sl, sl]
        if b.name == "2":
            d = np.diag(g)
            want[sl, sl] = np.diag(1 / (d + kfac.EIGEN_DAMPING * d.mean()))
        else:
            want[sl, sl] = np.linalg.inv(g + kfac.EMPIRICAL_DAMPING * np.trace(g) / b.k * np.eye(b.k))
        off += b.k
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12 * np.abs(want).max())
    assert per["2"]["block"] == kfac.EIGEN and per["0"]["block"] == "xtx"


# ------------------------------------------------------------------------------------------ TRAKer
def traker(model, path, projector="factored", **kw):
    from trak_core.compat.traker import TRAKer

    gd = sum(p.numel() for p in model.parameters())
    proj = make_projector("factored", gd, 12, 0, "rademacher", model=model) if projector == "factored" else None
    return TRAKer(model=model, task="image_classification", train_set_size=N, save_dir=str(path), device="cpu",
                  projector=proj, proj_dim=12, use_half_precision=False, curvature=kfac.EIGEN,
                  logging_level=logging.ERROR, **kw)  # fmt: skip


@pytest.mark.parametrize("projector", ["factored", None])
def test_scores_equal_brute_force(tmp_path, projector, monkeypatch):
    """TRAKer(curvature="kfac-eigen") end to end (a given factored projector, and the default one whose split waits
    for the first rows): Q · X_target H⁻¹ X_trainᵀ with X the eigen projection by its definition of the brute
    force's float64 gradients (/√grad_dim, as TRAK normalizes) and H⁻¹ the diagonal formula per eigen block. The
    factors are decomposed once for the train rows and the targets together."""
    calls = []
    real = kfac.eigen_sides
    monkeypatch.setattr(kfac, "eigen_sides", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = mlp()
    x, y = data()
    rows = brute(model, x, y)
    fac = brute_factors(rows)
    tr = traker(model, tmp_path / "s", projector)
    assert tr.curvature_damping == kfac.EIGEN_DAMPING
    tr.load_checkpoint(model.state_dict(), model_id=0)
    tr.fit_curvature([[x[:10], y[:10]], [x[10:], y[10:]]])
    tr.featurize([x, y], num_samples=N)
    tr.finalize_features()
    tr.start_scoring_checkpoint("e", model.state_dict(), 0, N)
    tr.score([x, y], num_samples=N)
    got = np.asarray(tr.finalize_scores("e"), dtype=np.float64)
    assert len(calls) == 1

    proj = tr.projector
    g = np.stack([r[0] for r in rows])
    xs, eigen = brute_rows(model, proj, brute_sides(model, proj.layout, fac), g)
    xs = xs / np.sqrt(sum(p.numel() for p in model.parameters()))
    assert eigen == {"0", "2"}
    inv, off = np.zeros((12, 12)), 0
    for b in proj.layout.blocks:
        sl = slice(off, off + b.k)
        d = np.diag(xs[:, sl].T @ xs[:, sl])
        inv[sl, sl] = np.diag(1 / (d + kfac.EIGEN_DAMPING * d.mean()))
        off += b.k
    want = (xs @ inv @ xs.T) * np.array([r[1] for r in rows])[:, None]
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())  # (float32 rows and inverse)

    # a TRAKer reopening the store binds the recorded factors: the same scores without fitting again
    del tr
    import gc

    gc.collect()
    tr2 = traker(model, tmp_path / "s", projector)
    tr2.start_scoring_checkpoint("e2", model.state_dict(), 0, N)
    tr2.score([x, y], num_samples=N)
    np.testing.assert_allclose(np.asarray(tr2.finalize_scores("e2"), dtype=np.float64), got, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("projector", ["factored", None])
def test_featurize_without_factors_is_refused(tmp_path, projector):
    model = mlp()
    x, y = data()
    tr = traker(model, tmp_path / "s", projector)
    tr.load_checkpoint(model.state_dict(), model_id=0)
    with pytest.raises(StateError, match="fit_curvature"):
        tr.featurize([x, y], num_samples=N)


def test_rows_featurized_without_factors_are_refused_by_the_fit(tmp_path):
    """A store of "kfac-eigen" whose rows were featurized with no factors (not through TRAKer) cannot get factors."""
    from trak_core.compat.traker import TRAKer

    model = mlp()
    x, y = data()
    tr = traker(model, tmp_path / "s")
    tr.load_checkpoint(model.state_dict(), model_id=0)
    tr.featurizer.projector.side_override = None  # as a route that does not bind the eigenbasis would
    tr.featurize([x, y], num_samples=N)
    tr._flush_rows()
    tr._fitted.clear()
    with pytest.raises(StateError, match="featurized without curvature factors"):
        tr.fit_curvature([[x, y]])
    assert isinstance(tr, TRAKer)


@pytest.mark.parametrize("projector", ["factored", None])
def test_index_queries_in_the_recorded_eigenbasis(tmp_path, projector):
    """TrakIndex rebuilds the store's projection and binds the recorded factors' eigenbasis: its scores are
    finalize_scores'."""
    from trak_core import TrakIndex

    model = mlp()
    x, y = data()
    tr = traker(model, tmp_path / "s", projector)
    tr.load_checkpoint(model.state_dict(), model_id=0)
    tr.fit_curvature([[x, y]])
    tr.featurize([x, y], num_samples=N)
    tr.finalize_features()
    xt, yt = x[:5] * 0.5, y[:5]
    tr.start_scoring_checkpoint("e", model.state_dict(), 0, 5)
    tr.score([xt, yt], num_samples=5)
    got = np.asarray(tr.finalize_scores("e"), dtype=np.float64)
    tr._close()
    del tr
    index = TrakIndex(tmp_path / "s", model=mlp(), checkpoints=[model.state_dict()], task="image_classification",
                      device="cpu")  # fmt: skip
    res = index.query((xt, yt), k=N)
    np.testing.assert_allclose(np.take_along_axis(got.T, res.indices, 1), res.scores, rtol=1e-5, atol=1e-6)


def test_projectors_of_a_store_share_its_decomposition(tmp_path, monkeypatch):
    """The pipeline builds a projector per shard task: those bound to one store's recorded factors (bind_recorded,
    as the tasks and the index bind them) decompose each factor set once per process; another fit of the model, or
    another layout, is decomposed anew; the shared sides are the ones a projector of its own computes."""
    from trak_core.engine import recorded_projector
    from trak_core.solve import kfac_record
    from trak_core.store import open_store

    model = mlp()
    x, y = data()
    tr = traker(model, tmp_path / "s")
    tr.load_checkpoint(model.state_dict(), model_id=0)
    tr.fit_curvature([[x, y]])
    tr.featurize([x, y], num_samples=N)
    tr.finalize_features()
    tr._close()
    del tr
    monkeypatch.setattr(kfac_record, "RECORDED_SIDES", kfac.SidesCache(keep=2))
    calls = []
    real = kfac.eigen_sides
    monkeypatch.setattr(kfac, "eigen_sides", lambda *a, **k: calls.append(1) or real(*a, **k))
    store = open_store(str(tmp_path / "s"), mode="r")

    def sides(store, **kw):
        proj = recorded_projector(store.meta, model, None, "cpu") if not kw else make_projector(**kw, model=model)
        kfac_record.bind_recorded(proj, store)
        return proj._overridden_sides(0)

    first = sides(store)
    again = [sides(store) for _ in range(3)]
    assert len(calls) == 1
    pre = kfac_record.current_factors(store, 0)
    own = {k: (torch.as_tensor(a), torch.as_tensor(b)) for k, (a, b) in real(recorded_projector(
        store.meta, model, None, "cpu").layout.blocks, pre).items()}  # fmt: skip
    for got in [first, *again]:
        assert got.keys() == own.keys() and all(torch.equal(got[k][i], own[k][i]) for k in own for i in (0, 1))
    gd = sum(p.numel() for p in model.parameters())
    sides(store, kind="factored", grad_dim=gd, proj_dim=8, seed=0, proj_type="rademacher")  # another layout
    assert len(calls) == 2
    refit = kfac.KroneckerFactors({n: (s, a * 2.0, f) for n, (s, a, f) in pre.blocks.items()}, dict(pre.info))
    monkeypatch.setattr(kfac_record, "current_factors", lambda st, mid: refit)
    sides(store)
    assert len(calls) == 3


# ------------------------------------------------------------------------------------------ the split
def brute_energies(pre, energies: dict, proj_dim: int) -> dict:
    """``kfac.eigen_energies`` by its definition, by enumeration of every layer's eigen-coordinates."""
    group = {n for site, _, _ in pre.blocks.values() for n in (site.weight, site.bias) if n}
    e_k = sum(v for k, v in energies.items() if k in group)
    rest = sum(energies.values()) - e_k
    ranked, every = [], []
    for name, (site, a, s) in pre.blocks.items():
        ea, es = np.clip(np.linalg.eigvalsh(a), 0, None), np.clip(np.linalg.eigvalsh(s), 0, None)
        e = [x * y for x in es for y in ea]
        lam = kfac.EIGEN_RANK_DAMPING * np.mean(e)
        ranked += [(x / (x + lam), site) for x in e]
        every += e
    every.sort(reverse=True)  # the fewest largest eigenvalues holding EIGEN_ENERGY_KEPT of their sum
    n_k = next(i + 1 for i in range(len(every)) if sum(every[: i + 1]) >= kfac.EIGEN_ENERGY_KEPT * sum(every))
    share = proj_dim * e_k / (e_k + rest)
    p_k = max(round(share), min(n_k, round(kfac.EIGEN_MAX_SHARE * proj_dim)))
    if share < p_k < proj_dim and rest > 0:
        e_k = rest * p_k / (proj_dim - p_k)
    ranked.sort(key=lambda t: -t[0])
    counts: dict = {}
    for _, site in ranked[:p_k]:
        counts[site.weight] = counts.get(site.weight, 0) + 1
    out = {k: v for k, v in energies.items() if k not in group}
    for site, _, _ in pre.blocks.values():
        out[site.weight] = e_k * counts.get(site.weight, 0) / p_k
        if site.bias:
            out[site.bias] = 0.0
    return out


def test_eigen_energies_follow_the_top_eigen_coordinates():
    """The Kronecker layers get their share of the probe's energy, or the coordinates holding 95 % of their K-FAC
    energy where more (up to 90 % of proj_dim), split ∝ their coordinates among the top p_K by e/(e + λ); other
    parameters keep theirs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(1, 2, 3), nn.Flatten(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, C)).double()
    x, y = torch.randn(N, 1, 10, dtype=torch.float64), torch.randint(0, C, (N,))
    with pytest.warns(UserWarning):
        pre = kfac.fit_factors(featurizer(model, "factored", 14), batches(x, y), kfac.EIGEN)
    raised = set()
    for conv in (0.01, 40.0):  # the Kronecker layers' share of the probe: 99.8 %, then 10 %
        energies = {"0.weight": conv, "0.bias": 0.0, "2.weight": 3.0, "2.bias": 0.25, "4.weight": 1.0, "4.bias": 0.25}
        for p in (6, 20, 60):
            got = kfac.eigen_energies(pre, energies, p)
            want = brute_energies(pre, energies, p)
            assert got.keys() == want.keys()
            for k in want:
                assert got[k] == pytest.approx(want[k], rel=1e-12, abs=1e-12), (p, k)
            assert got["0.weight"] == conv and got["0.bias"] == 0.0
            raised.add(sum(got.values()) > sum(energies.values()) * (1 + 1e-9))
    assert raised == {False, True}  # both the probe's share and the eigenvalues' floor decide somewhere


def test_the_default_projector_splits_by_the_fitted_factors(tmp_path, monkeypatch):
    """TRAKer's default projector (created by the first rows) takes its energies from the first fit's factors."""
    from trak_core import engine

    model = mlp()
    x, y = data()
    probe = {"0.weight": 1.0, "0.bias": 0.1, "2.weight": 3.0, "2.bias": 0.2}
    monkeypatch.setattr(engine, "probe_split", lambda *a, **k: {"energies": dict(probe)})
    tr = traker(model, tmp_path / "s", None)
    tr.load_checkpoint(model.state_dict(), model_id=0)
    tr.fit_curvature([[x, y]])
    tr.featurize([x, y], num_samples=N)
    tr._flush_rows()
    from trak_core.projection.energy import quantize_energies

    want = quantize_energies(brute_energies(tr._fitted[0], probe, 12))  # rounded as every recorded split
    assert tr.projector.energies == pytest.approx(want)
    assert tr.store.meta.projector_params["energies"] == pytest.approx(want)


def test_settings_refused_where_the_eigenbasis_is_not_bound():
    """The factored projector is required (its blocks are the layers); the settings take the name, with the
    curvature's own damping unless told; a TRAKer given a dense projector is refused before anything."""
    from trak_core.rules import check_projection
    from trak_core.settings import TrakSettings

    with pytest.raises(BadInputError, match="needs the factored projector"):
        check_projection("dense", 8, 100, "adaptive", kfac.EIGEN)
    check_projection("factored", 8, 100, "adaptive", kfac.EIGEN)
    assert TrakSettings(curvature=kfac.EIGEN).curvature_damping is None  # kfac.default_damping at the fit
    assert kfac.default_damping(kfac.EIGEN) == kfac.EIGEN_DAMPING != kfac.default_damping("kfac")
    with pytest.raises(BadInputError, match="curvature_damping"):
        traker(mlp(), "/nonexistent/never-created", curvature_damping=0.0)


def _count_reductions(monkeypatch) -> list:
    """Every factor reduced from here on (a FactorSpectrum or the values-only driver), by matrix id; every factor
    takes the reduction (DIRECT_MAX 0)."""
    seen: list = []
    monkeypatch.setattr(spectrum, "DIRECT_MAX", 0)
    monkeypatch.setattr(kfac, "DIRECT_MAX", 0)
    real_spectrum, real_values = kfac.FactorSpectrum, kfac._eigenvalues
    monkeypatch.setattr(kfac, "FactorSpectrum", lambda m: seen.append(id(m)) or real_spectrum(m))
    monkeypatch.setattr(kfac, "_eigenvalues", lambda m: seen.append(id(m)) or real_values(m))
    return seen


def test_the_splits_reductions_serve_the_sides_of_the_same_factors(monkeypatch):
    """With a SpectraMemo the split reduces each factor once and the sides reuse it: the same split and the same
    sides, bit for bit, as without; each kept reduction is taken once; a budget keeps the widest factors that fit in
    it, and one of 0 bytes keeps none."""
    model = mlp()
    x, y = data()
    feat = featurizer(model, "factored", 12)
    pre = kfac.fit_factors(feat, batches(x, y), kfac.EIGEN)
    blocks = feat.projector.layout.blocks
    energies = {"0.weight": 1.0, "0.bias": 0.1, "2.weight": 3.0, "2.bias": 0.2}
    factors = {id(m) for _, a, s in pre.blocks.values() for m in (a, s)}
    seen = _count_reductions(monkeypatch)
    want_split, want_sides = kfac.eigen_energies(pre, energies, 12), kfac.eigen_sides(blocks, pre)
    seen.clear()
    memo = kfac.SpectraMemo()
    assert kfac.eigen_energies(pre, energies, 12, memo) == want_split
    assert sorted(seen) == sorted(factors)  # each factor once
    seen.clear()
    got = kfac.eigen_sides(blocks, pre, spectra=memo)
    assert seen == [] and got.keys() == want_sides.keys()
    for name, (p_in, p_out) in want_sides.items():
        np.testing.assert_array_equal(got[name][0], p_in)
        np.testing.assert_array_equal(got[name][1], p_out)
    kfac.eigen_sides(blocks, pre, spectra=memo)  # taken: reduced anew
    assert sorted(seen) == sorted(factors)
    seen.clear()
    mats = [m for _, a, s in pre.blocks.values() for m in (a, s)]
    widest = max(mats, key=lambda m: m.shape[0])
    assert sum(m.shape == widest.shape for m in mats) == 1
    one = kfac.SpectraMemo(max_bytes=widest.nbytes)  # room for the widest alone
    kfac.eigen_energies(pre, energies, 12, one)
    seen.clear()
    kfac.eigen_sides(blocks, pre, spectra=one)
    assert sorted(seen) == sorted(id(m) for m in mats if m is not widest)
    seen.clear()
    empty = kfac.SpectraMemo(max_bytes=0)
    assert kfac.eigen_energies(pre, energies, 12, empty) == want_split
    kfac.eigen_sides(blocks, pre, spectra=empty)
    assert sorted(seen) == sorted([*factors, *factors])  # the split's and the sides' own


def test_a_traker_reduces_model_zeros_factors_once(tmp_path, monkeypatch):
    """TRAKer's default projector: the split and the first sides share one reduction per factor of model 0, and the
    sides equal those of a TRAKer that keeps no reduction (SPECTRA_KEEP_BYTES 0), bit for bit."""
    from trak_core import engine

    model = mlp()
    x, y = data()
    probe = {"0.weight": 1.0, "0.bias": 0.1, "2.weight": 3.0, "2.bias": 0.2}
    monkeypatch.setattr(engine, "probe_split", lambda *a, **k: {"energies": dict(probe)})
    seen = _count_reductions(monkeypatch)
    sides = {}
    for keep in (kfac.SPECTRA_KEEP_BYTES, 0):
        monkeypatch.setattr(kfac, "SPECTRA_KEEP_BYTES", keep)
        tr = traker(model, tmp_path / f"s{keep}", None)
        tr.load_checkpoint(model.state_dict(), model_id=0)
        tr.fit_curvature([[x, y]])
        seen.clear()
        tr.featurize([x, y], num_samples=N)
        factors = [id(m) for _, a, s in tr._fitted[0].blocks.values() for m in (a, s)]
        assert sorted(seen) == sorted(factors * (1 if keep else 2)), keep
        sides[keep] = tr.projector.factors(0)
    assert sides[0]
    for name, (p_in, p_out, _) in sides[0].items():
        assert torch.equal(sides[kfac.SPECTRA_KEEP_BYTES][name][0], p_in)
        assert torch.equal(sides[kfac.SPECTRA_KEEP_BYTES][name][1], p_out)
