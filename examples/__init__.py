"""Runnable examples. ``examples.digits`` is the embedded default used by ``trakflow demo``;
``examples.tiny`` is a seconds-fast synthetic set used by the tests."""
