"""Kronecker-factored curvature (K-FAC, and a separable eigenvalue-corrected EK-FAC) applied to each example's
per-layer gradient before the random projection (``curvature="kfac"`` / ``"ekfac"``).

The curvature
-------------
For an ``nn.Linear`` layer (weight W, d_out × d_in, and its bias) one example's gradient is the augmented
matrix G = Σ_t δ_t ãᵀ_t (d_out × (d_in [+1])), ã_t = [a_t; 1] the layer's input at position t (with a 1 for the
bias), δ_t = √r · ∂f/∂(layer output)_t, f the task's model output (TRAK's margin) and r = Q(1 − Q) the curvature
of the loss in f (:func:`trak_core.solve.damping.loss_curvature`: the same weighting as ``curvature="ggn"``, so the
factors approximate the Gauss-Newton matrix Σ r ∇f ∇fᵀ of TRAK's one Newton step; Q itself weights the scores
afterwards as in TRAK). K-FAC approximates that block's curvature by

    H ≈ S ⊗ A,   A = (1/T) Σ_{n,t} ã ãᵀ  (T positions in all),   S = (1/N) Σ_{n,t} δ δᵀ  (N examples)

(row-major vec(G); an MLP has one position per example). Each factor is damped on its own, λ = ``damping`` ×
its mean eigenvalue (kronfluence's heuristic with ``damping`` = 0.1), and the preconditioned gradient is

    G' = M_S G M_A,   M_S = (S + λ_S I)^(-1/2),   M_A = (A + λ_A I)^(-1/2),

so that ⟨G'_x, G'_y⟩ = g_xᵀ H⁻¹ g_y with H = (S + λ_S I) ⊗ (A + λ_A I). G' = Σ_t (M_S δ_t)(M_A ã_t)ᵀ stays a sum of
rank-one terms: for the factored projection, P_outᵀ G' P_in = (M_S P_out)ᵀ G (M_A P_in), i.e. preconditioning
is a change of the block's two side matrices, done once per checkpoint (:func:`preconditioned`); the fast path
and its cost per example are unchanged. Other projectors (dense, noop, sjlt) get G' computed from the
materialized per-example gradient. The scores then estimate g_testᵀ H⁻¹ g_train (JL), weighted by Q: finalize
writes the inverse c·I, c = grad_dim / the projector's scale (:func:`identity_inverse`).

EK-FAC
------
In the eigenbases S = U_S diag(s) U_Sᵀ, A = U_A diag(a) U_Aᵀ, EK-FAC replaces the products s_i a_j by the
corrected eigenvalues Λ_ij = (1/N) Σ_n (U_Sᵀ G_n U_A)²_ij (a second pass over the rows, after the first pass's
factors). The exact (Λ + λ)^(-1/2) is elementwise and breaks the rank-one form of each term. Here it is replaced
by its best *separable* fit in the log domain: log(Λ_ij + λ) ≈ α_i + β_j (least squares: row mean + column mean −
overall mean; λ = ``damping`` × mean Λ), so M_S = U_S diag(e^(−α/2)) U_Sᵀ and M_A = U_A diag(e^(−β/2)) U_Aᵀ and
the factored projection applies as for K-FAC. The fit is exact when Λ is itself a product (K-FAC's); its relative
residual is recorded per layer (``fit_residual``). Cost: the second pass materializes each example's layer
gradient in the eigenbasis (d_out·(d_in+1) per example), as kronfluence's EK-FAC does.

Layers
------
Only ``nn.Linear`` modules that are called once per forward (one use of their weight) are preconditioned. Every
other parameter in the gradient (convolutions, embeddings, attention's packed projections, norms, a Linear
used twice) keeps the identity: its coordinates enter the scores unpreconditioned, and a warning names them.

The record
----------
A fit is a pass over train rows (or a sample of them) at one checkpoint, reducible as sums
(:class:`FactorSums`). What it yields, the per-layer M_A and M_S (float64) with the damping and the rows used, is
recorded in the store's pipeline record under ``"curvature_factors"`` → model id (:func:`record_factors`), sealed
by a sha256 of its matrices. Every later step (a featurize worker, targets, the query index, rows appended to a
grown store) reads it back (:func:`load_factors`) and projects with exactly the same matrices; a store grows with
the factors it recorded (they are never refitted).
"""

