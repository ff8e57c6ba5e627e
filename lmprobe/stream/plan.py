"""The plan of a pass over a remote dataset: pieces of shard files, dealt to ranks, grouped for the cache.

Pure arithmetic on row counts, no I/O, so that its edge cases are tested on their own
(tests/stream/test_stream.py). docs/training.md explains the scheme; in short:

- **Pieces.** Each shard file's rows are cut into equal pieces of at most ``piece_bytes`` per site
  (a piece is one HTTP range request; a shard that fits in one piece is read whole, header and all).
- **Dealing.** A pass deals *pieces*, not rows, to the ranks, so that no two ranks download the same
  bytes: the pieces are put in a stratified random order (each run of ``n`` consecutive pieces of
  the dataset gives one piece to each rank) and the rows of that order are cut into ``n`` equal
  runs at block boundaries. A rank's share is then whole pieces from all over the dataset, plus at
  most two part-pieces where the cuts fall; the same cut splits a rank's share between its
  DataLoader workers.
- **Groups.** A rank's pieces are read ``K`` at a time (the cache holds the group being read and
  the next one). Which pieces are resident together is not left to chance: the share, in dataset
  order, is cut into ``K`` strata of consecutive pieces, and each group takes one piece from every
  stratum. Every group then spans the whole dataset, whatever order its publisher stored it in, so
  batches drawn from a group mix like batches drawn from everything.
- **Windows.** A group's blocks are shuffled together and read a window (at most ``pool_rows``
  rows) at a time; windows never span two groups.

Memory is a few integers per piece for the pass, plus one group's blocks at a time: flat in the
number of stored rows.

>>> pieces = Pieces.cut(np.array([256, 400, 100]), row_bytes=4096, piece_bytes=2**20)   # 256 rows a piece
>>> pieces.n, pieces.rows().tolist(), pieces.whole(np.arange(4)).tolist()
(4, [256, 200, 200, 100], [True, False, False, True])
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import numpy as np

#: blocks in one group at most: a group's plan stays small (tens of MB) whatever the cache's size
MAX_GROUP_BLOCKS = 1 << 22


@dataclass(frozen=True)
class Pieces:
    """Shard files cut into pieces: piece ``first[s] + k`` holds rows ``[k * per[s], min(rows[s], (k+1) * per[s]))``
    of shard ``s``. Pieces of a shard are equal but for a shorter last one."""

    shard_rows: np.ndarray  # (n_shards,) rows of each shard
    per: np.ndarray  # (n_shards,) rows of each of a shard's pieces (its last may hold fewer)
    first: np.ndarray  # (n_shards + 1,) the first piece of each shard; first[-1] is the number of pieces

    @classmethod
    def cut(cls, shard_rows: np.ndarray, *, row_bytes: int, piece_bytes: int) -> Pieces:
        """Pieces of at most ``piece_bytes`` (of one site's file; at least one row each)."""
        rows = np.asarray(shard_rows, dtype=np.int64)
        most = max(1, int(piece_bytes) // int(row_bytes))  # rows a piece may hold
        n = np.maximum(1, -(-rows // most))  # pieces a shard needs
        per = np.maximum(1, -(-rows // n))  # equal pieces: no sliver at the end
        count = np.where(rows > 0, -(-rows // per), 0)
        return cls(rows, per, np.concatenate([[0], np.cumsum(count)]).astype(np.int64))

    @property
    def n(self) -> int:
        return int(self.first[-1])

    def shard_of(self, piece: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.first, piece, side="right") - 1

    def locate(self, piece: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, first row, end row) of each piece, rows counted within the shard."""
        piece = np.asarray(piece, dtype=np.int64)
        s = self.shard_of(piece)
        lo = (piece - self.first[s]) * self.per[s]
        return s, lo, np.minimum(self.shard_rows[s], lo + self.per[s])

    def rows(self) -> np.ndarray:
        """(n,) rows of every piece."""
        _, lo, hi = self.locate(np.arange(self.n))
        return hi - lo

    def whole(self, piece: np.ndarray) -> np.ndarray:
        """Whether each piece is its shard's only piece (then it is read whole: header, rows and checksum)."""
        s = self.shard_of(np.asarray(piece, dtype=np.int64))
        return self.first[s + 1] - self.first[s] == 1


#: the sizes the reader picks its pieces between (per site): a request of at least 1 MiB keeps the request rate of a
#: rank at 1 GB/s under ~1,000/s (the Hub's largest plans); 64 MiB is the most a piece needs (docs/performance.md)
MIN_PIECE = 1 << 20
MAX_PIECE = 64 << 20
#: the label spread of a batch of B rows drawn from K resident pieces is sqrt(1 + B / K^2) times a uniform sample's
#: (docs/performance.md, "Mixing"): within 1.5x when K >= 0.9 sqrt(B)
MIXING_SPREAD = 1.5


@dataclass(frozen=True)
class PieceChoice:
    """The piece size a reader picks for mixing (``choose_piece``), and what it will get."""

    piece_bytes: int  # per site
    whole_share: bool  # the rank's whole share fits in its cache: read in the largest pieces, all resident
    k_needed: int  # pieces resident for a spread of MIXING_SPREAD
    k: int  # pieces resident with this piece size (``whole_share``: every piece of the share)
    spread: float  # the expected label spread against uniform sampling, sqrt(1 + B / K^2); 1.0 for a whole share
    cache_needed: int  # the cache (all of a machine's readers) that reaches MIXING_SPREAD with the smallest pieces


def choose_piece(*, share_bytes: int, cache_bytes: int, batch_size: int, n_sites: int = 1, readers: int = 1,
                 n_pieces_at_max: int | None = None) -> PieceChoice:
    """The piece size (per site) for a rank reading ``share_bytes`` (all sites) through its share of a cache of
    ``cache_bytes`` shared by ``readers`` ranks, batches of ``batch_size``.

    Half of a rank's cache holds the group being read, half the next one, so ``K = cache / (readers x 2 x piece x
    n_sites)`` pieces are resident. Pieces are sized so that ``K >= 0.9 sqrt(B)`` (a batch's spread within 1.5x of
    uniform), between MIN_PIECE and MAX_PIECE; when the share fits in the rank's cache it is read in the largest
    pieces and sampled from as a whole. At full size: 128 ranks of 8 a node, a 16 GiB cache per node, batches of
    4,096 -> K >= 58, 2 GiB a rank -> at most 2 GiB / (2 x 58) = 17.6 MiB, rounded down to 16 MiB (K = 64).

    >>> c = choose_piece(share_bytes=1600 << 20, cache_bytes=400 << 20, batch_size=4096)   # a quarter cache
    >>> c.piece_bytes >> 20, c.k, round(c.spread, 2)
    (2, 100, 1.19)
    >>> choose_piece(share_bytes=1600 << 20, cache_bytes=1600 << 20, batch_size=4096).piece_bytes >> 20
    64
    """
    b = max(1, int(batch_size))
    per_rank = max(1, int(cache_bytes) // max(1, int(readers)))
    n_sites = max(1, int(n_sites))
    k_needed = max(1, math.ceil(0.9 * math.sqrt(b)))
    if share_bytes <= per_rank:
        n = n_pieces_at_max if n_pieces_at_max is not None else max(1, -(-int(share_bytes) // (MAX_PIECE * n_sites)))
        return PieceChoice(MAX_PIECE, True, k_needed, n, 1.0, 2 * k_needed * MIN_PIECE * n_sites * int(readers))
    piece = per_rank // (2 * k_needed * n_sites)
    # a power of two at or below it: the bound is an estimate (the issue measured 1.76x where it gives 1.62x), so the
    # rounding errs towards more pieces resident
    piece = min(MAX_PIECE, max(MIN_PIECE, 1 << max(0, piece.bit_length() - 1)))
    k = max(1, per_rank // (2 * piece * n_sites))
    return PieceChoice(piece, False, k_needed, k, math.sqrt(1 + b / k**2),
                       2 * k_needed * MIN_PIECE * n_sites * max(1, int(readers)))


@dataclass(frozen=True)
class Share:
    """Parts of pieces, in dataset order: rows ``[lo, hi)`` of piece ``piece`` (``lo`` on a block boundary)."""

    piece: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    @property
    def rows(self) -> int:
        return int((self.hi - self.lo).sum())

    def __len__(self) -> int:
        return len(self.piece)


def whole_share(rows: np.ndarray) -> Share:
    """Every piece, whole."""
    rows = np.asarray(rows, dtype=np.int64)
    return Share(np.arange(len(rows), dtype=np.int64), np.zeros(len(rows), np.int64), rows.copy())


def stratified_order(n_items: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """A dealing order of ``n_items`` items for ``n`` takers: taker ``q``'s run (the ``q``-th of ``n`` runs) takes
    one item out of every ``n`` consecutive ones (which one: at random), so every run spans all the items.

    >>> stratified_order(6, 2, np.random.default_rng(0)).reshape(2, 3) // 2   # each run: one of 0-1, 2-3, 4-5
    array([[0, 1, 2],
           [0, 1, 2]])
    """
    strata = -(-n_items // n)
    pick = rng.permuted(np.tile(np.arange(n, dtype=np.int64), (strata, 1)), axis=1)  # (strata, n)
    order = (np.arange(strata, dtype=np.int64)[None, :] * n + pick.T).ravel()  # taker-major
    return order[order < n_items]


def deal(share: Share, n: int, index: int, block_rows: int, rng: np.random.Generator, *,
         shuffle: bool = True) -> Share:
    """Taker ``index``'s part of ``share`` (in dataset order) when it is dealt to ``n`` takers: whole parts in a
    stratified random order (``shuffle=False``: in dataset order), the rows of that order cut into ``n`` equal
    runs at block boundaries (the takers' rows differ by at most a block per cut). Every taker must pass an
    ``rng`` in the same state: then the cuts agree, and the takers' parts are disjoint and cover ``share``."""
    if n == 1:
        return share
    order = stratified_order(len(share), n, rng) if shuffle else np.arange(len(share), dtype=np.int64)
    lo, hi = share.lo[order], share.hi[order]
    ends = np.cumsum(hi - lo)
    total = int(ends[-1]) if len(ends) else 0

    def boundary(q: int) -> tuple[int, int]:
        """(position in the order, row within that part) of the cut before taker ``q``'s run."""
        if q == 0 or total == 0:
            return 0, int(lo[0]) if len(lo) else 0
        if q == n:
            return len(order) - 1, int(hi[-1])
        t = total * q // n
        i = min(int(np.searchsorted(ends, t, side="right")), len(order) - 1)
        before = int(ends[i - 1]) if i else 0
        row = int(lo[i]) + t - before  # the cut, rounded to the nearest block boundary of the part
        row = int(lo[i]) + int(round((row - int(lo[i])) / block_rows)) * block_rows
        return i, min(row, int(hi[i]))

    (i0, r0), (i1, r1) = boundary(index), boundary(index + 1)
    pos = np.arange(i0, i1 + 1)
    a, b = lo[pos].copy(), hi[pos].copy()
    a[0], b[-1] = max(a[0], r0), min(b[-1], r1)
    keep = b > a
    out = order[pos][keep]
    srt = np.argsort(out, kind="stable")
    return Share(share.piece[out][srt], a[keep][srt], b[keep][srt])


def groups(n_parts: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """The group of each of ``n_parts`` parts (in dataset order) when at most ``k`` are resident at a time: the
    parts are cut into ``k`` strata of consecutive ones and each group takes one part of every stratum.

    >>> g = groups(12, 4, np.random.default_rng(0))             # 4 strata of 3, 3 groups of 4
    >>> sorted((np.arange(12)[g == 0] // 3).tolist())           # group 0: one part of every stratum
    [0, 1, 2, 3]
    """
    k = max(1, min(int(k), n_parts))
    if n_parts == 0:
        return np.zeros(0, dtype=np.int64)
    n_groups = -(-n_parts // k)
    bounds = np.linspace(0, n_parts, k + 1).round().astype(np.int64)  # k strata of n_groups or n_groups - 1 parts
    missing = rng.permutation(n_groups)  # the short strata miss distinct groups in turn: groups stay balanced
    out = np.empty(n_parts, dtype=np.int64)
    short = 0
    for j in range(k):  # k is at most the cache's pieces (hundreds)
        slots = rng.permutation(n_groups)
        if bounds[j + 1] - bounds[j] < n_groups:
            slots = slots[slots != missing[short % n_groups]]
            short += 1
        out[bounds[j] : bounds[j + 1]] = slots
    return out


@dataclass
class GroupPlan:
    """One rank's (and worker's) pass over a remote dataset: groups of parts, each group's blocks shuffled and
    read in windows. Blocks of a group are made when a window of it is asked for (a few groups are kept).

    ``row_base`` is the first global row of each piece; ``window(w)`` gives a window's (piece, first row)
    blocks, each ``min(block_rows, part end - first row)`` rows long (part ends are block boundaries).
    """

    share: Share
    group: np.ndarray  # (parts,) the group of each part
    block_rows: int
    pool_rows: int
    seed: tuple
    shuffle: bool = True
    _cache: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        r = self.block_rows
        n_blocks = -(-(self.share.hi - self.share.lo) // r)
        n_groups = int(self.group.max()) + 1 if len(self.group) else 0
        self.group_blocks = np.bincount(self.group, weights=n_blocks, minlength=n_groups).astype(np.int64)
        per_window = max(1, self.pool_rows // r)
        self.group_windows = -(-self.group_blocks // per_window)
        self.first_window = np.concatenate([[0], np.cumsum(self.group_windows)]).astype(np.int64)
        self._order = np.argsort(self.group, kind="stable")  # parts of group g: _order[_starts[g]:_starts[g+1]]
        self._starts = np.concatenate([[0], np.cumsum(np.bincount(self.group, minlength=n_groups))]).astype(np.int64)

    @property
    def n_windows(self) -> int:
        return int(self.first_window[-1])

    def parts_of(self, g: int) -> np.ndarray:
        return self._order[self._starts[g] : self._starts[g + 1]]

    def group_plan(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """Group ``g``'s blocks in reading order: (piece, first row) arrays."""
        with self._lock:
            got = self._cache.get(g)
            if got is not None:
                return got
        r = self.block_rows
        parts = self.parts_of(g)
        lo, hi, piece = self.share.lo[parts], self.share.hi[parts], self.share.piece[parts]
        n = -(-(hi - lo) // r)
        first = np.repeat(np.cumsum(n) - n, n)
        start = np.repeat(lo, n) + (np.arange(int(n.sum()), dtype=np.int64) - first) * r
        shard = np.repeat(piece, n)
        if self.shuffle:
            order = np.random.default_rng((*self.seed, g)).permutation(len(shard))
            shard, start = shard[order], start[order]
        with self._lock:
            if len(self._cache) >= 3:
                self._cache.pop(next(iter(self._cache)))
            self._cache[g] = (shard, start)
        return shard, start

    def locate_window(self, w: int) -> tuple[int, int]:
        """(group, window within the group) of window ``w``."""
        g = int(np.searchsorted(self.first_window, w, side="right")) - 1
        return g, w - int(self.first_window[g])

    def _window_slice(self, g: int, i: int) -> slice:
        nb, nw = int(self.group_blocks[g]), int(self.group_windows[g])
        return slice(i * nb // nw, (i + 1) * nb // nw)  # windows of a group differ by at most one block

    def window(self, w: int) -> tuple[np.ndarray, np.ndarray]:
        g, i = self.locate_window(w)
        shard, start = self.group_plan(g)
        sl = self._window_slice(g, i)
        return shard[sl], start[sl]

    def window_pieces(self, w: int) -> np.ndarray:
        """The pieces window ``w`` reads, sorted."""
        return np.unique(self.window(w)[0])

    def window_of(self, piece: np.ndarray, row: np.ndarray) -> np.ndarray:
        """The window each (piece, row) is read in, or -1 where it is not in this share."""
        piece, row = np.asarray(piece, np.int64), np.asarray(row, np.int64)
        out = np.full(len(piece), -1, dtype=np.int64)
        key = np.lexsort((self.share.lo, self.share.piece))
        sp, slo, shi = self.share.piece[key], self.share.lo[key], self.share.hi[key]
        # the part holding each row: the last part of that piece starting at or before it
        at = np.searchsorted(sp * (2**32) + slo, piece * (2**32) + row, side="right") - 1
        ok = (at >= 0) & (sp[np.maximum(at, 0)] == piece) & (row < shi[np.maximum(at, 0)])
        r = self.block_rows
        for g in np.unique(self.group[key[at[ok]]]).tolist():
            shard, start = self.group_plan(g)
            bkey = shard * (2**32) + start
            srt = np.argsort(bkey)
            sel = np.flatnonzero(ok)[self.group[key[at[ok]]] == g]
            block = piece[sel] * (2**32) + (row[sel] - (row[sel] - slo[at[sel]]) % r)
            pos = srt[np.searchsorted(bkey[srt], block)]
            nb, nw = int(self.group_blocks[g]), int(self.group_windows[g])
            i = np.searchsorted([k * nb // nw for k in range(1, nw + 1)], pos, side="right")
            out[sel] = self.first_window[g] + i
        return out
