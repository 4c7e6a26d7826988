"""The package version (read by setuptools without importing trak_core)."""

__version__ = "0.1.0"
