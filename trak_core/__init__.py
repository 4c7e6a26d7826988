"""trak_core: TRAK data attribution as a pure library (no Prefect here)."""

from trak_core.featurize.gradients import (
    AbstractGradientComputer,
    FunctionalGradientComputer,
    IterativeGradientComputer,
    vectorize,
)
from trak_core.featurize.modelout import (
    TASK_TO_MODELOUT,
    AbstractModelOutput,
    CausalLMModelOutput,
    CLIPModelOutput,
    ImageClassificationModelOutput,
    IterativeImageClassificationModelOutput,
    TextClassificationModelOutput,
)
from trak_core.projection.projectors import (
    AbstractProjector,
    DenseProjector,
    NoOpProjector,
    ProjectionType,
    make_projector,
)
from trak_core.scoring.index import QueryResult, TrakIndex

from ._version import __version__
from .alpha import Alpha
from .errors import (
    BadInputError,
    IllConditionedWarning,
    NonFiniteGradientError,
    StateError,
    StoreLockedError,
    StoreMismatchError,
    TrakError,
)
from .store import StoreMetadata, TrakStore

__all__ = [
    "__version__",
    "AbstractModelOutput",
    "ImageClassificationModelOutput",
    "TextClassificationModelOutput",
    "CLIPModelOutput",
    "IterativeImageClassificationModelOutput",
    "CausalLMModelOutput",
    "TASK_TO_MODELOUT",
    "AbstractProjector",
    "NoOpProjector",
    "DenseProjector",
    "ProjectionType",
    "make_projector",
    "AbstractGradientComputer",
    "FunctionalGradientComputer",
    "IterativeGradientComputer",
    "vectorize",
    "TrakStore",
    "StoreMetadata",
    "TrakError",
    "BadInputError",
    "NonFiniteGradientError",
    "StateError",
    "StoreMismatchError",
    "StoreLockedError",
    "IllConditionedWarning",
    "Alpha",
    "TrakIndex",
    "QueryResult",
]

# traker 0.3.2's names live in the adapter package (trak_core.compat); they are resolved on first use, so that
# importing the core (the engine, the pipeline, the index) never imports the adapter nor registers its exit hook
_COMPAT_NAMES = {
    "TRAKer": "trak_core.compat.traker",
    "CudaProjector": "trak_core.compat.projectors",
    "ChunkedCudaProjector": "trak_core.compat.projectors",
    "BasicProjector": "trak_core.compat.projectors",
    "BasicSingleBlockProjector": "trak_core.compat.projectors",
    "AbstractScoreComputer": "trak_core.compat.score_computers",
    "BasicScoreComputer": "trak_core.compat.score_computers",
    "BasicSingleBlockScoreComputer": "trak_core.compat.score_computers",
    "install_trak_alias": "trak_core.compat.alias",
    "InputAssertionError": "trak_core.compat.errors",
    "ModelIDException": "trak_core.compat.errors",
    "StateAssertionError": "trak_core.compat.errors",
    "test_install": "trak_core.compat.utils",
}

__all__ += list(_COMPAT_NAMES)


def __getattr__(name: str):
    """``trak_core.TRAKer`` and traker's other names, imported from trak_core.compat when first asked for."""
    import importlib

    if name == "compat":
        return importlib.import_module("trak_core.compat")
    module = _COMPAT_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
