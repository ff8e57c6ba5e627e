"""lmprobe: language-model activations, extracted once, stored in an open format, read by anyone.

>>> import lmprobe
>>> ds = lmprobe.load("path/or/owner/name")   # doctest: +SKIP
>>> X, y = ds.hidden(ds.layers[-1]), ds.labels  # doctest: +SKIP
"""

from __future__ import annotations

__version__ = "0.1.0"

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .format.reader import Dataset
    from .format.writer import DatasetWriter

__all__ = ["Dataset", "DatasetWriter", "extract", "load", "push_to_hub", "validate", "__version__"]


def push_to_hub(path: Any, repo_id: str, **kwargs: Any) -> str:
    """Publish a dataset folder to a Hub dataset repo (resumable). See ``lmprobe.hub.push_to_hub``."""
    from .hub import push_to_hub as _push

    return _push(path, repo_id, **kwargs)


def extract(model: str, prompts: Any, *, out: Any, **kwargs: Any) -> Dataset:
    """Run ``model`` over ``prompts`` and write an lmprobe dataset to ``out``; returns it loaded.

    >>> ds = lmprobe.extract("lmprobe-tiny", "examples/prompts.jsonl", out="out/tiny")  # doctest: +SKIP

    See ``lmprobe.extraction.runner.extract`` for every option.
    """
    from .extraction.runner import extract as _extract

    return _extract(model, prompts, out=out, **kwargs)


def load(path: Any, **kwargs: Any) -> Dataset:
    """Open an lmprobe dataset: a local folder or a Hub repo. See ``lmprobe.format.reader.load``."""
    from .format.reader import load as _load

    return _load(path, **kwargs)


def validate(path: Any, **kwargs: Any):
    """Check a dataset against the format document; returns a report (see ``lmprobe.format.validate``)."""
    from .format.validate import validate as _validate

    return _validate(path, **kwargs)


def __getattr__(name: str) -> Any:
    # torch, transformers and pyarrow load only when a name that needs them is used
    if name == "Dataset":
        from .format.reader import Dataset

        return Dataset
    if name == "DatasetWriter":
        from .format.writer import DatasetWriter

        return DatasetWriter
    raise AttributeError(f"module 'lmprobe' has no attribute {name!r}")
