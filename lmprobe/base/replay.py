"""A file read twice, fetched once: the bytes of a first read kept in memory (up to a cap), and a second read served
from them.

A rank that plans a token budget counts a piece of its corpus before extracting it, and the
extraction reads the same piece again (extraction/dealing.py). :class:`Recorder` opens files as
the first read does and keeps every byte it reads; :meth:`Recorder.replay` opens them again for the
second read: a read that the kept bytes cover costs no I/O, any other goes to the file. Past
``limit`` bytes the recorder keeps nothing (the second read then reads the file).

>>> import io
>>> rec = Recorder(lambda f: io.BytesIO(b"hello world"), limit=100)
>>> with rec.open("f") as fh:
...     fh.read(5)
b'hello'
>>> with rec.replay(lambda f: io.BytesIO(b"")).open("f") as fh:
...     fh.read(5)
b'hello'
"""

from __future__ import annotations

import bisect
import io
from collections.abc import Callable
from typing import Any, BinaryIO

#: Bytes a second read is served from memory in one call (and a first read recorded in).
BUFFER = 1 << 20


class _Tee(io.RawIOBase):
    """A file whose reads are recorded in ``rec``."""

    def __init__(self, f: Any, rec: Recorder, key: Any):
        self._f, self._rec, self._key, self._pos = f, rec, key, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self._f.read(len(b))
        n = len(data)
        b[:n] = data
        self._rec.keep(self._key, self._pos, data)
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = self._f.seek(offset, whence)
        if whence == io.SEEK_END:
            self._rec.sizes[self._key] = self._pos - offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        self._f.close()
        super().close()


class _Replay(io.RawIOBase):
    """A file served from kept ``(offset, bytes)`` chunks where they cover a read, else from ``open(key)``."""

    def __init__(self, chunks: list[tuple[int, bytes]], size: int | None, opener: Callable[[Any], Any], key: Any):
        self._chunks = sorted(chunks, key=lambda c: c[0])
        self._size = size
        self._starts = [o for o, _ in self._chunks]
        self._opener, self._key, self._f, self._pos = opener, key, None, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def _kept(self, n: int) -> bytes | None:
        i = bisect.bisect_right(self._starts, self._pos) - 1
        if i < 0:
            return None
        start, data = self._chunks[i]
        if self._pos >= start + len(data):
            return None
        return data[self._pos - start : self._pos - start + n]

    def readinto(self, b: Any) -> int:
        if self._size is not None and self._pos >= self._size:
            return 0  # the end of the file, whose size the first read asked for
        data = self._kept(len(b))
        if data is None:
            if self._f is None:
                self._f = self._opener(self._key)
            self._f.seek(self._pos)
            data = self._f.read(len(b))
        n = len(data)
        b[:n] = data
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == io.SEEK_END and self._size is not None:
            self._pos = self._size + offset
        elif whence == io.SEEK_END:
            if self._f is None:
                self._f = self._opener(self._key)
            self._pos = self._f.seek(offset, io.SEEK_END)
        else:
            self._pos = offset if whence == io.SEEK_SET else self._pos + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        super().close()


class Recorder:
    """Opens files through ``opener`` and keeps the bytes read, while they total at most ``limit``."""

    def __init__(self, opener: Callable[[Any], Any], *, limit: int):
        self._opener, self.limit = opener, limit
        self.kept: dict[Any, list[tuple[int, bytes]]] = {}
        self.sizes: dict[Any, int] = {}  # the files' sizes, when the first read asked for them
        self.size = 0
        self.overflow = False

    def open(self, key: Any) -> BinaryIO:
        return io.BufferedReader(_Tee(self._opener(key), self, key), buffer_size=BUFFER)

    def keep(self, key: Any, offset: int, data: bytes) -> None:
        if self.overflow or not data:
            return
        self.size += len(data)
        if self.size > self.limit:
            self.overflow, self.kept = True, {}  # too large to keep: the second read reads the file
            return
        self.kept.setdefault(key, []).append((offset, data))

    def replay(self, opener: Callable[[Any], Any]) -> Replayer:
        """An opener serving what was kept (nothing when it overflowed), and ``opener`` for the rest."""
        return Replayer({} if self.overflow else self.kept, self.sizes, opener)


class Replayer:
    """Opens files from kept bytes, falling back on ``opener``."""

    def __init__(self, kept: dict[Any, list[tuple[int, bytes]]], sizes: dict[Any, int], opener: Callable[[Any], Any]):
        self._kept, self._sizes, self._opener = kept, sizes, opener

    def open(self, key: Any) -> BinaryIO:
        return io.BufferedReader(_Replay(self._kept.get(key, []), self._sizes.get(key), self._opener, key),
                                 buffer_size=BUFFER)
