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
