"""Kept for imports of ``trak_core.verify``: the checks and repair live in :mod:`trak_core.store.verify`."""

from .store.verify import (
    ArrayCheck,
    ChunkDamage,
    RepairResult,
    VerifyReport,
    repair_store,
    require_present,
    verify_location,
    verify_store,
)

__all__ = [
    "ArrayCheck",
    "ChunkDamage",
    "RepairResult",
    "VerifyReport",
    "repair_store",
    "require_present",
    "verify_location",
    "verify_store",
]
