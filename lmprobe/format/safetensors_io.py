"""Streaming safetensors files and header parsing.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON, then the tensor
bytes. The format allows the JSON to be padded with spaces, so we reserve a fixed header area,
append rows as they come (memory stays at one batch, not one shard), and write the real header
over the reserved area when the shard closes. Tensors after the first grow in side files that are
appended on close (logits shards hold values and indices).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ..base.safeio import check_regular, loads
from ..errors import FormatError
from .dtypes import DTYPES, ST_TO_DTYPE, dtype_info

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit safetensors itself enforces


@dataclass(frozen=True)
class TensorSpec:
    key: str
    dtype: str  # a name from spec.DTYPES
    row_shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64)) * dtype_info(self.dtype).itemsize


def _header_json(specs: list[TensorSpec], rows: int, metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    start = 0
    for spec in specs:
        end = start + rows * spec.row_bytes
        header[spec.key] = {
            "dtype": dtype_info(spec.dtype).st,
            "shape": [rows, *spec.row_shape],
            "data_offsets": [start, end],
        }
        start = end
    return json.dumps(header, separators=(",", ":")).encode()


def reserved_header_size(specs: list[TensorSpec], metadata: dict[str, str] | None) -> int:
    """Header bytes to reserve: enough for any row count, with data starting 8-byte aligned."""
    longest = len(_header_json(specs, 10**15, metadata))
    n = longest + 16
    return n + (-(8 + n) % 8)


class StreamingSafetensorsWriter:
    """Append rows to the tensors of one safetensors file; ``finish()`` makes it a valid file.

    ``resume_rows`` reopens a file left by an interrupted run and truncates it to that many rows.
    """

    def __init__(
        self,
        path: Path,
        specs: list[TensorSpec],
        *,
        metadata: dict[str, str] | None = None,
        resume_rows: int | None = None,
    ):
        self.path = Path(path)
        self.specs = specs
        self.metadata = metadata
        self.header_size = reserved_header_size(specs, metadata)
        self.rows = 0
        self._side_paths = [Path(f"{self.path}.t{i}") for i in range(1, len(specs))]
        if resume_rows is None:
            self._files = [open(self.path, "wb")] + [open(p, "w+b") for p in self._side_paths]
            self._files[0].write(b"\0" * (8 + self.header_size))
        else:
            self._files = [open(self.path, "r+b")] + [open(p, "r+b") for p in self._side_paths]
            for i, (f, spec) in enumerate(zip(self._files, specs, strict=False)):
                size = resume_rows * spec.row_bytes + (8 + self.header_size if i == 0 else 0)
                if os.fstat(f.fileno()).st_size < size:
                    raise FormatError(f"{self.path}: partial shard is shorter than its checkpoint says")
                f.truncate(size)
                f.seek(size)
            self.rows = resume_rows

    def append(self, arrays: list[np.ndarray]) -> None:
        """Append rows; ``arrays[i]`` has shape (n, *specs[i].row_shape) in the spec's storage dtype."""
        n = None
        for f, spec, arr in zip(self._files, self.specs, arrays, strict=False):
            if arr.dtype != DTYPES[spec.dtype].np_storage or arr.shape[1:] != spec.row_shape:
                raise AssertionError(f"{spec.key}: got {arr.dtype} {arr.shape}, expected {spec}")
            if n is None:
                n = arr.shape[0]
            assert arr.shape[0] == n, "all tensors of a shard grow by the same number of rows"
            f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))
        self.rows += n or 0

    def flush(self, fsync: bool = True) -> None:
        for f in self._files:
            f.flush()
            if fsync:
                os.fsync(f.fileno())

    def finish(self, fsync: bool = False) -> int:
        """Write the real header, append the side tensors, close; return the file size."""
        main = self._files[0]
        # Side files stay on disk until the caller's next checkpoint records this shard as closed:
        # a crash before that resumes the shard as open, from the side files' rows.
        for f in self._files[1:]:
            f.flush()
            f.seek(0)
            shutil.copyfileobj(f, main, 16 * 1024 * 1024)
            f.close()
        header = _header_json(self.specs, self.rows, self.metadata)
        assert len(header) <= self.header_size
        main.seek(0)
        main.write(struct.pack("<Q", self.header_size) + header + b" " * (self.header_size - len(header)))
        main.flush()
        if fsync:
            os.fsync(main.fileno())
        size = main.seek(0, os.SEEK_END)
        main.close()
        return size

    @property
    def side_paths(self) -> list[Path]:
        return list(self._side_paths)

    def abort(self) -> None:
        for f in self._files:
            f.close()


@dataclass(frozen=True)
class TensorEntry:
    key: str
    dtype: str  # our dtype name
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    file_size: int
    data_start: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


