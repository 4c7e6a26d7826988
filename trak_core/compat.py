"""traker 0.3.2's remaining public names, and a ``trak`` import alias.

* :class:`CudaProjector` and :class:`ChunkedCudaProjector` take traker's constructor arguments and map to
  our dense projection (:class:`~trak_core.projectors.DenseProjector`, counter-based RNG): they work on any
  device, CPU included, and give the same vectors on every device. On a GPU the projection uses our
  kernels (``cuda_ext``) when they build. They are not fast_jl: the matrices differ from traker's.
* The saver and score-computer classes: ``MmapSaver`` and ``BasicScoreComputer`` are what traker's
  ``TRAKer`` uses by default and what ours does in its own way (a Zarr store; XᵀX, inverse and scores in
  float64), so ``TRAKer`` accepts them. The score computers also work as standalone tensor utilities.
  Any other saver or score-computer class is refused by ``TRAKer`` with an error that says what to use.
* :func:`install_trak_alias` makes ``import trak`` / ``from trak.projectors import ...`` resolve to
  trak_core, for running code (or test suites) written against traker unchanged.
"""

from __future__ import annotations

import logging
import sys
import types
import warnings
from abc import ABC, abstractmethod

import torch
from torch import Tensor

from .errors import BadInputError, ModelIDException
from .projectors import DenseProjector, ProjectionType
from .utils import get_matrix_mult

__all__ = [
    "CudaProjector",
    "ChunkedCudaProjector",
    "AbstractSaver",
    "MmapSaver",
    "ModelIDException",
    "AbstractScoreComputer",
    "BasicSingleBlockScoreComputer",
    "BasicScoreComputer",
    "install_trak_alias",
    "trak_modules",
]


# ---------------------------------------------------------------------------------------------- projectors
def _proj_type(value) -> ProjectionType:
    try:
        return ProjectionType(getattr(value, "value", value))
    except ValueError:
        raise BadInputError(f"unknown projection type {value!r}; use 'rademacher' or 'normal'") from None


class CudaProjector(DenseProjector):
    """traker's ``CudaProjector(grad_dim, proj_dim, seed, proj_type, device, max_batch_size, ...)`` on any
    device: the dense Rademacher/normal projection of :class:`~trak_core.projectors.DenseProjector`.

    As with fast_jl, the result has the dtype of the input gradients (``dtype=`` sets the compute dtype;
    float32 by default) and ``max_batch_size`` / ``num_sms`` do not change the result (they are kept as
    attributes for scripts that set them).
    """

    def __init__(
        self,
        grad_dim: int,
        proj_dim: int,
        seed: int,
        proj_type: str | ProjectionType,
        device,
        max_batch_size: int,
        *args,
        **kwargs,
    ) -> None:
        dtype = kwargs.pop("dtype", torch.float32)
        if dtype not in (torch.float32, torch.float64):
            dtype = torch.float32  # half-precision inputs are projected in float32, returned in their dtype
        ptype = _proj_type(proj_type)
        super().__init__(int(grad_dim), int(proj_dim), int(seed), ptype, device, dtype=dtype)
        self.max_batch_size = max_batch_size
        dev = torch.device(device)
        if dev.type == "cuda" and torch.cuda.is_available():
            self.num_sms = torch.cuda.get_device_properties(dev.index or 0).multi_processor_count
        else:
            self.num_sms = torch.get_num_threads()
        self._gpu = None
        if dev.type == "cuda":
            from .projectors import make_projector  # uses cuda_ext when it builds; never imported otherwise

            p = make_projector("dense", self.grad_dim, self.proj_dim, self.seed, ptype.value, device)
            if not isinstance(p, DenseProjector):
                self._gpu = p

    def project(self, grads: dict | Tensor, model_id: int) -> Tensor:
        in_dtype = next(iter(grads.values())).dtype if isinstance(grads, dict) else grads.dtype
        out = self._gpu.project(grads, model_id) if self._gpu is not None else super().project(grads, model_id)
        return out.to(in_dtype) if in_dtype.is_floating_point else out