from __future__ import annotations

import base64
import copy
import hashlib
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from trak_core.errors import BadInputError, StateError
from trak_core.featurize.gradients import grad_param_names

#: the curvatures of this module (``StoreMetadata.curvature``)
KFAC_CURVATURES = ("kfac", "ekfac")
#: λ of each factor = DEFAULT_DAMPING × its mean eigenvalue (kronfluence's heuristic)
DEFAULT_DAMPING = 0.1
#: the key of the store's pipeline record under which the fitted factors are kept, per model id
RECORD_KEY = "curvature_factors"


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
    """One preconditioned layer: the ``nn.Linear`` module ``name`` with its weight (and bias) parameter names."""

    name: str
    weight: str
    bias: str | None
    d_out: int
    d_in: int

    @property
    def in_rows(self) -> int:
        return self.d_in + (1 if self.bias is not None else 0)


def linear_sites(model: nn.Module, grad_wrt: Iterable[str] | None = None) -> tuple[list[Site], list[str]]:
    """(the ``nn.Linear`` layers whose weight is in the gradient, the gradient's other parameters)."""
    names = grad_param_names(model, grad_wrt)
    wanted = set(names)
    sites = []
    for mname, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        prefix = f"{mname}." if mname else ""
        w, b = prefix + "weight", prefix + "bias"
        if w not in wanted:
            continue
        bias = b if mod.bias is not None and b in wanted else None
        sites.append(Site(mname, w, bias, mod.out_features, mod.in_features))
    covered = {n for s in sites for n in (s.weight, s.bias) if n is not None}
    return sites, [n for n in names if n not in covered]


# ---------------------------------------------------------------------------------------------- the pass
@dataclass
class FactorSums:
    """Partial sums of one fit, reducible by :meth:`add` (shards, processes): Σ ããᵀ and Σ δδᵀ per layer, the
    positions and examples counted, and (EK-FAC's second pass) Σ (U_Sᵀ G U_A)²."""

    a: dict[str, np.ndarray] = field(default_factory=dict)
    s: dict[str, np.ndarray] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    examples: int = 0
    lam: dict[str, np.ndarray] = field(default_factory=dict)

    def add(self, other: FactorSums) -> FactorSums:
        for mine, theirs in ((self.a, other.a), (self.s, other.s), (self.lam, other.lam)):
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
    from trak_core.solve.damping import loss_curvature

    model, task, gc = feat.model, feat.task, feat.gradient_computer
    weights, buffers = gc._weights(), gc._buffers()
    batch = [t.to(feat.device) for t in batch]
    ctx: dict = {"e": None, "a": {}, "shapes": {}, "calls": {}}
    mods = {s.name: model.get_submodule(s.name) for s in sites}

    def make_hook(name):
        def hook(mod, inputs, output):
            ctx["calls"][name] = ctx["calls"].get(name, 0) + 1
            ctx["shapes"][name] = tuple(output.shape)
            ctx["a"][name] = inputs[0].detach()
            if ctx["e"] is not None:
                return output + ctx["e"][name]
            return output

        return hook

    handles = [m.register_forward_hook(make_hook(n)) for n, m in mods.items()]
    try:
        with torch.no_grad():  # the per-example output shapes, and the layers called exactly once
            torch.func.vmap(lambda *s: task.get_output(model, weights, buffers, *s))(*[t[:1] for t in batch])
        skipped = [s.name for s in sites if ctx["calls"].get(s.name, 0) != 1]
        used = [s for s in sites if s.name not in skipped]
        shapes = dict(ctx["shapes"])
        bsz = batch[0].shape[0]
        dt = next(iter(weights.values())).dtype
        with torch.enable_grad():
            es = {
                s.name: torch.zeros(bsz, *shapes[s.name], device=feat.device, dtype=dt, requires_grad=True)
                for s in used
            }

            def out_fn(e, *sample):
                ctx["e"] = {**{n: 0.0 for n in skipped}, **e}
                ctx["a"] = {}
                out = task.get_output(model, weights, buffers, *sample)
                return out, {s.name: ctx["a"][s.name] for s in used}

            out, acts = torch.func.vmap(out_fn)(es, *batch)
            grads = torch.autograd.grad(out.sum(), [es[s.name] for s in used], allow_unused=True)
    finally:
        ctx["e"] = None
        for h in handles:
            h.remove()
    q = gc.compute_loss_grad(batch)
    root_r = torch.from_numpy(np.sqrt(np.maximum(loss_curvature(q.detach().cpu()), 0.0))).to(feat.device)
    a_out, d_out = {}, {}
    for s, g in zip(used, grads, strict=True):
        a = acts[s.name].to(torch.float64).reshape(bsz, -1, s.d_in)
        if s.bias is not None:
            a = torch.cat([a, torch.ones(*a.shape[:2], 1, dtype=a.dtype, device=a.device)], dim=2)
        d = torch.zeros(bsz, a.shape[1], s.d_out, dtype=torch.float64, device=a.device) if g is None else g
        a_out[s.name] = a
        d_out[s.name] = d.to(torch.float64).reshape(bsz, -1, s.d_out) * root_r.reshape(bsz, 1, 1)
    return a_out, d_out, skipped


