"""Tests for trak_core.alpha (cockpit's effective relative step size α via torch.func)."""

from __future__ import annotations

import copy
import math
import warnings
import weakref

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trak_core.alpha import (
    Alpha,
    AlphaWarning,
    alpha_from_coefficients,
    fit_alpha,
    fit_quadratic,
)


def per_sample_ce(outputs, targets):
    return nn.functional.cross_entropy(outputs, targets, reduction="none")


def tiny_mlp(seed=0, d_in=4, width=6, d_out=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, width), nn.Tanh(), nn.Linear(width, d_out)).double()


def batches(n, batch_size, seed=1, d_in=4, d_out=3):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch_size, d_in, generator=g, dtype=torch.float64),
            torch.randint(0, d_out, (batch_size,), generator=g),
        )
        for _ in range(n)
    ]


def train(model, opt, data, tracker=None, loss_fn=per_sample_ce):
    """Plain loop; returns the parameters θ_k seen at each step (before opt.step())."""
    thetas = []
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        loss_fn(model(x), y).mean().backward()
        thetas.append({n: p.detach().clone() for n, p in model.named_parameters()})
        if tracker is not None:
            tracker.track(step, model, x, y)
        opt.step()
    return thetas


def assert_no_nan(output):
    for step, value in output.items():
        assert value is None or math.isfinite(value), (step, value)


# ---------------------------------------------------------------------------------------
# 1. Against a brute-force float64 reference (autograd loop + normal-equation fit)
# ---------------------------------------------------------------------------------------


