"""Type stubs for the pagewire._native extension module."""

__version__: str