def batch_sums(feat, batch: Sequence[Tensor], sites: list[Site], bases: dict | None = None) -> tuple[FactorSums, list]:
    """One batch's :class:`FactorSums` (with ``bases`` {site: (U_S, U_A)}: EK-FAC's Σ (U_Sᵀ G_n U_A)² instead)
    and the sites left out (called other than once)."""
    a, d, skipped = _site_tensors(feat, batch, sites)
    out = FactorSums(examples=int(batch[0].shape[0]))
    for name, at in a.items():
        dt = d[name]
        if bases is None:
            out.a[name] = torch.einsum("bti,btj->ij", at, at).cpu().numpy()
            out.s[name] = torch.einsum("bto,btp->op", dt, dt).cpu().numpy()
            out.tokens[name] = int(at.shape[0] * at.shape[1])
        else:
            u_s, u_a = (torch.from_numpy(m).to(at.device) for m in bases[name][1::2])
            ds, da = dt @ u_s, at @ u_a  # rotated first: U_Sᵀ G_n U_A = Σ_t (U_Sᵀ δ_t)(U_Aᵀ ã_t)ᵀ
            if ds.shape[1] == 1:  # one position: (U_Sᵀ G U_A)² = (U_Sᵀ δ)² (U_Aᵀ ã)²ᵀ, summed by one product
                out.lam[name] = (ds[:, 0] ** 2).T.matmul(da[:, 0] ** 2).cpu().numpy()
            else:
                out.lam[name] = (torch.einsum("bto,bti->boi", ds, da) ** 2).sum(0).cpu().numpy()
    return out, skipped


# ---------------------------------------------------------------------------------------------- the solve
@dataclass
class Preconditioner:
    """The fitted curvature of one checkpoint: {site name: (Site, M_A (in_rows²), M_S (d_out²))} float64, and
    ``info`` (kind, damping, rows, λ per factor, the parameters left with the identity)."""

    blocks: dict[str, tuple[Site, np.ndarray, np.ndarray]]
    info: dict
    _cache: dict = field(default_factory=dict, repr=False)

    def tensors(self, device, dtype) -> dict[str, tuple[Site, Tensor, Tensor]]:
        key = (str(device), dtype)
        if key not in self._cache:
            self._cache[key] = {
                n: (s, torch.from_numpy(m_in).to(device, dtype), torch.from_numpy(m_out).to(device, dtype))
                for n, (s, m_in, m_out) in self.blocks.items()
            }
        return self._cache[key]


