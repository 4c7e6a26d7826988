"""Exceptions and warnings raised by trak_core. Every message names what is wrong."""


class TrakError(Exception):
    """Base class of trakflow's errors."""


class BadInputError(TrakError, ValueError):
    """The caller passed something malformed (shapes, labels, indices, config fields)."""


class NonFiniteGradientError(BadInputError):
    """NaN or inf in gradients or model outputs; nothing was written."""

    def __init__(self, model_id, indices, what="gradients"):
        self.model_id = model_id
        self.indices = list(dict.fromkeys(indices))  # once each (a batch's padding repeats its last row)
        shown = self.indices[:20]
        more = "" if len(self.indices) <= 20 else f" (and {len(self.indices) - 20} more)"
        super().__init__(
            f"non-finite {what} (NaN or inf) for model_id={model_id} at example indices {shown}{more}; "
            "nothing was written for this batch. Check the checkpoint and these inputs."
        )


class StoreMismatchError(TrakError, ValueError):
    """A store was reopened with settings that differ from the ones it was created with."""


class StateError(TrakError, RuntimeError):
    """An operation was called in the wrong order (e.g. featurize after finalize)."""


class StoreDamageError(StateError):
    """The store is damaged: a chunk of rows marked written is missing or fails its crc32c checksum, an
    array's zarr.json differs from the store's metadata, or arrays lie where the root metadata is missing.
    The message names the array and the chunk. Never retried (a :class:`StateError`): ``trakflow verify STORE
    --repair`` unflags the damaged rows, and a rerun recomputes them."""


class StoreLockedError(TrakError, RuntimeError):
    """Another live run holds the store's lock."""


class LockLostError(StoreLockedError, StateError):
    """The run's lock was removed or taken by another run while it was writing: it stops before committing
    more row flags (also a :class:`StateError`, so a task is not retried)."""


class IllConditionedWarning(UserWarning):
    """XᵀX (+ λI) is singular or badly conditioned: scores would be dominated by round-off."""
