"""``curvature="kfac"`` / ``"ekfac"`` through TRAKer, the engine and TrakIndex: the stored rows are the plain
projection's, the finalized inverse is the block inverse of the recorded factors (tests/trak_core/solve/test_kfac.py
checks both against a float64 brute force); the factors recorded in the store and reused by the index and by a grown
store; bad settings refused before anything is created."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from test_kfac import D_IN, C, N, mlp

from trak_core import TRAKer, TrakIndex
from trak_core.errors import BadInputError, StateError
from trak_core.projection.projectors import make_projector
from trak_core.solve import kfac, kfac_record

M = 5
DEFAULT = object()  # run(projector=DEFAULT): TRAKer's default projector


def make_data():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N + M, D_IN, generator=g, dtype=torch.float64)
    y = torch.randint(0, C, (N + M,), generator=g)
    return x[:N], y[:N], x[N:], y[N:]


def factored(model):
    return make_projector("factored", sum(p.numel() for p in model.parameters()), 16, 0, "rademacher", model=model)


def run(path, curvature="kfac", projector=None, n=N, fit=True, device="cpu", batch=10, **kw):
    model = mlp().to(device)
    x, y, xt, yt = (t.to(device) for t in make_data())
    tr = TRAKer(
        model=model,
        task="image_classification",
        train_set_size=n,
        save_dir=str(path),
        device=device,
        projector=None if projector is DEFAULT else projector if projector is not None else factored(model),
        use_half_precision=False,
        lambda_reg=0.0,
        logging_level=logging.ERROR,
        curvature=curvature,
        **kw,
    )
    ck = model.state_dict()
    tr.load_checkpoint(ck, model_id=0)
    if fit:
        tr.fit_curvature([(x[a : a + 10], y[a : a + 10]) for a in range(0, N, 10)])
    for a in range(0, n, batch):
        tr.featurize((x[a : min(a + batch, n)], y[a : min(a + batch, n)]), num_samples=min(a + batch, n) - a)
    tr.finalize_features()
    tr.start_scoring_checkpoint("e", ck, 0, M)
    tr.score((xt, yt), num_samples=M)
    return np.asarray(tr.finalize_scores("e"), dtype=np.float64), tr, model


@pytest.mark.parametrize("curvature", ["kfac", "ekfac"])
def test_rows_are_the_plain_projection_and_the_inverse_is_the_block_inverse(tmp_path, curvature):
    from trak_core.solve.reduce import total_xtx

    got, tr, _ = run(tmp_path / "s", curvature)
    plain, ref, _ = run(tmp_path / "p", "xtx", fit=False)
    np.testing.assert_array_equal(tr.store.model(0).grads[:], ref.store.model(0).grads[:])
    want, _ = kfac.block_inverse(tr.store.meta, 0, kfac_record.load_factors(tr.store, 0), total_xtx(tr.store, 0))
    np.testing.assert_array_equal(tr.store.inverse(0), want.astype(np.float32))
    info = tr.store.finalize_info(0)
    assert info["curvature"] == curvature and set(info["blocks"]) == {"0", "2"}
    rec = kfac_record.factor_record(tr.store, 0)
    assert rec["kind"] == curvature and rec["form"] == kfac_record.RECORD_FORM
    assert all(set(b) <= {"weight", "bias", "d_out", "d_in", "transposed"} for b in rec["blocks"].values())
    assert sorted(tr.store.read_factor_arrays(0)) == ["a0", "a1", "s0", "s1"]  # the matrices: arrays, not the record
    assert not np.allclose(got, plain, rtol=1e-2)  # the curvature changes the scores


@pytest.mark.parametrize(("curvature", "projector"), [("kfac", "factored"), ("ekfac", "factored"), ("kfac", None)])
def test_index_queries_with_the_recorded_factors(tmp_path, curvature, projector):
    """TrakIndex rebuilds the store's projection and reads its factors: its scores are finalize_scores'. ``None``:
    TRAKer's default projector, whose store is created once rows are featurized (the factors fitted before are
    recorded then)."""

    model = mlp()
    if projector is None:
        got, tr, model = run(tmp_path / "s", curvature, projector=DEFAULT, proj_dim=16)
    else:
        got, tr, model = run(tmp_path / "s", curvature, projector=factored(model))
    assert kfac_record.has_factors(tr.store, 0)
    tr._close()
    del tr
    index = TrakIndex(
        tmp_path / "s", model=mlp(), checkpoints=[model.state_dict()], task="image_classification", device="cpu"
    )
    _, _, xt, yt = make_data()
    res = index.query((xt, yt), k=N)
    np.testing.assert_allclose(np.take_along_axis(got.T, res.indices, 1), res.scores, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("curvature", ["kfac", "ekfac"])
def test_without_a_fit_the_featurized_rows_give_the_factors(tmp_path, curvature):
    """No fit_curvature: the factors are summed over the rows featurize is given (in batches of 7 here, the fit's of
    10), recorded at finalize, and equal the fit's over the same rows; so are the inverse and the scores."""
    fitted, a, _ = run(tmp_path / "f", curvature)
    folded, b, _ = run(tmp_path / "n", curvature, fit=False, batch=7)
    got, want = kfac_record.load_factors(b.store, 0), kfac_record.load_factors(a.store, 0)
    assert got.info["rows"] == want.info["rows"] == N and got.info["kind"] == curvature
    for name, (_, fa, fs) in want.blocks.items():
        np.testing.assert_allclose(got.blocks[name][1], fa, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(got.blocks[name][2], fs, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(b.store.inverse(0), a.store.inverse(0), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(folded, fitted, rtol=1e-5, atol=1e-6 * np.abs(fitted).max())


def test_rows_featurized_elsewhere_are_refused_and_a_fit_serves(tmp_path):
    """Factors summed while featurizing cover one TRAKer's rows: a model whose rows were featurized partly by another
    TRAKer is refused at finalize, naming the fit and leaving the model unfinalized without factors; fitting then
    (after the rows) gives the scores of fitting first."""
    first, _, _ = run(tmp_path / "f")
    x, y, xt, yt = make_data()

    def traker(model):
        return TRAKer(model=model, task="image_classification", train_set_size=N, save_dir=str(tmp_path / "l"),
                      device="cpu", projector=factored(model), use_half_precision=False, lambda_reg=0.0,
                      logging_level=logging.ERROR, curvature="kfac")  # fmt: skip

    model = mlp()
    tr = traker(model)
    tr.load_checkpoint(model.state_dict(), model_id=0)
    tr.featurize((x[:20], y[:20]), num_samples=20)
    tr._close()
    del tr
    tr = traker(model)
    tr.load_checkpoint(model.state_dict(), model_id=0)
    tr.featurize((x[20:], y[20:]), inds=np.arange(20, N))
    with pytest.raises(StateError, match=f"20 of its {N} rows were featurized by another TRAKer.*fit_curvature"):
        tr.finalize_features()
    assert not tr.store.is_finalized(0) and not kfac_record.has_factors(tr.store, 0)
    tr.fit_curvature([(x[a : a + 10], y[a : a + 10]) for a in range(0, N, 10)])
    tr.finalize_features()
    tr.start_scoring_checkpoint("e", model.state_dict(), 0, M)
    tr.score((xt, yt), num_samples=M)
    np.testing.assert_array_equal(np.asarray(tr.finalize_scores("e")), first)


def test_grown_store_keeps_its_factors(tmp_path):
    """A grown store keeps the factors it recorded: its rows and its inverse are those of a store built at once with
    the same fit."""
    from trak_core import engine
    from trak_core.featurize.featurizer import Featurizer
    from trak_core.store import open_store

    _, tr, _ = run(tmp_path / "s", n=N - 4)
    rec = kfac_record.factor_record(tr.store, 0)["sha256"]
    tr._close()
    del tr
    st = open_store(str(tmp_path / "s"))
    engine.grow_run(st, N)
    assert kfac_record.factor_record(st, 0)["sha256"] == rec
    model = mlp()
    feat = Featurizer(model, "image_classification", factored(model), device="cpu")
    feat.load_state(model.state_dict())
    x, y, _, _ = make_data()
    for shard in range(st.meta.num_shards):
        engine.featurize_shard(st, 0, shard, lambda: feat, lambda a, b: [x[a:b], y[a:b]], 10)
    engine.finalize(st, 0, 0.0, True)
    _, whole, _ = run(tmp_path / "t", n=N)
    np.testing.assert_array_equal(st.model(0).grads[:], whole.store.model(0).grads[:])
    np.testing.assert_array_equal(st.inverse(0), whole.store.inverse(0))


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"curvature": "kfacc"}, "curvature"),
        ({"curvature_damping": -1.0}, "curvature_damping"),
        ({"curvature_damping": float("nan")}, "curvature_damping"),
    ],
)
def test_bad_settings_named_before_anything_is_created(tmp_path, kw, field):
    kw = {"curvature": "kfac", **kw}
    with pytest.raises(BadInputError, match=field):
        TRAKer(
            model=mlp(), task="image_classification", train_set_size=N, save_dir=str(tmp_path / "s"), device="cpu", **kw
        )
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())


