"""One committer for a job's ranks: the ranks upload their files' content themselves and hand the records over.

A job of many ranks writing to one Hub repo makes its commits from one process (rank 0), so that the repo's
commit rate (about 128 an hour, shared by everyone who writes to it) is one budget for the job, and commits
take up to 1,000 files whoever uploaded them (huggingface_hub's large-folder uploader works the same way:
many uploaders, one committer). Each rank uploads its files (LFS or Xet preupload, in parallel) and sends
rank 0 a *group* per file, in order: ``{"files": [{"rel", "size", "sha256"}]}`` (content on the Hub already)
or ``{"files": [{"rel", "content"}]}`` (a small regular file, base64). A rank's last group holds its part's
statistics, card and index, the server-side renames of its provisional files and the folders it removes:
rank 0 commits a group whole, in one commit, so a part's index never lands before its renames.

Rank 0 tells each rank how many of its groups have landed (a count per rank: the groups before it all
landed), and the rank treats those files as done. The messages go through a key-value store every rank
reaches: torch.distributed's c10d store under torchrun (``dist.distributed_c10d._get_default_store()``),
no shared disk. A store needs ``set``, ``get`` (waits for the key), ``add`` (atomic counter, returns the
new value), ``check`` and ``delete_key``, as torch's TCPStore and FileStore have.

At full size (W1: 64 ranks, 23,232 files) the store carries 23,232 records of ~200 bytes, each deleted once
rank 0 has read it; rank 0 reads each rank's counter every ``poll`` seconds (64 small requests).

>>> relay = StoreRelay(store, rank=3, world=64)  # doctest: +SKIP
>>> relay.send({"files": [{"rel": "tensors/a.safetensors", "size": 10, "sha256": "..."}]})  # doctest: +SKIP
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol

from ..base.safeio import loads
from ..errors import LmprobeError, OutputInUseError, PushError


class Relay(Protocol):
    """What a HubCommitter needs to send its groups to the job's committer, or to receive them."""

    rank: int

    def send(self, group: dict) -> None:
        """Hand one group of this rank's to the job's committer (groups are committed in the order sent)."""

    def landed(self) -> int:
        """How many of this rank's groups have landed (every one before that count did)."""

    def receive(self) -> list[tuple[tuple[int, int], dict]]:
        """The committer: the groups sent since the last call, each with its id (rank, number)."""

    def report(self, gid: tuple[int, int]) -> None:
        """The committer: group ``gid`` landed."""

    def fail(self, message: str) -> None:
        """The committer failed: every sender's next ``landed`` raises a PushError with ``message``."""


class StoreRelay:
    """A :class:`Relay` over a key-value store (torch.distributed's c10d store under torchrun)."""

    def __init__(self, store: Any, *, rank: int, world: int, prefix: str = "lmprobe/commits"):
        self.store, self.rank, self.world, self.prefix = store, rank, world, prefix
        self._seen = [0] * world  # committer: groups read, per rank
        self._landed: list[set[int]] = [set() for _ in range(world)]  # committer: landed beyond the count
        self._count = [0] * world  # committer: groups landed in order, per rank
        self._next = 0  # sender: this rank's next group number (one sender per rank, calls in order)

    def _key(self, *parts: object) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def send(self, group: dict) -> None:
        # the record first, then the count: the committer never waits on a key (a c10d store client may hold its
        # connection while it waits, and rank 0's sender shares that client)
        self.store.set(self._key("group", self.rank, self._next), json.dumps(group))
        self._next += 1
        self.store.add(self._key("sent", self.rank), 1)

    def landed(self) -> int:
        if self.store.check([self._key("failed")]):
            raise PushError(f"the job's committer (rank 0) failed: {self.store.get(self._key('failed')).decode()}")
        key = self._key("landed", self.rank)
        return int(self.store.get(key)) if self.store.check([key]) else 0

    def fail(self, message: str) -> None:
        self.store.set(self._key("failed"), message)

    def share_claim(self, claim: Callable[[], str]) -> str:
        """Rank 0: ``claim()`` (the job's claim on its folder, claim.py: the job id), told to every rank; a refusal
        too, then raised here (every rank stops with the same line)."""
        try:
            job = claim()
        except LmprobeError as exc:
            self.store.set(self._key("claim"), json.dumps({"error": str(exc)}))
            raise
        self.store.set(self._key("claim"), json.dumps({"job": job}))
        return job

    def claimed(self) -> str:
        """Another rank: the job id rank 0 claimed the folder under (waits for it), or rank 0's refusal, raised."""
        told = loads(self.store.get(self._key("claim")), what="the job's claim", error=PushError)
        if isinstance(told, dict) and isinstance(told.get("job"), str):
            return told["job"]
        raise OutputInUseError(str(told.get("error") if isinstance(told, dict) else told))

    def receive(self) -> list[tuple[tuple[int, int], dict]]:
        out = []
        for r in range(self.world):
            n = int(self.store.add(self._key("sent", r), 0))
            for i in range(self._seen[r], n):
                key = self._key("group", r, i)
                raw = self.store.get(key)  # set before the count said it was there
                self.store.delete_key(key)
                try:
                    group = json.loads(raw)
                except ValueError as exc:
                    raise PushError(f"rank {r} sent a malformed commit record ({exc}); run the job again") from exc
                out.append(((r, i), group))
            self._seen[r] = n
        return out

    def report(self, gid: tuple[int, int]) -> None:
        r, i = gid
        self._landed[r].add(i)
        n = self._count[r]
        while n in self._landed[r]:
            self._landed[r].discard(n)
            n += 1
        if n != self._count[r]:
            self._count[r] = n
            self.store.set(self._key("landed", r), str(n))
