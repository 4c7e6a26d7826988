"""The factored projector's energy split (layout version 5): proj_dim ∝ each block's gradient energy, water-filled at
the block sizes with floors; the energy probe against a float64 per-example autograd loop; the spec's record rebuilds
the same projector (and a version-4 record the equal split)."""

import copy
import json
import math

import pytest
import torch
from torch import nn

from trak_core.errors import BadInputError
from trak_core.projection.energy import gradient_energies, probe_chunk, sketched_energies
from trak_core.projection.factored import LAYOUT_VERSION, FactoredProjector, record_kwargs
from trak_core.projection.layout import MIN_SHARE, _split_energy, model_layout
from trak_core.projection.projectors import make_projector, rebuild_kwargs


def mlp() -> nn.Module:
    torch.manual_seed(0)
    # blocks of 21·40 = 840, 41·40 = 1,640 and 41·3 = 123 coordinates
    return nn.Sequential(nn.Linear(20, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 3))


def energies_of(model, per_block):
    """{parameter name: energy} putting each block's energy on its weight (biases 0)."""
    names = [n for n, _ in model.named_parameters() if n.endswith("weight")]
    return dict(zip(names, per_block, strict=True))


# ---------------------------------------------------------------------------- the split
def test_split_follows_energy_with_exact_totals_and_floors():
    model = mlp()
    sizes = [840, 1640, 123]
    for p in (3, 12, 50, 200, 700, 2603, 3000):
        for e in ([1.0, 1.0, 1.0], [10.0, 1.0, 1.0], [0.0, 5.0, 0.0], [0.0, 0.0, 0.0], [1e-9, 1.0, 1e3]):
            ks = [b.k for b in model_layout(model, p, split="energy", energies=energies_of(model, e)).blocks]
            assert sum(ks) == p, (p, e, ks)
            floor = [min(MIN_SHARE, s, p // 3) for s in sizes]
            if p <= sum(sizes):
                assert all(f <= k <= s for f, k, s in zip(floor, ks, sizes, strict=True)), (p, e, ks)
    # a block with 10× the energy of the others gets 10× their share (±1 for rounding)
    ks = [b.k for b in model_layout(model, 240, split="energy", energies=energies_of(model, [10.0, 1.0, 1.0])).blocks]
    assert ks[0] == 200 and abs(ks[1] - 20) <= 1 and abs(ks[2] - 20) <= 1
    # zero (or absent) energy: the floor; the rest ∝ energy
    ks = [b.k for b in model_layout(model, 100, split="energy", energies={"2.weight": 3.0}).blocks]
    assert ks == [MIN_SHARE, 100 - 2 * MIN_SHARE, MIN_SHARE]
    # water-filling: the small last block with most of the energy is kept whole (123), the rest ∝ energy
    ks = [b.k for b in model_layout(model, 1000, split="energy", energies=energies_of(model, [1.0, 3.0, 1e6])).blocks]
    assert ks[2] == 123 and abs(ks[1] - 3 * ks[0]) <= 3 and sum(ks) == 1000
    whole = model_layout(model, 1000, split="energy", energies=energies_of(model, [1.0, 3.0, 1e6])).blocks[2]
    assert (whole.id_out, whole.id_in) == (True, True)  # the whole block, exactly, as for the equal split
    # no energy anywhere: equal shares; above grad_dim: ∝ size, as the equal split
    assert _split_energy([0.0, 0.0, 0.0], sizes, 99) == [33, 33, 33]
    assert _split_energy([1.0, 2.0, 3.0], sizes, 2603 + 10) == [
        b.k for b in model_layout(model, 2613, split="layer").blocks
    ]


def test_split_is_proportional_against_a_float_reference():
    """Unsaturated blocks: k_b within 1 of c · e_b for the c that makes the shares add up (the continuous split)."""
    e = [0.3, 2.0, 0.05, 7.0, 1.1]
    sizes = [5000] * 5
    total = 1000
    ks = _split_energy(e, sizes, total)
    c = total / sum(e)
    assert sum(ks) == total
    assert all(abs(k - c * x) <= 1 for k, x in zip(ks, e, strict=True)), ks


def test_bad_split_and_energies_fail_before_compute():
    model = mlp()
    with pytest.raises(BadInputError, match="split must be one of"):
        model_layout(model, 64, split="energies")
    with pytest.raises(BadInputError, match="split='energy' needs energies"):
        FactoredProjector.from_model(model, 64, split="energy")
    with pytest.raises(BadInputError, match="used by split='energy' only"):
        FactoredProjector.from_model(model, 64, split="layer", energies={"0.weight": 1.0})
    with pytest.raises(BadInputError, match=r"not in the gradient.*'9\.weight'"):
        FactoredProjector.from_model(model, 64, energies={"9.weight": 1.0})
    with pytest.raises(BadInputError, match=r"not in the gradient.*'0\.bias'"):  # outside grad_wrt
        FactoredProjector.from_model(model, 64, grad_wrt=["0.weight", "2.weight"], energies={"0.bias": 1.0})
    for bad in (-1.0, float("nan"), float("inf"), "1"):
        with pytest.raises(BadInputError, match="finite numbers ≥ 0"):
            FactoredProjector.from_model(model, 64, energies={"0.weight": bad})
    with pytest.raises(BadInputError, match="layout_version=4"):
        FactoredProjector.from_model(model, 64, energies={"0.weight": 1.0}, layout_version=4)


# ---------------------------------------------------------------------------- the record
def test_spec_rebuilds_the_same_projector_from_metadata_alone():
    model = mlp()
    x, y = torch.randn(8, 20), torch.randint(0, 3, (8,))
    e = gradient_energies(model, "image_classification", (x, y))
    a = FactoredProjector.from_model(model, 96, seed=3, energies=e)
    spec = json.loads(json.dumps(a.spec()))  # as a store keeps it
    assert spec["layout_version"] == LAYOUT_VERSION == 5 and spec["split"] == "energy" and spec["energies"] == e
    params = {k: v for k, v in spec.items() if k not in ("kind", "proj_type", "seed", "grad_dim", "proj_dim")}
    b = make_projector("factored", a.grad_dim, 96, 3, model=mlp(), **rebuild_kwargs("factored", params))
    assert b.spec() == a.spec()
    g = {n: torch.randn(4, *p.shape) for n, p in model.named_parameters()}
    assert torch.equal(a.project(g, 0), b.project(g, 0))
    # the equal split differs: the record matters
    assert FactoredProjector.from_model(model, 96, seed=3).spec()["layout"] != spec["layout"]


def test_a_version_4_record_rebuilds_the_equal_split_exactly_as_version_4_recorded():
    model = mlp()
    v4 = FactoredProjector.from_model(model, 64, layout_version=4).spec()
    assert v4["layout_version"] == 4 and "split" not in v4 and "energies" not in v4
    assert v4["layout"] == FactoredProjector.from_model(model, 64).spec()["layout"]  # version 5's "layer" layout
    assert record_kwargs({"layout_version": 4, "layout": v4["layout"]}) == {"split": "layer", "layout_version": 4}
    for old in (None, 2, 3, 6):
        with pytest.raises(BadInputError, match=f"layout_version={old}"):
            record_kwargs({"layout_version": old})


# ---------------------------------------------------------------------------- the probe
class Net(nn.Module):
    """Conv + BatchNorm + dropout + two linear layers: eval mode matters (running statistics, no dropout)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.fc1 = nn.Linear(4 * 4 * 4, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x))).flatten(1)
        return self.fc2(self.drop(torch.relu(self.fc1(h))))


def brute_energies(model: nn.Module, x, y, names) -> dict:
    """float64, one autograd call per example, eval mode: mean ‖∂f/∂θ‖² with f the classification margin."""
    m = copy.deepcopy(model).double().eval()
    params = dict(m.named_parameters())
    out = {n: 0.0 for n in names}
    for i in range(len(y)):
        logits = m(x[i : i + 1].double())[0]
        others = torch.cat([logits[: y[i]], logits[y[i] + 1 :]])
        f = logits[y[i]] - torch.logsumexp(others, 0)
        for n, g in zip(names, torch.autograd.grad(f, [params[n] for n in names]), strict=True):
            out[n] += float((g**2).sum()) / len(y)
    return out


def test_probe_matches_float64_autograd_in_eval_mode_and_any_chunk():
    torch.manual_seed(1)
    model = Net()
    model.bn.running_mean.uniform_(-0.5, 0.5)
    model.bn.running_var.uniform_(0.5, 2.0)
    model.train()
    x, y = torch.randn(70, 1, 6, 6), torch.randint(0, 3, (70,))
    names = [n for n, _ in model.named_parameters()]
    want = brute_energies(model, x[:64], y[:64], names)  # rows=64 by default: the first 64 of 70
    for budget in (2**28, 1):  # all rows in one pass; one row per pass
        got = gradient_energies(model, "image_classification", (x, y), budget_bytes=budget)
        assert model.training  # the caller's mode is restored
        assert set(got) == set(names)
        for n in names:
            assert math.isclose(got[n], want[n], rel_tol=2e-4), (n, got[n], want[n])
    sub = gradient_energies(model, "image_classification", (x, y), rows=5, grad_wrt=["fc2.weight", "conv.weight"])
    want5 = brute_energies(model, x[:5], y[:5], ["fc2.weight", "conv.weight"])
    assert set(sub) == {"fc2.weight", "conv.weight"}
    assert all(math.isclose(sub[n], want5[n], rel_tol=2e-4) for n in sub)


def test_probe_memory_bound_and_bad_input():
    assert probe_chunk(124_000_000) == 1  # GPT-2-small: one example per pass
    assert probe_chunk(100_000) == (256 * 2**20) // 400_000
    model = mlp()
    x, y = torch.randn(4, 20), torch.randint(0, 3, (4,))
    with pytest.raises(BadInputError, match="rows must be a positive integer"):
        gradient_energies(model, "image_classification", (x, y), rows=0)
    with pytest.raises(BadInputError, match="no examples"):
        gradient_energies(model, "image_classification", (x[:0], y[:0]))
    xb = x.clone()
    xb[2, 0] = float("nan")
    with pytest.raises(BadInputError, match=r"example\(s\) \[2\]"):
        gradient_energies(model, "image_classification", (xb, y))
    skipped = gradient_energies(model, "image_classification", (xb, y), skip_nonfinite=True)
    keep = torch.tensor([0, 1, 3])
    assert skipped == pytest.approx(gradient_energies(model, "image_classification", (x[keep], y[keep])), rel=1e-6)


# ---------------------------------------------------------------------------- the sketched probe (the default's)
def _per_block(model, energies: dict) -> dict:
    return {b.name: sum(energies[n] for n in b.params) for b in model_layout(model, 8, None, "dense", "layer").blocks}


def test_sketched_probe_is_exact_where_blocks_keep_their_whole_size():
    """A model of fewer coordinates than the sketch's width: every layer block is kept whole (identity sides), so
    the sketch's block energies are the float64 autograd ones; BatchNorm's parameters (the dense "other" block) are
    estimated (a random square matrix), in eval mode (running statistics, no dropout)."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.ReLU(), nn.Linear(8, 3)).double()
    model[1].running_mean.uniform_(-0.5, 0.5)
    model.train()
    x, y = torch.randn(40, 6, dtype=torch.float64), torch.randint(0, 3, (40,))
    names = [n for n, _ in model.named_parameters()]
    want = _per_block(model, brute_energies(model, x, y, names))
    got = sketched_energies(model, "image_classification", (x, y))
    assert model.training and set(got) == set(names)
    blocks = _per_block(model, got)
    for name in ("0", "4"):  # the two linear layers, whole
        assert math.isclose(blocks[name], want[name], rel_tol=1e-9), (name, blocks[name], want[name])
    assert blocks["__other__"] > 0


def test_sketched_probe_is_unbiased_block_by_block():
    """The mean over independent sketches (seeds) of each block's estimate is the exact energy (float64 autograd),
    within the spread of 48 sketches; each estimate is positive."""
    torch.manual_seed(1)
    model = Net().double().eval()
    x, y = torch.randn(64, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (64,))
    names = [n for n, _ in model.named_parameters()]
    want = _per_block(model, brute_energies(model, x, y, names))
    runs = [_per_block(model, sketched_energies(model, "image_classification", (x, y), seed=s)) for s in range(48)]
    chunked = _per_block(model, sketched_energies(model, "image_classification", (x, y), seed=47, chunk_rows=10))
    assert chunked == pytest.approx(runs[-1], rel=1e-12)  # rows in passes of 10: the same sums
    for name, w in want.items():
        vals = torch.tensor([r[name] for r in runs], dtype=torch.float64)
        assert bool((vals > 0).all())
        err = float(vals.std()) / math.sqrt(len(runs))
        assert abs(float(vals.mean()) - w) < 4 * err + 1e-9 * w, (name, float(vals.mean()), w, err)


def test_sketched_probe_bad_input():
    model = mlp()
    x, y = torch.randn(4, 20), torch.randint(0, 3, (4,))
    with pytest.raises(BadInputError, match="rows must be a positive integer"):
        sketched_energies(model, "image_classification", (x, y), rows=0)
    with pytest.raises(BadInputError, match="no examples"):
        sketched_energies(model, "image_classification", (x[:0], y[:0]))
    xb = x.clone()
    xb[2, 0] = float("nan")
    with pytest.raises(BadInputError, match=r"example\(s\) \[2\]"):
        sketched_energies(model, "image_classification", (xb, y))
    keep = torch.tensor([0, 1, 3])
    skipped = sketched_energies(model, "image_classification", (xb, y), skip_nonfinite=True)
    assert skipped == pytest.approx(sketched_energies(model, "image_classification", (x[keep], y[keep])), rel=1e-5)