def read_header(path: Path) -> SafetensorsHeader:
    """Parse and check a safetensors header without reading tensor data.

    Everything is untrusted: the header's length, its JSON, each tensor's dtype, shape and
    offsets. Sizes are computed with Python's integers (no int64 overflow), and each tensor must
    lie inside the file with exactly the bytes its shape needs.
    """
    path = Path(path)
    check_regular(path, "shard file")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = header_length(f.read(8), size, path)
        raw = f.read(n)
    return parse_header(raw, size, path)


def header_length(head: bytes, size: int, path: Path | str) -> int:
    """The JSON length a safetensors file's first 8 bytes give, checked against the file's ``size``."""
    if len(head) < 8:
        raise FormatError(f"{path}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise FormatError(f"{path}: header length {n} is larger than the file ({size} bytes)")
    return n


def parse_header(raw: bytes, size: int, path: Path | str) -> SafetensorsHeader:
    """Check the header JSON ``raw`` of a ``size``-byte file (read locally, or by a range request)."""
    path = Path(path)
    n = len(raw)
    header = loads(raw, what=f"{path}: the safetensors header")
    if not isinstance(header, dict):
        raise FormatError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    tensors: dict[str, TensorEntry] = {}
    data_start = 8 + n
    for key, entry in header.items():
        try:
            st = entry["dtype"]
            shape_raw, offsets = entry["shape"], entry["data_offsets"]
            if not isinstance(shape_raw, list) or not isinstance(offsets, list) or len(offsets) != 2:
                raise TypeError
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in [*shape_raw, *offsets]):
                raise TypeError
            shape = tuple(shape_raw)
            start, end = offsets
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"{path}: tensor {key!r} has a malformed header entry") from None
        if not isinstance(st, str) or st not in ST_TO_DTYPE:
            raise FormatError(f"{path}: tensor {key!r} has dtype {st!r}, which lmprobe does not read")
        dt = ST_TO_DTYPE[st]
        expected = math.prod(shape) * dt.itemsize  # Python ints: a shape of 2**61 rows cannot wrap around
        if any(s < 0 for s in shape) or not 0 <= start <= end or end - start != expected:
            raise FormatError(f"{path}: tensor {key!r} has shape {list(shape)} but offsets [{start}, {end}]")
        if data_start + end > size:
            raise FormatError(f"{path}: tensor {key!r} runs past the end of the file (truncated download?)")
        tensors[key] = TensorEntry(key, dt.name, shape, data_start + start, data_start + end)
    return SafetensorsHeader(path, size, data_start, tensors, metadata if isinstance(metadata, dict) else {})


def read_rows_into(path: Path, entry: TensorEntry, offsets: np.ndarray, out: np.ndarray) -> None:
    """Read rows ``offsets`` of a 2-D tensor into ``out`` (len(offsets), row) in one pass over the file.

    A contiguous ascending run is one ``readinto`` straight into ``out``; anything else reads the
    spanned bytes once through a memory map and gathers.
    """
    if len(offsets) == 0:
        return
    n_rows = entry.shape[0]
    lo, hi = int(offsets.min()), int(offsets.max())
    if lo < 0 or hi >= n_rows:
        raise FormatError(f"{path}: row {hi if hi >= n_rows else lo} is out of range for {entry.key} ({n_rows} rows)")
    storage = DTYPES[entry.dtype].np_storage
    contiguous = hi - lo + 1 == len(offsets) and (len(offsets) == 1 or bool(np.all(np.diff(offsets) == 1)))
    if contiguous and out.flags.c_contiguous:
        with open(path, "rb", buffering=0) as f:
            read_run_into(f, path, entry, lo, out)
        return
    mm = np.memmap(path, dtype=storage, mode="r", offset=entry.start, shape=entry.shape)
    out[...] = mm[offsets]
    del mm


def read_run_into(f: BinaryIO, path: Path, entry: TensorEntry, first: int, out: np.ndarray) -> None:
    """Rows ``first .. first + len(out) - 1`` of a 2-D tensor of ``path``, open as ``f``, into ``out`` (C-contiguous)."""
    n_rows = entry.shape[0]
    if first < 0 or first + len(out) > n_rows:
        raise FormatError(f"{path}: rows {first}..{first + len(out) - 1} are out of range for {entry.key} ({n_rows} rows)")
    row_bytes = (entry.end - entry.start) // n_rows if n_rows else 0
    view = memoryview(out.view(np.uint8).reshape(-1))
    f.seek(entry.start + first * row_bytes)
    got = 0
    while got < len(view):
        k = f.readinto(view[got:])
        if not k:
            raise FormatError(f"{path}: file ended early while reading {entry.key}")
        got += k
