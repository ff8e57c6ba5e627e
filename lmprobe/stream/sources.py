"""Where the training reader's rows come from: a dataset's shards, local or through a node-shared bounded cache."""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import quote, unquote

import numpy as np

from ..base.hashing import sha256_file
from ..base.safeio import nofollow_opener
from ..base.units import format_size
from ..errors import FormatError, InvalidArgumentError
from ..format.dtypes import DTYPES
from ..format.reader import Dataset
from ..format.safetensors_io import header_length, parse_header
from ..storage.cache import BoundedCache
from .engine import RowSource
from .plan import Pieces, Share


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
        self.kind = DTYPES[self.dtype]
        # (shard, site) -> (codes, a scaled dtype's per-row scales or None), published as one entry: the first window
        # of a pass is read on two threads, and the second must never see codes mapped without their scales
        self._maps: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray | None]] = OrderedDict()

    def _map(self, shard: int, site: int) -> tuple[np.ndarray, np.ndarray | None]:
        key = (shard, site)
        m = self._maps.get(key)
        if m is None:
            hp, layer = self.sites[site]
            path, entry = self.ds.shards.hidden_shard(layer, shard, hp)  # fetched; header checked against the metadata
            storage = DTYPES[self.dtype].np_storage
            codes = np.memmap(path, dtype=storage, mode="r", offset=entry.start, shape=(self.shard_rows[shard], self.dim))
            scales = None
            if self.kind.scaled:  # a scaled dtype's per-row scales: the tensor beside the codes
                path, entry = self.ds.shards.hidden_scales(layer, shard, hp)
                scales = np.memmap(path, dtype=np.float32, mode="r", offset=entry.start, shape=(self.shard_rows[shard],))
            m = self._maps[key] = (codes, scales)
            if len(self._maps) > self._MAX_MAPS:
                self._maps.pop(next(iter(self._maps)), None)
        else:
            try:
                self._maps.move_to_end(key)
            except KeyError:  # evicted by the other reading thread meanwhile: the arrays in hand stay valid
                pass
        return m

    def prepare(self, shards: Iterable[int]) -> None:
        for s in shards:
            for site in range(self.n_sites):
                self._map(s, site)

    def read_rows(self, shard: int, rows: np.ndarray, site: int, out: np.ndarray) -> None:
        # mode="clip": no buffered copy (rows are in range by construction); one gather, page cache -> pool
        codes, scales = self._map(shard, site)
        if scales is not None:
            decode_rows(self.kind, codes, scales, rows, out)
            return
        np.take(codes, rows, axis=0, out=out, mode="clip")


#: bytes of codes gathered per step before they are decoded: they stay in cache
_DECODE_BYTES = 1 << 20


