"""Cache folders that the processes of one machine share: locks, the readers using them, what each holds.

Ranks (and DataLoader workers) on one node that read the same remote dataset share one folder, so
a piece is downloaded once per node and one byte budget holds for the folder as a whole::

    $LMPROBE_CACHE/stream/
        .lock                  flock: budgets are decided and readers registered one process at a time
        <key>/                 one remote dataset (source and identity) on this machine
            .lock              flock: this folder's bookkeeping, one process at a time
            pieces/<name>      complete pieces only: a download is renamed in once it is whole and checked
            parts/<name>.<rid>.<bytes>.part   downloads under way; <bytes> is reserved against the budget
            readers/<rid>/     a reader: `alive` (flock held while its process lives), info.json (pid,
                               budget), holds/<name> (the pieces it still needs: never deleted under it),
                               wants ("<since> <bytes>" while it waits for room: served first)
            notes/<name>       small facts the readers share (where a shard's rows start)
        files-<rid>/           a private folder (``LruFiles``), registered the same way

A reader's liveness is its flock: the kernel drops it when the process dies (kill -9 included), so
the next reader of the machine removes what a killed one left: its holds, its half-downloads, the
pieces nobody holds, and folders no live reader uses (finished readers remove their own).

The folder is shared by the machine's users, so anything in it may have been planted by another
one. Nothing below the root is reached through a link (``base.safeio.open_folder``: ``O_NOFOLLOW``
for every component, listings by ``lstat``), the root itself must not be a link, and what a reader
removes is only regular files this user owns (``safeio.remove_owned``, ``safeio.remove_tree``): a
link planted for a folder is skipped when it is another dataset's, and is a one-line error when it
is in the folder of the dataset being read.

>>> with FolderLock(folder):            # doctest: +SKIP
...     used = usage(folder)
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from ..base.safeio import list_folder, lstat_inside, open_folder, open_inside, remove_owned, remove_tree
from ..base.units import format_size
from ..errors import OutOfSpaceError, UnsafePathError

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX: folders are not shared between processes
    fcntl = None

#: the default budget: the smaller of this and half of what the disk can still give this machine's caches
DEFAULT_CACHE_CAP = 20 * 2**30

_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def _after_fork() -> None:
    """A forked child (a DataLoader worker) starts with no folder held: a lock another thread of the parent held
    at the fork would otherwise stay held forever in the child."""
    global _LOCKS, _LOCKS_GUARD
    _LOCKS, _LOCKS_GUARD = {}, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def cache_root() -> Path:
    """Where bounded caches live: ``$LMPROBE_CACHE/stream`` (default ``~/.cache/lmprobe/stream``)."""
    return Path(os.environ.get("LMPROBE_CACHE", Path.home() / ".cache" / "lmprobe")) / "stream"


def check_root(root: Path) -> Path:
    """``root`` made if missing; UnsafePathError if it is a link (every folder under it is collected, so it must be
    the folder it names) or not a folder. Folders above it are the user's choice (``LMPROBE_CACHE``) and followed."""
    root = Path(os.path.realpath(root.parent)) / root.name
    with contextlib.suppress(FileExistsError):
        root.mkdir(parents=True)
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode):
        kind = "a link" if stat.S_ISLNK(st.st_mode) else "not a folder"
        raise UnsafePathError(f"the cache root {root} is {kind} (another user of this machine may have planted it): "
                              f"remove it (`rm {root}`) or point LMPROBE_CACHE at a folder of your own")
    return root


def new_reader_id() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:10]}"


class FolderLock:
    """An exclusive lock on a folder's bookkeeping, between processes (flock) and threads (a lock per path).

    The lock file is re-opened if another process removed the folder while this one waited for it. The
    folder is made if missing; it and its lock are reached from ``below`` (default: the folder's parent)
    without following a link.
    """

    def __init__(self, folder: Path, *, below: Path | None = None):
        self.folder = Path(folder)
        self.below = Path(below) if below is not None else self.folder.parent
        self.path = self.folder / ".lock"
        with _LOCKS_GUARD:
            self._thread_lock = _LOCKS.setdefault(str(self.path), threading.Lock())
        self._fd: int | None = None

    def __enter__(self) -> FolderLock:
        self._thread_lock.acquire()
        try:
            while True:
                fd = open_inside(self.path, os.O_RDWR | os.O_CREAT, below=self.below)
                if fcntl is None:  # pragma: no cover - not on POSIX
                    self._fd = fd
                    return self
                fcntl.flock(fd, fcntl.LOCK_EX)
                now = lstat_inside(self.path, below=self.below)
                same = now is not None and os.fstat(fd).st_ino == now.st_ino
                if same:
                    self._fd = fd
                    return self
                os.close(fd)  # the folder was removed (and maybe made again) meanwhile: lock the one there now
        except BaseException:
            self._thread_lock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        fd, self._fd = self._fd, None
        try:
            if fd is not None:
                os.close(fd)  # closing drops the flock
        finally:
            self._thread_lock.release()


