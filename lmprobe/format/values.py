"""Converting user values (numpy, torch, JAX, Python) to what the format stores, with checks."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import ColumnTypeError, InvalidArgumentError

# User column types we accept, by the name used in metadata and fingerprints.
COLUMN_TYPES: dict[str, pa.DataType] = {
    "string": pa.string(),
    "int64": pa.int64(),
    "int32": pa.int32(),
    "float64": pa.float64(),
    "float32": pa.float32(),
    "bool": pa.bool_(),
}
_INT_RANGE = {"int64": (-(2**63), 2**63 - 1), "int32": (-(2**31), 2**31 - 1)}


def column_type_name(t: str | pa.DataType) -> str:
    if isinstance(t, pa.DataType):
        for name, pt in COLUMN_TYPES.items():
            if pt == t:
                return name
        if pa.types.is_large_string(t):
            return "string"
        raise InvalidArgumentError(f"unsupported column type {t}; use one of {sorted(COLUMN_TYPES)}")
    if t in COLUMN_TYPES:
        return t
    aliases = {"str": "string", "int": "int64", "float": "float64", "double": "float64", "boolean": "bool"}
    if t in aliases:
        return aliases[t]
    raise InvalidArgumentError(f"unsupported column type {t!r}; use one of {sorted(COLUMN_TYPES)}")


def is_null(v: Any) -> bool:
    if v is None:
        return True
    if isinstance(v, float) and math.isnan(v):
        return True
    try:
        import pandas as pd

        return v is pd.NA or v is pd.NaT
    except ImportError:  # pragma: no cover - pandas is a dependency
        return False


def check_value(v: Any, type_name: str, *, row: int, column: str) -> Any:
    """Return ``v`` as a plain Python value of ``type_name`` or raise ColumnTypeError naming row and column."""
    if is_null(v):
        return None
    ok = False
    if type_name == "string":
        ok = isinstance(v, str)
    elif type_name in _INT_RANGE:
        if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
            lo, hi = _INT_RANGE[type_name]
            ok = lo <= int(v) <= hi
            v = int(v)
        elif isinstance(v, (float, np.floating)) and float(v).is_integer():
            # pandas turns an int column with missing values into floats
            ok = True
            v = int(v)
    elif type_name in ("float64", "float32"):
        ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
        v = float(v) if ok else v
    elif type_name == "bool":
        ok = isinstance(v, (bool, np.bool_))
        v = bool(v) if ok else v
    if not ok:
        raise ColumnTypeError(
            f"row {row}, column {column!r}: value {v!r} ({type(v).__name__}) does not fit the column's "
            f"type {type_name}; fix the value or declare the column with a type that holds it"
        )
    return v


def infer_column_type(values: Any, column: str) -> str:
    """Infer a user column type from its values (all non-null values must agree)."""
    kinds = set()
    for v in values:
        if is_null(v):
            continue
        if isinstance(v, (bool, np.bool_)):
            kinds.add("bool")
        elif isinstance(v, (int, np.integer)):
            kinds.add("int64")
        elif isinstance(v, (float, np.floating)):
            kinds.add("float64")
        elif isinstance(v, str):
            kinds.add("string")
        else:
            raise ColumnTypeError(
                f"column {column!r}: value {v!r} of type {type(v).__name__} cannot be stored; "
                "user columns hold strings, integers, floats or booleans"
            )
    if kinds <= {"int64", "float64"} and "float64" in kinds:
        return "float64"
    if len(kinds) > 1:
        raise ColumnTypeError(f"column {column!r} mixes value types {sorted(kinds)}; make them one type")
    return kinds.pop() if kinds else "string"


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def float32_to_bfloat16_bits(a: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even) and return the raw uint16 bits."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


#: below this many values the numpy shift beats torch's per-call overhead (and torch's import)
_TORCH_CONVERT_MIN = 1 << 16


_CONVERTER: tuple[int, ThreadPoolExecutor] | None = None


#: values from which a cast is split between the converter threads (64 MiB of float32)
_SPLIT_CONVERT_MIN = 1 << 24
#: converter threads: each casts ~7 GB/s; two keep up with any reader here, more are rarely useful
_CONVERT_THREADS = max(1, min(2, os.cpu_count() or 1))


def _converter() -> ThreadPoolExecutor:
    """The threads that run torch's casts, each with one torch thread (OpenMP's count is per calling thread).

    torch would split a cast over every core with OpenMP; next to the threads of a reader, a writer
    or a training loop its threads spin waiting on each other, and the cast ran 2.2x slower than on
    one thread (4.6 against 2.1 ms for 2M values with the other core busy). Independent threads,
    each casting a part, use an idle core without that penalty on a busy one.
    """
    global _CONVERTER
    if _CONVERTER is None or _CONVERTER[0] != os.getpid():  # a forked DataLoader worker makes its own
        _CONVERTER = (os.getpid(), ThreadPoolExecutor(_CONVERT_THREADS, thread_name_prefix="lmprobe-bf16",
                                                      initializer=one_torch_thread))
    return _CONVERTER[1]


def _all_done(futures: list[Future], result: Any) -> Future:
    """A future done when all of ``futures`` are (none still writes into the result), with the first error."""
    done: Future = Future()
    lock = threading.Lock()
    left = [len(futures)]

    def one(_: Future) -> None:
        with lock:  # callbacks run on the converter threads
            left[0] -= 1
            if left[0]:
                return
        error = next((f.exception() for f in futures if f.exception() is not None), None)
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    for f in futures:
        f.add_done_callback(one)
    return done


def one_torch_thread() -> None:
    """A thread initializer: torch runs this thread's ops on one core (OpenMP's count is per calling
    thread), leaving the other cores to the caller, the hashers and the other workers."""
    import torch

    torch.set_num_threads(1)


def bfloat16_bits_to_float32(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bfloat16 values stored as raw uint16 bits -> float32, into ``out`` (allocated when not given).

    The one conversion of the package (reader, training reader, export-saev, pages). Exact: a
    bfloat16 is the top half of a float32, so this equals ``(bits.astype(uint32) << 16).view(float32)``
    for every bit pattern, NaN payloads included. Large arrays go through torch's vectorised cast
    straight into ``out`` (one pass over the data at memory-copy speed: ~4.5x the shift formula and
    its three temporaries), on one thread of its own (``_converter``); small ones through one numpy
    shift.

    >>> bfloat16_bits_to_float32(np.array([0x3F80, 0xC000], dtype=np.uint16)).tolist()
    [1.0, -2.0]
    """
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"expected raw bfloat16 bits as uint16, got {bits.dtype}")
    if out is None:
        out = np.empty(bits.shape, dtype=np.float32)
    elif out.dtype != np.float32 or out.shape != bits.shape:
        raise ValueError(f"out must be float32 of shape {bits.shape}, got {out.dtype} {out.shape}")
    bfloat16_to_float32_later(bits, out).result()
    return out


