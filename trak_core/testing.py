"""The contracts of projectors, model outputs and stores as check functions you can run on your own ones.

scikit-learn's ``check_estimator`` for trakflow: every projector we ship and every model output class is
checked by these same functions (``tests/trak_core/test_projector_contract.py``); a projector or a model output you
write passes them before the pipeline uses it. Each check raises :class:`AssertionError` whose message
starts with the check's name and says what failed. pytest is not needed to import this module (only
:func:`parametrize_with_checks` imports it, lazily).

Run all checks at once::

    from trak_core.testing import check_projector, check_model_output

    check_projector(lambda seed=0: MyProjector(grad_dim=1000, proj_dim=256, seed=seed))
    check_model_output(MyModelOutput(), model, (inputs, labels))

or one pytest test per (object, check), with readable ids (``dense-check_projector_batch_split``)::

    from trak_core.testing import ModelOutputCase, ProjectorCase, parametrize_with_checks

    @parametrize_with_checks([
        ProjectorCase(lambda seed=0: MyProjector(1000, 256, seed=seed), id="mine"),
        ModelOutputCase(MyModelOutput(), model, (inputs, labels), id="my-task",
                        reference=lambda model, batch: my_plain_forward_output(model, batch)),
    ])
    def test_contract(obj, check):
        check(obj)

A projector is given as an instance, or better as a factory: a callable returning a fresh instance, which
may take ``seed=`` (the checks then build a fresh instance where the contract speaks of "another process",
and a reseeded one to see that the seed changes the matrix).

The projector contract (:mod:`trak_core.projection.projectors`): ``project(grads, model_id)`` maps (B, grad_dim)
gradients — or a dict of (B, *shape) pieces in vector order — to (B, proj_dim) in the projector's dtype;
the result for one example depends only on (seed, model_id, grad_dim, proj_dim, kind) and that example
(any batch, batch split or fresh instance; bit-identical for identical batches); E⟨Px, Py⟩ = scale·⟨x, y⟩;
a gradient of the wrong shape is refused with :class:`~trak_core.errors.BadInputError` naming grad_dim;
``spec()`` identifies the projection; ``free_memory()`` drops caches without changing results.

The model output contract (:mod:`trak_core.featurize.modelout`): ``validate_batch`` accepts good batches and refuses
malformed ones with BadInputError; ``get_output(model, weights, buffers, *sample)`` on one example (no batch
dimension) is a finite scalar computed from the ``weights``/``buffers`` it is given (``torch.func`` calls it
with other tensors than the module's own) and vmaps over a batch as a loop over its examples would
(values and gradients); ``get_out_to_loss_grad`` gives one finite Q per example, (B,) or (B, 1). Outputs
for :class:`~trak_core.featurize.gradients.IterativeGradientComputer` (``batched_output=True``) take the whole batch
and use the module's own parameters: one finite output per example, each depending on its own example
only. With ``reference=`` the output must equal a plain forward-pass computation of f.

The store contract (:class:`~trak_core.store.RunStore`), checked by :func:`check_store` or one test per check
with :class:`StoreCase`: rows, targets and scores read back as written (in the store's dtype), flags follow their
rows, unfinished results (an inverse before finalize, scores with rows not done) are refused, rows read by path and
score pieces written then marked. :class:`MemoryStore` is a second backend that passes it: a store in this process's
memory (numpy arrays) at a :func:`memory_location`, opened by the same factory, on which TRAKer, the pipeline and the
index give the Zarr store's scores bit for bit.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trak_core.projection.projectors import AbstractProjector, projector_traits

from .checks import _check
from .errors import BadInputError

__all__ = [
    "ProjectorCase",
    "ModelOutputCase",
    "StoreCase",
    "MemoryStore",
    "memory_location",
    "check_projector",
    "check_model_output",
    "check_store",
    "projector_checks",
    "model_output_checks",
    "store_checks",
    "parametrize_with_checks",
    "iter_checks",
]


# ---------------------------------------------------------------------------------------------- cases
@dataclass
class ProjectorCase:
    """A projector to check: ``factory`` (a callable returning a fresh projector, optionally taking
    ``seed=``) or an instance. ``rtol``/``atol``: the tolerance of results that the contract says agree up
    to float rounding (batch splits, dict vs flat input). ``marks``: pytest marks of its tests (e.g. a
    ``skipif`` without a GPU)."""

    factory: Any
    id: str | None = None
    rtol: float = 1e-5
    atol: float = 1e-4
    marks: Any = ()

    def make(self, seed: int | None = None) -> AbstractProjector | None:
        """A fresh projector (the instance itself when given one), reseeded when ``seed`` is given (None
        where it cannot be)."""
        f = self.factory
        if isinstance(f, AbstractProjector):
            if seed is None:
                return f
            try:  # the traker-compatible constructor
                return type(f)(f.grad_dim, f.proj_dim, seed=seed, proj_type=f.proj_type, device=f.device)
            except Exception:
                return None
        if seed is None:
            return f()
        try:
            params = inspect.signature(f).parameters
        except (TypeError, ValueError):
            return None
        if "seed" in params or any(p.kind == p.VAR_KEYWORD for p in params.values()):
            return f(seed=seed)
        return None

    @property
    def name(self) -> str:
        if self.id:
            return self.id
        f = self.factory
        if isinstance(f, AbstractProjector):
            return type(f).__name__
        return getattr(f, "__name__", type(f).__name__).replace("<lambda>", "projector")


@dataclass
class ModelOutputCase:
    """A model output to check on ``model`` and a good ``batch`` (at least 2 examples).

    ``reference(model, batch) -> (B,)``: f computed with a plain forward pass of the model (optional; the
    output must agree with it). ``bad_batches``: more malformed batches that ``validate_batch`` must refuse
    (beside the generic ones: not a sequence, mixed batch sizes, empty). ``batched_output``: ``get_output``
    takes the whole batch (the loop gradient computer's contract). ``setup``: called before every check
    (e.g. to set class-level state such as CLIP's embeddings). ``rtol``/``atol``: tolerance of the
    comparisons (use float64 models and batches for tight ones).
    """

    model_output: Any
    model: torch.nn.Module
    batch: Sequence[Tensor]
    id: str | None = None
    reference: Callable[[torch.nn.Module, Sequence[Tensor]], Tensor] | None = None
    bad_batches: Sequence[Sequence[Tensor]] = ()
    batched_output: bool = False
    setup: Callable[[], None] | None = None
    rtol: float = 1e-6
    atol: float = 1e-8
    marks: Any = ()

    @property
    def name(self) -> str:
        return self.id or type(self.model_output).__name__


def _as_projector_case(obj) -> ProjectorCase:
    if isinstance(obj, ProjectorCase):
        return obj
    if isinstance(obj, AbstractProjector) or callable(obj):
        return ProjectorCase(obj)
    raise TypeError(f"not a projector, a projector factory or a ProjectorCase: {type(obj).__name__}")


# ---------------------------------------------------------------------------------------------- helpers
def _grads(batch: int, grad_dim: int, seed: int = 0) -> Tensor:
    return torch.randn(batch, grad_dim, generator=torch.Generator().manual_seed(seed))


def _project(p: AbstractProjector, grads, model_id: int) -> Tensor:
    out = p.project(grads, model_id)
    assert isinstance(out, Tensor), f"project() returned {type(out).__name__}, not a tensor"
    return out.detach().cpu()


def _close(got: Tensor, want: Tensor, rtol: float, atol: float, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    g, w = got.double(), want.double()
    bad = ~torch.isclose(g, w, rtol=rtol, atol=atol)
    if bool(bad.any()):
        idx = bad.nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} entries differ (max |diff| "
            f"{float((g - w).abs().max()):.3g}; first at {idx}: {float(g[tuple(idx)]):.6g} vs "
            f"{float(w[tuple(idx)]):.6g}; rtol={rtol}, atol={atol})"
        )


def _projector(case: ProjectorCase) -> AbstractProjector:
    p = case.make()
    assert isinstance(p, AbstractProjector), f"the factory returned {type(p).__name__}, not an AbstractProjector"
    assert isinstance(p.grad_dim, int) and p.grad_dim > 0, (
        f"grad_dim must be a positive int to check the projector, got {p.grad_dim!r}"
    )
    return p


# ---------------------------------------------------------------------------------------------- projector checks
@_check
def check_projector_shape_and_dtype(obj) -> None:
    """(B, grad_dim) → (B, proj_dim) in the projector's dtype (float32 unless it says otherwise)."""
    case = _as_projector_case(obj)
    p = _projector(case)
    out = p.project(_grads(5, p.grad_dim), model_id=0)
    assert tuple(out.shape) == (5, p.proj_dim), f"output shape {tuple(out.shape)}, expected (5, {p.proj_dim})"
    want = getattr(p, "dtype", torch.float32)
    assert out.dtype == want, f"output dtype {out.dtype}, expected {want}"
    assert bool(torch.isfinite(out).all()), "non-finite values in the projection of finite gradients"


@_check
def check_projector_batch_split(obj) -> None:
    """An example gets the same vector in any batch (splits of 1, 16 and 23) and from a fresh instance;
    identical batches give bit-identical results."""
    case = _as_projector_case(obj)
    p = _projector(case)
    g = _grads(40, p.grad_dim)
    whole = _project(p, g, 1)
    parts = torch.cat([_project(_projector(case), g[a:b], 1) for a, b in [(0, 1), (1, 17), (17, 40)]])
    _close(
        parts,
        whole,
        case.rtol,
        case.atol,
        "the projection depends on the batch (batches 0:1, 1:17, 17:40 vs one batch of 40)",
    )
    again = _project(_projector(case), g, 1)
    assert torch.equal(again, whole), (
        "the same batch projected twice (a fresh instance) is not bit-identical: "
        f"max |diff| {float((again - whole).abs().max()):.3g}"
    )


@_check
def check_projector_dict_input(obj) -> None:
    """A dict {name: (B, *shape)} whose pieces make up the gradient vector (in order) projects as the
    flat (B, grad_dim) tensor."""
    case = _as_projector_case(obj)
    p = _projector(case)
    n = p.grad_dim
    g = _grads(6, n, seed=1)
    k = max(1, (3 * n) // 5) if n > 1 else 1
    rows = max(d for d in range(1, math.isqrt(k) + 1) if k % d == 0)
    d = {"a.weight": g[:, :k].reshape(6, rows, k // rows)}
    if k < n:
        d["a.bias"] = g[:, k:]
    _close(
        _project(p, d, 2),
        _project(p, g, 2),
        case.rtol,
        case.atol,
        f"dict input {{name: shape}} = {{{', '.join(f'{a}: {tuple(v.shape[1:])}' for a, v in d.items())}}} "
        "does not project as the flat tensor",
    )


@_check
def check_projector_randomness(obj) -> None:
    """model_id and seed change the matrix (skipped for the identity, a kind whose registry traits say so)."""
    case = _as_projector_case(obj)
    p = _projector(case)
    if projector_traits(getattr(p, "kind", "")).is_identity:
        return
    g = _grads(4, p.grad_dim, seed=2)
    a = _project(p, g, 0)
    assert not torch.allclose(a, _project(p, g, 1)), "model_id 0 and 1 give the same projection"
    other = case.make(seed=int(p.seed) + 1)
    if other is not None:
        assert int(other.seed) != int(p.seed), "the factory ignores seed="
        assert not torch.allclose(a, _project(other, g, 0)), f"seed {p.seed} and {other.seed} give the same projection"


@_check
def check_projector_inner_products(obj) -> None:
    """JL: ⟨Px, Py⟩ / scale ≈ ⟨x, y⟩ (30 Gaussian vectors; max error < 6/√proj_dim, mean < 1.5/√proj_dim,
    relative to the norms)."""
    case = _as_projector_case(obj)
    p = _projector(case)
    g = _grads(30, p.grad_dim, seed=5)
    out = _project(p, g, 0).double()
    scale = float(p.scale)
    assert scale > 0 and math.isfinite(scale), f"scale must be a positive number, got {scale!r}"
    ip = (out @ out.T) / scale
    ref = g.double() @ g.double().T
    norms = ref.diagonal().sqrt()
    err = ((ip - ref) / (norms[:, None] * norms[None, :])).abs()
    k = math.sqrt(p.proj_dim)
    assert float(err.max()) < 6 / k, (
        f"max relative inner-product error {float(err.max()):.3g} ≥ 6/√proj_dim = {6 / k:.3g}"
    )
    assert float(err.mean()) < 1.5 / k, (
        f"mean relative inner-product error {float(err.mean()):.3g} ≥ 1.5/√proj_dim = {1.5 / k:.3g} (is scale right?)"
    )


@_check
def check_projector_refuses_bad_input(obj) -> None:
    """Gradients of the wrong width or rank are refused with BadInputError (the message names grad_dim)."""
    case = _as_projector_case(obj)
    p = _projector(case)
    for bad, what in (
        (torch.zeros(3, p.grad_dim + 1), f"shape (3, {p.grad_dim + 1})"),
        (torch.zeros(p.grad_dim), f"a 1-d tensor of shape ({p.grad_dim},)"),
    ):
        try:
            p.project(bad, 0)
        except BadInputError as e:
            if what.startswith("shape"):
                assert "grad_dim" in str(e), f"the BadInputError for {what} does not name grad_dim: {e}"
            continue
        except Exception as e:
            raise AssertionError(f"gradients of {what} raised {type(e).__name__} ({e}), not BadInputError") from e
        raise AssertionError(f"gradients of {what} were accepted (grad_dim={p.grad_dim})")


@_check
def check_projector_spec(obj) -> None:
    """spec() names kind, proj_type, seed, grad_dim, proj_dim, is JSON (it goes into the store's metadata)
    and is the same for a fresh instance."""
    case = _as_projector_case(obj)
    p = _projector(case)
    spec = p.spec()
    missing = [k for k in ("kind", "proj_type", "seed", "grad_dim", "proj_dim") if k not in spec]
    assert not missing, f"spec() lacks {missing}: {spec}"
    assert (spec["grad_dim"], spec["proj_dim"]) == (p.grad_dim, p.proj_dim), (
        f"spec() disagrees with the projector: {spec}"
    )
    try:
        json.dumps(spec)
    except TypeError as e:
        raise AssertionError(f"spec() is not JSON-serializable ({e}): {spec}") from None
    assert _projector(case).spec() == spec, "a fresh instance has another spec()"


@_check
def check_projector_free_memory(obj) -> None:
    """free_memory() drops caches, not results."""
    case = _as_projector_case(obj)
    p = _projector(case)
    g = _grads(3, p.grad_dim, seed=3)
    before = _project(p, g, 0)
    p.free_memory()
    after = _project(p, g, 0)
    assert torch.equal(before, after), "the projection changed after free_memory()"


PROJECTOR_CHECKS = (
    check_projector_shape_and_dtype,
    check_projector_batch_split,
    check_projector_dict_input,
    check_projector_randomness,
    check_projector_inner_products,
    check_projector_refuses_bad_input,
    check_projector_spec,
    check_projector_free_memory,
)


def projector_checks() -> tuple:
    """The projector checks, each ``check(projector_or_factory_or_case)``."""
    return PROJECTOR_CHECKS


def check_projector(
    projector_factory_or_instance, *, checks: Sequence[Callable] | None = None, rtol: float = 1e-5, atol: float = 1e-4
) -> None:
    """Run every projector check (or ``checks``) on a projector, a factory of projectors (a callable,
    optionally taking ``seed=``) or a :class:`ProjectorCase`; the first failure raises AssertionError."""
    case = projector_factory_or_instance
    if not isinstance(case, ProjectorCase):
        case = ProjectorCase(case, rtol=rtol, atol=atol)
    for check in checks or PROJECTOR_CHECKS:
        check(case)


# ---------------------------------------------------------------------------------------------- model output checks
def _mo_case(obj) -> ModelOutputCase:
    if not isinstance(obj, ModelOutputCase):
        raise TypeError(f"model output checks take a ModelOutputCase, got {type(obj).__name__}")
    if obj.setup is not None:
        obj.setup()
    return obj


def _state(model):
    return ({n: p.detach() for n, p in model.named_parameters()}, {n: b.detach() for n, b in model.named_buffers()})


def _example(batch, i: int) -> list:
    return [x[i] for x in batch]


def _bsize(batch) -> int:
    return int(batch[0].shape[0])


def _get_outputs(case: ModelOutputCase, batch) -> Tensor:
    """f for every example of ``batch``, shape (B,) (a loop over examples for per-example outputs)."""
    mo, model = case.model_output, case.model
    if case.batched_output:
        return mo.get_output(model, None, None, *batch)
    w, b = _state(model)
    return torch.stack([mo.get_output(model, w, b, *_example(batch, i)) for i in range(_bsize(batch))])


@_check
def check_model_output_validate_batch(obj) -> None:
    """validate_batch accepts the good batch and refuses (BadInputError) a bare tensor, elements with
    different batch sizes, an empty batch and the case's bad_batches."""
    case = _mo_case(obj)
    mo, batch = case.model_output, case.batch
    assert _bsize(batch) >= 2, "the case's batch needs at least 2 examples"
    try:
        mo.validate_batch(batch)
    except Exception as e:
        raise AssertionError(f"the good batch is refused: {type(e).__name__}: {e}") from e
    bad = [
        ("a bare tensor instead of a sequence of tensors", batch[0]),
        (
            "elements with different batch sizes",
            [batch[0][:-1], *batch[1:]] if len(batch) > 1 else [batch[0], batch[0][:-1]],
        ),
        ("an empty batch (batch size 0)", [x[:0] for x in batch]),
    ]
    bad += [(f"bad_batches[{i}]", b) for i, b in enumerate(case.bad_batches)]
    for what, b in bad:
        try:
            mo.validate_batch(b)
        except BadInputError:
            continue
        except Exception as e:
            raise AssertionError(f"{what}: validate_batch raised {type(e).__name__} ({e}), not BadInputError") from e
        raise AssertionError(f"{what}: validate_batch accepted it")


@_check
def check_model_output_output(obj) -> None:
    """get_output gives one finite output per example: a 0-d tensor for one example (per-example
    outputs), shape (B,) for the batch (batched outputs)."""
    case = _mo_case(obj)
    mo, model, batch = case.model_output, case.model, case.batch
    n = _bsize(batch)
    if case.batched_output:
        out = mo.get_output(model, None, None, *batch)
        assert isinstance(out, Tensor) and tuple(out.shape) == (n,), (
            f"get_output on the batch returned shape {tuple(getattr(out, 'shape', ()))}, expected ({n},)"
        )
    else:
        w, b = _state(model)
        out = mo.get_output(model, w, b, *_example(batch, 0))
        assert isinstance(out, Tensor) and out.dim() == 0, (
            f"get_output on one example returned {tuple(getattr(out, 'shape', ()))}, expected a scalar (0-d) tensor"
        )
        out = _get_outputs(case, batch)
    assert out.is_floating_point(), f"get_output returned dtype {out.dtype}"
    assert bool(torch.isfinite(out).all()), f"get_output returned non-finite values {out.tolist()}"


@_check
def check_model_output_uses_weights(obj) -> None:
    """The output is computed from the weights it is given (per-example outputs: ``functional_call`` with
    ``weights``/``buffers``, not the module's own parameters; batched: the module's parameters): its
    gradient is finite and not zero, and other weights give another output."""
    case = _mo_case(obj)
    mo, model, batch = case.model_output, case.model, case.batch
    if case.batched_output:
        params = [p for p in model.parameters() if p.requires_grad]
        with torch.enable_grad():
            out = mo.get_output(model, None, None, *batch)
            grads = torch.autograd.grad(out.sum(), params, allow_unused=True)
        flat = torch.cat(
            [(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params, strict=True)]
        )
    else:
        w, b = _state(model)
        sample = _example(batch, 0)
        grads = torch.func.grad(lambda ww: mo.get_output(model, ww, b, *sample))(w)
        flat = torch.cat([g.reshape(-1) for g in grads.values()]) if grads else torch.zeros(0)
        shifted = {n: p + 0.1 * torch.ones_like(p) if p.is_floating_point() else p for n, p in w.items()}
        f0 = mo.get_output(model, w, b, *sample)
        f1 = mo.get_output(model, shifted, b, *sample)
        assert not torch.equal(f0, f1), (
            "get_output gives the same value for other weights: it does not use the "
            "weights it is given (call the model with "
            "torch.func.functional_call(model, (weights, buffers), ...))"
        )
    assert bool(torch.isfinite(flat).all()), "the gradient of the output has non-finite entries"
    assert bool((flat != 0).any()), "the gradient of the output w.r.t. the weights is zero"


@_check
def check_model_output_batch_independent(obj) -> None:
    """Each example's output and gradient depend on that example only: vmap(grad(get_output)) over the
    batch equals a loop over its examples (per-example outputs; what FunctionalGradientComputer runs), the
    batch's outputs equal those of one-example batches (batched outputs)."""
    case = _mo_case(obj)
    mo, model, batch = case.model_output, case.model, case.batch
    n = _bsize(batch)
    if case.batched_output:
        whole = mo.get_output(model, None, None, *batch).detach()
        single = torch.cat(
            [mo.get_output(model, None, None, *[x[i : i + 1] for x in batch]).detach().reshape(-1) for i in range(n)]
        )
        _close(whole, single, case.rtol, case.atol, "outputs of the batch vs one-example batches")
        return
    w, b = _state(model)

    def f(ww, *sample):
        return mo.get_output(model, ww, b, *sample)

    vals = torch.func.vmap(f, in_dims=(None, *([0] * len(batch))), randomness="different")(w, *batch)
    loop = _get_outputs(case, batch).detach()
    _close(vals.detach().reshape(-1), loop, case.rtol, case.atol, "vmapped outputs vs a loop over examples")
    vgrads = torch.func.vmap(torch.func.grad(f), in_dims=(None, *([0] * len(batch))), randomness="different")(w, *batch)
    for i in range(n):
        gi = torch.func.grad(f)(w, *_example(batch, i))
        for name in w:
            _close(
                vgrads[name][i],
                gi[name],
                case.rtol,
                case.atol,
                f"vmapped gradient vs the gradient of example {i} alone (parameter {name!r})",
            )


@_check
def check_model_output_out_to_loss_grad(obj) -> None:
    """get_out_to_loss_grad(model, weights, buffers, batch) gives one finite Q per example, (B,) or (B, 1)."""
    case = _mo_case(obj)
    mo, model, batch = case.model_output, case.model, case.batch
    n = _bsize(batch)
    w, b = _state(model)
    with torch.no_grad():
        q = mo.get_out_to_loss_grad(model, w, b, batch)
    assert isinstance(q, Tensor) and tuple(q.shape) in ((n,), (n, 1)), (
        f"Q has shape {tuple(getattr(q, 'shape', ()))}, expected ({n},) or ({n}, 1)"
    )
    assert bool(torch.isfinite(q).all()), f"Q has non-finite values {q.reshape(-1).tolist()}"


@_check
def check_model_output_reference(obj) -> None:
    """get_output agrees with the case's plain forward-pass reference (skipped without one)."""
    case = _mo_case(obj)
    if case.reference is None:
        return
    with torch.no_grad():
        want = case.reference(case.model, case.batch)
        got = _get_outputs(case, case.batch)
    _close(
        got.detach().reshape(-1),
        torch.as_tensor(want).detach().reshape(-1),
        case.rtol,
        case.atol,
        "get_output vs the plain forward pass (reference)",
    )


MODEL_OUTPUT_CHECKS = (
    check_model_output_validate_batch,
    check_model_output_output,
    check_model_output_uses_weights,
    check_model_output_batch_independent,
    check_model_output_out_to_loss_grad,
    check_model_output_reference,
)


def model_output_checks() -> tuple:
    """The model output checks, each ``check(ModelOutputCase)``."""
    return MODEL_OUTPUT_CHECKS


def check_model_output(
    model_output,
    model: torch.nn.Module,
    batch: Sequence[Tensor],
    *,
    checks: Sequence[Callable] | None = None,
    **case_options,
) -> None:
    """Run every model output check (or ``checks``) on ``model_output`` with ``model`` and a good ``batch``
    (≥ 2 examples). ``case_options``: the other fields of :class:`ModelOutputCase` (``reference``,
    ``bad_batches``, ``batched_output``, ``setup``, ``rtol``, ``atol``)."""
    case = ModelOutputCase(model_output, model, batch, **case_options)
    for check in checks or MODEL_OUTPUT_CHECKS:
        check(case)


# ---------------------------------------------------------------------------------------------- pytest
def iter_checks(objects: Sequence[Any]) -> Iterator[tuple[Any, Callable, str, Any]]:
    """(case, check, id, marks) for every object and each of its checks: projectors (instances,
    factories, :class:`ProjectorCase`) get the projector checks, :class:`ModelOutputCase` the model
    output checks, :class:`StoreCase` the store checks."""
    seen: dict[str, int] = {}
    case: ProjectorCase | ModelOutputCase | StoreCase
    checks: tuple
    for obj in objects:
        if isinstance(obj, ModelOutputCase):
            case, checks = obj, MODEL_OUTPUT_CHECKS
        elif isinstance(obj, StoreCase):
            case, checks = obj, STORE_CHECKS
        else:
            case, checks = _as_projector_case(obj), PROJECTOR_CHECKS
        name = case.name
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            name = f"{name}{seen[name]}"
        for check in checks:
            yield case, check, f"{name}-{check.__name__}", case.marks


def parametrize_with_checks(objects: Sequence[Any]):
    """A ``pytest.mark.parametrize("obj, check", ...)`` decorator with one test per (object, check), ids
    ``"<case id>-<check name>"`` (as scikit-learn's ``parametrize_with_checks``). The test calls
    ``check(obj)``. pytest is imported here, not when this module is imported."""
    import pytest

    params = [pytest.param(case, check, id=ident, marks=marks) for case, check, ident, marks in iter_checks(objects)]
    return pytest.mark.parametrize("obj, check", params)


# the store contract suite lives beside (trak_core/store_checks.py); its names are part of this module's API
from .store.memory import MemoryStore, memory_location  # noqa: E402
from .store_checks import STORE_CHECKS, StoreCase, check_store, store_checks  # noqa: E402
