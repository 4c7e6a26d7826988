"""Kronecker-factored curvature (K-FAC, and EK-FAC's eigenvalue correction) in the factored projection's space
(``curvature="kfac"`` / ``"ekfac"``): LoGra's order, project first, then curve; or the projection itself in the
factors' eigenbasis (``curvature="kfac-eigen"``).

The curvature
-------------
For an ``nn.Linear`` layer (weight W, d_out × d_in, and its bias; a transformers ``Conv1D``, weight Wᵀ, is the same
layer without its bias, its block the transposed view: A and S change sides) one example's gradient is the augmented
matrix G = Σ_t δ_t ãᵀ_t (d_out × (d_in [+1])), ã_t = [a_t; 1] the layer's input at position t (with a 1 for the
bias), δ_t = √r · ∂f/∂(layer output)_t, f the task's model output (TRAK's margin) and r = Q(1 − Q) the curvature
of the loss in f (:func:`trak_core.solve.damping.loss_curvature`, the weighting of ``curvature="ggn"``); r = 1 for a
causal LM, whose r ≈ 0 on every sequence says nothing of its fit (:func:`~trak_core.solve.lambda_rules.q_measures_fit`:
S is then the output gradients' own second moment, as XᵀX weighs its rows). K-FAC
approximates that block's curvature by

    H ≈ S ⊗ A,   A = (1/T) Σ_{n,t} ã ãᵀ  (T positions in all),   S = (1/N) Σ_{n,t} δ δᵀ  (N examples),

summed over a text task's real tokens only (padding positions left out, :func:`token_mask`).

Where it is applied
-------------------
The factored projection keeps, per block, coordinates c = w_c · p_out,iᵀ G p_in,j (a grid (i, j) = (c // k_in,
c % k_in), or pairs i = j = c; :mod:`trak_core.projection.factored`). Under K-FAC their second moment is

    F_b[c, c'] = w_c w_c' · (P_outᵀ S P_out)[i, i'] · (P_inᵀ A P_in)[j, j']

(k_b × k_b per block: a Kronecker product for the grid, a Hadamard product for pairs), which
:func:`projected_factors` forms from the fitted A and S and the block's side matrices. Finalize then writes the
block-diagonal inverse (:func:`block_inverse`): per K-FAC block (F_b · tr(G_b)/tr(F_b) + λ_b I)⁻¹, K-FAC's shape
at the scale of the block's own XᵀX block G_b, λ_b = ``damping`` × its mean eigenvalue; for ``"ekfac"`` the
eigenvalues of F_b are replaced by the rows' second moments in its eigenbasis, uᵀ G_b u (EK-FAC's correction,
here exact per block and free: G_b is reduced anyway); every other block (convolutions, embeddings, attention,
norms, a Linear used twice) keeps its XᵀX block, damped by :data:`EMPIRICAL_DAMPING` × its mean eigenvalue. The
rows are the plain projected gradients: featurizing, targets, the index and appends do not depend on the
curvature, only the inverse does.

Why this order: whitening each gradient before a random projection (H^(-1/2) g, then JL) spreads the signal
over every direction, and the projection's error grows with the whitened norms; on the held-out cases of
benchmarks/RESULTS.md that scored below the defaults, while curving in the projected space scores above them.

The eigenbasis projection (``curvature="kfac-eigen"``)
-----------------------------------------------------
Instead of random side matrices, a Kronecker block (:func:`kronecker_blocks`) is projected in the eigenbasis of its
own factors, R = U_R diag(e_R) U_Rᵀ (the block's rows: S of a Linear, A of a Conv1D's view) and C = U_C diag(e_C)
U_Cᵀ (its columns): coordinate (i, j) of the rotated gradient U_Rᵀ G U_C has K-FAC eigenvalue e = e_R,i · e_C,j. A
pairs block of k pairs keeps the k coordinates of largest e/(e + λ) (λ = :data:`EIGEN_DAMPING` × the block's mean
e; within a block the same order as e), a grid block (k_out × k_in) the top k_out eigenvectors of R and the top
k_in of C (a side as wide as its dimension: its full eigenbasis), weight 1 (:func:`eigen_sides`, bound to the
projector by :func:`bind_eigen` through ``FactoredProjector.side_override``). Finalize inverts each such block
by EK-FAC's diagonal: diag(1 / (diag(G_b) + λ_b)), G_b its XᵀX block (the rows' own second moments in the
eigenbasis), λ_b = ``damping`` (default :data:`EIGEN_DAMPING`) × their mean; every other block keeps its damped XᵀX
block. The rows depend on the factors, so each checkpoint's factors are fitted before its rows
(:data:`FIT_BEFORE_FEATURIZE`); a square Conv1D whose block carries its bias, and the layers without factors,
keep random sides. Which coordinates are worth keeping is the factors' business, not the gradient energy's: a new
store's projector splits proj_dim with energies whose Kronecker layers' share is spread ∝ their eigen-coordinates
among the top ones by e/(e + λ) over all those layers (:func:`eigen_energies`, by ``engine.eigen_split`` with model
0's factors: TRAKer's default projector after the first fit, the pipeline's plan by one fit of model 0 before it
creates the store, so both lay out the same projection); on wide-mlp the probe's energy split scored 0.05 LDS lower
at proj_dim 512. Whitening each gradient then projecting it at random scored far below (offline). LDS beside
kronfluence: benchmarks/RESULTS.md, "Beside kronfluence".

The record
----------
A fit is a pass over train rows (or a sample of them) at one checkpoint, reducible as sums
(:class:`FactorSums`; TRAKer and the pipeline's shards sum them while they featurize, :class:`FactorFold`: each
layer's input and output gradient taken from the factored projection's own forward and backward,
:mod:`trak_core.solve.kfac_tap`, or by a pass of their own where that fast path does not run). Its per-layer A and
S (float64) are arrays in the store's ``curvature/<model id>`` group, their layout, the damping, the rows used and a
sha256 over them in that group's record (:mod:`trak_core.solve.kfac_record`); finalize reads them back. A store
grows with the factors it recorded (they are never refitted).
"""

