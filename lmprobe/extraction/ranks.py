"""One token budget over many ranks: how ranks that each read a share of a corpus agree where it ends.

A single process stores windows in source order until exactly ``max_tokens`` stored tokens
(:mod:`.windows`). When ``world`` ranks share a source, record ``i`` is rank ``i % world``'s
(:mod:`.sources`) and no rank sees the documents before its own, so none can tell alone where the
budget ends. The ranks plan in rounds: a round is ``round_size`` consecutive documents of the
source; each rank reads and tokenizes its own documents of the round, and the ranks exchange how
many tokens each of them stores (one ``all_gather`` of a list of counts a round). From the
counts every rank computes the same running total and, in the round where it reaches the
budget, the same :class:`~.windows.Cutoff`: the document, the window in it and how many of that
window's tokens are kept. Each rank then stores exactly its own windows before the cutoff, so
together the ranks store the windows a single process stores, cut the same way. The planner
keeps only the counts of one round; the token ids of a rank's own documents go on to its
extraction, which runs while the planner works ahead (:func:`ahead`), so a document is tokenized
once. Without a budget no round is exchanged.

Resuming. A rank's writer records, with every checkpoint, where the rank stands
(:func:`progress_record`): the next window to run (``document``, ``window``), the stored tokens
of the rank's last window (``last_tokens``, with or without a budget: a resumed run may set
one), and under a budget the tokens the whole job stores before that document
(``tokens_before``) and, once known, the cutoff (``cut_document``, ``cut_window``,
``cut_tokens``, ``cut_limit``). A resumed job first exchanges every rank's position
(:func:`start_plan`): a cutoff recorded for the same budget is taken as it is and nothing more
is exchanged; otherwise planning restarts at the lowest document any rank stands at, from the
tokens recorded before it, and every rank's stored windows are checked against the new plan
(another budget, a changed source: one error, the same on every rank).

Errors. A rank that cannot read or tokenize its documents sends its error in the round's
exchange instead of its counts, and every rank raises it: a bad record stops the whole job with
one message naming it. A rank whose extraction stops early tells the others in the next round
(they raise an :class:`~lmprobe.errors.ExtractionError` rather than wait for it forever).

``all_gather`` is any callable that returns every rank's object, by rank, and that every rank
calls in the same order; the objects are small JSON values (dicts, lists, ints, strings, None).
With ``torchrun``: ``torch.distributed.all_gather_object`` over a gloo group that nothing else
uses while the planner runs (it runs on a thread of its own).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from ..errors import ExtractionError, LmprobeError, PromptError
from .sources import first_owned
from .windows import Cutoff, find_cutoff

T = TypeVar("T")

#: ``all_gather(obj) -> [rank 0's obj, rank 1's obj, ...]``, called by every rank in the same order.
Gather = Callable[[Any], list]

#: Rounds a rank's planner may run ahead of its extraction (each holds the token ids of the rank's documents
#: of one round): enough that the ranks seldom wait for each other at an exchange.
AHEAD = 2

#: The progress keys a rank of a multi-rank extraction with a budget records besides ``document``/``window``.
PROGRESS_KEYS = ("tokens_before", "last_tokens", "cut_document", "cut_window", "cut_tokens", "cut_limit")
#: The progress key of a rank whose source is dealt by piece (:mod:`.dealing`), not record by record.
DEALT_KEY = "pieces"


class Documents(Protocol[T]):
    """A rank's own documents, read on demand in source order."""

    done: bool  # no document is left

    def take(self, end: int) -> list[tuple[int, int, T]]:
        """The next documents with an index below ``end``: ``(index, stored tokens, payload)`` each."""


@dataclass(frozen=True)
class BudgetEnd:
    """Where a budget of ``limit`` stored tokens ends over all ranks: at ``cutoff``, or (None) with the source,
    which it holds whole."""

    limit: int
    cutoff: Cutoff | None


@dataclass(frozen=True)
class Round(Generic[T]):
    """What a rank extracts of one round: its own documents ``(index, tokens_before, payload)``, where
    ``tokens_before`` is what the whole job stores before the document (None when no plan was made), and
    the cutoff when it is known (the budget ends in this round, or it was recorded by an earlier run)."""

    documents: list[tuple[int, int | None, T]]
    cutoff: Cutoff | None


