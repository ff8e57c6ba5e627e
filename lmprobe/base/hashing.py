"""File hashing shared by the writer, the validator and publishing."""

from __future__ import annotations

import hashlib
import os
from typing import BinaryIO


def sha256_file(path: str | os.PathLike | BinaryIO) -> str:
    """Hex SHA-256 of a file (the Hub's LFS object id), read in 8 MiB chunks.

    ``path`` may be an open binary file, read from its start and closed when done: a file opened
    when a shard closes is hashed correctly even if the shard is renamed before its turn comes.
    hashlib releases the GIL on large buffers, so this runs in parallel with the caller's work.
    """
    h = hashlib.sha256()
    with (path if hasattr(path, "readinto") else open(path, "rb", buffering=0)) as f:  # type: ignore[union-attr]
        f.seek(0)
        buf = bytearray(8 * 1024 * 1024)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()
