"""Keep freed batch buffers from piling up in glibc's heap during long extractions.

glibc serves large allocations with mmap, but raises that threshold every time such a block is
freed (up to 32 MiB), after which batch-sized buffers come from the heap and are kept there when
freed. Over a run the process then holds several batches' worth of dead memory, more or less by
chance. Pinning the threshold at 1 MiB returns every large buffer to the system when it is freed:
peak RSS of a full_sequence benchmark went from 42-229 MiB (run to run) to a steady 62-69 MiB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_MMAP_THRESHOLD = -3
_done = False


def bound_allocator_cache(threshold: int = 1 << 20) -> bool:
    """Pin glibc's mmap threshold (once per process); a no-op off glibc. Returns whether it applied."""
    global _done
    if _done or not sys.platform.startswith("linux"):
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _done = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):  # musl and other libcs have no mallopt
        _done = False
    return _done