@contextlib.contextmanager
def flocked(path: Path) -> Iterator[None]:
    """An exclusive flock on ``path`` (made if missing), between processes and between threads alike (each open is
    its own lock holder). Where flock is missing, no lock."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def is_alive(reader_dir: Path) -> bool:
    """Whether the process that registered ``reader_dir`` (``<folder>/readers/<rid>``) still runs (it holds the flock
    on its ``alive`` file). A link in its place is never followed: a reader that is not there."""
    if fcntl is None:  # pragma: no cover - not on POSIX
        return True
    try:
        fd = open_inside(reader_dir / "alive", os.O_RDONLY, below=reader_dir.parent.parent)
    except (OSError, UnsafePathError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


class Registration:
    """A reader of a cache folder, registered under ``folder/readers/<rid>`` for as long as it is open."""

    def __init__(self, folder: Path, budget: int, *, rid: str | None = None):
        self.folder, self.budget = Path(folder), int(budget)
        self.rid = rid or new_reader_id()
        self.dir = self.folder / "readers" / self.rid
        self.holds = self.dir / "holds"
        self._fd = open_inside(self.dir / "alive", os.O_RDWR | os.O_CREAT | os.O_EXCL, below=self.folder.parent)
        if fcntl is not None:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.close(open_folder(self.holds, below=self.folder.parent, create=True))
        self.write("info.json", json.dumps({"pid": os.getpid(), "budget": self.budget, "since": time.time()}))
        self._pid = os.getpid()

    def write(self, rel: str, text: str) -> None:
        """A small file of this reader's (made new: a link in its place is an error, never written through)."""
        path = self.dir / rel
        remove_owned(path, below=self.folder.parent)
        fd = open_inside(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, below=self.folder.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)

    def touch(self, rel: str) -> None:
        """Make this reader's file ``rel`` (``holds/<name>``), empty."""
        os.close(open_inside(self.dir / rel, os.O_WRONLY | os.O_CREAT, below=self.folder.parent))

    def unhold(self, name: str) -> None:
        remove_owned(self.holds / name, below=self.folder.parent)

    @property
    def open(self) -> bool:
        return self._fd is not None and self._pid == os.getpid()

    def close(self) -> None:
        """Unregister (the caller holds the folder's lock): the reader's holds go with it."""
        if not self.open:
            return
        remove_tree(self.dir, below=self.folder.parent)
        os.close(self._fd)
        self._fd = None


def live_readers(folder: Path) -> list[Path]:
    """The reader folders of ``folder`` whose process still runs."""
    return [d for d in sorted(_dirs(folder / "readers", below=folder.parent)) if is_alive(d)]


def read_small(path: Path, *, below: Path, limit: int = 4096) -> str | None:
    """The text of a small file of the cache (at most ``limit`` bytes read), or None when it is missing, is a link,
    or is not a regular file."""
    try:
        fd = open_inside(path, os.O_RDONLY, below=below)
    except (OSError, UnsafePathError):
        return None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(limit)
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return None


def reader_budgets(folder: Path) -> list[int]:
    out = []
    for d in live_readers(folder):
        try:
            out.append(int(json.loads(read_small(d / "info.json", below=folder.parent) or "")["budget"]))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def part_name(name: str, rid: str, size: int) -> str:
    return f"{name}.{rid}.{size}.part"


def parse_part(file: str) -> tuple[str, str, int] | None:
    """(piece name, reader id, reserved bytes) of a part file's name, or None."""
    bits = file.rsplit(".", 3)
    if len(bits) != 4 or bits[3] != "part" or not bits[2].isdigit():
        return None
    return bits[0], bits[1], int(bits[2])


