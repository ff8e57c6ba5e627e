"""Reading .npy/.npz and safetensors arrays without numpy (for the pure-Python fallback).

Arrays come back as ``(flat_values: list, shape: tuple)``. Only the dtypes SAE dictionaries use
are supported: float16, float32, int32, int64. Nothing is unpickled: object arrays are refused.
"""

from __future__ import annotations

import ast
import json
import struct
import zipfile
from pathlib import Path

from ..errors import DictionaryError

_NPY_CODES = {"<f2": "e", "<f4": "f", "<i4": "i", "<i8": "q", "|i1": "b", "<u4": "I"}
_ST_CODES = {"F16": "e", "F32": "f", "I32": "i", "I64": "q"}


def _parse_npy(raw: bytes, what: str) -> tuple[list, tuple[int, ...]]:
    if raw[:6] != b"\x93NUMPY":
        raise DictionaryError(f"{what}: not a .npy array")
    major = raw[6]
    if major == 1:
        (hlen,) = struct.unpack("<H", raw[8:10])
        start = 10
    else:
        (hlen,) = struct.unpack("<I", raw[8:12])
        start = 12
    header = ast.literal_eval(raw[start : start + hlen].decode("latin1"))
    if not isinstance(header, dict) or header.get("fortran_order"):
        raise DictionaryError(f"{what}: unsupported .npy header (Fortran order or malformed)")
    descr = header.get("descr")
    if descr not in _NPY_CODES:
        raise DictionaryError(f"{what}: dtype {descr!r} is not supported here (object arrays are never loaded)")
    shape = tuple(int(x) for x in header["shape"])
    count = 1
    for s in shape:
        count *= s
    code = _NPY_CODES[descr]
    body = raw[start + hlen :]
    size = struct.calcsize(code)
    if len(body) < count * size:
        raise DictionaryError(f"{what}: truncated array data")
    return list(struct.unpack(f"<{count}{code}", body[: count * size])), shape


def load_npz(path: Path) -> dict[str, tuple[list, tuple[int, ...]]]:
    out = {}
    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            key = name[:-4] if name.endswith(".npy") else name
            out[key] = _parse_npy(z.read(name), f"{path}:{key}")
    return out


def load_npy(path: Path) -> tuple[list, tuple[int, ...]]:
    return _parse_npy(Path(path).read_bytes(), str(path))


def load_safetensors(path: Path) -> dict[str, tuple[list, tuple[int, ...]]]:
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    out = {}
    for key, e in header.items():
        code = _ST_CODES.get(e["dtype"])
        if code is None:
            raise DictionaryError(f"{path}: tensor {key!r} has dtype {e['dtype']}, not supported here")
        a, b = e["data_offsets"]
        shape = tuple(e["shape"])
        count = (b - a) // struct.calcsize(code)
        out[key] = (list(struct.unpack(f"<{count}{code}", raw[8 + n + a : 8 + n + b])), shape)
    return out


#: deflate cannot expand data more than ~1032 times: a zip member that claims more is lying about its size
_MAX_DEFLATE_RATIO = 1100
#: an encoder's weights (float16 values, int32 columns) compress less than 2x with np.savez_compressed, a dense
#: layer's columns (0..d-1 again and again) at most ~4x overall; runs of zeros declaring millions of empty
#: features compress ~1000x (a 66 KB file declaring 2^24 features): an .npz whose arrays declare more than this
#: many times its size is refused before any array is read (R31)
MAX_NPZ_EXPANSION = 64


def check_declared_sizes(path: Path) -> int:
    """The bytes of array data a .npy or .npz file declares, after checking that the file holds them.

    numpy allocates an array's declared size before it reads the data (for a zip member, always),
    so a 66 KB file whose header claims 2^34 values would ask for 32 GiB: such a file is refused
    here instead. A zip member may not claim more uncompressed bytes than deflate can produce.
    """
    import numpy as np  # the numpy path only: the pure-Python parser reads what the file holds

    fmt = np.lib.format

    def declared(f, what: str, holds: int) -> int:
        try:
            version = fmt.read_magic(f)
            reader = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            shape, _, dtype = reader(f, max_header_size=10_000)
        except (ValueError, OSError, EOFError, SyntaxError) as exc:
            raise DictionaryError(f"{what}: not a .npy array ({exc})") from None
        need = int(np.prod(shape, dtype=object)) * dtype.itemsize
        if need > holds - f.tell():
            raise DictionaryError(f"{what}: its header declares {need} bytes of data, the file holds "
                                  f"{max(0, holds - f.tell())}; the file is damaged")
        return need

    path = Path(path)
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            return declared(f, str(path), path.stat().st_size)
    total = 0
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if info.file_size > max(info.compress_size, 1) * _MAX_DEFLATE_RATIO + 1024:
                    raise DictionaryError(f"{path}:{info.filename}: claims {info.file_size} bytes from "
                                          f"{info.compress_size} compressed; the file is damaged")
                with z.open(info) as f:
                    total += declared(f, f"{path}:{info.filename}", info.file_size)
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise DictionaryError(f"{path}: not a readable .npz ({type(exc).__name__}: {exc})") from None
    size = path.stat().st_size
    if total > size * MAX_NPZ_EXPANSION + (1 << 20):
        raise DictionaryError(f"{path}: its arrays declare {total:,} bytes in a file of {size:,} (more than "
                              f"{MAX_NPZ_EXPANSION} times): weights do not compress so far, so its sizes are not "
                              "what it holds; the dictionary is damaged: export it again")
    return total
