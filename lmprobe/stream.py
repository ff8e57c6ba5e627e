"""A streaming training reader: shuffled batches of stored vectors, prefetching shards in the background.

Works on any dataset ``lmprobe.load`` opens (local folder, ``owner/name`` / ``hf://`` on the Hub,
``s3://`` and other fsspec URLs): shards are fetched (downloaded when remote) and read on a
background thread while the consumer trains on the current pool.

>>> for batch in ShardStream("hf://datasets/me/acts", layer=12, batch_size=4096, seed=0):   # doctest: +SKIP
...     train_step(batch)                                                                   # (4096, d) float32
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from .errors import InvalidArgumentError
from .format.reader import Dataset
from .format.safetensors_io import read_rows_into
from .format.spec import DTYPES
from .format.values import bfloat16_bits_to_float32
from .opening import load
from .worker import prefetched


class ShardStream:
    """Shuffled (batch_size, dim) float32 batches of every stored vector of one layer.

    Each pass reads every shard of the layer once (last-token and sequence shards: every stored
    token), in a seeded random order, split across DataLoader workers. ``pool_shards`` shards are
    pooled and shuffled together; ``prefetch`` more are fetched ahead on a background thread.
    Memory stays at about (pool_shards + prefetch) shards.
    """

    def __init__(self, dataset: Any, layer: int, batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 pool_shards: int = 2, prefetch: int = 2, drop_last: bool = False):
        self.ds = dataset if isinstance(dataset, Dataset) else load(dataset)
        self.layer = self.ds.check_layer(layer)
        if batch_size < 1 or pool_shards < 1 or prefetch < 0:
            raise InvalidArgumentError("batch_size and pool_shards must be >= 1, prefetch >= 0")
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.pool_shards, self.prefetch, self.drop_last = pool_shards, prefetch, drop_last
        self.epoch = 0

    def __len__(self) -> int:
        """Vectors per pass."""
        h = self.ds.meta.hidden
        return sum(h.shard_rows(s) for s in range(len(h.shards)))

    def _read_shard(self, shard: int) -> np.ndarray:
        h = self.ds.meta.hidden
        rows = h.shard_rows(shard)
        path, entry = self.ds.hidden_shard(self.layer, shard)
        out = np.empty((rows, h.dim), dtype=DTYPES[h.dtype].np_storage)
        read_rows_into(path, entry, np.arange(rows), out)
        if h.dtype == "bfloat16":
            return bfloat16_bits_to_float32(out)
        return out.astype(np.float32, copy=False)

    def _shards(self, worker: tuple[int, int]) -> list[int]:
        order = np.arange(len(self.ds.meta.hidden.shards))
        if self.shuffle:
            np.random.default_rng((self.seed, self.epoch)).shuffle(order)
        return [int(s) for s in order[worker[0] :: worker[1]]]

    def iterate(self, worker: tuple[int, int] = (0, 1)) -> Iterator[np.ndarray]:
        shards = self._shards(worker)
        rng = np.random.default_rng((self.seed, self.epoch, worker[0]))
        reads = prefetched(self._read_shard, shards, depth=max(1, self.prefetch), name="lmprobe-prefetch")
        try:
            carry = np.zeros((0, self.ds.dim), dtype=np.float32)
            finished = False
            while not finished:
                parts = [carry]
                for _ in range(self.pool_shards):
                    item = next(reads, None)
                    if item is None:
                        finished = True
                        break
                    parts.append(item)
                pool = np.concatenate(parts) if len(parts) > 1 else carry
                order = rng.permutation(len(pool)) if self.shuffle else np.arange(len(pool))
                n_full = len(pool) // self.batch_size * self.batch_size
                for i in range(0, n_full, self.batch_size):
                    yield pool[order[i : i + self.batch_size]]
                carry = pool[order[n_full:]]
            if len(carry) and not self.drop_last:
                yield carry
        finally:
            reads.close()

    def __iter__(self) -> Iterator[np.ndarray]:
        return self.iterate()

    def torch_dataset(self):
        """A torch IterableDataset of float32 tensors; DataLoader workers take disjoint shards.

        Use ``DataLoader(stream.torch_dataset(), batch_size=None, num_workers=N)`` and
        ``stream.epoch = e`` (or ``set_epoch``) to reshuffle each epoch.
        """
        import torch

        parent = self

        class _Iterable(torch.utils.data.IterableDataset):
            def set_epoch(self, epoch: int) -> None:
                parent.epoch = epoch

            def __iter__(self):
                info = torch.utils.data.get_worker_info()
                worker = (info.id, info.num_workers) if info else (0, 1)
                for batch in parent.iterate(worker):
                    yield torch.from_numpy(batch)

        return _Iterable()
