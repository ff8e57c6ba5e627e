"""The engine of the training reader: a pass's blocks, windows of them read ahead, batches.

How a pass is shuffled (docs/training.md): every stored vector of the layer belongs to a *block* of
a few consecutive rows of one shard. The blocks of the whole dataset are put in a random order
(seeded by ``(seed, epoch)``), dealt to the ranks, and read a *window* at a time: a window is as many
blocks as fit in the memory budget, read from all over the dataset into one pool, which is
shuffled and served as batches while the next window is read on a background thread. Blocks are
small enough that each window holds at least four blocks per batch row, so a batch is as mixed as
a uniform sample of the whole layer, and the bytes are read once, in runs of whole blocks.
A remote source (``sources.RemoteRows``) is read by another plan (``plan.GroupPlan``): its pieces are
dealt to the ranks (no two ranks download the same bytes) and read ``Engine.resident`` at a time, in
groups that each span the whole dataset, so that a window reads only what its bounded cache holds.
"""

from __future__ import annotations

import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..base.worker import prefetched, settle
from ..errors import InvalidArgumentError
from ..format.dtypes import DTYPES
from ..format.values import bfloat16_bits_to_float32, cast_bfloat16_here, on_converter
from .plan import MAX_GROUP_BLOCKS, GroupPlan, Share, deal, groups, whole_share

OUT_DTYPES = ("float32", "bfloat16")


class RowSource(ABC):
    """What the engine reads from: shards of rows, each row one vector per site.

    Subclasses give ``shard_rows`` (rows per shard), ``n_sites``, ``dim``, ``dtype`` (the stored
    dtype name) and ``read_rows(shard, rows, site, out)``, which gathers rows ``rows`` (sorted) of a
    shard into ``out`` ((len(rows), dim) in the numpy storage of ``pool_dtype(dtype)``: raw uint16 bits
    for bfloat16). Pools hold rows as stored: converting is done once, as a batch is formed. A scaled
    dtype (int8) is decoded as it is read: its pools hold float32.
    """

    shard_rows: list[int]
    n_sites: int
    dim: int
    dtype: str = "float32"

    @abstractmethod
    def read_rows(self, shard: int, rows: np.ndarray, site: int, out: np.ndarray) -> None:
        """Gather rows ``rows`` (sorted) of shard ``shard``, site ``site``, into ``out``."""

    @abstractmethod
    def prepare(self, shards: Iterable[int]) -> None:
        """Called on the reader's thread before a window is read (remote files download and are checked here)."""

    def plan(self, windows: list[np.ndarray], share: int = 1) -> None:
        """The shards each coming window will read, in order (a remote source downloads them ahead).

        ``share``: how many readers of this process split the source's resources (DataLoader workers).
        A local source reads in place and has nothing to do.
        """
        return None

    def done(self, shards: Iterable[int]) -> None:
        """A window (or a ``read_ids``) has gathered its rows from these shards."""
        return None

    def use(self, share: Share | None) -> None:
        """The parts of shards this pass reads (a remote source downloads only those rows); None: whole shards."""
        return None

    def cancel(self) -> None:
        """A pass ended early: forget the windows planned and not read."""
        return None


def pool_dtype(dtype: str) -> str:
    """The dtype a source's ``read_rows`` writes into a pool: the stored one, or the float dtype a scaled one (int8)
    decodes to (``DType.compute``)."""
    kind = DTYPES[dtype]
    return kind.compute if kind.scaled else kind.name


def rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world size): as given, else torch.distributed's when it is initialised, else (0, 1)."""
    if rank is None and world_size is None:
        dist = sys.modules.get("torch.distributed")  # not imported: not initialised (and torch is slow to import)
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    rank = 0 if rank is None else int(rank)
    world = 1 if world_size is None else int(world_size)
    if world < 1 or not 0 <= rank < world:
        raise InvalidArgumentError(f"rank must be in 0..world_size-1, got rank={rank}, world_size={world}")
    return rank, world


#: blocks per pass are kept below this, so that the plan of a pass stays small (tens of MB)
_MAX_BLOCKS = 1 << 22


