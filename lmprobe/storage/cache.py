"""A bounded local cache for remote dataset files: downloads ahead, within a byte budget, deleted when done.

A published SAE dataset is terabytes; the disk of the node that trains from it is not. The reader
tells the cache which files it will need, in order (``schedule``); background workers download
them ahead of the consumer, several at a time, but never beyond ``budget`` bytes on local disk
(counting files being downloaded); the consumer takes a file (``get``, waiting for its download)
and gives it back (``release``); a file nobody needs any more is deleted at once, which frees
room for the next downloads. Files are counted in full from the moment their download starts.

>>> cache = BoundedCache(files.download, budget=20 * 2**30, sizes={"a.bin": 10})   # doctest: +SKIP
>>> cache.schedule(["a.bin"]); path = cache.get("a.bin"); ...; cache.release("a.bin")  # doctest: +SKIP
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError, ShardMissingError
from ..paths import check_relpath
from ..units import format_size, parse_size

#: the default budget: the smaller of this and half the free space where the cache lives
DEFAULT_CACHE_CAP = 20 * 2**30


def default_budget(where: Path) -> int:
    """min(20 GiB, half the free space of ``where``'s file system)."""
    where.mkdir(parents=True, exist_ok=True)
    return int(min(DEFAULT_CACHE_CAP, shutil.disk_usage(where).free // 2))


def cache_budget(cache: int | str | None, source: object, *, announce: bool) -> int:
    """The byte budget of a bounded cache for ``source``: ``cache`` parsed, else the default; ``announce``
    says it on stderr (a user who did not choose it learns what it is and how to change it)."""
    import sys

    budget = parse_size(cache) if cache is not None else default_budget(cache_root())
    if announce:
        print(f"lmprobe: reading {source} through a local cache of at most {format_size(budget)} "
              "(cache= / --cache to change it)", file=sys.stderr)
    return budget


def cache_root() -> Path:
    """Where bounded caches live: ``$LMPROBE_CACHE/stream`` (default ``~/.cache/lmprobe/stream``)."""
    return Path(os.environ.get("LMPROBE_CACHE", Path.home() / ".cache" / "lmprobe")) / "stream"


class BoundedCache:
    """Remote files on local disk within ``budget`` bytes; see the module docstring.

    ``download(key, dst)`` writes the item ``key`` (a file, or a byte range of one) to ``dst``;
    ``sizes`` gives each item's size in bytes (from the dataset's metadata: a download of another
    size is an error, as the remote changed); ``label`` names the remote in messages.
    ``on_bytes(n)``, if given, is called with the bytes on disk whenever they change (tests and
    benchmarks sample it). The cache's folder is removed by ``close()`` (or when the object goes).
    """

    def __init__(self, download: Callable[[str, Path], None], budget: int, sizes: dict[str, int], *,
                 label: str = "the remote", workers: int = 4, root: Path | None = None,
                 on_bytes: Callable[[int], None] | None = None):
        if budget <= 0:
            raise InvalidArgumentError(f"cache budget must be positive, got {budget}")
        self.download, self.label, self.budget, self.sizes = download, label, int(budget), dict(sizes)
        too_big = [rel for rel, n in self.sizes.items() if n > self.budget]
        if too_big:
            raise InvalidArgumentError(
                f"cache={format_size(self.budget)} cannot hold {too_big[0]} ({format_size(self.sizes[too_big[0]])}); "
                "give a larger cache= (--cache)")
        base = root or cache_root()
        base.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="reader-", dir=base))
        self.on_bytes = on_bytes
        self._cv = threading.Condition()
        self._queue: deque[str] = deque()  # files to download, in the order they will be needed
        self._need: dict[str, int] = {}  # rel -> scheduled uses not yet released
        self._state: dict[str, str] = {}  # rel -> "queued" | "loading" | "ready"
        self._errors: dict[str, BaseException] = {}
        self.bytes = 0  # bytes on disk, or reserved for a download under way
        self.peak = 0
        self.downloaded = 0  # files downloaded (a file needed again after its deletion counts twice)
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"lmprobe-fetch-{i}", daemon=True)
                         for i in range(max(1, workers))]
        for t in self._threads:
            t.start()

    # ---------------------------------------------------------------- the consumer's side

    def schedule(self, rels: Iterable[str]) -> None:
        """Files the consumer will ``get`` (once each per mention), in the order it will need them."""
        with self._cv:
            for rel in rels:
                if rel not in self.sizes:
                    raise InvalidArgumentError(f"{rel} is not a file of this dataset")
                self._need[rel] = self._need.get(rel, 0) + 1
                if rel not in self._state:
                    self._state[rel] = "queued"
                    self._queue.append(rel)
            self._cv.notify_all()

    def get(self, rel: str) -> Path:
        """The local path of a scheduled file, waiting for its download (its error, if it failed)."""
        with self._cv:
            if rel not in self._state:
                raise InvalidArgumentError(f"{rel} was not scheduled")
            while self._state.get(rel) != "ready" and rel not in self._errors:
                if self._closed:
                    raise RuntimeError("the cache is closed")
                self._cv.wait()
            if rel in self._errors:
                raise self._errors[rel]
            return self.dir / rel

    def release(self, rel: str) -> None:
        """One scheduled use of ``rel`` is over; the file is deleted when no scheduled use is left."""
        with self._cv:
            left = self._need.get(rel, 0) - 1
            if left > 0:
                self._need[rel] = left
                return
            self._need.pop(rel, None)
            state = self._state.pop(rel, None)
            if state == "queued":
                self._queue.remove(rel)
            elif state == "ready":
                (self.dir / rel).unlink(missing_ok=True)
                self._add_bytes(-self.sizes[rel])
            elif state == "loading":  # the worker deletes it when its download ends
                self._state[rel] = "dropped"
            self._errors.pop(rel, None)
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __del__(self) -> None:  # pragma: no cover - a reader dropped without close()
        if not getattr(self, "_closed", True):
            with self._cv:
                self._closed = True
                self._cv.notify_all()
            shutil.rmtree(self.dir, ignore_errors=True)

    # ---------------------------------------------------------------- the workers

    def _add_bytes(self, n: int) -> None:
        self.bytes += n
        self.peak = max(self.peak, self.bytes)
        if self.on_bytes is not None:
            self.on_bytes(self.bytes)

    def _next(self) -> str | None:
        """The next file to download, once the budget has room for it (strictly in order: none jumps the queue)."""
        with self._cv:
            while True:
                if self._closed:
                    return None
                if self._queue and self.bytes + self.sizes[self._queue[0]] <= self.budget:
                    rel = self._queue.popleft()
                    self._state[rel] = "loading"
                    self._add_bytes(self.sizes[rel])
                    return rel
                self._cv.wait()

    def _work(self) -> None:
        while (rel := self._next()) is not None:
            error: BaseException | None = None
            dst = self.dir / rel
            try:
                check_relpath(rel, "file")
                dst.parent.mkdir(parents=True, exist_ok=True)
                self.download(rel, dst)
                size = dst.stat().st_size
                if size != self.sizes[rel]:
                    raise ShardMissingError(
                        f"{rel} from {self.label} is {size} bytes, the dataset's metadata says {self.sizes[rel]}: the "
                        "remote dataset changed after it was opened; open it again")
            except BaseException as exc:  # handed to the consumer in get(), with its traceback
                error = exc
            with self._cv:
                self.downloaded += error is None
                if self._state.get(rel) == "dropped" or error is not None:
                    if self._state.get(rel) == "dropped":
                        self._state.pop(rel, None)
                    dst.unlink(missing_ok=True)
                    self._add_bytes(-self.sizes[rel])
                    if error is not None and rel in self._state:
                        self._errors[rel] = error
                else:
                    self._state[rel] = "ready"
                self._cv.notify_all()


