"""Keep freed batch buffers from piling up in glibc's heap during long extractions, at no cost in speed.

A forward pass allocates and frees large temporaries every batch. glibc serves them from its
heap once its adaptive mmap threshold has risen (up to 32 MiB), which is what makes reuse
cheap; but freed blocks fragment the heap and, with one arena per thread, a process holds
several batches' worth of dead memory, more or less by chance (42-229 MiB of growth from run
to run in the extraction benchmark).

Two things bound it without touching the fast path:
- one malloc arena (``M_ARENA_MAX=1``): threads reuse each other's freed blocks;
- ``HeapTrimmer``: after a batch, when the heap's free bytes exceed what a batch reuses,
  ``malloc_trim(0)`` hands the free pages back to the system (a few milliseconds, and only
  when the heap has actually piled up).

Pinning the mmap threshold instead (every large block mapped and unmapped, an earlier
approach) bounds memory too but re-faults every temporary's pages on every batch: a third of
the throughput of a small model on CPU. Off glibc all of this is a no-op.

``check_memory`` is the other side: an allocation sized by something read from a file (an SAE
dictionary's feature count) or asked for (``--top``) is compared with the memory the machine
has left before it is made, so it is a one-line error, not a MemoryError or the OOM killer.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

from ..errors import InvalidArgumentError, LmprobeError
from .units import format_size

_M_ARENA_MAX = -8
_libc = None
_arenas_set = False


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _glibc():
    global _libc
    if _libc is None:
        _libc = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                libc.mallinfo2.restype = _MallInfo2  # glibc >= 2.33; raises AttributeError elsewhere
                libc.malloc_trim.argtypes = [ctypes.c_size_t]
                _libc = libc
            except (OSError, AttributeError):  # musl and older or other libcs
                _libc = False
    return _libc or None


def bound_allocator_cache() -> bool:
    """One malloc arena for the process (once); a no-op off glibc. Returns whether it applied."""
    global _arenas_set
    libc = _glibc()
    if libc is None:
        return False
    if not _arenas_set:
        _arenas_set = bool(libc.mallopt(_M_ARENA_MAX, 1))
    return _arenas_set


class HeapTrimmer:
    """Call after each batch: hands freed heap pages back once resident memory grows past a batch's needs.

    Make it after the model has loaded and before the first batch: it trims what loading freed,
    then takes the resident size after the first batch (extraction runs its longest batch first)
    as the working level. A later batch that ends more than ``max(floor, slack x the first
    batch's growth)`` above that level has piled up freed memory: ``malloc_trim(0)`` returns it.
    When live memory itself has grown (the trim frees too little), the level moves up, so a
    legitimately larger working set does not trim after every batch.
    """

    def __init__(self, *, slack: float = 0.5, floor: int = 32 << 20):
        self.slack = slack
        self.floor = floor
        self.limit: int | None = None
        self.trims = 0
        self._libc = _glibc()
        self._start = 0
        if self._libc is not None:
            self._libc.malloc_trim(0)  # what loading the model freed is not a batch's working memory
            self._start = resident_bytes()

    def __call__(self) -> None:
        if self._libc is None:
            return
        rss = resident_bytes()
        if self.limit is None:
            self.limit = rss + max(self.floor, int(self.slack * max(0, rss - self._start)))
            return
        if rss > self.limit:
            self._libc.malloc_trim(0)
            self.trims += 1
            after = resident_bytes()
            if after > self.limit - self.floor:  # live memory grew: a new working level
                self.limit = after + self.floor


def resident_bytes() -> int:
    """This process's resident set size (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def available_memory() -> int | None:
    """Bytes this process can still allocate, or None where unknown: the least of what the machine can give
    without swapping (Linux ``MemAvailable``), what the process's cgroup allows beyond what it uses (a container's
    ``memory.max``) and the address space its ``RLIMIT_AS`` leaves (``ulimit -v``). MemAvailable alone
    said 20 GiB where a container's limit left 2 GiB, and numpy's allocation then died with a traceback (R31)."""
    found = [v for v in (_meminfo_available(), _cgroup_room(), _address_space_room()) if v is not None]
    return max(0, min(found)) if found else None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * _PAGE
    except (AttributeError, ValueError, OSError):
        return None


def _read_int(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            text = f.read(64).strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _cgroup_room() -> int | None:
    """The cgroup's memory limit less its use (cgroup v2, else v1), for the cgroup this process is in."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8", errors="replace") as f:
            lines = f.read(4096).splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":  # v2: one unified tree
            base = "/sys/fs/cgroup" + path.rstrip("/")
            limit, used = _read_int(base + "/memory.max"), _read_int(base + "/memory.current")
        elif "memory" in controllers.split(","):
            base = "/sys/fs/cgroup/memory" + path.rstrip("/")
            limit, used = _read_int(base + "/memory.limit_in_bytes"), _read_int(base + "/memory.usage_in_bytes")
        else:
            continue
        if limit is not None and used is not None and limit < 1 << 60:  # v1 writes "no limit" as a huge number
            return limit - used
    return None


def _address_space_room() -> int | None:
    """``RLIMIT_AS`` less this process's virtual size (None: no limit)."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmSize:"):
                    return soft - int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(n_bytes: int, what: str, *, fix: str, error: type[LmprobeError] = InvalidArgumentError) -> None:
    """Raise ``error`` when ``what`` (``n_bytes``) needs more memory than is available; ``fix`` says what to do.

    >>> check_memory(1 << 70, "a 2^70-byte buffer", fix="ask for less")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    lmprobe.errors.InvalidArgumentError: a 2^70-byte buffer needs 1073741824.0 TiB of memory, more than ...
    """
    avail = available_memory()
    if avail is not None and n_bytes > avail:
        raise error(f"{what} needs {format_size(n_bytes)} of memory, more than the {format_size(avail)} available "
                    f"here; {fix}")