def test_started_over_model_refits_its_factors(tmp_path):
    """A model started over at another checkpoint (load_from_save_dir=False) gets factors fitted at that checkpoint;
    the record names the checkpoint's digest. Refitting where rows are featurized with factors of another checkpoint
    is refused."""
    from trak_core import engine
    from trak_core.featurize.featurizer import Featurizer
    from trak_core.store import open_store

    _, tr, model = run(tmp_path / "s")
    first = kfac_record.factor_record(tr.store, 0)
    assert first["checkpoint"] == tr.store.checkpoint_record(0)["state_sha256"]
    tr._close()
    del tr
    other = mlp()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
    x, y, _, _ = make_data()
    tr = TRAKer(
        model=other,
        task="image_classification",
        train_set_size=N,
        save_dir=str(tmp_path / "s"),
        device="cpu",
        projector=factored(other),
        use_half_precision=False,
        lambda_reg=0.0,
        logging_level=logging.ERROR,
        curvature="kfac",
        load_from_save_dir=False,
    )
    tr.load_checkpoint(other.state_dict(), model_id=0)
    tr.fit_curvature([(x, y)])
    again = kfac_record.factor_record(tr.store, 0)
    assert again["checkpoint"] == engine.state_fingerprint(other.state_dict()) != first["checkpoint"]
    assert again["sha256"] != first["sha256"]
    tr._close()
    del tr
    # a store whose rows were featurized at the first checkpoint: fitting at another is refused
    run(tmp_path / "t")
    st = open_store(str(tmp_path / "t"))
    st.set_checkpoint_record(0, {"path": "x", "state_sha256": "0" * 64})
    feat = Featurizer(other, "image_classification", factored(other), device="cpu")
    with pytest.raises(StateError, match="another checkpoint"):
        engine.fit_curvature(st, 0, feat, lambda: [(x, y)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("curvature", ["kfac", "ekfac"])
def test_cuda_gives_the_cpu_scores(tmp_path, curvature):
    """The factors fitted on the GPU and the GPU's projection give the CPU run's scores (the default projector)."""
    cpu, _, _ = run(tmp_path / "c", curvature, projector=DEFAULT)
    gpu, _, _ = run(tmp_path / "g", curvature, projector=DEFAULT, device="cuda")
    np.testing.assert_allclose(gpu, cpu, rtol=1e-4, atol=1e-6 * float(np.abs(cpu).max()))


def _planned_store(tmp_path, curvature):
    """A store of ``curvature`` with model 0 planned at the test model's checkpoint and nothing featurized."""
    from trak_core.store import open_store

    model = mlp()
    tr = TRAKer(model=model, task="image_classification", train_set_size=N, save_dir=str(tmp_path / "s"),
                device="cpu", projector=factored(model), use_half_precision=False, lambda_reg=0.0,
                logging_level=logging.ERROR, curvature=curvature, chunk_rows=4, shard_rows=8)  # fmt: skip
    tr.load_checkpoint(model.state_dict(), model_id=0)
    tr._close()
    del tr
    return open_store(str(tmp_path / "s"))


def _featurize_shards(st, order, batch=5):
    from trak_core import engine
    from trak_core.featurize.featurizer import Featurizer

    x, y, _, _ = make_data()

    def feat():  # a featurizer of its own per shard, as each shard task builds
        model = mlp()
        f = Featurizer(model, "image_classification", factored(model), device="cpu")
        f.load_state(model.state_dict())
        return f

    for shard in order:
        engine.featurize_shard(st, 0, shard, feat, lambda a, b: [x[a:b], y[a:b]], batch)


@pytest.mark.parametrize("curvature", ["kfac", "ekfac"])
def test_shards_sum_their_factors_and_finalize_records_them(tmp_path, curvature):
    """The pipeline's shard step sums each shard's factors beside its rows; finalize adds them in shard order and
    records the factors of every row: the fit's (TRAKer, fit_curvature over all rows), whatever the order the shards
    ran in and their batches; so are the inverse and the scores."""
    from trak_core import engine

    _, fitted, _ = run(tmp_path / "f", curvature)
    st = _planned_store(tmp_path, curvature)
    assert st.meta.num_shards == 3
    _featurize_shards(st, [2, 0, 1])
    assert all(st.read_factor_partial(0, s) is not None for s in range(3))
    assert not kfac_record.has_factors(st, 0)  # recorded once every shard is in
    engine.finalize(st, 0, 0.0, True)
    got, want = kfac_record.load_factors(st, 0), kfac_record.load_factors(fitted.store, 0)
    assert got.info["rows"] == N and got.info["checkpoint"] == want.info["checkpoint"]
    for name, (_, a, s) in want.blocks.items():
        np.testing.assert_allclose(got.blocks[name][1], a, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(got.blocks[name][2], s, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(st.inverse(0), fitted.store.inverse(0), rtol=1e-5, atol=1e-7)


def test_a_shard_without_its_factor_sums_is_named_before_anything_is_written(tmp_path):
    """Finalize refuses a model one of whose shards has no factor sums (here deleted; or featurized at another
    checkpoint), naming the shard and the way out, and writes nothing: no factors, no inverse."""
    from trak_core import engine
    from trak_core.store.factor_arrays import GROUP

    st = _planned_store(tmp_path, "kfac")
    _featurize_shards(st, [0, 1, 2])
    del st.root[f"{GROUP}/partials/0/1"]
    with pytest.raises(StateError, match=r"shards \[1\] .*without their sums.*curvature_rows"):
        engine.finalize(st, 0, 0.0, True)
    assert not kfac_record.has_factors(st, 0) and not st.is_finalized(0)


def test_damaged_shard_sums_are_named_before_anything_is_written(tmp_path):
    """A shard's factor sums changed or lost after they were written fail their sha256 at finalize: StoreDamageError
    naming the shard, and no factors, no inverse."""
    from trak_core import engine
    from trak_core.errors import StoreDamageError
    from trak_core.store.factor_arrays import GROUP

    st = _planned_store(tmp_path, "kfac")
    _featurize_shards(st, [0, 1, 2])
    arr = st.root[f"{GROUP}/partials/0/2/a0"]
    arr[0, 0] = arr[0, 0] + 1.0
    with pytest.raises(StoreDamageError, match="shard 2 .*sha256"):
        engine.finalize(st, 0, 0.0, True)
    del st.root[f"{GROUP}/partials/0/2/s1"]
    with pytest.raises(StoreDamageError, match="shard 2 .*sha256"):
        engine.finalize(st, 0, 0.0, True)
    assert not kfac_record.has_factors(st, 0) and not st.is_finalized(0)


def test_finalize_of_a_model_missing_rows_names_the_rows_not_the_sums(tmp_path):
    from trak_core import engine

    st = _planned_store(tmp_path, "kfac")
    _featurize_shards(st, [0, 2])
    with pytest.raises(StateError, match=r"not fully featurized: 8 of 24 rows missing"):
        engine.finalize(st, 0, 0.0, True)
    assert not kfac_record.has_factors(st, 0) and not st.is_finalized(0)


def test_a_models_factors_are_written_to_its_own_group_only(tmp_path):
    """Recording one checkpoint's factors writes its ``curvature/<id>`` group and nothing another checkpoint's task
    writes (the root's attributes, where a shared record would be read, changed and written back by each): the
    pipeline's reduce and fit tasks of two checkpoints run at once."""
    from pathlib import Path

    from trak_core.store import open_store

    _, tr, _ = run(tmp_path / "s")
    pre = kfac_record.load_factors(tr.store, 0)
    tr._close()
    del tr
    root = Path(tmp_path / "s" / "zarr.json")
    before = root.read_bytes()
    st = open_store(str(tmp_path / "s"))
    kfac_record.record_factors(st, 1, kfac.KroneckerFactors(dict(pre.blocks), dict(pre.info)))
    assert root.read_bytes() == before
    assert kfac_record.factor_record(st, 1)["sha256"] == kfac_record.factor_record(st, 0)["sha256"]
    assert kfac_record.RECORD_KEY not in st.pipeline_info()


def test_a_store_of_the_previous_version_is_read_and_a_refit_moves_its_record(tmp_path):
    """A store written before each model's record moved beside its arrays (the record in the pipeline record) is
    read as it was: the same factors, the same inverse; a model started over records in its own group and drops
    the old record."""
    from trak_core.store import open_store

    _, tr, _ = run(tmp_path / "s")
    want = kfac_record.load_factors(tr.store, 0)
    tr._close()
    del tr
    st = open_store(str(tmp_path / "s"))
    rec = kfac_record.factor_record(st, 0)
    del st.root["curvature/0"].attrs["factor_record"]  # the previous layout: arrays here, the record at the root
    st.set_pipeline_info({**st.pipeline_info(), kfac_record.RECORD_KEY: {"0": rec}})
    st = open_store(str(tmp_path / "s"))
    assert st.read_factor_record(0) is None and kfac_record.has_factors(st, 0)
    got = kfac_record.load_factors(st, 0)
    for name, (_, a, s) in want.blocks.items():
        np.testing.assert_array_equal(got.blocks[name][1], a)
        np.testing.assert_array_equal(got.blocks[name][2], s)
    changed = {n: (site, a * 2, s) for n, (site, a, s) in want.blocks.items()}
    kfac_record.record_factors(st, 0, kfac.KroneckerFactors(changed, dict(want.info)), replace=True)
    assert kfac_record.RECORD_KEY not in st.pipeline_info() or "0" not in st.pipeline_info()[kfac_record.RECORD_KEY]
    assert st.read_factor_record(0)["sha256"] != rec["sha256"]
    name = next(iter(changed))
    np.testing.assert_array_equal(kfac_record.load_factors(st, 0).blocks[name][1], changed[name][1])
