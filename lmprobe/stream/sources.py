"""Where the training reader's rows come from: a dataset's shards, local or through a bounded cache."""

from __future__ import annotations

import os
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from ..format.reader import Dataset
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


class RemoteRows(DatasetRows):
    """The rows of a remote dataset (Hub, object storage), read through a bounded local cache.

    The engine plans a pass's windows up front; their shard files are downloaded ahead, in order,
    on background workers, within the cache budget, and each file is deleted once the last window
    that reads it has gathered its rows. The Hugging Face cache is not used. Each process (a
    DataLoader worker) makes its own cache, with an equal share of the budget.
    """

    def __init__(self, ds: Dataset, sites: list[tuple[str | None, int]], budget: int, workers: int = 4):
        super().__init__(ds, sites)
        self.budget, self.workers = budget, workers
        descs = [ds.hidden_desc(hp) for hp, _ in sites]
        n = len(self.shard_rows)
        self.rels = [[h.file(layer, s) for (_, layer), h in zip(sites, descs, strict=True)] for s in range(n)]
        recorded = {f.rel: f.bytes for f in ds.meta.files()}
        self.sizes: dict[str, int] = {}
        for rel in (r for rels in self.rels for r in rels):
            size = recorded.get(rel)
            if size is None:
                raise InvalidArgumentError(f"{ds.files}: the metadata records no size for {rel}, which a bounded cache "
                                           "needs; download the dataset (`lmprobe pull`) and read the local copy")
            self.sizes[rel] = size
        self.shard_bytes = [sum(self.sizes[r] for r in rels) for rels in self.rels]
        if hasattr(ds.files, "pin"):  # object storage: the version of every object is fixed now (Hub: the commit)
            ds.files.pin()
        self._cache: BoundedCache | None = None
        self._pid = -1
        self._planned: deque[list[int]] = deque()
        self._paths: dict[tuple[int, int], Any] = {}

    def cache(self, share: int = 1) -> BoundedCache:
        """This process's cache (made on first use: threads do not survive a DataLoader worker's fork)."""
        if self._cache is None or self._pid != os.getpid():
            self._cache = BoundedCache(self.ds.files, max(1, self.budget // max(1, share)), self.sizes,
                                       workers=self.workers)
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
            cache.schedule(r for s in shards for r in self.rels[s])

    def prepare(self, shards: Iterable[int]) -> None:
        shards = [int(s) for s in shards]
        cache = self.cache()
        if self._planned and self._planned[0] == shards:
            self._planned.popleft()
        else:  # a read no pass planned (len(), the median norms): scheduled now
            cache.schedule(r for s in shards for r in self.rels[s])
        for s in shards:
            for site in range(self.n_sites):
                self._paths[(s, site)] = cache.get(self.rels[s][site])

    def _map(self, shard: int, site: int) -> np.ndarray:
        key = (shard, site)
        m = self._maps.get(key)
        if m is None:
            hp, layer = self.sites[site]
            path = self._paths[key]
            entry = self.ds.hidden_entry(path, layer, shard, hp)
            m = self._maps[key] = np.memmap(path, dtype=DTYPES[self.dtype].np_storage, mode="r", offset=entry.start,
                                            shape=(self.shard_rows[shard], self.dim))
        return m

    def done(self, shards: Iterable[int]) -> None:
        cache = self.cache()
        for s in shards:
            for site in range(self.n_sites):
                self._maps.pop((int(s), site), None)  # unmapped before the file goes: its disk space is freed
                self._paths.pop((int(s), site), None)
                cache.release(self.rels[int(s)][site])

    def cancel(self) -> None:
        if self._cache is None or self._pid != os.getpid():
            return
        while self._planned:
            for s in self._planned.popleft():
                for site in range(self.n_sites):
                    self._cache.release(self.rels[s][site])

    def close(self) -> None:
        if self._cache is not None and self._pid == os.getpid():
            self._maps.clear()
            self._cache.close()
        self._cache = None