def usage(folder: Path) -> int:
    """Bytes of a folder's complete pieces (regular files only) and of the downloads under way (counted in full)."""
    total = 0
    for _, st in list_folder(folder / "pieces", below=folder.parent):
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
    for name in files_of(folder, "parts"):
        parsed = parse_part(name)
        total += parsed[2] if parsed else 0
    return total


def files_of(folder: Path, sub: str) -> list[str]:
    """The regular files in ``folder/sub`` (``parts``, ``pieces``): links are not followed, nor listed."""
    return [name for name, st in list_folder(folder / sub, below=folder.parent) if stat.S_ISREG(st.st_mode)]


def held_elsewhere(folder: Path, name: str, rid: str) -> bool:
    """Whether a reader other than ``rid`` holds piece ``name``."""
    return any(d.name != rid and lstat_inside(d / "holds" / name, below=folder.parent) is not None
               for d in _dirs(folder / "readers", below=folder.parent))


def _dirs(d: Path, *, below: Path) -> list[Path]:
    """The folders in ``d`` (under ``below``), by lstat: a link to a folder is not one."""
    return [d / name for name, st in list_folder(d, below=below) if stat.S_ISDIR(st.st_mode)]


def collect(folder: Path, *, keep: str | None = None) -> None:
    """Remove what dead readers left in ``folder`` (the caller holds its lock): their registrations and
    half-downloads, and every piece no live reader holds. ``keep``: a reader id to treat as alive. Only regular
    files this user owns are removed, and no link is followed (``safeio.remove_owned``)."""
    below = folder.parent
    live = set()
    for d in _dirs(folder / "readers", below=folder.parent):
        if d.name == keep or is_alive(d):
            live.add(d.name)
        else:
            remove_tree(d, below=below)
    for name in files_of(folder, "parts"):
        parsed = parse_part(name)
        if parsed is None or parsed[1] not in live:
            remove_owned(folder / "parts" / name, below=below)
    held = set()
    for rid in live:
        held.update(name for name, _ in list_folder(folder / "readers" / rid / "holds", below=below))
    for name in files_of(folder, "pieces"):
        if name not in held:
            remove_owned(folder / "pieces" / name, below=below)


def collect_root(root: Path, *, skip: Path | None = None) -> None:
    """Remove every cache folder under ``root`` that no live reader uses (killed readers' leftovers, and the
    folders of readers that ended without closing), and what dead readers left in the others. A link under the
    root is not a folder here: it is neither followed nor removed; a folder holding a link keeps it."""
    for d in _dirs(root, below=root):
        if skip is not None and d == skip:
            continue
        with contextlib.suppress(UnsafePathError, PermissionError), FolderLock(d, below=root):  # not ours to collect
            collect(d)
            if d.name != "claims" and not live_readers(d):
                remove_tree(d, below=root)


def default_budget(root: Path, *, cap: int = DEFAULT_CACHE_CAP) -> int:
    """min(``cap``, half of what the disk can still give): free space, less what the live readers of this
    machine may still claim (their budgets less what they hold), so that two jobs started together do not
    both plan on half of the same free space. The caller holds ``root``'s lock and registers right after."""
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    claimed = 0
    for d in _dirs(root, below=root):
        budgets = reader_budgets(d)
        if d.name == "claims":  # budgets decided for processes that have not started reading
            claimed += sum(budgets)
        elif budgets:
            claimed += max(0, max(budgets) - usage(d))
    return int(max(0, min(cap, (free - claimed) // 2)))


def claim_default_budget(root: Path, *, cap: int = DEFAULT_CACHE_CAP) -> int:
    """A default budget, decided and claimed at once (under the root's lock): the claim holds until this process
    registers a reader (``drop_claims``) or ends, so that another job deciding its budget meanwhile counts it."""
    root = check_root(root)
    with FolderLock(root, below=root):
        budget = default_budget(root, cap=cap)
        _CLAIMS.append(Registration(root / "claims", budget))
    return budget


_CLAIMS: list[Registration] = []


def drop_claims() -> None:
    """This process registered its reader: its pending budget claims are counted there now."""
    while _CLAIMS:
        claim = _CLAIMS.pop()
        with contextlib.suppress(OSError):
            claim.close()


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
