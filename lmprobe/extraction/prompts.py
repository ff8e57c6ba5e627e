"""Prompts: every record of a source read into memory and checked, for prompt-mode extraction.

A source is a file (JSONL, CSV, TSV, Parquet, plain text), a folder of such files, a Hugging Face
dataset, a Python list or a pandas DataFrame (:mod:`.sources` reads them). Everything is read
and checked before a model loads: an empty or non-string text, a missing column or a label
column that mixes types is an error naming the line. A source with an ``input_ids`` column of
integer lists is pretokenized: its ids are the model's input as they are.

Many ranks (``read_prompts(..., rank=r, world=n, all_gather=...)``): each rank reads and checks only
its own prompts (prompt ``i`` is rank ``i % world``'s, :mod:`.sources`), each with its position in
the whole source (``Prompts.indices``). Two small exchanges make the ranks agree on what depends
on every prompt: the columns and their order, each column's type, the labels' type, and any
error (every rank raises it). A share's :meth:`Prompts.fingerprint` identifies the share (a rank's
part resumes against it); :meth:`Prompts.set_identity` identifies the whole prompt set, the same
for one process and for any number of ranks (:class:`PromptDigest`).

Corpus extraction (``--context-len``/``--max-tokens``) streams its source instead (:mod:`.corpus`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ExtractionError, PromptError
from ..format.spec import RESERVED_COLUMNS
from ..format.values import infer_column_type, is_null
from .ranks import Gather
from .sources import PRETOKENIZED_COLUMN, Record, Source, check_share, open_source

logger = logging.getLogger(__name__)

_MOD = 1 << 256


@dataclass(frozen=True)
class PromptDigest:
    """A summary of prompts that adds up over shares: how many, and the sum modulo 2**256 of every prompt's
    SHA-256 (over its position in the whole source, text, label, user columns and token ids). The digests
    of the ranks' shares add up to the whole set's, whatever the number of ranks, so every rank can form
    the whole set's :meth:`identity` from the ranks' digests alone. It identifies (a resume, a finished
    dataset); it does not authenticate (a sum of hashes can be forged on purpose)."""

    count: int = 0
    sum: int = 0

    def __add__(self, other: PromptDigest) -> PromptDigest:
        return PromptDigest(self.count + other.count, (self.sum + other.sum) % _MOD)

    def identity(self) -> str:
        """The prompt set's identity: SHA-256 (hex) over the count and the sum."""
        return hashlib.sha256(f"lmprobe prompt set v1\n{self.count}\n{self.sum:064x}".encode()).hexdigest()

    def to_json(self) -> list:
        return [self.count, f"{self.sum:064x}"]

    @classmethod
    def from_json(cls, x: list) -> PromptDigest:
        return cls(int(x[0]), int(x[1], 16))


