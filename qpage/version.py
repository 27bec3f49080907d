"""The package version (a leaf module, so that any module can read it without importing qpage)."""

__version__ = "0.1.0"
