"""The small files protocol a Dataset reads through, and its local-folder implementation.

A dataset's files can live in a local folder, a Hub repo or object storage (``lmprobe.storage``).
Each source offers what ``DatasetFiles`` lists: ``fetch(rel, what=...)`` returns a local path to the
dataset file ``rel`` (downloading it first when remote), ``has``, ``read_range`` and ``download`` read
without the whole file, ``pin`` fixes the version read, ``missing_hint(rel)`` says what to do when a
file is missing, and ``str(files)`` names the source in messages. ``find_index`` finds the index of a
local folder (or says why there is none).
"""

from __future__ import annotations

import os
import re
import shutil
from functools import cached_property
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from ..base.lock import writer_pid
from ..base.paths import resolve_inside
from ..base.safeio import check_regular, read_json
from ..errors import DatasetNotFoundError, LmprobeError
from .spec import INDEX_PATH, PULL_RECORD, STAGING_DIR

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")


class DatasetFiles(Protocol):
    """Where a dataset's files come from: everything a reader asks of them (LocalFiles here; storage/'s HubFiles,
    ObjectStoreFiles and LruFiles, which wraps one of them)."""

    #: False: the files are on this machine and read in place; True: fetched on demand (the Hub, object storage)
    remote: bool
    #: the Hub repo a local copy was pulled from (``lmprobe pull``), else None
    origin: str | None

    def fetch(self, rel: str, *, what: str = "file") -> Path:
        """A local path holding the dataset file ``rel`` (a relative POSIX path, checked)."""
        ...

    def has(self, rel: str) -> bool:
        """Whether the source holds the dataset file ``rel`` (a ``lmprobe pull --layers`` copy holds some shards)."""
        ...

    def read_range(self, rel: str, start: int, end: int, *, out: BinaryIO | None = None,
                   policy: Any = None) -> bytes | None:
        """Bytes ``start:end`` of ``rel``: returned, or written to the binary file ``out``."""
        ...

    def download(self, rel: str, dst: Path, *, policy: Any = None) -> None:
        """``rel`` copied to ``dst`` (a name of the caller's own: bounded caches)."""
        ...

    def listing(self) -> list[str]:
        """Every file the source holds, relative to it (a folder reader's layers: an SAE dictionary's)."""
        ...

    def pin(self) -> None:
        """Fix the version of every file now, so that a file changed while it is read is an error (the Hub pins
        its commit when opened; a local folder has one version)."""
        ...

    def missing_hint(self, rel: str) -> str:
        """A sentence for a missing file: what is missing and how to get it."""
        ...


class LocalFiles:
    """Dataset files in a local folder; only regular files inside the folder are ever returned."""

    remote = False

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

    def has(self, rel: str) -> bool:
        """Whether the dataset file ``rel`` is in the folder (a ``lmprobe pull --layers`` copy holds some shards)."""
        try:
            return resolve_inside(self.root, rel, "file").is_file()
        except LmprobeError:
            return False

    def read_range(self, rel: str, start: int, end: int, *, out: BinaryIO | None = None,
                   policy: Any = None) -> bytes | None:
        """Bytes ``start:end`` of ``rel`` (``policy``: remote sources' retries; unused here)."""
        with open(self.fetch(rel), "rb") as f:
            f.seek(start)
            data = f.read(max(0, end - start))
        if out is None:
            return data
        out.write(data)
        return None

    def download(self, rel: str, dst: Path, *, policy: Any = None) -> None:
        """``rel`` copied to ``dst``."""
        shutil.copyfile(self.fetch(rel), dst)

    def listing(self) -> list[str]:
        """Every regular file inside the folder, relative to it (links are not followed)."""
        found = []
        for top, _, names in os.walk(self.root):
            found += [(Path(top) / n).relative_to(self.root).as_posix() for n in names if (Path(top) / n).is_file()
                      and not (Path(top) / n).is_symlink()]
        return sorted(found)

    def pin(self) -> None:
        """A local folder has one version: nothing to fix."""

    @cached_property
    def origin(self) -> str | None:
        """The Hub repo this folder was copied from by ``lmprobe pull`` (its record, checked), else None."""
        if not (self.root / PULL_RECORD).is_file():
            return None
        try:
            rec = read_json(self.root / PULL_RECORD, what=PULL_RECORD)
        except LmprobeError:
            return None
        repo = rec.get("repo") if isinstance(rec, dict) else None
        return repo if isinstance(repo, str) and _REPO_ID.fullmatch(repo) else None

    def missing_hint(self, rel: str) -> str:
        if self.origin:
            return (f"{rel} is not in this copy of {self.origin}: `lmprobe pull {self.origin} --out {self.root}` "
                    "with the --layers you need fetches it")
        return f"{rel} is missing from {self.root}; the dataset is incomplete (re-copy or re-download it)"


def find_index(root: Path) -> Path:
    """The index file of a local dataset folder (the standard name, or the single parquet file in index/).

    Like every dataset file, it must be a regular file inside the folder (a symlink may point within it).
    """
    std = root / INDEX_PATH
    if std.exists() or std.is_symlink():
        return check_regular(resolve_inside(root, INDEX_PATH, "index"), "index")
    found = sorted((root / "index").glob("*.parquet")) if (root / "index").is_dir() else []
    if len(found) == 1:
        rel = found[0].relative_to(root).as_posix()
        return check_regular(resolve_inside(root, rel, "index"), "index")
    if not root.exists():
        hub = f" (a Hub dataset is hf://datasets/{root.as_posix()})" if re.fullmatch(r"[\w.-]+/[\w.-]+", str(root)) else ""
        raise DatasetNotFoundError(f"{root} does not exist{hub}")
    if (root / STAGING_DIR).exists():
        pid = writer_pid(root)
        if pid is not None:
            raise DatasetNotFoundError(f"{root} is being written by process {pid} (no index yet); wait for that run "
                                       "to finish")
        raise DatasetNotFoundError(
            f"{root} holds an unfinished dataset (no index yet); re-run the command that wrote it to resume"
        )
    raise DatasetNotFoundError(f"{root} holds no lmprobe dataset: {INDEX_PATH} is missing")
