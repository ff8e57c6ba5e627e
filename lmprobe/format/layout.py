"""Shard planning: where each prompt's rows go, as pure arithmetic (no I/O).

A shard series (the last-token shards, the sequence shards, the logits shards) fills shards of at
most ``cap_rows`` rows, one after the other. A prompt's rows never straddle two shards: a prompt
that does not fit in the open shard starts a new one, and a prompt larger than the cap gets a
shard of its own (over the cap). ``plan`` assigns a batch of prompts to (shard, offset) and says
where the writer has to close a shard.

>>> c = Cursor(shard=0, rows=0, prompts=0)
>>> p = plan(c, [2, 2, 2], cap_rows=4)
>>> p.shard_of.tolist(), p.offset_of.tolist(), p.after
([0, 0, 1], [0, 2, 0], Cursor(shard=1, rows=2, prompts=1))
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Cursor:
    """The state of a shard series: the shard being filled and what it holds."""

    shard: int
    """Index, within the series, of the shard being filled (or to be opened next when ``rows == 0``)."""
    rows: int
    """Rows already in that shard."""
    prompts: int
    """Prompts with rows in that shard."""


@dataclass(frozen=True)
class Segment:
    """A run of consecutive batch rows written to one shard."""

    close_before: bool
    """Close the open shard (and open the next) before writing these rows."""
    row_lo: int
    row_hi: int
    prompts: int
    """Prompts whose rows are in this run."""


@dataclass(frozen=True)
class Plan:
    shard_of: np.ndarray
    """(n,) int64: each prompt's shard in the series; -1 for a prompt with no rows."""
    offset_of: np.ndarray
    """(n,) int64: the row of each prompt's first row in its shard (0 for a prompt with no rows)."""
    segments: tuple[Segment, ...]
    after: Cursor


def plan(cursor: Cursor, counts, cap_rows: int) -> Plan:
    """Assign each prompt's ``counts[i]`` rows to (shard, offset), continuing from ``cursor``."""
    counts = np.asarray(counts, dtype=np.int64).reshape(-1)
    if cap_rows < 1:
        raise ValueError(f"cap_rows must be >= 1, got {cap_rows}")
    if len(counts) and counts.min() < 0:
        raise ValueError("row counts must be >= 0")
    if len(counts) and bool(np.all(counts == 1)):
        return _plan_one_row_each(cursor, len(counts), cap_rows)
    return _plan_general(cursor, counts, cap_rows)


def _plan_general(cursor: Cursor, counts: np.ndarray, cap: int) -> Plan:
    shard_of = np.full(len(counts), -1, dtype=np.int64)
    offset_of = np.zeros(len(counts), dtype=np.int64)
    segments: list[Segment] = []
    shard, rows, prompts = cursor.shard, cursor.rows, cursor.prompts
    lo = cursor_row = 0
    close = False
    seg_prompts = 0
    open_segment = False
    for i, c in enumerate(counts.tolist()):
        if c == 0:
            continue
        starts_new = rows > 0 and rows + c > cap
        if starts_new:
            if open_segment:
                segments.append(Segment(close, lo, cursor_row, seg_prompts))
            shard, rows, prompts = shard + 1, 0, 0
            lo, close, seg_prompts = cursor_row, True, 0
        open_segment = True
        shard_of[i], offset_of[i] = shard, rows
        rows += c
        prompts += 1
        seg_prompts += 1
        cursor_row += c
    if open_segment:
        segments.append(Segment(close, lo, cursor_row, seg_prompts))
    return Plan(shard_of, offset_of, tuple(segments), Cursor(shard, rows, prompts))


def _plan_one_row_each(cursor: Cursor, n: int, cap: int) -> Plan:
    """``plan`` when every prompt has one row (last-token and logits series), without a Python loop per prompt."""
    # rows left in the open shard: the whole cap when none is open, none when an oversized prompt overfilled it
    room = cap - cursor.rows if cursor.rows < cap else 0
    first = min(room, n)
    rest = np.arange(n - first, dtype=np.int64)
    shard_of = np.concatenate([np.full(first, cursor.shard, dtype=np.int64), cursor.shard + 1 + rest // cap])
    offset_of = np.concatenate([cursor.rows + np.arange(first, dtype=np.int64), rest % cap])
    segments = [Segment(False, 0, first, first)] if first else []
    for lo in range(first, n, cap):
        hi = min(n, lo + cap)
        segments.append(Segment(True, lo, hi, hi - lo))
    if n > first:
        last = n - first - 1
        after = Cursor(cursor.shard + 1 + last // cap, last % cap + 1, last % cap + 1)
    else:
        after = Cursor(cursor.shard, cursor.rows + first, cursor.prompts + first)
    return Plan(shard_of, offset_of, tuple(segments), after)
