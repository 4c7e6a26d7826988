"""K-FAC's factor sums taken from the factored projector's own forward and backward while featurizing
(:meth:`kfac.FactorFold.featurize`, :mod:`trak_core.solve.kfac_tap`): equal to the float64 brute force and to the
fold's own pass (:func:`kfac.batch_sums`, :func:`kfac.fit_factors`) over the same rows, to float64 rounding, for an MLP
with and without biases (r = Q(1 − Q)), sequence models (a Linear, a transformers Conv1D), a tiny GPT-2 (causal LM,
padding), a layer called twice, a weight used outside its module's forward, in uneven batches with rows counted twice
and in a memory budget's pieces; and no pass of its own where the fast path ran (TRAKer, its default projector, the
pipeline's shards), the scores unchanged."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from test_kfac import D_IN, C, Conv1DSeq, N, SeqModel, batches, brute, brute_factors, data, featurizer
from torch import nn

from trak_core.featurize import featurizer as featurizer_module
from trak_core.featurize.budget import MemoryFit
from trak_core.featurize.featurizer import Featurizer
from trak_core.projection.projectors import make_projector
from trak_core.solve import kfac

#: rows in uneven batches, out of order, 3..6 and N//2.. counted twice
ORDERS = (np.arange(N // 2, N), np.arange(0, 7), np.arange(3, N // 2 + 4)[::-1].copy())


def refuse(*args, **kwargs):
    raise AssertionError("the factor sums ran a forward and backward of their own")


@contextlib.contextmanager
def no_pass():
    """Inside: the fold's own pass (one more forward and backward of the batch) raises if it runs."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(kfac, "_site_tensors", refuse)
        yield


def passes(monkeypatch) -> list:
    """Counts the fold's own passes (the list grows by one per pass)."""
    seen: list = []
    real = kfac._site_tensors

    def counted(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(kfac, "_site_tensors", counted)
    return seen


def mlp(bias: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, 5, bias=bias), nn.Tanh(), nn.Linear(5, C, bias=bias)).double()


