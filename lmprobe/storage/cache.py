"""A bounded local cache for remote dataset pieces: downloads ahead, within a byte budget, deleted when done.

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
import logging
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

from ..base.paths import check_relpath
from ..base.safeio import (
    lstat_inside,
    open_folder,
    open_inside,
    remove_owned,
    remove_tree,
    replace_inside,
)
from ..base.units import format_size, parse_size
from ..errors import InvalidArgumentError, LmprobeError, OutOfSpaceError, UnsafePathError
from .cachedir import (
    DEFAULT_CACHE_CAP,
    FolderLock,
    Registration,
    cache_root,
    check_root,
    claim_default_budget,
    collect,
    collect_root,
    default_budget,
    disk_full,
    drop_claims,
    files_of,
    held_elsewhere,
    is_alive,
    is_disk_full,
    live_readers,
    new_reader_id,
    parse_part,
    part_name,
    read_small,
    reader_budgets,
    usage,
)

__all__ = ["BoundedCache", "cache_budget", "cache_root", "DEFAULT_CACHE_CAP"]

logger = logging.getLogger(__name__)

#: seconds a reader waits for room in a folder that other readers filled before it says so, and
#: (``patience``, default) before it gives up: with windows claimed whole and the longest waiter served first, only
#: a reader that holds pieces and stops reading makes the others wait that long
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
    logger.info("lmprobe: reading %s through a local cache of at most %s (cache= / --cache to change it)",
                source, format_size(budget))


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
    reader's bytes whenever they change; ``patience`` (seconds, default ``DEFAULT_PATIENCE``) bounds a
    wait for room in the folder.

    Readers sharing the budget cannot wait on each other for ever: a window (one ``schedule`` call) is
    claimed whole or not at all, so every reader that holds pieces can finish its window and give them
    back; the reader that has waited longest for room is served first. What remains is a reader that
    holds pieces and stops reading: the others wait ``patience`` seconds for it, then say so in one line.
    """

    def __init__(self, download: Callable[[str, Path], None], budget: int | None = None, *, key: str | None = None,
                 sizes: dict[str, int] | None = None, label: str = "the remote", workers: int = 4,
                 root: Path | None = None, share: int = 1, on_bytes: Callable[[int], None] | None = None,
                 patience: float | None = None):
        if budget is not None and budget <= 0:
            raise InvalidArgumentError(f"cache budget must be positive, got {budget}")
        self.download, self.label, self.sizes = download, label, dict(sizes or {})
        self.root = check_root(Path(root) if root is not None else cache_root())
        rid = new_reader_id()
        self.folder = self.root / (key if key is not None else f"reader-{rid}")
        check_relpath(self.folder.name, "cache folder")
        with FolderLock(self.root, below=self.root):  # the budget is decided and the reader registered at once
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
        try:
            for d in (self.dir, self.parts, self.notes):  # a link planted in their place: one line, nothing followed
                os.close(open_folder(d, below=self.root, create=True))
        except BaseException:
            self.close()
            raise
        self.on_bytes = on_bytes
        self.patience = float(DEFAULT_PATIENCE if patience is None else patience)
        self._lock = FolderLock(self.folder)
        self._cv = threading.Condition()
        self._queue: deque[list[str]] = deque()  # groups of pieces to claim together, in the order they are needed
        self._jobs: deque[tuple[str, str]] = deque()  # claimed pieces to fetch: (name, "download" | "other")
        self._want_since: float | None = None  # when this reader started waiting for room (wall clock: shared)
        self._wants = ""
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
        (name, size) pairs.

        The new pieces of one call are claimed together when they fit in this reader's share (a window the
        consumer takes at once): a reader never holds part of a window while it waits for room for the rest,
        which is what let readers sharing a budget wait on each other for ever. A call larger than the share
        is claimed piece by piece (its consumer cannot hold it at once anyway)."""
        with self._cv:
            new: list[str] = []
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
                    new.append(name)
            if not new:
                pass
            elif sum(self.sizes[n] for n in new) <= self.cap:
                self._queue.append(new)
            else:
                self._queue.extend([n] for n in new)
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
                for group in self._queue:
                    if name in group:
                        group.remove(name)
                        break
                while self._queue and not self._queue[0]:
                    self._queue.popleft()
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
            return read_small(path, below=self.root)
        tmp = path.with_name(f".{path.name}.{self._reg.rid}.tmp")
        with os.fdopen(open_inside(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, below=self.root), "w") as f:
            f.write(text)
        replace_inside(tmp, path, below=self.root)
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
                remove_tree(self.folder, below=self.root)

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
            self._reg.unhold(name)
            if not held_elsewhere(self.folder, name, self._reg.rid):
                remove_owned(self.dir / name, below=self.root)

    def _claim(self, name: str, size: int) -> str | None:
        """Under the folder's lock: "ready" (another reader downloaded it), "other" (another reader is downloading
        it), "download" (room reserved: this reader downloads it), or None (no room in the folder yet)."""
        with self._lock:
            self._reg.touch(f"holds/{name}")
            if self._complete(name):
                return "ready"
            for file in files_of(self.folder, "parts"):
                parsed = parse_part(file)
                if parsed and parsed[0] == name and parsed[1] != self._reg.rid \
                        and is_alive(self.folder / "readers" / parsed[1]):
                    return "other"
            if usage(self.folder) + size > self.budget:
                collect(self.folder, keep=self._reg.rid)  # what dead readers left may be in the way
            if usage(self.folder) + size <= self.budget:
                os.close(open_inside(self.parts / part_name(name, self._reg.rid, size),
                                     os.O_WRONLY | os.O_CREAT | os.O_EXCL, below=self.root))
                return "download"
            self._reg.unhold(name)
            return None

    def _complete(self, name: str) -> bool:
        """Whether piece ``name`` is in ``pieces/``, complete (a regular file: a link there is not a piece)."""
        st = lstat_inside(self.dir / name, below=self.root)
        return st is not None and stat.S_ISREG(st.st_mode)

    def _claim_group(self, group: list[str]) -> list[str] | None:
        """Under the folder's lock, the pieces of ``group`` all at once: each one's mode ("ready", "other",
        "download", as ``_claim``), or None (nothing claimed) when the folder has no room for the group's downloads.

        Room is what the budget leaves after the folder's pieces and downloads, less what the readers that started
        waiting before this one need (their ``wants``): the reader that has waited longest is served first, and a
        reader that is not waiting never takes the room a waiting one needs."""
        rid = self._reg.rid
        with self._lock:
            for name in group:
                self._reg.touch(f"holds/{name}")
            downloading = {parsed[0] for parsed in map(parse_part, files_of(self.folder, "parts"))
                           if parsed and parsed[1] != rid and is_alive(self.folder / "readers" / parsed[1])}
            modes = ["ready" if self._complete(n) else "other" if n in downloading else "download" for n in group]
            new = sum(self.sizes[n] for n, mode in zip(group, modes, strict=True) if mode == "download")
            if new:
                used = usage(self.folder)
                if used + new + self._waiting_ahead() > self.budget:
                    collect(self.folder, keep=rid)  # what dead readers left may be in the way
                    used = usage(self.folder)
                if used + new + self._waiting_ahead() > self.budget:
                    for name in group:
                        self._reg.unhold(name)
                    self._want(new)
                    return None
            for name, mode in zip(group, modes, strict=True):
                if mode == "download":
                    os.close(open_inside(self.parts / part_name(name, rid, self.sizes[name]),
                                         os.O_WRONLY | os.O_CREAT | os.O_EXCL, below=self.root))
            self._stop_wanting()
            return modes

    def _waiting_ahead(self) -> int:
        """Bytes the live readers that started waiting for room before this one (or all waiting ones, when this one
        is not waiting) need: ``readers/<rid>/wants`` holds "<since> <bytes>"."""
        mine = (self._want_since, self._reg.rid) if self._want_since is not None else None
        ahead = 0
        for d in live_readers(self.folder):
            if d.name == self._reg.rid:
                continue
            since, _, n = (read_small(d / "wants", below=self.root, limit=64) or "").partition(" ")
            try:
                since_f, n_i = float(since), int(n)
            except ValueError:
                continue
            if mine is None or (since_f, d.name) < mine:
                ahead += max(0, min(n_i, self.budget))
        return ahead

    def _want(self, n: int) -> None:
        """Say to the folder's other readers that this one waits for ``n`` bytes of room (since when it began)."""
        if self._want_since is None:
            self._want_since = time.time()
        text = f"{self._want_since!r} {int(n)}"
        if text != self._wants:
            self._reg.write("wants", text)
            self._wants = text

    def _stop_wanting(self) -> None:
        if self._want_since is not None or self._wants:
            remove_owned(self._reg.dir / "wants", below=self.root)
            self._want_since, self._wants = None, ""

    def _next(self) -> tuple[str, str] | None:
        """The next piece to fetch: claimed pieces first, else the next group, once this reader's share and the
        folder have room for all of it (strictly in order: none jumps the queue). Waiting for room in the folder
        lasts at most ``patience`` seconds; then the group's reads fail with one line saying why."""
        waiting_since: float | None = None
        warned = False
        with self._cv:
            while True:
                if self._closed:
                    with contextlib.suppress(OSError):
                        self._stop_wanting()
                    return None
                if self._jobs:
                    return self._jobs.popleft()
                while self._queue and not self._queue[0]:  # every piece of it was released before its turn
                    self._queue.popleft()
                group = self._queue[0] if self._queue else None
                need = sum(self.sizes[n] for n in group) if group else 0
                if not group or self.bytes + need > self.cap:
                    waiting_since = None
                    self._stop_wanting()
                    self._cv.wait()
                    continue
                modes = self._claim_group(group)
                if modes is None:  # other readers of this machine fill the folder: wait for them to free room
                    now = time.monotonic()
                    waiting_since = waiting_since or now
                    if not warned and now - waiting_since > min(ROOM_WARN_AFTER, self.patience / 2):
                        warned = True
                        logger.warning("lmprobe: waiting for room in the cache %s shared with %d other reader(s) "
                                       "(%s of %s used)", self.folder, len(live_readers(self.folder)) - 1,
                                       format_size(usage(self.folder)), format_size(self.budget))
                    if now - waiting_since > self.patience:
                        error = self._no_room(need)
                        self._queue.popleft()
                        for name in group:
                            self._errors[name] = error
                        self._stop_wanting()
                        waiting_since, warned = None, False
                        self._cv.notify_all()
                        continue
                    self._cv.wait(0.05)
                    continue
                waiting_since, warned = None, False
                self._queue.popleft()
                for name, mode in zip(group, modes, strict=True):
                    self._add_bytes(self.sizes[name])
                    if mode == "ready":
                        self.shared += 1
                        self._state[name] = "ready"
                    else:
                        self._state[name] = "loading"
                        self._jobs.append((name, mode))
                self._cv.notify_all()

    def _no_room(self, need: int) -> OutOfSpaceError:
        others = max(0, len(live_readers(self.folder)) - 1)
        return OutOfSpaceError(
            f"this reader waited {self.patience:.0f} s for {format_size(need)} of room in the cache {self.folder} "
            f"(cache={format_size(self.budget)}, {format_size(usage(self.folder))} used), which {others} other "
            "reader(s) of this dataset on this machine hold without giving any back (a reader that stopped reading "
            "keeps its pieces until it is closed): close the readers you no longer use, give a larger cache= "
            "(--cache), or run fewer readers of this dataset at once")

    def _wait_for_other(self, name: str) -> bool:
        """Wait while another reader downloads ``name``: True when it is there, False when that reader is gone."""
        while not self._closed:
            if self._complete(name):
                return True
            with self._lock:
                if self._complete(name):
                    return True
                alive = False
                for file in files_of(self.folder, "parts"):
                    parsed = parse_part(file)
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
            st = lstat_inside(part, below=self.root)
            if st is None or not stat.S_ISREG(st.st_mode):
                raise UnsafePathError(f"the download of {name} in {self.parts} was replaced by something else than a "
                                      "file (another user of this machine?): nothing of it was used; run again")
            size = st.st_size
            if size != self.sizes[name]:
                raise LmprobeError(
                    f"{name} from {self.label} is {size} bytes, the dataset's metadata says {self.sizes[name]}: the "
                    "remote dataset changed after it was opened; open it again")
            replace_inside(part, self.dir / name, below=self.root)  # visible only now: complete and checked
            self.downloaded += 1
        except BaseException as exc:
            remove_owned(part, below=self.root)
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
