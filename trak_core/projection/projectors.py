"""JL projections of per-example gradients: one contract, several implementations.

Contract (checked for every implementation by :func:`trak_core.testing.check_projector`):

* ``project(grads, model_id)`` takes (B, grad_dim) gradients, or a dict {name: (B, *shape)} whose
  flattened sizes add up to grad_dim, and returns (B, proj_dim) float32 (or the projector's dtype).
* The result is a pure function of (seed, model_id, grad_dim, proj_dim, kind) and the example's own
  gradient: the same example gets the same vector in any batch, batch size, shard, process or machine
  (up to float rounding of the matmul; bit-identical for identical batches).
* E⟨Px, Py⟩ = proj_dim · ⟨x, y⟩ for the dense kinds (entries have unit variance, no 1/√k scaling, as in
  traker); ``scale`` tells the factor so callers can compare inner products.

The dense matrix is defined by :mod:`trak_core.projection.counter_rng`, generated in row blocks, cached when it
fits ``cache_bytes``. A dict input is projected parameter by parameter (the "chunked path": the
flattened (B, grad_dim) gradient is never materialized, so grad_dim may exceed memory for one matrix).

Registry: :func:`make_projector` builds projectors by kind name and device type from factories registered
with :func:`register_projector`. trak_core registers its own (``noop``, ``dense``, ``sjlt``, ``factored``,
any device); other packages register theirs when imported, and are found through the entry point group
``trakflow.projectors`` (loaded the first time a lookup needs a kind or device trak_core's own do not
cover). trakflow's GPU projectors are such a plugin package: trak_core never imports them by name.
"""

from __future__ import annotations

import importlib.metadata
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from trak_core.errors import BadInputError
from trak_core.featurize.gradients import vectorize
from trak_core.projection import counter_rng
from trak_core.projection.base import AbstractProjector, ProjectionType, as_proj_type, check_dims
from trak_core.projection.factored import FactoredProjector, record_kwargs
from trak_core.projection.sjlt import SJLTProjector

__all__ = [
    "AbstractProjector",
    "ProjectionType",
    "as_proj_type",
    "check_dims",
    "NoOpProjector",
    "DenseProjector",
    "FactoredProjector",
    "SJLTProjector",
    "ProjectorEntry",
    "ProjectorTraits",
    "projector_traits",
    "register_projector",
    "unregister_projector",
    "load_projector_plugins",
    "find_projector",
    "registered_projectors",
    "make_projector",
    "rebuild_kwargs",
]


class NoOpProjector(AbstractProjector):
    """The identity: ``project(g) = g`` (proj_dim is grad_dim)."""

    kind = "noop"

    def __init__(
        self,
        grad_dim: int = 0,
        proj_dim: int = 0,
        seed: int = 0,
        proj_type: str | ProjectionType = "na",
        device="cpu",
        *args,
        **kwargs,
    ) -> None:
        super().__init__(grad_dim, proj_dim, seed, proj_type, device)

    def project(self, grads, model_id: int) -> Tensor:
        if self.grad_dim:
            self._check_input(grads)
        return vectorize(grads, device=self.device)

    @property
    def scale(self) -> float:
        return 1.0


