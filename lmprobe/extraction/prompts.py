"""Prompts: every record of a source read into memory and checked, for prompt-mode extraction.

A source is a file (JSONL, CSV, TSV, Parquet, plain text), a folder of such files, a Hugging Face
dataset, a Python list or a pandas DataFrame (:mod:`.sources` reads them). Everything is read
and checked before a model loads: an empty or non-string text, a missing column or a label
column that mixes types is an error naming the line. A source with an ``input_ids`` column of
integer lists is pretokenized: its ids are the model's input as they are.

Corpus extraction (``--context-len``/``--max-tokens``) streams its source instead (:mod:`.corpus`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from ..errors import PromptError
from ..format.spec import RESERVED_COLUMNS
from ..format.values import infer_column_type, is_null
from ..progress import logger
from .sources import PRETOKENIZED_COLUMN, Record, Source, open_source


@dataclass
class Prompts:
    texts: list[str]
    labels: list[Any] | None  # ints or strings, None entries for unlabeled rows
    label_type: str | None  # "int", "string" or None
    columns: dict[str, list[Any]] = field(default_factory=dict)
    column_types: dict[str, str] = field(default_factory=dict)
    source: str = "<memory>"
    input_ids: list[list[int]] | None = None  # pretokenized prompts: the model's input ids, as given
    locations: list[str] | None = None  # where each prompt is in its source ("line 3"), for messages

    def __len__(self) -> int:
        return len(self.texts)

    def fingerprint(self) -> str:
        """SHA-256 over texts, labels and user columns: identifies the prompt set for resuming."""
        h = hashlib.sha256()
        payload = {"texts": self.texts, "labels": self.labels, "columns": self.columns}
        if self.input_ids is not None:
            payload["input_ids"] = self.input_ids
        h.update(json.dumps(payload, sort_keys=True, default=str).encode())
        return h.hexdigest()

    def subset(self, lo: int, hi: int) -> Prompts:
        """Prompts ``lo`` to ``hi`` (one process's share of a multi-process extraction)."""
        return Prompts(self.texts[lo:hi], self.labels[lo:hi] if self.labels is not None else None, self.label_type,
                       {c: v[lo:hi] for c, v in self.columns.items()}, self.column_types, self.source,
                       self.input_ids[lo:hi] if self.input_ids is not None else None,
                       self.locations[lo:hi] if self.locations is not None else None)

    def take(self, indices: Any) -> Prompts:
        """The prompts at ``indices``, in that order (one process's share of a multi-process extraction)."""
        idx = [int(i) for i in indices]
        pick = (lambda v: [v[i] for i in idx]) if idx else (lambda v: [])
        return Prompts(pick(self.texts), pick(self.labels) if self.labels is not None else None, self.label_type,
                       {c: pick(v) for c, v in self.columns.items()}, self.column_types, self.source,
                       pick(self.input_ids) if self.input_ids is not None else None,
                       pick(self.locations) if self.locations is not None else None)

    def where(self, i: int) -> str:
        """Where prompt ``i`` is, for messages: "prompts.jsonl, line 4"."""
        return f"{self.source}, {self.locations[i] if self.locations else f'prompt {i}'}"


def _from_records(records: list[Record], source: str, text_column: str, label_column: str | None,
                  label_required: bool) -> Prompts:
    if not records:
        raise PromptError(f"{source}: no prompts found")
    names: list[str] = []
    for r in records:
        for k in r.values:
            if k not in names:
                names.append(k)
    pretokenized = PRETOKENIZED_COLUMN in names
    if text_column not in names and not pretokenized:
        close = _other_case(text_column, names)
        raise PromptError(f"{source}: no {text_column!r} column (columns: {names}); "
                          + (f"did you mean --text-column {close}?" if close else
                             "pass --text-column NAME to choose the text column"))
    if label_column is not None and label_column not in names:
        close = _other_case(label_column, names)
        if label_required:
            raise PromptError(f"{source}: no label column {label_column!r} (columns: {names})"
                              + (f"; did you mean --label-column {close}?" if close else ""))
        if close is not None:  # said even with --quiet: it is about what the dataset will hold
            logger.warning(f"note: {source} has a column {close!r} but no {label_column!r}: it is stored as an "
                           f"ordinary column, not as the labels; pass --label-column {close} to use it as the labels")
        label_column = None
    input_ids = [check_token_ids(r.values.get(PRETOKENIZED_COLUMN), r) for r in records] if pretokenized else None
    texts = [record_text(r, text_column, required=not pretokenized) for r in records]
    labels = label_type = None
    if label_column is not None:
        labels, label_type = _labels(records, label_column)
    columns: dict[str, list[Any]] = {}
    types: dict[str, str] = {}
    for name in names:
        if name in (text_column, label_column, PRETOKENIZED_COLUMN):
            continue
        if name in RESERVED_COLUMNS:
            raise PromptError(f"{source}: column {name!r} collides with a column of the lmprobe index; rename it")
        values = [r.values.get(name) for r in records]
        for r, v in zip(records, values, strict=True):
            if isinstance(v, (list, dict)):
                raise PromptError(
                    f"{r.where}: column {name!r} holds a {type(v).__name__}; user columns hold "
                    "strings, numbers or booleans (flatten or JSON-encode it)"
                )
        try:
            types[name] = infer_column_type(values, name)
        except (TypeError, ValueError) as exc:
            raise PromptError(f"{source}: {exc}") from None
        columns[name] = [None if is_null(v) else v for v in values]
    return Prompts(texts, labels, label_type, columns, types, source, input_ids, [r.at for r in records])


def _other_case(name: str, names: list[str]) -> str | None:
    """The column that differs from ``name`` only in case (``Label`` for ``label``), if exactly one does."""
    found = [n for n in names if n != name and n.lower() == name.lower()]
    return found[0] if len(found) == 1 else None


def record_text(r: Record, text_column: str, *, required: bool = True) -> str:
    """The text of record ``r``, checked: a non-empty string of Unicode text ("" when not required and absent)."""
    t = r.values.get(text_column)
    if t is None and not required:
        return ""
    if not isinstance(t, str):
        raise PromptError(f"{r.where}: {text_column!r} must be a string, got {t!r}")
    if not t.strip() and required:
        raise PromptError(f"{r.where}: {text_column!r} is empty")
    try:
        t.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PromptError(f"{r.where}: {text_column!r} contains an unpaired surrogate "
                          f"({t[exc.start]!r}), which is not Unicode text; fix the JSON escape") from None
    return t


def check_token_ids(ids: Any, r: Record, vocab_size: int | None = None) -> list[int]:
    """A pretokenized record's ``input_ids``: a non-empty list of integers in the vocabulary."""
    import numpy as np

    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)) or not ids or not all(
            isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in ids):
        raise PromptError(f"{r.where}: {PRETOKENIZED_COLUMN!r} must be a non-empty list of integers (token ids), "
                          f"got {str(ids)[:60]}")
    ids = [int(x) for x in ids]
    lo, hi = min(ids), max(ids)
    if lo < 0 or (vocab_size is not None and hi >= vocab_size):
        bad = lo if lo < 0 else hi
        where = f"0..{vocab_size - 1}" if vocab_size else "ids are 0 or more"
        raise PromptError(f"{r.where}: token id {bad} is outside the model's vocabulary ({where}); "
                          "were these ids made with another tokenizer?")
    return ids


