"""The small files protocol a Dataset reads through, and its local-folder implementation.

A dataset's files can live in a local folder, a Hub repo or object storage (``lmprobe.storage``).
Each source offers the same three things: ``fetch(rel, what=...)`` returns a local path to the
dataset file ``rel`` (downloading it first when remote), ``missing_hint(rel)`` says what to do
when a file is missing, and ``str(files)`` names the source in messages.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from ..paths import resolve_inside
from ..safeio import check_regular


class DatasetFiles(Protocol):
    """Where a dataset's files come from."""

    def fetch(self, rel: str, *, what: str = "file") -> Path:
        """A local path holding the dataset file ``rel`` (a relative POSIX path, checked)."""
        ...

    def missing_hint(self, rel: str) -> str:
        """A sentence for a missing file: what is missing and how to get it."""
        ...


class LocalFiles:
    """Dataset files in a local folder; only regular files inside the folder are ever returned."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def __str__(self) -> str:
        return str(self.root)

    def fetch(self, rel: str, *, what: str = "file") -> Path:
        """Local path of the dataset file ``rel``: refused if it lies outside the root or is not a regular file."""
        path = resolve_inside(self.root, rel, what)
        if path.exists():
            check_regular(path, what)
        return path

    def missing_hint(self, rel: str) -> str:
        return f"{rel} is missing from {self.root}; the dataset is incomplete (re-copy or re-download it)"
