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

Many ranks (``rank``/``world``): each rank reads and tokenizes only its own documents (document
``i`` is rank ``i % world``'s) and stores their windows, in source order. Without a budget no
rank needs the others. With one, the ranks agree where it ends (:mod:`.ranks`): either while
they extract (``all_gather``: a planner thread tokenizes a round of documents ahead and
exchanges their token counts; each document is tokenized once), or before, with
:func:`plan_budget` (a counting pass, so every document before the cutoff is tokenized twice)
and then ``cutoff=``. Either way the ranks' windows together are exactly the windows a single
process stores, with the same ids and the same cut of the last window.

A source of many files is dealt by piece instead (:mod:`.dealing`): a rank reads only its own
files or parquet row groups, and the ranks plan in rounds of pieces; the windows are the same.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..base.replay import Recorder
from ..errors import ExtractionError, PromptError
from .dealing import Placed, deal_pieces, share_pieces
from .pieces import Piece
from .prompts import check_token_ids, record_text
from .ranks import (
    BudgetEnd,
    Gather,
    Position,
    ahead,
    exchange_positions,
    plan_rounds,
    progress_record,
    unplanned_rounds,
)
from .sources import NONE_WANTED, PRETOKENIZED_COLUMN, Record, Source, check_share
from .tokens import pad_sequences
from .windows import Affixes, Budget, Cutoff, stored_tokens, windows

#: Documents tokenized together (fast tokenizers run a batch in parallel).
TOKENIZE_CHUNK = 64
#: Bytes of a piece that a rank's planner keeps after counting it, for the extraction to read again from memory
#: (a source dealt by piece, under a budget or with files no footer counts). At most AHEAD + 2 pieces are kept at
#: once: 256 MiB a rank at most; a larger piece is read from its file twice.
KEEP_BYTES = 64 << 20


@dataclass
class Window:
    document: int
    index: int  # the window's number within its document
    start: int  # window_start: offset of the first content token in the document's ids
    input_ids: list[int]  # what the model runs: affixes + content (cut by the budget)
    text: str
    # one rank of many (recorded in its progress, for resuming): ranked is set; under a budget, the tokens the
    # whole job stores before this document (None when no plan was made) and the budget's end once known
    ranked: bool = False
    tokens_before: int | None = None
    cutoff: Cutoff | None = None
    dealt: bool = False  # the source is dealt to the ranks by piece (dealing.py)


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

    def encode(self, records: list[Record], *, offsets: bool | None = None
               ) -> list[tuple[list[int], list[tuple[int, int]] | None, str]]:
        """(content ids, offsets or None, text) of each record; empty documents give no ids. ``offsets``
        False: no character offsets (counting tokens needs none)."""
        want_offsets = self.offsets if offsets is None else offsets and self.offsets
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
            enc = self.tok(texts, add_special_tokens=False, return_offsets_mapping=want_offsets, truncation=False,
                           verbose=False)
            for k, j in enumerate(where):
                offs = enc["offset_mapping"][k] if want_offsets else None
                out[j] = (enc["input_ids"][k], offs, texts[k])
        return out

    def window_text(self, ids: list[int], offsets: Any, text: str | None, a: int, b: int) -> str:
        if offsets is not None and text is not None:
            return text[offsets[a][0] : offsets[b - 1][1]]
        return self.tok.decode(ids[a:b])


def stream_windows(plan: CorpusPlan, tok: Any, text_column: str, *, resume: dict[str, int] | None,
                   budget: Budget | None = None, rank: int = 0, world: int = 1, all_gather: Gather | None = None,
                   end: BudgetEnd | None = None, round_size: int | None = None) -> Iterator[Window]:
    """Windows of the source's documents in order, from where ``resume`` says, until the budget is spent.

    One process (``world`` 1): every window, until ``budget`` (default: ``plan.max_tokens``) is spent.

    Rank ``rank`` of ``world``: the windows of the rank's own documents (``document % world == rank``), in
    source order, from the rank's writer progress ``resume``. Without ``plan.max_tokens`` they run to the
    source's end and nothing is exchanged. With it, the windows end where a single process's would, cut the
    same way: give ``end`` (from :func:`plan_budget`) or ``all_gather`` to plan while extracting (a
    collective: every rank iterates its stream to the end, a rank with nothing left to store included, and
    the gather's group is used by nothing else meanwhile). ``round_size`` (default ``64 * world``, the same
    on every rank): consecutive documents planned together. ``budget`` is for one process only: the budget
    of many ranks is the whole job's, and each rank's progress records what it needs to resume
    (:func:`progress_after`).

    >>> ws = stream_windows(plan, tok, "text", resume=None, rank=1, world=4, all_gather=gather)  # doctest: +SKIP
    """
    if world == 1 and end is None:
        yield from _single_windows(plan, tok, text_column, resume=resume,
                                   budget=Budget(plan.max_tokens) if budget is None else budget)
        return
    check_share(rank, world)
    if budget is not None:
        raise ValueError("budget is for one process; a multi-rank extraction plans plan.max_tokens over all ranks")
    if plan.source.dealt_files() is not None:
        if all_gather is None or end is not None:
            raise ValueError("a source dealt by piece plans with the other ranks while extracting: pass all_gather")
        pieces = share_pieces(plan.source, rank=rank, world=world, all_gather=all_gather)
        yield from _dealt_windows(plan, tok, text_column, pieces, resume=resume, rank=rank, world=world,
                                  all_gather=all_gather)
        return
    round_size = round_size or TOKENIZE_CHUNK * world
    position = Position.from_progress(resume)
    doc_tok = _DocumentTokenizer(tok, text_column, plan.vocab_size)
    if end is not None and end.limit != plan.max_tokens:
        raise ValueError(f"end was planned for {end.limit} tokens, plan.max_tokens is {plan.max_tokens}")
    if plan.max_tokens is None or end is not None:
        rounds = unplanned_rounds(_OwnDocuments(plan, doc_tok, position.document, rank, world), position.document,
                                  round_size, None if end is None else end.cutoff)
    else:
        if all_gather is None:
            raise ValueError("many ranks with a budget need all_gather (to plan while extracting) or end "
                             "(from plan_budget)")
        start = exchange_positions(all_gather, position, world=world, limit=plan.max_tokens)
        if start.cutoff is not None:  # recorded by an earlier run for this budget: nothing to plan
            rounds = unplanned_rounds(_OwnDocuments(plan, doc_tok, position.document, rank, world),
                                      position.document, round_size, start.cutoff)
        else:
            # the planner tokenizes on its own thread, with its own copy of the tokenizer (a fast tokenizer is
            # not to be used from two threads at once)
            planner_tok = _DocumentTokenizer(copy.deepcopy(tok), text_column, plan.vocab_size)
            rounds = ahead(lambda: plan_rounds(
                lambda first: _OwnDocuments(plan, planner_tok, first, rank, world), rank=rank, world=world,
                limit=plan.max_tokens, context_len=plan.context_len, all_gather=all_gather, start=start,
                round_size=round_size))
    per_window = plan.affixes.content_per_window(plan.context_len)
    here = (position.document, position.window)
    try:
        for rnd in rounds:
            for d, before, (_r, ids, offsets, text) in rnd.documents:
                for w, (a, b) in enumerate(windows(len(ids), per_window)):
                    if (d, w) < here:  # stored by an earlier run
                        continue
                    input_ids = plan.affixes.wrap(ids[a:b])
                    n = len(input_ids) if rnd.cutoff is None else rnd.cutoff.keep(d, w, len(input_ids))
                    if n == 0:
                        return
                    input_ids, b = _cut(plan.affixes, input_ids, a, b, n)
                    yield Window(d, w, a, input_ids, doc_tok.window_text(ids, offsets, text, a, b) if b > a else "",
                                 ranked=True, tokens_before=before, cutoff=rnd.cutoff)
    finally:
        rounds.close()  # a planner thread stops with its stream


def exchanges(plan: CorpusPlan, world: int) -> bool:
    """Whether the ranks' streams exchange with each other (then a rank whose part is finished still runs its
    stream to the end, or the others would wait for it): under a budget, or with a source dealt by piece."""
    return world > 1 and (plan.max_tokens is not None or plan.source.dealt_files() is not None)


def _dealt_windows(plan: CorpusPlan, tok: Any, text_column: str, pieces: list[Piece], *,
                   resume: dict[str, int] | None, rank: int, world: int, all_gather: Gather) -> Iterator[Window]:
    """Rank ``rank``'s windows of a source dealt by piece (:mod:`.dealing`): the windows of its own pieces, in
    source order, from its progress ``resume`` on, until the source or the job's budget ends."""
    position = Position.from_progress(resume)
    here = (position.document, position.window)
    doc_tok = _DocumentTokenizer(tok, text_column, plan.vocab_size)
    per_window = plan.affixes.content_per_window(plan.context_len)
    # the planner counts on its own thread, with its own copy of the tokenizer
    counter = _PieceCounter(plan, _DocumentTokenizer(copy.deepcopy(tok), text_column, plan.vocab_size))
    placed = ahead(lambda: deal_pieces(pieces, rank=rank, world=world, limit=plan.max_tokens,
                                       context_len=plan.context_len, all_gather=all_gather, count=counter.count,
                                       progress=resume))
    try:
        for p in placed:
            kept = counter.kept.pop(p.piece.number, None)  # the bytes the planner read, when few enough
            if p.first_document + p.rows <= position.document:
                continue  # stored by an earlier run: not read again
            records = plan.source.piece_records(p.piece, p.first_document,
                                                skip=max(0, position.document - p.first_document),
                                                opener=None if kept is None else kept.replay(plan.source.open).open)
            for doc in _encoded(records, doc_tok):
                if _stop_at_cut(doc, p):
                    return
                yield from _doc_windows(plan, doc_tok, doc, per_window, here, p)
    finally:
        placed.close()  # the planner thread stops with its stream


def _encoded(records: Iterator[Record], doc_tok: _DocumentTokenizer, *, offsets: bool | None = None
             ) -> Iterator[tuple[Record, Any, Any, Any]]:
    """(record, content ids, offsets, text) of each record, tokenized a chunk at a time (``offsets`` False: no
    character offsets, for counting)."""
    while True:
        chunk = [r for _, r in zip(range(TOKENIZE_CHUNK), records, strict=False)]
        if not chunk:
            return
        for r, (ids, offs, text) in zip(chunk, doc_tok.encode(chunk, offsets=offsets), strict=True):
            yield r, ids, offs, text


def _stop_at_cut(doc: tuple[Record, Any, Any, Any], p: Placed) -> bool:
    return p.cutoff is not None and doc[0].index > p.cutoff.document


def _doc_windows(plan: CorpusPlan, doc_tok: _DocumentTokenizer, doc: tuple[Record, Any, Any, Any], per_window: int,
                 here: tuple[int, int], p: Placed) -> Iterator[Window]:
    r, ids, offsets, text = doc
    for w, (a, b) in enumerate(windows(len(ids), per_window)):
        if (r.index, w) < here:  # stored by an earlier run
            continue
        input_ids = plan.affixes.wrap(ids[a:b])
        n = len(input_ids) if p.cutoff is None else p.cutoff.keep(r.index, w, len(input_ids))
        if n == 0:
            return
        input_ids, b = _cut(plan.affixes, input_ids, a, b, n)
        yield Window(r.index, w, a, input_ids, doc_tok.window_text(ids, offsets, text, a, b) if b > a else "",
                     ranked=True, cutoff=p.cutoff, dealt=True)


class _PieceCounter:
    """Counts one of a rank's pieces for the plan: its records, and the stored tokens of each when asked. The
    bytes it reads of a piece are kept (``kept``, by piece number) when they are at most ``KEEP_BYTES``: the
    extraction then reads them from memory instead of from the file again."""

    def __init__(self, plan: CorpusPlan, doc_tok: _DocumentTokenizer):
        self._plan = plan
        self._doc_tok = doc_tok
        self._per_window = plan.affixes.content_per_window(plan.context_len)
        self._n_affixes = len(plan.affixes)
        self.kept: dict[int, Recorder] = {}

    def count(self, piece: Piece, tokens: bool) -> tuple[int, list[int] | None]:
        rec = Recorder(self._plan.source.open, limit=KEEP_BYTES)
        if not tokens:
            n = _drain(self._plan.source.piece_records(piece, 0, skip=NONE_WANTED, opener=rec.open))
            counts = None
        else:
            records = self._plan.source.piece_records(piece, 0, opener=rec.open)
            counts = [stored_tokens(len(ids), self._per_window, self._n_affixes)
                      for _r, ids, _o, _t in _encoded(records, self._doc_tok, offsets=False)]
            n = len(counts)
        if not rec.overflow and rec.size:
            self.kept[piece.number] = rec
        return n, counts


def _drain(records: Any) -> int:
    """Run a piece's reader to its end: what it returns (its count of records)."""
    while True:
        try:
            next(records)
        except StopIteration as stop:
            return stop.value


def plan_budget(plan: CorpusPlan, tok: Any, text_column: str, *, rank: int, world: int, all_gather: Gather,
                resume: dict[str, int] | None = None, round_size: int | None = None) -> BudgetEnd:
    """Where ``plan.max_tokens`` (which must be set) ends over all ranks, counted before extracting: a
    collective (every rank calls it, with the same arguments but ``rank`` and ``resume``, its writer's
    progress).

    Each rank reads and tokenizes its own documents only, a round at a time, keeping their token counts
    alone. Returns the end, the same on every rank: pass it to :func:`stream_windows` as ``end``. A cutoff
    that a rank's progress records for this budget is returned after one exchange, without reading
    anything. Planning while extracting (``stream_windows(..., all_gather=...)``) tokenizes each document
    once instead of twice.

    >>> end = plan_budget(plan, tok, "text", rank=rank, world=world, all_gather=gather)  # doctest: +SKIP
    >>> windows = stream_windows(plan, tok, "text", resume=None, rank=rank, world=world, end=end)  # doctest: +SKIP
    """
    check_share(rank, world)
    if plan.source.dealt_files() is not None:
        raise ValueError("a source dealt by piece plans while extracting: call stream_windows with all_gather")
    if plan.max_tokens is None:
        raise ValueError("plan_budget needs plan.max_tokens; without a budget every rank streams to the source's end")
    start = exchange_positions(all_gather, Position.from_progress(resume), world=world, limit=plan.max_tokens)
    if start.cutoff is not None:
        return BudgetEnd(plan.max_tokens, start.cutoff)
    doc_tok = _DocumentTokenizer(tok, text_column, plan.vocab_size)
    cutoff = None
    for rnd in plan_rounds(lambda first: _OwnDocuments(plan, doc_tok, first, rank, world, keep=False), rank=rank,
                           world=world, limit=plan.max_tokens, context_len=plan.context_len, all_gather=all_gather,
                           start=start, round_size=round_size or TOKENIZE_CHUNK * world):
        cutoff = rnd.cutoff
    return BudgetEnd(plan.max_tokens, cutoff)


def _single_windows(plan: CorpusPlan, tok: Any, text_column: str, *, resume: dict[str, int] | None,
                    budget: Budget) -> Iterator[Window]:
    """One process: every document in order, until the budget is spent."""
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
                if n == 0:
                    return
                input_ids, b = _cut(plan.affixes, input_ids, a, b, n)
                yield Window(r.index, w, a, input_ids, doc_tok.window_text(ids, offsets, text, a, b) if b > a else "")
                if budget.spent:
                    return


def _cut(affixes: Affixes, input_ids: list[int], a: int, b: int, n: int) -> tuple[list[int], int]:
    """A window's ids kept to their first ``n``, and where its content then ends (a budget cuts the last one)."""
    if n < len(input_ids):
        return input_ids[:n], min(b, a + max(0, n - len(affixes.prefix)))
    return input_ids, b


class _OwnDocuments:
    """A rank's own documents from document ``first`` on, read and tokenized a round at a time
    (:class:`.ranks.Documents`); ``keep`` False: token counts only."""

    def __init__(self, plan: CorpusPlan, doc_tok: _DocumentTokenizer, first: int, rank: int, world: int, *,
                 keep: bool = True):
        self._records = plan.source.records(first, rank=rank, world=world)
        self._next: Record | None = None
        self._doc_tok = doc_tok
        self._keep = keep
        self._per_window = plan.affixes.content_per_window(plan.context_len)
        self._n_affixes = len(plan.affixes)
        self.done = False

    def take(self, end: int) -> list[tuple[int, int, Any]]:
        chunk: list[Record] = []
        while not self.done:
            if self._next is None:
                self._next = next(self._records, None)
                if self._next is None:
                    self.done = True
                    break
            if self._next.index >= end:
                break
            chunk.append(self._next)
            self._next = None
        if not chunk:
            return []
        encoded = self._doc_tok.encode(chunk, offsets=self._keep)
        return [(r.index, stored_tokens(len(ids), self._per_window, self._n_affixes),
                 (r, ids, offsets, text) if self._keep else None)
                for r, (ids, offsets, text) in zip(chunk, encoded, strict=True)]


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
    """Where the stream stands after ``batch``: the next window to run; for one rank of many, also what a plan
    needs to resume it (:func:`.ranks.progress_record`), with or without a budget (a resumed run may set one)."""
    last = batch[-1]
    if not last.ranked:
        return {"document": last.document, "window": last.index + 1}
    return progress_record(last.document, last.index + 1, tokens_before=last.tokens_before,
                           last_tokens=len(last.input_ids), cutoff=last.cutoff, dealt=last.dealt)


def describe_context(context_len: int, limit: int | None) -> None:
    if limit is not None and context_len > limit:
        raise ExtractionError(f"--context-len {context_len} is longer than the model's limit of {limit} tokens; "
                              f"pass --context-len {limit} or less")
