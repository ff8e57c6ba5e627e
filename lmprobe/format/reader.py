"""Reading lmprobe format 2.0 datasets (ours, the reference implementation's, anyone's that conforms).

A ``Dataset`` reads through a files object (``files.DatasetFiles``: a local folder here; the Hub
and object storage in ``lmprobe.storage``). Besides the user-facing calls it offers a small,
documented internal API that lmprobe's other modules use (docs/architecture.md):

- ``files``, ``meta`` (the parsed descriptors), ``source`` (a name for messages);
- ``row_indices(rows)``, ``check_layer(layer)``;
- ``tensor(rel, key, dtype, row_shape, min_rows)`` and ``hidden_shard(layer, shard)``: a checked
  shard file and tensor entry;
- ``read_hidden_rows(layer, shard_ids, offsets)``: rows gathered from shards, one pass per shard;
- ``token_addresses(rows)``: the per-token (shard, offset) lists of some prompts.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future
from contextlib import nullcontext
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..base.layers import stored_layer
from ..base.lock import writer_pid
from ..base.paths import resolve_inside
from ..base.safeio import check_regular
from ..base.tokenizer import local_tokenizer
from ..base.worker import settle
from ..errors import DatasetNotFoundError, FormatError, LayerNotFoundError, ShardMissingError
from .files import LocalFiles
from .metadata import DatasetInfo, decode_schema_metadata, parse_info
from .safetensors_io import SafetensorsHeader, TensorEntry, read_header, read_rows_into, read_run_into
from .spec import DTYPES, INDEX_PATH, PER_TOKEN_COLUMNS, STAGING_DIR
from .values import bfloat16_bits_to_float32, bfloat16_to_float32_later
from .view import Prompt, dataset_html

RowsArg = None | int | slice | Iterable[int] | np.ndarray


#: bfloat16 values read per piece when a read converts as it goes: at most 2M (4 MiB of bits, in cache when the
#: converter thread casts them), and a quarter of a small read (a prompt of 1024 tokens x 2048 is four pieces of
#: 512K, each read while the one before converts), down to 512K
_PIECE_VALUES = 1 << 21
_MIN_PIECE_VALUES = 1 << 19
#: reads of at most this many bfloat16 values (16 MiB of bits) are read whole, then cast by both converter threads
_WHOLE_VALUES = 1 << 23


def _consecutive(positions: np.ndarray) -> bool:
    """Output positions that are one ascending run (rows read straight into a slice of the output)."""
    return len(positions) == 1 or bool(np.all(np.diff(positions) == 1))


def find_index(root: Path) -> Path:
    """The index file of a local dataset folder (the standard name, or the single parquet file in index/).

    Like every dataset file, it must be a regular file inside the folder (a symlink may point within it).
    """
    std = root / INDEX_PATH
    if std.exists() or std.is_symlink():
        return check_regular(resolve_inside(root, INDEX_PATH, "index"), "index")
    found = sorted((root / "index").glob("*.parquet")) if (root / "index").is_dir() else []
    if len(found) == 1:
        rel = found[0].relative_to(root).as_posix()
        return check_regular(resolve_inside(root, rel, "index"), "index")
    if not root.exists():
        hub = f" (a Hub dataset is hf://datasets/{root.as_posix()})" if re.fullmatch(r"[\w.-]+/[\w.-]+", str(root)) else ""
        raise DatasetNotFoundError(f"{root} does not exist{hub}")
    if (root / STAGING_DIR).exists():
        pid = writer_pid(root)
        if pid is not None:
            raise DatasetNotFoundError(f"{root} is being written by process {pid} (no index yet); wait for that run "
                                       "to finish")
        raise DatasetNotFoundError(
            f"{root} holds an unfinished dataset (no index yet); re-run the command that wrote it to resume"
        )
    raise DatasetNotFoundError(f"{root} holds no lmprobe dataset: {INDEX_PATH} is missing")


class Dataset:
    """An lmprobe dataset: the per-prompt index columns in memory, the rest read on demand.

    >>> ds = lmprobe.load("my-dataset")          # doctest: +SKIP
    >>> X, y = ds.hidden(16), ds.labels           # (num_prompts, dim), (num_prompts,)

    Opening reads the index's per-prompt columns only. The per-token columns (token addresses,
    ids, strings, perplexities) stay on disk until a call needs some prompts' tokens, and then
    only the row groups holding those prompts are read, so opening costs the same for a million
    tokens as for a billion.
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
        per_prompt = [n for n in schema.names if n not in PER_TOKEN_COLUMNS]
        self._prompt_table = self._parquet.read(columns=per_prompt)
        md = self._parquet.metadata
        self._group_starts = np.zeros(md.num_row_groups + 1, dtype=np.int64)
        np.cumsum([md.row_group(g).num_rows for g in range(md.num_row_groups)], out=self._group_starts[1:])
        self._groups: OrderedDict[tuple[int, tuple[str, ...]], pa.Table] = OrderedDict()
        self._headers: dict[Path, SafetensorsHeader] = {}
        self._located: dict[tuple[int, int, str | None], tuple[Path, TensorEntry]] = {}
        if self.meta.num_prompts != self._prompt_table.num_rows:
            raise FormatError(
                f"{files}: metadata says num_prompts={self.meta.num_prompts} but the index has "
                f"{self._prompt_table.num_rows} rows"
            )

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
        """The index's per-prompt columns (everything but the per-token lists), as read when the dataset opened."""
        return self._prompt_table

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

    def iter_index(self) -> Iterable[pa.Table]:
        """The whole index, every column, one row group at a time (for copying it, never whole in memory)."""
        for g in range(self._parquet.metadata.num_row_groups):
            yield self._parquet.read_row_group(g)

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

    def _header(self, path: Path) -> SafetensorsHeader:
        h = self._headers.get(path)
        if h is None:
            h = self._headers[path] = read_header(path)
        return h

    def fetch(self, rel: str, what: str) -> Path:
        """Local path of the dataset file ``rel`` (downloaded when remote); missing: ShardMissingError."""
        path = self.files.fetch(rel, what=what)
        if not path.exists():
            raise ShardMissingError(self._missing_hint(rel))
        return path

    def layers_here(self, hookpoint: str | None = None) -> list[int]:
        """The stored layers whose shards are all in this copy: a ``lmprobe pull --layers 4`` copy holds [4].

        A source that fetches on demand (the Hub, object storage) holds every layer.
        """
        h = self.hidden_desc(hookpoint)
        has = getattr(self.files, "has", None)
        if has is None:
            return list(h.layers)
        return [layer for layer in h.layers if all(has(h.file(layer, s)) for s in range(len(h.shards)))]

    def logits_here(self) -> bool:
        """Whether the top-k logits' shards are in this copy (``lmprobe pull --no-logits`` leaves them out)."""
        lg, has = self.meta.logits, getattr(self.files, "has", None)
        return lg is not None and (has is None or all(has(lg.file(s)) for s in range(len(lg.shards))))

    def default_layers(self, hookpoint: str | None = None) -> list[int]:
        """The layers a command takes when none are named: every stored layer; in a copy that ``lmprobe pull
        --layers`` made, the layers it holds (a folder that merely lacks files is not guessed around: reading
        the missing layer says what is missing)."""
        if getattr(self.files, "origin", None):
            return self.layers_here(hookpoint)
        return list(self.hidden_desc(hookpoint).layers)

    def _missing_hint(self, rel: str) -> str:
        """What to do about a missing file: for a layer's shard in a partial copy, the pull that fetches it."""
        descs = self.meta.hookpoints or {self._hidden_desc.hookpoint: self._hidden_desc}
        for hp, h in descs.items():
            layer = next((x for x in h.layers for s in range(len(h.shards)) if h.file(x, s) == rel), None)
            if layer is None:
                continue
            here = self.layers_here(hp)
            if not here:
                break
            repo = getattr(self.files, "origin", None) or "REPO"
            hps = f" --hookpoints {hp}" if len(descs) > 1 else ""
            held = f"layer {here[0]}" if len(here) == 1 else f"layers {', '.join(map(str, here))}"
            return (f"this copy holds {held} only, not layer {layer} ({rel} is not here): "
                    f"`lmprobe pull {repo} --layers {layer}{hps} --out {self.files}` fetches it")
        lg = self.meta.logits
        if lg is not None and getattr(self.files, "origin", None) and not self.logits_here() \
                and rel in {lg.file(s) for s in range(len(lg.shards))}:
            return (f"this copy was pulled without its top-k logits ({rel} is not here): `lmprobe pull "
                    f"{self.files.origin} --out {self.files}` (without --no-logits) fetches them")
        return self.files.missing_hint(rel)

    def tensor(self, rel: str, key: str, dtype: str, row_shape: tuple[int, ...], min_rows: int) -> tuple[Path, TensorEntry]:
        """The shard file ``rel`` and its tensor ``key``, checked against what the metadata says."""
        return self.check_tensor(self.fetch(rel, "shard file"), rel, key, dtype, row_shape, min_rows)

    def check_tensor(self, path: Path, rel: str, key: str, dtype: str, row_shape: tuple[int, ...],
                     min_rows: int) -> tuple[Path, TensorEntry]:
        """The local file ``path`` holding ``rel``: its tensor ``key``, checked against the metadata."""
        return path, self.check_entry(self._header(path), rel, key, dtype, row_shape, min_rows)

    def hidden_header_entry(self, header: SafetensorsHeader, layer: int, shard: int,
                            hookpoint: str | None = None) -> TensorEntry:
        """The tensor entry of shard ``shard`` of ``layer`` in a header read remotely (range requests), checked."""
        h = self.hidden_desc(hookpoint)
        return self.check_entry(header, h.file(layer, shard), h.key(layer), h.dtype, (h.dim,), h.shard_rows(shard))

    def check_entry(self, header: SafetensorsHeader, rel: str, key: str, dtype: str, row_shape: tuple[int, ...],
                    min_rows: int) -> TensorEntry:
        """Tensor ``key`` of the parsed header of ``rel``, checked against what the metadata says."""
        entry = header.tensors.get(key)
        if entry is None:
            raise FormatError(f"{rel}: no tensor {key!r} (has {sorted(header.tensors)})")
        if entry.dtype != dtype:
            raise FormatError(f"{rel}: tensor {key!r} is {entry.dtype} but the metadata says {dtype}")
        if entry.shape[1:] != row_shape:
            raise FormatError(f"{rel}: tensor {key!r} has shape {list(entry.shape)}, expected rows of {list(row_shape)}")
        if entry.shape[0] < min_rows:
            raise FormatError(f"{rel}: tensor {key!r} has {entry.shape[0]} rows, the index needs {min_rows}")
        return entry

    def hidden_shard(self, layer: int, shard: int, hookpoint: str | None = None) -> tuple[Path, TensorEntry]:
        """Shard ``shard`` of ``layer`` (of ``hookpoint``): local path and tensor entry, checked."""
        key = (layer, shard, hookpoint)
        found = self._located.get(key)
        if found is not None:
            return found
        h = self.hidden_desc(hookpoint)
        if not 0 <= shard < len(h.shards):
            raise FormatError(f"{self.files}: shard {shard} is not among the {len(h.shards)} the metadata lists")
        found = self.tensor(h.file(layer, shard), h.key(layer), h.dtype, (h.dim,), h.shard_rows(shard))
        if isinstance(self.files, LocalFiles):  # located and checked once (a remote copy may leave a bounded cache)
            self._located[key] = found
        return found

    def check_addresses(self, shard_ids: np.ndarray, offsets: np.ndarray, shard_rows, n_shards: int) -> None:
        """Every (shard, row) lies inside the shards the metadata lists; FormatError naming the first that does not.

        Addresses come from the index: untrusted. ``shard_rows(shard)`` is a shard's row count.
        """
        if len(shard_ids) == 0:
            return
        if shard_ids.min() < 0 or shard_ids.max() >= n_shards:
            bad = int(shard_ids.max() if shard_ids.max() >= n_shards else shard_ids.min())
            raise FormatError(f"{self.files}: the index points at shard {bad}, but only {n_shards} are listed")
        rows = np.array([shard_rows(s) for s in range(n_shards)], dtype=np.int64)[shard_ids]
        bad = np.flatnonzero((offsets < 0) | (offsets >= rows))
        if len(bad):
            i = int(bad[0])
            raise FormatError(f"{self.files}: the index gives row offset {int(offsets[i])} in shard {int(shard_ids[i])}, "
                              f"which has {int(rows[i])} rows ({len(bad)} address(es) out of range)")

    def _gather(self, shard_ids: np.ndarray, offsets: np.ndarray, locate, n_shards: int, row_shape: tuple[int, ...],
                storage: np.dtype, *, bfloat16_out: bool = False) -> np.ndarray:
        """Rows ``offsets[i]`` of shards ``shard_ids[i]``, one read pass per shard (``bfloat16_out``:
        bfloat16 rows returned as float32).

        Every shard is located and its header checked against the metadata before the output is
        allocated: a size in the metadata that no file backs never reaches np.empty.
        """
        if len(shard_ids) and (shard_ids.min() < 0 or shard_ids.max() >= n_shards):
            bad = int(shard_ids.max() if shard_ids.max() >= n_shards else shard_ids.min())
            raise FormatError(f"{self.files}: the index points at shard {bad}, but only {n_shards} are listed")
        order = np.argsort(shard_ids, kind="stable")
        bounds = np.flatnonzero(np.diff(shard_ids[order])) + 1
        groups = [(g, *locate(int(shard_ids[g[0]]))) for g in np.split(order, bounds)] if len(order) else []
        if bfloat16_out and len(shard_ids) * int(np.prod(row_shape)) > _WHOLE_VALUES:
            return self._gather_bfloat16(groups, offsets, len(shard_ids), row_shape)
        out = np.empty((len(shard_ids), *row_shape), dtype=storage)
        if bfloat16_out:  # a small read (a prompt): read whole, then cast on both converter threads at once
            bits, out = out, np.empty(out.shape, dtype=np.float32)
            self._read_groups(groups, offsets, bits)
            return bfloat16_to_float32_later(bits, out, split=True).result()
        self._read_groups(groups, offsets, out)
        return out

    @staticmethod
    def _read_groups(groups: list, offsets: np.ndarray, out: np.ndarray) -> None:
        for group, path, entry in groups:
            offs = offsets[group]
            lo, hi = int(group[0]), int(group[-1])
            if _consecutive(group):
                read_rows_into(path, entry, offs, out[lo : hi + 1])
            else:
                tmp = np.empty((len(group), *out.shape[1:]), dtype=out.dtype)
                read_rows_into(path, entry, offs, tmp)
                out[group] = tmp

    @staticmethod
    def _gather_bfloat16(groups: list, offsets: np.ndarray, n: int, row_shape: tuple[int, ...]) -> np.ndarray:
        """``_gather`` of bfloat16 rows straight to float32: pieces are read into two small buffers of raw
        bits in turn, each converted on a converter thread as soon as it is read: the two threads cast
        (and fault in the new output's pages) while the next piece is read. No layer-sized array of
        bits; a piece's bits are still in cache when they convert. A run of consecutive rows read into
        consecutive output rows (a prompt's tokens, a whole shard) opens its file once."""
        out = np.empty((n, *row_shape), dtype=np.float32)
        row_values = int(np.prod(row_shape)) if row_shape else 1
        piece = min(_PIECE_VALUES, max(_MIN_PIECE_VALUES, n * row_values // 4))
        step = max(1, piece // row_values)
        buffers: list[np.ndarray | None] = [None, None]
        pending: list[Future | None] = [None, None]  # each buffer's conversion in flight
        k = 0
        try:
            for group, path, entry in groups:
                offs = offsets[group]
                run = _consecutive(group) and _consecutive(offs)
                with open(path, "rb", buffering=0) if run else nullcontext() as f:
                    for a in range(0, len(group), step):
                        g = group[a : a + step]
                        slot = k % 2
                        if pending[slot] is not None:
                            pending[slot].result()  # the piece before last is converted: its buffer is free
                            pending[slot] = None
                        buf = buffers[slot]
                        if buf is None or len(buf) < len(g):
                            buf = buffers[slot] = np.empty((len(g), *row_shape), np.uint16)
                        bits = buf[: len(g)]
                        if run:
                            read_run_into(f, path, entry, int(offs[a]), bits)
                        else:
                            read_rows_into(path, entry, offs[a : a + step], bits)
                        lo, hi = int(g[0]), int(g[-1])
                        if run or _consecutive(g):
                            pending[slot] = bfloat16_to_float32_later(bits, out[lo : hi + 1])
                        else:
                            out[g] = bfloat16_bits_to_float32(bits)
                        k += 1
        finally:  # no conversion may still write into ``out`` or read a buffer once this returns or raises
            settle(pending)
        return out

    @staticmethod
    def _finish(arr: np.ndarray, dtype: str, as_torch: bool):
        if as_torch:
            import torch

            if dtype == "bfloat16":
                return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
            return torch.from_numpy(arr)
        if dtype == "bfloat16":
            return bfloat16_bits_to_float32(arr)
        return arr

    def read_hidden_rows(self, layer: int, shard_ids: np.ndarray, offsets: np.ndarray, *, as_torch: bool = False,
                         hookpoint: str | None = None):
        """Rows ``offsets[i]`` of shards ``shard_ids[i]`` of ``layer``: (N, dim), one read pass per shard."""
        h = self.hidden_desc(hookpoint)
        convert = h.dtype == "bfloat16" and not as_torch  # converted as it is read
        out = self._gather(shard_ids, offsets, lambda shard: self.hidden_shard(layer, shard, hookpoint), len(h.shards),
                           (h.dim,), DTYPES[h.dtype].np_storage, bfloat16_out=convert)
        return out if convert else self._finish(out, h.dtype, as_torch)

    def check_token_counts(self, counts: np.ndarray, rows: RowsArg, what: str) -> None:
        """Per-token lists must hold num_tokens entries per prompt (a damaged index must not shift every later prompt)."""
        col = self._prompt_table.column("num_tokens")
        if col.null_count:
            return  # lmprobe 0.10.3's pooled datasets: the lists give the lengths
        r = self.row_indices(rows)
        want = col.to_numpy()[r].astype(np.int64)
        bad = np.flatnonzero(want != counts)
        if len(bad):
            i = int(bad[0])
            raise FormatError(f"{self.files}: the index is damaged: row {int(r[i])}: {int(counts[i])} {what} for "
                              f"num_tokens={int(want[i])} ({len(bad)} row(s) disagree); `lmprobe validate` lists "
                              "every problem")

    def token_addresses(self, rows: RowsArg = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-token addresses of the prompts ``rows``: (shard ids, offsets, tokens per prompt), flattened."""
        if self.storage != "full_sequence":
            raise FormatError(
                "this dataset is pooled: it stores only the last token of each prompt; use .hidden(layer) "
                "(extract with --storage full_sequence to keep every token)"
            )
        cols = self.token_columns(["token_shard_ids", "token_shard_offsets"], rows)
        ids_col, offs_col = cols["token_shard_ids"], cols["token_shard_offsets"]
        lengths = pc.list_value_length(ids_col).to_numpy(zero_copy_only=False).astype(np.int64)
        if not np.array_equal(lengths, pc.list_value_length(offs_col).to_numpy(zero_copy_only=False)):
            raise FormatError(f"{self.files}: token_shard_ids and token_shard_offsets differ in length")
        self.check_token_counts(lengths, rows, "token addresses")
        ids = pc.list_flatten(ids_col).to_numpy(zero_copy_only=False).astype(np.int64)
        offs = pc.list_flatten(offs_col).to_numpy(zero_copy_only=False).astype(np.int64)
        return ids, offs, lengths

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
        shards = self.column("shard_index")[r]
        offsets = self.column("row_offset")[r]
        if len(r) and self.storage == "full_sequence" and shards.max() >= self._hidden_desc.last_token_shards:
            raise FormatError(f"{self.files}: shard_index points past the last-token shards")
        return self.read_hidden_rows(layer, shards, offsets, as_torch=as_torch, hookpoint=hookpoint)

    def token_hidden(self, i: int, layer: int, *, as_torch: bool = False, hookpoint: str | None = None):
        """All token activations of prompt ``i`` at ``layer``: (num_tokens, dim). Full-sequence datasets only."""
        layer = self.check_layer(layer, hookpoint)
        (row,) = self.row_indices(i)
        ids, offs, _ = self.token_addresses([int(row)])
        return self.read_hidden_rows(layer, ids, offs, as_torch=as_torch, hookpoint=hookpoint)

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

        path = self.fetch(desc.file, "statistics file")
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
        shards = self.column("shard_index_logits")[r]
        offsets = self.column("row_offset_logits")[r]
        keys: dict[int, tuple[str, str]] = {}

        def header_keys(shard: int) -> tuple[str, str]:
            if shard not in keys:
                path = self.fetch(desc.file(shard), "logits shard")
                keys[shard] = desc.keys_for(set(self._header(path).tensors))
            return keys[shard]

        def locate_values(shard: int):
            vk, _ = header_keys(shard)
            return self.tensor(desc.file(shard), vk, desc.dtype, (desc.k,), desc.shards[shard]["num_prompts"])

        def locate_indices(shard: int):
            _, ik = header_keys(shard)
            path = self.fetch(desc.file(shard), "logits shard")
            entry = self._header(path).tensors.get(ik)
            if entry is None or entry.dtype not in ("int32", "int64") or entry.shape[1:] != (desc.k,):
                raise FormatError(f"{desc.file(shard)}: tensor {ik!r} is missing or not an (n, {desc.k}) integer tensor")
            return path, entry

        values = self._gather(shards, offsets, locate_values, len(desc.shards), (desc.k,), DTYPES[desc.dtype].np_storage)
        idx_dtype = "int32"
        if len(r):
            idx_dtype = locate_indices(int(shards[0]))[1].dtype
        indices = self._gather(shards, offsets, locate_indices, len(desc.shards), (desc.k,), DTYPES[idx_dtype].np_storage)
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
