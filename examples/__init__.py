"""Runnable examples. The embedded default used by ``trakflow demo`` is :mod:`trakflow_demo_data.digits`, shipped with
the package (``examples.digits`` names it too); ``examples.tiny`` is a seconds-fast synthetic set used by the tests."""
