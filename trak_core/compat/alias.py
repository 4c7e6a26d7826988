"""``import trak`` / ``from trak.projectors import ...`` resolved to trak_core, for running code (or test
suites) written against traker unchanged."""

from __future__ import annotations

import sys
import types
import warnings

from trak_core.featurize import gradients, modelout
from trak_core.projection import projectors

from .._version import __version__
from . import traker, utils
from .errors import ModelIDException
from .projectors import BasicProjector, BasicSingleBlockProjector, ChunkedCudaProjector, CudaProjector
from .score_computers import AbstractScoreComputer, BasicScoreComputer, BasicSingleBlockScoreComputer

__all__ = ["install_trak_alias", "uninstall_trak_alias", "trak_modules"]


def trak_modules() -> dict[str, types.ModuleType]:
    """The modules that stand for ``trak``, ``trak.projectors``, ``trak.utils``, ``trak.gradient_computers``,
    ``trak.modelout_functions``, ``trak.score_computers``, ``trak.savers`` and ``trak.traker``."""

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
        "traker's saver module: its exception (trak_core keeps one Zarr store, no saver classes)",
        ModelIDException=ModelIDException,
    )
    proj_mod = module(
        "trak.projectors",
        "trak_core's projectors under traker's module name",
        **{n: v for n, v in vars(projectors).items() if not n.startswith("_")},
    )
    proj_mod.__dict__.update(
        BasicProjector=BasicProjector,
        BasicSingleBlockProjector=BasicSingleBlockProjector,
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
        BasicProjector=BasicProjector,
        CudaProjector=CudaProjector,
        ChunkedCudaProjector=ChunkedCudaProjector,
        ModelIDException=ModelIDException,
        AbstractScoreComputer=AbstractScoreComputer,
        BasicScoreComputer=BasicScoreComputer,
        get_num_params=utils.get_num_params,
        get_parameter_chunk_sizes=utils.get_parameter_chunk_sizes,
    )
    top = module(
        "trak",
        "trak_core under traker's package name (trak_core.compat.alias.install_trak_alias)",
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
