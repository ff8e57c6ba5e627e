"""The parquet index: its schema, the staging parts written at checkpoints, and the final file.

While a dataset is written, index rows go to part files in the staging folder (one per
checkpoint), with private columns: ``_position`` (the prompt's row in the final index) and, for
full_sequence storage, ``_seq_shard``/``_seq_offset`` (where the prompt's sequence tokens start).
At close the parts are turned into the final index, streaming: per-token address lists are built
part by part, rows are put in position order with a buffer bounded by how far prompts arrived
out of order, and row groups are cut by rows and by per-token entries, so readers can fetch the
per-token columns of a few prompts without reading them all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..base.atomic import atomic_output
from ..errors import FormatError
from .datasetspec import DatasetSpec
from .spec import CORPUS_COLUMNS, PER_TOKEN_COLUMNS, TRUNCATION_COLUMNS
from .values import COLUMN_TYPES

#: Most rows in one row group of the index (of an index of up to MAX_ROW_GROUPS x this many rows).
ROW_GROUP_ROWS = 65536
#: Most per-token list entries (summed over the per-token columns' tokens) in one row group (of an index of up to
#: MAX_ROW_GROUPS x this many entries: 2^30, 5.4 x 10^8 tokens with their two address lists).
ROW_GROUP_TOKENS = 1 << 17
#: Row groups in one index file, about at most (twice at worst: a group closes early when the next row does not fit);
#: a larger index gets larger groups. A parquet writer holds every group's
#: metadata until it closes (~8 KB a group in pyarrow 26) and the footer, which every reader parses at open, has
#: ~0.9 KB a group: at 2^17 entries a group, 10^10 tokens would be 150,000 groups, 1.2 GB in the writer that
#: writes the index (the merge's) and a 130 MB footer. At most 8,192: 64 MiB and 7 MB.
MAX_ROW_GROUPS = 8192

# What an index takes on disk, for the job's plan (measured with benchmarks/bench_merge_memory.py and
# docs/performance.md, "The merge and the index at scale": corpus windows of 1,024 tokens, pyarrow 26,
# zstd level 1). A corpus index holds every window's text: English compresses to ~1.4 bytes a token (3.3
# characters a byte, 4.2 a token), most of the index; token addresses are delta-encoded runs (~0.05 bytes
# a token), the per-row numbers ~1-2 bytes a column.
#: bytes of index a stored token costs (full_sequence, text ~4.2 characters a token), without ``--token-ids``
INDEX_BYTES_PER_TOKEN = 1.5
#: ... with ``--token-ids`` (ids of a 128k vocabulary: ~17 bits of entropy each, which no encoding removes)
INDEX_BYTES_PER_TOKEN_WITH_IDS = 3.8
#: bytes of index a row costs beyond its tokens (pooled rows, windows): its numbers and its column chunks' share
INDEX_BYTES_PER_ROW = 16


def staging_schema(spec: DatasetSpec) -> pa.Schema:
    """Columns of the staging parts, in the order the final index has them (private ones included)."""
    fields = [
        ("text", pa.string()),
        ("label", pa.string() if spec.label_type == "string" else pa.int32()),
        ("num_tokens", pa.int32()),
        ("shard_index", pa.int32()),
        ("row_offset", pa.int32()),
    ]
    if spec.full_sequence:
        fields += [("_seq_shard", pa.int32()), ("_seq_offset", pa.int64())]
    if spec.corpus:
        fields += list(CORPUS_COLUMNS.items())
    if spec.truncation:
        fields += list(TRUNCATION_COLUMNS.items())
    if spec.logits_topk:
        fields += [("shard_index_logits", pa.int32()), ("row_offset_logits", pa.int32())]
    if spec.perplexity:
        fields += [(c, pa.float64()) for c in ("perplexity_mean", "perplexity_min", "perplexity_max")]
    if spec.token_ids:
        fields.append(("token_ids", pa.list_(pa.int64())))
    if spec.token_perplexity:
        fields.append(("token_perplexity", pa.list_(pa.float64())))
    if spec.token_strings:
        fields.append(("token_strings", pa.list_(pa.string())))
    fields += [(name, COLUMN_TYPES[t]) for name, t in spec.columns.items()]
    fields.append(("_position", pa.int64()))
    return pa.schema(fields)


def final_schema(spec: DatasetSpec) -> pa.Schema:
    """Columns of the final index (docs/format.md), without schema metadata."""
    fields = []
    for f in staging_schema(spec):
        if f.name == "_seq_shard":
            fields += [
                pa.field("token_offset", pa.int64()),
                pa.field("token_shard_ids", pa.list_(pa.int64())),
                pa.field("token_shard_offsets", pa.list_(pa.int64())),
            ]
        elif f.name not in ("_seq_offset", "_position"):
            fields.append(f)
    return pa.schema(fields)


#: integer columns that run arithmetically from row to row (addresses, windows): delta-encoded
_DELTA_COLUMNS = ("num_tokens", "shard_index", "row_offset", "token_offset", "document", "window_start",
                  "truncated_tokens", "shard_index_logits", "row_offset_logits")
#: per-token integer lists, delta-encoded element by element: addresses are runs of consecutive rows of one shard
#: (a few bits a token), token ids small numbers (about 17 bits a token against 64)
_DELTA_LISTS = ("token_shard_ids", "token_shard_offsets", "token_ids")


def encoding_options(schema: pa.Schema) -> dict:
    """Parquet writer options for an index: integer columns delta-encoded, pages compressed with zstd.

    A prompt's token addresses are runs of consecutive rows of one shard and a corpus's rows
    step ``window_start`` and ``row_offset`` by a constant: DELTA_BINARY_PACKED stores them in a
    few bits each (a 30M-token index shrinks from ~120 MB to a few MB) and decodes faster than
    the default dictionary-or-plain pages. zstd compresses the rest (``text``: a corpus index
    holds every window's text, most of its bytes). Both are core parts of the parquet format
    that every reader (pyarrow, datasets, duckdb, polars, parquet-mr, lmprobe 0.10.3) reads.
    Statistics (min/max) are kept for the per-prompt numbers only: a corpus's ``text`` would put
    two windows' text per row group into the footer, which every reader parses at open.
    """
    delta = [n for n in _DELTA_COLUMNS if n in schema.names and pa.types.is_integer(schema.field(n).type)]
    delta += [f"{n}.list.element" for n in _DELTA_LISTS
              if n in schema.names and pa.types.is_integer(schema.field(n).type.value_type)]
    plain = {d.split(".")[0] for d in delta}
    stats = [f.name for f in schema if not pa.types.is_list(f.type) and not pa.types.is_string(f.type)]
    return {"compression": "zstd", "use_dictionary": [n for n in schema.names if n not in plain],
            "column_encoding": dict.fromkeys(delta, "DELTA_BINARY_PACKED"), "write_statistics": stats}


def write_part(path: Path, columns: dict[str, list], spec: DatasetSpec) -> None:
    """Write pending index rows as one staging part (atomically); ``columns[name]`` holds one chunk per batch."""
    schema = staging_schema(spec)
    table = pa.table({f.name: pa.chunked_array([c if isinstance(c, pa.Array) else pa.array(c, type=f.type)
                                                for c in columns[f.name]], type=f.type) for f in schema}, schema=schema)
    with atomic_output(path) as tmp:
        pq.write_table(table, tmp)


def finalize_part(t: pa.Table, spec: DatasetSpec, n_last: int, schema: pa.Schema) -> pa.Table:
    """A staging part as final index rows (``_position`` kept): per-token address lists built from the scalars."""
    position = t.column("_position")
    if not spec.full_sequence:
        return t.select(schema.names).cast(schema).append_column("_position", position)
    n = t.column("num_tokens").to_numpy().astype(np.int64)
    seq = t.column("_seq_shard").to_numpy().astype(np.int64)
    seq_off = t.column("_seq_offset").to_numpy().astype(np.int64)
    si = t.column("shard_index").to_numpy().astype(np.int64)
    ro = t.column("row_offset").to_numpy().astype(np.int64)
    list_offsets = np.zeros(len(n) + 1, dtype=np.int64)
    np.cumsum(n, out=list_offsets[1:])
    starts, ends = list_offsets[:-1], list_offsets[1:] - 1
    pos = np.arange(int(list_offsets[-1]), dtype=np.int64) - np.repeat(starts, n)
    ids = np.repeat(n_last + seq, n)  # sequence shards are numbered after the last-token shards
    offs = np.repeat(seq_off, n) + pos
    ids[ends] = si  # a prompt's last token lives in the last-token shards
    offs[ends] = ro
    cols = {name: t.column(name) for name in t.column_names if not name.startswith("_")}
    cols["token_offset"] = pa.array(ro)
    cols["token_shard_ids"] = pa.LargeListArray.from_arrays(list_offsets, ids).cast(pa.list_(pa.int64()))
    cols["token_shard_offsets"] = pa.LargeListArray.from_arrays(list_offsets, offs).cast(pa.list_(pa.int64()))
    out = pa.table({name: cols[name] for name in schema.names}).cast(schema)
    return out.append_column("_position", position)


def _in_position_order(parts: list[Path], load: Callable[[Path], pa.Table]) -> Iterator[pa.Table]:
    """Yield the rows of ``parts`` sorted by ``_position``, holding only rows that must wait for earlier ones.

    ``positions`` of all parts must form 0..N-1. A row can be emitted once every position before
    it has been seen; the smallest position still to come is known from each later part's minimum.
    """
    mins, total = [], 0
    for p in parts:
        pos = pq.read_table(p, columns=["_position"]).column("_position").to_numpy()
        mins.append(int(pos.min()) if len(pos) else np.iinfo(np.int64).max)
        total += len(pos)
    # future_min[k]: the smallest position in parts k, k+1, ... (no part left: infinity)
    future_min = np.minimum.accumulate(np.array(mins + [np.iinfo(np.int64).max], dtype=np.int64)[::-1])[::-1]
    buffered: list[pa.Table] = []
    seen = 0
    next_pos = 0
    for k, p in enumerate(parts):
        t = load(p)
        seen += t.num_rows
        buffered.append(t)
        limit = int(future_min[k + 1])  # no later part holds a position below this
        pool = pa.concat_tables(buffered) if len(buffered) > 1 else buffered[0]
        pos = pool.column("_position").to_numpy()
        order = np.argsort(pos, kind="stable")
        sorted_pos = pos[order]
        ready = int(np.searchsorted(sorted_pos, limit))
        # the ready rows must be exactly next_pos, next_pos + 1, ...
        if ready and not np.array_equal(sorted_pos[:ready], np.arange(next_pos, next_pos + ready)):
            raise FormatError(
                f"the positions given to add_batch do not form 0..{total - 1} (duplicates or gaps); "
                "the index cannot be ordered"
            )
        if ready == len(order) and bool(np.all(np.diff(pos) > 0)):
            yield pool  # in order already (the usual case): no copy
            next_pos += ready
            buffered = []
            continue
        if ready:
            yield pool.take(order[:ready])
            next_pos += ready
        buffered = [pool.take(order[ready:])] if ready < len(order) else []
    if next_pos != total or seen != total:
        raise FormatError(
            f"the positions given to add_batch do not form 0..{total - 1} (duplicates or gaps); "
            "the index cannot be ordered"
        )


def list_entries(t: pa.Table | pa.RecordBatch) -> np.ndarray:
    """Each row's per-token list entries, summed over ``t``'s list columns (what bounds a row group's size)."""
    total = np.zeros(t.num_rows, dtype=np.int64)
    for f in t.schema:
        if pa.types.is_list(f.type) or pa.types.is_large_list(f.type):
            total += pc.list_value_length(t.column(f.name)).to_numpy(zero_copy_only=False).astype(np.int64)
    return total


def _token_entries(t: pa.Table, spec: DatasetSpec) -> np.ndarray:
    """Per-token list entries each staging row becomes in the final index (over all per-token columns)."""
    total = list_entries(t)
    if spec.full_sequence:  # token_shard_ids and token_shard_offsets, built at finalisation
        total += 2 * t.column("num_tokens").to_numpy().astype(np.int64)
    return total


def group_bounds(num_rows: int, num_entries: int) -> tuple[int, int]:
    """(rows, per-token entries) at most in one row group of an index of ``num_rows`` rows and ``num_entries``
    per-token entries: ``ROW_GROUP_ROWS`` and ``ROW_GROUP_TOKENS``, or more where the index would otherwise pass
    ``MAX_ROW_GROUPS`` groups.

    >>> group_bounds(10**6, 10**9)[1] == ROW_GROUP_TOKENS, group_bounds(10**7, 2 * 10**10)
    (True, (65536, 2441407))
    """
    return (max(ROW_GROUP_ROWS, -(-num_rows // MAX_ROW_GROUPS)),
            max(ROW_GROUP_TOKENS, -(-num_entries // MAX_ROW_GROUPS)))


def file_entries(md: pq.FileMetaData) -> int:
    """The per-token list entries of an index file, from its footer (nothing else is read)."""
    lists = [i for i in range(md.num_columns) if md.schema.column(i).path.split(".")[0] in PER_TOKEN_COLUMNS]
    return sum(md.row_group(g).column(i).num_values for g in range(md.num_row_groups) for i in lists)


def row_groups(tables: Iterable[pa.Table], entries: Callable[[pa.Table], np.ndarray], *,
               bounds: tuple[int, int] | None = None) -> Iterator[pa.Table]:
    """The rows of ``tables`` regrouped into the index's row groups: at most ``bounds`` (``group_bounds``; by
    default ``ROW_GROUP_ROWS`` rows and ``ROW_GROUP_TOKENS`` per-token entries) each, a longer row alone
    (``entries(table)``: each row's entries).

    Holds one group at a time, whatever the stream's length: what the writer's close and a merge write.
    """
    max_rows, max_entries = bounds or (ROW_GROUP_ROWS, ROW_GROUP_TOKENS)
    pending: list[pa.Table] = []
    rows = tokens = 0
    for chunk in tables:
        per_row = entries(chunk)
        start = 0
        while start < chunk.num_rows:
            # rows that still fit in the current row group (at least one row per group)
            cum = np.cumsum(per_row[start : start + max_rows - rows])
            fit = int(np.searchsorted(cum, max_entries - tokens, side="right"))
            if fit == 0 and rows == 0:
                fit = 1
            if fit:
                pending.append(chunk.slice(start, fit))
                rows += fit
                tokens += int(cum[fit - 1])
                start += fit
            if fit == 0 or rows >= max_rows or tokens >= max_entries:
                yield pa.concat_tables(pending) if len(pending) > 1 else pending[0]
                pending, rows, tokens = [], 0, 0
    if pending:
        yield pa.concat_tables(pending) if len(pending) > 1 else pending[0]


def write_index(final: Path, parts: list[Path], *, spec: DatasetSpec, n_last: int, metadata: dict[bytes, bytes],
                fsync: bool = False, num_rows: int = 0, num_tokens: int = 0) -> None:
    """Write the final index from the staging parts (atomically; the schema carries ``metadata``); ``num_rows``
    and ``num_tokens``: what the parts hold, which sizes the row groups (``group_bounds``)."""
    schema = final_schema(spec)
    final.parent.mkdir(parents=True, exist_ok=True)
    per_token = 2 * spec.full_sequence + spec.token_ids + spec.token_strings + spec.token_perplexity
    bounds = group_bounds(num_rows, per_token * num_tokens)
    with atomic_output(final, fsync=fsync) as tmp:
        with pq.ParquetWriter(tmp, schema.with_metadata(metadata), **encoding_options(schema)) as pw:
            # per-token address lists are built here, one row group at a time: memory stays at one group
            for staged in row_groups(_in_position_order(parts, pq.read_table), lambda t: _token_entries(t, spec),
                                     bounds=bounds):
                group = finalize_part(staged, spec, n_last, schema).drop_columns(["_position"])
                pw.write_table(group, row_group_size=max(1, group.num_rows))
            if not parts:
                pw.write_table(schema.empty_table())
