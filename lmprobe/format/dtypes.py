"""Every dtype the format stores, as a behaviour: its safetensors name, bytes per row, how a float batch is
encoded (scales included) and how stored rows decode to float32 (docs/format.md, "Dtypes").

This is the one place a dtype is described. Adding a storage dtype touches this table, its tests
(tests/format/test_dtypes.py) and docs/format.md; every writer, reader, gather, stream, export and statistics
path asks its ``DType`` here instead of comparing names.

Two lists, kept apart: ``HIDDEN_DTYPES`` are what hidden states may be *stored* as;
``COMPUTE_DTYPES`` are what a model may *run* in (``compute_dtype``). ``int8`` is a storage dtype only.

int8 stores each row as ``round(x / s)`` in [-127, 127], with ``s = max|x| / 127`` (the row's absmax
scale) kept as one float32 per row in a tensor beside the codes, in the same shard; a row decodes to
``codes * s`` in float32. A row of zeros has ``s = 0`` and decodes to zeros. NaN and infinity have no
code: a batch holding one is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ColumnTypeError, InvalidArgumentError
from .values import bfloat16_bits_to_float32, float32_to_bfloat16_bits, to_numpy, torch_dtype

#: the format version a dataset of unscaled dtypes is written under (lmprobe 0.10.3 reads it)
FORMAT_VERSION = "2.0"
#: the version of a dataset whose vectors need a scale to decode: readers that refuse a higher major version
#: (lmprobe 0.10.3 and every reader of format 2) refuse it instead of returning codes as values
SCALED_FORMAT_VERSION = "3.0"
#: the major versions this reader understands
READ_MAJORS = ("2", "3")
#: the suffix of a scaled tensor's scale key: ``hidden.layer_5`` -> ``hidden.layer_5.scale``
SCALE_SUFFIX = ".scale"
SCALE_DTYPE = "float32"


@dataclass(frozen=True)
class DType:
    """A stored dtype: what its bytes are, how many a row takes, and how values go in and come out."""

    name: str  # the name written in metadata
    st: str  # safetensors' dtype tag of the values (the codes, for a scaled dtype)
    itemsize: int
    np_storage: np.dtype  # how the raw bytes are held in numpy (bfloat16 has no numpy dtype: raw uint16 bits)
    scaled: bool = False  # one float32 scale per row, in a tensor of its own beside the codes
    qmax: int = 0  # a scaled dtype's largest code: values are stored as round(x / s), |code| <= qmax
    #: the 16 bits are a float32's top half (bfloat16): numpy has no type for them, torch casts them at memory speed
    half_of_float32: bool = False

    @property
    def format_version(self) -> str:
        """The format version of a dataset stored in this dtype."""
        return SCALED_FORMAT_VERSION if self.scaled else FORMAT_VERSION

    @property
    def compute(self) -> str:
        """The float dtype a model hands its activations to the writer in, before they are encoded."""
        return "float32" if self.scaled else self.name

    def row_bytes(self, dim: int) -> int:
        """Bytes one stored row of ``dim`` values takes in a shard, its scale included."""
        return int(dim) * self.itemsize + (np.dtype(SCALE_DTYPE).itemsize if self.scaled else 0)

    def tensors(self, key: str, dim: int) -> list[tuple[str, str, tuple[int, ...]]]:
        """(key, dtype, row shape) of each tensor a shard holds for rows stored under ``key``: the values, and a
        scaled dtype's scales beside them."""
        codes = (key, self.name, (int(dim),))
        return [codes, (scale_key(key), SCALE_DTYPE, ())] if self.scaled else [codes]

    def encode(self, x: Any) -> tuple[np.ndarray, np.ndarray | None]:
        """(codes, scales) of a float array-like (numpy, torch, JAX) of shape (rows, dim): codes in
        ``np_storage``, scales (rows,) float32 for a scaled dtype, else None.

        >>> codes, scales = DTYPES["int8"].encode(np.array([[1.0, -0.5], [0.0, 0.0]], np.float32))
        >>> codes.tolist(), scales.tolist()
        ([[127, -64], [0, 0]], [0.007874015718698502, 0.0])
        """
        if not self.scaled:
            return _to_storage(x, self), None
        a = to_numpy(x)
        if a.dtype == object:
            raise ColumnTypeError("expected a numeric array, got an object array (a nested list or dict?)")
        a = np.asarray(a, dtype=np.float32)
        if a.ndim != 2:
            return np.zeros(a.shape, self.np_storage), np.zeros(a.shape[:1], np.float32)  # the caller's shape check
        finite = np.isfinite(a)
        if not finite.all():
            row = int(np.flatnonzero(~finite.all(axis=1))[0])
            raise InvalidArgumentError(f"row {row} of the batch holds NaN or infinity, which {self.name} cannot store; "
                                       "store this dataset as float32 or bfloat16 (--dtype), or fix the values")
        amax = np.max(np.abs(a), axis=1) if a.shape[1] else np.zeros(len(a), np.float32)
        scales = (amax / np.float32(self.qmax)).astype(np.float32)
        # a division, not a reciprocal: the reciprocal of a subnormal scale overflows
        q = np.divide(a, scales[:, None], out=np.zeros_like(a), where=scales[:, None] > 0)
        np.rint(q, out=q)
        np.clip(q, -self.qmax, self.qmax, out=q)
        return q.astype(self.np_storage), scales

    def decode(self, codes: np.ndarray, scales: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """Stored rows (and their scales) as float32, into ``out`` when given: exactly what ``lmprobe.load``
        returns for them.

        >>> DTYPES["int8"].decode(np.array([[127, -64]], np.int8), np.array([0.5], np.float32)).tolist()
        [[63.5, -32.0]]
        """
        if self.half_of_float32:
            return bfloat16_bits_to_float32(np.ascontiguousarray(codes), out=out)
        if out is None:
            out = np.empty(codes.shape, dtype=np.float32)
        if not self.scaled:
            out[...] = codes
            return out
        if scales is None:
            raise AssertionError(f"{self.name} rows decode with their scales")
        np.multiply(codes, scales.reshape(scales.shape + (1,) * (codes.ndim - scales.ndim)), out=out,
                    dtype=np.float32)
        return out

    def torch_out(self) -> Any:
        """The torch dtype rows of this dtype come back as when read as torch tensors (``as_torch=True``)."""
        return torch_dtype("float32" if self.scaled else self.name)


DTYPES: dict[str, DType] = {
    "float32": DType("float32", "F32", 4, np.dtype("<f4")),
    "float16": DType("float16", "F16", 2, np.dtype("<f2")),
    "bfloat16": DType("bfloat16", "BF16", 2, np.dtype("<u2"), half_of_float32=True),
    "int8": DType("int8", "I8", 1, np.dtype("i1"), scaled=True, qmax=127),
    "float64": DType("float64", "F64", 8, np.dtype("<f8")),
    "int32": DType("int32", "I32", 4, np.dtype("<i4")),
    "int64": DType("int64", "I64", 8, np.dtype("<i8")),
}
#: what hidden states may be stored as (``--dtype``)
HIDDEN_DTYPES = ("float32", "float16", "bfloat16", "int8")
#: what a model may run in (``--compute-dtype``): a storage dtype such as int8 is not one
COMPUTE_DTYPES = ("float32", "float16", "bfloat16")
ST_TO_DTYPE = {d.st: d for d in DTYPES.values()}


def dtype_info(name: str) -> DType:
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidArgumentError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}") from None


def scale_key(key: str) -> str:
    """The key of the scales of a scaled tensor ``key`` in its shard."""
    return key + SCALE_SUFFIX


def _to_storage(x: Any, dt: DType) -> np.ndarray:
    """An array-like (numpy, torch, JAX) in the numpy storage of an unscaled dtype."""
    if type(x).__module__.split(".")[0] == "torch":
        import torch

        t = x.detach().to(device="cpu", dtype=torch_dtype(dt.name)).contiguous()
        if dt.half_of_float32:
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()
    a = np.asarray(x)
    if a.dtype == object:
        raise ColumnTypeError("expected a numeric array, got an object array (a nested list or dict?)")
    if dt.half_of_float32:
        return float32_to_bfloat16_bits(a)
    return np.ascontiguousarray(a, dtype=dt.np_storage)