class LruFiles:
    """A remote dataset's files, fetched into a folder that never holds more than ``budget`` bytes.

    For readers that fetch files one call at a time (``lmprobe report``, ``features``,
    ``export-saev`` on a remote dataset): before a download, the least recently fetched files are
    deleted until the new one fits. A file a reader still has open keeps its disk space until it
    is closed. Everything else (``download``, ``pin``, ``repo_files``) is the wrapped source's.
    """

    def __init__(self, files: Any, budget: int, *, root: Path | None = None):
        if budget <= 0:
            raise InvalidArgumentError(f"cache budget must be positive, got {budget}")
        self.files, self.budget = files, int(budget)
        base = root or cache_root()
        base.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="files-", dir=base))
        self._have: dict[str, int] = {}  # rel -> bytes, least recently fetched first
        self.bytes = self.peak = 0
        self._lock = threading.Lock()

    def __str__(self) -> str:
        return str(self.files)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.files, name)

    def fetch(self, rel: str, *, what: str = "file") -> Path:
        check_relpath(rel, what)
        dst = self.dir / rel
        with self._lock:
            if rel in self._have:
                self._have[rel] = self._have.pop(rel)  # most recently used now
                return dst
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(dst.name + ".part")
            self.files.download(rel, tmp)
            size = tmp.stat().st_size
            if size > self.budget:
                tmp.unlink(missing_ok=True)
                raise InvalidArgumentError(f"cache={format_size(self.budget)} cannot hold {rel} ({format_size(size)});"
                                           " give a larger --cache")
            while self._have and self.bytes + size > self.budget:
                old = next(iter(self._have))
                self.bytes -= self._have.pop(old)
                (self.dir / old).unlink(missing_ok=True)
            os.replace(tmp, dst)
            self._have[rel] = size
            self.bytes += size
            self.peak = max(self.peak, self.bytes)
            return dst

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def __del__(self) -> None:  # pragma: no cover - removed with the dataset
        if getattr(self, "dir", None) is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