def _labels(records: list[Record], column: str) -> tuple[list[Any], str | None]:
    import numpy as np

    out: list[Any] = []
    seen: dict[str, Record] = {}
    for r in records:
        v = r.values.get(column)
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
            raise PromptError(f"{r.where}: label {v!r} is neither an integer nor a string")
        if seen and kind_i not in seen:
            first_kind, first = next(iter(seen.items()))
            raise PromptError(
                f"{r.where}: label {v!r} is a {kind_i} but {first.at} has a {first_kind} label; a label column "
                "holds integers or strings, not both"
            )
        seen.setdefault(kind_i, r)
        if kind_i == "int" and not -(2**31) <= v < 2**31:
            raise PromptError(f"{r.where}: label {v} does not fit in int32")
        out.append(v)
    if not seen:
        return out, None
    return out, next(iter(seen))


def read_prompts(source: Any, *, text_column: str = "text", label_column: str | None = "label",
                 dataset_config: str | None = None, split: str = "train") -> Prompts:
    """Read every prompt of ``source``: a file or folder path, a Hub dataset, a list of strings/dicts, or a DataFrame.

    A label column named explicitly (anything but the default "label") must exist; the default
    one is used when present.

    >>> read_prompts(["The cat sat.", "A dog ran."]).texts
    ['The cat sat.', 'A dog ran.']
    """
    src = source if isinstance(source, Source) else open_source(source, text_column=text_column, config=dataset_config,
                                                                split=split)
    label_required = label_column not in (None, "label")
    return _from_records(list(src.records()), src.description, text_column, label_column, label_required)
