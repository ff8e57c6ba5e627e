"""Reading untrusted files: only regular files, sizes bounded before reading, JSON that cannot recurse away.

Everything read from a dataset, an SAE dictionary, a saev folder or a staging folder goes
through here (docs/security.md): a FIFO would block the reader forever, a folder would fail in
the middle of a read, a 10 GB "JSON" file would be read whole, and deeply nested JSON exhausts
the interpreter's stack.
"""

from __future__ import annotations

import json
import os
import stat
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
