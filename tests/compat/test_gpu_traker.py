"""TRAKer on a CUDA device against the same run on the CPU (marker ``cuda``; skipped without a GPU).

On the GPU the per-example gradients, the projection and the XᵀX partials (float64) run on the device, the store
stays on the host; the scores must be the CPU's up to float32 round-off of the projected gradients."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

import trak_core

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _projector(kind: str, model: nn.Module, device: str):
    """trak_core's projector on the CPU; on CUDA the GPU plugin's kernels (the same matrix), as installed users get."""
    grad_dim = sum(p.numel() for p in model.parameters())
    kw = {"c": 4} if kind == "sjlt" else {}
    if device == "cuda":
        from cuda_ext.projectors import CudaDenseProjector, CudaSJLTProjector

        return (CudaDenseProjector if kind == "dense" else CudaSJLTProjector)(grad_dim, 64, 0, device=device, **kw)
    return trak_core.projection.projectors.make_projector(kind, grad_dim, 64, 0, device=device, **kw)


def _run(tmp_path, device: str, projector: str, model: nn.Module, data) -> tuple[np.ndarray, dict]:
    x, y, xt, yt = data
    kw = {} if projector == "factored" else {"projector": _projector(projector, model, device)}
    tr = trak_core.TRAKer(
        model=model.to(device),
        task="image_classification",
        train_set_size=len(x),
        save_dir=str(tmp_path / device),
        device=device,
        proj_dim=64,
        logging_level=logging.ERROR,
        **kw,
    )
    tr.load_checkpoint(model.state_dict(), model_id=0)
    for a in range(0, len(x), 50):
        tr.featurize((x[a : a + 50], y[a : a + 50]), num_samples=len(x[a : a + 50]))
    tr.finalize_features()
    tr.start_scoring_checkpoint("exp", model.state_dict(), model_id=0, num_targets=len(xt))
    tr.score((xt, yt), num_samples=len(xt))
    return np.asarray(tr.finalize_scores("exp"), dtype=np.float64), tr.store.finalize_info(0)


@pytest.mark.parametrize("projector", ["factored", "dense", "sjlt"])
def test_traker_on_cuda_gives_the_cpus_scores(tmp_path, projector):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(300, 20, generator=g), torch.randint(0, 4, (300,), generator=g))
    data += (torch.randn(7, 20, generator=g), torch.randint(0, 4, (7,), generator=g))
    cpu, info_cpu = _run(tmp_path, "cpu", projector, model, data)
    gpu, info_gpu = _run(tmp_path, "cuda", projector, model, data)
    assert cpu.shape == gpu.shape == (300, 7)
    assert info_gpu["lambda_reg"] == pytest.approx(info_cpu["lambda_reg"], rel=1e-3)
    assert float(np.abs(gpu - cpu).max() / np.abs(cpu).max()) < 1e-3


def test_rows_come_back_from_the_gpu_in_reused_page_locked_memory():
    """Featurizer hands X and Q to the host in page-locked memory (a full-speed copy) with the device's values; a
    batch's block goes back to torch's cache when its arrays are dropped and the next batch gets it again."""
    from trak_core.featurize.featurizer import host_array

    t = torch.randn(256, 512, device="cuda")
    first = host_array(t)
    assert torch.from_numpy(first).is_pinned()
    assert np.array_equal(first, t.cpu().numpy())
    where = first.__array_interface__["data"][0]
    del first
    again = host_array(t * 2)
    assert again.__array_interface__["data"][0] == where and np.array_equal(again, (t * 2).cpu().numpy())


def test_a_batch_above_the_page_locked_bound_is_copied_pageable(monkeypatch):
    from trak_core.featurize import featurizer as featurize

    monkeypatch.setattr(featurize, "PINNED_BATCH_BYTES", 1024)
    t = torch.randn(16, 16, device="cuda")  # exactly the bound: page-locked; one more row: pageable
    assert torch.from_numpy(featurize.host_array(t)).is_pinned()
    wide = featurize.host_array(torch.randn(17, 16, device="cuda"))
    assert not torch.from_numpy(wide).is_pinned() and wide.shape == (17, 16)


@pytest.mark.parametrize("stored", [torch.float16, torch.float32])
def test_train_rows_are_rounded_on_the_device_as_the_store_rounds_them(stored):
    """A featurizer for a float16 store hands train rows back in float16, rounded on the device: the bits the
    host's conversion gives the float32 rows (a float32 store: the float32 rows); target rows stay float32."""
    from trak_core.featurize.featurizer import Featurizer
    from trak_core.projection.projectors import make_projector

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 4)).cuda().eval()
    grad_dim = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    batch = [torch.randn(64, 20, generator=g) * 30, torch.randint(0, 4, (64,), generator=g)]
    feats = []
    for dtype in (None, stored):
        proj = make_projector("factored", grad_dim, 64, 0, device="cuda", model=model)
        feats.append(Featurizer(model, "image_classification", proj, device="cuda", stored_dtype=dtype))
    plain, rounded = (f.featurize(batch, 0) for f in feats)
    assert plain[0].dtype == np.float32 and rounded[0].dtype == np.dtype(str(stored).split(".")[-1])
    want = torch.from_numpy(plain[0]).to(stored).numpy()  # the host's conversion (the store's to_dtype)
    assert rounded[0].tobytes() == want.tobytes() and np.array_equal(rounded[1], plain[1])
    assert feats[1].target_features(batch, 0).dtype == np.float32