def bfloat16_to_float32_later(bits: np.ndarray, out: np.ndarray, *, split: bool = False) -> Future:
    """Start converting ``bits`` into ``out`` (checked as above) on the converter thread; the caller
    may do other work, and must not touch either array, until the returned future is done.
    ``split``: cast on every converter thread at once, whatever the size (the caller has nothing
    else to do meanwhile)."""
    if _torch_casts(bits):
        # a bulk read is split between the converter threads; a piece of a pipelined read is not (its
        # reader runs beside it)
        big = split or bits.size >= _SPLIT_CONVERT_MIN
        parts = min(_CONVERT_THREADS, len(bits) if bits.ndim else 1) if big else 1
        if parts <= 1:
            return _converter().submit(cast_bfloat16_here, bits, out)
        cuts = np.linspace(0, len(bits), parts + 1).astype(int)  # rows split between the converter threads
        return _all_done([_converter().submit(cast_bfloat16_here, bits[a:b], out[a:b])
                          for a, b in zip(cuts[:-1], cuts[1:], strict=True)], out)
    cast_bfloat16_here(bits, out)
    done: Future = Future()
    done.set_result(out)
    return done


def cast_bfloat16_here(bits: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The cast itself, on the calling thread: torch's vectorised cast for large arrays (a converter
    thread runs torch on one core), numpy's shift for small ones or read-only memory."""
    if _torch_casts(bits):
        import torch

        # a strided ``out`` is fine: torch writes through the view
        torch.from_numpy(out).copy_(torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16))
    else:
        np.left_shift(bits, 16, out=out.view(np.uint32), dtype=np.uint32)
    return out


def _torch_casts(bits: np.ndarray) -> bool:
    """Whether torch casts these bits (worth its per-call cost; torch warns on read-only memory such as maps)."""
    return bits.size >= _TORCH_CONVERT_MIN and bits.flags.writeable


def on_converter(fn: Callable[..., Any], *args: Any) -> Future:
    """Run ``fn(*args)`` on a converter thread (torch on one core there): work that casts as it goes,
    such as a training batch gathered and converted a few rows at a time."""
    return _converter().submit(fn, *args)


def torch_dtype(name: str):
    """The torch dtype of a floating dtype name (``float32``, ``float16``, ``bfloat16``)."""
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def to_numpy(x: Any) -> np.ndarray:
    if _is_torch(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)
