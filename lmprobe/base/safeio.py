"""Reading untrusted files: only regular files, sizes bounded before reading, JSON that cannot recurse away.

Everything read from a dataset, an SAE dictionary, a saev folder or a staging folder goes
through here (docs/security.md): a FIFO would block the reader forever, a folder would fail in
the middle of a read, a 10 GB "JSON" file would be read whole, and deeply nested JSON exhausts
the interpreter's stack.

Folders other users can write (the node-shared reader cache) are used through ``open_folder`` and the
functions after it: every component below a trusted anchor is opened with ``O_NOFOLLOW`` (a link
planted there is never followed), files are listed with ``lstat``, and only regular files this user
owns are removed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import FormatError, LmprobeError, UnsafePathError

#: the largest JSON document lmprobe reads from a dataset or an artefact (metadata, configs, checkpoints)
MAX_JSON_BYTES = 256 * 2**20


def check_regular(path: str | os.PathLike, what: str) -> Path:
    """``path`` if it is a regular file (symlinks followed); UnsafePathError for a FIFO, a folder, a device."""
    p = Path(path)
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise UnsafePathError(f"{what} {p} cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a special file"
        raise UnsafePathError(f"{what} {p} is {kind}, not a regular file")
    return p


def loads(raw: str | bytes, *, what: str, error: type[LmprobeError] = FormatError) -> Any:
    """Parse JSON from an untrusted source; any problem is ``error`` naming ``what``."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise error(f"{what} is nested too deeply to be read as JSON") from None
    except UnicodeDecodeError as exc:
        raise error(f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise error(f"{what} is not valid JSON ({exc.msg}, line {exc.lineno} column {exc.colno})") from None


def read_json(path: str | os.PathLike, *, what: str | None = None, error: type[LmprobeError] = FormatError,
              max_bytes: int = MAX_JSON_BYTES) -> Any:
    """A JSON file from an untrusted source: a regular file, at most ``max_bytes``, parsed with ``loads``."""
    p = Path(path)
    what = what or str(p)
    try:
        check_regular(p, what)
        size = p.stat().st_size
        if size > max_bytes:
            raise error(f"{what} is {size} bytes, more than the {max_bytes} a JSON document may have here")
        raw = p.read_bytes()
    except UnsafePathError as exc:
        raise error(str(exc)) from None
    except FileNotFoundError:
        raise error(f"{what} is missing") from None
    except OSError as exc:
        raise error(f"{what} cannot be read ({exc.strerror or exc})") from None
    return loads(raw, what=what, error=error)


# ------------------------------------------------------------------------------ folders other users can write

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _not_plain(path: Path) -> UnsafePathError:
    try:
        kind = "a link" if stat.S_ISLNK(os.lstat(path).st_mode) else "not a folder"
    except OSError:
        kind = "a link or not a folder"
    return UnsafePathError(f"{path} is {kind} where lmprobe's cache keeps a folder (another user of this machine "
                           f"may have planted it): remove it (`rm {path}`) or point LMPROBE_CACHE at a folder of "
                           "your own")


def open_folder(path: str | os.PathLike, *, below: str | os.PathLike, create: bool = False) -> int:
    """A file descriptor on the folder ``path``, which lies under (or is) ``below``: ``below`` itself and every
    component between are opened with ``O_NOFOLLOW`` (``create``: made when missing), so no link is followed below
    the anchor's parent. A link or a non-folder on the way is UnsafePathError; a missing one FileNotFoundError."""
    path, below = Path(path), Path(below)
    parts = path.relative_to(below).parts
    if create:
        below.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(below, _DIR_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _not_plain(below) from None
        raise
    here = below
    try:
        for part in parts:
            here = here / part
            try:
                new = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                new = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = new
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _not_plain(here) from None
        raise
    return fd


@contextlib.contextmanager
def folder_fd(path: str | os.PathLike, *, below: str | os.PathLike, create: bool = False) -> Iterator[int]:
    """``open_folder`` as a context manager."""
    fd = open_folder(path, below=below, create=create)
    try:
        yield fd
    finally:
        os.close(fd)


def open_inside(path: str | os.PathLike, flags: int, *, below: str | os.PathLike, mode: int = 0o644) -> int:
    """``os.open`` of ``path`` under ``below`` without following a link anywhere below the anchor's parent (the file
    itself included: ``O_NOFOLLOW``); a folder on the way is made when ``flags`` has ``O_CREAT``. Opening something
    that is not a regular file (a FIFO: it never blocks) is UnsafePathError."""
    path = Path(path)
    with folder_fd(path.parent, below=below, create=bool(flags & os.O_CREAT)) as dfd:
        try:
            fd = os.open(path.name, flags | _NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), mode,
                         dir_fd=dfd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePathError(f"{path} is a link where lmprobe's cache keeps a file (another user of this "
                                      f"machine may have planted it): remove it (`rm {path}`)") from None
            raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePathError(f"{path} is not a regular file where lmprobe's cache keeps one: remove it")
    os.set_blocking(fd, True)
    return fd


def nofollow_opener(path: str, flags: int) -> int:
    """An ``opener`` for ``open()`` that refuses a link as the file itself (``O_NOFOLLOW``)."""
    return os.open(path, flags | _NOFOLLOW, 0o644)


def lstat_inside(path: str | os.PathLike, *, below: str | os.PathLike) -> os.stat_result | None:
    """``lstat`` of ``path`` under ``below`` (no link followed on the way), or None when it, or a folder on the way,
    is missing or not a plain folder."""
    path = Path(path)
    try:
        with folder_fd(path.parent, below=below) as dfd:
            return os.stat(path.name, dir_fd=dfd, follow_symlinks=False)
    except (OSError, UnsafePathError):
        return None


def list_folder(path: str | os.PathLike, *, below: str | os.PathLike) -> list[tuple[str, os.stat_result]]:
    """(name, lstat) of what the folder ``path`` holds (links not followed: a link is listed as a link); empty when
    the folder is missing or is not a plain folder under ``below``."""
    try:
        dfd = open_folder(path, below=below)
    except (OSError, UnsafePathError):
        return []
    out = []
    try:
        with os.scandir(dfd) as it:
            names = [e.name for e in it]
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                out.append((name, os.stat(name, dir_fd=dfd, follow_symlinks=False)))
    finally:
        os.close(dfd)
    return out


def _mine(st: os.stat_result) -> bool:
    return not hasattr(os, "geteuid") or st.st_uid == os.geteuid()


def remove_owned(path: str | os.PathLike, *, below: str | os.PathLike) -> bool:
    """Remove ``path`` if it is a regular file this user owns, reached under ``below`` without following a link; a
    link, another user's file or anything else stays. Whether it was removed."""
    path = Path(path)
    try:
        with folder_fd(path.parent, below=below) as dfd:
            st = os.stat(path.name, dir_fd=dfd, follow_symlinks=False)
            if not (stat.S_ISREG(st.st_mode) and _mine(st)):
                return False
            os.unlink(path.name, dir_fd=dfd)
            return True
    except (OSError, UnsafePathError):
        return False


#: how deep ``remove_tree`` descends: lmprobe's cache folders are 3 deep; a deeper tree was planted, and stays
_REAP_DEPTH = 16


def _reap(dfd: int, depth: int = 0) -> None:
    if depth > _REAP_DEPTH:
        return
    with os.scandir(dfd) as it:
        names = [e.name for e in it]
    for name in names:
        with contextlib.suppress(OSError):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and _mine(st):
                os.unlink(name, dir_fd=dfd)
            elif stat.S_ISDIR(st.st_mode):
                sub = os.open(name, _DIR_FLAGS, dir_fd=dfd)
                try:
                    _reap(sub, depth + 1)
                finally:
                    os.close(sub)
                os.rmdir(name, dir_fd=dfd)  # only once empty: what was not ours keeps it


def remove_tree(path: str | os.PathLike, *, below: str | os.PathLike) -> None:
    """Remove the folder ``path`` (under ``below``) as far as it is this user's: regular files this user owns, then
    the folders left empty. Links are never followed (nor removed); whatever is not ours stays, with its folders."""
    path = Path(path)
    try:
        with folder_fd(path.parent, below=below) as pfd:
            sub = os.open(path.name, _DIR_FLAGS, dir_fd=pfd)
            try:
                _reap(sub)
            finally:
                os.close(sub)
            os.rmdir(path.name, dir_fd=pfd)
    except (OSError, UnsafePathError):
        return


def replace_inside(src: str | os.PathLike, dst: str | os.PathLike, *, below: str | os.PathLike) -> None:
    """``os.replace(src, dst)`` with both folders reached under ``below`` without following a link (a link at
    ``dst`` is replaced, never written through)."""
    src, dst = Path(src), Path(dst)
    with folder_fd(src.parent, below=below) as sfd, folder_fd(dst.parent, below=below) as dfd:
        os.replace(src.name, dst.name, src_dir_fd=sfd, dst_dir_fd=dfd)