def reference_point(model, theta, x, y, direction):
    """Per-sample losses and gradient projections on direction/||direction||, one at a time."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(theta[n])
    names = [n for n, _ in m.named_parameters()]
    norm = math.sqrt(sum(float((direction[n] ** 2).sum()) for n in names))
    losses, projections = [], []
    for i in range(x.shape[0]):
        loss_i = per_sample_ce(m(x[i : i + 1]), y[i : i + 1])[0]
        grads = torch.autograd.grad(loss_i, list(m.parameters()))
        losses.append(loss_i.item())
        projections.append(sum(float((g * direction[n]).sum()) for g, n in zip(grads, names)) / norm)
    return np.array(losses), np.array(projections), norm


def reference_alpha(t, fs, dfs, var_fs, var_dfs):
    """Independent implementation: maximum-likelihood estimate by the normal equations."""
    phi = np.array([[1.0, 0.0, 0.0], [1.0, t, t**2], [0.0, 1.0, 0.0], [0.0, 1.0, 2 * t]])
    w = np.diag(1.0 / np.array(list(var_fs) + list(var_dfs)))
    obs = np.array(list(fs) + list(dfs))
    c, b, a = np.linalg.inv(phi.T @ w @ phi) @ phi.T @ w @ obs
    if a < 0:
        return -1.0
    return 2 * t / (-b / a) - 1


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("schedule", ["every", "sparse"])
def test_matches_brute_force_reference(optimizer, schedule):
    n_steps, batch_size = 7, 5
    model = tiny_mlp()
    data = batches(n_steps, batch_size)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
    starts = set(range(n_steps - 1)) if schedule == "every" else {0, 2, 3, 5}
    # 'every' as a callable, 'sparse' as an iterable (both forms are accepted)
    tracker = Alpha(per_sample_ce, (lambda s: True) if schedule == "every" else starts)
    reference_model = copy.deepcopy(model)
    thetas = train(model, opt, data, tracker)

    output, details = tracker.get_output(), tracker.get_details()
    assert sorted(output) == sorted(starts)
    assert_no_nan(output)
    for k in sorted(starts):
        d = {n: thetas[k + 1][n] - thetas[k][n] for n in thetas[k]}
        l0, p0, t = reference_point(reference_model, thetas[k], *data[k], d)
        l1, p1, _ = reference_point(reference_model, thetas[k + 1], *data[k + 1], d)
        fs, dfs = [l0.mean(), l1.mean()], [p0.mean(), p1.mean()]
        var_fs = [l0.var(ddof=1), l1.var(ddof=1)]
        var_dfs = [p0.var(ddof=1), p1.var(ddof=1)]
        expected = reference_alpha(t, fs, dfs, var_fs, var_dfs)

        got = details[k]
        assert got["end_step"] == k + 1
        np.testing.assert_allclose(got["t"], t, rtol=1e-10)
        np.testing.assert_allclose([got["loss_start"], got["loss_end"]], fs, rtol=1e-10)
        np.testing.assert_allclose([got["dderiv_start"], got["dderiv_end"]], dfs, rtol=1e-8, atol=1e-12)
        np.testing.assert_allclose([got["var_loss_start"], got["var_loss_end"]], var_fs, rtol=1e-8)
        np.testing.assert_allclose([got["var_dderiv_start"], got["var_dderiv_end"]], var_dfs, rtol=1e-8)
        assert output[k] == got["alpha"]
        assert abs(output[k] - expected) <= 1e-6 * max(1.0, abs(expected)), (k, output[k], expected)


def test_tracking_does_not_change_training():
    """No parameter, buffer or RNG side effects: tracked and untracked runs coincide."""

    def run(track):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Linear(8, 3))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        tracker = Alpha(per_sample_ce, lambda s: True) if track else None
        for step, (x, y) in enumerate(batches(4, 6)):
            x = x.float()
            opt.zero_grad()
            per_sample_ce(model(x), y).mean().backward()
            if tracker is not None:
                tracker.track(step, model, x, y)
            opt.step()
        return model.state_dict(), tracker

    plain, _ = run(False)
    tracked, tracker = run(True)
    for k in plain:
        assert torch.equal(plain[k], tracked[k]), k
    assert len(tracker.get_output()) == 3
    assert_no_nan(tracker.get_output())


def test_schedule_semantics():
    tracker = Alpha(per_sample_ce, [3, 4])
    assert [tracker.is_start(s) for s in range(2, 6)] == [False, True, True, False]
    assert [tracker.is_end(s) for s in range(2, 6)] == [False, False, True, True]
    assert [tracker.should_track(s) for s in range(2, 7)] == [False, True, True, True, False]
    model = tiny_mlp()
    x, y = batches(1, 4)[0]
    tracker.track(2, model, x, y)  # nothing to do: no snapshot taken
    assert tracker.pending_step is None and tracker.get_output() == {}
    tracker.track(3, model, x, y)
    assert tracker.pending_step == 3


def test_finish_completes_last_pair():
    model = tiny_mlp()
    data = batches(3, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    tracker = Alpha(per_sample_ce, [2])
    train(model, opt, data, tracker)
    assert tracker.get_output() == {} and tracker.pending_step == 2
    x, y = batches(1, 6, seed=7)[0]
    alpha = tracker.finish(model, x, y)
    assert tracker.pending_step is None
    assert tracker.get_output() == {2: alpha} and math.isfinite(alpha)
    assert tracker.get_details()[2]["end_step"] == 3
    assert tracker.finish(model) is None  # nothing pending any more


# ---------------------------------------------------------------------------------------
# 2. The fit alone on exact quadratics
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("t, expected", [(0.5, -0.5), (1.0, 0.0), (2.0, 1.0)])
def test_fit_exact_quadratic(t, expected):
    # f(x) = (x - 1)^2 from x = 0: f(0) = 1, f(t) = (t-1)^2, f'(0) = -2, f'(t) = 2(t-1)
    obs = (1.0, (t - 1) ** 2, -2.0, 2 * (t - 1))
    assert fit_alpha(t, *obs, 1e-8, 1e-8, 1e-8, 1e-8) == pytest.approx(expected, abs=1e-10)
    np.testing.assert_allclose(fit_quadratic(t, *obs, 1.0, 1.0, 1.0, 1.0), [1, -2, 1], atol=1e-12)
    # noise-free: zero variances are replaced by eps, with a warning, same answer
    with pytest.warns(AlphaWarning, match="variance"):
        assert fit_alpha(t, *obs, 0.0, 0.0, 0.0, 0.0) == pytest.approx(expected, abs=1e-8)


def test_fit_weights_by_inverse_variance():
    # derivatives from f(x) = (x-1)^2, wildly wrong losses with huge variance: the fit
    # must follow the precise derivative observations (t = 2 -> alpha = 1).
    alpha = fit_alpha(2.0, 50.0, -30.0, -2.0, 2.0, 1e12, 1e12, 1e-6, 1e-6)
    assert alpha == pytest.approx(1.0, abs=1e-6)
    # with equal weights the same bad losses pull the fit far away
    assert abs(fit_alpha(2.0, 50.0, -30.0, -2.0, 2.0, 1.0, 1.0, 1.0, 1.0) - 1.0) > 0.5


# ---------------------------------------------------------------------------------------
# 3. Edge cases
# ---------------------------------------------------------------------------------------


def test_batch_size_one_gives_none_with_warning():
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = Alpha(per_sample_ce, lambda s: True)
    with pytest.warns(AlphaWarning, match="batch size 1"):
        train(model, opt, batches(3, 1), tracker)
    output = tracker.get_output()
    assert output == {0: None, 1: None}
    details = tracker.get_details()[0]
    assert details["reason"] == "batch size 1"
    assert details["var_loss_start"] is None and details["var_dderiv_end"] is None
    assert math.isfinite(details["loss_start"]) and math.isfinite(details["dderiv_start"])


def test_batch_size_one_at_one_end_only():
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = Alpha(per_sample_ce, [0])
    data = [batches(1, 8)[0], batches(1, 1)[0]]
    with pytest.warns(AlphaWarning, match="batch size 1"):
        train(model, opt, data, tracker)
    assert tracker.get_output() == {0: None}


def test_zero_step_gives_none_with_reason():
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    tracker = Alpha(per_sample_ce, lambda s: True)
    with pytest.warns(AlphaWarning, match="zero step"):
        train(model, opt, batches(3, 4), tracker)
    assert tracker.get_output() == {0: None, 1: None}
    assert tracker.get_details()[0]["reason"] == "zero step"
    assert tracker.get_details()[0]["t"] == 0.0
    # the pure functions agree: zero step -> None (warning), singular system -> None
    with pytest.warns(AlphaWarning, match="zero step"):
        assert fit_alpha(0.0, 1.0, 1.0, -1.0, -1.0, 0.1, 0.1, 0.1, 0.1) is None
    assert fit_quadratic(0.0, 1.0, 1.0, -1.0, -1.0, 0.1, 0.1, 0.1, 0.1) is None


def test_concave_fit_gives_minus_one():
    # f(x) = -x^2: concave along the step -> -1 (cockpit's convention), no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fit_alpha(1.0, 0.0, -1.0, 0.0, -2.0, 0.1, 0.1, 0.1, 0.1) == -1.0
        assert alpha_from_coefficients(np.array([0.0, 1.0, 0.0]), 1.0) == -1.0  # linear

    class Scalar(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.tensor([0.3], dtype=torch.float64))

        def forward(self, x):
            return x * self.w

    def concave_loss(out, y):  # per-sample -(x_i w - y_i)^2: concave in w
        return -((out - y) ** 2)

    model = Scalar()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.tensor([1.0, 2.0, -1.0, 0.5], dtype=torch.float64)
    y = torch.tensor([0.0, 1.0, 0.5, -1.0], dtype=torch.float64)
    tracker = Alpha(concave_loss, lambda s: True)
    train(model, opt, [(x, y)] * 3, tracker, loss_fn=concave_loss)
    assert tracker.get_output() == {0: -1.0, 1: -1.0}
    details = tracker.get_details()[0]
    assert details["reason"] == "concave fit" and details["coefficients"][2] < 0


def test_minimum_at_start_and_singular_coefficients_give_none():
    assert alpha_from_coefficients(np.array([1.0, 0.0, 2.0]), 1.0) is None
    assert alpha_from_coefficients(None, 1.0) is None


@pytest.mark.parametrize("bad_step", [0, 1])
def test_non_finite_loss_gives_none_with_warning(bad_step):
    model = nn.Linear(4, 3).double()
    data = batches(2, 5)
    x_bad = data[bad_step][0].clone()
    x_bad[0, 0] = float("nan") if bad_step == 0 else float("inf")
    tracker = Alpha(per_sample_ce, [0])
    with pytest.warns(AlphaWarning, match="non-finite"):
        for step, (x, y) in enumerate(data):
            tracker.track(step, model, x_bad if step == bad_step else x, y)
            with torch.no_grad():  # a finite update of the parameters
                model.weight.add_(0.01)
    assert tracker.get_output() == {0: None}
    assert tracker.get_details()[0]["reason"].startswith("non-finite")
    with pytest.warns(AlphaWarning, match="non-finite"):
        assert fit_alpha(1.0, float("nan"), 1.0, -1.0, 1.0, 0.1, 0.1, 0.1, 0.1) is None


def test_zero_variance_uses_eps_with_warning():
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    x, y = batches(1, 1)[0]
    same = (x.repeat(6, 1), y.repeat(6))  # identical samples: all variances are 0
    tracker = Alpha(per_sample_ce, [0])
    with pytest.warns(AlphaWarning, match="variance"):
        train(model, opt, [same, same], tracker)
    alpha = tracker.get_output()[0]
    assert alpha is not None and math.isfinite(alpha)
    assert tracker.get_details()[0]["var_loss_start"] == 0.0


def test_skipped_end_step_is_recorded_as_none():
    model = tiny_mlp()
    x, y = batches(1, 4)[0]
    tracker = Alpha(per_sample_ce, [0])
    tracker.track(0, model, x, y)
    with pytest.warns(AlphaWarning, match="not called at step 1"):
        tracker.track(5, model, x, y)
    assert tracker.get_output() == {0: None}
    assert tracker.get_details()[0]["reason"] == "end point not tracked"


def test_invalid_usage_raises():
    model = tiny_mlp()
    x, y = batches(1, 4)[0]
    tracker = Alpha(per_sample_ce, lambda s: True)
    tracker.track(3, model, x, y)
    with pytest.raises(ValueError, match="increase"):
        tracker.track(3, model, x, y)
    scalar_loss = Alpha(lambda o, t: per_sample_ce(o, t).mean(), lambda s: True)
    scalar_loss.track(0, model, x, y)
    with torch.no_grad():
        model[0].weight.add_(0.1)
    with pytest.raises(ValueError, match=r"leading dimension is the batch"):
        scalar_loss.track(1, model, x, y)
    with pytest.raises(TypeError):
        Alpha(per_sample_ce, 5)


# ---------------------------------------------------------------------------------------
# 4. Memory: nothing of size batch x parameters, neither kept nor transient
# ---------------------------------------------------------------------------------------


def held_tensors(obj, seen=None):
    """All tensors reachable from obj's attributes / containers (deduplicated)."""
    seen = {} if seen is None else seen
    if isinstance(obj, torch.Tensor):
        seen[id(obj)] = obj
    elif isinstance(obj, dict):
        for v in obj.values():
            held_tensors(v, seen)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            held_tensors(v, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, nn.Module)) and not callable(obj):
        for v in vars(obj).values():
            held_tensors(v, seen)
    return list(seen.values())


