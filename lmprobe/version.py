"""The package version, in a module of its own so that every layer can record it without importing the package."""

__version__ = "0.1.0"
