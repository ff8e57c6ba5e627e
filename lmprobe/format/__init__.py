"""The lmprobe dataset format 2.0: writer, reader, validator (docs/format.md is the document).

This layer knows local folders only; ``lmprobe.load`` opens datasets anywhere (the Hub, object storage).
"""

from .datasetspec import DatasetSpec
from .dtypes import FORMAT_VERSION
from .files import DatasetFiles, LocalFiles
from .reader import Dataset, open_local
from .validate import Report, validate
from .writer import DatasetWriter

__all__ = ["Dataset", "DatasetFiles", "DatasetSpec", "DatasetWriter", "FORMAT_VERSION", "LocalFiles", "Report",
           "open_local", "validate"]