def prompt_set_identity(digests: Iterable[PromptDigest]) -> str:
    """The identity of a prompt set read in shares, from the shares' digests (in any order).

    >>> whole = read_prompts(["a", "b", "c"])
    >>> prompt_set_identity([whole.subset(0, 1).digest(), whole.subset(1, 3).digest()]) == whole.set_identity()
    True
    """
    return sum(digests, PromptDigest()).identity()


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
    # a rank's share of the source: each prompt's 0-based position in the whole source (None: 0, 1, ...)
    indices: list[int] | None = None
    share: tuple[int, int] | None = None  # (rank, world) of a share read with read_prompts; None: the whole set
    total: int | None = None  # a share: how many prompts the whole source holds
    _set_identity: str | None = field(default=None, repr=False)  # a share: the whole set's, from every rank

    def __len__(self) -> int:
        return len(self.texts)

    def fingerprint(self) -> str:
        """Identifies these prompts for resuming. The whole set: SHA-256 over texts, labels and user columns
        (and token ids). A rank's share (``share`` set): SHA-256 over the rank, the number of ranks and the
        share's :meth:`digest`, which covers every prompt's position in the source."""
        h = hashlib.sha256()
        if self.share is not None:
            d = self.digest()
            h.update(json.dumps({"share": list(self.share), "count": d.count, "sum": f"{d.sum:064x}"}).encode())
            return h.hexdigest()
        payload = {"texts": self.texts, "labels": self.labels, "columns": self.columns}
        if self.input_ids is not None:
            payload["input_ids"] = self.input_ids
        h.update(json.dumps(payload, sort_keys=True, default=str).encode())
        return h.hexdigest()

    def digest(self) -> PromptDigest:
        """These prompts' :class:`PromptDigest` (each with its position in the whole source)."""
        total = 0
        for i, position in enumerate(self.indices if self.indices is not None else range(len(self))):
            leaf = [position, self.texts[i], self.labels[i] if self.labels is not None else None,
                    {c: v[i] for c, v in self.columns.items()},
                    self.input_ids[i] if self.input_ids is not None else None]
            total += int.from_bytes(hashlib.sha256(json.dumps(leaf, sort_keys=True, default=str).encode()).digest(),
                                    "big")
        return PromptDigest(len(self), total % _MOD)

    def set_identity(self) -> str:
        """The whole prompt set's identity: the same for one process and for a share of any number of ranks
        (:func:`prompt_set_identity` of every rank's digest, exchanged when the share was read)."""
        if self.share is not None:
            assert self._set_identity is not None, "a share read with read_prompts knows the whole set's identity"
            return self._set_identity
        return self.digest().identity()

    def subset(self, lo: int, hi: int) -> Prompts:
        """Prompts ``lo`` to ``hi`` (one process's share of a multi-process extraction)."""
        return Prompts(self.texts[lo:hi], self.labels[lo:hi] if self.labels is not None else None, self.label_type,
                       {c: v[lo:hi] for c, v in self.columns.items()}, self.column_types, self.source,
                       self.input_ids[lo:hi] if self.input_ids is not None else None,
                       self.locations[lo:hi] if self.locations is not None else None,
                       self.indices[lo:hi] if self.indices is not None else list(range(lo, min(hi, len(self)))))

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
                  label_required: bool, *, names: list[str] | None = None, warn: bool = True) -> Prompts:
    """Prompts of ``records``, checked. ``names``: the columns of the whole source, in order (a rank's share
    may lack some); ``warn`` False: say nothing (another rank says it)."""
    if names is None:
        if not records:
            raise PromptError(f"{source}: no prompts found")
        names = [name for name, _, _ in _first_seen(records)]
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
        if close is not None and warn:  # said even with --quiet: it is about what the dataset will hold
            logger.warning("note: %s has a column %r but no %r: it is stored as an ordinary column, not "
                           "as the labels; pass --label-column %s to use it as the labels",
                           source, close, label_column, close)
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


def _first_seen(records: list[Record]) -> list[tuple[str, int, int]]:
    """Every column name, in the order the records first show them: (name, the first record's index, the
    name's place in that record)."""
    seen: dict[str, tuple[str, int, int]] = {}
    for r in records:
        for pos, k in enumerate(r.values):
            if k not in seen:
                seen[k] = (k, r.index, pos)
    return list(seen.values())


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
                 dataset_config: str | None = None, split: str = "train", rank: int = 0, world: int = 1,
                 all_gather: Gather | None = None, limit: int | None = None, token: Any = None) -> Prompts:
    """Read every prompt of ``source``: a file or folder path, a Hub dataset, a list of strings/dicts, or a DataFrame.

    A label column named explicitly (anything but the default "label") must exist; the default
    one is used when present.

    With ``world`` > 1: rank ``rank``'s share only (prompt ``i`` is rank ``i % world``'s), read,
    checked and returned with each prompt's position in the whole source (``indices``), for the
    same ``world`` ranks calling it at once with an ``all_gather`` (two exchanges, after reading
    and after checking). Every rank gets the whole source's columns, column types and label type,
    raises the same error when any rank finds one, and knows the whole set's identity
    (:meth:`Prompts.set_identity`). A rank may get no prompt (more ranks than prompts).

    With ``limit``: the first ``limit`` prompts of the source only; the source is read no further.

    ``token``: the Hub identity a Hub dataset is read with (None: HF_TOKEN or the saved login).

    >>> read_prompts(["The cat sat.", "A dog ran."]).texts
    ['The cat sat.', 'A dog ran.']
    """
    check_share(rank, world)
    src = source if isinstance(source, Source) else open_source(source, text_column=text_column, config=dataset_config,
                                                                split=split, token=token)
    label_required = label_column not in (None, "label")

    def take(**share: int) -> list[Record]:
        found = src.records(**share)
        return list(found if limit is None else itertools.takewhile(lambda r: r.index < limit, found))

    if world == 1:
        return _from_records(take(), src.description, text_column, label_column, label_required)
    if all_gather is None:
        raise ValueError("reading one rank's prompts needs all_gather: the ranks agree on columns, types and errors")
    name = src.description
    # 1. read the share; exchange the columns each rank saw (and where it first saw them)
    records: list[Record] = []
    try:
        records = take(rank=rank, world=world)
        mine: dict[str, Any] = {"n": len(records), "names": [list(x) for x in _first_seen(records)]}
        failed = None
    except Exception as exc:
        mine, failed = {"error": _describe(exc)}, exc
    gathered = _exchange(all_gather, mine, world, failed)
    total = sum(g["n"] for g in gathered)
    if total == 0:
        raise PromptError(f"{name}: no prompts found")
    first: dict[str, tuple[int, int]] = {}
    for g in gathered:
        for col, index, pos in g["names"]:
            first[col] = min(first.get(col, (index, pos)), (index, pos))
    names = sorted(first, key=first.__getitem__)  # the order one process sees them in
    # 2. check the share against the whole source's columns; exchange the label and value kinds, and digests
    p = None
    try:
        p = _from_records(records, name, text_column, label_column, label_required, names=names, warn=rank == 0)
        p.indices = [r.index for r in records]
        mine = {"labels": _label_kinds(p, records), "kinds": _value_kinds(p), "digest": p.digest().to_json()}
        failed = None
    except Exception as exc:
        mine, failed = {"error": _describe(exc)}, exc
    gathered = _exchange(all_gather, mine, world, failed)
    assert p is not None
    # 3. what depends on every prompt, the same on every rank
    p.label_type = _merge_label_kinds([g["labels"] for g in gathered])
    for col in p.column_types:
        kinds = sorted({k for g in gathered for k in g["kinds"].get(col, [])})
        try:
            p.column_types[col] = infer_column_type([_CANONICAL[k] for k in kinds], col)
        except (TypeError, ValueError) as exc:
            raise PromptError(f"{name}: {exc}") from None
    p.share, p.total = (rank, world), total
    p._set_identity = prompt_set_identity(PromptDigest.from_json(g["digest"]) for g in gathered)
    return p


