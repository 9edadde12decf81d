"""The engine's version, in a leaf module: the package face and the registry (the built-in plugins' version) read it."""

__version__ = "0.1.0"
