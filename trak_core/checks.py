"""The decorator every contract check of :mod:`trak_core.testing` and :mod:`trak_core.store_checks` wears."""

from __future__ import annotations

import functools


def _check(fn):
    """Make every failure of a check an AssertionError that starts with the check's name."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(obj, *args, **kwargs):
        try:
            return fn(obj, *args, **kwargs)
        except AssertionError as e:
            msg = str(e)
            raise AssertionError(msg if msg.startswith(name) else f"{name}: {msg}") from e
        except Exception as e:
            raise AssertionError(f"{name}: raised {type(e).__name__}: {e}") from e

    return wrapper
