"""Prompt sources: JSONL, CSV, Parquet, plain text, a Python list or a pandas DataFrame.

Everything is read and checked before a model loads: an empty or non-string text, a missing
column or a label column that mixes types is an error naming the line.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PromptError
from ..format.spec import RESERVED_COLUMNS
from ..format.values import infer_column_type, is_null
from ..safeio import loads


@dataclass
class Prompts:
    texts: list[str]
    labels: list[Any] | None  # ints or strings, None entries for unlabeled rows
    label_type: str | None  # "int", "string" or None
    columns: dict[str, list[Any]] = field(default_factory=dict)
    column_types: dict[str, str] = field(default_factory=dict)
    source: str = "<memory>"

    def __len__(self) -> int:
        return len(self.texts)

    def fingerprint(self) -> str:
        """SHA-256 over texts, labels and user columns: identifies the prompt set for resuming."""
        h = hashlib.sha256()
        payload = {"texts": self.texts, "labels": self.labels, "columns": self.columns}
        h.update(json.dumps(payload, sort_keys=True, default=str).encode())
        return h.hexdigest()


def _where(kind: Any, i: int) -> str:
    """Where prompt ``i`` came from, for messages; ``kind`` may be a list of file line numbers."""
    if isinstance(kind, list):
        return f"line {kind[i]}"
    return {"csv": f"line {i + 2}", "txt": f"line {i + 1}", "parquet": f"row {i}"}.get(kind, f"prompt {i}")


def _from_records(records: list[dict], kind: Any, source: str, text_column: str, label_column: str | None,
                  label_required: bool) -> Prompts:
    if not records:
        raise PromptError(f"{source}: no prompts found")
    names: list[str] = []
    for r in records:
        for k in r:
            if k not in names:
                names.append(k)
    if text_column not in names:
        raise PromptError(
            f"{source}: no {text_column!r} column (columns: {names}); pass --text-column NAME to choose the text column"
        )
    if label_column is not None and label_column not in names:
        if label_required:
            raise PromptError(f"{source}: no label column {label_column!r} (columns: {names})")
        label_column = None
    texts: list[str] = []
    for i, r in enumerate(records):
        t = r.get(text_column)
        if not isinstance(t, str):
            raise PromptError(f"{source}, {_where(kind, i)}: {text_column!r} must be a string, got {t!r}")
        if not t.strip():
            raise PromptError(f"{source}, {_where(kind, i)}: {text_column!r} is empty")
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PromptError(f"{source}, {_where(kind, i)}: {text_column!r} contains an unpaired surrogate "
                              f"({t[exc.start]!r}), which is not Unicode text; fix the JSON escape") from None
        texts.append(t)
    labels = label_type = None
    if label_column is not None:
        labels, label_type = _labels([r.get(label_column) for r in records], kind, source, label_column)
    columns: dict[str, list[Any]] = {}
    types: dict[str, str] = {}
    for name in names:
        if name in (text_column, label_column):
            continue
        if name in RESERVED_COLUMNS:
            raise PromptError(f"{source}: column {name!r} collides with a column of the lmprobe index; rename it")
        values = [r.get(name) for r in records]
        for i, v in enumerate(values):
            if isinstance(v, (list, dict)):
                raise PromptError(
                    f"{source}, {_where(kind, i)}: column {name!r} holds a {type(v).__name__}; user columns hold "
                    "strings, numbers or booleans (flatten or JSON-encode it)"
                )
        try:
            types[name] = infer_column_type(values, name)
        except (TypeError, ValueError) as exc:
            raise PromptError(f"{source}: {exc}") from None
        columns[name] = [None if is_null(v) else v for v in values]
    return Prompts(texts, labels, label_type, columns, types, source)


def _labels(values: list[Any], kind: str, source: str, column: str) -> tuple[list[Any], str | None]:
    import numpy as np

    out: list[Any] = []
    seen: dict[str, int] = {}
    for i, v in enumerate(values):
        if is_null(v):
            out.append(None)
            continue
        if isinstance(v, (bool, np.bool_)):
            v, kind_i = int(v), "int"
        elif isinstance(v, (int, np.integer)):
            v, kind_i = int(v), "int"
        elif isinstance(v, (float, np.floating)) and float(v).is_integer():
            v, kind_i = int(v), "int"
        elif isinstance(v, str):
            kind_i = "string"
        else:
            raise PromptError(f"{source}, {_where(kind, i)}: label {v!r} is neither an integer nor a string")
        if seen and kind_i not in seen:
            first = next(iter(seen.values()))
            raise PromptError(
                f"{source}, {_where(kind, i)}: label {v!r} is a {kind_i} but {_where(kind, first)} has a "
                f"{next(iter(seen))} label; a label column holds integers or strings, not both"
            )
        seen.setdefault(kind_i, i)
        if kind_i == "int" and not -(2**31) <= v < 2**31:
            raise PromptError(f"{source}, {_where(kind, i)}: label {v} does not fit in int32")
        out.append(v)
    if not seen:
        return out, None
    return out, next(iter(seen))


def read_prompts(source: Any, *, text_column: str = "text", label_column: str | None = "label") -> Prompts:
    """Read prompts from a file path, a list of strings/dicts, or a pandas DataFrame.

    A label column named explicitly (anything but the default "label") must exist; the default
    one is used when present.

    >>> read_prompts(["The cat sat.", "A dog ran."]).texts
    ['The cat sat.', 'A dog ran.']
    """
    label_required = label_column not in (None, "label")
    try:
        import pandas as pd
    except ImportError:  # pragma: no cover - pandas is a dependency
        pd = None
    if pd is not None and isinstance(source, pd.DataFrame):
        records = source.to_dict(orient="records")
        return _from_records(records, "frame", "DataFrame", text_column, label_column, label_required)
    if isinstance(source, (str, os.PathLike)) and not (isinstance(source, str) and "\n" in source):
        return _read_file(Path(source), text_column, label_column, label_required)
    if isinstance(source, Sequence) and not isinstance(source, (str, bytes)):
        items = list(source)
        if all(isinstance(x, str) for x in items):
            records = [{text_column: x} for x in items]
        elif all(isinstance(x, dict) for x in items):
            records = items
        else:
            bad = next(i for i, x in enumerate(items) if not isinstance(x, (str, dict)))
            raise PromptError(f"prompt {bad}: expected a string (or a dict with {text_column!r}), got {items[bad]!r}")
        return _from_records(records, "list", "prompts", text_column, label_column, label_required)
    raise PromptError(f"cannot read prompts from {type(source).__name__}; pass a file path, a list or a DataFrame")


def text_lines(path: Path):
    """(line number, text) of every line of a UTF-8 file; a line that is not UTF-8 is an error naming it."""
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):
            try:
                yield i, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise PromptError(f"{path}, line {i}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column "
                                  f"{exc.start + 1}); save the file as UTF-8") from None


def _read_file(path: Path, text_column: str, label_column: str | None, label_required: bool) -> Prompts:
    if path.is_dir():
        raise PromptError(f"{path} is a folder; pass a prompt file (.jsonl, .csv, .tsv, .parquet or .txt)")
    if not path.is_file():
        raise PromptError(f"prompt file {path} does not exist")
    suffix = path.suffix.lower()
    src = str(path)
    if suffix in (".jsonl", ".ndjson"):
        records = []
        for lineno, line in text_lines(path):
            i = lineno - 1
            if not line.strip():
                continue
            obj = loads(line, what=f"{src}, line {lineno}", error=PromptError)
            if isinstance(obj, str):
                obj = {text_column: obj}
            if not isinstance(obj, dict):
                raise PromptError(f"{src}, line {lineno}: expected a JSON object, got {type(obj).__name__}")
            records.append((i, obj))
        line_numbers = [i + 1 for i, _ in records]  # file lines, blank lines skipped
        return _from_records([r for _, r in records], line_numbers, src, text_column, label_column, label_required)
    if suffix in (".csv", ".tsv"):
        import pandas as pd

        # the text column is text even when it looks like a number ("007")
        df = pd.read_csv(path, sep="\t" if suffix == ".tsv" else ",", keep_default_na=True, dtype_backend="numpy_nullable",
                         dtype={text_column: str}, encoding="utf-8")
        records = [{k: (None if is_null(v) else (v.item() if hasattr(v, "item") else v)) for k, v in r.items()}
                   for r in df.to_dict(orient="records")]
        return _from_records(records, "csv", src, text_column, label_column, label_required)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        records = pq.read_table(path).to_pylist()
        return _from_records(records, "parquet", src, text_column, label_column, label_required)
    if suffix in (".txt", ".text", ""):
        lines = [line.rstrip("\r\n") for _, line in text_lines(path)]
        while lines and not lines[-1].strip():
            lines.pop()
        for i, line in enumerate(lines):
            if not line.strip():
                raise PromptError(f"{src}, line {i + 1}: empty prompt (plain-text files hold one prompt per line)")
        return _from_records([{text_column: x} for x in lines], "txt", src, text_column, None, False)
    raise PromptError(f"{src}: unknown prompt file type {suffix!r}; use .jsonl, .csv, .tsv, .parquet or .txt")
