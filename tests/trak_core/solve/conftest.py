"""Fixtures of the curvature tests."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["pairs", "grid"])
def block_form(request, monkeypatch):
    """The tiny layers get pairs (their default) or, with pairs switched off, the (k_out, k_in) grid."""
    if request.param == "grid":
        from trak_core.projection import layout

        for name in ("PAIRS_MAX_WEIGHTS", "PAIRS_MAX_MACS", "PAIRS_MAX_RATIO"):
            monkeypatch.setattr(layout, name, 0)
    return request.param