class TwiceAndTied(nn.Module):
    """``twice`` is called twice per example (no factors: its XᵀX block), ``head``'s weight is used by its module and
    by ``F.linear`` outside it (the projector substitutes that weight; the factors see the module's own call)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.first, self.twice = nn.Linear(D_IN, 5), nn.Linear(5, 5)
        self.head = nn.Linear(5, C)

    def forward(self, x):
        h = torch.tanh(self.twice(torch.tanh(self.twice(torch.tanh(self.first(x))))))
        return self.head(h) + 0.5 * nn.functional.linear(torch.sin(h), self.head.weight)


def factored_featurizer(model, task="image_classification", proj_dim=12) -> Featurizer:
    gd = sum(p.numel() for p in model.parameters())
    proj = make_projector("factored", gd, proj_dim, 0, "rademacher", device="cpu", model=model)
    feat = Featurizer(model, task, proj, dtype=torch.float64)
    feat.load_state(model.state_dict())
    return feat


def folded(feat, x, y, orders=ORDERS) -> kfac.FactorFold:
    fold = kfac.FactorFold(len(y))
    for rows in orders:
        x_b, q_b = fold.featurize(feat, [x[rows], y[rows]], 0, rows)
        want_x, want_q = feat.featurize([x[rows], y[rows]], 0, rows)  # the rows are the plain featurizer's
        np.testing.assert_array_equal(x_b, want_x)
        np.testing.assert_array_equal(q_b, want_q)
    return fold


def assert_same(got: kfac.KroneckerFactors, want: dict, rtol=1e-10) -> None:
    assert set(got.blocks) == set(want)
    for name, (a, s) in want.items():
        _, ga, gs = got.blocks[name]
        assert ga.dtype == gs.dtype == np.float64
        np.testing.assert_allclose(ga, a, rtol=rtol, atol=rtol * np.abs(a).max())
        np.testing.assert_allclose(gs, s, rtol=rtol, atol=rtol * np.abs(s).max())


def pass_factors(pre: kfac.KroneckerFactors) -> dict:
    return {n: (a, s) for n, (_, a, s) in pre.blocks.items()}


# ------------------------------------------------------------------------------------------ the sums
MODELS = {"mlp": lambda: mlp(True), "mlp-no-bias": lambda: mlp(False), "seq": lambda: SeqModel().double(),
          "conv1d": lambda: Conv1DSeq().double()}  # fmt: skip


@pytest.mark.parametrize("model_of", list(MODELS.values()), ids=list(MODELS))
def test_folded_sums_match_brute_force_and_the_pass_without_a_pass(model_of, recwarn):
    """Rows out of order, in uneven batches, some twice: the brute-force factors of the rows counted once (r = Q(1 −
    Q) of the classifier's rows), and fit_factors' over the same rows, to float64 rounding; no pass of their own."""
    model = model_of()
    seq = isinstance(model, (SeqModel, Conv1DSeq))
    x, y = data(seq)
    with no_pass():
        fold = folded(factored_featurizer(model), x, y)
    assert fold.covers(np.ones(N, bool))
    got = fold.factors("kfac", warn=False)
    assert got.info["rows"] == N
    brute_rows = brute(model, x, y)
    want = brute_factors(brute_rows)
    assert any(q * (1 - q) < 0.2 for _, q, _ in brute_rows)  # the weights r differ from row to row
    assert_same(got, want)
    kfac_sites = {s.name for s in kfac.linear_sites(model)[0]}
    assert set(want) == kfac_sites
    fitted = kfac.fit_factors(featurizer(model), batches(x, y, 9), "kfac", warn=False)
    assert_same(got, pass_factors(fitted))
    assert got.info["identity"] == fitted.info["identity"]


def test_a_layer_called_twice_and_a_weight_used_outside_its_module():
    """A Linear called twice keeps its XᵀX block (as the pass says); a weight the projector substitutes (used outside
    its module's forward) still gets the factors of its module's call, as the pass computes them."""
    model = TwiceAndTied().double()
    x, y = data()
    with no_pass(), pytest.warns(UserWarning, match="weight substitution"):
        fold = folded(factored_featurizer(model, proj_dim=20), x, y)
    got = fold.factors("kfac", warn=False)
    fitted = kfac.fit_factors(featurizer(model), batches(x, y, 9), "kfac", warn=False)
    assert set(got.blocks) == {"first", "head"} and "twice.weight" in got.info["identity"]
    assert got.info["identity"] == fitted.info["identity"]
    assert_same(got, pass_factors(fitted))


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=13, n_positions=12, n_embd=8, n_layer=2, n_head=2)).double().eval()


def texts(lengths, width, seed=30):
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(2, 13, (n,), generator=torch.Generator().manual_seed(seed + i))
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    return [ids, mask, torch.where(mask.bool(), ids, torch.full_like(ids, -100))]


def test_a_gpt2_causal_lm_with_padding_matches_the_pass():
    """A tiny GPT-2 (transformers Conv1D layers, a causal LM: r = 1, real tokens only): the folded sums of right-padded
    texts in uneven batches, some rows twice, equal fit_factors' over the same rows (float64 rounding)."""
    model = tiny_gpt2()
    lengths = [7, 4, 6, 3, 7, 2, 5, 6, 3, 4, 7]
    batch = texts(lengths, 8)
    gd = sum(p.numel() for p in model.parameters())
    feat = Featurizer(model, "causal_lm", make_projector("factored", gd, 40, 0, "rademacher", model=model),
                      dtype=torch.float64)  # fmt: skip
    feat.load_state(model.state_dict())
    fold, wide = kfac.FactorFold(len(lengths)), kfac.FactorFold(len(lengths))
    with no_pass():
        for rows in (np.arange(5, 11), np.arange(0, 3), np.array([4, 2, 1, 3])):  # rows 1, 2 twice; batches of 6, 3, 4
            fold.featurize(feat, [t[rows] for t in batch], 0, rows)
        wide.featurize(feat, texts(lengths, 11), 0, np.arange(len(lengths)))  # the same texts padded wider
    assert fold.covers(np.ones(len(lengths), bool))
    got = fold.factors("ekfac", warn=False)
    plain = Featurizer(model, "causal_lm", make_projector("noop", gd, gd, 0, "rademacher"), dtype=torch.float64)
    plain.load_state(model.state_dict())
    fitted = kfac.fit_factors(plain, lambda: [[t[:5] for t in batch], [t[5:] for t in batch]], "ekfac", warn=False)
    conv1d = {
        f"transformer.h.{i}.{n}" for i in (0, 1) for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    }
    assert set(got.blocks) == conv1d and got.info["identity"] == fitted.info["identity"]
    assert all(np.abs(s).max() > 0 for _, _, s in got.blocks.values())
    assert_same(got, pass_factors(fitted))
    # padded wider, the same texts give the same factors (a padding position counts in neither A nor S)
    assert_same(wide.factors("ekfac", warn=False), pass_factors(fitted), rtol=1e-9)


def test_a_memory_budget_s_pieces_and_probe(monkeypatch):
    """Under a memory budget a batch is computed in pieces (here 5 rows each): each piece's rows are counted once, the
    budget's probe (measured with the tap's tensors) counts none of its rows."""
    model = mlp(True)
    x, y = data()
    feat = factored_featurizer(model)
    probes: list = []

    def fit(run, device, budget, reserve=0):
        probes.append(feat.tap is not None)
        run(1)
        run(3)
        return MemoryFit(base=0, points=((5, 0),))

    monkeypatch.setattr(featurizer_module, "fit_memory", fit)
    feat.max_memory = 1 << 40
    fold = kfac.FactorFold(N)
    with no_pass():
        for rows in ORDERS:
            fold.featurize(feat, [x[rows], y[rows]], 0, rows)
    assert probes == [True]  # measured once, with the tap
    assert_same(fold.factors("kfac", warn=False), brute_factors(brute(model, x, y)))


def test_without_the_fast_path_the_fold_runs_its_pass(monkeypatch):
    """A projector without the fast path (here the identity): the fold's own pass, once per batch with rows not
    counted yet, the same factors."""
    seen = passes(monkeypatch)
    model = mlp(True)
    x, y = data()
    fold = folded(featurizer(model), x, y, ORDERS + (np.arange(0, 5),))  # the last batch: every row counted already
    assert len(seen) == len(ORDERS)
    assert_same(fold.factors("kfac", warn=False), brute_factors(brute(model, x, y)))


# ------------------------------------------------------------------------------------------ TRAKer and the shards
def traker_scores(path, projector, monkeypatch, old: bool, batch: int = 7):
    """TRAKer(curvature="kfac") without a fit; ``old``: the factor sums by the fold's pass after featurizing."""
    from test_kfac_store import run

    if old:
        with monkeypatch.context() as m:

            def featurize(self, feat, rows_batch, model_id, rows):
                out = feat.featurize(rows_batch, model_id, rows)
                self.add(feat, rows_batch, rows)
                return out

            m.setattr(kfac.FactorFold, "featurize", featurize)
            return run(path, "kfac", projector=projector, fit=False, batch=batch)
    return run(path, "kfac", projector=projector, fit=False, batch=batch)


@pytest.mark.parametrize("default", [False, True], ids=["factored", "default-projector"])
def test_traker_scores_unchanged_without_a_pass(tmp_path, monkeypatch, default):
    """TRAKer(curvature="kfac") with the factored projector, or its default one (the rows held until the projector
    is chosen are folded too): no pass of the fold's own, the factors and scores of the pass after featurizing.

    The scores go through a float32 inverse of a nearly undamped H (λ = 0.001 × the mean eigenvalue): with the default
    projector's layout the pass's own scores move by 1.6e-5 × their largest when its batches change (float64
    rounding of the factors, one float32 rounding of the inverse); there the folded scores are held to that."""
    from test_kfac_store import DEFAULT

    from trak_core.solve import kfac_record

    projector = DEFAULT if default else None
    want, ref, _ = traker_scores(tmp_path / "old", projector, monkeypatch, old=True)
    seen = passes(monkeypatch)
    got, tr, _ = traker_scores(tmp_path / "new", projector, monkeypatch, old=False)
    assert seen == []
    new, old = kfac_record.load_factors(tr.store, 0), kfac_record.load_factors(ref.store, 0)
    assert new.info["rows"] == N
    assert_same(new, pass_factors(old))
    if not default:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
        return
    other, _, _ = traker_scores(tmp_path / "old5", projector, monkeypatch, old=True, batch=5)
    own = np.abs(other - want).max()  # the pass's own rounding, in other batches
    assert 0 < own < 1e-4 * np.abs(want).max()
    assert np.abs(got - want).max() <= 2 * own


def test_pipeline_shards_fold_without_a_pass(tmp_path):
    """The pipeline's shard step (engine.featurize_shard) sums each shard's factors from its featurizing, no pass of
    their own: finalize records the factors of TRAKer's fit over all rows."""
    from test_kfac_store import _featurize_shards, _planned_store, run

    from trak_core import engine
    from trak_core.solve import kfac_record

    _, fitted, _ = run(tmp_path / "f", "kfac")  # the fit: the pass
    st = _planned_store(tmp_path, "kfac")
    with no_pass():
        _featurize_shards(st, [1, 2, 0], batch=6)
    engine.finalize(st, 0, 0.0, True)
    assert_same(kfac_record.load_factors(st, 0), pass_factors(kfac_record.load_factors(fitted.store, 0)))


def test_a_piece_without_the_fast_path_makes_the_call_run_the_pass(monkeypatch):
    """One piece of a call computed without the fast path (its per-example gradients instead): the sums of the pieces
    taken so far are dropped and the call's rows summed by the pass, once."""
    from trak_core.projection.factored import FactoredProjector

    model = mlp(True)
    x, y = data()
    feat = factored_featurizer(model)
    monkeypatch.setattr(featurizer_module, "fit_memory", lambda run, *a, **k: MemoryFit(base=0, points=((5, 0),)))
    feat.max_memory = 1 << 40
    real, calls = FactoredProjector.featurize_batch, []

    def second_piece_slow(self, *args, **kwargs):
        calls.append(1)
        return None if len(calls) == 2 else real(self, *args, **kwargs)

    monkeypatch.setattr(FactoredProjector, "featurize_batch", second_piece_slow)
    seen = passes(monkeypatch)
    fold = kfac.FactorFold(N)
    for rows in ORDERS:
        fold.featurize(feat, [x[rows], y[rows]], 0, rows)
    assert len(seen) == 1  # the first call only (its second piece); the later calls from the fast path
    assert_same(fold.factors("kfac", warn=False), brute_factors(brute(model, x, y)))