def decode_rows(kind, codes: np.ndarray, scales: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """Rows ``rows`` of mapped codes and scales, decoded into float32 ``out``: a gather of the codes a few
    cache-sized steps at a time, then one multiply each (the read plus dequantize of the benchmark's floor)."""
    step = max(1, _DECODE_BYTES // max(1, codes.shape[1] * codes.itemsize))
    buf = np.empty((min(step, len(rows)), codes.shape[1]), dtype=codes.dtype)
    for a in range(0, len(rows), step):
        r = rows[a : a + step]
        np.take(codes, r, axis=0, out=buf[: len(r)], mode="clip")
        kind.decode(buf[: len(r)], scales[r], out=out[a : a + len(r)])


#: bytes of one site's rows per piece, the default of ``ShardStream(piece=)``: one HTTP range request each
#: (15 requests a second at 1 GB/s: within the Hub's free tier for one rank), and small enough that a cache
#: holds a few hundred. A shard file that fits in one piece is read whole, header and all, in one request.
PIECE_BYTES = 64 * 2**20


class RemoteRows(DatasetRows):
    """The rows of a remote dataset (Hub, object storage), read in pieces through a node-shared bounded cache.

    Each shard's rows are cut into *pieces* of at most ``piece_bytes`` per site (``plan.Pieces``); to
    the engine a piece is a shard (``shard_rows`` lists the pieces), and a pass deals the pieces to
    the ranks and reads them in groups (``plan.GroupPlan``). A shard that fits in one piece is
    downloaded whole (one request, header included) and checked against the sha256 the dataset
    records before any of its rows is used; any other piece is one range request of its rows, after
    the shard's header (read once per machine: the readers share it) gave where they start. Pieces
    are downloaded ahead, in the order the pass needs them, within the cache's budget, and deleted
    once the last window that reads them is done. The Hugging Face cache is not used.

    The cache folder (``storage.cache.BoundedCache``) is shared by the readers of this dataset on the
    machine; ``readers`` is how many of them a launch starts (ranks on the node): each holds at most
    its share of the budget.
    """

    def __init__(self, ds: Dataset, sites: list[tuple[str | None, int]], budget: int | None, *,
                 piece_bytes: int | None = None, workers: int = 4, policy: Any = None, readers: int = 1):
        super().__init__(ds, sites)
        self.workers, self.policy, self.readers = workers, policy, max(1, int(readers))
        ds.files.pin()  # object storage: the version of every object is fixed now (the Hub: its commit, already)
        self._descs = [ds.hidden_desc(hp) for hp, _ in sites]
        n_shards = len(self.shard_rows)
        self.file_bytes = np.zeros((n_shards, self.n_sites), dtype=np.int64)
        for s in range(n_shards):
            for site in range(self.n_sites):
                rel, size, _ = self._record(s, site)
                if not isinstance(size, int) or size < 8:
                    raise InvalidArgumentError(f"{ds.files}: the metadata records no size for {rel}, which a bounded "
                                               "cache needs; download the dataset (`lmprobe pull`) and read the "
                                               "local copy")
                self.file_bytes[s, site] = size
        self.row_bytes = self.kind.row_bytes(self.dim)  # what a row costs to download, a scaled dtype's scale included
        self.code_bytes = self.dim * self.kind.itemsize  # a row of the values (codes) tensor in the file
        self._file_rows = np.asarray(self.shard_rows, dtype=np.int64)
        self.cut_pieces(int(piece_bytes or PIECE_BYTES))
        self.data_start = np.full((n_shards, self.n_sites), -1, dtype=np.int64)  # learned from the headers
        self.scale_start = np.full((n_shards, self.n_sites), -1, dtype=np.int64)  # a scaled dtype's scales: likewise
        self.key = hashlib.sha256(f"{ds.files}\n{ds.identity}".encode()).hexdigest()[:24]
        self._share: Share | None = None
        self._planned: deque[list[str]] = deque()  # the names each window fed to the cache will read
        self._pending: dict[str, int] = {}  # name -> windows fed and not read yet that read it
        self._pending_bytes = 0
        self._feeder: Iterator[np.ndarray] | None = None
        self._paths: dict[tuple[int, int], tuple[Any, int]] = {}  # (piece, site) -> (local path, first row)
        self._feed_lock = threading.RLock()
        self._header_lock = threading.Lock()
        self._cache: BoundedCache | None = None
        self._pid = -1
        self.budget = budget  # None: the folder's (what its readers use), else the default
        self.budget = self.cache().budget

    # ---------------------------------------------------------------- what a piece is

    def cut_pieces(self, piece_bytes: int) -> None:
        """Cut the shard files into pieces of at most ``piece_bytes`` per site (before anything is planned or read)."""
        self.piece_bytes = int(piece_bytes)
        self.pieces = Pieces.cut(self._file_rows, row_bytes=self.row_bytes, piece_bytes=self.piece_bytes)
        self.shard_rows = self.pieces.rows()  # the engine's shards are the pieces
        self._whole = self.pieces.whole(np.arange(self.pieces.n))
        self._shard_of = self.pieces.shard_of(np.arange(self.pieces.n))
        self._lo = self.pieces.locate(np.arange(self.pieces.n))[1]  # each piece's first row in its shard

    def _record(self, shard: int, site: int) -> tuple[str, Any, Any]:
        """(file, recorded size, recorded sha256) of one site's file of a shard."""
        h, (_, layer) = self._descs[site], self.sites[site]
        rec = (h.shards[shard].get("files") or {}).get(str(layer)) or {}
        return h.file(layer, shard), rec.get("bytes"), rec.get("sha256")

    def piece_size(self, piece: int) -> int:
        """Bytes a whole piece downloads, all sites together."""
        if self._whole[piece]:
            return int(self.file_bytes[self._shard_of[piece]].sum())
        return int(self.shard_rows[piece]) * self.row_bytes * self.n_sites

    def largest_piece(self) -> int:
        """Bytes of the largest piece, all sites: a whole shard file, or a piece's rows."""
        rows = np.asarray(self.shard_rows, dtype=np.int64) * self.row_bytes * self.n_sites
        whole = self.file_bytes.sum(axis=1)[self._shard_of]
        return int(np.where(self._whole, whole, rows).max(initial=1))

    def _part(self, piece: int) -> tuple[int, int]:
        """Rows [lo, hi) of ``piece`` this pass reads (a dealing cut may leave a piece's other rows to another rank)."""
        sh = self._share
        if sh is not None:
            at = int(np.searchsorted(sh.piece, piece))
            if at < len(sh.piece) and sh.piece[at] == piece:
                return int(sh.lo[at]), int(sh.hi[at])
        return 0, int(self.shard_rows[piece])

    def _name(self, piece: int, site: int, lo: int, hi: int) -> tuple[str, int]:
        """The cache name of rows [lo, hi) of a piece's file for ``site`` (the same for every reader of the
        dataset), and its size. A piece that is its shard's only one, read whole, is the shard file itself."""
        s = int(self._shard_of[piece])
        rel, _, _ = self._record(s, site)
        flat = f"{quote(rel, safe='')}#{s}"
        if self._whole[piece] and lo == 0 and hi == int(self.shard_rows[piece]):
            return flat, int(self.file_bytes[s, site])
        first, end = int(self._lo[piece]) + lo, int(self._lo[piece]) + hi
        return f"{flat}.{first}-{end}", (end - first) * self.row_bytes

    def _spec(self, name: str) -> tuple[int, int, int, int, bool]:
        """(shard, site, first row, end row, whole file) of a cache name made by ``_name``."""
        quoted, _, rest = name.partition("#")
        rel = unquote(quoted)
        shard, _, rows = rest.partition(".")
        s = int(shard)
        site = next(i for i in range(self.n_sites) if self._record(s, i)[0] == rel)
        if not rows:
            return s, site, 0, int(self.pieces.shard_rows[s]), True
        first, end = (int(x) for x in rows.split("-"))
        return s, site, first, end, False

    def use(self, share: Share | None) -> None:
        self._share = share

    # ---------------------------------------------------------------- downloads (on the cache's workers)

    def _download(self, name: str, dst: Any) -> None:
        s, site, first, end, whole = self._spec(name)
        rel, size, sha = self._record(s, site)
        files = self.ds.files
        with open(dst, "wb", opener=nofollow_opener) as f:  # the node-shared cache: a link there is not followed
            if whole:
                files.read_range(rel, 0, int(size), out=f, policy=self.policy)
            else:  # the rows' codes, then (a scaled dtype, int8) their scales: a piece file holds both
                start = self._data_start(s, site)
                files.read_range(rel, start + first * self.code_bytes, start + end * self.code_bytes, out=f,
                                 policy=self.policy)
                if self.kind.scaled:
                    sstart = int(self.scale_start[s, site])
                    files.read_range(rel, sstart + first * 4, sstart + end * 4, out=f, policy=self.policy)
        if whole:
            if isinstance(sha, str) and sha256_file(dst) != sha:
                raise FormatError(f"{rel} from {files} does not have the sha256 the dataset records ({sha[:12]}...): "
                                  "the server (or a proxy) sent other bytes of the right length; nothing of it was "
                                  "used. Try again; if it persists, the remote copy is damaged (`lmprobe validate`)")
            self._header_from_file(dst, s, site)

    def _check_start(self, start: int, s: int, site: int, row_bytes: int | None = None) -> int:
        end = start + int(self.pieces.shard_rows[s]) * (row_bytes or self.code_bytes)
        if not 8 <= start <= end <= self.file_bytes[s, site]:
            rel = self._record(s, site)[0]
            raise FormatError(f"{rel}: its rows would start at byte {start}, outside the file's "
                              f"{int(self.file_bytes[s, site])} bytes")
        return start

    def _header_from_file(self, path: Any, s: int, site: int) -> int:
        """Where the rows start in a whole shard file on disk, from its header (checked against the metadata)."""
        if self.data_start[s, site] >= 0:
            return int(self.data_start[s, site])
        rel = self._record(s, site)[0]
        size = int(self.file_bytes[s, site])
        with open(path, "rb") as f:
            n = header_length(f.read(8), size, rel)
            raw = f.read(n)
        self._starts(parse_header(raw, size, rel), s, site)
        return int(self.data_start[s, site])

    def _starts(self, header: Any, s: int, site: int) -> str:
        """Record where a shard's codes (and a scaled dtype's scales) start, from its parsed header (checked against
        the metadata); the note other readers of the machine take them from."""
        hp, layer = self.sites[site]
        start = self._check_start(self.ds.shards.hidden_header_entry(header, layer, s, hp).start, s, site)
        if self.kind.scaled:
            h = self._descs[site]
            entry = self.ds.shards.check_entry(header, h.file(layer, s), h.scale_key(layer), "float32", (),
                                               h.shard_rows(s))
            self.scale_start[s, site] = self._check_start(entry.start, s, site, row_bytes=4)
        self.data_start[s, site] = start
        return f"{start} {int(self.scale_start[s, site])}" if self.kind.scaled else str(start)

    def _data_start(self, s: int, site: int) -> int:
        """Where a shard's rows start in its file: known, or noted by another reader of this machine, or read from
        its header with a range request (then noted for the others)."""
        if self.data_start[s, site] >= 0:
            return int(self.data_start[s, site])
        rel, size, _ = self._record(s, site)
        note = f"{rel.replace('/', '%')}.start"
        with self._header_lock:
            if self.data_start[s, site] >= 0:
                return int(self.data_start[s, site])
            known = (self.cache().note(note) or "").split()
            if known and all(x.isdigit() for x in known) and len(known) == (2 if self.kind.scaled else 1):
                start = self._check_start(int(known[0]), s, site)
                if self.kind.scaled:
                    self.scale_start[s, site] = self._check_start(int(known[1]), s, site, row_bytes=4)
            else:
                files = self.ds.files
                # lmprobe's writer puts the tensor last: the header is what the rows leave of the file (a
                # second request reads the rest of a longer one)
                guess = int(size) - int(self.pieces.shard_rows[s]) * self.row_bytes
                head = files.read_range(rel, 0, max(64, min(int(size), guess, 1 << 16)), policy=self.policy)
                n = header_length(head[:8], int(size), rel)
                raw = head[8 : 8 + n] if 8 + n <= len(head) else files.read_range(rel, 8, 8 + n, policy=self.policy)
                self.cache().note(note, self._starts(parse_header(raw, int(size), rel), s, site))
                start = int(self.data_start[s, site])
            self.data_start[s, site] = start
        return start

    # ---------------------------------------------------------------- the cache and the plan of a pass

    def cache(self, share: int = 1) -> BoundedCache:
        """This process's cache (made on first use: threads do not survive a DataLoader worker's fork)."""
        if self._cache is None or self._pid != os.getpid():
            self._cache = BoundedCache(self._download, self.budget, key=self.key, label=str(self.ds.files),
                                       workers=self.workers, share=self.readers * max(1, share))
            self._pid = os.getpid()
            self._feed_lock, self._header_lock = threading.RLock(), threading.Lock()  # a fork's copies may be held
            self._feeder = None
            self._planned.clear()
            self._pending.clear()
            self._pending_bytes = 0
            self._paths.clear()
            self._maps.clear()
        return self._cache

    def _names(self, pieces: Iterable[int]) -> list[tuple[str, int]]:
        out = []
        for p in pieces:
            lo, hi = self._part(int(p))
            out += [self._name(int(p), site, lo, hi) for site in range(self.n_sites)]
        return out

    def plan(self, windows: Iterable[np.ndarray], share: int = 1) -> None:
        cache = self.cache(share)
        with self._feed_lock:
            self._feeder = iter(windows)
        self._feed(cache)

    def _feed(self, cache: BoundedCache) -> None:
        """Hand the cache the next windows' pieces, in order, until it knows what to download for a budget ahead."""
        with self._feed_lock:
            while self._feeder is not None and (len(self._planned) < 2 or self._pending_bytes < 2 * cache.cap):
                w = next(self._feeder, None)
                if w is None:
                    self._feeder = None
                    break
                names = self._names(w)
                need = sum(size for _, size in names)
                if need > cache.cap:
                    raise InvalidArgumentError(
                        f"a window of this reader reads {format_size(need)} of pieces at once, more than its share "
                        f"of the cache ({format_size(cache.cap)}); give a larger cache= or a smaller memory=")
                cache.schedule(names)
                self._planned.append([n for n, _ in names])
                for n, size in names:
                    self._pending[n] = self._pending.get(n, 0) + 1
                    self._pending_bytes += size if self._pending[n] == 1 else 0

    def prepare(self, shards: Iterable[int]) -> None:
        shards = [int(s) for s in shards]
        cache = self.cache()
        names = self._names(shards)
        with self._feed_lock:
            if self._planned and self._planned[0] == [n for n, _ in names]:
                for n in self._planned.popleft():
                    self._pending[n] -= 1
                    if self._pending[n] == 0:
                        del self._pending[n]
                        self._pending_bytes -= cache.sizes.get(n, 0)
            else:  # a read no pass planned (len(), the median norms, a resumed pass's carry): scheduled now
                cache.schedule(names)
        self._feed(cache)
        for s in shards:
            lo, _ = self._part(s)
            for site in range(self.n_sites):
                name, _ = self._name(s, site, *self._part(s))
                self._paths[(s, site)] = (cache.get(name), lo)

    def _map(self, shard: int, site: int) -> tuple[np.ndarray, np.ndarray | None]:
        key = (shard, site)
        m = self._maps.get(key)
        if m is None:
            path, lo = self._paths[key]
            _, hi = self._part(shard)
            s = int(self._shard_of[shard])
            storage = DTYPES[self.dtype].np_storage
            if self._whole[shard] and (lo, hi) == (0, int(self.shard_rows[shard])):  # the shard file itself
                offset = self._header_from_file(path, s, site)
                scales = int(self.scale_start[s, site])
            else:  # a piece file holds its rows (codes, then a scaled dtype's scales) and nothing else
                offset, scales = 0, (hi - lo) * self.code_bytes
            codes = np.memmap(path, dtype=storage, mode="r", offset=offset, shape=(hi - lo, self.dim))
            scale_map = (np.memmap(path, dtype=np.float32, mode="r", offset=scales, shape=(hi - lo,))
                         if self.kind.scaled else None)
            m = self._maps[key] = (codes, scale_map)
        return m

    def read_rows(self, shard: int, rows: np.ndarray, site: int, out: np.ndarray) -> None:
        codes, scales = self._map(shard, site)
        lo = self._paths[(shard, site)][1]
        rows = rows - lo if lo else rows
        if scales is not None:
            decode_rows(self.kind, codes, scales, rows, out)
            return
        np.take(codes, rows, axis=0, out=out, mode="clip")

    def done(self, shards: Iterable[int]) -> None:
        cache = self.cache()
        for s in shards:
            s = int(s)
            lo, hi = self._part(s)
            for site in range(self.n_sites):
                self._maps.pop((s, site), None)  # unmapped before the file goes: its disk space is freed
                self._paths.pop((s, site), None)
                name, _ = self._name(s, site, lo, hi)
                cache.release(name)

    def cancel(self) -> None:
        if self._cache is None or self._pid != os.getpid():
            return
        with self._feed_lock:
            self._feeder = None
            while self._planned:
                for n in self._planned.popleft():
                    self._cache.release(n)
            self._pending.clear()
            self._pending_bytes = 0

    def close(self) -> None:
        if self._cache is not None and self._pid == os.getpid():
            self._maps.clear()
            self._cache.close()
        self._cache = None