def _eig(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    e, u = np.linalg.eigh((m + m.T) / 2)
    return np.maximum(e, 0.0), u


def _inv_sqrt(e: np.ndarray, u: np.ndarray, damping: float) -> tuple[np.ndarray, float]:
    lam = damping * float(e.mean())
    if lam <= 0:  # a factor that is all zero: its layer's gradient is zero, nothing to precondition
        return np.eye(len(e)), 0.0
    return (u * (e + lam) ** -0.5) @ u.T, lam


def eigenbases(sums: FactorSums) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """{site: (eigenvalues of S, U_S, eigenvalues of A, U_A)} of the factors of ``sums``."""
    out = {}
    for name in sums.a:
        e_a, u_a = _eig(sums.a[name] / max(1, sums.tokens[name]))
        e_s, u_s = _eig(sums.s[name] / max(1, sums.examples))
        out[name] = (e_s, u_s, e_a, u_a)
    return out


def solve_factors(
    sums: FactorSums,
    sites: list[Site],
    kind: str = "kfac",
    damping: float = DEFAULT_DAMPING,
    identity=(),
    bases: dict | None = None,
) -> Preconditioner:
    """The :class:`Preconditioner` of reduced ``sums`` (``kind`` "ekfac": with its second pass's ``lam`` sums;
    ``bases``: their :func:`eigenbases`, when computed already)."""
    if kind not in KFAC_CURVATURES:
        raise BadInputError(f"curvature={kind!r}: expected one of {KFAC_CURVATURES}")
    damping = check_damping(damping)
    blocks, per = {}, {}
    by_name = {s.name: s for s in sites}
    bases = eigenbases(sums) if bases is None else bases
    for name in sums.a:
        site = by_name[name]
        e_s, u_s, e_a, u_a = bases[name]
        if kind == "kfac":
            m_in, lam_a = _inv_sqrt(e_a, u_a, damping)
            m_out, lam_s = _inv_sqrt(e_s, u_s, damping)
            per[name] = {"lambda_in": lam_a, "lambda_out": lam_s}
        else:
            corrected = sums.lam[name] / max(1, sums.examples)
            lam = damping * float(corrected.mean())
            if lam <= 0:
                m_in, m_out = np.eye(site.in_rows), np.eye(site.d_out)
                per[name] = {"lambda": 0.0, "fit_residual": 0.0}
            else:
                logs = np.log(corrected + lam)
                mu = float(logs.mean())
                alpha = logs.mean(axis=1) - mu / 2
                beta = logs.mean(axis=0) - mu / 2
                fit = alpha[:, None] + beta[None, :]
                resid = float(np.linalg.norm(logs - fit)) / max(float(np.linalg.norm(logs - mu)), 1e-300)
                m_out = (u_s * np.exp(-alpha / 2)) @ u_s.T
                m_in = (u_a * np.exp(-beta / 2)) @ u_a.T
                per[name] = {"lambda": lam, "fit_residual": resid}
        blocks[name] = (site, m_in, m_out)
    info = {"kind": kind, "damping": damping, "rows": int(sums.examples), "layers": per, "identity": sorted(identity)}
    return Preconditioner(blocks, info)


def fit_factors(
    feat,
    batches: Callable[[], Iterable[Sequence[Tensor]]],
    kind: str = "kfac",
    damping: float = DEFAULT_DAMPING,
    grad_wrt: Iterable[str] | None = None,
    warn: bool = True,
) -> Preconditioner:
    """Fit the curvature of ``feat``'s current checkpoint over the train rows ``batches()`` yields (called once,
    twice for EK-FAC): forward + backward of the task's output, no per-example gradient (EK-FAC's second pass
    forms each example's layer gradient in the eigenbasis). Parameters other than single-use ``nn.Linear`` layers
    keep the identity (a warning names them)."""
    if kind not in KFAC_CURVATURES:
        raise BadInputError(f"curvature={kind!r}: expected one of {KFAC_CURVATURES}")
    damping = check_damping(damping)
    sites, others = linear_sites(feat.model, grad_wrt)
    total, skipped = FactorSums(), set()
    for batch in batches():
        part, left = batch_sums(feat, batch, sites)
        total.add(part)
        skipped.update(left)
    if total.examples == 0:
        raise BadInputError("curvature: the factor pass was given no train rows")
    used = [s for s in sites if s.name not in skipped]
    bases = eigenbases(total)
    if kind == "ekfac":
        for batch in batches():
            part, _ = batch_sums(feat, batch, used, bases)
            part.examples = 0  # (the examples were counted by the first pass)
            total.add(part)
    identity = list(others) + [n for s in sites if s.name in skipped for n in (s.weight, s.bias) if n]
    if identity and warn:
        warnings.warn(
            f"curvature={kind!r}: only nn.Linear layers called once per forward are preconditioned; parameters "
            f"{identity[:10]}{' and more' if len(identity) > 10 else ''} keep the identity (their gradient enters "
            "the scores unpreconditioned)",
            stacklevel=2,
        )
    return solve_factors(total, used, kind, damping, identity, bases)


# ---------------------------------------------------------------------------------------------- application
def precondition_grads(grads: dict[str, Tensor], pre: Preconditioner) -> dict[str, Tensor]:
    """Per-example gradients {param: (B, *shape)} with each preconditioned layer's G replaced by M_S G M_A."""
    out = dict(grads)
    any_grad = next(iter(grads.values()))
    for _, (site, m_in, m_out) in pre.tensors(any_grad.device, any_grad.dtype).items():
        w = grads[site.weight]
        bsz = w.shape[0]
        g = w.reshape(bsz, site.d_out, site.d_in)
        if site.bias is not None:
            g = torch.cat([g, grads[site.bias].reshape(bsz, site.d_out, 1)], dim=2)
        g = m_out @ g @ m_in
        out[site.weight] = g[:, :, : site.d_in].reshape(w.shape)
        if site.bias is not None:
            out[site.bias] = g[:, :, site.d_in].reshape(grads[site.bias].shape)
    return out


class _Preconditioned:
    """A projector of materialized gradients that preconditions them first (dense, noop, sjlt, a flat layout)."""

    def __init__(self, inner, pre: Preconditioner) -> None:
        self.inner, self.pre = inner, pre
        self.grad_dim, self.proj_dim, self.kind = inner.grad_dim, inner.proj_dim, inner.kind

    def project(self, grads, model_id: int) -> Tensor:
        if not isinstance(grads, dict):
            raise BadInputError("curvature: preconditioning needs the per-example gradients by parameter name")
        return self.inner.project(precondition_grads(grads, self.pre), model_id)

    @property
    def scale(self) -> float:
        return self.inner.scale

    def spec(self) -> dict:
        return self.inner.spec()


def preconditioned(projector, model_id: int, pre: Preconditioner | None):
    """``projector`` with ``pre`` applied before it, for ``model_id``: a factored projector bound to a model gets
    its linear blocks' side matrices replaced by M_A P_in and M_S P_out (the fast path unchanged), any other
    projects preconditioned materialized gradients. None: the projector itself."""
    if pre is None:
        return projector
    from trak_core.projection.factored import FactoredProjector

    if isinstance(projector, FactoredProjector) and projector.layout.model_bound:
        raw = projector.factors(model_id)
        facs = dict(raw)
        for b in projector.layout.blocks:
            entry = pre.blocks.get(b.name)
            if entry is None or b.kind != "linear":
                continue
            site, m_in, m_out = entry
            if site.in_rows != b.in_rows or site.d_out != b.d_out:
                continue
            p_in, p_out, w = raw[b.name]
            dt = p_in.dtype
            m_in_t = torch.from_numpy(m_in).to(p_in.device, torch.float64)
            m_out_t = torch.from_numpy(m_out).to(p_in.device, torch.float64)
            facs[b.name] = ((m_in_t @ p_in.double()).to(dt), (m_out_t @ p_out.double()).to(dt), w)
        clone = copy.copy(projector)
        clone._factors = (model_id, facs)
        return clone
    return _Preconditioned(projector, pre)


def identity_inverse(grad_dim: int, proj_dim: int, scale: float) -> tuple[np.ndarray, float]:
    """(c·I (p × p) float32, c) with c = grad_dim / scale: X c Xᵀ = (P G')(P G')ᵀ / scale ≈ g_xᵀ H⁻¹ g_y (the rows X
    are normalized by √grad_dim; E⟨Px, Py⟩ = scale·⟨x, y⟩)."""
    c = float(grad_dim) / float(scale)
    return (np.eye(proj_dim, dtype=np.float64) * c).astype(np.float32), c


# ---------------------------------------------------------------------------------------------- the record
def _encode(m: np.ndarray) -> dict:
    m = np.ascontiguousarray(m, dtype="<f8")
    return {"shape": list(m.shape), "data": base64.b64encode(m.tobytes()).decode("ascii")}


def _decode(d: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["data"]), dtype="<f8").reshape(d["shape"]).copy()


