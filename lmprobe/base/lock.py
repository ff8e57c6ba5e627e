"""One lock per output: a second writer is refused at once, a dead writer's lock does not block.

The lock is a file beside the output (``<parent>/.<name>.lmprobe-lock``, holding the owner's
process id) with an exclusive ``flock`` on it. The kernel drops a flock when its process dies, so
a lock left by a killed run (kill -9, power loss on local disks) is free at once; nothing has to
decide whether a process id is still alive. Where flock is missing (Windows), an exclusive create
with a liveness check of the recorded process stands in.

>>> with OutputLock(Path("out/acts")):      # doctest: +SKIP
...     write_the_dataset()
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from ..errors import OutputInUseError, UnsafePathError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX
    fcntl = None


def lock_path(target: Path) -> Path:
    target = Path(os.path.abspath(target))
    return target.with_name(f".{target.name}.lmprobe-lock")


class OutputLock:
    """An exclusive lock on writing ``target`` (a folder or file that may not exist yet)."""

    def __init__(self, target: str | os.PathLike):
        self.target = Path(target)
        self.path = lock_path(self.target)
        self._fd: int | None = None

    def acquire(self) -> OutputLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if fcntl is None:  # pragma: no cover - not on POSIX
            self._acquire_exclusive_create()
            return self
        try:  # a link planted in the lock's place is never written through (it would truncate its target)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise UnsafePathError(f"the lock file {self.path} of {self.target} is a link (another user may have planted "
                                  f"it): remove it (`rm {self.path}`) and run again") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UnsafePathError(f"the lock file {self.path} of {self.target} is not a regular file: remove it and "
                                  "run again")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            raise self._in_use(pid) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def _acquire_exclusive_create(self) -> None:  # pragma: no cover - not on POSIX
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                pid = _read_pid_file(self.path)
                if pid is not None and _alive(pid):
                    raise self._in_use(pid) from None
                self.path.unlink(missing_ok=True)  # left by a dead process
                continue
            os.write(fd, str(os.getpid()).encode())
            self._fd = fd
            return
        raise self._in_use(None)

    def _in_use(self, pid: int | None) -> OutputInUseError:
        who = f"process {pid}" if pid else "another process"
        return OutputInUseError(
            f"{self.target} is in use by {who} (another lmprobe run writing it); wait for it to finish or stop it, "
            "or choose another output", path=self.target, pid=pid)

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()  # before unlocking: a waiting process then locks a fresh file
        os.close(self._fd)  # closing drops the flock
        self._fd = None

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def writer_pid(target: str | os.PathLike) -> int | None:
    """The process id of a live lmprobe run writing ``target``, else None, without touching its lock.

    A lock file exists while its owner holds it (release deletes it first) or after its owner was
    killed; the recorded process is asked whether it is alive. Taking the lock to find out would
    make a writer starting at that moment refuse.
    """
    pid = _read_pid_file(lock_path(Path(target)))
    return pid if pid is not None and pid != os.getpid() and _alive(pid) else None


def _read_pid(fd: int) -> int | None:
    try:
        raw = os.pread(fd, 32, 0)
    except OSError:
        return None
    return int(raw) if raw.strip().isdigit() else None


def _read_pid_file(path: Path) -> int | None:
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return _read_pid(fd) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