@dataclass(frozen=True)
class Position:
    """Where a rank stands: the next window to run is window ``window`` of ``document``. ``tokens_before``:
    what the whole job stores before ``document`` (None: unknown); ``last_tokens``: the stored tokens of the
    rank's last stored window, window ``window - 1`` of ``document`` (None: unknown); ``cutoff``: the
    budget's end when the rank knew it."""

    document: int = 0
    window: int = 0
    tokens_before: int | None = 0
    last_tokens: int | None = None
    cutoff: Cutoff | None = None

    @classmethod
    def from_progress(cls, progress: Mapping[str, int] | None) -> Position:
        """A rank's position from its writer's progress (None: a rank that stored nothing yet)."""
        if not progress:
            return cls()
        d, w = int(progress.get("document", 0)), int(progress.get("window", 0))
        before = progress.get("tokens_before", 0 if d == 0 else None)
        cut = None
        if all(k in progress for k in PROGRESS_KEYS[2:]):
            cut = Cutoff(*(int(progress[k]) for k in PROGRESS_KEYS[2:]))
            if cut.tokens < 1 or cut.limit < 1:
                raise ExtractionError(f"the partial output's progress records an impossible end of the budget "
                                      f"({dict(progress)}); pass --overwrite to start over")
        last = progress.get("last_tokens")
        return cls(d, w, None if before is None else int(before), None if last is None else int(last), cut)

    def to_json(self) -> dict[str, Any]:
        cut = self.cutoff
        return {"document": self.document, "window": self.window, "tokens_before": self.tokens_before,
                "last_tokens": self.last_tokens,
                "cutoff": None if cut is None else [cut.document, cut.window, cut.tokens, cut.limit]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Position:
        cut = d.get("cutoff")
        return cls(d["document"], d["window"], d["tokens_before"], d["last_tokens"],
                   None if cut is None else Cutoff(*cut))


def progress_record(document: int, window: int, *, tokens_before: int | None, last_tokens: int,
                    cutoff: Cutoff | None, dealt: bool = False) -> dict[str, int]:
    """A rank's writer progress after window ``window - 1`` of ``document`` (the next one to run is
    ``window``): what :meth:`Position.from_progress` reads back. Every value is a count, as the writer wants.
    ``dealt``: the source is dealt by piece (:mod:`.dealing`), recorded as ``pieces`` 1 so that a part made
    with records dealt one by one is not resumed as if it were one.

    >>> progress_record(7, 2, tokens_before=300, last_tokens=12, cutoff=None)
    {'document': 7, 'window': 2, 'tokens_before': 300, 'last_tokens': 12}
    """
    out = {"document": document, "window": window}
    if tokens_before is not None:
        out["tokens_before"] = tokens_before
    out["last_tokens"] = last_tokens
    if cutoff is not None:
        out.update(cut_document=cutoff.document, cut_window=cutoff.window, cut_tokens=cutoff.tokens,
                   cut_limit=cutoff.limit)
    if dealt:
        out[DEALT_KEY] = 1
    return out


@dataclass(frozen=True)
class Start:
    """How a (resumed) plan starts: every rank's position, by rank, and either a cutoff recorded for this
    budget (nothing to plan) or where planning restarts: ``document``, with ``tokens_before`` stored before it."""

    positions: list[Position]
    cutoff: Cutoff | None
    document: int
    tokens_before: int


def start_plan(positions: list[Position], limit: int) -> Start:
    """Where planning starts, from every rank's position (a pure function: every rank computes the same).

    >>> start_plan([Position(40, 1, 900, 12), Position(35, 2, 870, 8)], 5000).document
    35
    """
    recorded = {p.cutoff for p in positions if p.cutoff is not None and p.cutoff.limit == limit}
    if len(recorded) > 1:
        raise ExtractionError(f"the ranks' partial parts record different ends of --max-tokens {limit:,}: the "
                              "source changed since they were written; pass --overwrite to start over")
    if recorded:
        return Start(positions, recorded.pop(), 0, 0)
    known: dict[int, int] = {0: 0}
    for rank, p in enumerate(positions):
        if p.tokens_before is None:
            continue
        if known.setdefault(p.document, p.tokens_before) != p.tokens_before:
            raise ExtractionError(f"rank {rank}'s partial part counts {p.tokens_before:,} tokens before document "
                                  f"{p.document}, another rank's {known[p.document]:,}: the source changed since "
                                  "they were written; pass --overwrite to start over")
    lowest = min(p.document if p.tokens_before is not None else 0 for p in positions)
    return Start(positions, None, lowest, known[lowest])


def merge_counts(gathered: list[Mapping[str, Any]], start: int, end: int, world: int) -> list[tuple[int, int]]:
    """Every rank's stored-token counts of its documents in ``start .. end - 1``, as ``(document, count)`` in
    source order, up to the end of the source (a pure function).

    >>> merge_counts([{"counts": [5, 7]}, {"counts": [6]}], 10, 14, 2)
    [(10, 5), (11, 6), (12, 7)]
    """
    slots: list[int | None] = [None] * (end - start)
    for rank, payload in enumerate(gathered):
        first = first_owned(start, rank, world)
        for k, n in enumerate(payload["counts"]):
            i = first + k * world - start
            if i >= len(slots):
                raise AssertionError(f"rank {rank} sent {len(payload['counts'])} counts for documents "
                                     f"{start}..{end - 1}")
            slots[i] = n
    n_present = next((i for i, n in enumerate(slots) if n is None), len(slots))
    missing_then_present = [start + i for i, n in enumerate(slots[n_present:], n_present) if n is not None]
    if missing_then_present:
        raise ExtractionError(f"document {start + n_present} is missing on rank {(start + n_present) % world} "
                              f"but rank {missing_then_present[0] % world} has document {missing_then_present[0]}: "
                              "every rank must read the same source (the same files, in the same order)")
    return [(start + i, n) for i, n in enumerate(slots[:n_present])]


class _Checks:
    """Every rank's stored windows checked against a plan made again (a resumed job whose budget changed, or
    whose ranks recorded no end): one error, the same on every rank, when a part holds what the plan does not."""

    def __init__(self, positions: list[Position], context_len: int, limit: int):
        # a rank that stored windows: its last one is window `window - 1` of `document`
        self.open = {r: p for r, p in enumerate(positions) if p.window >= 1}
        self.context_len = context_len
        self.limit = limit

    def round(self, counts: list[tuple[int, int]], before: dict[int, int], cutoff: Cutoff | None, last: bool) -> None:
        n_of = dict(counts)
        for rank, p in sorted(self.open.items()):
            d, w = p.document, p.window - 1
            if d not in n_of:
                continue
            del self.open[rank]
            if p.tokens_before is not None and before[d] != p.tokens_before:
                raise ExtractionError(f"the source changed since rank {rank}'s part was written (it counts "
                                      f"{p.tokens_before:,} tokens before document {d}, the source now "
                                      f"{before[d]:,}); pass --overwrite to start over")
            full = min(self.context_len, n_of[d] - w * self.context_len)
            if full < 1:
                raise ExtractionError(f"the source changed since rank {rank}'s part was written (document {d} "
                                      f"has no window {w} now); pass --overwrite to start over")
            kept = full if cutoff is None else cutoff.keep(d, w, full)
            if kept == 0:
                raise _past_budget(rank, d, cutoff)
            if p.last_tokens is not None and p.last_tokens != kept:
                raise ExtractionError(f"rank {rank}'s part ends with window {w} of document {d} cut to "
                                      f"{p.last_tokens} tokens by another --max-tokens (--max-tokens "
                                      f"{self.limit:,} keeps {kept}): pass the --max-tokens it was started with "
                                      "to finish it, or --overwrite to start over")
        if last:
            for rank, p in sorted(self.open.items()):
                if cutoff is not None:
                    raise _past_budget(rank, p.document, cutoff)
                raise ExtractionError(f"the source changed since rank {rank}'s part was written (it holds document "
                                      f"{p.document}, which the source no longer has); pass --overwrite to start "
                                      "over")


def _past_budget(rank: int, document: int, cutoff: Cutoff) -> ExtractionError:
    return ExtractionError(f"the partial output holds windows past the end of --max-tokens {cutoff.limit:,} (rank "
                           f"{rank} stored document {document}; the budget ends in document {cutoff.document}): "
                           "pass the --max-tokens it was started with to finish it, or --overwrite to start over")


def exchange_positions(all_gather: Gather, position: Position, *, world: int, limit: int) -> Start:
    """Every rank's position, exchanged, and where planning starts (:func:`start_plan`): the first exchange
    of a plan, a collective."""
    return start_plan([Position.from_json(x) for x in gather_checked(all_gather, position.to_json(), world)], limit)


def plan_rounds(documents: Callable[[int], Documents[T]], *, rank: int, world: int, limit: int, context_len: int,
                all_gather: Gather, start: Start, round_size: int) -> Iterator[Round[T]]:
    """The rounds of rank ``rank``'s extraction under a budget of ``limit`` stored tokens, planned with the
    other ranks from ``start`` (:func:`exchange_positions`; one that holds no cutoff). A collective: every
    rank runs it, with the same ``world``, ``limit``, ``context_len`` and ``round_size``.
    ``documents(first)`` reads the rank's own documents from document ``first`` on. The last round yielded
    holds the cutoff (or the source's end); every round before it is stored whole.
    """
    assert start.cutoff is None, "a recorded cutoff needs no plan: use unplanned_rounds"
    docs = documents(start.document)
    lo, used = start.document, start.tokens_before
    checks = _Checks(start.positions, context_len, limit)
    finished = False
    try:
        while True:
            hi = lo + round_size
            try:
                mine = docs.take(hi)
            except Exception as exc:
                gather_checked(all_gather, {"error": describe_failure(exc)}, world)  # the others stop with this rank's error
                raise
            gathered = gather_checked(all_gather, {"counts": [n for _, n, _ in mine]}, world)
            raise_from_others(gathered)
            counts = merge_counts(gathered, lo, hi, world)
            cutoff, after = find_cutoff(counts, used=used, limit=limit, context_len=context_len)
            before, total = {}, used
            for d, n in counts:
                before[d] = total
                total += n
            last = cutoff is not None or len(counts) < round_size
            checks.round(counts, before, cutoff, last)
            finished = last
            yield Round([(d, before[d], payload) for d, _, payload in mine if cutoff is None or d <= cutoff.document],
                        cutoff)
            if last:
                return
            lo, used = hi, after
    except GeneratorExit:
        if not finished:  # this rank's extraction stopped: the others would wait for its counts forever
            gather_checked(all_gather, {"stop": True}, world)
        raise


def unplanned_rounds(docs: Documents[T], start: int, round_size: int, cutoff: Cutoff | None = None
                     ) -> Iterator[Round[T]]:
    """A rank's rounds when nothing is exchanged: its documents from ``start`` to the source's end, or to
    the document of a ``cutoff`` already known (no budget, or a plan made before)."""
    lo = start
    while not docs.done and (cutoff is None or lo <= cutoff.document):
        hi = lo + round_size if cutoff is None else min(lo + round_size, cutoff.document + 1)
        mine = docs.take(hi)
        if mine:
            yield Round([(d, None, payload) for d, _, payload in mine], cutoff)
        lo = hi


def gather_checked(all_gather: Gather, payload: Any, world: int) -> list:
    """Every rank's ``payload``, by rank (an exchange's result checked for its length)."""
    got = list(all_gather(payload))
    if len(got) != world:
        raise AssertionError(f"all_gather returned {len(got)} objects for {world} ranks")
    return got


def describe_failure(exc: BaseException) -> dict[str, str]:
    """A rank's error as a small JSON value, sent to the others in an exchange (:func:`raise_from_others`)."""
    if isinstance(exc, PromptError):
        return {"kind": "prompt", "message": str(exc)}
    if isinstance(exc, LmprobeError):
        return {"kind": "lmprobe", "message": str(exc)}
    return {"kind": "bug", "message": f"{type(exc).__name__}: {str(exc)[:300]}"}


def raise_from_others(gathered: list[Mapping[str, Any]]) -> None:
    """The first other rank's error or stop, raised on this rank too."""
    for other, payload in enumerate(gathered):
        if "error" in payload:
            err = payload["error"]
            if err["kind"] == "prompt":
                raise PromptError(err["message"])
            if err["kind"] == "lmprobe":
                raise ExtractionError(f"rank {other}: {err['message']}")
            raise ExtractionError(f"rank {other} failed ({err['message']}); its log has the traceback")
        if "stop" in payload:
            raise ExtractionError(f"rank {other} stopped before the extraction ended (its log says why); every rank "
                                  "stops: run the same command again on every node to resume")


_ITEM, _DONE, _ERROR = "item", "done", "error"


def ahead(make: Callable[[], Iterator[T]], *, depth: int = AHEAD, name: str = "lmprobe-planner") -> Iterator[T]:
    """The items of ``make()``, produced on a thread of their own up to ``depth`` items ahead of the caller.

    An exception in the thread is raised here, with its traceback. Closing this iterator early closes the
    thread's iterator at its next item (a planner then tells the other ranks in its next exchange).

    >>> list(ahead(lambda: iter(range(5))))
    [0, 1, 2, 3, 4]
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: tuple) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        it = None
        try:
            it = make()
            for x in it:
                if not put((_ITEM, x)):
                    return
            put((_DONE, None))
        except BaseException as exc:  # handed to the caller, who raises it
            put((_ERROR, exc))
        finally:
            close = getattr(it, "close", None)  # at the item it stopped at, if it stopped early
            if close is not None:
                try:
                    close()
                except Exception:  # noqa: BLE001 - the caller has stopped: nobody is left to tell
                    pass

    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    try:
        while True:
            kind, x = q.get()
            if kind == _ITEM:
                yield x
            elif kind == _DONE:
                return
            else:
                raise x
    finally:
        stop.set()
