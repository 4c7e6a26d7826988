"""traker 0.3.2's names over trak_core: an adapter that imports the core, never imported by it.

* :class:`~trak_core.compat.traker.TRAKer`: traker's front class, a stateful adapter over :mod:`trak_core.engine`;
* :mod:`~trak_core.compat.projectors`: ``CudaProjector`` / ``ChunkedCudaProjector`` / ``BasicProjector`` /
  ``BasicSingleBlockProjector`` (the dense projection);
* :mod:`~trak_core.compat.errors`: ``StateAssertionError``, ``InputAssertionError``, ``ModelIDException``;
* :mod:`~trak_core.compat.score_computers`, :mod:`~trak_core.compat.savers`: what ``score_computer=`` and
  ``saver=`` accept;
* :mod:`~trak_core.compat.utils`: ``trak.utils``;
* :mod:`~trak_core.compat.alias`: ``import trak`` resolved to all of the above.
"""

from .alias import install_trak_alias, trak_modules, uninstall_trak_alias
from .errors import InputAssertionError, ModelIDException, StateAssertionError
from .projectors import BasicProjector, BasicSingleBlockProjector, ChunkedCudaProjector, CudaProjector
from .score_computers import AbstractScoreComputer, BasicScoreComputer, BasicSingleBlockScoreComputer
from .traker import TRAKer
from .utils import test_install

__all__ = [
    "TRAKer",
    "CudaProjector",
    "ChunkedCudaProjector",
    "BasicProjector",
    "BasicSingleBlockProjector",
    "StateAssertionError",
    "InputAssertionError",
    "ModelIDException",
    "AbstractScoreComputer",
    "BasicScoreComputer",
    "BasicSingleBlockScoreComputer",
    "install_trak_alias",
    "uninstall_trak_alias",
    "trak_modules",
    "test_install",
]
