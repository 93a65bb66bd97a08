"""The package version (one place: pyproject.toml reads it, every module that records it imports it)."""

__version__ = "0.1.0"
