"""``TRAKer(saver=...)``: trak_core keeps everything in one Zarr store, so traker's default saver is the only
choice it accepts (meaning: the store), and any other is refused with what to use instead."""

from __future__ import annotations

from ..errors import BadInputError

SAVER_HELP = (
    "trak_core keeps everything in one Zarr store (trak_core.store): give TRAKer a save_dir "
    "(a path or an fsspec URL such as s3://bucket/run.zarr, with storage_options=...) instead of a "
    "saver class"
)


def traker_class(cls, name: str) -> bool:
    """Whether ``cls`` is traker's own class ``name`` (e.g. when the real trak is installed next to us)."""
    mod = getattr(cls, "__module__", "")
    return getattr(cls, "__name__", None) == name and mod.split(".")[0] == "trak"


def check_saver(saver) -> None:
    """``None`` or traker's ``MmapSaver`` (its default; ours is the Zarr store); anything else is refused."""
    if saver is None or traker_class(saver, "MmapSaver"):
        return
    raise BadInputError(f"TRAKer(saver={getattr(saver, '__name__', saver)!r}) is not supported: {SAVER_HELP}")
