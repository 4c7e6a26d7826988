"""trak_core: TRAK data attribution as a pure library (no Prefect here)."""

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
from .gradients import AbstractGradientComputer, FunctionalGradientComputer, IterativeGradientComputer, vectorize
from .index import QueryResult, TrakIndex
from .modelout import (
    TASK_TO_MODELOUT,
    AbstractModelOutput,
    CausalLMModelOutput,
    CLIPModelOutput,
    ImageClassificationModelOutput,
    IterativeImageClassificationModelOutput,
    TextClassificationModelOutput,
)
from .projectors import (
    AbstractProjector,
    BasicProjector,
    BasicSingleBlockProjector,
    DenseProjector,
    NoOpProjector,
    ProjectionType,
    make_projector,
)
from .store import StoreMetadata, TrakStore

__all__ = [
    "__version__",
    "TRAKer",
    "AbstractModelOutput",
    "ImageClassificationModelOutput",
    "TextClassificationModelOutput",
    "CLIPModelOutput",
    "IterativeImageClassificationModelOutput",
    "CausalLMModelOutput",
    "TASK_TO_MODELOUT",
    "AbstractProjector",
    "NoOpProjector",
    "BasicProjector",
    "BasicSingleBlockProjector",
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

# traker 0.3.2's names: the adapter package (imported here; no core module imports it)
from .compat import (
    AbstractScoreComputer,
    BasicScoreComputer,
    BasicSingleBlockScoreComputer,
    ChunkedCudaProjector,
    CudaProjector,
    TRAKer,
    install_trak_alias,
    test_install,
)
from .errors import InputAssertionError, ModelIDException, StateAssertionError

__all__ += [
    "CudaProjector",
    "ChunkedCudaProjector",
    "AbstractScoreComputer",
    "BasicScoreComputer",
    "BasicSingleBlockScoreComputer",
    "install_trak_alias",
    "InputAssertionError",
    "ModelIDException",
    "StateAssertionError",
    "test_install",
]