from __future__ import annotations

import hashlib
import math
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from trak_core.errors import BadInputError, StateError
from trak_core.featurize.gradients import grad_param_names
from trak_core.solve.spectrum import DIRECT_MAX, FactorSpectrum

#: the curvatures of this module (``StoreMetadata.curvature``)
KFAC_CURVATURES = ("kfac", "ekfac", "kfac-eigen")
#: the curvature whose projection is the factors' eigenbasis ("The eigenbasis projection" in the module docstring)
EIGEN = "kfac-eigen"
#: the curvatures whose rows depend on the factors: each checkpoint's factors are fitted before its rows
FIT_BEFORE_FEATURIZE = (EIGEN,)
#: the curvatures whose factors TRAKer may sum while it featurizes, without a fit (:class:`FactorFold`)
FOLDED_CURVATURES = tuple(c for c in KFAC_CURVATURES if c not in FIT_BEFORE_FEATURIZE)
#: λ of each K-FAC block of the inverse = DEFAULT_DAMPING × its mean eigenvalue (chosen on held-out cases,
#: benchmarks/RESULTS.md "Beside kronfluence")
DEFAULT_DAMPING = 0.001
#: λ of each other block of the inverse (its XᵀX block) = EMPIRICAL_DAMPING × its mean eigenvalue
EMPIRICAL_DAMPING = 0.1
#: ``"kfac-eigen"``: λ of each eigen block's diagonal inverse = EIGEN_DAMPING × the mean of its rows' second moments
#: (on wide-mlp, 0.003–0.03 scored within 0.006 LDS of each other at proj_dim 512 and 2048, 0.1 up to 0.016 lower)
EIGEN_DAMPING = 0.01
#: ``"kfac-eigen"``'s split between layers: each eigen-coordinate ranked by e/(e + λ), λ = this × its layer's mean e
EIGEN_RANK_DAMPING = 0.1
#: ``"kfac-eigen"``: the Kronecker layers get at least the coordinates that hold this share of their K-FAC energy
#: (:func:`eigen_energies`), up to EIGEN_MAX_SHARE of proj_dim (the other layers keep the rest). Over the twelve
#: LDS cases at proj_dim 512 and 2048 only bn-conv, small-lm and digits-conv move: 0.90 (or the probe's share
#: alone) scores up to 0.032 lower (bn-conv 512), a cap of 0.75 up to 0.006 lower (small-lm); 0.99 ties 0.95 left out
#: one case at a time (bn-conv +0.019 at 512, −0.019 at 2048)
EIGEN_ENERGY_KEPT, EIGEN_MAX_SHARE = 0.95, 0.9


def default_damping(curvature: str) -> float:
    """The damping a curvature of this module uses unless told: :data:`EIGEN_DAMPING` for ``"kfac-eigen"``,
    :data:`DEFAULT_DAMPING` for the others."""
    return EIGEN_DAMPING if curvature == EIGEN else DEFAULT_DAMPING


def check_damping(damping) -> float:
    """``damping`` as a float, or BadInputError naming ``curvature_damping``: a finite number > 0."""
    if isinstance(damping, bool) or not isinstance(damping, (int, float, np.floating, np.integer)):
        raise BadInputError(f"curvature_damping={damping!r}: expected a finite number > 0 (default {DEFAULT_DAMPING})")
    value = float(damping)
    if not math.isfinite(value) or value <= 0:
        raise BadInputError(f"curvature_damping={damping!r}: expected a finite number > 0 (default {DEFAULT_DAMPING})")
    return value


# ---------------------------------------------------------------------------------------------- layers
@dataclass(frozen=True)
class Site:
    """A layer with Kronecker factors: the module ``name``, its weight (and bias) parameter names, its output and
    input widths. ``transposed``: a transformers ``Conv1D`` (weight [d_in, d_out], y = x W + b), whose projection
    block is the weight's d_in × d_out view; its bias is not part of the site (it keeps its XᵀX block)."""

    name: str
    weight: str
    bias: str | None
    d_out: int
    d_in: int
    transposed: bool = False

    @property
    def in_rows(self) -> int:
        return self.d_in + (1 if self.bias is not None else 0)


def linear_sites(model: nn.Module, grad_wrt: Iterable[str] | None = None) -> tuple[list[Site], list[str]]:
    """(the ``nn.Linear`` and transformers ``Conv1D`` layers whose weight is in the gradient, the gradient's other
    parameters)."""
    from trak_core.projection.layout import is_conv1d

    names = grad_param_names(model, grad_wrt)
    wanted = set(names)
    sites = []
    for mname, mod in model.named_modules():
        prefix = f"{mname}." if mname else ""
        w, b = prefix + "weight", prefix + "bias"
        if w not in wanted:
            continue
        if is_conv1d(mod):
            sites.append(Site(mname, w, None, int(mod.nf), int(mod.weight.shape[0]), transposed=True))
        elif isinstance(mod, nn.Linear):
            bias = b if mod.bias is not None and b in wanted else None
            sites.append(Site(mname, w, bias, mod.out_features, mod.in_features))
    covered = {n for s in sites for n in (s.weight, s.bias) if n is not None}
    return sites, [n for n in names if n not in covered]


