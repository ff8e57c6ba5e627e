"""A shard series on disk: files that grow as rows arrive, closed and hashed when full.

The writer keeps three series (last-token, sequence, logits). A series has one file per "slot"
(a layer, or the single logits file) and cuts all of them at the same rows; ``layout.plan`` says
where. Files are written in the staging folder; the writer moves closed ones into place.

Hashing is off the critical path: a shard's sha256 covers its header, written when it closes, so
each closed file is opened at once and hashed from the page cache on the hasher thread while the
next shard is written. Checkpoints record the hashes that are done and never wait for the others;
a resumed writer re-hashes the closed shards whose hash its checkpoint lacks (``missing_hashes``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..base.hashing import sha256_file
from .layout import Cursor, Plan
from .safetensors_io import StreamingSafetensorsWriter, TensorSpec, reserved_header_size


class ShardSeries:
    """One series of shards: ``slots`` files per shard, filled by ``write`` according to a ``layout.Plan``."""

    def __init__(self, name: str, slots: list[str], specs: Callable[[str], list[TensorSpec]], cap_rows: int,
                 staging: Path, *, checksums: bool, hasher: ThreadPoolExecutor, metadata: dict[str, str],
                 fsync: bool = False):
        self.name = name
        self.slots = slots
        self.specs = specs  # slot -> one TensorSpec per tensor of the slot's file
        self.cap_rows = cap_rows
        self.staging = staging
        self.checksums = checksums
        self.hasher = hasher
        self.metadata = metadata
        self.fsync = fsync
        self.cursor = Cursor(0, 0, 0)
        self.writers: dict[str, StreamingSafetensorsWriter] = {}
        self.closed: list[dict] = []  # {"num_prompts", "num_tokens", "files": {slot: {"bytes", "staging"[, "sha256"]}}}
        self.hashes: dict[tuple[int, str], Future] = {}
        self.obsolete: list[Path] = []  # side files of closed shards, deleted after the next checkpoint

    def staging_name(self, slot: str, shard: int) -> str:
        return f"{self.name}-{slot}-{shard:06d}.safetensors"

    def _open(self, resume_rows: int | None = None) -> None:
        for slot in self.slots:
            self.writers[slot] = StreamingSafetensorsWriter(
                self.staging / self.staging_name(slot, self.cursor.shard), self.specs(slot),
                metadata=self.metadata, resume_rows=resume_rows)

    def write(self, plan: Plan, arrays: dict[str, list[np.ndarray]], counts: np.ndarray,
              packed_counts: np.ndarray | None = None) -> None:
        """Write the rows of a planned batch; ``arrays[slot]`` lists one array per tensor spec.

        ``packed_counts``: the arrays hold ``packed_counts[i]`` rows for prompt i, of which the
        first ``counts[i]`` are this series' (sequence shards keep every token but the last):
        rows are written prompt by prompt, without a copy.
        """
        has_rows = counts > 0
        prompt_end = np.cumsum(counts[has_rows])  # batch-row end of each prompt with rows
        if packed_counts is not None:
            src_start = np.concatenate([[0], np.cumsum(packed_counts)[:-1]])[has_rows]
            dst_start = np.concatenate([[0], prompt_end[:-1]])
        cur = self.cursor
        for seg in plan.segments:
            if seg.close_before:
                self.close_shard()
                cur = self.cursor
            if not self.writers:
                self._open()
            for slot in self.slots:
                w = self.writers[slot]
                if packed_counts is None:
                    w.append([a[seg.row_lo : seg.row_hi] for a in arrays[slot]])
                    continue
                first = int(np.searchsorted(dst_start, seg.row_lo))
                last = int(np.searchsorted(dst_start, seg.row_hi))
                for j in range(first, last):
                    n_rows = int(prompt_end[j] - dst_start[j])
                    w.append([a[src_start[j] : src_start[j] + n_rows] for a in arrays[slot]])
            cur = Cursor(cur.shard, cur.rows + seg.row_hi - seg.row_lo, cur.prompts + seg.prompts)
            self.cursor = cur
        if self.cursor != plan.after:
            raise AssertionError(f"{self.name} shards: wrote up to {self.cursor}, the plan says {plan.after}")

    def close_shard(self) -> None:
        """Finish the open shard (if any): real header, recorded size, hash queued; the next one is opened on demand."""
        if not self.writers:
            if self.cursor.rows:
                raise AssertionError(f"{self.name}: rows recorded but no open shard")
            return
        files = {}
        shard = self.cursor.shard
        for slot, w in self.writers.items():
            self.obsolete += w.side_paths
            size = w.finish(fsync=self.fsync)
            staged = self.staging / self.staging_name(slot, shard)
            files[slot] = {"bytes": size, "staging": staged.name}
            if self.checksums:  # opened now: the writer may move the file before its turn comes
                self.hash_later(shard, slot, open(staged, "rb", buffering=0))
        self.closed.append({"num_prompts": self.cursor.prompts, "num_tokens": self.cursor.rows, "files": files})
        self.writers = {}
        self.cursor = Cursor(shard + 1, 0, 0)
        # backpressure: a hasher that falls far behind would re-read its shards from disk, not the page cache
        while len(self.hashes) > 2 * len(self.slots):
            self._resolve(*next(iter(self.hashes)))

    def hash_later(self, shard: int, slot: str, f) -> None:
        self.hashes[(shard, slot)] = self.hasher.submit(sha256_file, f)

    def _resolve(self, shard: int, slot: str) -> None:
        self.closed[shard]["files"][slot]["sha256"] = self.hashes.pop((shard, slot)).result()

    def resolve_hashes(self, *, wait: bool) -> None:
        """Record the hashes that are done (``wait``: all of them, waiting for the hasher)."""
        for (shard, slot), fut in list(self.hashes.items()):
            if wait or fut.done():
                self._resolve(shard, slot)

    def missing_hashes(self) -> list[tuple[int, str]]:
        """Closed (shard, slot) files whose hash is neither recorded nor under way (after a resume)."""
        if not self.checksums:
            return []
        return [(shard, slot) for shard, d in enumerate(self.closed) for slot, f in d["files"].items()
                if "sha256" not in f and (shard, slot) not in self.hashes]

    def flush(self) -> None:
        for w in self.writers.values():
            w.flush(fsync=self.fsync)

    def state(self) -> dict:
        c = self.cursor
        return {"shard": c.shard, "rows": c.rows, "prompts": c.prompts, "closed": self.closed}

    def restore(self, st: dict) -> None:
        """Continue from a checkpoint's ``state()`` (checked by the caller); reopens a partial shard."""
        self.cursor = Cursor(st["shard"], st["rows"], st["prompts"])
        self.closed = st["closed"]
        if self.cursor.rows:
            self._open(resume_rows=self.cursor.rows)

    def open_shard_here(self, st: dict) -> bool:
        """Whether the partial files of the open shard a checkpoint's ``state()`` names are in the staging folder,
        each at least as long as its rows (a checkpoint copied from another machine has none of them)."""
        rows = st["rows"]
        if not rows:
            return True
        for slot in self.slots:
            specs = self.specs(slot)
            path = self.staging / self.staging_name(slot, st["shard"])
            paths = [path] + [Path(f"{path}.t{i}") for i in range(1, len(specs))]
            header = 8 + reserved_header_size(specs, self.metadata)
            for i, (p, spec) in enumerate(zip(paths, specs, strict=True)):
                if not p.is_file() or p.stat().st_size < rows * spec.row_bytes + (header if i == 0 else 0):
                    return False
        return True

    def restore_empty(self, st: dict) -> Cursor:
        """Continue from a checkpoint's ``state()`` whose open shard is not here: the shard starts empty again (its
        rows are to be written again); returns the cursor the checkpoint recorded, where the refill must end."""
        self.closed = st["closed"]
        self.cursor = Cursor(st["shard"], 0, 0)
        for slot in self.slots:  # what a kill during an earlier refill left
            path = self.staging / self.staging_name(slot, st["shard"])
            for p in [path] + [Path(f"{path}.t{i}") for i in range(1, 8)]:
                p.unlink(missing_ok=True)
        return Cursor(st["shard"], st["rows"], st["prompts"])

    def open_staging_names(self) -> set[str]:
        """Staging files of the open shard (with their side files)."""
        if not self.cursor.rows:
            return set()
        names = {self.staging_name(slot, self.cursor.shard) for slot in self.slots}
        return names | {f"{n}.t{i}" for n in names for i in range(1, 8)}

    def abort(self) -> None:
        for w in self.writers.values():
            w.abort()
        self.writers = {}