#: a stand-in value of each Python type a user column holds: the column's type depends on its values' types alone
_CANONICAL: dict[str, Any] = {"bool": False, "int": 0, "float": 0.0, "str": ""}


def _value_kinds(p: Prompts) -> dict[str, list[str]]:
    """The kinds of each user column's values in a share (every value passed infer_column_type already)."""
    import numpy as np

    out = {}
    for col, values in p.columns.items():
        kinds = set()
        for v in values:
            if v is None:
                continue
            v = v.item() if isinstance(v, np.generic) else v
            kinds.add("bool" if isinstance(v, bool) else "int" if isinstance(v, int) else
                      "float" if isinstance(v, float) else "str")
        out[col] = sorted(kinds)
    return out


def _label_kinds(p: Prompts, records: list[Record]) -> dict[str, list]:
    """The first label of each kind in a share: kind -> [index, where, at, repr(label)]."""
    out: dict[str, list] = {}
    for r, v in zip(records, p.labels or [], strict=False):
        if v is not None:
            out.setdefault("int" if isinstance(v, int) else "string", [r.index, r.where, r.at, repr(v)])
    return out


def _merge_label_kinds(shares: list[dict[str, list]]) -> str | None:
    """The whole set's label type from every share's first labels; a set mixing kinds is the error one process
    gives."""
    first: dict[str, list] = {}
    for share in shares:
        for kind, x in share.items():
            if kind not in first or x[0] < first[kind][0]:
                first[kind] = x
    if len(first) > 1:
        (kind_a, a), (kind_b, b) = sorted(first.items(), key=lambda kv: kv[1][0])
        raise PromptError(f"{b[1]}: label {b[3]} is a {kind_b} but {a[2]} has a {kind_a} label; a label column "
                          "holds integers or strings, not both")
    return next(iter(first), None)


def _describe(exc: BaseException) -> dict[str, str]:
    if isinstance(exc, PromptError):
        return {"kind": "prompt", "message": str(exc)}
    return {"kind": "other", "message": f"{type(exc).__name__}: {str(exc)[:300]}"}


def _exchange(all_gather: Gather, mine: dict, world: int, failed: BaseException | None) -> list[dict]:
    """Every rank's ``mine``. When a rank failed, every rank raises: the first failed rank's prompt error
    (the same message everywhere), or this rank's own failure when it is not one (with its traceback)."""
    gathered = list(all_gather(mine))
    if len(gathered) != world:
        raise AssertionError(f"all_gather returned {len(gathered)} objects for {world} ranks")
    if failed is not None and not isinstance(failed, PromptError):
        raise failed
    for rank, g in enumerate(gathered):
        if "error" in g:
            if g["error"]["kind"] == "prompt":
                raise PromptError(g["error"]["message"])
            raise ExtractionError(f"rank {rank} could not read its prompts ({g['error']['message']}); its log has "
                                  "the traceback")
    return gathered
