"""Where the training reader's rows come from: a dataset's shards, local or through a bounded cache."""

from __future__ import annotations

import os
from collections import OrderedDict, deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from ..format.reader import Dataset
from ..format.safetensors_io import header_length, parse_header
from ..format.spec import DTYPES
from ..storage.cache import BoundedCache
from ..units import format_size
from .engine import RowSource


class DatasetRows(RowSource):
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


#: bytes of one site's rows per piece: one range request each (a few ms of overhead against ~40 ms of
#: transfer at 100 MB/s), and small enough that a cache holds hundreds of them
PIECE_BYTES = 4 * 2**20


class RemoteRows(DatasetRows):
    """The rows of a remote dataset (Hub, object storage), read in byte-range pieces through a bounded cache.

    Each shard's rows are cut into *pieces* of about ``PIECE_BYTES`` per site, fetched with one HTTP
    range request each; to the engine a piece is a shard (``shard_rows`` lists the pieces), so a
    pass takes pieces in a random order, ``Engine.resident`` at a time, from all over the dataset.
    The engine plans a pass's windows up front; their pieces are downloaded ahead, in order, on
    background workers, within the cache budget, and each is deleted once the last window that
    reads it has gathered its rows. The Hugging Face cache is not used. Each process (a DataLoader
    worker) makes its own cache, with an equal share of the budget.
    """

    def __init__(self, ds: Dataset, sites: list[tuple[str | None, int]], budget: int, workers: int = 4,
                 piece_bytes: int | None = None):
        super().__init__(ds, sites)
        self.budget, self.workers = budget, workers
        if hasattr(ds.files, "pin"):  # object storage: the version of every object is fixed now (Hub: the commit)
            ds.files.pin()
        descs = [ds.hidden_desc(hp) for hp, _ in sites]
        real_rows = list(self.shard_rows)
        recorded = {f.rel: f.bytes for f in ds.meta.files()}
        rels = [[h.file(layer, s) for (_, layer), h in zip(sites, descs, strict=True)] for s in range(len(real_rows))]
        for rel in (r for per in rels for r in per):
            if recorded.get(rel) is None:
                raise InvalidArgumentError(f"{ds.files}: the metadata records no size for {rel}, which a bounded cache "
                                           "needs; download the dataset (`lmprobe pull`) and read the local copy")
        starts = self._data_starts(rels, recorded)
        row_bytes = self.dim * DTYPES[self.dtype].itemsize
        per_piece = max(1, (piece_bytes or PIECE_BYTES) // row_bytes)
        self.pieces: list[tuple[int, int, int]] = [(s, lo, min(n, lo + per_piece))
                                                   for s, n in enumerate(real_rows) for lo in range(0, n, per_piece)]
        self.shard_rows = [hi - lo for _, lo, hi in self.pieces]  # the engine's shards are the pieces
        self.keys: list[list[str]] = []
        self.ranges: dict[str, tuple[str, int, int]] = {}
        for s, lo, hi in self.pieces:
            keys = []
            for site in range(self.n_sites):
                key = f"{rels[s][site]}.rows-{lo}-{hi}"
                self.ranges[key] = (rels[s][site], starts[(s, site)] + lo * row_bytes, starts[(s, site)] + hi * row_bytes)
                keys.append(key)
            self.keys.append(keys)
        self.sizes = {k: b - a for k, (_, a, b) in self.ranges.items()}
        self.shard_bytes = [sum(self.sizes[k] for k in keys) for keys in self.keys]
        self._cache: BoundedCache | None = None
        self._pid = -1
        self._planned: deque[list[int]] = deque()
        self._paths: dict[tuple[int, int], Any] = {}

    def _data_starts(self, rels: list[list[str]], sizes: dict[str, int | None]) -> dict[tuple[int, int], int]:
        """Where each file's tensor starts, from its header read with range requests (checked like a local one)."""
        files = self.ds.files

        def start_of(job: tuple[int, int]) -> tuple[tuple[int, int], int]:
            s, site = job
            rel, size = rels[s][site], int(sizes[rels[s][site]] or 0)
            head = files.read_range(rel, 0, min(size, 1 << 16))
            n = header_length(head[:8], size, rel)
            raw = head[8 : 8 + n] if 8 + n <= len(head) else files.read_range(rel, 8, 8 + n)
            hp, layer = self.sites[site]
            return job, self.ds.hidden_header_entry(parse_header(raw, size, rel), layer, s, hp).start

        jobs = [(s, site) for s in range(len(rels)) for site in range(self.n_sites)]
        with ThreadPoolExecutor(8, thread_name_prefix="lmprobe-headers") as pool:
            return dict(pool.map(start_of, jobs))

    def _download(self, key: str, dst: Any) -> None:
        rel, a, b = self.ranges[key]
        data = self.ds.files.read_range(rel, a, b)
        with open(dst, "wb") as f:
            f.write(data)

    def cache(self, share: int = 1) -> BoundedCache:
        """This process's cache (made on first use: threads do not survive a DataLoader worker's fork)."""
        if self._cache is None or self._pid != os.getpid():
            self._cache = BoundedCache(self._download, max(1, self.budget // max(1, share)), self.sizes,
                                       label=str(self.ds.files), workers=self.workers)
            self._pid = os.getpid()
            self._planned.clear()
            self._paths.clear()
            self._maps.clear()
        return self._cache

    def plan(self, windows: list[np.ndarray], share: int = 1) -> None:
        cache = self.cache(share)
        too_big = [w for w in windows if sum(self.shard_bytes[int(s)] for s in w) > cache.budget]
        if too_big:
            need = max(sum(self.shard_bytes[int(s)] for s in w) for w in too_big)
            raise InvalidArgumentError(
                f"a window of this reader reads {format_size(need)} of shards at once, more than the cache's "
                f"{format_size(cache.budget)}; give a larger cache= (--cache) or a smaller memory=")
        for w in windows:
            shards = [int(s) for s in w]
            self._planned.append(shards)
            cache.schedule(r for s in shards for r in self.keys[s])

    def prepare(self, shards: Iterable[int]) -> None:
        shards = [int(s) for s in shards]
        cache = self.cache()
        if self._planned and self._planned[0] == shards:
            self._planned.popleft()
        else:  # a read no pass planned (len(), the median norms): scheduled now
            cache.schedule(r for s in shards for r in self.keys[s])
        for s in shards:
            for site in range(self.n_sites):
                self._paths[(s, site)] = cache.get(self.keys[s][site])

    def _map(self, shard: int, site: int) -> np.ndarray:
        key = (shard, site)
        m = self._maps.get(key)
        if m is None:  # a piece file holds its rows and nothing else
            m = self._maps[key] = np.memmap(self._paths[key], dtype=DTYPES[self.dtype].np_storage, mode="r",
                                            shape=(self.shard_rows[shard], self.dim))
        return m

    def done(self, shards: Iterable[int]) -> None:
        cache = self.cache()
        for s in shards:
            for site in range(self.n_sites):
                self._maps.pop((int(s), site), None)  # unmapped before the file goes: its disk space is freed
                self._paths.pop((int(s), site), None)
                cache.release(self.keys[int(s)][site])

    def cancel(self) -> None:
        if self._cache is None or self._pid != os.getpid():
            return
        while self._planned:
            for s in self._planned.popleft():
                for site in range(self.n_sites):
                    self._cache.release(self.keys[s][site])

    def close(self) -> None:
        if self._cache is not None and self._pid == os.getpid():
            self._maps.clear()
            self._cache.close()
        self._cache = None
