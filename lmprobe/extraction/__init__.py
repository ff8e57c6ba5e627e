"""Extraction: prompt sources, model loading, backends, and the resumable runner."""

from .runner import ExtractionError, extract

__all__ = ["ExtractionError", "extract"]
