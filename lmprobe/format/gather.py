"""Rows out of a dataset's shards: files fetched, headers checked against the metadata, rows gathered.

A ``Dataset`` (reader.py) owns one ``ShardGather`` as ``ds.shards``: its own reads go through it,
and so do lmprobe's other modules that read shards themselves (docs/architecture.md, "The
Dataset's internal API"):

- ``fetch(rel, what)``: a dataset file's local path, or ShardMissingError saying how to get it;
- ``tensor(rel, key, dtype, row_shape, min_rows)`` and ``hidden_shard(layer, shard)``: a checked
  shard file and tensor entry; ``hidden_header_entry(header, layer, shard)`` for a header read remotely;
- ``token_addresses(rows)``, ``check_addresses(...)``, ``check_token_counts(...)``: the index's
  addresses of rows, checked;
- ``read_hidden_rows(layer, shard_ids, offsets)`` and ``logits_rows(shard_ids, offsets)``: rows
  gathered, one read pass per shard (bfloat16 converted to float32 as it is read; int8 decoded with
  its scales, ``hidden_scales(layer, shard)``, by ``dtypes.DType.decode``).

Addresses and headers are untrusted: every shard a read touches is located and its header checked
before the output is allocated, so a size in the metadata that no file backs never reaches np.empty.
"""

from __future__ import annotations

from concurrent.futures import Future
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc

from ..base.worker import settle
from ..errors import FormatError, ShardMissingError
from .dtypes import DTYPES, SCALE_DTYPE
from .files import LocalFiles
from .safetensors_io import SafetensorsHeader, TensorEntry, read_header, read_rows_into, read_run_into
from .values import bfloat16_bits_to_float32, bfloat16_to_float32_later

#: bfloat16 values read per piece when a read converts as it goes: at most 2M (4 MiB of bits, in cache when the
#: converter thread casts them), and a quarter of a small read (a prompt of 1024 tokens x 2048 is four pieces of
#: 512K, each read while the one before converts), down to 512K
_PIECE_VALUES = 1 << 21
_MIN_PIECE_VALUES = 1 << 19
#: reads of at most this many bfloat16 values (16 MiB of bits) are read whole, then cast by both converter threads
_WHOLE_VALUES = 1 << 23


