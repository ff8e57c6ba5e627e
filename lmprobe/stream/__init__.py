"""The training reader: globally shuffled batches of stored vectors, in bounded memory, at disk speed.

>>> from lmprobe.stream import ShardStream
>>> for batch in ShardStream("hf://datasets/me/acts", layer=12, batch_size=4096, seed=0):   # doctest: +SKIP
...     train_step(batch)                                                                   # (4096, d) float32

The package: ``plan`` (which shards a rank reads, in which groups), ``engine`` (blocks, windows and batches of a
pass: how it is shuffled), ``sources`` (a dataset's rows, read in place, or from a remote dataset through
``storage.cache``'s bounded cache) and ``shardstream`` (``ShardStream``: filters, normalisation, resume).
"""

from .engine import OUT_DTYPES, Engine, RowSource, rank_world
from .shardstream import DEFAULT_MEMORY, NORMALIZE, ShardStream
from .sources import PIECE_BYTES, DatasetRows, RemoteRows

__all__ = ["DEFAULT_MEMORY", "NORMALIZE", "OUT_DTYPES", "PIECE_BYTES", "DatasetRows", "Engine", "RemoteRows",
           "RowSource", "ShardStream", "rank_world"]
