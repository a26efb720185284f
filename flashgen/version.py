"""The package version (one place; flashgen/__init__.py re-exports it)."""

__version__ = "0.1.0"
