"""The training reader: globally shuffled batches of stored vectors, in bounded memory, at disk speed.

Works on any dataset ``lmprobe.load`` opens (local folder, ``owner/name`` / ``hf://`` on the Hub,
``s3://`` and other fsspec URLs) and on saev folders (``SaevDataset.batches``), through one engine.

>>> for batch in ShardStream("hf://datasets/me/acts", layer=12, batch_size=4096, seed=0):   # doctest: +SKIP
...     train_step(batch)                                                                   # (4096, d) float32

How a pass is shuffled (docs/training.md): every stored vector of the layer belongs to a *block* of
a few consecutive rows of one shard. The blocks of the whole dataset are put in a random order
(seeded by ``(seed, epoch)``), dealt to the ranks, and read a *window* at a time: a window is as many
blocks as fit in the memory budget, read from all over the dataset into one pool, which is
shuffled and served as batches while the next window is read on a background thread. Blocks are
small enough that each window holds at least four blocks per batch row, so a batch is as mixed as
a uniform sample of the whole layer, and the bytes are read once, in runs of whole blocks.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow.compute as pc

from .errors import InvalidArgumentError
from .format.reader import Dataset
from .format.spec import DTYPES
from .format.values import bfloat16_bits_to_float32
from .opening import load
from .units import parse_size
from .worker import prefetched

NORMALIZE = (None, "mean_norm", "standardize")
OUT_DTYPES = ("float32", "bfloat16")
DEFAULT_MEMORY = "1GiB"


class RowSource(ABC):
    """What the engine reads from: shards of rows, each row one vector per site.

    Subclasses give ``shard_rows`` (rows per shard), ``n_sites``, ``dim``, ``dtype`` (the stored
    dtype name) and ``read_rows(shard, rows, site, out)``, which gathers rows ``rows`` (sorted) of a
    shard into ``out`` ((len(rows), dim) in the stored dtype's numpy storage: raw uint16 bits for
    bfloat16). Pools hold rows as stored: converting is done once, as a batch is formed.
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


class _DatasetRows(RowSource):
    """The rows of some (hookpoint, layer) sites of an lmprobe dataset, gathered from memory maps."""

    _MAX_MAPS = 512

    def __init__(self, ds: Dataset, sites: list[tuple[str | None, int]]):
        self.ds, self.sites = ds, sites
        descs = [ds.hidden_desc(hp) for hp, _ in sites]
        dims = {d.dim for d in descs}
        if len(dims) != 1:
            raise InvalidArgumentError(f"the sites {sites} have different widths {sorted(dims)}; read them apart")
        self.dim = dims.pop()
        self.dtype = descs[0].dtype
        h = descs[0]
        self.shard_rows = [h.shard_rows(s) for s in range(len(h.shards))]
        self.n_sites = len(sites)
        self._maps: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def _map(self, shard: int, site: int) -> np.ndarray:
        key = (shard, site)
        m = self._maps.get(key)
        if m is None:
            hp, layer = self.sites[site]
            path, entry = self.ds.hidden_shard(layer, shard, hp)  # fetched; header checked against the metadata
            storage = DTYPES[self.dtype].np_storage
            m = np.memmap(path, dtype=storage, mode="r", offset=entry.start, shape=(self.shard_rows[shard], self.dim))
            self._maps[key] = m
            if len(self._maps) > self._MAX_MAPS:
                self._maps.popitem(last=False)
        else:
            self._maps.move_to_end(key)
        return m

    def prepare(self, shards: Iterable[int]) -> None:
        for s in shards:
            for site in range(self.n_sites):
                self._map(s, site)

    def read_rows(self, shard: int, rows: np.ndarray, site: int, out: np.ndarray) -> None:
        # mode="clip": no buffered copy (rows are in range by construction); one gather, page cache -> pool
        np.take(self._map(shard, site), rows, axis=0, out=out, mode="clip")


def rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world size): as given, else torch.distributed's when it is initialised, else (0, 1)."""
    if rank is None and world_size is None:
        dist = sys.modules.get("torch.distributed")  # not imported: not initialised (and torch is slow to import)
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    rank, world = int(rank or 0), int(world_size or 1)
    if world < 1 or not 0 <= rank < world:
        raise InvalidArgumentError(f"rank must be in 0..world_size-1, got rank={rank}, world_size={world}")
    return rank, world


#: blocks per pass are kept below this, so that the plan of a pass stays small (tens of MB)
_MAX_BLOCKS = 1 << 22


#: rows converted per step when a batch is formed from a bfloat16 pool: the raw rows stay in cache
_CONVERT_ROWS = 256


class Engine:
    """Windows of shuffled blocks from a ``RowSource``: the machinery behind ShardStream and saev's batches.

    Pools hold rows as stored (bfloat16 as raw bits: twice the rows of a float32 pool in the same
    memory). A batch is formed by one gather out of the pool, converted on the way in cache-sized
    steps: ``out_dtype="float32"`` gives numpy float32 batches, ``"bfloat16"`` torch bfloat16
    tensors; ``pin_memory`` allocates batches (as torch tensors) in page-locked memory.
    """

    def __init__(self, source: RowSource, batch_size: int, *, seed: int, shuffle: bool, rank: int, world: int,
                 memory: int, drop_last: bool, keep: Callable[[int], np.ndarray | None] | None = None,
                 transform: Callable[[np.ndarray], np.ndarray] | None = None, max_norm: np.ndarray | None = None,
                 block_rows: int | None = None, out_dtype: str = "float32", pin_memory: bool = False,
                 as_torch: bool = False, squeeze: bool = False):
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise InvalidArgumentError(f"batch_size must be a positive integer, got {batch_size!r}")
        if out_dtype not in OUT_DTYPES:
            raise InvalidArgumentError(f"dtype must be one of {OUT_DTYPES}, got {out_dtype!r}")
        self.source, self.batch_size = source, int(batch_size)
        self.seed, self.shuffle, self.rank, self.world = seed, shuffle, rank, world
        self.drop_last, self.keep, self.transform, self.max_norm = drop_last, keep, transform, max_norm
        self.out_dtype, self.pin_memory, self.squeeze = out_dtype, bool(pin_memory), squeeze
        self.as_torch = as_torch or self.pin_memory or out_dtype != "float32"  # batches as torch tensors
        self.storage = DTYPES[source.dtype].np_storage
        row = source.n_sites * source.dim * DTYPES[source.dtype].itemsize
        row_out = source.n_sites * source.dim * (4 if out_dtype == "float32" else 2)
        # two pools (one served, one being read; each with room for a carried batch), and the batches
        # in flight (the one being gathered and the one the consumer holds): all within ``memory``
        self.pool_rows = int((memory - 4 * self.batch_size * row_out) // (2 * row)) - self.batch_size
        if self.pool_rows < self.batch_size:
            need = 4 * self.batch_size * (row + row_out)
            raise InvalidArgumentError(f"memory={memory:,} bytes holds less than one batch per pool; give at least "
                                       f"{need:,} bytes (memory='{-(-need // 2**20)}MiB') or a smaller batch_size")
        total = sum(source.shard_rows)
        # blocks of r rows, W = pool_rows / r of them per window: a batch's label fraction then varies
        # like a uniform sample's times sqrt(1 + B (r - 1) / pool_rows) <= sqrt(1.4)
        mixing = 1 + int(0.4 * self.pool_rows / self.batch_size)
        self.block_rows = int(block_rows or max(mixing, -(-total // _MAX_BLOCKS)))
        self.dropped_by_norm = 0
        self._base = np.concatenate([[0], np.cumsum(source.shard_rows)]).astype(np.int64)

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

    def count(self, epoch: int = 0) -> int:
        """Vectors this rank gets per pass after the filters that need no data (positions, special tokens)."""
        shard, start = self.blocks(epoch)
        if self.keep is None:
            return int(self._lengths(shard, start).sum())
        total = 0
        for s, a, n in zip(shard.tolist(), start.tolist(), self._lengths(shard, start).tolist(), strict=True):
            m = self.keep(s)
            total += n if m is None else int(m[a : a + n].sum())
        return total

    # ---------------------------------------------------------------- reading

    def _rows(self, shard: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every row of some blocks, sorted by (shard, row): (shard, row) arrays."""
        order = np.lexsort((start, shard))
        shard, start = shard[order], start[order]
        n = self._lengths(shard, start)
        first = np.repeat(np.cumsum(n) - n, n)
        rows = np.repeat(start, n) + (np.arange(int(n.sum())) - first)
        return np.repeat(shard, n), rows

    def gather(self, shard: np.ndarray, rows: np.ndarray, lead: int = 0) -> np.ndarray:
        """Rows ``rows[i]`` of shards ``shard[i]`` (sorted by shard) into a (lead + n, n_sites, dim) pool."""
        src = self.source
        pool = np.empty((lead + len(rows), src.n_sites, src.dim), dtype=self.storage)
        at = lead
        scratch = None
        for s, seg in _segments(shard):
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
        return pool

    def _read_window(self, blocks: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(pool (lead + rows, n_sites, dim) as stored, global row ids) of a window's kept rows.

        The pool's first ``batch_size`` rows are left free for the rows the previous window carries
        over, so that joining them costs no copy of the window.
        """
        shard, rows = self._rows(*blocks)
        self.source.prepare(np.unique(shard).tolist())
        if self.keep is not None:
            ok = np.ones(len(rows), dtype=bool)
            for s, seg in _segments(shard):
                m = self.keep(s)
                if m is not None:
                    ok[seg] = m[rows[seg]]
            shard, rows = shard[ok], rows[ok]
        lead = self.batch_size
        pool = self.gather(shard, rows, lead)
        ids = np.empty(len(pool), dtype=np.int64)
        ids[lead:] = self._base[shard] + rows
        if self.max_norm is not None and len(rows):
            norms = self.norms(pool[lead:])
            fine = np.all(norms <= self.max_norm, axis=1)
            if not fine.all():
                self.dropped_by_norm += int((~fine).sum())
                keep = np.concatenate([np.ones(lead, dtype=bool), fine])
                pool, ids = pool[keep], ids[keep]
        return pool, ids

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
        shard = np.searchsorted(self._base, ids[order], side="right") - 1
        self.source.prepare(np.unique(shard).tolist())
        pool = self.gather(shard, ids[order] - self._base[shard])
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
        shard, start = self.blocks(epoch, worker)
        windows = self.windows(shard, start)
        w0 = int(state["window"]) if state else 0
        skip = int(state["batches"]) if state else 0
        carry_ids = np.asarray(state["carry"], dtype=np.int64) if state else np.zeros(0, np.int64)
        carry = self.read_ids(carry_ids)
        plans = [(shard[w], start[w]) for w in windows[w0:]]
        reads = prefetched(self._read_window, plans, depth=1, name="lmprobe-reader")
        bs = lead = self.batch_size
        try:
            for w, (pool, pool_ids) in enumerate(reads, start=w0):
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
            if len(carry) and not self.drop_last:
                if on_window is not None:
                    on_window(len(windows), carry_ids)
                if skip == 0:
                    yield self._finish(carry, np.arange(len(carry)))
        finally:
            reads.close()

    def _finish(self, pool: np.ndarray, idx: np.ndarray) -> Any:
        """The batch of pool rows ``idx``: one gather, converted on the way; transformed; squeezed."""
        import_torch = self.as_torch
        shape = (len(idx), *pool.shape[1:])
        if self.out_dtype == "bfloat16" and pool.dtype == np.uint16 and self.transform is None:
            import torch

            t = torch.empty(shape, dtype=torch.bfloat16, pin_memory=self.pin_memory)
            np.take(pool, idx, axis=0, out=t.view(torch.int16).numpy().view(np.uint16), mode="clip")
            return t[:, 0] if self.squeeze else t
        if import_torch:
            import torch

            t = torch.empty(shape, dtype=torch.float32, pin_memory=self.pin_memory and self.out_dtype == "float32")
            batch = t.numpy()
        else:
            batch = np.empty(shape, dtype=np.float32)
        if pool.dtype == np.float32:
            np.take(pool, idx, axis=0, out=batch, mode="clip")
        else:  # gather a few rows into a small buffer that stays in cache, convert them into the batch
            step = max(1, min(len(idx), _CONVERT_ROWS * 4096 // max(1, pool.shape[1] * pool.shape[2])))
            raw = np.empty((step, *pool.shape[1:]), dtype=pool.dtype)
            for a in range(0, len(idx), step):
                k = min(step, len(idx) - a)
                np.take(pool, idx[a : a + k], axis=0, out=raw[:k], mode="clip")
                self.to_float32(raw[:k], out=batch[a : a + k])
        if self.transform is not None:
            batch = self.transform(batch)
        if import_torch:
            if self.out_dtype == "bfloat16":
                t = torch.empty(shape, dtype=torch.bfloat16, pin_memory=self.pin_memory)
                t.copy_(torch.from_numpy(batch))
            batch = t
        return batch[:, 0] if self.squeeze else batch


class ShardStream:
    """Globally shuffled float32 batches of every stored vector of a layer (or several sites at once).

    ``ShardStream(dataset, layer, batch_size, seed=0, shuffle=True, rank=None, world_size=None,
    normalize=None, skip_first_tokens=0, skip_special_tokens=False, max_norm_ratio=None,
    memory="1GiB", layers=None, hookpoints=None, drop_last=False, dtype="float32", pin_memory=False)``

    - iterating yields ``(batch_size, dim)`` arrays, or ``(batch_size, n_sites, dim)`` with
      ``layers=[...]`` and/or ``hookpoints=[...]`` (every layer x hookpoint, same tokens);
    - ``dtype="float32"`` (default) yields numpy float32 arrays; ``dtype="bfloat16"`` yields torch
      bfloat16 tensors (a bfloat16 dataset's rows as stored, no conversion: for trainers that cast
      on the GPU); ``pin_memory=True`` yields torch tensors in page-locked memory, for fast
      ``.to("cuda", non_blocking=True)`` copies (a warning and ordinary memory without CUDA);
    - a pass is as mixed as uniform sampling of the whole layer, in about ``memory`` bytes
      (module docstring); each epoch reshuffles from ``(seed, epoch)``; ``set_epoch(e)``;
    - ``rank``/``world_size`` (default: torch.distributed's when initialised) give each rank a
      disjoint share; together the ranks see every vector exactly once per epoch;
    - ``normalize="mean_norm"`` scales each site so its mean L2 norm is sqrt(dim) (the factor is
      ``stream.scale``, to fold into a trained SAE); ``"standardize"`` subtracts the per-dimension
      mean and divides by the std, both from the dataset's stored statistics;
    - filters: ``skip_first_tokens=k`` drops positions 0..k-1 of every prompt or window;
      ``skip_special_tokens`` (True: the model's tokenizer's special ids; or a list of ids) drops
      those tokens (needs stored token ids); ``max_norm_ratio=r`` drops vectors whose norm exceeds
      r x the site's median norm (``stream.dropped_by_norm`` counts them);
    - ``len(stream)`` is this rank's vectors per pass after the filters (with ``max_norm_ratio``,
      computing it reads the data once); ``state_dict()``/``load_state_dict()`` resume mid-epoch
      exactly; ``torch_dataset()`` is an IterableDataset for DataLoader workers.
    """

    def __init__(self, dataset: Any, layer: int | None = None, batch_size: int = 4096, *, seed: int = 0,
                 shuffle: bool = True, rank: int | None = None, world_size: int | None = None,
                 normalize: str | None = None, skip_first_tokens: int = 0,
                 skip_special_tokens: bool | Sequence[int] = False, max_norm_ratio: float | None = None,
                 memory: int | str = DEFAULT_MEMORY, layers: Sequence[int] | None = None,
                 hookpoints: Sequence[str] | None = None, drop_last: bool = False, block_rows: int | None = None,
                 dtype: str = "float32", pin_memory: bool = False):
        if normalize not in NORMALIZE:
            raise InvalidArgumentError(f"normalize must be None, 'mean_norm' or 'standardize', got {normalize!r}")
        if isinstance(skip_first_tokens, bool) or not isinstance(skip_first_tokens, int) or skip_first_tokens < 0:
            raise InvalidArgumentError(f"skip_first_tokens must be a non-negative integer, got {skip_first_tokens!r}")
        if max_norm_ratio is not None and not (isinstance(max_norm_ratio, (int, float)) and max_norm_ratio > 0):
            raise InvalidArgumentError(f"max_norm_ratio must be a positive number, got {max_norm_ratio!r}")
        if (layer is None) == (layers is None):
            raise InvalidArgumentError("pass layer=L for one layer, or layers=[...] for several sites")
        if dtype not in OUT_DTYPES:
            raise InvalidArgumentError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        pinned = _check_pin_memory(pin_memory)
        self.batch_size, self.seed, self.shuffle, self.drop_last = batch_size, seed, shuffle, drop_last
        self.ds = dataset if isinstance(dataset, Dataset) else load(dataset)
        ds = self.ds
        layer_list = [layer] if layers is None else list(layers)
        hps = [None] if hookpoints is None else list(hookpoints)
        self.sites = [(hp, ds.check_layer(x, hp)) for x in layer_list for hp in hps]
        self.multi = layers is not None or hookpoints is not None and len(hps) > 1
        self.layer = self.sites[0][1]
        self.rank, self.world_size = rank_world(rank, world_size)
        source = _DatasetRows(ds, self.sites)
        self.dim = source.dim
        self.normalize = normalize
        self.skip_first_tokens, self.max_norm_ratio = skip_first_tokens, max_norm_ratio
        self._special = self._special_ids(skip_special_tokens)
        self.shift, self.scale = self._normalization(normalize)
        keep = self._keep_masks() if (skip_first_tokens or self._special is not None) else None
        self.engine = Engine(source, batch_size, seed=seed, shuffle=shuffle, rank=self.rank, world=self.world_size,
                             memory=parse_size(memory), drop_last=drop_last,
                             keep=(lambda s: keep[s]) if keep is not None else None,
                             transform=self._transform if normalize else None, block_rows=block_rows,
                             out_dtype=dtype, pin_memory=pinned, as_torch=bool(pin_memory), squeeze=not self.multi)
        if max_norm_ratio:
            self.engine.max_norm = self._median_norms(keep) * np.float32(max_norm_ratio)
        self.epoch = 0
        self._state: dict | None = None  # where the current pass stands
        self._resume: dict | None = None
        self._len: int | None = None

    # ---------------------------------------------------------------- setup

    def _special_ids(self, skip: bool | Sequence[int]) -> np.ndarray | None:
        if skip is False or skip is None:
            return None
        if skip is True:
            name = self.ds.model.get("name")
            try:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(name, revision=self.ds.model.get("revision") or None)
            except Exception as exc:
                raise InvalidArgumentError(
                    f"skip_special_tokens=True reads the special token ids from the tokenizer of {name!r}, which "
                    f"cannot be loaded here ({type(exc).__name__}); pass the ids instead: skip_special_tokens=[...]"
                ) from None
            ids = sorted(set(tok.all_special_ids))
        else:
            ids = sorted({int(x) for x in skip})
        if "token_ids" not in self.ds.schema.names:
            raise InvalidArgumentError("skip_special_tokens needs the token ids, and this dataset stores none "
                                       "(extract with --token-ids)")
        return np.asarray(ids, dtype=np.int64)

    def _keep_masks(self) -> list[np.ndarray]:
        """Per shard, which rows pass the position and special-token filters (one byte per stored row).

        The masks are views of one flat array indexed by global row (shard base + row offset).
        """
        ds = self.ds
        h = ds.hidden_desc(self.sites[0][0])
        rows = np.array([h.shard_rows(s) for s in range(len(h.shards))], dtype=np.int64)
        base = np.concatenate([[0], np.cumsum(rows)])
        keep = np.ones(int(base[-1]), dtype=bool)
        k = self.skip_first_tokens
        if ds.storage != "full_sequence":
            drop = ds.token_lengths() - 1 < k  # the one stored token is at position num_tokens-1
            if self._special is not None:
                drop |= np.isin(_last_values(ds.token_columns(["token_ids"])["token_ids"]), self._special)
            keep[base[ds.column("shard_index")[drop]] + ds.column("row_offset")[drop]] = False
        else:
            for t in ds.iter_index():  # row group by row group: memory stays small
                n = _flat(pc.list_value_length(t.column("token_shard_ids")))
                sid = _flat(pc.list_flatten(t.column("token_shard_ids")))
                off = _flat(pc.list_flatten(t.column("token_shard_offsets")))
                drop = np.arange(len(sid)) - np.repeat(np.cumsum(n) - n, n) < k  # position in the prompt
                if self._special is not None:
                    drop |= np.isin(_flat(pc.list_flatten(t.column("token_ids"))), self._special)
                keep[base[sid[drop]] + off[drop]] = False
        return np.split(keep, base[1:-1])

    def _median_norms(self, keep: list[np.ndarray] | None) -> np.ndarray:
        """Each site's median norm, (1, n_sites), from up to 65,536 kept rows drawn at random."""
        total = sum(self.engine.source.shard_rows)
        ids = np.sort(np.random.default_rng(self.seed).choice(total, size=min(total, 65536), replace=False))
        if keep is not None:
            ids = ids[np.concatenate(keep)[ids]]  # the masks are views of one flat array: this copies it once
        if not len(ids):
            return np.full((1, self.engine.source.n_sites), np.inf, dtype=np.float32)
        return np.median(self.engine.norms(self.engine.read_ids(ids)), axis=0).astype(np.float32)[None, :]

    def _normalization(self, normalize: str | None) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(shift, scale) per site, (n_sites, dim) each, from the stored statistics."""
        if normalize is None:
            return None, None
        if self.ds.meta.statistics is None:
            raise InvalidArgumentError(f"normalize={normalize!r} uses the dataset's statistics, and it stores none "
                                       "(extract without --no-statistics)")
        stats = [self.ds.statistics(layer, hookpoint=hp) for hp, layer in self.sites]
        d = self.dim
        if normalize == "mean_norm":
            scale = np.array([np.sqrt(d) / s["mean_norm"] for s in stats], dtype=np.float32)[:, None]
            return None, np.broadcast_to(scale, (len(stats), d)).copy()
        mean = np.stack([s["mean"] for s in stats]).astype(np.float32)
        std = np.stack([s["std"] for s in stats]).astype(np.float32)
        return mean, (1.0 / np.where(std > 0, std, 1.0)).astype(np.float32)

    def _transform(self, batch: np.ndarray) -> np.ndarray:
        if self.shift is not None:
            batch -= self.shift
        if self.scale is not None:
            batch *= self.scale
        return batch

    # ---------------------------------------------------------------- iterating

    @property
    def dropped_by_norm(self) -> int:
        """Vectors the ``max_norm_ratio`` filter dropped so far."""
        return self.engine.dropped_by_norm

    def __len__(self) -> int:
        """This rank's vectors per pass, after the filters."""
        if self._len is None:
            if self.max_norm_ratio is None:
                self._len = self.engine.count(self.epoch)
            else:  # the norm filter needs the data: count it once
                before = self.engine.dropped_by_norm
                shard, start = self.engine.blocks(self.epoch)
                self._len = sum(len(self.engine._read_window((shard[w], start[w]))[0]) - self.engine.batch_size
                                for w in self.engine.windows(shard, start))
                self.engine.dropped_by_norm = before
        return self._len

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def state_dict(self) -> dict:
        """Where the current pass stands: give it to ``load_state_dict`` to continue exactly from here."""
        st = self._state or {"window": 0, "batches": 0, "carry": []}
        return {"epoch": self.epoch, "seed": self.seed, "rank": self.rank, "world_size": self.world_size,
                "batch_size": self.batch_size, "window": st["window"], "batches": st["batches"],
                "carry": [int(x) for x in st["carry"]]}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "rank", "world_size", "batch_size"):
            if state.get(key) != getattr(self, key):
                raise InvalidArgumentError(f"this state was saved with {key}={state.get(key)!r}; this reader has "
                                           f"{getattr(self, key)!r}")
        self.epoch = int(state["epoch"])
        self._resume = {"window": int(state["window"]), "batches": int(state["batches"]),
                        "carry": np.asarray(state["carry"], dtype=np.int64)}
        self._state = dict(self._resume)

    def __iter__(self) -> Iterator[np.ndarray]:
        resume, self._resume = self._resume, None
        st = dict(resume) if resume else {"window": 0, "batches": 0, "carry": np.zeros(0, np.int64)}
        self._state = st

        def on_window(w: int, carry: np.ndarray) -> None:
            if w != st["window"]:
                st.update(window=w, batches=0, carry=carry)

        for batch in self.engine.iterate(self.epoch, state=resume, on_window=on_window):
            st["batches"] += 1
            yield batch
        st.update(window=0, batches=0, carry=np.zeros(0, np.int64))
        self.epoch += 1  # the next pass reshuffles

    def iterate(self, worker: tuple[int, int] = (0, 1)) -> Iterator[np.ndarray]:
        """One pass over this rank's share, split between ``worker[1]`` DataLoader workers."""
        return self.engine.iterate(self.epoch, worker)

    def torch_dataset(self):
        """A torch IterableDataset of tensors (float32, or the stream's ``dtype``); workers take disjoint blocks.

        Use ``DataLoader(stream.torch_dataset(), batch_size=None, num_workers=N)`` and call
        ``set_epoch(e)`` on it (or the stream) before each epoch to reshuffle.
        """
        import torch

        parent = self

        class _Iterable(torch.utils.data.IterableDataset):
            def set_epoch(self, epoch: int) -> None:
                parent.set_epoch(epoch)

            def __iter__(self):
                info = torch.utils.data.get_worker_info()
                worker = (info.id, info.num_workers) if info else (0, 1)
                for batch in parent.iterate(worker):
                    yield batch if isinstance(batch, torch.Tensor) else torch.from_numpy(batch)

        return _Iterable()


def _check_pin_memory(pin_memory: bool) -> bool:
    """Page-locked batches need CUDA; without it, say so once and use ordinary memory (as DataLoader does)."""
    if not pin_memory:
        return False
    import torch

    if torch.cuda.is_available():
        return True
    import warnings

    warnings.warn("pin_memory=True needs a CUDA device, and torch sees none: batches use ordinary memory",
                  stacklevel=3)
    return False


def _flat(a: Any) -> np.ndarray:
    """An Arrow integer array or chunked array as int64 numpy."""
    return a.to_numpy(zero_copy_only=False).astype(np.int64)


def _last_values(lists: Any) -> np.ndarray:
    """The last element of every list (-1 for an empty one), without building Python lists."""
    lists = lists.combine_chunks() if hasattr(lists, "combine_chunks") else lists
    offsets = _flat(lists.offsets)
    values = _flat(lists.values)
    out = np.full(len(offsets) - 1, -1, dtype=np.int64)
    full = offsets[1:] > offsets[:-1]
    out[full] = values[offsets[1:][full] - 1]
    return out


def _segments(shard: np.ndarray) -> Iterator[tuple[int, slice]]:
    """(shard, slice) for each run of equal values of a sorted shard array."""
    if not len(shard):
        return
    edges = np.concatenate([[0], np.flatnonzero(np.diff(shard)) + 1, [len(shard)]]).tolist()
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        yield int(shard[a]), slice(a, b)