#: the largest pool buffer, unless mixing a very large dataset needs more (``Engine.__init__``): small enough
#: that a pass recycles its buffers, large enough that a window reads its shards' pages in long runs
#: (64 MiB pools cost a small layer's pass 20-30% more CPU than 128 MiB ones: docs/performance.md)
POOL_BYTES = 128 * 2**20
#: pool buffers finished passes left, for the next pass of any reader of this process
_SPARE_POOLS: list[np.ndarray] = []
_SPARE_LOCK = threading.Lock()

#: rows converted per step when a batch is formed from a bfloat16 pool: the raw rows stay in cache
_CONVERT_ROWS = 256


class Engine:
    """Windows of shuffled blocks from a ``RowSource``: the machinery behind ShardStream and saev's batches.

    Pools hold rows as stored (bfloat16 as raw bits: twice the rows of a float32 pool in the same
    memory). A batch is formed by one gather out of the pool, converted on the way in cache-sized
    steps (a bfloat16 batch's two halves at once, on the two converter threads):
    ``out_dtype="float32"`` gives numpy float32 batches, ``"bfloat16"`` torch bfloat16 tensors;
    ``pin_memory`` allocates batches (as torch tensors) in page-locked memory.
    """

    def __init__(self, source: RowSource, batch_size: int, *, seed: int, shuffle: bool, rank: int, world: int,
                 memory: int, drop_last: bool, dropped: np.ndarray | None = None,
                 transform: Callable[[np.ndarray], np.ndarray] | None = None, max_norm: np.ndarray | None = None,
                 block_rows: int | None = None, out_dtype: str = "float32", pin_memory: bool = False,
                 as_torch: bool = False, squeeze: bool = False):
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise InvalidArgumentError(f"batch_size must be a positive integer, got {batch_size!r}")
        if out_dtype not in OUT_DTYPES:
            raise InvalidArgumentError(f"dtype must be one of {OUT_DTYPES}, got {out_dtype!r}")
        self.source, self.batch_size = source, int(batch_size)
        self.seed, self.shuffle, self.rank, self.world = seed, shuffle, rank, world
        self.drop_last, self.transform, self.max_norm = drop_last, transform, max_norm
        #: global ids of the rows the filters drop (sorted), or None: every row is kept
        self.dropped = None if dropped is None else np.asarray(dropped, dtype=np.int64)
        self.out_dtype, self.pin_memory, self.squeeze = out_dtype, bool(pin_memory), squeeze
        self.as_torch = as_torch or self.pin_memory or out_dtype != "float32"  # batches as torch tensors
        pooled = DTYPES[pool_dtype(source.dtype)]
        self.storage = pooled.np_storage
        row = source.n_sites * source.dim * pooled.itemsize
        row_out = source.n_sites * source.dim * (4 if out_dtype == "float32" else 2)
        # two pools (one served, one being read; each with room for a carried batch), and the batches
        # in flight (the one being gathered and the one the consumer holds): all within ``memory``
        self.pool_rows = int((memory - 4 * self.batch_size * row_out) // (2 * row)) - self.batch_size
        if self.pool_rows < self.batch_size:
            need = 4 * self.batch_size * (row + row_out)
            raise InvalidArgumentError(f"memory={memory:,} bytes holds less than one batch per pool; give at least "
                                       f"{need:,} bytes (memory='{-(-need // 2**20)}MiB') or a smaller batch_size")
        self._given_block_rows = block_rows
        self.row_base = np.concatenate([[0], np.cumsum(source.shard_rows)]).astype(np.int64)
        # windows of at most POOL_BYTES: a pass then touches two small pools of fresh memory and recycles them
        # window after window, where one pool the size of a small dataset was fresh memory every pass (on a VM
        # whose idle memory the host takes back, fresh pages cost several times the read: docs/performance.md).
        # Pools grow past it only when the plan's size forces blocks so large that mixing needs larger windows.
        for_mixing = int(2.5 * self.batch_size * max(0.0, int(self.row_base[-1]) / _MAX_BLOCKS - 1))
        self.pool_rows = min(self.pool_rows, max(self.batch_size, POOL_BYTES // row, for_mixing))
        #: shards resident at a time (a remote source: pieces): a pass deals the pieces to the ranks and reads
        #: each rank's share in groups of this many (``plan.GroupPlan``); None: the global shuffle of every block
        self.resident: int | None = None
        self._set_block_rows()
        self.dropped_by_norm = 0
        self._free_pools: list[np.ndarray] = []  # pool buffers done with, for the next windows of a pass

    def _set_block_rows(self) -> None:
        if self.resident is not None:
            # a remote pass makes one group's blocks at a time, and its pieces are on local disk: blocks of
            # single rows (as many as a group's plan allows), so that a window is a uniform sample of its group
            self.block_rows = int(self._given_block_rows or max(1, -(-self._group_rows // MAX_GROUP_BLOCKS)))
            return
        # blocks of r rows, W = pool_rows / r of them per window: a batch's label fraction then varies
        # like a uniform sample's times sqrt(1 + B (r - 1) / pool_rows) <= sqrt(1.4)
        mixing = 1 + int(0.4 * self.pool_rows / self.batch_size)
        self.block_rows = int(self._given_block_rows or max(mixing, -(-int(self.row_base[-1]) // _MAX_BLOCKS)))

    def set_resident(self, k: int, rows: int) -> None:
        """A remote source: ``k`` pieces resident at a time per rank, a group of them ``rows`` rows at most; a
        window reads within one group, so it holds at most that."""
        self.resident = max(1, int(k))
        self._group_rows = max(1, int(rows))
        self.pool_rows = max(self.batch_size, min(self.pool_rows, int(rows)))
        self._set_block_rows()

    # ---------------------------------------------------------------- the plan of a pass

    def blocks(self, epoch: int, worker: tuple[int, int] = (0, 1)) -> tuple[np.ndarray, np.ndarray]:
        """This rank's (and worker's) blocks of ``epoch`` in reading order: (shard, first row) arrays."""
        r = self.block_rows
        per = [-(-n // r) for n in self.source.shard_rows]
        shard = np.repeat(np.arange(len(per)), per).astype(np.int64)
        start = (np.arange(len(shard)) - np.repeat(np.cumsum(per) - per, per)) * r
        if self.shuffle:
            order = np.random.default_rng((self.seed, epoch)).permutation(len(shard))
            shard, start = shard[order], start[order]
        sel = slice(self.rank, None, self.world)
        shard, start = shard[sel], start[sel]
        return shard[worker[0] :: worker[1]], start[worker[0] :: worker[1]]

    def _lengths(self, shard: np.ndarray, start: np.ndarray) -> np.ndarray:
        rows = np.asarray(self.source.shard_rows, dtype=np.int64)
        return np.minimum(self.block_rows, rows[shard] - start)

    def windows(self, shard: np.ndarray, start: np.ndarray) -> list[slice]:
        """Consecutive runs of blocks of at most ``pool_rows`` rows (a block never splits)."""
        lengths = self._lengths(shard, start)
        ends = np.cumsum(lengths)
        cuts = [0]
        while cuts[-1] < len(lengths):
            before = ends[cuts[-1] - 1] if cuts[-1] else 0
            nxt = int(np.searchsorted(ends, before + self.pool_rows, side="right"))
            cuts.append(max(nxt, cuts[-1] + 1))
        return [slice(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]

    def block_rows_kept(self, shard: np.ndarray, start: np.ndarray) -> int:
        """Rows of some blocks that pass the filters needing no data."""
        n = self._lengths(shard, start)
        return int(n.sum()) - self._dropped_in(self.row_base[shard] + start, n)

    def _dropped_in(self, first: np.ndarray, n: np.ndarray) -> int:
        """How many dropped rows lie in the global row ranges [first, first + n)."""
        if self.dropped is None or not len(first):
            return 0
        d = self.dropped
        return int((np.searchsorted(d, first + n) - np.searchsorted(d, first)).sum())

    def window_rows(self, plan: Any, w: int) -> int:
        """Rows window ``w`` of a pass reads that pass the filters needing no data (its batches are at most this
        over batch_size)."""
        return self.block_rows_kept(*plan.window(w))

    def pass_plan(self, epoch: int, worker: tuple[int, int] = (0, 1)) -> Any:
        """The windows of this rank's (and worker's) pass of ``epoch``: an ``ArrayPlan`` (the global shuffle) or,
        for a remote source, a ``plan.GroupPlan`` (pieces dealt to ranks and workers, read in groups)."""
        if self.resident is None:
            shard, start = self.blocks(epoch, worker)
            return ArrayPlan(shard, start, self.windows(shard, start), self.block_rows, int(self.row_base[-1]))
        r = self.block_rows
        rows = np.asarray(self.source.shard_rows, dtype=np.int64)
        share = deal(whole_share(rows), self.world, self.rank, r, np.random.default_rng((self.seed, epoch, 1)),
                     shuffle=self.shuffle)
        share = deal(share, worker[1], worker[0], r, np.random.default_rng((self.seed, epoch, 2, self.rank)),
                     shuffle=self.shuffle)
        k = max(1, self.resident // worker[1])
        if self.shuffle:
            group = groups(len(share), k, np.random.default_rng((self.seed, epoch, 3, self.rank, worker[0])))
        else:
            group = np.arange(len(share), dtype=np.int64) // k
        return GroupPlan(share, group, r, self.pool_rows, seed=(self.seed, epoch, 4, self.rank, worker[0]),
                         shuffle=self.shuffle)

    def count(self, epoch: int = 0) -> int:
        """Vectors this rank gets per pass after the filters that need no data (positions, special tokens)."""
        plan = self.pass_plan(epoch)
        if isinstance(plan, ArrayPlan):
            return self.block_rows_kept(plan.shard, plan.start)
        sh = plan.share
        return sh.rows - self._dropped_in(self.row_base[sh.piece] + sh.lo, sh.hi - sh.lo)

    def count_by_reading(self, epoch: int = 0) -> int:
        """Vectors this rank gets per pass after every filter, the norm filter included: reads the pass once."""
        before = self.dropped_by_norm
        plan = self.pass_plan(epoch)
        self.source.use(getattr(plan, "share", None))
        self.source.plan(plan.window_pieces(w) for w in range(plan.n_windows))
        try:
            return sum(len(self._read_window(plan.window(w))[0]) - self.batch_size for w in range(plan.n_windows))
        finally:
            self.source.cancel()
            self.source.use(None)
            self.dropped_by_norm = before

    # ---------------------------------------------------------------- reading

    def _rows(self, shard: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every row of some blocks, sorted by (shard, row): (shard, row) arrays."""
        order = np.lexsort((start, shard))
        shard, start = shard[order], start[order]
        n = self._lengths(shard, start)
        first = np.repeat(np.cumsum(n) - n, n)
        rows = np.repeat(start, n) + (np.arange(int(n.sum())) - first)
        return np.repeat(shard, n), rows

    def gather(self, shard: np.ndarray, rows: np.ndarray, lead: int = 0, buffer: np.ndarray | None = None,
               threads: int = 1) -> np.ndarray:
        """Rows ``rows[i]`` of shards ``shard[i]`` (sorted by shard) into a (lead + n, n_sites, dim) pool: the
        first rows of ``buffer`` when given (a recycled pool), else a new array. ``threads=2`` reads the
        second half of the rows on a second thread (the first window of a pass: nothing else runs yet)."""
        src = self.source
        shape = (lead + len(rows), src.n_sites, src.dim)
        pool = buffer[: shape[0]] if buffer is not None else np.empty(shape, dtype=self.storage)
        if threads > 1 and len(rows) >= 2 * self.block_rows:
            half = len(rows) // 2
            with ThreadPoolExecutor(1, thread_name_prefix="lmprobe-reader") as helper:
                second = helper.submit(self._fill, pool, lead + half, shard[half:], rows[half:])
                self._fill(pool, lead, shard[:half], rows[:half])
                second.result()
        else:
            self._fill(pool, lead, shard, rows)
        return pool

    def _fill(self, pool: np.ndarray, at: int, shard: np.ndarray, rows: np.ndarray) -> None:
        src = self.source
        scratch = None
        for s, seg in segments(shard):
            r = rows[seg]
            for site in range(src.n_sites):
                if src.n_sites == 1:
                    src.read_rows(s, r, 0, pool[at : at + len(r), 0])
                else:
                    if scratch is None or len(scratch) < len(r):
                        scratch = np.empty((len(r), src.dim), dtype=self.storage)
                    src.read_rows(s, r, site, scratch[: len(r)])
                    pool[at : at + len(r), site] = scratch[: len(r)]
            at += len(r)

    def _pool_buffer(self, rows: int) -> np.ndarray | None:
        """A pool buffer the last windows of this pass have finished with, or that a finished pass of any reader of
        this process left (its pages are warm), if one holds ``rows`` rows."""
        while self._free_pools:
            try:
                buf = self._free_pools.pop()
            except IndexError:  # taken by another pass of the same engine
                break
            if len(buf) >= rows:
                return buf
        shape = (self.source.n_sites, self.source.dim)
        with _SPARE_LOCK:
            for i, buf in enumerate(_SPARE_POOLS):
                if buf.dtype == self.storage and buf.shape[1:] == shape and len(buf) >= rows:
                    return _SPARE_POOLS.pop(i)
        return None

    def _leave_pools(self) -> None:
        """At the end of a pass: its two pool buffers go to the process's spares, for the next pass of this reader
        or of another one (a few small ones only: at most two, of at most twice ``POOL_BYTES`` each)."""
        with _SPARE_LOCK:
            while self._free_pools:
                buf = self._free_pools.pop()
                if buf.nbytes <= 2 * POOL_BYTES:
                    _SPARE_POOLS.insert(0, buf)
            del _SPARE_POOLS[2:]

    @property
    def pool_capacity(self) -> int:
        """Rows of a pool buffer: the carried batch and the largest window (a block never splits)."""
        return self.batch_size + max(self.pool_rows, self.block_rows)

    def _read_window(self, blocks: tuple[np.ndarray, np.ndarray], threads: int = 1
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(pool (lead + rows, n_sites, dim) as stored, global row ids, its buffer) of a window's kept rows.

        The pool's first ``batch_size`` rows are left free for the rows the previous window carries
        over, so that joining them costs no copy of the window. Pools are the first rows of buffers
        of ``pool_capacity`` rows, recycled from window to window within a pass: a new buffer's pages
        fault in as they are first written, which cost as much as the reads themselves.
        """
        shard, rows = self._rows(*blocks)
        used = np.unique(shard).tolist()
        self.source.prepare(used)
        if self.dropped is not None and len(self.dropped):
            ok = ~is_in_sorted(self.dropped, self.row_base[shard] + rows)
            shard, rows = shard[ok], rows[ok]
        lead = self.batch_size
        n = lead + len(rows)
        buffer = self._pool_buffer(n)
        if buffer is None and n <= self.pool_capacity:
            buffer = np.empty((self.pool_capacity, self.source.n_sites, self.source.dim), dtype=self.storage)
        pool = self.gather(shard, rows, lead, buffer, threads)
        self.source.done(used)
        ids = np.empty(len(pool), dtype=np.int64)
        ids[lead:] = self.row_base[shard] + rows
        if self.max_norm is not None and len(rows):
            norms = self.norms(pool[lead:])
            fine = np.all(norms <= self.max_norm, axis=1)
            if not fine.all():
                self.dropped_by_norm += int((~fine).sum())
                keep = np.concatenate([np.ones(lead, dtype=bool), fine])
                pool, ids = pool[keep], ids[keep]
        return pool, ids, buffer

    def to_float32(self, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Pool rows (as stored) as float32."""
        if rows.dtype == np.float32 and out is None:
            return rows
        if out is None:
            out = np.empty(rows.shape, dtype=np.float32)
        if rows.dtype == np.uint16:
            return bfloat16_bits_to_float32(rows, out=out)
        out[...] = rows
        return out

    def norms(self, rows: np.ndarray) -> np.ndarray:
        """(n, n_sites) L2 norms of pool rows, converted a cache-sized step at a time."""
        out = np.empty(rows.shape[:2], dtype=np.float32)
        step = max(1, (1 << 20) // max(1, rows.shape[1] * rows.shape[2]))
        for a in range(0, len(rows), step):
            x = self.to_float32(rows[a : a + step])
            out[a : a + step] = np.sqrt(np.einsum("nsd,nsd->ns", x, x))
        return out

    def read_ids(self, ids: np.ndarray) -> np.ndarray:
        """Rows by global id, in the order given (a resumed pass's carried rows), as stored."""
        ids = np.asarray(ids, dtype=np.int64)
        order = np.argsort(ids, kind="stable")
        shard = np.searchsorted(self.row_base, ids[order], side="right") - 1
        used = np.unique(shard)
        if not len(used):
            return np.empty((0, self.source.n_sites, self.source.dim), dtype=self.storage)
        self.source.plan([used])
        self.source.prepare(used.tolist())
        pool = self.gather(shard, ids[order] - self.row_base[shard])
        self.source.done(used.tolist())
        out = np.empty_like(pool)
        out[order] = pool
        return out

    def iterate(self, epoch: int, worker: tuple[int, int] = (0, 1), state: dict | None = None,
                on_window: Callable[[int, np.ndarray], None] | None = None) -> Iterator[np.ndarray]:
        """Batches of one pass: (batch, n_sites, dim) float32.

        ``state`` resumes: ``{"window": w, "batches": j, "carry": ids}`` starts at window ``w`` with
        the carried rows ``ids``, skipping its first ``j`` batches. ``on_window(w, carry_ids)`` is
        called as each window's pool is formed (what a state_dict records).
        """
        plan = self.pass_plan(epoch, worker)
        n_windows = plan.n_windows
        w0 = int(state["window"]) if state else 0
        skip = int(state["batches"]) if state else 0
        carry_ids = np.asarray(state["carry"], dtype=np.int64) if state else np.zeros(0, np.int64)
        self.source.use(getattr(plan, "share", None))
        carry = self.read_ids(carry_ids)
        self.source.plan((plan.window_pieces(w) for w in range(w0, n_windows)), share=worker[1])
        # the first window is read on two threads: the pass waits for it, and nothing else runs yet
        reads = prefetched(lambda w: self._read_window(plan.window(w), threads=2 if w == w0 else 1),
                           range(w0, n_windows), depth=1, name="lmprobe-reader")
        bs = lead = self.batch_size
        try:
            for w, (pool, pool_ids, buffer) in enumerate(reads, start=w0):
                if on_window is not None:
                    on_window(w, carry_ids)
                c = len(carry)  # the carried rows go just before the window's, in the room left for them
                pool[lead - c : lead], pool_ids[lead - c : lead] = carry, carry_ids
                pool, pool_ids = pool[lead - c :], pool_ids[lead - c :]
                if self.shuffle:
                    order = np.random.default_rng((self.seed, epoch, self.rank, worker[0], w)).permutation(len(pool))
                else:
                    order = np.arange(len(pool))
                n_full = len(pool) // bs * bs
                for j, i in enumerate(range(0, n_full, bs)):
                    if j < skip:
                        continue
                    yield self._finish(pool, order[i : i + bs])
                skip = 0
                rest = order[n_full:]
                carry, carry_ids = pool[rest], pool_ids[rest]
                del pool, pool_ids
                if buffer is not None and len(self._free_pools) < 2:
                    self._free_pools.append(buffer)  # its rows are served (batches and the carry are copies)
                del buffer
            if len(carry) and not self.drop_last:
                if on_window is not None:
                    on_window(n_windows, carry_ids)
                if skip == 0:
                    yield self._finish(carry, np.arange(len(carry)))
        finally:
            reads.close()
            self.source.cancel()
            self.source.use(None)
            self._leave_pools()  # warm pages for the next pass, where new buffers would fault in again

    def _finish(self, pool: np.ndarray, idx: np.ndarray) -> Any:
        """The batch of pool rows ``idx``: one gather, converted on the way; transformed; squeezed."""
        import_torch = self.as_torch
        shape = (len(idx), *pool.shape[1:])
        if self.out_dtype == "bfloat16" and pool.dtype == np.uint16 and self.transform is None:
            import torch

            raw = _empty(shape, np.uint16, self.pin_memory)
            np.take(pool, idx, axis=0, out=raw.view(torch.int16).numpy().view(np.uint16), mode="clip")
            t = raw.view(torch.int16).view(torch.bfloat16)
            return t[:, 0] if self.squeeze else t
        if import_torch:
            import torch

            t = _empty(shape, np.float32, self.pin_memory and self.out_dtype == "float32")
            batch = t.numpy()
        else:
            batch = np.empty(shape, dtype=np.float32)
        if pool.dtype == np.float32:
            np.take(pool, idx, axis=0, out=batch, mode="clip")
        elif pool.dtype == np.uint16:
            # two halves gathered and cast at once, each on a converter thread, a few cache-sized rows at a time
            step = max(1, _CONVERT_ROWS * 4096 // max(1, pool.shape[1] * pool.shape[2]))
            cut = len(idx) // 2 if len(idx) >= 2 * step else len(idx)
            settle([on_converter(_gather_cast, pool, idx[a:b], batch[a:b], step)
                    for a, b in ((0, cut), (cut, len(idx))) if b > a])
        else:
            batch[...] = np.take(pool, idx, axis=0)
        if self.transform is not None:
            batch = self.transform(batch)
        if import_torch:
            if self.out_dtype == "bfloat16":
                t = _empty(shape, np.uint16, self.pin_memory).view(torch.int16).view(torch.bfloat16)
                t.copy_(torch.from_numpy(batch))
            batch = t
        return batch[:, 0] if self.squeeze else batch


def _gather_cast(pool: np.ndarray, idx: np.ndarray, out: np.ndarray, step: int) -> None:
    """Pool rows ``idx`` (raw bfloat16 bits) into float32 ``out``, ``step`` rows at a time through a buffer
    that stays in cache: one gather and one cast per row."""
    raw = np.empty((min(step, len(idx)), *pool.shape[1:]), dtype=pool.dtype)
    for a in range(0, len(idx), step):
        k = min(step, len(idx) - a)
        np.take(pool, idx[a : a + k], axis=0, out=raw[:k], mode="clip")
        cast_bfloat16_here(raw[:k], out[a : a + k])


def _empty(shape: tuple[int, ...], dtype: Any, pinned: bool):
    """A new torch tensor for a batch: page-locked, or in numpy's memory (numpy asks for huge pages on large
    arrays; torch's own fresh allocations fault 4 KiB pages, 2.5x slower here). bfloat16 goes as uint16."""
    import torch

    if pinned:
        tdtype = torch.int16 if dtype == np.uint16 else torch.float32
        return torch.empty(shape, dtype=tdtype, pin_memory=True)
    a = np.empty(shape, dtype=np.int16 if dtype == np.uint16 else dtype)
    return torch.from_numpy(a)


def segments(shard: np.ndarray) -> Iterator[tuple[int, slice]]:
    """(shard, slice) for each run of equal values of a sorted shard array."""
    if not len(shard):
        return
    edges = np.concatenate([[0], np.flatnonzero(np.diff(shard)) + 1, [len(shard)]]).tolist()
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        yield int(shard[a]), slice(a, b)


def is_in_sorted(sorted_ids: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Whether each of ``ids`` is in the sorted array ``sorted_ids``."""
    at = np.searchsorted(sorted_ids, ids)
    return (at < len(sorted_ids)) & (sorted_ids[np.minimum(at, len(sorted_ids) - 1)] == ids)


class ArrayPlan:
    """The windows of a pass as slices of its (shard, first row) block arrays: the global shuffle."""

    def __init__(self, shard: np.ndarray, start: np.ndarray, windows: list[slice], block_rows: int, n_rows: int):
        self.shard, self.start, self.windows = shard, start, windows
        self.block_rows, self._span = block_rows, n_rows + block_rows

    @property
    def n_windows(self) -> int:
        return len(self.windows)

    def window(self, w: int) -> tuple[np.ndarray, np.ndarray]:
        sl = self.windows[w]
        return self.shard[sl], self.start[sl]

    def window_pieces(self, w: int) -> np.ndarray:
        return np.unique(self.shard[self.windows[w]])

    def window_of(self, shard: np.ndarray, row: np.ndarray) -> np.ndarray:
        """The window each (shard, row) is read in, or -1 where no block of this pass holds it."""
        span, r = self._span, self.block_rows
        keys = self.shard * span + self.start
        order = np.argsort(keys)
        want = np.asarray(shard, np.int64) * span + np.asarray(row, np.int64) // r * r
        at = np.minimum(np.searchsorted(keys[order], want), max(0, len(keys) - 1))
        found = (len(keys) > 0) & (keys[order][at] == want) if len(keys) else np.zeros(len(want), bool)
        ends = np.array([w.stop for w in self.windows], dtype=np.int64)
        window = np.searchsorted(ends, order[at], side="right")
        return np.where(found, window, -1)
