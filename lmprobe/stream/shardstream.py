"""``ShardStream``, the training reader users make: globally shuffled batches of stored vectors, in bounded memory, at disk speed.

Works on any dataset ``lmprobe.load`` opens (local folder, ``owner/name`` / ``hf://`` on the Hub,
``s3://`` and other fsspec URLs) and on saev folders (``SaevDataset.batches``), through one engine.

>>> for batch in ShardStream("hf://datasets/me/acts", layer=12, batch_size=4096, seed=0):   # doctest: +SKIP
...     train_step(batch)                                                                   # (4096, d) float32

It adds to the engine (``engine.py``) and the row sources (``sources.py``) filters, normalisation and resume.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow.compute as pc

from ..base.tokenizer import resolve_tokenizer, special_token_ids
from ..base.units import format_size, parse_size
from ..errors import InvalidArgumentError
from ..format.reader import Dataset
from ..opening import load
from ..storage.hub import READER_DEADLINE, HubFiles, reader_policy
from ..storage.objectstore import object_store_policy
from .engine import OUT_DTYPES, Engine, is_in_sorted, rank_world
from .plan import MIXING_SPREAD, choose_piece, groups
from .sources import DatasetRows, RemoteRows

logger = logging.getLogger(__name__)

NORMALIZE = (None, "mean_norm", "standardize")
DEFAULT_MEMORY = "1GiB"


class ShardStream:
    """Globally shuffled float32 batches of every stored vector of a layer (or several sites at once).

    ``ShardStream(dataset, layer, batch_size, seed=0, shuffle=True, rank=None, world_size=None,
    normalize=None, skip_first_tokens=0, skip_special_tokens=False, max_norm_ratio=None,
    memory="1GiB", layers=None, hookpoints=None, drop_last=False, dtype="float32", pin_memory=False,
    cache=None, piece=None, deadline=1800)``

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
      exactly; ``torch_dataset()`` is an IterableDataset for DataLoader workers;
    - a remote dataset (Hub, object storage) is read in pieces of at most ``piece`` bytes (one request
      each; by default sized for mixing: ``plan.choose_piece``, between 1 and 64 MiB, so that a batch
      draws from enough pieces to stay within 1.5x of uniform sampling, with a warning when the cache
      is too small for that) through a cache of at most ``cache`` bytes that the ranks and workers of one machine share
      (``LOCAL_WORLD_SIZE`` of them, as torchrun sets it, each holding its share); 429/5xx answers and
      dropped or stalled connections are waited out for ``deadline`` seconds (docs/training.md);
      ``stream.resident`` is then ``K``, how many pieces one group of this rank may hold (its share of
      the cache over two pieces): a capacity, not a count of pieces read, so a layer of 4 pieces under
      the default cache shows thousands; ``stream.cache_budget`` and ``stream.piece_bytes`` are the
      sizes it came from (all three None for a local dataset).
    """

    def __init__(self, dataset: Any, layer: int | None = None, batch_size: int = 4096, *, seed: int = 0,
                 shuffle: bool = True, rank: int | None = None, world_size: int | None = None,
                 normalize: str | None = None, skip_first_tokens: int = 0,
                 skip_special_tokens: bool | Sequence[int] = False, max_norm_ratio: float | None = None,
                 memory: int | str = DEFAULT_MEMORY, layers: Sequence[int] | None = None,
                 hookpoints: Sequence[str] | None = None, drop_last: bool = False, block_rows: int | None = None,
                 dtype: str = "float32", pin_memory: bool = False, cache: int | str | None = None,
                 piece: int | str | None = None, deadline: float = READER_DEADLINE):
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
        source = self._source(cache, piece, deadline)
        self.dim = source.dim
        self.normalize = normalize
        self.skip_first_tokens, self.max_norm_ratio = skip_first_tokens, max_norm_ratio
        self._special = self._special_ids(skip_special_tokens)
        self.shift, self.scale = self._normalization(normalize)
        dropped = self._dropped_rows() if (skip_first_tokens or self._special is not None) else None
        self.engine = Engine(source, batch_size, seed=seed, shuffle=shuffle, rank=self.rank, world=self.world_size,
                             memory=parse_size(memory), drop_last=drop_last, dropped=dropped,
                             transform=self._transform if normalize else None, block_rows=block_rows,
                             out_dtype=dtype, pin_memory=pinned, as_torch=bool(pin_memory), squeeze=not self.multi)
        if isinstance(source, RemoteRows):
            # a window draws its blocks from one group of K pieces of this rank's share (plan.GroupPlan)
            self.engine.set_resident(self.resident, self.resident * int(np.max(source.shard_rows, initial=1)))
        if max_norm_ratio:
            self.engine.max_norm = self._median_norms() * np.float32(max_norm_ratio)
        self.epoch = 0
        self._state: dict | None = None  # where the current pass stands
        self._resume: dict | None = None
        self._len: int | None = None

    # ---------------------------------------------------------------- setup

    def _source(self, cache: int | str | None, piece: int | str, deadline: float) -> DatasetRows:
        """Local rows, or (a remote dataset) rows through a node-shared cache holding two groups of ``resident``
        pieces for each of the machine's readers."""
        self.resident: int | None = None
        self.cache_budget: int | None = None
        self.piece_bytes: int | None = None
        if not self.ds.files.remote:  # a local folder: read in place, no cache
            return DatasetRows(self.ds, self.sites)
        piece_bytes = parse_size(piece) if piece is not None else None
        if piece_bytes is not None and piece_bytes <= 0:
            raise InvalidArgumentError(f"piece must be a positive size, got {piece!r}")
        if not isinstance(deadline, (int, float)) or isinstance(deadline, bool) or deadline < 0:
            raise InvalidArgumentError(f"deadline must be a number of seconds >= 0, got {deadline!r}")
        budget = parse_size(cache) if cache is not None else None
        if budget is not None and budget <= 0:
            raise InvalidArgumentError(f"cache must be a positive size, got {cache!r}")
        readers = node_readers(self.world_size)
        files = getattr(self.ds.files, "files", self.ds.files)  # through a load(..., cache=) folder: the source
        policy = reader_policy(float(deadline)) if isinstance(files, HubFiles) else object_store_policy()
        source = RemoteRows(self.ds, self.sites, budget, piece_bytes=piece_bytes, policy=policy, readers=readers)
        budget = source.budget
        if cache is None:
            logger.info("lmprobe: reading %s through a local cache of at most %s (cache= / --cache to "
                        "change it)", self.ds.files, format_size(budget))
        whole_share = False
        if piece_bytes is None:  # sized for mixing (docs/performance.md, "Mixing")
            choice = choose_piece(share_bytes=int(source.file_bytes.sum()) // self.world_size, cache_bytes=budget,
                                  batch_size=self.batch_size, n_sites=source.n_sites, readers=readers)
            source.cut_pieces(choice.piece_bytes)
            whole_share = choice.whole_share
            if not whole_share and choice.spread > MIXING_SPREAD:
                _warn_once(f"lmprobe: cache={format_size(budget)} holds {choice.k} pieces of "
                           f"{format_size(choice.piece_bytes)} per rank of {self.ds.files}: batches of "
                           f"{self.batch_size} will mix about {choice.spread:.1f}x worse than uniform sampling (label "
                           f"spread); cache='{format_size(choice.cache_needed)}' would keep it within "
                           f"{MIXING_SPREAD}x")
        piece_bytes = source.piece_bytes
        biggest = source.largest_piece()
        if budget < 2 * biggest * readers:
            source.close()
            per = f" for each of the {readers} ranks of this machine" if readers > 1 else ""
            raise InvalidArgumentError(
                f"cache={format_size(budget)} holds fewer than two pieces{per} of {self.ds.files} "
                f"({format_size(biggest)} each, all sites); give at least cache='{format_size(2 * biggest * readers)}' "
                "or a smaller piece=")
        self.resident, self.cache_budget, self.piece_bytes = budget // (2 * biggest * readers), budget, piece_bytes
        if whole_share:  # the rank's share fits in its cache: one group of every piece, rows sampled from all of it
            self.resident = max(self.resident, source.pieces.n)
        return source

    def close(self) -> None:
        """Stop the downloads of a remote dataset and delete its cached files (also done when the stream goes)."""
        src = self.engine.source
        if isinstance(src, RemoteRows):
            src.close()

    def _special_ids(self, skip: bool | Sequence[int]) -> np.ndarray | None:
        if skip is False or skip is None:
            return None
        if skip is True:  # the tokenizer's files read as JSON (no transformers); else the tokenizer, loaded
            name, revision = self.ds.model.get("name"), self.ds.model.get("revision")
            ids = special_token_ids(name, revision)
            if ids is None:  # the one way a dataset's tokenizer is found: embedded, local, cached, then the Hub
                tok = resolve_tokenizer(name, revision,
                                        need="skip_special_tokens=True (or pass the ids: skip_special_tokens=[...])")
                ids = sorted(set(tok.all_special_ids))
        else:
            ids = sorted({int(x) for x in skip})
        if "token_ids" not in self.ds.schema.names:
            raise InvalidArgumentError("skip_special_tokens needs the token ids, and this dataset stores none "
                                       "(extract with --token-ids)")
        return np.asarray(ids, dtype=np.int64)

    def _dropped_rows(self) -> np.ndarray:
        """Global ids (shard base + row offset) of the stored rows the position and special-token filters drop,
        sorted: memory grows with the rows dropped (a few per prompt), not with the rows stored."""
        ds = self.ds
        h = ds.hidden_desc(self.sites[0][0])
        rows = np.array([h.shard_rows(s) for s in range(len(h.shards))], dtype=np.int64)
        base = np.concatenate([[0], np.cumsum(rows)])
        k = self.skip_first_tokens
        found: list[np.ndarray] = []
        if ds.storage != "full_sequence":
            drop = ds.token_lengths() - 1 < k  # the one stored token is at position num_tokens-1
            if self._special is not None:
                drop |= np.isin(_last_values(ds.token_columns(["token_ids"])["token_ids"]), self._special)
            found.append(base[ds.column("shard_index")[drop]] + ds.column("row_offset")[drop])
        else:
            for t in ds.iter_index():  # row group by row group: memory stays small
                n = _flat(pc.list_value_length(t.column("token_shard_ids")))
                sid = _flat(pc.list_flatten(t.column("token_shard_ids")))
                off = _flat(pc.list_flatten(t.column("token_shard_offsets")))
                drop = np.arange(len(sid)) - np.repeat(np.cumsum(n) - n, n) < k  # position in the prompt
                if self._special is not None:
                    drop |= np.isin(_flat(pc.list_flatten(t.column("token_ids"))), self._special)
                found.append(base[sid[drop]] + off[drop])
        return np.unique(np.concatenate(found)) if found else np.zeros(0, dtype=np.int64)

    def _median_norms(self) -> np.ndarray:
        """Each site's median norm, (1, n_sites), from up to 65,536 kept rows drawn at random (from a remote
        dataset: from a few of its pieces, spread over the whole dataset, so that this costs a few downloads)."""
        src = self.engine.source
        total = int(self.engine.row_base[-1])
        rng = np.random.default_rng(self.seed)
        if isinstance(src, RemoteRows):
            n_pieces = len(src.shard_rows)
            k = max(1, min(n_pieces, self.resident or 1, 16))
            picked = np.flatnonzero(groups(n_pieces, k, rng) == 0)  # one piece from each of k strata
            pool = np.concatenate([np.arange(self.engine.row_base[p], self.engine.row_base[p + 1]) for p in picked])
            ids = np.sort(rng.choice(pool, size=min(len(pool), 65536), replace=False))
        else:
            ids = np.sort(rng.choice(total, size=min(total, 65536), replace=False))
        if self.engine.dropped is not None:
            ids = ids[~is_in_sorted(self.engine.dropped, ids)]
        if not len(ids):
            return np.full((1, src.n_sites), np.inf, dtype=np.float32)
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
                self._len = self.engine.count_by_reading(self.epoch)
        return self._len

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def settings(self) -> dict:
        """Everything that decides this reader's batch sequence, as a JSON-able dict (what a state is checked against)."""
        e = self.engine
        return {
            # the settings a user passes first, then what they derive (a message names the first difference)
            "dataset": self.ds.identity, "sites": [[hp, layer] for hp, layer in self.sites],
            "seed": self.seed, "shuffle": self.shuffle, "rank": self.rank, "world_size": self.world_size,
            "batch_size": self.batch_size, "drop_last": self.drop_last, "skip_first_tokens": self.skip_first_tokens,
            "skip_special_tokens": None if self._special is None else sorted(set(self._special.tolist())),
            "max_norm_ratio": self.max_norm_ratio, "normalize": self.normalize,
            "memory": e.pool_rows, "block_rows": e.block_rows, "cache": self.resident, "piece": self.piece_bytes,
        }

    def state_dict(self) -> dict:
        """Where the current pass stands: give it to ``load_state_dict`` to continue exactly from here.

        A plain JSON-able dict: the epoch, the window, the batches served from it, the ids of the rows
        carried into it, and ``settings()`` with their fingerprint.
        """
        st = self._state or {"window": 0, "batches": 0, "carry": []}
        settings = self.settings()
        return {"epoch": self.epoch, "window": int(st["window"]), "batches": int(st["batches"]),
                "carry": [int(x) for x in st["carry"]], "settings": settings, "fingerprint": fingerprint(settings)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a ``state_dict()``: refused (one line, naming the setting) unless this reader would serve
        the same batch sequence, and unless every field is well-formed and in range."""
        if not isinstance(state, dict):
            raise InvalidArgumentError(f"a reader state must be a dict (from state_dict()), got {type(state).__name__}")
        for key in ("epoch", "window", "batches", "carry", "settings", "fingerprint"):
            if key not in state:
                raise InvalidArgumentError(f"the reader state has no {key!r}: pass the dict state_dict() returned")
        saved = state["settings"]
        if not isinstance(saved, dict) or state["fingerprint"] != fingerprint(saved):
            raise InvalidArgumentError("the reader state's settings do not match its fingerprint: it was edited "
                                       "or damaged; pass the dict state_dict() returned")
        mine = self.settings()
        for key, value in mine.items():
            if saved.get(key) != value:
                shown = f"{saved.get(key)!r}"[:80]
                hint = f" (pass piece={saved.get(key)!r})" if key == "piece" and isinstance(saved.get(key), int) else ""
                raise InvalidArgumentError(
                    f"this reader state was saved by a reader with {key}={shown}{_UNITS.get(key, '')}; this reader "
                    f"has {value!r}{_UNITS.get(key, '')}: resume with the same settings{hint}, or start the pass over")
        epoch = _count(state, "epoch", 2**62)
        plan = self.engine.pass_plan(epoch)
        window = _count(state, "window", plan.n_windows)
        carry = state["carry"]
        if not isinstance(carry, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in carry):
            raise InvalidArgumentError("the reader state's carry must be a list of row ids")
        carry_ids = np.asarray(carry, dtype=object)
        self._check_carry(carry_ids, plan, window)
        carry_ids = carry_ids.astype(np.int64)
        rows = self.engine.window_rows(plan, window) if window < plan.n_windows else 0
        most = (rows + len(carry_ids)) // self.batch_size
        if window == plan.n_windows:
            most = int(bool(len(carry_ids)) and not self.drop_last)
        batches = _count(state, "batches", most)
        self.epoch = epoch
        self._resume = {"window": window, "batches": batches, "carry": carry_ids}
        self._state = dict(self._resume)

    def _check_carry(self, carry: np.ndarray, plan: Any, window: int) -> None:
        """Carried rows: fewer than a batch, distinct, and rows of this rank's windows before ``window`` that pass
        the filters."""
        if len(carry) >= self.batch_size:
            raise InvalidArgumentError(f"the reader state's carry holds {len(carry)} rows; a carry is shorter than "
                                       f"a batch ({self.batch_size})")
        total = int(self.engine.row_base[-1])
        if any(not 0 <= x < total for x in carry):
            raise InvalidArgumentError(f"the reader state's carry names rows outside 0..{total - 1}")
        ids = carry.astype(np.int64)
        if len(np.unique(ids)) != len(ids):
            raise InvalidArgumentError("the reader state's carry names a row twice")
        if not len(ids):
            return
        s = np.searchsorted(self.engine.row_base, ids, side="right") - 1
        w = plan.window_of(s, ids - self.engine.row_base[s])
        kept = (w >= 0) & (w < window)
        if self.engine.dropped is not None:
            kept &= ~is_in_sorted(self.engine.dropped, ids)
        if not kept.all():
            raise InvalidArgumentError("the reader state's carry names rows this reader has not served before its "
                                       "window: it was saved by another reader or edited")

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


#: how a setting's value reads in a message
_UNITS = {"memory": " rows per window", "cache": " pieces resident", "piece": " bytes per piece"}
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """A warning said once per process (a reader made each epoch, or by each DataLoader worker, repeats nothing)."""
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def node_readers(world_size: int) -> int:
    """How many ranks of this launch run on this machine and share its cache folder: ``LOCAL_WORLD_SIZE`` (torchrun
    sets it), 1 for a single process."""
    if world_size <= 1:
        return 1
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return max(1, min(world_size, int(value))) if value.isdigit() else 1



def fingerprint(settings: dict) -> str:
    """sha256 of the settings as canonical JSON: what a reader state is checked against."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _count(state: dict, key: str, most: int) -> int:
    """A non-negative integer field of a reader state, at most ``most``."""
    value = state[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise InvalidArgumentError(f"the reader state's {key} must be an integer in 0..{most}, got {value!r:.40}")
    return value


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
