"""Checking a batch handed to the writer: every value against the dataset's spec, before any byte is written."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import ColumnTypeError, InvalidArgumentError
from .datasetspec import DatasetSpec
from .dtypes import DTYPES
from .values import check_value, to_numpy


@dataclass
class CheckedBatch:
    """A batch that fits the spec, in the forms the writer stores."""

    texts: list[str]
    counts: np.ndarray  # (b,) int64 tokens per prompt
    positions: list[int]  # each prompt's row in the final index
    labels: list[Any]
    # slot (spec.sites) -> the stored tensors of its rows (``DType.encode``): [codes] for an unscaled dtype,
    # [codes, scales (rows,) float32] for int8; codes (b, dim) pooled, (sum(counts), dim) full_sequence
    hidden: dict[str, list[np.ndarray]]
    logits: tuple[np.ndarray, np.ndarray] | None  # (values (b, k) float32, indices (b, k) int32)
    columns: dict[str, list]  # optional format columns (perplexity, token lists) and user columns

    def __len__(self) -> int:
        return len(self.texts)


def check_batch(spec: DatasetSpec, base: int, *, texts: Sequence[str], hidden: Mapping[Any, Any],
                num_tokens: Sequence[int], labels: Sequence[Any] | None = None,
                columns: Mapping[str, Sequence[Any]] | None = None, logits_values: Any = None,
                logits_indices: Any = None, perplexity_mean: Sequence[float] | None = None,
                perplexity_min: Sequence[float] | None = None, perplexity_max: Sequence[float] | None = None,
                token_ids: Sequence[Sequence[int]] | None = None, token_strings: Sequence[Sequence[str]] | None = None,
                token_perplexity: Sequence[Sequence[float]] | None = None,
                positions: Sequence[int] | None = None, document: Sequence[int] | None = None,
                window_start: Sequence[int] | None = None,
                truncated_tokens: Sequence[int] | None = None) -> CheckedBatch:
    """Check a batch whose first prompt becomes row ``base``; raise naming the row and what to fix."""
    b = len(texts)
    counts = np.asarray(num_tokens, dtype=np.int64)
    if counts.shape != (b,):
        raise InvalidArgumentError(f"num_tokens has {counts.size} entries for {b} texts")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise ColumnTypeError(f"row {base + i}, column 'text': expected a string, got {type(t).__name__}")
    if b and counts.min() < 1:
        i = int(np.argmin(counts))
        raise InvalidArgumentError(f"row {base + i}: num_tokens must be >= 1, got {counts[i]}")
    if positions is None:
        pos = list(range(base, base + b))
    else:
        pos = [int(x) for x in to_numpy(positions).reshape(-1).tolist()]
        if len(pos) != b or (b and min(pos) < 0):
            raise InvalidArgumentError(f"positions must hold {b} non-negative row numbers")
    out_columns = _check_format_columns(spec, b, base, counts, perplexity_mean, perplexity_min, perplexity_max,
                                        token_ids, token_strings, token_perplexity)
    out_columns.update(_check_corpus_columns(spec, b, document, window_start))
    out_columns.update(_check_truncation(spec, b, truncated_tokens))
    out_columns.update(_check_user_columns(spec, columns, b, base))
    return CheckedBatch(
        texts=list(texts),
        counts=counts,
        positions=pos,
        labels=_check_labels(spec, labels, b, base),
        hidden=_check_hidden(spec, hidden, counts, base),
        logits=_check_logits(spec, logits_values, logits_indices, b),
        columns=out_columns,
    )


def _check_corpus_columns(spec: DatasetSpec, b: int, document: Any, window_start: Any) -> dict[str, Any]:
    if not spec.corpus:
        if document is not None or window_start is not None:
            raise InvalidArgumentError("document/window_start were given but the writer was created with corpus=False")
        return {}
    out = {}
    for name, vals in (("document", document), ("window_start", window_start)):
        if vals is None:
            raise InvalidArgumentError(f"this dataset's rows are windows of documents; pass {name}")
        a = np.asarray(to_numpy(vals))
        if a.shape != (b,) or (b and (a.dtype.kind not in "iu" or a.min() < 0)):
            raise InvalidArgumentError(f"{name} must hold {b} non-negative integers")
        out[name] = a.astype(np.int64)
    return out


def _check_truncation(spec: DatasetSpec, b: int, truncated_tokens: Any) -> dict[str, Any]:
    if not spec.truncation:
        if truncated_tokens is not None:
            raise InvalidArgumentError("truncated_tokens was given but the writer was created with truncation=False")
        return {}
    if truncated_tokens is None:
        raise InvalidArgumentError("this dataset records truncation; pass truncated_tokens (0 for a prompt not cut)")
    a = np.asarray(to_numpy(truncated_tokens))
    if a.shape != (b,) or (b and (a.dtype.kind not in "iu" or a.min() < 0 or a.max() >= 2**31)):
        raise InvalidArgumentError(f"truncated_tokens must hold {b} non-negative integers")
    return {"truncated_tokens": a.astype(np.int32)}


def _check_labels(spec: DatasetSpec, labels: Sequence[Any] | None, b: int, base: int) -> list:
    if labels is None:
        if spec.label_type is not None:
            raise InvalidArgumentError(f"this dataset has {spec.label_type} labels; pass labels= for every batch")
        return [None] * b
    if len(labels) != b:
        raise InvalidArgumentError(f"labels has {len(labels)} entries for {b} texts")
    kind = "int32" if spec.label_type in (None, "int") else "string"
    out = [check_value(v, kind, row=base + i, column="label") for i, v in enumerate(labels)]
    if spec.label_type is None and any(v is not None for v in out):
        raise InvalidArgumentError(
            "labels were given but the writer was created with label_type=None; pass label_type='int' or 'string'")
    return out


def _check_user_columns(spec: DatasetSpec, columns: Mapping[str, Sequence[Any]] | None, b: int,
                        base: int) -> dict[str, list]:
    columns = dict(columns or {})
    unknown = set(columns) - set(spec.columns)
    if unknown:
        raise ColumnTypeError(
            f"unknown user column(s) {sorted(unknown)}; declare them with columns={{name: type}} "
            "when creating the writer"
        )
    out = {}
    for name, t in spec.columns.items():
        vals = columns.get(name)
        if vals is None:
            out[name] = [None] * b
            continue
        if len(vals) != b:
            raise InvalidArgumentError(f"column {name!r} has {len(vals)} values for {b} texts")
        out[name] = [check_value(v, t, row=base + i, column=name) for i, v in enumerate(vals)]
    return out


def hidden_by_slot(spec: DatasetSpec, hidden: Mapping[Any, Any]) -> dict[str, Any]:
    """``hidden`` keyed by the spec's slots.

    Accepted: ``{layer: array}`` (one hookpoint stored), ``{hookpoint: {layer: array}}`` or
    ``{(hookpoint, layer): array}``.
    """
    if not isinstance(hidden, Mapping):
        raise InvalidArgumentError(f"hidden must map layers to arrays, got {type(hidden).__name__}")
    by_site: dict[tuple[str, Any], Any] = {}
    for key, value in hidden.items():
        if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str):
            by_site[key] = value
        elif isinstance(key, str) and isinstance(value, Mapping):
            by_site.update({(key, layer): v for layer, v in value.items()})
        elif len(spec.hookpoints) == 1 and not isinstance(key, (str, tuple)):
            by_site[(spec.hookpoints[0], key)] = value
        else:
            raise InvalidArgumentError(
                f"hidden key {key!r}: this dataset stores hookpoints {list(spec.hookpoints)}; pass "
                "{hookpoint: {layer: array}} or {(hookpoint, layer): array}")
    want = {(hp, layer): slot for slot, (hp, layer) in spec.sites.items()}
    missing = [k for k in want if k not in by_site]
    extra = [k for k in by_site if k not in want]
    if missing or extra:
        if len(spec.hookpoints) == 1:
            missing, extra = [k[1] for k in missing], [k[1] for k in extra]
            raise InvalidArgumentError(
                f"hidden must hold exactly layers {list(spec.layers)}; missing {missing}, unexpected {extra}")
        raise InvalidArgumentError(
            f"hidden must hold layers {list(spec.layers)} of hookpoints {list(spec.hookpoints)}; "
            f"missing {missing}, unexpected {extra}")
    return {slot: by_site[k] for k, slot in want.items()}


def _check_hidden(spec: DatasetSpec, hidden: Mapping[Any, Any], counts: np.ndarray,
                  base: int) -> dict[str, list[np.ndarray]]:
    rows = len(counts) if not spec.full_sequence else int(counts.sum())
    out = {}
    sites = spec.sites
    kind = DTYPES[spec.dtype]
    for slot, value in hidden_by_slot(spec, hidden).items():
        hp, layer = sites[slot]
        name = f"hidden[{layer}]" if len(spec.hookpoints) == 1 else f"hidden[{hp!r}][{layer}]"
        try:
            tensors = kind.encode(value)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"{name} (prompts {base}..{base + len(counts) - 1}): {e}") from None
        a = tensors[0]
        if a.shape != (rows, spec.dim_of(hp)):
            what = "(batch, dim)" if not spec.full_sequence else "(sum(num_tokens), dim)"
            raise InvalidArgumentError(
                f"{name} has shape {tuple(a.shape)}; expected {what} = {(rows, spec.dim_of(hp))} "
                f"for prompts {base}..{base + len(counts) - 1}"
            )
        out[slot] = [t for t in tensors if t is not None]
    return out


def _check_logits(spec: DatasetSpec, values: Any, indices: Any, b: int) -> tuple[np.ndarray, np.ndarray] | None:
    if spec.logits_topk is None:
        if values is not None or indices is not None:
            raise InvalidArgumentError("logits were given but the writer was created without logits_topk")
        return None
    if values is None or indices is None:
        raise InvalidArgumentError(
            f"this dataset stores top-{spec.logits_topk} logits; pass logits_values and logits_indices")
    v = np.ascontiguousarray(to_numpy(values), dtype=np.float32)
    ix = to_numpy(indices)
    if ix.dtype.kind not in "iu":
        raise ColumnTypeError(f"logits_indices must be integers, got {ix.dtype}")
    if v.shape != (b, spec.logits_topk) or ix.shape != (b, spec.logits_topk):
        raise InvalidArgumentError(
            f"logits_values/logits_indices have shapes {v.shape}/{ix.shape}; expected {(b, spec.logits_topk)}"
        )
    if ix.size and (ix.min() < 0 or ix.max() > np.iinfo(np.int32).max):
        raise InvalidArgumentError("logits_indices must fit in int32")
    return v, np.ascontiguousarray(ix, dtype=np.int32)


def _check_format_columns(spec: DatasetSpec, b, base, counts, p_mean, p_min, p_max, token_ids, token_strings,
                          token_ppl) -> dict:
    """The optional columns of the format: perplexity summaries and per-token lists."""
    out: dict[str, list] = {}
    given = {"perplexity_mean": p_mean, "perplexity_min": p_min, "perplexity_max": p_max}
    if spec.perplexity:
        for name, vals in given.items():
            if vals is None:
                raise InvalidArgumentError(f"this dataset stores perplexity; pass {name}")
            vals = [float(x) for x in to_numpy(vals).reshape(-1).tolist()]
            if len(vals) != b:
                raise InvalidArgumentError(f"{name} has {len(vals)} values for {b} texts")
            out[name] = vals
    elif any(v is not None for v in given.values()):
        raise InvalidArgumentError("perplexity values were given but the writer was created with perplexity=False")
    lists = {
        "token_ids": (token_ids, 0, np.int64, spec.token_ids),
        "token_strings": (token_strings, 0, None, spec.token_strings),
        "token_perplexity": (token_ppl, 1, np.float64, spec.token_perplexity),
    }
    for name, (vals, short, dtype, stored) in lists.items():
        if not stored:
            if vals is not None:
                raise InvalidArgumentError(f"{name} were given but the writer was created with {name}=False")
            continue
        if vals is None:
            raise InvalidArgumentError(f"this dataset stores {name}; pass {name}")
        if len(vals) != b:
            raise InvalidArgumentError(f"{name} has {len(vals)} entries for {b} texts")
        out[name] = _list_column(name, vals, counts - short, dtype, base, short)
    return out


def _list_column(name: str, vals: Sequence[Any], want: np.ndarray, dtype: Any, base: int, short: int) -> pa.Array:
    """A per-token column of a batch as an Arrow list array (compact: one value buffer), lengths checked."""
    if dtype is None:  # strings
        rows = [[str(x) for x in (seq.tolist() if hasattr(seq, "tolist") else seq)] for seq in vals]
        lens = np.array([len(r) for r in rows], dtype=np.int64)
    else:
        rows = []
        for i, seq in enumerate(vals):
            try:
                rows.append(np.asarray(to_numpy(seq), dtype=dtype).reshape(-1))
            except (TypeError, ValueError):
                raise ColumnTypeError(f"row {base + i}: {name} must hold numbers") from None
        lens = np.array([len(r) for r in rows], dtype=np.int64)
    bad = np.flatnonzero(lens != want)
    if len(bad):
        i = int(bad[0])
        raise InvalidArgumentError(
            f"row {base + i}: {name} has {lens[i]} entries, expected {want[i]} (num_tokens{' - 1' if short else ''})"
        )
    if dtype is None:
        return pa.array(rows, type=pa.list_(pa.string()))
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    values = np.concatenate(rows) if rows else np.zeros(0, dtype=dtype)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values)).cast(
        pa.list_(pa.int64() if dtype is np.int64 else pa.float64()))