def _digest(blocks: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(blocks):
        h.update(name.encode())
        for part in ("m_in", "m_out"):
            h.update(blocks[name][part]["data"].encode())
    return h.hexdigest()


def to_record(pre: Preconditioner) -> dict:
    blocks = {
        n: {
            "weight": s.weight,
            "bias": s.bias,
            "d_out": s.d_out,
            "d_in": s.d_in,
            "m_in": _encode(mi),
            "m_out": _encode(mo),
        }
        for n, (s, mi, mo) in pre.blocks.items()
    }
    return {**pre.info, "blocks": blocks, "sha256": _digest(blocks)}


def from_record(rec: dict, where: str = "") -> Preconditioner:
    blocks = rec.get("blocks", {})
    if _digest(blocks) != rec.get("sha256"):
        from trak_core.errors import StoreDamageError

        raise StoreDamageError(f"curvature factors{where}: their record does not match its sha256 (damaged)")
    out = {}
    for n, b in blocks.items():
        site = Site(n, b["weight"], b["bias"], int(b["d_out"]), int(b["d_in"]))
        out[n] = (site, _decode(b["m_in"]), _decode(b["m_out"]))
    info = {k: v for k, v in rec.items() if k not in ("blocks", "sha256")}
    return Preconditioner(out, info)


def has_factors(store, model_id: int) -> bool:
    return str(int(model_id)) in store.pipeline_info().get(RECORD_KEY, {})


def _checkpoint_of(store, model_id: int) -> str | None:
    """The state digest of ``model_id``'s recorded checkpoint (None: none recorded)."""
    rec = store.checkpoint_record(model_id) if store.has_model(model_id) else None
    return None if rec is None else rec.get("state_sha256")


def record_factors(store, model_id: int, pre: Preconditioner, replace: bool = False) -> None:
    """Record ``pre`` as ``model_id``'s factors in the store's pipeline record, with the digest of the checkpoint the
    store records for it; a model that has factors keeps them (StateError when they differ: a store never mixes two
    fits) unless ``replace`` (a model started over, no row featurized with the old ones)."""
    info = store.pipeline_info()
    factors = dict(info.get(RECORD_KEY, {}))
    pre.info["checkpoint"] = _checkpoint_of(store, model_id)
    rec = to_record(pre)
    old = factors.get(str(int(model_id)))
    if old is not None and not replace:
        if old.get("sha256") != rec["sha256"]:
            raise StateError(
                f"model_id={model_id}: {store.location} holds curvature factors fitted before; a store keeps the "
                "factors it recorded (use a new store to fit them again)"
            )
        return
    factors[str(int(model_id))] = rec
    info[RECORD_KEY] = factors
    store.set_pipeline_info(info)


def load_factors(store, model_id: int) -> Preconditioner:
    """``model_id``'s recorded factors, or StateError saying to fit them first."""
    rec = store.pipeline_info().get(RECORD_KEY, {}).get(str(int(model_id)))
    if rec is None:
        raise StateError(
            f"model_id={model_id}: the store at {store.location} has curvature={store.meta.curvature!r} but no fitted "
            "factors for this checkpoint; fit them before featurizing (TRAKer.fit_curvature, or the pipeline's "
            "fit step)"
        )
    return from_record(rec, f" of model_id={model_id}")


def recorded_factors(store, model_id: int) -> Preconditioner | None:
    """``model_id``'s recorded factors (None: none recorded)."""
    return load_factors(store, model_id) if has_factors(store, model_id) else None


def wants_factors(store, model_id: int) -> bool:
    """Whether the store's curvature is Kronecker-factored and ``model_id`` has no factors recorded yet (the fit
    step has work to do)."""
    return store.meta.curvature in KFAC_CURVATURES and not has_factors(store, model_id)


class StoreFactors:
    """``feat.curvature``: model id → the store's recorded :class:`Preconditioner` (cached), for a featurizer."""

    def __init__(self, store) -> None:
        self.store = store
        self.cache: dict[int, Preconditioner] = {}

    def __call__(self, model_id: int) -> Preconditioner:
        if model_id not in self.cache:
            self.cache[model_id] = load_factors(self.store, model_id)
        return self.cache[model_id]


def bind(feat, store):
    """``feat`` reading its curvature from ``store`` when the store's curvature is K-FAC's (else unchanged)."""
    if store.meta.curvature in KFAC_CURVATURES and getattr(feat, "curvature", None) is None:
        feat.curvature = StoreFactors(store)
    return feat


def finalize_inverse(meta, rule, rescale: bool) -> tuple[np.ndarray, dict]:
    """Finalize of a K-FAC store: the rows are preconditioned already, so the inverse is c·I
    (:func:`identity_inverse`; ``lambda_reg`` and ``rescale_inverse`` are recorded, not applied)."""
    from trak_core.projection.projectors import projector_traits

    scale = 1.0 if projector_traits(meta.projector).is_identity else float(meta.proj_dim)
    inv, c = identity_inverse(meta.grad_dim, meta.proj_dim, scale)
    info = {
        "curvature": meta.curvature,
        "lambda_reg": 0.0,
        "lambda_setting": rule.setting,
        "rescale": bool(rescale),
        "inverse_scale": c,
    }
    return inv, info


def fit_step(store, model_id: int, feat, batches, damping=DEFAULT_DAMPING, grad_wrt=None) -> Preconditioner | None:
    """Fit and record ``model_id``'s factors in a store of K-FAC curvature (None for another curvature); a model
    with recorded factors keeps them (read back); one with featurized rows but no factors is refused."""
    if store.meta.curvature not in KFAC_CURVATURES:
        return None
    featurized = store.has_model(model_id) and bool(store.featurized_mask(model_id).any())
    stale = False
    if has_factors(store, model_id):
        pre = load_factors(store, model_id)
        if pre.info.get("checkpoint") == _checkpoint_of(store, model_id):
            return pre
        stale = True  # fitted at another checkpoint (the model was started over)
    if featurized:
        what = "factors fitted at another checkpoint" if stale else "no curvature factors"
        raise StateError(f"model_id={model_id}: {store.location} holds featurized rows and {what}; use a new store")
    pre = fit_factors(feat, batches, store.meta.curvature, damping, grad_wrt)
    record_factors(store, model_id, pre, replace=stale)
    return pre