# ---------------------------------------------------------------------------------------------- the pass
@dataclass
class FactorSums:
    """Partial sums of one fit, reducible by :meth:`add` (shards, processes): Σ ããᵀ and Σ δδᵀ per layer, and the
    positions and examples counted."""

    a: dict[str, np.ndarray] = field(default_factory=dict)
    s: dict[str, np.ndarray] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    examples: int = 0

    def add(self, other: FactorSums) -> FactorSums:
        for mine, theirs in ((self.a, other.a), (self.s, other.s)):
            for k, v in theirs.items():
                mine[k] = mine[k] + v if k in mine else v.copy()
        for k, count in other.tokens.items():
            self.tokens[k] = self.tokens.get(k, 0) + count
        self.examples += other.examples
        return self


def _site_tensors(feat, batch: Sequence[Tensor], sites: list[Site]) -> tuple[dict, dict, list[str]]:
    """({site: ã (B, T, in_rows)}, {site: δ (B, T, d_out), scaled by √r}, sites left out) of one batch, float64:
    one forward of the task's output per example (vmap) and one backward of their sum (each example's δ is its
    own: vmap gives each example its own zero probe added to the layer's output)."""
    from trak_core.projection.mha import differentiable_attention
    from trak_core.solve.kfac_tap import FactorTap
    from trak_core.solve.lambda_rules import q_measures_fit

    model, task, gc = feat.model, feat.task, feat.gradient_computer
    weights, buffers = gc._weights(), gc._buffers()
    batch = [t.to(feat.device) for t in batch]
    bsz = batch[0].shape[0]
    tap = FactorTap([s.name for s in sites], np.ones(bsz, dtype=bool), lambda *_: None)  # its hooks, not its sums
    shapes = tap.shapes(model, task, weights, buffers, batch)  # the layers called exactly once, their shapes
    used, skipped = [s for s in sites if s.name in shapes], [s.name for s in sites if s.name not in shapes]
    dt = next(iter(weights.values())).dtype
    handles = tap.hooks(model)
    try:
        with torch.enable_grad(), differentiable_attention():
            es = {
                s.name: torch.zeros(bsz, *shapes[s.name], device=feat.device, dtype=dt, requires_grad=True)
                for s in used
            }

            def out_fn(e, *sample):
                taken = tap.bind(e)
                out = task.get_output(model, weights, buffers, *sample)
                return out, {s.name: taken[s.name] for s in used}

            out, acts = torch.func.vmap(out_fn)(es, *batch)
            grads = torch.autograd.grad(out.sum(), [es[s.name] for s in used], allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    q = gc.compute_loss_grad(batch) if q_measures_fit(task) else None
    a_out, d_out = augmented(used, acts, {s.name: g for s, g in zip(used, grads, strict=True)}, q, bsz)
    return a_out, d_out, skipped


def augmented(used: list[Site], acts: dict, grads: dict, q: Tensor | None, bsz: int) -> tuple[dict, dict]:
    """({site: ã (B, T, in_rows)}, {site: δ (B, T, d_out) scaled by √r}) float64 of the ``used`` sites' inputs
    ``acts`` and output gradients ``grads`` (None: a layer whose output f does not use), r = Q(1 − Q) of the rows'
    ``q`` (S of the loss's Gauss-Newton), or r = 1 with ``q`` None (a task whose r ≈ 0 for every row says nothing of
    the fit: S of the output's own gradients, as XᵀX weighs them, R = I)."""
    from trak_core.solve.damping import loss_curvature

    if q is None:
        root_r = torch.ones(bsz, dtype=torch.float64)
    else:
        root_r = torch.from_numpy(np.sqrt(np.maximum(loss_curvature(q.detach().cpu()), 0.0)))
    a_out, d_out = {}, {}
    for s in used:
        a = acts[s.name].to(torch.float64).reshape(bsz, -1, s.d_in)
        if s.bias is not None:
            a = torch.cat([a, torch.ones(*a.shape[:2], 1, dtype=a.dtype, device=a.device)], dim=2)
        g = grads.get(s.name)
        d = torch.zeros(bsz, a.shape[1], s.d_out, dtype=torch.float64, device=a.device) if g is None else g
        a_out[s.name] = a
        d_out[s.name] = d.to(torch.float64).reshape(bsz, -1, s.d_out) * root_r.to(a.device).reshape(bsz, 1, 1)
    return a_out, d_out


def token_mask(task, batch: Sequence[Tensor]) -> Tensor | None:
    """(B, T) float64 1 for a real token, 0 for padding, of a batch of the built-in text tasks (their attention
    mask: a causal LM's second tensor, a text classifier's third); None for other tasks (every position counts)."""
    from trak_core.featurize.modelout import CausalLMModelOutput, TextClassificationModelOutput

    at = {CausalLMModelOutput: 1, TextClassificationModelOutput: 2}.get(type(task))
    return None if at is None else (batch[at] != 0).to(torch.float64)


def batch_sums(feat, batch: Sequence[Tensor], sites: list[Site]) -> tuple[FactorSums, list]:
    """One batch's :class:`FactorSums` and the sites left out (called other than once). A layer applied at every
    token of a text task counts its real tokens only (:func:`token_mask`): a padding position's input is no input
    of the data, and would otherwise weigh in A as much as a real one. The products are float64 whatever the model's
    dtype: float32 ones made the factors depend on the batch size at 1e-7, which kfac-eigen's eigenbasis turned
    into 1e-4 differences between scores of the same rows in other batches."""
    a, d, skipped = _site_tensors(feat, batch, sites)
    return tensor_sums(feat.task, batch, a, d), skipped


def tensor_sums(task, batch: Sequence[Tensor], a: dict, d: dict) -> FactorSums:
    """The :class:`FactorSums` of one batch's ã and scaled δ (:func:`augmented`), its real tokens only (the padding
    positions' rows left out of the products: they would add zeros)."""
    out = FactorSums(examples=int(batch[0].shape[0]))
    mask = token_mask(task, batch)
    for name, at in a.items():
        dt = d[name]
        if mask is not None and at.shape[1] == mask.shape[1]:
            real = mask.to(device=at.device) != 0
            at, dt = at[real], dt[real]
            out.tokens[name] = int(mask.sum())
        else:
            out.tokens[name] = int(at.shape[0] * at.shape[1])
        at, dt = at.reshape(-1, at.shape[-1]), dt.reshape(-1, dt.shape[-1])
        out.a[name] = (at.T @ at).cpu().numpy()
        out.s[name] = (dt.T @ dt).cpu().numpy()
    return out


# ---------------------------------------------------------------------------------------------- the factors
@dataclass
class KroneckerFactors:
    """The fitted curvature of one checkpoint: {site name: (Site, A (in_rows²), S (d_out²))} float64, and ``info``
    (kind, damping, rows, the parameters left with their XᵀX block)."""

    blocks: dict[str, tuple[Site, np.ndarray, np.ndarray]]
    info: dict


def factors_of(
    sums: FactorSums, sites: list[Site], kind: str = "kfac", damping: float | None = None, identity=()
) -> KroneckerFactors:
    """The :class:`KroneckerFactors` of reduced ``sums``: A = Σ ããᵀ / positions, S = Σ δδᵀ / examples per layer
    (``damping`` None: the kind's :func:`default_damping`)."""
    if kind not in KFAC_CURVATURES:
        raise BadInputError(f"curvature={kind!r}: expected one of {KFAC_CURVATURES}")
    damping = check_damping(default_damping(kind) if damping is None else damping)
    by_name = {s.name: s for s in sites}
    blocks = {
        name: (by_name[name], sums.a[name] / max(1, sums.tokens[name]), sums.s[name] / max(1, sums.examples))
        for name in sums.a
    }
    info = {"kind": kind, "damping": damping, "rows": int(sums.examples), "identity": sorted(identity)}
    return KroneckerFactors(blocks, info)


def finish_factors(
    total: FactorSums, sites: list[Site], others: list[str], skipped: set, kind: str, damping, warn: bool
) -> KroneckerFactors:
    """The factors of a reduced pass (:func:`fit_factors`, :class:`FactorFold`): the sites called other than once and
    the other parameters keep their XᵀX block (a warning names them)."""
    if total.examples == 0:
        raise BadInputError("curvature: the factor pass was given no train rows")
    used = [s for s in sites if s.name not in skipped]
    identity = list(others) + [n for s in sites if s.name in skipped for n in (s.weight, s.bias) if n]
    if identity and warn:
        warnings.warn(
            f"curvature={kind!r}: only nn.Linear and Conv1D layers called once per forward get Kronecker factors; "
            "parameters "
            f"{identity[:10]}{' and more' if len(identity) > 10 else ''} keep their block of XᵀX",
            stacklevel=3,
        )
    return factors_of(total, used, kind, damping, identity)


def fit_factors(
    feat,
    batches: Callable[[], Iterable[Sequence[Tensor]]],
    kind: str = "kfac",
    damping: float | None = None,
    grad_wrt: Iterable[str] | None = None,
    warn: bool = True,
) -> KroneckerFactors:
    """Fit the factors of ``feat``'s current checkpoint over the train rows ``batches()`` yields (one pass, for
    either kind: EK-FAC's correction is taken from XᵀX at finalize): forward + backward of the task's output, no
    per-example gradient. Parameters other than single-use ``nn.Linear`` and ``Conv1D`` layers keep their XᵀX block
    (a warning names them)."""
    if kind not in KFAC_CURVATURES:
        raise BadInputError(f"curvature={kind!r}: expected one of {KFAC_CURVATURES}")
    damping = check_damping(default_damping(kind) if damping is None else damping)
    sites, others = linear_sites(feat.model, grad_wrt)
    total, skipped = FactorSums(), set()
    for batch in batches():
        part, left = batch_sums(feat, batch, sites)
        total.add(part)
        skipped.update(left)
    return finish_factors(total, sites, others, skipped, kind, damping, warn)


class FactorFold:
    """The factor fit folded into featurizing (``"kfac"`` / ``"ekfac"``, whose rows do not depend on the factors):
    the running :class:`FactorSums` of the train rows of one model featurized so far, each row counted once. Its
    :meth:`factors` are :func:`fit_factors`' over the same rows (the same sums, added in another order: equal to
    float64 rounding), provided those rows are all the model's (:meth:`covers`). :meth:`featurize` featurizes and
    sums in one forward and backward; :meth:`add` sums rows featurized already, by a pass of its own."""

    def __init__(self, train_rows: int, grad_wrt: Iterable[str] | None = None) -> None:
        self.rows = np.zeros(int(train_rows), dtype=bool)
        self.total, self.skipped = FactorSums(), set[str]()
        self._grad_wrt = None if grad_wrt is None else list(grad_wrt)
        self._sites: tuple[list[Site], list[str]] | None = None
        self._shapes: dict = {}  # the per-example shapes of the fast path's layers, by input shape (FactorTap)

    def add(self, feat, batch: Sequence[Tensor], rows) -> None:
        """Add the rows ``rows`` (distinct) of ``batch`` that are not counted yet."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        new = ~self.rows[rows]
        if not new.any():
            return
        if not new.all():
            keep = torch.as_tensor(np.flatnonzero(new), device=batch[0].device)
            batch, rows = [t[keep] for t in batch], rows[new]
        if self._sites is None:
            self._sites = linear_sites(feat.model, self._grad_wrt)
        part, left = batch_sums(feat, batch, self._sites[0])
        self.total.add(part)
        self.skipped.update(left)
        self.rows[rows] = True

    def featurize(self, feat, batch: Sequence[Tensor], model_id: int, rows) -> tuple[np.ndarray, np.ndarray]:
        """``feat.featurize(batch, model_id, rows)``, adding the rows ``rows`` (distinct) not counted yet from the
        same forward and backward where the factored projector's fast path computes them all
        (:class:`~trak_core.solve.kfac_tap.FactorTap`); else (another projector or featurizer) by :meth:`add`'s
        pass of its own. The sums are :meth:`add`'s either way (float64 rounding apart)."""
        from trak_core.solve.kfac_tap import FactorTap

        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        new = ~self.rows[rows]
        if not new.any() or not hasattr(feat, "tap"):
            out = feat.featurize(batch, model_id, rows)
            self.add(feat, batch, rows)
            return out
        if self._sites is None:
            self._sites = linear_sites(feat.model, self._grad_wrt)
        sites, part, left_out = self._sites[0], FactorSums(), set[str]()

        def reduce(piece, acts, grads, q, left) -> None:
            from trak_core.solve.lambda_rules import q_measures_fit

            used = [s for s in sites if s.name in acts]
            fit = q if q_measures_fit(feat.task) else None
            part.add(tensor_sums(feat.task, piece, *augmented(used, acts, grads, fit, int(piece[0].shape[0]))))
            left_out.update(left)

        tap = FactorTap([s.name for s in sites], new, reduce, self._shapes)
        feat.tap = tap
        try:
            out = feat.featurize(batch, model_id, rows)
        finally:
            feat.tap = None
        if not (tap.complete and tap.offset == len(rows)):
            self.add(feat, batch, rows)
            return out
        self.total.add(part)
        self.skipped.update(left_out)
        self.rows[rows[new]] = True
        return out

    def merge(self, other: FactorFold) -> bool:
        """Add ``other``'s sums (a fold of the same model) when none of its rows is counted here; False (nothing
        added) otherwise."""
        if other.rows.shape != self.rows.shape or bool((self.rows & other.rows).any()):
            return False
        self.total.add(other.total)
        self.skipped.update(other.skipped)
        self.rows |= other.rows
        self._sites = self._sites or other._sites
        return True

    def layout(self) -> tuple[list[Site], list[str]]:
        """(the model's K-FAC sites, its other gradient parameters); BadInputError before any row was added."""
        if self._sites is None:
            raise BadInputError("curvature: the factor pass was given no train rows")
        return self._sites

    def covers(self, featurized: np.ndarray) -> bool:
        """Whether the rows counted are exactly ``featurized`` (a model's featurized flags)."""
        return bool(np.array_equal(self.rows, np.asarray(featurized, dtype=bool)))

    def factors(self, kind: str, damping: float | None = None, warn: bool = True) -> KroneckerFactors:
        if kind not in FOLDED_CURVATURES:
            raise BadInputError(f"curvature={kind!r}: the factors summed while featurizing are {FOLDED_CURVATURES}")
        sites, others = self.layout()
        damping = check_damping(default_damping(kind) if damping is None else damping)
        return finish_factors(self.total, sites, others, self.skipped, kind, damping, warn)


def featurize_folded(fold: FactorFold | None, feat, batch: Sequence[Tensor], model_id: int, rows):
    """(X, Q) of ``feat.featurize``; with a ``fold``, its sums of the rows too (:meth:`FactorFold.featurize`)."""
    return feat.featurize(batch, model_id, rows) if fold is None else fold.featurize(feat, batch, model_id, rows)


# ---------------------------------------------------------------------------------------------- the inverse
def kronecker_blocks(blocks, pre: KroneckerFactors) -> dict:
    """{block name: (block, R, C)} of the factored projection's ``blocks`` that are a Kronecker product of ``pre``'s
    factors: R the factor of the block's rows (d_out side), C of its columns (in_rows side). A linear block's R is
    S, its C is A; a ``Conv1D`` site's block is its weight's view (rows: the input a, columns: the output δ), so
    R = A, C = S; a view with its bias attached (a square ``Conv1D``) is not a Kronecker product and is left out."""
    from trak_core.projection.layout import MATRIX

    views = {site.weight: (site, s, a) for site, a, s in pre.blocks.values() if site.transposed}
    out = {}
    for blk in blocks:
        entry, shape = None, None
        if blk.kind == "linear" and blk.name in pre.blocks and not pre.blocks[blk.name][0].transposed:
            entry = pre.blocks[blk.name]
            shape = (entry[0].d_out, entry[0].in_rows)
        elif blk.kind == MATRIX and blk.name in views and not blk.bias:
            entry = views[blk.name]
            shape = (entry[0].d_in, entry[0].d_out)
        if entry is not None:
            site, c, r = entry  # c: the columns' factor, r: the rows'
            if shape != (blk.d_out, blk.in_rows):
                raise StateError(f"curvature factors of {blk.name!r} do not match the store's projection layout")
            out[blk.name] = (blk, r, c)
    return out


def projected_factors(meta, model_id: int, pre: KroneckerFactors) -> dict[str, tuple[int, np.ndarray]]:
    """{block name: (its offset in the row, F_b (k_b × k_b) float64)} of the K-FAC layers of the store's factored
    projection for ``model_id`` (module docstring), from the recorded layout and the side matrices it names
    (:func:`kronecker_blocks` says which blocks, and which factor goes to which side)."""
    from trak_core.projection.layout import SIDE_IN, SIDE_OUT, coordinate_weights, factor_matrix, recorded_blocks

    blocks = recorded_blocks(dict(meta.projector_params))
    kron = kronecker_blocks(blocks, pre)
    out, offset = {}, 0
    for blk in blocks:
        if blk.name in kron:
            _, s, a = kron[blk.name]  # s: the rows' factor, a: the columns'

            def side(which: int, rows: int, cols: int, identity: bool, name: str = blk.name) -> np.ndarray:
                if identity:
                    return np.eye(rows)
                m = factor_matrix(meta.proj_seed, model_id, name, which, rows, cols, meta.proj_type, "cpu")
                return m.double().numpy()

            p_in = side(SIDE_IN, blk.in_rows, blk.k_in, blk.id_in)
            p_out = side(SIDE_OUT, blk.d_out, blk.k_out, blk.id_out)
            a_p, s_p = p_in.T @ a @ p_in, p_out.T @ s @ p_out
            c = np.arange(blk.k)
            i, j = (c, c) if blk.pairs else (c // blk.k_in, c % blk.k_in)
            cw = coordinate_weights(blk, meta.proj_dim)
            w = np.broadcast_to(np.asarray(cw.numpy() if isinstance(cw, Tensor) else cw, dtype=np.float64), (blk.k,))
            out[blk.name] = (offset, np.outer(w, w) * s_p[np.ix_(i, i)] * a_p[np.ix_(j, j)])
        offset += blk.k
    return out


def _eigenvalues(m: np.ndarray) -> np.ndarray:
    """The eigenvalues of a symmetric factor clipped at 0, largest first, without its eigenvectors (LAPACK's
    values-only driver: 0.6× a full eigendecomposition's time on a 4,097² factor here)."""
    return np.clip(np.linalg.eigvalsh((m + m.T) / 2)[::-1], 0.0, None)


#: ``"kfac-eigen"``: at most this many bytes of factor reductions are kept from the split (:func:`eigen_energies`)
#: for the sides of the same factors (:func:`eigen_sides`), the widest factors first (a reduction costs n³, holds n²)
SPECTRA_KEEP_BYTES = 1 << 30


class SpectraMemo:
    """The tridiagonal reductions (:class:`FactorSpectrum`) that :func:`eigen_energies` made of a checkpoint's factors,
    kept for :func:`eigen_sides` of the same matrices (the same arrays: a TRAKer's fitted factors), each taken once:
    the split and the sides then reduce each factor once. Holds at most ``max_bytes`` (:data:`SPECTRA_KEEP_BYTES`);
    a factor of up to DIRECT_MAX columns is never kept (its full decomposition is cheap)."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = SPECTRA_KEEP_BYTES if max_bytes is None else int(max_bytes)
        self._wanted: set[int] = set()
        self._held: dict[int, tuple[np.ndarray, FactorSpectrum]] = {}

    def plan(self, matrices: Iterable[np.ndarray]) -> None:
        """Choose which of ``matrices`` to keep: the widest first, while their reductions fit in ``max_bytes``."""
        left, self._wanted = self.max_bytes, set()
        for m in sorted({id(m): m for m in matrices}.values(), key=lambda m: -m.shape[0]):
            if m.shape[0] > DIRECT_MAX and m.nbytes <= left:
                self._wanted.add(id(m))
                left -= m.nbytes

    def keep(self, m: np.ndarray, spectrum: FactorSpectrum) -> None:
        """Hold ``m``'s ``spectrum`` for :meth:`take` where :meth:`plan` chose it."""
        if id(m) in self._wanted:
            self._held[id(m)] = (m, spectrum)

    def take(self, m: np.ndarray) -> FactorSpectrum:
        """``m``'s kept spectrum (then forgotten), else a new one."""
        held = self._held.pop(id(m), None)
        return held[1] if held is not None and held[0] is m else FactorSpectrum(m)

    def clear(self) -> None:
        self._wanted.clear()
        self._held.clear()


def eigen_sides(
    blocks, pre: KroneckerFactors, damping: float | None = None, spectra: SpectraMemo | None = None
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{block name: (P_in, P_out)} float64 of ``curvature="kfac-eigen"`` for the Kronecker blocks of ``blocks``
    (:func:`kronecker_blocks`), from one checkpoint's factors (module docstring, "The eigenbasis projection"): a
    pairs block of k pairs keeps the k eigen-coordinates (i, j) of largest e/(e + λ), e = e_R,i · e_C,j, λ =
    ``damping`` × the block's mean e (P_out's columns u_R,i, P_in's u_C,j); a grid block (k_out × k_in, an
    identity side included: its full eigenbasis) the top k_out eigenvectors of R and the top k_in of C.
    ``spectra``: the reductions the split made of these factors (:class:`SpectraMemo`), used instead of new ones."""
    damping = float(pre.info.get("damping", EIGEN_DAMPING)) if damping is None else float(damping)
    out = {}
    for name, (blk, r, c) in kronecker_blocks(blocks, pre).items():
        # every eigenvalue; only the eigenvectors kept below
        sr, sc = (FactorSpectrum(m) if spectra is None else spectra.take(m) for m in (r, c))
        if blk.pairs:
            e = np.outer(sr.values, sc.values).reshape(-1)
            lam = damping * float(e.mean())
            key = e / (e + lam) if lam > 0 else e
            keep = np.argsort(-key, kind="stable")[: blk.k]
            i, j = keep // sc.n, keep % sc.n
            ur, uc = (s.vectors(int(ix.max(initial=-1)) + 1) for s, ix in ((sr, i), (sc, j)))
            out[name] = (_columns(uc[:, j], blk.k), _columns(ur[:, i], blk.k))
        else:
            out[name] = (_columns(sc.vectors(blk.k_in), blk.k_in), _columns(sr.vectors(blk.k_out), blk.k_out))
        sr.release()
        sc.release()
    return out


def _columns(u: np.ndarray, k: int) -> np.ndarray:
    """The first ``k`` columns of ``u``; a block given more coordinates than its eigenbasis has (proj_dim near or
    above the gradient's dimension) gets zero columns for the rest: coordinates that are always 0."""
    if u.shape[1] >= k:
        return u[:, :k]
    return np.concatenate([u, np.zeros((u.shape[0], k - u.shape[1]))], axis=1)


def eigen_energies(
    pre: KroneckerFactors, energies: dict, proj_dim: int, spectra: SpectraMemo | None = None
) -> dict[str, float]:
    """The energies of ``"kfac-eigen"``'s split of ``proj_dim`` between blocks (the factored projector's
    ``split="energy"``), from the probe's ``energies`` ({parameter name: energy}) and one checkpoint's factors.

    The Kronecker layers together get p_K = max(round(proj_dim · E_K / E), min(N_K, round(:data:`EIGEN_MAX_SHARE` ·
    proj_dim))) coordinates: their share of the probe's energy E, or, where more, the N_K largest of their K-FAC
    eigenvalues e that hold :data:`EIGEN_ENERGY_KEPT` of their sum (a layer whose coordinates concentrate its
    energy is not starved by wide layers of random sides). The group's energy is set to give it that share, and is
    spread between its layers ∝ n_ℓ, the number of layer ℓ's eigen-coordinates among the p_K of largest e/(e + λ)
    over all of them (λ = :data:`EIGEN_RANK_DAMPING` × each layer's mean e; on the layer's weight, its bias 0): the
    coordinates worth keeping are spread over the layers as the factors say, not as the gradient's energy does.
    Other parameters keep their energy. A square ``Conv1D`` (its block carries its bias) is left as the others.
    ``spectra``: keeps the factors' reductions for :func:`eigen_sides` (:class:`SpectraMemo`); the split is the same.
    A factor wider than DIRECT_MAX takes the reduction :class:`FactorSpectrum` makes, either way."""
    total = float(sum(energies.values()))
    sites = [site for site, _, _ in pre.blocks.values() if not (site.transposed and site.d_in == site.d_out)]
    group = {n for s in sites for n in (s.weight, s.bias) if n is not None}
    e_k = float(sum(v for k, v in energies.items() if k in group))
    if not sites or e_k <= 0 or total <= 0:
        return dict(energies)
    keys, owner, raw = [], [], []
    if spectra is not None:
        spectra.plan(m for site in sites for m in pre.blocks[site.name][1:])

    def values(m: np.ndarray) -> np.ndarray:  # the same computation with or without ``spectra``: the same split
        if m.shape[0] <= DIRECT_MAX:
            return _eigenvalues(m)
        spectrum = FactorSpectrum(m)
        if spectra is not None:
            spectra.keep(m, spectrum)
        return spectrum.values

    for i, site in enumerate(sites):
        _, a, s = pre.blocks[site.name]
        e = np.outer(values(s), values(a)).reshape(-1)
        lam = EIGEN_RANK_DAMPING * float(e.mean())
        keys.append(e / (e + lam) if lam > 0 else e)
        owner.append(np.full(e.size, i))
        raw.append(e)
    share = proj_dim * e_k / total
    held = np.cumsum(np.sort(np.concatenate(raw))[::-1])
    n_k = int(np.searchsorted(held, EIGEN_ENERGY_KEPT * held[-1])) + 1 if held[-1] > 0 else 0
    p_k = max(1, round(share), min(n_k, round(EIGEN_MAX_SHARE * proj_dim)))
    rest = total - e_k
    if share < p_k < proj_dim and rest > 0:  # the group's energy for its share p_K / proj_dim
        e_k = rest * p_k / (proj_dim - p_k)
    key, own = np.concatenate(keys), np.concatenate(owner)
    top = np.argsort(-key, kind="stable")[: min(p_k, key.size)]
    counts = np.bincount(own[top], minlength=len(sites))
    out = {k: float(v) for k, v in energies.items() if k not in group}
    for site, c in zip(sites, counts, strict=True):
        out[site.weight] = e_k * float(c) / float(counts.sum())
        if site.bias is not None:
            out[site.bias] = 0.0
    return out


class SidesCache:
    """The eigenbasis sides (:func:`eigen_sides`) of the last ``keep`` factor sets a process decomposed, keyed by the
    factors' digest and the blocks they project: the pipeline's worker builds a projector for every shard task of a
    checkpoint, and decomposing the factors again for each would cost more than a shard's featurizing on a GPU (and
    tens of seconds of CPU for a ResNet's 4,608² factors). Thread-safe; every caller gets the same arrays, to read."""

    def __init__(self, keep: int = 4):
        self.keep, self._lock = keep, threading.Lock()
        self._sides: OrderedDict[tuple[str, str], dict] = OrderedDict()

    def get(self, blocks, pre: KroneckerFactors, digest: str | None = None) -> dict:
        """The sides of ``pre`` for ``blocks`` (``digest``: ``pre``'s :func:`_fingerprint`, where the caller has it)."""
        key = (digest or _fingerprint(pre), repr([asdict(b) for b in blocks]))
        with self._lock:
            if key in self._sides:
                self._sides.move_to_end(key)
                return self._sides[key]
        sides = eigen_sides(blocks, pre)
        with self._lock:
            self._sides[key] = sides
            while len(self._sides) > self.keep:
                self._sides.popitem(last=False)
        return sides


#: the sides of the factors a store records, shared by this process's projectors of that store
#: (:func:`trak_core.solve.kfac_record.bind_recorded`)
RECORDED_SIDES = SidesCache()


def bind_eigen(
    projector,
    factors_of: Callable[[int], KroneckerFactors],
    cache: SidesCache | None = None,
    spectra: SpectraMemo | None = None,
) -> None:
    """Make ``projector`` (a :class:`~trak_core.projection.factored.FactoredProjector`) project the Kronecker blocks
    of each model id in the eigenbasis of the factors ``factors_of(model_id)`` gives (:func:`eigen_sides`; it
    raises when a checkpoint has none); its other blocks keep their random sides. Each model's sides are computed
    once for the factors they come from (featurizing and scoring a model decompose its factors once); with a
    ``cache``, once per process for all the projectors that share it. ``spectra``: the reductions the split made
    (:func:`eigen_energies`), used by the first sides computed and then dropped."""
    blocks = projector.layout.blocks
    memo: dict[int, tuple[str, dict]] = {}

    def sides(model_id: int) -> dict:
        nonlocal spectra
        pre = factors_of(model_id)
        key = _fingerprint(pre)
        if model_id not in memo or memo[model_id][0] != key:
            if cache is None:
                memo[model_id] = (key, eigen_sides(blocks, pre, spectra=spectra))
            else:
                memo[model_id] = (key, cache.get(blocks, pre, key))
            if spectra is not None:  # what the first sides did not take is never asked for: free it
                spectra.clear()
                spectra = None
        return memo[model_id][1]

    projector.side_override = sides


def _fingerprint(pre: KroneckerFactors) -> str:
    """A digest of the factors' matrices and damping (which factors a model's cached sides come from)."""
    h = hashlib.blake2b(repr(pre.info.get("damping")).encode(), digest_size=16)
    for name in sorted(pre.blocks):
        _, a, s = pre.blocks[name]
        h.update(name.encode())
        h.update(np.ascontiguousarray(a).tobytes())
        h.update(np.ascontiguousarray(s).tobytes())
    return h.hexdigest()


def _damped_inverse(h: np.ndarray, damping: float) -> tuple[np.ndarray, float]:
    lam = damping * float(np.trace(h)) / len(h)
    if lam <= 0:  # a block whose rows are all zero: nothing to score through it
        return np.zeros_like(h), 0.0
    return np.linalg.inv(h + lam * np.eye(len(h))), lam


def block_inverse(meta, model_id: int, pre: KroneckerFactors, xtx: np.ndarray) -> tuple[np.ndarray, dict]:
    """The block-diagonal inverse (p × p float64) of a K-FAC store's model from its factors and XᵀX (float64):
    K-FAC (or EK-FAC) blocks where a layer has factors, XᵀX blocks elsewhere (module docstring), and per block its
    kind and λ."""
    from trak_core.projection.layout import recorded_blocks

    kind = pre.info.get("kind", "kfac")
    blocks = recorded_blocks(dict(meta.projector_params))
    eigen = set(kronecker_blocks(blocks, pre)) if kind == EIGEN else set()
    proj = {} if kind == EIGEN else projected_factors(meta, model_id, pre)
    inv, per, offset = np.zeros_like(xtx), {}, 0
    damping = float(pre.info.get("damping", default_damping(kind)))
    for blk in blocks:
        sl = slice(offset, offset + blk.k)
        g = xtx[sl, sl]
        f = proj.get(blk.name, (0, None))[1]
        if blk.name in eigen:  # rows in the factors' eigenbasis: EK-FAC's diagonal, the rows' own second moments
            d = np.diag(g).copy()
            lam = damping * float(d.mean())
            inv[sl, sl] = np.diag(1.0 / (d + lam)) if lam > 0 else 0.0
            per[blk.name] = {"block": EIGEN, "lambda": lam if lam > 0 else 0.0}
        elif f is not None and np.trace(f) > 0:
            if pre.info.get("kind") == "ekfac":  # F_b's eigenbasis, the rows' own second moments as eigenvalues
                _, u = np.linalg.eigh((f + f.T) / 2)
                h = (u * ((g @ u) * u).sum(axis=0)) @ u.T  # uᵢᵀ G_b uᵢ for each eigenvector, by a GEMM
            else:
                h = f * (np.trace(g) / np.trace(f))
            inv[sl, sl], lam = _damped_inverse(h, damping)
            per[blk.name] = {"block": pre.info.get("kind", "kfac"), "lambda": lam}
        else:
            inv[sl, sl], lam = _damped_inverse(g, EMPIRICAL_DAMPING)
            per[blk.name] = {"block": "xtx", "lambda": lam}
        offset = sl.stop
    return inv, per