class ShardGather:
    """The shards of one dataset, read for it: located and checked once each, rows gathered in one pass per shard.

    ``ds`` is the ``Dataset`` it reads for; it uses its public members only (``files``, ``meta``,
    ``hidden_desc``, ``row_indices``, ``token_columns``, ``prompt_table``, ``layers_here``, ...).
    """

    def __init__(self, ds: Any):
        self._ds = ds
        self._headers: dict[Path, SafetensorsHeader] = {}
        self._located: dict[tuple[int, int, str | None], tuple[Path, TensorEntry]] = {}

    @property
    def _files(self) -> Any:
        return self._ds.files

    # ---------------------------------------------------------------- files and headers

    def fetch(self, rel: str, what: str) -> Path:
        """Local path of the dataset file ``rel`` (downloaded when remote); missing: ShardMissingError."""
        path = self._files.fetch(rel, what=what)
        if not path.exists():
            raise ShardMissingError(self._missing_hint(rel))
        return path

    def _missing_hint(self, rel: str) -> str:
        """What to do about a missing file: for a layer's shard in a partial copy, the pull that fetches it."""
        ds, files = self._ds, self._files
        descs = ds.meta.hookpoints or {ds.hidden_desc().hookpoint: ds.hidden_desc()}
        for hp, h in descs.items():
            layer = next((x for x in h.layers for s in range(len(h.shards)) if h.file(x, s) == rel), None)
            if layer is None:
                continue
            here = ds.layers_here(hp)
            if not here:
                break
            repo = files.origin or "REPO"
            hps = f" --hookpoints {hp}" if len(descs) > 1 else ""
            held = f"layer {here[0]}" if len(here) == 1 else f"layers {', '.join(map(str, here))}"
            return (f"this copy holds {held} only, not layer {layer} ({rel} is not here): "
                    f"`lmprobe pull {repo} --layers {layer}{hps} --out {files}` fetches it")
        lg = ds.meta.logits
        if lg is not None and files.origin and not ds.logits_here() \
                and rel in {lg.file(s) for s in range(len(lg.shards))}:
            return (f"this copy was pulled without its top-k logits ({rel} is not here): `lmprobe pull "
                    f"{files.origin} --out {files}` (without --no-logits) fetches them")
        return files.missing_hint(rel)

    def _header(self, path: Path) -> SafetensorsHeader:
        h = self._headers.get(path)
        if h is None:
            h = self._headers[path] = read_header(path)
        return h

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
        h = self._ds.hidden_desc(hookpoint)
        return self.check_entry(header, h.file(layer, shard), h.key(layer), h.dtype, (h.dim,), h.shard_rows(shard))

    @staticmethod
    def check_entry(header: SafetensorsHeader, rel: str, key: str, dtype: str, row_shape: tuple[int, ...],
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
        h = self._ds.hidden_desc(hookpoint)
        if not 0 <= shard < len(h.shards):
            raise FormatError(f"{self._files}: shard {shard} is not among the {len(h.shards)} the metadata lists")
        found = self.tensor(h.file(layer, shard), h.key(layer), h.dtype, (h.dim,), h.shard_rows(shard))
        if isinstance(self._files, LocalFiles):  # located and checked once (a remote copy may leave a bounded cache)
            self._located[key] = found
        return found

    def hidden_scales(self, layer: int, shard: int, hookpoint: str | None = None) -> tuple[Path, TensorEntry]:
        """A scaled dtype's (int8) per-row scales of shard ``shard`` of ``layer``: local path and tensor entry, checked
        (one float32 per row of the codes, in the same file)."""
        h = self._ds.hidden_desc(hookpoint)
        if not 0 <= shard < len(h.shards):
            raise FormatError(f"{self._files}: shard {shard} is not among the {len(h.shards)} the metadata lists")
        key = h.scale_key(layer)
        if key is None:
            raise AssertionError(f"{h.dtype} rows have no scales")
        return self.tensor(h.file(layer, shard), key, SCALE_DTYPE, (), h.shard_rows(shard))

    # ---------------------------------------------------------------- addresses

    def check_addresses(self, shard_ids: np.ndarray, offsets: np.ndarray, shard_rows, n_shards: int) -> None:
        """Every (shard, row) lies inside the shards the metadata lists; FormatError naming the first that does not.

        Addresses come from the index: untrusted. ``shard_rows(shard)`` is a shard's row count.
        """
        if len(shard_ids) == 0:
            return
        if shard_ids.min() < 0 or shard_ids.max() >= n_shards:
            bad = int(shard_ids.max() if shard_ids.max() >= n_shards else shard_ids.min())
            raise FormatError(f"{self._files}: the index points at shard {bad}, but only {n_shards} are listed")
        rows = np.array([shard_rows(s) for s in range(n_shards)], dtype=np.int64)[shard_ids]
        bad = np.flatnonzero((offsets < 0) | (offsets >= rows))
        if len(bad):
            i = int(bad[0])
            raise FormatError(f"{self._files}: the index gives row offset {int(offsets[i])} in shard {int(shard_ids[i])}, "
                              f"which has {int(rows[i])} rows ({len(bad)} address(es) out of range)")

    def check_token_counts(self, counts: np.ndarray, rows: Any, what: str) -> None:
        """Per-token lists must hold num_tokens entries per prompt (a damaged index must not shift every later prompt)."""
        col = self._ds.prompt_table.column("num_tokens")
        if col.null_count:
            return  # lmprobe 0.10.3's pooled datasets: the lists give the lengths
        r = self._ds.row_indices(rows)
        want = col.to_numpy()[r].astype(np.int64)
        bad = np.flatnonzero(want != counts)
        if len(bad):
            i = int(bad[0])
            raise FormatError(f"{self._files}: the index is damaged: row {int(r[i])}: {int(counts[i])} {what} for "
                              f"num_tokens={int(want[i])} ({len(bad)} row(s) disagree); `lmprobe validate` lists "
                              "every problem")

    def token_addresses(self, rows: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-token addresses of the prompts ``rows``: (shard ids, offsets, tokens per prompt), flattened."""
        if self._ds.storage != "full_sequence":
            raise FormatError(
                "this dataset is pooled: it stores only the last token of each prompt; use .hidden(layer) "
                "(extract with --storage full_sequence to keep every token)"
            )
        cols = self._ds.token_columns(["token_shard_ids", "token_shard_offsets"], rows)
        ids_col, offs_col = cols["token_shard_ids"], cols["token_shard_offsets"]
        lengths = pc.list_value_length(ids_col).to_numpy(zero_copy_only=False).astype(np.int64)
        if not np.array_equal(lengths, pc.list_value_length(offs_col).to_numpy(zero_copy_only=False)):
            raise FormatError(f"{self._files}: token_shard_ids and token_shard_offsets differ in length")
        self.check_token_counts(lengths, rows, "token addresses")
        ids = pc.list_flatten(ids_col).to_numpy(zero_copy_only=False).astype(np.int64)
        offs = pc.list_flatten(offs_col).to_numpy(zero_copy_only=False).astype(np.int64)
        return ids, offs, lengths

    # ---------------------------------------------------------------- gathering rows

    def read_hidden_rows(self, layer: int, shard_ids: np.ndarray, offsets: np.ndarray, *, as_torch: bool = False,
                         hookpoint: str | None = None):
        """Rows ``offsets[i]`` of shards ``shard_ids[i]`` of ``layer``: (N, dim), one read pass per shard."""
        h = self._ds.hidden_desc(hookpoint)
        if h.kind.scaled:  # codes and their scales, gathered alike, decoded to float32
            codes = self._gather(shard_ids, offsets, lambda shard: self.hidden_shard(layer, shard, hookpoint),
                                 len(h.shards), (h.dim,), h.kind.np_storage)
            scales = self._gather(shard_ids, offsets, lambda shard: self.hidden_scales(layer, shard, hookpoint),
                                  len(h.shards), (), DTYPES[SCALE_DTYPE].np_storage)
            return _finish(h.kind.decode(codes, scales), False, as_torch)
        convert = h.kind.half_of_float32 and not as_torch  # converted as it is read
        out = self._gather(shard_ids, offsets, lambda shard: self.hidden_shard(layer, shard, hookpoint), len(h.shards),
                           (h.dim,), DTYPES[h.dtype].np_storage, bfloat16_out=convert)
        return out if convert else _finish(out, h.kind.half_of_float32, as_torch)

    def logits_rows(self, shard_ids: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Top-k logits rows ``offsets[i]`` of logits shards ``shard_ids[i]``: (values (N, k), indices (N, k))."""
        desc = self._ds.meta.logits
        if desc is None:
            raise FormatError("this dataset stores no logits (extract with --logits-topk K)")
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

        n = len(desc.shards)
        values = self._gather(shard_ids, offsets, locate_values, n, (desc.k,), DTYPES[desc.dtype].np_storage)
        idx_dtype = "int32"
        if len(shard_ids):
            idx_dtype = locate_indices(int(shard_ids[0]))[1].dtype
        indices = self._gather(shard_ids, offsets, locate_indices, n, (desc.k,), DTYPES[idx_dtype].np_storage)
        return values, indices

    def _gather(self, shard_ids: np.ndarray, offsets: np.ndarray, locate, n_shards: int, row_shape: tuple[int, ...],
                storage: np.dtype, *, bfloat16_out: bool = False) -> np.ndarray:
        """Rows ``offsets[i]`` of shards ``shard_ids[i]``, one read pass per shard (``bfloat16_out``:
        bfloat16 rows returned as float32).

        Every shard is located and its header checked against the metadata before the output is
        allocated: a size in the metadata that no file backs never reaches np.empty.
        """
        if len(shard_ids) and (shard_ids.min() < 0 or shard_ids.max() >= n_shards):
            bad = int(shard_ids.max() if shard_ids.max() >= n_shards else shard_ids.min())
            raise FormatError(f"{self._files}: the index points at shard {bad}, but only {n_shards} are listed")
        order = np.argsort(shard_ids, kind="stable")
        bounds = np.flatnonzero(np.diff(shard_ids[order])) + 1
        groups = [(g, *locate(int(shard_ids[g[0]]))) for g in np.split(order, bounds)] if len(order) else []
        if bfloat16_out and len(shard_ids) * int(np.prod(row_shape)) > _WHOLE_VALUES:
            return _gather_bfloat16(groups, offsets, len(shard_ids), row_shape)
        out = np.empty((len(shard_ids), *row_shape), dtype=storage)
        if bfloat16_out:  # a small read (a prompt): read whole, then cast on both converter threads at once
            bits, out = out, np.empty(out.shape, dtype=np.float32)
            _read_groups(groups, offsets, bits)
            return bfloat16_to_float32_later(bits, out, split=True).result()
        _read_groups(groups, offsets, out)
        return out


def _consecutive(positions: np.ndarray) -> bool:
    """Output positions that are one ascending run (rows read straight into a slice of the output)."""
    return len(positions) == 1 or bool(np.all(np.diff(positions) == 1))


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


def _finish(arr: np.ndarray, half_of_float32: bool, as_torch: bool):
    """Rows as read, handed out: a torch tensor (bfloat16 bits viewed as bfloat16), or float32 for bfloat16."""
    if as_torch:
        import torch

        if half_of_float32:
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(arr)
    if half_of_float32:
        return bfloat16_bits_to_float32(arr)
    return arr
