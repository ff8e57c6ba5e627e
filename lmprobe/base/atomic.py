"""Atomic file replacement: a reader sees the old file or the new one, never a half-written one.

Every file lmprobe writes goes through here: written under a temporary name beside its final
place (same folder, so the rename stays on one filesystem), optionally fsync'ed, then renamed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def temporary_name(path: str | os.PathLike) -> Path:
    """The temporary name a file is written under before it replaces ``path``."""
    p = Path(path)
    return p.with_name(f"{p.name}.tmp")


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, *, fsync: bool = False) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces ``path``, on failure it is removed.

    >>> with atomic_output("out.json") as tmp:      # doctest: +SKIP
    ...     tmp.write_text("{}")
    """
    final = Path(path)
    tmp = temporary_name(final)
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def atomic_write(path: str | os.PathLike, data: bytes | str, *, fsync: bool = False) -> None:
    """Replace ``path`` with ``data`` (bytes, or text written as UTF-8) atomically."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    with atomic_output(path, fsync=fsync) as tmp, open(tmp, "wb") as f:
        f.write(raw)


def move_into_place(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename a finished file to its final name (creating the folder), replacing what was there."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.replace(src, dst)