class DenseProjector(AbstractProjector):
    """Dense Rademacher (±1) or standard-normal projection, generated block-wise from the counter RNG.

    ``block_rows`` rows of the matrix are generated (or read from the cache) and multiplied at a time;
    the whole matrix is cached per model_id when grad_dim × proj_dim × 4 bytes ≤ ``cache_bytes``.
    """

    kind = "dense"

    def __init__(
        self,
        grad_dim: int,
        proj_dim: int,
        seed: int = 0,
        proj_type: str | ProjectionType = ProjectionType.rademacher,
        device="cpu",
        dtype: torch.dtype = torch.float32,
        block_rows: int | None = None,
        cache_bytes: int = 512 * 2**20,
        model_id: int = 0,
        *args,
        **kwargs,
    ) -> None:
        check_dims(grad_dim, proj_dim)
        super().__init__(grad_dim, proj_dim, seed, as_proj_type(proj_type), device)
        self.dtype = dtype
        self.block_rows = block_rows or max(256, (64 * 2**20) // (4 * proj_dim))
        self.cache_bytes = cache_bytes
        self.model_id = model_id
        self._cache: tuple[int, Tensor] | None = None

    def free_memory(self) -> None:
        self._cache = None

    def generate(self, model_id: int, row0: int, row1: int) -> Tensor:
        """Rows [row0, row1) of the matrix for ``model_id`` (CPU float32; the definition)."""
        fn = counter_rng.rademacher_block if self.proj_type == ProjectionType.rademacher else counter_rng.normal_block
        step = max(1, (1 << 19) // self.proj_dim)  # generate in cache-sized pieces
        if row1 - row0 <= step:
            return fn(self.seed, model_id, row0, row1, self.proj_dim)
        out = torch.empty(row1 - row0, self.proj_dim, dtype=torch.float32)
        for r in range(row0, row1, step):
            e = min(r + step, row1)
            out[r - row0 : e - row0] = fn(self.seed, model_id, r, e, self.proj_dim)
        return out

    def matrix(self, model_id: int) -> Tensor:
        """The whole grad_dim × proj_dim matrix (only for small sizes and tests)."""
        return self.generate(model_id, 0, self.grad_dim)

    def _block(self, model_id: int, row0: int, row1: int) -> Tensor:
        fits = self.grad_dim * self.proj_dim * 4 <= self.cache_bytes
        if fits:
            if self._cache is None or self._cache[0] != model_id:
                self._cache = (model_id, self.generate(model_id, 0, self.grad_dim).to(self.device, self.dtype))
            return self._cache[1][row0:row1]
        return self.generate(model_id, row0, row1).to(self.device, self.dtype)

    def project(self, grads, model_id: int) -> Tensor:
        self._check_input(grads)
        if isinstance(grads, dict):
            pieces = [(g.reshape(g.shape[0], -1)) for g in grads.values()]
        else:
            pieces = [grads]
        batch = pieces[0].shape[0]
        out = torch.zeros(batch, self.proj_dim, dtype=self.dtype, device=self.device)
        offset = 0
        for piece in pieces:
            width = piece.shape[1]
            for c0 in range(0, width, self.block_rows):
                c1 = min(c0 + self.block_rows, width)
                block = self._block(model_id, offset + c0, offset + c1)
                out.addmm_(piece[:, c0:c1].to(self.device, self.dtype), block)
            offset += width
        return out


# ---------------------------------------------------------------------------------------------- the registry
ENTRY_POINT_GROUP = "trakflow.projectors"

ProjectorFactory = Callable[..., AbstractProjector]


@dataclass(frozen=True)
class ProjectorTraits:
    """What a projector kind is, on every device (the registry answers it: :func:`projector_traits`), so that no
    caller compares kind names.

    ``uses_model``: its factory takes ``model=`` and ``grad_wrt=`` (others never see them). ``is_identity``: it
    keeps every gradient coordinate (proj_dim is grad_dim; nothing is compressed). ``splits_by_layer``: its
    proj_dim is split over the model's layers, by the gradient energy probed on a new store's first rows; the
    split is recorded in the store's ``projector_params`` (as :func:`trak_core.projection.factored.record_kwargs` reads
    it) and every later run rebuilds the projection from that record (:func:`rebuild_kwargs`).
    """

    uses_model: bool = False
    is_identity: bool = False
    splits_by_layer: bool = False


@dataclass(frozen=True)
class ProjectorEntry:
    """A registered projector: ``factory(grad_dim, proj_dim, seed, proj_type, device, **kwargs)``.

    ``devices``: the torch device types it serves (``("cuda",)``), or None for any device (used where no
    entry names the device type). ``traits``: what the kind is (:class:`ProjectorTraits`, the same for every
    device).
    """

    kind: str
    factory: ProjectorFactory
    devices: tuple[str, ...] | None = None
    traits: ProjectorTraits = ProjectorTraits()

    @property
    def uses_model(self) -> bool:
        """The factory takes ``model=`` and ``grad_wrt=``."""
        return self.traits.uses_model


_REGISTRY: dict[tuple[str, str | None], ProjectorEntry] = {}
_PLUGINS: dict[str, str] = {}  # entry point name -> "" (loaded) or the reason it failed
_plugins_loaded = False


def register_projector(
    kind: str,
    factory: ProjectorFactory,
    devices: Iterable[str] | None = None,
    *,
    uses_model: bool = False,
    is_identity: bool = False,
    splits_by_layer: bool = False,
    replace: bool = False,
) -> None:
    """Register ``factory`` as the projector ``kind`` on the device types ``devices`` (None: any device).

    The factory is called as ``factory(grad_dim, proj_dim, seed, proj_type, device, **kwargs)`` (with
    ``model=`` and ``grad_wrt=`` when ``uses_model``). ``uses_model``, ``is_identity``, ``splits_by_layer``: the
    kind's :class:`ProjectorTraits`, which must agree with the kind's entries on other devices. A (kind, device
    type) registered by another factory is refused unless ``replace``; registering the same factory again is a
    no-op.
    """
    if not isinstance(kind, str) or not kind:
        raise BadInputError(f"projector kind must be a non-empty string, got {kind!r}")
    if not callable(factory):
        raise BadInputError(f"projector factory for {kind!r} must be callable, got {type(factory).__name__}")
    if isinstance(devices, str):
        devices = [devices]
    devs = None if devices is None else tuple(sorted({_device_type(d) for d in devices}))
    traits = ProjectorTraits(uses_model=uses_model, is_identity=is_identity, splits_by_layer=splits_by_layer)
    entry = ProjectorEntry(kind, factory, devs, traits)
    others = {e.traits for (k, d), e in _REGISTRY.items() if k == kind and d not in (devs or (None,))}
    if others - {traits}:
        raise BadInputError(
            f"projector {kind!r}: {traits} differs from the kind's entries on other devices ({others.pop()}); "
            "a kind is the same projection on every device"
        )
    for dev in devs or (None,):
        old = _REGISTRY.get((kind, dev))
        if old is not None and old.factory is not factory and not replace:
            where = "any device" if dev is None else f"device type {dev!r}"
            raise BadInputError(
                f"projector {kind!r} for {where} is already registered "
                f"({getattr(old.factory, '__qualname__', old.factory)}); pass replace=True"
            )
    for dev in devs or (None,):
        _REGISTRY[(kind, dev)] = entry


def unregister_projector(kind: str, devices: Iterable[str] | None = None) -> None:
    """Remove the entries of ``kind`` (only those of ``devices`` when given; None removes them all)."""
    if isinstance(devices, str):
        devices = [devices]
    types = None if devices is None else {_device_type(d) for d in devices}
    for key in [k for k in _REGISTRY if k[0] == kind]:
        if types is None or key[1] in types:
            del _REGISTRY[key]


def load_projector_plugins(reload: bool = False) -> dict[str, str]:
    """Import the packages of the ``trakflow.projectors`` entry points (they register on import; an entry
    point that names a callable is called). Returns {entry point name: "" or why it failed}; a failure
    is a one-line :class:`RuntimeWarning`, never an error."""
    global _plugins_loaded
    if _plugins_loaded and not reload:
        return dict(_PLUGINS)
    _plugins_loaded = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            if callable(obj) and not isinstance(obj, type):
                obj()
            _PLUGINS[ep.name] = ""
        except Exception as e:  # a broken plugin must not break trak_core's own projectors
            _PLUGINS[ep.name] = f"{type(e).__name__}: {e}"
            warnings.warn(
                f"trak_core: projector plugin {ep.name!r} ({ep.value}) failed to load: {_PLUGINS[ep.name]}".replace(
                    "\n", " "
                ),
                RuntimeWarning,
                stacklevel=3,
            )
    return dict(_PLUGINS)


def _device_type(device) -> str:
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError):
        raise BadInputError(f"unknown device {device!r}") from None


def _find(kind: str, dev: str) -> ProjectorEntry | None:
    return _REGISTRY.get((kind, dev)) or _REGISTRY.get((kind, None))


def find_projector(kind: str, device="cpu") -> ProjectorEntry:
    """The entry that :func:`make_projector` uses for ``kind`` on ``device``: the one registered for the
    device's type, else the one for any device. The entry point plugins are loaded first when neither
    exists, or when the device is not a CPU and no entry names its type."""
    kind = getattr(kind, "value", kind)
    dev = _device_type(device)
    if (kind, dev) not in _REGISTRY and (dev != "cpu" or _find(kind, dev) is None):
        load_projector_plugins()
    entry = _find(kind, dev)
    if entry is None:
        raise BadInputError(
            f"unknown projector {kind!r} for device {str(device)!r}; choose one of {registered_projectors(device)}"
        )
    return entry


def projector_traits(kind: str) -> ProjectorTraits:
    """What the registry says of the kind ``kind`` on any device (:class:`ProjectorTraits`); the entry point plugins
    are loaded first when no entry registers it. A kind that none registers (a store written with a plugin that is
    not installed here) has none of the traits."""
    kind = getattr(kind, "value", kind)
    entries = [e for (k, _), e in _REGISTRY.items() if k == kind]
    if not entries:
        load_projector_plugins()
        entries = [e for (k, _), e in _REGISTRY.items() if k == kind]
    return entries[0].traits if entries else ProjectorTraits()


def registered_projectors(device=None) -> list[str]:
    """The kinds registered (for ``device``'s type, or any device, when given)."""
    if device is None:
        return sorted({k for k, _ in _REGISTRY})
    dev = _device_type(device)
    return sorted({k for k, d in _REGISTRY if d is None or d == dev})


def _make_noop(grad_dim, proj_dim, seed=0, proj_type="rademacher", device="cpu", **kwargs) -> NoOpProjector:
    return NoOpProjector(grad_dim=grad_dim, proj_dim=grad_dim, device=device)


def _make_factored(
    grad_dim, proj_dim, seed=0, proj_type="rademacher", device="cpu", model=None, grad_wrt=None, **kwargs
) -> FactoredProjector:
    if model is None:
        raise BadInputError(
            "projector 'factored' needs the model (make_projector(..., model=model, "
            "grad_wrt=...)): its blocks are the model's layers"
        )
    p = FactoredProjector.from_model(model, proj_dim, seed, proj_type, device, grad_wrt=grad_wrt, **kwargs)
    if p.grad_dim != grad_dim:
        raise BadInputError(
            f"projector 'factored': the model has {p.grad_dim} gradient coordinates "
            f"(grad_wrt={grad_wrt!r}), not grad_dim={grad_dim}"
        )
    return p


register_projector("noop", _make_noop, is_identity=True)
register_projector("dense", DenseProjector)
register_projector("sjlt", SJLTProjector)
register_projector("factored", _make_factored, uses_model=True, splits_by_layer=True)


def make_projector(
    kind: str, grad_dim: int, proj_dim: int, seed: int = 0, proj_type: str = "rademacher", device="cpu", **kwargs
) -> AbstractProjector:
    """Build a projector by kind name (the pipeline's entry point), from the registry.

    ``"factored"`` needs ``model=`` (and the ``grad_wrt`` used for the gradients): its blocks are the model's
    layers; ``"sjlt"`` takes ``c=`` (nonzeros per input coordinate). On a CUDA device ``"dense"`` and
    ``"sjlt"`` are trakflow's GPU projectors and ``"fast_jl"`` TRAK's, where the GPU projector plugin is
    installed (see :func:`find_projector`).
    """
    entry = find_projector(kind, device)
    model, grad_wrt = kwargs.pop("model", None), kwargs.pop("grad_wrt", None)
    if entry.uses_model:
        kwargs.update(model=model, grad_wrt=grad_wrt)
    return entry.factory(grad_dim, proj_dim, seed, proj_type, device, **kwargs)


def rebuild_kwargs(kind: str, params: dict) -> dict:
    """The :func:`make_projector` keywords (beyond grad_dim, proj_dim, seed, proj_type, device, model, grad_wrt) that
    rebuild the projection a store records: its kind-specific ``projector_params`` (SJLT's ``c``; the factored
    projector's split and, for the energy split, the energies it used: the same layout without any data)."""
    if projector_traits(kind).splits_by_layer:
        return record_kwargs(params)
    return {"c": params["c"]} if "c" in params else {}
