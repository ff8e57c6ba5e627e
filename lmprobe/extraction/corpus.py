"""Corpus extraction: documents streamed from a source, cut into context windows, one row each.

The source is read record by record (never whole); each document is tokenized once, without
special tokens, and cut into windows of ``context_len`` tokens (:mod:`.windows`), the
tokenizer's special tokens added to every window within those tokens. Rows are stored in
source order with ``document`` (the record's 0-based position in the source) and
``window_start`` (the offset of the window's first content token in the document's own ids).

A token budget stops at exactly ``max_tokens`` stored tokens: the last window is cut, and the
source is not read further. The writer's checkpoints record where the stream stands
(``{"document": d, "window": w}``: the next window to run), so a resumed run starts reading at
document ``d`` without parsing the records before it, and stores nothing twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import ExtractionError, PromptError
from .prompts import check_token_ids, record_text
from .sources import PRETOKENIZED_COLUMN, Record, Source
from .tokens import pad_sequences
from .windows import Affixes, Budget, windows

#: Documents tokenized together (fast tokenizers run a batch in parallel).
TOKENIZE_CHUNK = 64


@dataclass
class Window:
    document: int
    index: int  # the window's number within its document
    start: int  # window_start: offset of the first content token in the document's ids
    input_ids: list[int]  # what the model runs: affixes + content (cut by the budget)
    text: str


@dataclass
class CorpusPlan:
    """The settings of a corpus extraction that are not fields of :class:`ExtractionConfig`."""

    source: Source
    affixes: Affixes
    context_len: int
    max_tokens: int | None
    vocab_size: int | None


class _DocumentTokenizer:
    """Document records -> content token ids (and character offsets, to cut each window's text)."""

    def __init__(self, tok: Any, text_column: str, vocab_size: int | None):
        self.tok = tok
        self.text_column = text_column
        self.vocab_size = vocab_size
        self.offsets = bool(getattr(tok, "is_fast", False))

    def encode(self, records: list[Record]) -> list[tuple[list[int], list[tuple[int, int]] | None, str]]:
        """(content ids, offsets or None, text) of each record; empty documents give no ids."""
        out: list[Any] = [None] * len(records)
        texts, where = [], []
        for j, r in enumerate(records):
            if PRETOKENIZED_COLUMN in r.values:
                ids = check_token_ids(r.values[PRETOKENIZED_COLUMN], r, self.vocab_size)
                out[j] = (ids, None, None)
            else:
                t = record_text(r, self.text_column, required=False) if self.text_column in r.values else None
                if t is None:
                    raise PromptError(f"{r.where}: no {self.text_column!r} field (fields: {list(r.values)}); "
                                      "pass --text-column NAME to choose the text column")
                texts.append(t)
                where.append(j)
        if texts:
            enc = self.tok(texts, add_special_tokens=False, return_offsets_mapping=self.offsets, truncation=False,
                           verbose=False)
            for k, j in enumerate(where):
                offs = enc["offset_mapping"][k] if self.offsets else None
                out[j] = (enc["input_ids"][k], offs, texts[k])
        return out

    def window_text(self, ids: list[int], offsets: Any, text: str | None, a: int, b: int) -> str:
        if offsets is not None and text is not None:
            return text[offsets[a][0] : offsets[b - 1][1]]
        return self.tok.decode(ids[a:b])


def stream_windows(plan: CorpusPlan, tok: Any, text_column: str, *, resume: dict[str, int] | None,
                   budget: Budget) -> Iterator[Window]:
    """Windows of the source's documents in order, from where ``resume`` says, until the budget is spent."""
    if budget.spent:
        return
    doc_tok = _DocumentTokenizer(tok, text_column, plan.vocab_size)
    per_window = plan.affixes.content_per_window(plan.context_len)
    first_doc = resume["document"] if resume else 0
    skip_windows = resume["window"] if resume else 0
    records = plan.source.records(first_doc)
    while True:
        chunk = [r for _, r in zip(range(TOKENIZE_CHUNK), records, strict=False)]
        if not chunk:
            return
        for r, (ids, offsets, text) in zip(chunk, doc_tok.encode(chunk), strict=True):
            for w, (a, b) in enumerate(windows(len(ids), per_window)):
                if r.index == first_doc and w < skip_windows:
                    continue
                input_ids = plan.affixes.wrap(ids[a:b])
                n = budget.take(len(input_ids))
                if n < len(input_ids):  # the budget cuts this window: its content ends earlier
                    input_ids = input_ids[:n]
                    b = min(b, a + max(0, n - len(plan.affixes.prefix)))
                if n == 0:
                    return
                yield Window(r.index, w, a, input_ids, doc_tok.window_text(ids, offsets, text, a, b) if b > a else "")
                if budget.spent:
                    return


def check_first_record(source: Source, text_column: str, vocab_size: int | None, *, label_column: str | None = None,
                       windows_asked: bool = True) -> list[str]:
    """Read the source's first record before the model loads: a missing column or bad ids fail at once.

    Returns the source's other columns, which corpus extraction does not store. Labelled prompts
    given only ``--max-tokens`` (``windows_asked`` False) are refused: corpus extraction would drop
    their labels without being asked for windows.
    """
    head = source.head(1)
    if not head:
        raise PromptError(f"{source.description}: no documents found")
    r = head[0]
    if PRETOKENIZED_COLUMN in r.values:
        check_token_ids(r.values[PRETOKENIZED_COLUMN], r, vocab_size)
    elif text_column not in r.values:
        raise PromptError(f"{r.where}: no {text_column!r} field (fields: {list(r.values)}); pass --text-column NAME "
                          "to choose the text column")
    else:
        record_text(r, text_column, required=False)
    others = [c for c in r.values if c not in (text_column, PRETOKENIZED_COLUMN)]
    label = label_column or "label"
    if label in r.values and not windows_asked:
        rest = [c for c in others if c != label]
        also = f" (and {', '.join(repr(c) for c in rest)})" if rest else ""
        raise PromptError(f"{source.description} holds labelled prompts: a {label!r} column{also}; --max-tokens "
                          "alone makes this corpus extraction, which stores windows of documents and drops those "
                          "columns: leave out --max-tokens to extract the prompts, or add --context-len T to cut "
                          "them into windows on purpose")
    return others


def batches(stream: Iterator[Window], batch_size: int) -> Iterator[list[Window]]:
    batch: list[Window] = []
    for w in stream:
        batch.append(w)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def pad(batch: list[Window], pad_id: int, left: bool):
    """(input_ids, attention_mask) tensors of a batch of windows."""
    ids, mask, _ = pad_sequences([w.input_ids for w in batch], pad_id, left=left)
    return ids, mask


def progress_after(batch: list[Window]) -> dict[str, int]:
    """Where the stream stands after ``batch``: the next window to run."""
    last = batch[-1]
    return {"document": last.document, "window": last.index + 1}


def describe_context(context_len: int, limit: int | None) -> None:
    if limit is not None and context_len > limit:
        raise ExtractionError(f"--context-len {context_len} is longer than the model's limit of {limit} tokens; "
                              f"pass --context-len {limit} or less")