class ChunkedCudaProjector:
    """traker's ``ChunkedCudaProjector``: consecutive parameters are grouped into chunks (a new chunk starts
    when the next parameter would take the current one past ``max_chunk_size``; ``params_per_chunk`` are the
    chunk widths, as from :func:`trak_core.utils.get_parameter_chunk_sizes`), chunk ``i`` is projected with
    ``projector_per_chunk[i]`` and the projections are summed. Any device."""

    def __init__(
        self,
        projector_per_chunk: list,
        max_chunk_size: int,
        params_per_chunk: list,
        feat_bs: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        if len(projector_per_chunk) != len(params_per_chunk):
            raise BadInputError(
                f"ChunkedCudaProjector: {len(projector_per_chunk)} projectors for {len(params_per_chunk)} chunks"
            )
        self.projector_per_chunk = projector_per_chunk
        self.proj_dim = projector_per_chunk[0].proj_dim
        self.proj_type = projector_per_chunk[0].proj_type
        self.params_per_chunk = [int(c) for c in params_per_chunk]
        self.grad_dim = sum(self.params_per_chunk)
        self.max_chunk_size = int(max_chunk_size)
        self.feat_bs = feat_bs
        self.device = device
        self.dtype = dtype

    def free_memory(self) -> None:
        for p in self.projector_per_chunk:
            p.free_memory()

    def _chunks(self, grads: dict):
        current: list[Tensor] = []
        width = 0
        for g in grads.values():
            flat = g.detach().reshape(g.shape[0], -1)
            if current and width + flat.shape[1] > self.max_chunk_size:
                yield current, width
                current, width = [], 0
            current.append(flat)
            width += flat.shape[1]
        if current:
            yield current, width

    def project(self, grads, model_id):
        if not isinstance(grads, dict):
            raise BadInputError("ChunkedCudaProjector.project takes the gradient dict {name: (B, *shape)}")
        out = None
        for i, (parts, width) in enumerate(self._chunks(grads)):
            if i >= len(self.params_per_chunk) or width != self.params_per_chunk[i]:
                raise BadInputError(
                    f"ChunkedCudaProjector: chunk {i} has {width} parameters, params_per_chunk "
                    f"says {self.params_per_chunk[i] if i < len(self.params_per_chunk) else None}"
                )
            x = torch.cat(parts, dim=1).to(self.device)
            p = self.projector_per_chunk[i].project(x, model_id=model_id).to(self.device, self.dtype)
            out = p if out is None else out + p
        return out


# ---------------------------------------------------------------------------------------------- savers
_SAVER_HELP = (
    "trak_core keeps everything in one Zarr store (trak_core.TrakStore): give TRAKer a save_dir "
    "(a path or an fsspec URL such as s3://bucket/run.zarr, with storage_options=...) instead of a "
    "saver class"
)


class AbstractSaver(ABC):
    """traker's saver interface. trak_core has no pluggable saver (see :class:`~trak_core.TrakStore`);
    ``TRAKer`` refuses subclasses with an error saying to use ``save_dir`` / ``storage_options``."""

    @abstractmethod
    def __init__(
        self, save_dir, metadata, load_from_save_dir: bool, logging_level: int, use_half_precision: bool
    ) -> None:
        raise BadInputError(_SAVER_HELP)


class MmapSaver(AbstractSaver):
    """traker's default saver. Passing ``saver=MmapSaver`` to ``TRAKer`` is accepted (it is the default,
    and our Zarr store takes its place); building one directly raises, saying what to use instead."""

    def __init__(
        self, save_dir, metadata, train_set_size, proj_dim, load_from_save_dir, logging_level, use_half_precision
    ) -> None:
        raise BadInputError(f"MmapSaver is not available in trak_core: {_SAVER_HELP}")


# ---------------------------------------------------------------------------------------------- scoring
class AbstractScoreComputer(ABC):
    """traker's score-computer interface (``get_xtx``, ``get_x_xtx_inv``, ``get_scores``)."""

    @abstractmethod
    def __init__(self, dtype, device) -> None:
        self.dtype = dtype
        self.device = device

    @abstractmethod
    def get_xtx(self, grads: Tensor) -> Tensor:
        """XᵀX, (p, p)."""

    @abstractmethod
    def get_x_xtx_inv(self, grads: Tensor, xtx: Tensor) -> Tensor:
        """X (XᵀX)⁻¹, (n, p)."""

    @abstractmethod
    def get_scores(self, features: Tensor, target_grads: Tensor, accumulator: Tensor) -> Tensor | None:
        """accumulator += features @ target_gradsᵀ (in place; a subclass may also return the accumulator)."""


class BasicSingleBlockScoreComputer(AbstractScoreComputer):
    """All in one block: XᵀX, X (XᵀX)⁻¹ with the plain inverse (no λ, no rescale), one product.
    ``TRAKer(score_computer=BasicSingleBlockScoreComputer)`` means ``rescale_inverse=False`` and λ = 0."""

    def __init__(self, dtype, device) -> None:
        super().__init__(dtype, device)

    def get_xtx(self, grads: Tensor) -> Tensor:
        return grads.T @ grads

    def get_x_xtx_inv(self, grads: Tensor, xtx: Tensor) -> Tensor:
        inv = torch.linalg.inv(xtx.float())  # float16 has no inverse
        return grads @ inv.to(grads.dtype if self.dtype is None else self.dtype)

    def get_scores(self, features: Tensor, target_grads: Tensor, accumulator: Tensor) -> None:
        accumulator += (features @ target_grads.T).detach().to(accumulator.device, accumulator.dtype)


class BasicScoreComputer(AbstractScoreComputer):
    """Block-wise XᵀX; (XᵀX + λI)⁻¹ in float32 divided by its mean |entry| (traker's rescale); block-wise
    scores. This is what ``TRAKer`` computes by default (ours in float64 over the store)."""

    def __init__(
        self,
        dtype: torch.dtype,
        device: torch.device,
        CUDA_MAX_DIM_SIZE: int = 20_000,
        logging_level=logging.INFO,
        lambda_reg: float = 0.0,
    ) -> None:
        super().__init__(dtype, device)
        self.CUDA_MAX_DIM_SIZE = int(CUDA_MAX_DIM_SIZE)
        self.logger = logging.getLogger("ScoreComputer")
        self.logger.setLevel(logging_level)
        self.lambda_reg = lambda_reg

    def get_xtx(self, grads: Tensor) -> Tensor:
        self.proj_dim = grads.shape[1]
        out = torch.zeros(self.proj_dim, self.proj_dim, dtype=self.dtype, device=self.device)
        for block in torch.split(grads, self.CUDA_MAX_DIM_SIZE, dim=0):
            b = block.to(self.device, self.dtype)
            out += b.T @ b
        return out

    def get_x_xtx_inv(self, grads: Tensor, xtx: Tensor) -> Tensor:
        eye = torch.eye(xtx.shape[0], dtype=xtx.dtype, device=xtx.device)
        inv = torch.linalg.inv((xtx + self.lambda_reg * eye).to(torch.float32))
        inv = (inv / inv.abs().mean()).to(self.dtype)
        out = torch.empty(grads.shape[0], inv.shape[1], dtype=self.dtype, device=self.device)
        for start in range(0, grads.shape[0], self.CUDA_MAX_DIM_SIZE):
            out[start : start + self.CUDA_MAX_DIM_SIZE] = (
                grads[start : start + self.CUDA_MAX_DIM_SIZE].to(self.device, self.dtype) @ inv
            )
        return out

    def get_scores(self, features: Tensor, target_grads: Tensor, accumulator: Tensor) -> Tensor:
        big = features.shape[0] > self.CUDA_MAX_DIM_SIZE or target_grads.shape[0] > self.CUDA_MAX_DIM_SIZE
        scores = get_matrix_mult(
            features, target_grads, target_dtype=self.dtype, batch_size=self.CUDA_MAX_DIM_SIZE, use_blockwise=big
        )
        accumulator += scores.detach().to(accumulator.device, accumulator.dtype)
        return accumulator


def check_saver(saver) -> None:
    """``TRAKer(saver=...)``: ``None`` or ``MmapSaver`` (ours: the Zarr store); anything else is refused."""
    if saver is None or saver is MmapSaver or _named(saver, "MmapSaver"):
        return
    raise BadInputError(f"TRAKer(saver={getattr(saver, '__name__', saver)!r}) is not supported: {_SAVER_HELP}")


def score_computer_settings(score_computer, lambda_reg) -> dict:
    """``TRAKer(score_computer=...)`` → the TRAKer settings it means (``rescale_inverse``), or an error."""
    if score_computer is None or score_computer is BasicScoreComputer or _named(score_computer, "BasicScoreComputer"):
        return {}
    if score_computer is BasicSingleBlockScoreComputer or _named(score_computer, "BasicSingleBlockScoreComputer"):
        if not (isinstance(lambda_reg, (int, float)) and float(lambda_reg) == 0.0):
            raise BadInputError(
                "score_computer=BasicSingleBlockScoreComputer uses the plain inverse without "
                f"damping, but lambda_reg={lambda_reg!r}: drop one of the two (the default "
                "BasicScoreComputer honours lambda_reg)"
            )
        return {"rescale_inverse": False}
    raise BadInputError(
        f"TRAKer(score_computer={getattr(score_computer, '__name__', score_computer)!r}) is not supported: "
        "trak_core computes XᵀX, (XᵀX + λI)⁻¹ and the scores itself, block-wise over its store in float64. "
        "Use score_computer=None (BasicScoreComputer's math) or BasicSingleBlockScoreComputer (plain inverse), "
        "and lambda_reg= / rescale_inverse= to change the math"
    )


def _named(cls, name: str) -> bool:
    # traker's own classes (e.g. when the real trak is installed next to us) count as the same choice
    mod = getattr(cls, "__module__", "")
    return getattr(cls, "__name__", None) == name and mod.split(".")[0] == "trak"


# ---------------------------------------------------------------------------------------------- trak alias
def trak_modules() -> dict[str, types.ModuleType]:
    """The modules that stand for ``trak``, ``trak.projectors``, ``trak.utils``, ``trak.gradient_computers``,
    ``trak.modelout_functions``, ``trak.score_computers``, ``trak.savers`` and ``trak.traker``."""
    from . import __version__, gradients, modelout, projectors, traker, utils

    def module(name: str, doc: str, **attrs) -> types.ModuleType:
        m = types.ModuleType(name, doc)
        m.__dict__.update(attrs)
        return m

    grad_mod = module(
        "trak.gradient_computers",
        "trak_core's gradient computers under traker's module name",
        AbstractGradientComputer=gradients.AbstractGradientComputer,
        FunctionalGradientComputer=gradients.FunctionalGradientComputer,
        IterativeGradientComputer=gradients.IterativeGradientComputer,
        AbstractModelOutput=modelout.AbstractModelOutput,
        get_num_params=utils.get_num_params,
        parameters_to_vector=utils.parameters_to_vector,
    )
    out_mod = module(
        "trak.modelout_functions",
        "trak_core's model output functions under traker's module name",
        **{
            n: getattr(modelout, n)
            for n in (
                "AbstractModelOutput",
                "ImageClassificationModelOutput",
                "CLIPModelOutput",
                "TextClassificationModelOutput",
                "IterativeImageClassificationModelOutput",
                "TASK_TO_MODELOUT",
            )
        },
    )
    score_mod = module(
        "trak.score_computers",
        "traker's score computers (trak_core.compat)",
        AbstractScoreComputer=AbstractScoreComputer,
        BasicSingleBlockScoreComputer=BasicSingleBlockScoreComputer,
        BasicScoreComputer=BasicScoreComputer,
        get_matrix_mult=utils.get_matrix_mult,
    )
    saver_mod = module(
        "trak.savers",
        "traker's saver names (trak_core.compat)",
        AbstractSaver=AbstractSaver,
        MmapSaver=MmapSaver,
        ModelIDException=ModelIDException,
    )
    proj_mod = module(
        "trak.projectors",
        "trak_core's projectors under traker's module name",
        **{n: v for n, v in vars(projectors).items() if not n.startswith("_")},
    )
    proj_mod.__dict__.update(
        CudaProjector=CudaProjector,
        ChunkedCudaProjector=ChunkedCudaProjector,
        vectorize=utils.vectorize,  # traker's projectors module re-exports trak.utils.vectorize
    )
    traker_mod = module(
        "trak.traker",
        "trak_core's TRAKer under traker's module name (with the names traker's module imports)",
        **{n: v for n, v in vars(traker).items() if not n.startswith("_")},
    )
    traker_mod.__dict__.update(
        TASK_TO_MODELOUT=modelout.TASK_TO_MODELOUT,
        BasicProjector=projectors.BasicProjector,
        CudaProjector=CudaProjector,
        ChunkedCudaProjector=ChunkedCudaProjector,
        AbstractSaver=AbstractSaver,
        MmapSaver=MmapSaver,
        ModelIDException=ModelIDException,
        AbstractScoreComputer=AbstractScoreComputer,
        BasicScoreComputer=BasicScoreComputer,
        get_num_params=utils.get_num_params,
        get_parameter_chunk_sizes=utils.get_parameter_chunk_sizes,
    )
    top = module(
        "trak",
        "trak_core under traker's package name (trak_core.compat.install_trak_alias)",
        TRAKer=traker.TRAKer,
        test_install=utils.test_install,
        __version__=__version__,
        VERSION=__version__,
    )
    top.__path__ = []  # a package, so ``import trak.x`` looks the submodules up in sys.modules
    mods = {
        "trak": top,
        "trak.projectors": proj_mod,
        "trak.utils": utils,
        "trak.gradient_computers": grad_mod,
        "trak.modelout_functions": out_mod,
        "trak.score_computers": score_mod,
        "trak.savers": saver_mod,
        "trak.traker": traker_mod,
    }
    for name, m in mods.items():
        if name != "trak":
            setattr(top, name.split(".", 1)[1], m)
    return mods


def install_trak_alias(force: bool = True) -> dict[str, types.ModuleType]:
    """Make ``import trak`` and ``import trak.<module>`` resolve to trak_core (in ``sys.modules``).

    Replaces an installed traker in this process when ``force`` (the default); returns the mapping.
    Undo with :func:`uninstall_trak_alias`.
    """
    mods = trak_modules()
    if not force and "trak" in sys.modules:
        warnings.warn("install_trak_alias: 'trak' is already imported; leaving it", stacklevel=2)
        return {}
    for name in [n for n in sys.modules if n == "trak" or n.startswith("trak.")]:
        del sys.modules[name]
    sys.modules.update(mods)
    return mods


def uninstall_trak_alias() -> None:
    """Remove the ``trak`` alias modules from ``sys.modules`` (a later ``import trak`` finds the real one)."""
    for name in [n for n, m in sys.modules.items() if (n == "trak" or n.startswith("trak."))]:
        del sys.modules[name]
