"""Refilling the open shards of a checkpoint taken on another machine.

A writer whose files leave the machine (an upload) keeps only its open shards' partial files here; a copy of its
checkpoint elsewhere (a Hub output's, storage/hubresume.py) has everything else: the closed shards are where
they went, the index rows and statistics are in the copy. Reopened on that copy, each series whose open shard is
missing starts that shard empty again, and the caller gives again the prompts from the first one with rows in it
(``Refill.start``): only their rows in those shards are written; the index, the counts and the statistics already
hold them. When the checkpoint's row count is reached, each refilled shard must be where the checkpoint left it:
recomputed rows that differ (another model, other prompts) are refused, never mixed in.

At worst this recomputes one shard's rows per series: ``rows_per_shard`` prompts (pooled) or tokens (full_sequence).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from ..errors import FormatError
from .batch import CheckedBatch
from .layout import Cursor, Plan, plan
from .shards import ShardSeries

#: the index column that says where each prompt's rows are in a series
SHARD_COLUMN = {"last": "shard_index", "seq": "_seq_shard", "logits": "shard_index_logits"}


class Refill:
    """The series to refill (name -> the cursor the checkpoint recorded) and the first prompt of each open shard,
    found in the staged index ``parts`` (``num_prompts`` rows; ``name``: the output, for messages)."""

    def __init__(self, targets: dict[str, Cursor], parts: list[Path], num_prompts: int, name: str):
        self.targets, self.name = targets, name
        first: dict[str, int] = {}
        row = 0
        for path in parts:
            t = pq.read_table(path, columns=[SHARD_COLUMN[n] for n in targets])
            for n, target in targets.items():
                if n not in first:
                    hits = np.flatnonzero(t.column(SHARD_COLUMN[n]).to_numpy() == target.shard)
                    if len(hits):
                        first[n] = row + int(hits[0])
            row += t.num_rows
        if row != num_prompts or set(first) != set(targets):
            raise FormatError(f"{name}: the checkpoint's index rows do not say where its open shards start; pass "
                              "overwrite=True (--overwrite) to start over")
        self.first = first
        self.end = num_prompts

    @property
    def start(self) -> int:
        """The first prompt to give again."""
        return min(self.first.values())

    def write(self, series: list[ShardSeries], batch: CheckedBatch, first: int, *, full_sequence: bool) -> bool:
        """Write again the rows of prompts ``first ..`` (``batch``, checked) that belong to the shards refilled;
        True once the checkpoint's row count is reached (every refilled shard checked)."""
        b, counts = len(batch), batch.counts
        if first < 0 or first + b > self.end:
            raise FormatError(f"{self.name}: prompts {first}..{first + b - 1} are not before the checkpoint's "
                              f"{self.end}; only those are given again")
        for s in series:
            if s.name not in self.first:
                continue
            k = max(0, self.first[s.name] - first)  # the batch's prompts before the open shard: not its rows
            if k >= b:
                continue
            ones = np.ones(b - k, dtype=np.int64)
            if s.name == "logits":
                assert batch.logits is not None
                s.write(self._plan(s, ones), {"all": [a[k:] for a in batch.logits]}, ones)
            elif s.name == "seq":
                off, seq_counts = int(counts[:k].sum()), counts[k:] - 1
                s.write(self._plan(s, seq_counts), {slot: [t[off:] for t in ts] for slot, ts in batch.hidden.items()},
                        seq_counts, packed_counts=counts[k:])
            elif full_sequence:
                ends = np.cumsum(counts) - 1
                s.write(self._plan(s, ones), {slot: [t[ends][k:] for t in ts] for slot, ts in batch.hidden.items()},
                        ones)
            else:
                s.write(self._plan(s, ones), {slot: [t[k:] for t in ts] for slot, ts in batch.hidden.items()}, ones)
        if first + b < self.end:
            return False
        wrong = [s.name for s in series if s.name in self.targets and s.cursor != self.targets[s.name]]
        if wrong:
            raise FormatError(f"{self.name}: the recomputed rows do not fill the {', '.join(wrong)} shards the way "
                              "the checkpoint says; pass overwrite=True (--overwrite) to start over")
        return True

    def _plan(self, s: ShardSeries, counts: np.ndarray) -> Plan:
        p = plan(s.cursor, counts, s.cap_rows)
        if any(seg.close_before for seg in p.segments):
            raise FormatError(f"{self.name}: the recomputed rows do not fit the {s.name} shard the checkpoint left "
                              "open; pass overwrite=True (--overwrite) to start over")
        return p
