"""A remote dataset's files fetched one call at a time into a folder of at most a budget (``LruFiles``).

For readers that fetch whole files as they go (``lmprobe report``, ``features``, ``export-saev`` and
``load(..., cache=)`` on a remote dataset), as opposed to ``storage.cache.BoundedCache``, which
downloads the pieces of a planned pass ahead. The folder lives under the same root and follows the
same rules (``storage.cachedir``): registered, removed by the next reader if this one is killed, no
link followed.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from pathlib import Path
from typing import Any

from ..base.paths import check_relpath
from ..base.safeio import lstat_inside, open_folder, remove_owned, remove_tree, replace_inside
from ..base.units import format_size
from ..errors import InvalidArgumentError, UnsafePathError
from .cachedir import (
    FolderLock,
    Registration,
    cache_root,
    check_root,
    collect_root,
    default_budget,
    disk_full,
    drop_claims,
    is_disk_full,
    new_reader_id,
)

__all__ = ["LruFiles"]


class LruFiles:
    """A remote dataset's files, fetched into a folder that never holds more than ``budget`` bytes.

    For readers that fetch files one call at a time (``lmprobe report``, ``features``,
    ``export-saev`` on a remote dataset): before a download, the least recently fetched files are
    deleted until the new one fits. A file a reader still has open keeps its disk space until it
    is closed. The folder is registered like a bounded cache's, so that the default budgets of other
    readers count it and the next reader removes it if this process is killed. Everything else
    (``download``, ``pin``, ``repo_files``) is the wrapped source's.
    """

    def __init__(self, files: Any, budget: int | None, *, root: Path | None = None):
        if budget is not None and budget <= 0:
            raise InvalidArgumentError(f"cache budget must be positive, got {budget}")
        self.files = files
        base = check_root(Path(root) if root is not None else cache_root())
        rid = new_reader_id()
        folder = base / f"files-{rid}"
        with FolderLock(base, below=base):
            collect_root(base, skip=folder)
            if budget is None:
                budget = default_budget(base)
            self._reg = Registration(folder, budget, rid=rid)
        drop_claims()
        self.budget, self.folder, self.root = int(budget), folder, base
        self.dir = folder / "data"
        os.close(open_folder(self.dir, below=base, create=True))
        self._have: dict[str, int] = {}  # rel -> bytes, least recently fetched first
        self.bytes = self.peak = 0
        self._lock = threading.Lock()

    def __str__(self) -> str:
        return str(self.files)

    def __getattr__(self, name: str) -> Any:
        if name in ("files", "_reg"):
            raise AttributeError(name)
        return getattr(self.files, name)

    def fetch(self, rel: str, *, what: str = "file") -> Path:
        check_relpath(rel, what)
        dst = self.dir / rel
        with self._lock:
            if rel in self._have:
                self._have[rel] = self._have.pop(rel)  # most recently used now
                return dst
            os.close(open_folder(dst.parent, below=self.root, create=True))
            tmp = dst.with_name(f".{dst.name}.{self._reg.rid}.part")
            try:
                self.files.download(rel, tmp)
                st = lstat_inside(tmp, below=self.root)
                if st is None or not stat.S_ISREG(st.st_mode):
                    raise UnsafePathError(f"the download of {rel} in {self.dir} was replaced by something else than a "
                                          "file (another user of this machine?): run again")
            except BaseException as exc:
                remove_owned(tmp, below=self.root)
                if is_disk_full(exc):
                    raise disk_full(self.folder, f"downloading {rel} from {self.files}") from exc
                raise
            size = st.st_size
            if size > self.budget:
                remove_owned(tmp, below=self.root)
                raise InvalidArgumentError(f"cache={format_size(self.budget)} cannot hold {rel} ({format_size(size)});"
                                           " give a larger --cache")
            while self._have and self.bytes + size > self.budget:
                old = next(iter(self._have))
                self.bytes -= self._have.pop(old)
                remove_owned(self.dir / old, below=self.root)
            replace_inside(tmp, dst, below=self.root)
            self._have[rel] = size
            self.bytes += size
            self.peak = max(self.peak, self.bytes)
            return dst

    def close(self) -> None:
        reg = self.__dict__.get("_reg")
        if reg is None or not reg.open:
            return
        with contextlib.suppress(OSError):
            reg.close()
            remove_tree(self.folder, below=self.root)

    def __del__(self) -> None:  # pragma: no cover - removed with the dataset
        with contextlib.suppress(Exception):
            self.close()
