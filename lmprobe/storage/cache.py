"""Bounded local caches for remote dataset files: downloads ahead, within a byte budget, deleted when done.

A published SAE dataset is terabytes; the disk of the node that trains from it is not. The reader
tells the cache which pieces it will need, in order (``schedule``); background workers download
them ahead of the consumer, several at a time, but never beyond ``budget`` bytes on local disk
(counting pieces being downloaded); the consumer takes a piece (``get``, waiting for its download)
and gives it back (``release``); a piece nobody needs any more is deleted at once, which frees
room for the next downloads.

The folder is shared by every process of the machine that reads the same remote (``key``): ranks
and DataLoader workers on one node download each piece once, the budget holds for the folder as a
whole, a piece is visible only once complete, and what a killed reader leaves is removed by the next
one (``storage.cachedir`` has the layout and the locks).

>>> cache = BoundedCache(files.download, budget=20 * 2**30, key="acts@abc")   # doctest: +SKIP
>>> cache.schedule([("a.bin", 10)]); path = cache.get("a.bin"); ...; cache.release("a.bin")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..base.paths import check_relpath
from ..base.units import format_size, parse_size
from ..errors import InvalidArgumentError, LmprobeError, OutOfSpaceError
from .cachedir import (
    DEFAULT_CACHE_CAP,
    FolderLock,
    Registration,
    cache_root,
    claim_default_budget,
    collect,
    collect_root,
    default_budget,
    drop_claims,
    held_elsewhere,
    is_alive,
    live_readers,
    new_reader_id,
    parse_part,
    part_name,
    reader_budgets,
    usage,
)

__all__ = ["BoundedCache", "LruFiles", "cache_budget", "cache_root", "DEFAULT_CACHE_CAP", "disk_full",
           "is_disk_full"]

logger = logging.getLogger(__name__)

#: seconds a reader waits for room in a folder that other readers filled before it says so, and
#: (``patience``, default) before it gives up
ROOM_WARN_AFTER = 30.0
DEFAULT_PATIENCE = 1800.0


def cache_budget(cache: int | str | None, source: object, *, announce: bool) -> int:
    """The byte budget of a bounded cache for ``source``: ``cache`` parsed, else the default (claimed at once,
    counting the budgets of this machine's other readers); ``announce`` says it on stderr (a user who did not
    choose it learns what it is and how to change it)."""
    budget = parse_size(cache) if cache is not None else claim_default_budget(cache_root())
    if budget <= 0:
        raise InvalidArgumentError(f"the disk holding {cache_root()} has no room for a cache (the default budget is "
                                   "half of what is free after this machine's other readers): free some space or "
                                   "point LMPROBE_CACHE at another disk")
    if announce:
        announce_budget(source, budget)
    return budget


def announce_budget(source: object, budget: int) -> None:
    """Say on stderr which cache a remote ``source`` is read through (a user who did not choose it learns what it
    is and how to change it)."""
    logger.info(f"lmprobe: reading {source} through a local cache of at most {format_size(budget)} "
                "(cache= / --cache to change it)")


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def disk_full(where: Path, what: str) -> OutOfSpaceError:
    """One line for a full disk under a cache: what was being written, what is free, what to do."""
    try:
        free = format_size(shutil.disk_usage(where).free)
    except OSError:
        free = "?"
    return OutOfSpaceError(f"the disk holding the cache {where} is full ({free} free) while {what}: free some "
                           "space, give a smaller cache= (--cache), or point LMPROBE_CACHE at a larger disk")


class BoundedCache:
    """Remote pieces on local disk within ``budget`` bytes, shared by the processes of a machine; see the module
    docstring.

    ``download(name, dst)`` writes piece ``name`` to the path ``dst`` (it checks what it can: sizes,
    checksums); ``key`` names the folder under ``root`` (default ``$LMPROBE_CACHE/stream``) that every
    reader of the same remote shares (None: a private folder); ``budget`` is for the whole folder
    (None: the folder's, when other readers use it, else the default); ``share``: this reader holds at
    most ``budget // share`` of it (the readers a launch starts on one machine each get their share,
    so none waits for room another needs to progress); ``sizes`` (optional) gives the size of names
    scheduled without one; ``label`` names the remote in messages; ``on_bytes(n)`` is called with this
    reader's bytes whenever they change.
    """

    def __init__(self, download: Callable[[str, Path], None], budget: int | None = None, *, key: str | None = None,
                 sizes: dict[str, int] | None = None, label: str = "the remote", workers: int = 4,
                 root: Path | None = None, share: int = 1, on_bytes: Callable[[int], None] | None = None,
                 patience: float = DEFAULT_PATIENCE):
        if budget is not None and budget <= 0:
            raise InvalidArgumentError(f"cache budget must be positive, got {budget}")
        self.download, self.label, self.sizes = download, label, dict(sizes or {})
        self.root = Path(root) if root is not None else cache_root()
        self.root.mkdir(parents=True, exist_ok=True)
        rid = new_reader_id()
        self.folder = self.root / (key if key is not None else f"reader-{rid}")
        check_relpath(self.folder.name, "cache folder")
        with FolderLock(self.root):  # the budget is decided and the reader registered at once
            collect_root(self.root, skip=self.folder)
            with FolderLock(self.folder):
                collect(self.folder)
                if budget is None:
                    others = reader_budgets(self.folder)
                    budget = max(others) if others else default_budget(self.root)
                self._reg = Registration(self.folder, budget, rid=rid)
        drop_claims()
        if budget <= 0:
            self._reg.close()
            raise InvalidArgumentError(f"the disk holding {self.root} has no room for a cache: free some space or "
                                       "point LMPROBE_CACHE at another disk")
        self.budget = int(budget)
        self.cap = max(1, self.budget // max(1, int(share)))
        too_big = [rel for rel, n in self.sizes.items() if n > self.cap]
        if too_big:
            self.close()
            raise InvalidArgumentError(
                f"cache={format_size(self.budget)} cannot hold {too_big[0]} ({format_size(self.sizes[too_big[0]])}); "
                "give a larger cache= (--cache)")
        self.dir = self.folder / "pieces"
        self.parts = self.folder / "parts"
        self.notes = self.folder / "notes"
        for d in (self.dir, self.parts, self.notes):
            d.mkdir(parents=True, exist_ok=True)
        self.on_bytes, self.patience = on_bytes, float(patience)
        self._lock = FolderLock(self.folder)
        self._cv = threading.Condition()
        self._queue: deque[str] = deque()  # pieces to download, in the order they will be needed
        self._need: dict[str, int] = {}  # name -> scheduled uses not yet released
        self._state: dict[str, str] = {}  # name -> "queued" | "loading" | "ready" | "dropped"
        self._errors: dict[str, BaseException] = {}
        self.bytes = 0  # this reader's bytes: pieces it holds, and downloads it reserved
        self.peak = 0
        self.downloaded = 0  # pieces this reader downloaded (a piece needed again after its deletion counts twice)
        self.shared = 0  # pieces another reader of this machine had downloaded or was downloading
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"lmprobe-fetch-{i}", daemon=True)
                         for i in range(max(1, workers))]
        for t in self._threads:
            t.start()

    # ---------------------------------------------------------------- the consumer's side

    def schedule(self, items: Iterable[str | tuple[str, int]]) -> None:
        """Pieces the consumer will ``get`` (once each per mention), in the order it will need them: names, or
        (name, size) pairs."""
        with self._cv:
            for item in items:
                name, size = (item, self.sizes.get(item)) if isinstance(item, str) else item
                if size is None:
                    raise InvalidArgumentError(f"{name} is not a file of this dataset")
                if size > self.cap:
                    raise InvalidArgumentError(f"cache={format_size(self.budget)} cannot hold {name} "
                                               f"({format_size(size)}); give a larger cache= (--cache)")
                check_relpath(name, "cache piece")
                self.sizes[name] = int(size)
                self._need[name] = self._need.get(name, 0) + 1
                if name not in self._state:
                    self._state[name] = "queued"
                    self._queue.append(name)
            self._cv.notify_all()

    def get(self, name: str) -> Path:
        """The local path of a scheduled piece, waiting for its download (its error, if it failed)."""
        with self._cv:
            if name not in self._state:
                raise InvalidArgumentError(f"{name} was not scheduled")
            while self._state.get(name) != "ready" and name not in self._errors:
                if self._closed:
                    raise RuntimeError("the cache is closed")
                self._cv.wait()
            if name in self._errors:
                raise self._errors[name]
            return self.dir / name

    def release(self, name: str) -> None:
        """One scheduled use of ``name`` is over; it is deleted when no use (of any reader here) is left."""
        with self._cv:
            left = self._need.get(name, 0) - 1
            if left > 0:
                self._need[name] = left
                return
            self._need.pop(name, None)
            state = self._state.pop(name, None)
            if state == "queued":
                self._queue.remove(name)
            elif state == "ready":
                self._unhold(name)
                self._add_bytes(-self.sizes[name])
            elif state == "loading":  # the worker lets it go when its download ends
                self._state[name] = "dropped"
            self._errors.pop(name, None)
            if state != "loading":
                self.sizes.pop(name, None)
            self._cv.notify_all()

    def note(self, name: str, text: str | None = None) -> str | None:
        """A small fact shared by the readers of this folder (where a shard's rows start): written when ``text`` is
        given, else read (None when nobody wrote it)."""
        path = self.notes / name
        if text is None:
            try:
                return path.read_text()[:4096]
            except (FileNotFoundError, UnicodeDecodeError):
                return None
        tmp = path.with_name(f".{path.name}.{self._reg.rid}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        return text

    def folder_bytes(self) -> int:
        """Bytes in the whole folder: every reader's pieces and downloads under way."""
        return usage(self.folder)

    def close(self) -> None:
        """Stop the downloads, let go of this reader's pieces, and remove the folder if no other reader uses it."""
        self._closed = True
        cv = self.__dict__.get("_cv")
        if cv is not None:
            with cv:
                cv.notify_all()
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join(timeout=60)
        reg = self.__dict__.get("_reg")
        if reg is None or not reg.open:
            return
        with contextlib.suppress(OSError), FolderLock(self.folder):
            reg.close()
            collect(self.folder)
            if not live_readers(self.folder):
                shutil.rmtree(self.folder, ignore_errors=True)

    def __del__(self) -> None:  # pragma: no cover - a reader dropped without close()
        with contextlib.suppress(Exception):
            if getattr(self, "_reg", None) is not None and self._reg.open:
                self._closed = True
                with self._cv:
                    self._cv.notify_all()
                with FolderLock(self.folder):
                    self._reg.close()
                    collect(self.folder)

    # ---------------------------------------------------------------- the workers

    def _add_bytes(self, n: int) -> None:
        self.bytes += n
        self.peak = max(self.peak, self.bytes)
        if self.on_bytes is not None:
            self.on_bytes(self.bytes)

    def _unhold(self, name: str) -> None:
        """This reader is done with ``name``: delete it unless another reader of the folder holds it."""
        with self._lock:
            (self._reg.holds / name).unlink(missing_ok=True)
            if not held_elsewhere(self.folder, name, self._reg.rid):
                (self.dir / name).unlink(missing_ok=True)

    def _claim(self, name: str, size: int) -> str | None:
        """Under the folder's lock: "ready" (another reader downloaded it), "other" (another reader is downloading
        it), "download" (room reserved: this reader downloads it), or None (no room in the folder yet)."""
        with self._lock:
            hold = self._reg.holds / name
            hold.touch()
            if (self.dir / name).exists():
                return "ready"
            for e in os.scandir(self.parts):
                parsed = parse_part(e.name)
                if parsed and parsed[0] == name and parsed[1] != self._reg.rid \
                        and is_alive(self.folder / "readers" / parsed[1]):
                    return "other"
            if usage(self.folder) + size > self.budget:
                collect(self.folder, keep=self._reg.rid)  # what dead readers left may be in the way
            if usage(self.folder) + size <= self.budget:
                (self.parts / part_name(name, self._reg.rid, size)).touch()
                return "download"
            hold.unlink(missing_ok=True)
            return None

    def _next(self) -> tuple[str, str] | None:
        """The next piece to fetch, once this reader's share and the folder have room for it (strictly in order:
        none jumps the queue)."""
        waiting_since: float | None = None
        warned = False
        with self._cv:
            while True:
                if self._closed:
                    return None
                if not self._queue or self.bytes + self.sizes[self._queue[0]] > self.cap:
                    waiting_since = None
                    self._cv.wait()
                    continue
                name = self._queue[0]
                mode = self._claim(name, self.sizes[name])
                if mode is None:  # other readers of this machine fill the folder: wait for them to free room
                    now = time.monotonic()
                    waiting_since = waiting_since or now
                    if not warned and now - waiting_since > ROOM_WARN_AFTER:
                        warned = True
                        logger.warning("lmprobe: waiting for room in the cache %s shared with %d other reader(s) "
                                       "(%s of %s used)", self.folder, len(live_readers(self.folder)) - 1,
                                       format_size(usage(self.folder)), format_size(self.budget))
                    if now - waiting_since > self.patience:
                        self._queue.popleft()
                        self._errors[name] = OutOfSpaceError(
                            f"the cache {self.folder} (budget {format_size(self.budget)}) stayed full of other "
                            f"readers' pieces for {self.patience:.0f} s: give each reader a larger cache= or run "
                            "fewer readers of this dataset on this machine")
                        self._cv.notify_all()
                        continue
                    self._cv.wait(0.05)
                    continue
                self._queue.popleft()
                self._add_bytes(self.sizes[name])
                if mode == "ready":
                    self.shared += 1
                    self._state[name] = "ready"
                    self._cv.notify_all()
                    continue
                self._state[name] = "loading"
                return name, mode

    def _wait_for_other(self, name: str) -> bool:
        """Wait while another reader downloads ``name``: True when it is there, False when that reader is gone."""
        while not self._closed:
            if (self.dir / name).exists():
                return True
            with self._lock:
                if (self.dir / name).exists():
                    return True
                alive = False
                for e in os.scandir(self.parts):
                    parsed = parse_part(e.name)
                    if parsed and parsed[0] == name and is_alive(self.folder / "readers" / parsed[1]):
                        alive = True
                if not alive:
                    return False
            time.sleep(0.02)
        return False

    def _fetch(self, name: str, mode: str) -> None:
        if mode == "other":
            if self._wait_for_other(name):
                self.shared += 1
                return
            if self._closed:
                raise RuntimeError("the cache is closed")
            again = self._claim(name, self.sizes[name])  # its downloader died: this reader downloads it
            if again == "ready":
                return
            if again != "download":
                raise OutOfSpaceError(f"the cache {self.folder} has no room for {name}, which another reader was "
                                      "downloading when it ended; run again")
        part = self.parts / part_name(name, self._reg.rid, self.sizes[name])
        try:
            self.download(name, part)
            size = part.stat().st_size
            if size != self.sizes[name]:
                raise LmprobeError(
                    f"{name} from {self.label} is {size} bytes, the dataset's metadata says {self.sizes[name]}: the "
                    "remote dataset changed after it was opened; open it again")
            os.replace(part, self.dir / name)  # visible only now: complete and checked
            self.downloaded += 1
        except BaseException as exc:
            part.unlink(missing_ok=True)
            if is_disk_full(exc):
                raise disk_full(self.folder, f"downloading {name} from {self.label}") from exc
            raise

    def _work(self) -> None:
        while (job := self._next()) is not None:
            name, mode = job
            error: BaseException | None = None
            try:
                self._fetch(name, mode)
            except BaseException as exc:  # handed to the consumer in get(), with its traceback
                error = exc
            with self._cv:
                dropped = self._state.get(name) == "dropped"
                if dropped or error is not None:
                    if dropped:
                        self._state.pop(name, None)
                    with contextlib.suppress(OSError):
                        self._unhold(name)
                    self._add_bytes(-self.sizes[name])
                    if error is not None and name in self._state:
                        self._errors[name] = error
                    if dropped:
                        self.sizes.pop(name, None)
                else:
                    self._state[name] = "ready"
                self._cv.notify_all()


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
        base = Path(root) if root is not None else cache_root()
        base.mkdir(parents=True, exist_ok=True)
        rid = new_reader_id()
        folder = base / f"files-{rid}"
        with FolderLock(base):
            collect_root(base, skip=folder)
            if budget is None:
                budget = default_budget(base)
            self._reg = Registration(folder, budget, rid=rid)
        drop_claims()
        self.budget, self.folder = int(budget), folder
        self.dir = folder / "data"
        self.dir.mkdir(parents=True, exist_ok=True)
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
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(f".{dst.name}.{self._reg.rid}.part")
            try:
                self.files.download(rel, tmp)
            except BaseException as exc:
                tmp.unlink(missing_ok=True)
                if is_disk_full(exc):
                    raise disk_full(self.folder, f"downloading {rel} from {self.files}") from exc
                raise
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
        reg = self.__dict__.get("_reg")
        if reg is None or not reg.open:
            return
        with contextlib.suppress(OSError):
            reg.close()
            shutil.rmtree(self.folder, ignore_errors=True)

    def __del__(self) -> None:  # pragma: no cover - removed with the dataset
        with contextlib.suppress(Exception):
            self.close()
