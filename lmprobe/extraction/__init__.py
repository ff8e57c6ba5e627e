"""Extraction: prompt sources, model loading, backends, the configuration and the resumable runner."""

from .config import ExtractionConfig
from .runner import run

__all__ = ["ExtractionConfig", "run"]
