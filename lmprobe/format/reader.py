"""Reading lmprobe format 2.0 datasets (ours, the reference implementation's, anyone's that conforms).

A ``Dataset`` reads through a files object (``files.DatasetFiles``: a local folder here; the Hub
and object storage in ``lmprobe.storage``). It holds the index's per-prompt columns and the
parsed metadata; its shards are read by the ``ShardGather`` it owns, ``ds.shards`` (gather.py).
Besides the user-facing calls it offers a small, documented internal API that lmprobe's other
modules use (docs/architecture.md):

- ``files``, ``meta`` (the parsed descriptors), ``source`` (a name for messages);
- ``row_indices(rows)``, ``check_layer(layer)``, ``column(name)``, ``hidden_desc(hookpoint)``,
  ``token_columns(names, rows)``, ``iter_index()``;
- ``layers_here(hookpoint)``, ``default_layers(hookpoint)``, ``logits_here()``: what a copy holds;
- ``shards``: files fetched, shards located and checked, rows gathered (gather.py).
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..base.layers import stored_layer
from ..base.tokenizer import local_tokenizer
from ..errors import FormatError, LayerNotFoundError
from .files import LocalFiles, find_index
from .gather import ShardGather
from .metadata import DatasetInfo, decode_schema_metadata, parse_info
from .spec import PER_TOKEN_COLUMNS
from .view import Prompt, dataset_html

RowsArg = None | int | slice | Iterable[int] | np.ndarray


class Dataset:
    """An lmprobe dataset: the per-prompt index columns in memory, the rest read on demand.

    >>> ds = lmprobe.load("my-dataset")          # doctest: +SKIP
    >>> X, y = ds.hidden(16), ds.labels           # (num_prompts, dim), (num_prompts,)  # doctest: +SKIP

    Opening reads the index's footer and metadata; the per-prompt columns are read on first use.
    The per-token columns (token addresses, ids, strings, perplexities) stay on disk until a call
    needs some prompts' tokens, and then only the row groups holding those prompts are read, so
    opening costs the same for a million tokens as for a billion.
    """

    def __init__(self, files: Any, index_path: str | os.PathLike):
        self.files = files
        self.index_path = Path(index_path)
        try:
            self._parquet = pq.ParquetFile(self.index_path)
        except (OSError, pa.ArrowInvalid) as exc:
            raise FormatError(f"{files}: the index cannot be read as parquet ({exc})") from None
        schema = self._parquet.schema_arrow
        raw = decode_schema_metadata(schema.metadata)
        if not raw:
            raise FormatError(f"{files}: the index has no 'lmprobe:' schema metadata; it is not an lmprobe dataset")
        self.meta: DatasetInfo = parse_info(raw)
        self.schema = schema
        md = self._parquet.metadata
        self._group_starts = np.zeros(md.num_row_groups + 1, dtype=np.int64)
        np.cumsum([md.row_group(g).num_rows for g in range(md.num_row_groups)], out=self._group_starts[1:])
        self._groups: OrderedDict[tuple[int, tuple[str, ...]], pa.Table] = OrderedDict()
        if self.meta.num_prompts != md.num_rows:
            raise FormatError(
                f"{files}: metadata says num_prompts={self.meta.num_prompts} but the index has {md.num_rows} rows"
            )
        #: the shards: files fetched, located and checked against the metadata, rows gathered (gather.py)
        self.shards = ShardGather(self)

    # ---------------------------------------------------------------- description

    @property
    def source(self) -> str:
        """Where the dataset is read from, for messages (a folder, hf://..., s3://...)."""
        return str(self.files)

    @cached_property
    def identity(self) -> str:
        """This dataset and revision, as 16 hex digits: a digest of the index's schema metadata (every shard's
        name, size and checksum, the settings, the creation time). What a saved reader state, a merge in
        progress or a partial feature cache is checked against."""
        md = self.schema.metadata or {}
        h = hashlib.sha256()
        for k in sorted(md):
            h.update(len(k).to_bytes(8, "little") + k + len(md[k]).to_bytes(8, "little") + md[k])
        return h.hexdigest()[:16]

    @property
    def info(self) -> dict[str, Any]:
        """The decoded ``lmprobe:`` metadata (format_version, model, num_prompts, tensors, provenance, ...)."""
        return self.meta.raw

    @cached_property
    def index(self):
        """The whole index as a pandas DataFrame, one row per prompt (per-token columns included: read on first use)."""
        return self.table.to_pandas()

    @cached_property
    def table(self) -> pa.Table:
        """The whole index as a pyarrow Table, schema metadata and per-token columns included (read on first use).

        For large full_sequence datasets this holds every token's address in memory: ``prompt_table``
        and ``token_addresses`` read only what they need.
        """
        return self._parquet.read()

    @property
    def prompt_table(self) -> pa.Table:
        """The index's per-prompt columns (everything but the per-token lists), read on first use."""
        return self._prompt_table

    @cached_property
    def _prompt_table(self) -> pa.Table:
        # not at open: a corpus index holds every window's text, and a merge of many parts opens them all
        t = self._parquet.read(columns=[n for n in self.schema.names if n not in PER_TOKEN_COLUMNS])
        if t.num_rows != self.meta.num_prompts:
            raise FormatError(f"{self.files}: metadata says num_prompts={self.meta.num_prompts} but the index has "
                              f"{t.num_rows} rows")
        return t

    @property
    def column_names(self) -> list[str]:
        """Every column of the index, per-token ones included."""
        return list(self.schema.names)

    def token_columns(self, names: list[str], rows: RowsArg = None) -> dict[str, pa.ChunkedArray]:
        """Per-token list columns of the prompts ``rows``, read by row group (only the groups holding them)."""
        missing = [n for n in names if n not in self.schema.names]
        if missing:
            raise FormatError(f"{self.files}: the index has no column(s) {missing}")
        r = self.row_indices(rows)
        if rows is None:
            return {n: self._parquet.read(columns=names).column(n) for n in names}
        groups = np.searchsorted(self._group_starts, r, side="right") - 1
        if len(r) == 1:  # one prompt (token_hidden, ds.prompt): a zero-copy slice of its row group
            g = int(groups[0])
            table = self._row_group(g, tuple(names)).slice(int(r[0] - self._group_starts[g]), 1)
            return {n: table.column(n) for n in names}
        parts: dict[str, list] = {n: [] for n in names}
        order = np.argsort(r, kind="stable")
        pieces, positions = [], []
        for g in np.unique(groups):
            sel = order[groups[order] == g]
            table = self._row_group(int(g), tuple(names))
            pieces.append(table.take(pa.array(r[sel] - self._group_starts[g])))
            positions.append(sel)
        if not pieces:
            return {n: pa.chunked_array([], type=self.schema.field(n).type) for n in names}
        joined = pa.concat_tables(pieces)
        back = np.argsort(np.concatenate(positions), kind="stable")  # into the order rows were asked in
        joined = joined.take(pa.array(back))
        for n in names:
            parts[n] = joined.column(n)
        return parts

    def iter_index(self, *, max_bytes: int = 8 << 20) -> Iterable[pa.Table]:
        """The whole index, every column, in tables of about ``max_bytes`` in memory (and at most 65,536 rows)
        each, whatever the file's row groups: for copying it, never whole in memory."""
        md = self._parquet.metadata
        held = 0  # the file's rows in memory, estimated from its footer: per-token lists decode to 8 bytes an entry
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            for i in range(md.num_columns):
                c = rg.column(i)
                per_token = md.schema.column(i).path.split(".")[0] in PER_TOKEN_COLUMNS
                held += max(c.total_uncompressed_size, 12 * c.num_values) if per_token else c.total_uncompressed_size
        rows = max(1, min(1 << 16, max_bytes * md.num_rows // max(1, held)))
        # a reader of its own, closed at the end: the dataset's keeps what it read (~5 MiB a 4-MiB batch), and a
        # merge reads a hundred parts
        with pq.ParquetFile(self.index_path) as f:
            for batch in f.iter_batches(batch_size=rows):
                yield pa.Table.from_batches([batch])

    def _row_group(self, g: int, names: tuple[str, ...]) -> pa.Table:
        key = (g, names)
        t = self._groups.get(key)
        if t is None:
            t = self._groups[key] = self._parquet.read_row_group(g, columns=list(names))
            while len(self._groups) > 4:  # a few recent groups: neighbouring prompts share one
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(key)
        return t

    @property
    def _hidden_desc(self):
        if self.meta.hidden is None:
            raise FormatError(f"{self.files}: this dataset stores no hidden states")
        return self.meta.hidden

    def hidden_desc(self, hookpoint: str | None = None):
        """The descriptor of ``hookpoint`` (None: ``hidden_layers``); LayerNotFoundError naming the stored ones."""
        h = self._hidden_desc
        if hookpoint is None or hookpoint == h.hookpoint:
            return h
        found = self.meta.hookpoints.get(hookpoint)
        if found is None:
            raise LayerNotFoundError(f"hookpoint {hookpoint!r} is not stored in this dataset; stored hookpoints: "
                                     f"{list(self.meta.hookpoints)}", layer=hookpoint, available=self.hookpoints)
        return found

    @property
    def layers(self) -> list[int]:
        return list(self._hidden_desc.layers)

    @property
    def hookpoints(self) -> list[str]:
        """The stored hookpoints, the one ``hidden_layers`` holds first (``resid_post`` for a default extraction)."""
        return list(self.meta.hookpoints) or [self._hidden_desc.hookpoint]

    @property
    def dim(self) -> int:
        return self._hidden_desc.dim

    @property
    def dtype(self) -> str:
        return self._hidden_desc.dtype

    @property
    def storage(self) -> str:
        return self._hidden_desc.storage

    @property
    def num_prompts(self) -> int:
        return self.meta.num_prompts

    def __len__(self) -> int:
        return self.num_prompts

    @property
    def model(self) -> dict[str, Any]:
        return dict(self.info.get("model") or {}) if isinstance(self.info.get("model"), dict) else {}

    @property
    def labels(self) -> np.ndarray | None:
        """Labels in index order (ints or strings), or None when the dataset is unlabeled."""
        if "label" not in self._prompt_table.column_names:
            return None
        col = self._prompt_table.column("label")
        if col.null_count == len(col):
            return None
        if pa.types.is_integer(col.type) and col.null_count == 0:
            return col.to_numpy()
        return np.asarray(col.to_pylist(), dtype=object)

    @property
    def texts(self) -> list[str]:
        return self._prompt_table.column("text").to_pylist()

    def __repr__(self) -> str:
        h = self.meta.hidden
        desc = f"layers={h.layers}, dim={h.dim}, dtype={h.dtype!r}, storage={h.storage!r}" if h else "no hidden states"
        return f"<lmprobe.Dataset {self.model.get('name')!r}: {self.num_prompts} prompts, {desc}, source={self.files}>"

    def _repr_html_(self) -> str:
        return dataset_html(self)

    def prompt(self, i: int, *, tokenizer: Any = None) -> Prompt:
        """Prompt ``i`` with what the dataset stores of its tokens; displays as coloured tokens in a notebook.

        Token strings come from the ``token_strings`` column, else from ``tokenizer`` (a transformers
        tokenizer) decoding the stored ids; top-k predictions from ``logits_topk``. Without
        ``tokenizer``, the dataset's model's tokenizer decodes them when it is on this machine (the
        embedded model, a local folder, or the local Hugging Face cache; nothing is downloaded);
        else ids show as ``#id``.
        """
        (row,) = self.row_indices(i)
        row = int(row)
        names = [n for n in ("token_ids", "token_strings", "token_perplexity") if n in self.schema.names]
        lists = {n: c.to_pylist()[0] for n, c in self.token_columns(names, [row]).items()} if names else {}
        ids = lists.get("token_ids")
        strings = lists.get("token_strings")
        if tokenizer is None and ((strings is None and ids is not None) or self.meta.logits is not None):
            tokenizer = self.local_tokenizer
        if strings is None and ids is not None and tokenizer is not None:
            strings = [tokenizer.decode([t]) for t in ids]
        table = self._prompt_table  # one row's values: never a whole column per call

        def value(name: str) -> Any:
            return table.column(name)[row].as_py() if name in table.column_names else None

        n = value("num_tokens")
        if n is None:  # lmprobe 0.10.3 left num_tokens null in pooled datasets
            n = int(self.token_lengths()[row])
        p = Prompt(row, value("text"), int(n), label=value("label"), token_ids=ids, tokens=strings,
                   token_perplexity=lists.get("token_perplexity"), perplexity_mean=value("perplexity_mean"),
                   noun="window" if "document" in self.schema.names else "prompt")
        if self.meta.logits is not None and self.logits_here():  # not in a copy pulled with --no-logits
            values, indices = self.logits_topk([row])
            names = [tokenizer.decode([int(t)]) if tokenizer is not None else f"#{int(t)}" for t in indices[0]]
            p.topk = list(zip(names, [float(v) for v in values[0]], strict=True))
        return p

    @cached_property
    def local_tokenizer(self) -> Any:
        """The tokenizer of the dataset's model if it is on this machine (never downloaded), else None."""
        return local_tokenizer(self.model.get("name"), self.model.get("revision"))

    # ---------------------------------------------------------------- the internal API

    def row_indices(self, rows: RowsArg) -> np.ndarray:
        """``rows`` (None, an int, a slice, ints or a boolean mask) as int64 index rows, checked."""
        n = self.num_prompts
        if rows is None:
            return np.arange(n, dtype=np.int64)
        if isinstance(rows, (int, np.integer)):
            rows = [int(rows)]
        if isinstance(rows, slice):
            return np.arange(n, dtype=np.int64)[rows]
        arr = np.asarray(list(rows) if not isinstance(rows, np.ndarray) else rows)
        if arr.dtype == bool:
            if arr.shape != (n,):
                raise IndexError(f"a boolean row mask must have {n} entries, got {arr.shape}")
            return np.flatnonzero(arr)
        if arr.size == 0:
            return np.zeros(0, dtype=np.int64)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"rows must be integers, a slice or a boolean mask, got {arr.dtype}")
        arr = arr.astype(np.int64)
        arr = np.where(arr < 0, arr + n, arr)
        if arr.min() < 0 or arr.max() >= n:
            raise IndexError(f"row out of range for a dataset of {n} prompts")
        return arr

    def check_layer(self, layer: int, hookpoint: str | None = None) -> int:
        """``layer`` as an int if the dataset stores it (negative: back from the last stored layer, as in
        ``lmprobe extract --layers -1``); else LayerNotFoundError naming the stored layers."""
        return stored_layer(layer, list(self.hidden_desc(hookpoint).layers))

    def column(self, name: str) -> np.ndarray:
        """A non-null integer column of the index as int64."""
        if name not in self._prompt_table.column_names:
            raise FormatError(f"{self.files}: the index has no {name!r} column")
        col = self._prompt_table.column(name)
        if col.null_count:
            raise FormatError(f"{self.files}: column {name!r} has null values")
        return col.to_numpy().astype(np.int64)

    def layers_here(self, hookpoint: str | None = None) -> list[int]:
        """The stored layers whose shards are all in this copy: a ``lmprobe pull --layers 4`` copy holds [4].

        A source that fetches on demand (the Hub, object storage) holds every layer.
        """
        h = self.hidden_desc(hookpoint)
        if self.files.remote:
            return list(h.layers)
        has = self.files.has
        return [layer for layer in h.layers if all(has(h.file(layer, s)) for s in range(len(h.shards)))]

    def logits_here(self) -> bool:
        """Whether the top-k logits' shards are in this copy (``lmprobe pull --no-logits`` leaves them out)."""
        lg, files = self.meta.logits, self.files
        return lg is not None and (files.remote or all(files.has(lg.file(s)) for s in range(len(lg.shards))))

    def default_layers(self, hookpoint: str | None = None) -> list[int]:
        """The layers a command takes when none are named: every stored layer; in a copy that ``lmprobe pull
        --layers`` made, the layers it holds (a folder that merely lacks files is not guessed around: reading
        the missing layer says what is missing)."""
        if self.files.origin:
            return self.layers_here(hookpoint)
        return list(self.hidden_desc(hookpoint).layers)

    # ---------------------------------------------------------------- reading

    def hidden(self, layer: int, rows: RowsArg = None, *, as_torch: bool = False, hookpoint: str | None = None):
        """Last-token hidden states of ``layer`` (``-1``: the last stored layer): an (N, dim) array in index order.

        ``hookpoint`` picks another stored hookpoint (``ds.hookpoints``); default: what
        ``hidden_layers`` holds, the block outputs (resid_post) of a default extraction.

        ``rows`` selects prompts (an int, slice, list of ints or boolean mask); None reads all.
        bfloat16 data comes back as float32 numpy arrays (numpy has no bfloat16), or as a
        bfloat16 tensor with ``as_torch=True``.
        """
        layer = self.check_layer(layer, hookpoint)
        r = self.row_indices(rows)
        shard_ids = self.column("shard_index")[r]
        offsets = self.column("row_offset")[r]
        if len(r) and self.storage == "full_sequence" and shard_ids.max() >= self._hidden_desc.last_token_shards:
            raise FormatError(f"{self.files}: shard_index points past the last-token shards")
        return self.shards.read_hidden_rows(layer, shard_ids, offsets, as_torch=as_torch, hookpoint=hookpoint)

    def token_hidden(self, i: int, layer: int, *, as_torch: bool = False, hookpoint: str | None = None):
        """All token activations of prompt ``i`` at ``layer``: (num_tokens, dim). Full-sequence datasets only."""
        layer = self.check_layer(layer, hookpoint)
        (row,) = self.row_indices(i)
        ids, offs, _ = self.shards.token_addresses([int(row)])
        return self.shards.read_hidden_rows(layer, ids, offs, as_torch=as_torch, hookpoint=hookpoint)

    def token_lengths(self) -> np.ndarray:
        """num_tokens of every prompt (from the token address lists when the column is null)."""
        col = self._prompt_table.column("num_tokens")
        if col.null_count == 0:
            return col.to_numpy().astype(np.int64)
        for name in ("token_shard_ids", "token_ids"):  # lmprobe 0.10.3 left num_tokens null in pooled datasets
            if name in self.schema.names:
                lists = self.token_columns([name])[name]
                return pc.list_value_length(lists).to_numpy(zero_copy_only=False).astype(np.int64)
        raise FormatError(f"{self.files}: num_tokens is null and no token list column gives the lengths")

    def statistics(self, layer: int, hookpoint: str | None = None) -> dict[str, Any]:
        """Running statistics of ``layer`` over every stored vector: count, mean, std (ddof=0), mean_norm."""
        desc = self.meta.statistics
        if desc is None:
            raise FormatError("this dataset stores no statistics (extract with statistics on, the default)")
        layer = self.check_layer(layer, hookpoint)
        if hookpoint is not None and hookpoint != self._hidden_desc.hookpoint:
            self.hidden_desc(hookpoint)  # stored at all?
            desc = desc.for_hookpoint(hookpoint)
        if layer not in desc.layers:
            raise LayerNotFoundError(f"no statistics for layer {layer}; they cover layers {desc.layers}",
                                     layer=layer, available=desc.layers)
        from safetensors import safe_open

        path = self.shards.fetch(desc.file, "statistics file")
        with safe_open(str(path), framework="np") as f:
            keys = set(f.keys())

            def get(stat):
                key = desc.key(layer, stat)
                if key not in keys:
                    raise FormatError(f"{desc.file}: tensor {key!r} is missing")
                return f.get_tensor(key)

            return {"count": int(get("count")[0]), "mean": get("mean"), "std": get("std"),
                    "mean_norm": float(get("mean_norm")[0])}

    def logits_topk(self, rows: RowsArg = None, *, as_torch: bool = False):
        """Top-k logits at the last token: (values (N, k) float32, indices (N, k) int) in index order."""
        desc = self.meta.logits
        if desc is None:
            raise FormatError("this dataset stores no logits (extract with --logits-topk K)")
        r = self.row_indices(rows)
        values, indices = self.shards.logits_rows(self.column("shard_index_logits")[r],
                                                  self.column("row_offset_logits")[r])
        if as_torch:
            import torch

            return torch.from_numpy(values), torch.from_numpy(indices)
        return values, indices


def open_local(path: str | os.PathLike) -> Dataset:
    """Open the dataset in a local folder (or at a local index .parquet file)."""
    root = Path(path)
    if root.is_file() and root.suffix == ".parquet":
        index_path, root = root, root.parent.parent
    else:
        index_path = find_index(root)
    return Dataset(LocalFiles(root), index_path)
