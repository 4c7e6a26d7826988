"""trak_core: TRAK data attribution as a pure library (no Prefect here)."""

from ._version import __version__ as __version__
from .errors import (  # noqa: E402
    BadInputError,
    IllConditionedWarning,
    NonFiniteGradientError,
    StateError,
    StoreLockedError,
    StoreMismatchError,
    TrakError,
)
from .gradients import AbstractGradientComputer, FunctionalGradientComputer, IterativeGradientComputer, vectorize  # noqa: E402
from .modelout import (  # noqa: E402
    TASK_TO_MODELOUT,
    AbstractModelOutput,
    CLIPModelOutput,
    ImageClassificationModelOutput,
    IterativeImageClassificationModelOutput,
    TextClassificationModelOutput,
)
from .projectors import (  # noqa: E402
    AbstractProjector,
    BasicProjector,
    BasicSingleBlockProjector,
    DenseProjector,
    NoOpProjector,
    ProjectionType,
    make_projector,
)
from .store import StoreMetadata, TrakStore  # noqa: E402
from .traker import TRAKer  # noqa: E402

try:  # written in parallel; optional until it lands
    from .alpha import Alpha  # noqa: E402,F401
except ImportError:  # pragma: no cover
    pass

__all__ = [
    "TRAKer",
    "AbstractModelOutput",
    "ImageClassificationModelOutput",
    "TextClassificationModelOutput",
    "CLIPModelOutput",
    "IterativeImageClassificationModelOutput",
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
]

# traker 0.3.2's remaining names (trak_core/compat.py, trak_core/utils.py) and the ``trak`` alias
from .compat import (  # noqa: E402
    AbstractSaver,
    AbstractScoreComputer,
    BasicScoreComputer,
    BasicSingleBlockScoreComputer,
    ChunkedCudaProjector,
    CudaProjector,
    MmapSaver,
    install_trak_alias,
)
from .errors import InputAssertionError, ModelIDException, StateAssertionError  # noqa: E402
from .utils import test_install  # noqa: E402

__all__ += [
    "CudaProjector",
    "ChunkedCudaProjector",
    "AbstractSaver",
    "MmapSaver",
    "AbstractScoreComputer",
    "BasicScoreComputer",
    "BasicSingleBlockScoreComputer",
    "install_trak_alias",
    "InputAssertionError",
    "ModelIDException",
    "StateAssertionError",
    "test_install",
]
