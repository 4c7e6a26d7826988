"""The root metadata, kept three times and sealed: in the root zarr.json and, as copies, in ``models/`` and
``experiments/`` zarr.json, each beside the sha256 of its canonical JSON. An edited or damaged root fails its seal
and is restored from a copy that passes; the arrays are then checked against what the seal vouches for."""

from __future__ import annotations

import hashlib
import json
from collections.abc import MutableMapping
from typing import Any, cast

import zarr

#: attribute keys: the metadata and its seal (root), a sealed copy (models/, experiments/)
META_KEY = "trakflow"
SEAL_KEY = "trakflow_sha256"
COPY_KEY = "trakflow_root"
COPY_GROUPS = ("models", "experiments")


def seal(doc: Any) -> str:
    """sha256 of the canonical JSON of ``doc``."""
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_root(group: zarr.Group, doc: dict) -> None:
    """Write the root metadata ``doc`` sealed, and its sealed copies (creation, or repair)."""
    record: dict[str, Any] = {META_KEY: doc, SEAL_KEY: seal(doc)}
    for name in COPY_GROUPS:
        cast(MutableMapping[str, Any], group.require_group(name).attrs)[COPY_KEY] = record
    cast(MutableMapping[str, Any], group.attrs).update(record)


def _copies(group: zarr.Group) -> list[tuple[str, dict | None]]:
    """Each copy group's sealed copy of the root metadata (None: absent or failing its seal)."""
    out: list[tuple[str, dict | None]] = []
    for name in COPY_GROUPS:
        try:
            node = group[name]
            rec = dict(node.attrs).get(COPY_KEY)
        except (KeyError, TypeError, ValueError):
            rec = None
        ok = isinstance(rec, dict) and isinstance(rec.get(META_KEY), dict) and rec.get(SEAL_KEY) == seal(rec[META_KEY])
        out.append((name, rec[META_KEY] if ok and isinstance(rec, dict) else None))
    return out


def _differences(have: Any, want: dict) -> str:
    if not isinstance(have, dict):
        return f"it is {type(have).__name__}, not a mapping"
    fields = sorted((k for k in set(have) | set(want) if have.get(k) != want.get(k)), key=lambda k: (k not in have, k))
    return ", ".join(f"{k}={have.get(k)!r} (sealed: {want.get(k)!r})" for k in fields[:4]) or "its seal differs"


def read_root(group: zarr.Group, check_copies: bool = True) -> tuple[dict, str | None, list[str]]:
    """The root metadata the seals vouch for: ``(doc, root_problem, copy_problems)``. ``root_problem`` (None:
    intact) says what in the root differs from an intact copy (``doc`` is then the copy's); ``copy_problems``
    names each copy that is missing or fails its seal (read only with ``check_copies`` or a damaged root).
    Raises KeyError when no intact record exists, with what was found."""
    attrs: dict[str, Any] = dict(group.attrs)
    doc = attrs.get(META_KEY)
    intact = isinstance(doc, dict) and attrs.get(SEAL_KEY) == seal(doc)
    root: dict = doc if isinstance(doc, dict) else {}
    if intact and not check_copies:
        return root, None, []
    copies = _copies(group)
    good = [c for _, c in copies if c is not None]
    if intact:
        why = {
            name: "is missing or fails its seal" if c is None else "differs from the root"
            for name, c in copies
            if c != doc
        }
        return root, None, [f"{name}/zarr.json: its copy of the root metadata {w}" for name, w in why.items()]
    copy_problems = [
        f"{name}/zarr.json: its copy of the root metadata is missing or fails its seal"
        for name, c in copies
        if c is None
    ]
    if not good:
        raise KeyError("the root metadata fails its seal and no intact copy is left (models/, experiments/)")
    return good[0], "root zarr.json: its trakflow metadata fails its seal: " + _differences(doc, good[0]), copy_problems
