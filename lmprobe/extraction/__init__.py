"""Extraction: prompt sources, model loading, backends, the configuration and the resumable runner.

``lmprobe.api.run_extraction`` (and its alias ``lmprobe.extract``) runs an extraction; ``runner.execute`` is its
step in this layer."""

from .config import ExtractionConfig

__all__ = ["ExtractionConfig"]
