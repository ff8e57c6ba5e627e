"""The lmprobe dataset format 2.0: writer, reader, validator (docs/format.md is the document)."""

from .reader import Dataset, LocalFiles, load
from .spec import FORMAT_VERSION
from .writer import DatasetWriter

__all__ = ["Dataset", "DatasetWriter", "FORMAT_VERSION", "LocalFiles", "load"]
