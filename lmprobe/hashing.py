"""File hashing shared by the writer, the validator and publishing."""

from __future__ import annotations

import hashlib
import os


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file (the Hub's LFS object id), read in 8 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(8 * 1024 * 1024)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()