def test_state_between_steps_is_params_plus_batch():
    held = {}
    for batch_size in (4, 64):
        model = tiny_mlp(d_in=20, width=64)
        num_params = sum(p.numel() for p in model.parameters())
        tracker = Alpha(per_sample_ce, lambda s: True)
        data = batches(3, batch_size, d_in=20)
        train(model, torch.optim.Adam(model.parameters(), lr=0.01), data, tracker)
        tensors = held_tensors(vars(tracker))
        held[batch_size] = sum(t.numel() for t in tensors)
        batch_numel = batch_size * 20 + batch_size  # inputs + targets
        assert held[batch_size] == num_params + batch_numel
        assert max(t.numel() for t in tensors) < batch_size * 64 + num_params
    assert held[64] - held[4] == 60 * 21  # grows with the batch only, not batch x params


class AllocationProbe(TorchDispatchMode):
    """Peak bytes of live tensor storages allocated under the mode, and the largest tensor."""

    def __init__(self):
        super().__init__()
        self.live, self.current, self.peak, self.max_numel = {}, 0, 0, 0

    @staticmethod
    def _ptr(t):
        try:
            return t.untyped_storage().data_ptr()
        except RuntimeError:  # e.g. wrapper tensors without storage
            return None

    def _release(self, ptr):
        entry = self.live.get(ptr)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.current -= entry[0]
                del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        existing = {self._ptr(a) for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            self.max_numel = max(self.max_numel, t.numel())
            ptr = self._ptr(t)
            if ptr is None or ptr == 0:
                continue
            if ptr in self.live:
                self.live[ptr][1] += 1
            elif ptr in existing:  # a view of / in-place op on memory from outside
                continue
            else:
                nbytes = t.untyped_storage().nbytes()
                self.live[ptr] = [nbytes, 1]
                self.current += nbytes
                self.peak = max(self.peak, self.current)
            weakref.finalize(t, self._release, ptr)
        return out


def test_transient_memory_does_not_scale_with_batch_times_params():
    width, d_in = 64, 20
    peaks = {}
    for batch_size in (16, 256):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(d_in, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 3)
        ).double()
        num_params = sum(p.numel() for p in model.parameters())
        per_sample_grad_bytes = batch_size * num_params * 8  # one point's worth
        (x0, y0), (x1, y1) = batches(2, batch_size, d_in=d_in)
        tracker = Alpha(per_sample_ce, lambda s: True)
        tracker.track(0, model, x0, y0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        with AllocationProbe() as ours:
            tracker.track(1, model, x1, y1)  # both JVPs + the next snapshot
        assert tracker.get_output()[0] is not None
        peaks[batch_size] = ours.peak
        assert ours.max_numel < batch_size * width * width / 4
        assert ours.peak < 0.2 * per_sample_grad_bytes

        # Negative control: the probe does see per-sample gradients when they exist.
        params = {n: p.detach() for n, p in model.named_parameters()}

        def one(p, xi, yi):
            return per_sample_ce(functional_call(model, p, (xi[None],)), yi[None])[0]

        with AllocationProbe() as cockpit_like:
            per_sample_grads = vmap(grad(one), in_dims=(None, 0, 0))(params, x1, y1)
        assert cockpit_like.max_numel >= batch_size * width * width
        assert cockpit_like.peak >= per_sample_grad_bytes
        del per_sample_grads
    # growth per extra sample ~ a few activations, far below one per-sample gradient
    growth_per_sample = (peaks[256] - peaks[16]) / 240
    assert growth_per_sample < num_params * 8 / 4


# ---------------------------------------------------------------------------------------
# 5. Plots
# ---------------------------------------------------------------------------------------

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plots_write_png(tmp_path):
    from trak_core.alpha_plots import plot_alpha_gauge, plot_alpha_trace

    rng = np.random.default_rng(0)
    output = {k: float(v) for k, v in enumerate(rng.normal(0.2, 0.6, size=40))}
    output[7] = None  # undefined steps are skipped / marked
    output[8] = 5.0  # outside the gauge range: clipped into the edge bin
    paths = [
        plot_alpha_trace(output, tmp_path / "trace.png"),
        plot_alpha_gauge(output, tmp_path / "sub" / "gauge.png"),
        plot_alpha_gauge([v for v in output.values()], tmp_path / "gauge_list.png"),
        plot_alpha_trace({}, tmp_path / "empty_trace.png"),
        plot_alpha_gauge([None], tmp_path / "empty_gauge.png"),
    ]
    for path in paths:
        data = path.read_bytes()
        assert len(data) > 1000 and data[:8] == PNG_MAGIC, path


# ------------------------------------------------------------------ cockpit's types and loss shapes
def test_concave_fit_is_the_int_minus_one_and_linear_the_float():
    # cockpit returns the int -1 for a < 0 and compares outputs type-strictly (int vs float fails)
    concave = fit_alpha(1.0, 0.0, -1.0, 0.0, -2.0, 0.1, 0.1, 0.1, 0.1)
    assert concave == -1 and type(concave) is int
    linear = alpha_from_coefficients(np.array([0.0, 1.0, 0.0]), 1.0)  # a == 0: cockpit's 2t/inf - 1
    assert linear == -1.0 and type(linear) is float
    regular = alpha_from_coefficients(np.array([1.0, -2.0, 1.0]), 0.5)  # (x-1)^2, half-way: -0.5
    assert regular == pytest.approx(-0.5) and isinstance(regular, float)


def test_tracked_concave_step_stores_the_int():
    model = nn.Linear(1, 1, bias=False).double()
    with torch.no_grad():
        model.weight.fill_(0.3)

    def concave_loss(out, y):
        return -((out.squeeze(1) - y) ** 2)

    x = torch.tensor([[1.0], [2.0], [-1.0], [0.5]], dtype=torch.float64)
    y = torch.tensor([0.0, 1.0, 0.5, -1.0], dtype=torch.float64)
    tracker = Alpha(concave_loss, [0])
    train(model, torch.optim.SGD(model.parameters(), lr=0.05), [(x, y)] * 2, tracker, loss_fn=concave_loss)
    assert tracker.get_output() == {0: -1} and type(tracker.get_output()[0]) is int


def _mse_run(loss_fn, targets_shape, seed=0):
    torch.manual_seed(seed)
    model = nn.Linear(3, targets_shape[1] if len(targets_shape) > 1 else 1).double()
    g = torch.Generator().manual_seed(seed + 1)
    data = [
        (
            torch.rand(4, 3, generator=g, dtype=torch.float64),
            torch.rand(*targets_shape, generator=g, dtype=torch.float64),
        )
        for _ in range(3)
    ]
    tracker = Alpha(loss_fn, lambda s: True)
    train(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        data,
        tracker,
        loss_fn=lambda o, t: loss_fn(o, t).reshape(-1),
    )
    return tracker


def test_loss_of_shape_b_by_1_equals_the_squeezed_loss():
    # cockpit's issue-5 problem: MSELoss(reduction="none") on [B, 1] targets gives [B, 1] losses
    with_col = _mse_run(lambda o, t: nn.functional.mse_loss(o, t, reduction="none"), (4, 1))
    squeezed = _mse_run(lambda o, t: nn.functional.mse_loss(o.squeeze(1), t.squeeze(1), reduction="none"), (4, 1))
    out = with_col.get_output()
    assert set(out) == {0, 1} and all(v is not None for v in out.values())
    for k in out:
        assert type(out[k]) is type(squeezed.get_output()[k])
        assert out[k] == pytest.approx(squeezed.get_output()[k], rel=1e-12, abs=1e-12)
    assert with_col.get_details()[0]["batch_size_start"] == 4


def test_loss_of_shape_b_by_k_reduced_as_cockpit():
    # cockpit: f and var(f) over all B*k entries; per-sample gradients of each sample's mean entry
    tracker = _mse_run(lambda o, t: nn.functional.mse_loss(o, t, reduction="none"), (4, 3))
    d = tracker.get_details()[0]
    assert d["batch_size_start"] == 4
    torch.manual_seed(0)
    model = nn.Linear(3, 3).double()
    g = torch.Generator().manual_seed(1)
    x, t = torch.rand(4, 3, generator=g, dtype=torch.float64), torch.rand(4, 3, generator=g, dtype=torch.float64)
    entries = nn.functional.mse_loss(model(x), t, reduction="none")
    assert d["loss_start"] == pytest.approx(float(entries.mean()), rel=1e-12)
    assert d["var_loss_start"] == pytest.approx(float(entries.reshape(-1).var()), rel=1e-12)
    assert d["var_loss_start"] != pytest.approx(float(entries.mean(1).var()), rel=1e-3)


def test_scalar_loss_is_refused():
    tracker = Alpha(lambda o, t: per_sample_ce(o, t).mean(), lambda s: True)
    model = nn.Linear(4, 3).double()
    x, y = batches(1, 5)[0]
    tracker.track(0, model, x, y)
    with torch.no_grad():
        model.weight.add_(0.1)
    with pytest.raises(ValueError, match="leading dimension is the batch"):
        tracker.track(1, model, x, y)
