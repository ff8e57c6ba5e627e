"""This process's place in a ``torchrun`` job: its rank, the world size, and how the ranks exchange small values
(a gloo group of its own, on the CPU whatever the model runs on)."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import (
    ExtractionError,
    LmprobeError,
    PeerStoppedError,
)
from .ranks import Gather

logger = logging.getLogger(__name__)

#: seconds without a sign of life from a peer before this rank says it stopped and exits (LMPROBE_PEER_TIMEOUT; 0
#: turns the watch off). A rank beats every PEER_TIMEOUT / 12 seconds from a thread of its own, whatever its main
#: thread does (a forward pass, a gloo wait), so only a process that is gone (or a node cut off) misses a minute.
PEER_TIMEOUT = 60.0
#: how a rank's stop is said, on every other rank, and how to go on
RESUME_HINT = "run the same command again on every node to resume"


@dataclass(frozen=True)
class Ranks:
    """This process's place in a multi-process job: rank, world size, and how the ranks exchange small values."""

    rank: int
    world: int
    all_gather: Gather | None  # one value per rank, by rank (a gloo group of its own); None for one process

    def agree(self, check: Callable[[], None]) -> None:
        """Run ``check`` on every rank; when it fails on any, every rank raises the first rank's error (one
        rank cannot stop alone: the others would wait for it)."""
        if self.world == 1:
            check()
            return
        try:
            check()
            mine = None
        except LmprobeError as exc:
            mine = str(exc)
        found = [m for m in self.all_gather(mine) if m is not None]
        if found:
            raise ExtractionError(found[0])


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of this process: torchrun's, else (0, 1)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def start_ranks() -> Ranks:
    """One process, or a rank of ``torchrun``: then the process group is joined (gloo, on the CPU, whatever the
    model runs on) with a timeout sized for long extractions (``LMPROBE_DIST_TIMEOUT`` seconds, default 14 days:
    a rank that finishes early waits for the others instead of being killed by the default ten minutes), and a
    second gloo group carries the small exchanges of reading and planning."""
    from datetime import timedelta

    rank, world = rank_and_world()
    if world == 1:
        return Ranks(0, 1, None)
    import torch.distributed as dist

    if not dist.is_initialized():
        timeout = float(os.environ.get("LMPROBE_DIST_TIMEOUT", 14 * 24 * 3600))
        dist.init_process_group(backend="gloo", timeout=timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo")

    def all_gather(value: Any) -> list:
        out: list = [None] * world
        dist.all_gather_object(out, value, group=group)
        return out

    _name_ranks(rank, world)
    timeout = float(os.environ.get("LMPROBE_PEER_TIMEOUT", PEER_TIMEOUT))
    if timeout > 0:
        PeerWatch(rank, world, timeout).start()
    return Ranks(rank, world, all_gather)


class _RankPrefix:
    """Every message of a rank names it: each node shows its own rank's lines (none is the silent one).

    A record factory, not a logger filter: a filter on the ``lmprobe`` logger would miss the records of its children
    (every module logs through ``logging.getLogger(__name__)``); only ``lmprobe``'s records are touched."""

    def __init__(self, rank: int, world: int, make: Callable[..., logging.LogRecord]):
        self.prefix = f"[rank {rank}/{world}] "
        self.make = make

    def __call__(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        record = self.make(*args, **kwargs)
        if (record.name == "lmprobe" or record.name.startswith("lmprobe.")) and isinstance(record.msg, str) \
                and not record.msg.startswith(self.prefix):
            record.msg = self.prefix + record.msg
        return record


def _name_ranks(rank: int, world: int) -> None:
    make = logging.getLogRecordFactory()
    if not isinstance(make, _RankPrefix):
        logging.setLogRecordFactory(_RankPrefix(rank, world, make))


def stopped_message(rank: int | None, why: str) -> str:
    """The one line every other rank says when rank ``rank`` stops."""
    who = f"rank {rank}" if rank is not None else "another rank of this job"
    return f"{who} stopped ({why}); {RESUME_HINT}"


def peer_stopped(exc: BaseException) -> PeerStoppedError | None:
    """The one-line error for a gloo failure that means a peer's process is gone (``Connection closed by peer``,
    a reset or refused connection): what a collective raises on the ranks that are left. None for anything else,
    which stays a bug with its traceback."""
    text = str(exc)
    gone = ("Connection closed by peer", "Connection reset by peer", "Connection refused", "Broken pipe",
            "Socket closed", "ECONNRESET")
    if isinstance(exc, RuntimeError) and any(g in text for g in gone):
        return PeerStoppedError(stopped_message(None, "its connection closed"))
    return None


class PeerWatch:
    """A thread that finds a dead peer early, through the rendezvous store (no collective, so no rank waits on it).

    Every ``timeout / 12`` seconds this rank adds 1 to its beat counter in the store and reads two keys: the job's
    ``dead`` flag and the beat of the next rank in a ring that has not finished (its successor). A successor whose
    beat has not moved for ``timeout`` seconds (or a store that has not answered that long: the node hosting it is
    gone) is dead: the rank writes the flag, so every other rank learns it within one beat, says one line and
    exits with status 1, as a kill would leave it (the checkpoints on disk are what a re-run resumes from).
    Cost at full size: 3 small store requests per rank per beat, 128 ranks at 5 s: ~80 requests/s on the store,
    however many ranks (each watches one peer, not all of them).
    """

    PREFIX = "lmprobe/peers/"

    def __init__(self, rank: int, world: int, timeout: float, *, store: Any = None, exit: Callable[[int], None] | None
                 = None):
        self.rank, self.world, self.timeout = rank, world, timeout
        self.interval = max(0.2, timeout / 12)
        self._store, self._exit = store, exit or os._exit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lmprobe-peer-watch", daemon=True)

    def start(self) -> PeerWatch:
        atexit.register(self.finish)  # a rank that ends, even with an error, is not dead: it said so
        self._thread.start()
        return self

    def finish(self) -> None:
        """This rank is done (or stopping with its own error): mark it, so the others do not wait for its beats."""
        self._stop.set()
        try:
            self.store().add(f"{self.PREFIX}done/{self.rank}", 1)
        except Exception:  # noqa: BLE001 - the store may be gone at exit: nothing to tell then
            pass

    def store(self) -> Any:
        if self._store is None:
            from datetime import timedelta

            import torch.distributed as dist

            self._store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                        timeout=timedelta(seconds=max(5.0, self.interval)))
        return self._store

    def _run(self) -> None:
        p = self.PREFIX
        watched = (self.rank + 1) % self.world
        last_beat, since, store_ok = -1, time.monotonic(), None
        started = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            try:
                store = self.store()
                store.add(f"{p}beat/{self.rank}", 1)
                if store.add(f"{p}dead", 0) > 0:
                    self._say(int(store.get(f"{p}dead_rank")), "its process is gone", tell=False)
                    return
                beat = store.add(f"{p}beat/{watched}", 0)
                store_ok = now
            except Exception as exc:  # noqa: BLE001 - no answer: the node that hosts the store may be gone
                if store_ok is None:  # never reached (no MASTER_ADDR, another launcher): no watch, never a false stop
                    if now - started > self.timeout:
                        logger.warning("lmprobe: cannot watch the other ranks through the rendezvous "
                                       "store (%s); a rank that dies is found when a collective meets it",
                                       exc)
                        return
                elif now - store_ok > self.timeout:
                    self._say(0 if self.rank else None, "the node that hosts the job's rendezvous stopped answering",
                              tell=False)
                    return
                continue
            if beat != last_beat:
                last_beat, since = beat, now
                continue
            if now - since <= self.timeout:
                continue
            try:
                done = store.add(f"{p}done/{watched}", 0) > 0
            except Exception:  # noqa: BLE001
                continue
            if not done:
                self._say(watched, f"no sign of life for {self.timeout:.0f} s", tell=True)
                return
            watched = (watched + 1) % self.world  # it finished: watch the one after it
            if watched == self.rank:
                return  # every other rank finished
            last_beat, since = -1, now

    def _say(self, dead: int | None, why: str, *, tell: bool) -> None:
        if self._stop.is_set():
            return  # this rank finished meanwhile: nothing to stop
        if tell:
            try:  # the other ranks learn it at their next beat, not a timeout later
                self.store().set(f"{self.PREFIX}dead_rank", str(dead))
                self.store().add(f"{self.PREFIX}dead", 1)
            except Exception:  # noqa: BLE001
                pass
        print(f"lmprobe extract: error: {stopped_message(dead, why)}", file=sys.stderr, flush=True)
        self._exit(1)
