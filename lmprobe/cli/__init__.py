"""The ``lmprobe`` command line (``lmprobe.cli:main``): one module per command group, each parsing its arguments
and calling the Python API."""

from .app import build_parser, main

__all__ = ["build_parser", "main"]
