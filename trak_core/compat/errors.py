"""traker 0.3.2's exception names, as subclasses of trak_core's errors (:mod:`trak_core.errors`): code written
against traker catches what it caught, code written against trak_core catches what it catches."""

from ..errors import BadInputError, StateError

__all__ = ["StateAssertionError", "InputAssertionError", "ModelIDException"]


class StateAssertionError(StateError, AssertionError):
    """A :class:`StateError` raised where traker 0.3.2 asserted (e.g. featurizing before ``load_checkpoint``).

    It is also an ``AssertionError`` and its message includes traker's, so code written against traker
    (``except AssertionError``, ``pytest.raises(AssertionError, match=...)``) keeps working."""


class InputAssertionError(BadInputError, AssertionError):
    """A :class:`BadInputError` raised where traker 0.3.2 asserted on its arguments (e.g. both or neither of
    ``inds`` / ``num_samples``); also an ``AssertionError``, with traker's message included."""


class ModelIDException(BadInputError):
    """traker's name (``trak.savers.ModelIDException``) for errors about model ids: an unregistered or not
    yet featurized ``model_id``. Also a :class:`BadInputError`."""
