"""lmprobe: language-model activations, extracted once, stored in an open format, read by anyone.

>>> import lmprobe
>>> ds = lmprobe.load("path/or/owner/name")   # doctest: +SKIP
>>> X, y = ds.hidden(ds.layers[-1]), ds.labels  # doctest: +SKIP

The API lives in ``lmprobe.api`` (and ``lmprobe.format`` for ``Dataset``/``DatasetWriter``); its
names load on first use, so that ``import lmprobe.sae`` stays free of numpy, pyarrow and torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .base import progress as _progress  # noqa: F401  (the lmprobe logger's handler, before any module logs)
from .errors import LmprobeError
from .version import __version__

if TYPE_CHECKING:
    from .api import (
        export_saelens,
        extract,
        features,
        hookpoints,
        import_saelens,
        info,
        load,
        merge,
        plan,
        pull,
        push_to_hub,
        report,
        validate,
    )
    from .extraction.config import ExtractionConfig
    from .format.reader import Dataset
    from .format.writer import DatasetWriter

_LAZY = {
    "export_saelens": "api",
    "import_saelens": "api",
    "info": "api",
    "extract": "api",
    "load": "api",
    "merge": "api",
    "plan": "api",
    "pull": "api",
    "push_to_hub": "api",
    "validate": "api",
    "report": "api",
    "features": "api",
    "hookpoints": "api",
    "ExtractionConfig": "extraction.config",
    "Dataset": "format.reader",
    "DatasetWriter": "format.writer",
}

__all__ = ["Dataset", "DatasetWriter", "ExtractionConfig", "LmprobeError", "__version__", "export_saelens", "extract",
           "features", "hookpoints", "import_saelens", "info", "load", "merge", "plan", "pull", "push_to_hub", "report", "validate"]


def __getattr__(name: str) -> Any:
    # PEP 562: the API's modules import numpy and pyarrow, so they load when a name is first used
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lmprobe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
