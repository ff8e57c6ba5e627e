"""Sources of many files dealt to ranks by piece: which rank reads which file, and where its documents stand.

A source of many files (a folder, a Hub dataset of many data files) is cut into pieces
(:meth:`.sources.Source.pieces`): a whole file, or one row group of a parquet file, in source
order. Piece ``p`` is rank ``p % world``'s, so a rank opens and reads only its own files: about
``1/world`` of the bytes, where dealing records one by one (:func:`.sources.owner`) has every rank
read every file.

The documents keep their order and numbers: document ``i`` is still the ``i``-th record of the whole
source, as one process reads it, so the stored dataset is the one a single process stores. What a
rank cannot know alone is where its pieces start: a parquet piece's records are counted in the
footers (:func:`share_pieces`: each rank reads the footers of its share of the files, a few KiB a
file, and the ranks exchange the row groups), another file's only by reading it. The ranks
therefore go through the pieces in rounds of ``world`` pieces, one a rank, and exchange what they
counted (one ``all_gather`` a round): the records of each piece that no footer counts, and under a
token budget the tokens each piece stores. From them every rank computes the same first document of
every piece and, under a budget, the same running total and, in the piece where it reaches
``--max-tokens``, the same :class:`~.windows.Cutoff` (the owner of that piece computes it from its
documents' counts and sends it in a second exchange). Nothing is exchanged when every piece is a
parquet row group and there is no budget.

Counting a piece means reading it, and the planner does so a round or two ahead of the extraction
(:func:`.ranks.ahead`), which then reads the piece again: the planner keeps the bytes it read of a
piece (up to ``corpus.KEEP_BYTES``, :mod:`lmprobe.base.replay`) and the extraction reads them from
memory, so a rank reads its own bytes once; a larger piece is read twice. The planner keeps one
token count per document of its current piece, not the documents.

At full size (W1 of docs/publishing.md: 64 ranks; say a corpus of 1,000 parquet files of 10 row groups):
a rank reads 16 footers (16 KiB each) and its 157 row groups; the ranks exchange once the
10,000 row counts (a JSON list of about 200 KB), then two small objects a rank every round of 64
pieces (157 rounds, 314 exchanges in all); a planner holds one count per document of the piece it
counts and at most ``AHEAD + 2`` pieces' bytes (``corpus.KEEP_BYTES`` each, 256 MiB). The ranks go
through the rounds together, a planner at most ``AHEAD`` pieces ahead of its extraction, so a job's
pace is that of the rank with the largest pieces: pieces of even sizes balance best.

Resuming: a rank's progress (:func:`.ranks.progress_record` with ``dealt``) records the next window
to run and the budget's end once known. A resumed job plans again from the first piece (the
counts are the same when the source is), skips what each rank stored, and refuses, on every rank
with one message, a part whose last stored window the new plan does not keep as it is (another
``--max-tokens``) or a part made with records dealt one by one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ExtractionError
from .pieces import Piece, build_pieces
from .ranks import (
    DEALT_KEY,
    Gather,
    Position,
    describe_failure,
    gather_checked,
    raise_from_others,
)
from .sources import Source
from .windows import Cutoff, find_cutoff

#: ``count(piece, tokens)``: the records of one of the rank's pieces, and with ``tokens`` the stored tokens of
#: each of them, in order (None without).
Count = Callable[[Piece, bool], tuple[int, list[int] | None]]


@dataclass(frozen=True)
class Placed:
    """One of a rank's pieces, placed in the whole source: its first document, its count of records, and the
    budget's end when it is known (it lies in this piece, or an earlier run recorded it)."""

    piece: Piece
    first_document: int
    rows: int
    cutoff: Cutoff | None


def share_pieces(source: Source, *, rank: int, world: int, all_gather: Gather) -> list[Piece]:
    """The source's pieces, the same on every rank, each rank reading the footers of only its share of the
    files (file ``k`` is read by rank ``k % world``) and the ranks exchanging the row groups they found: a
    collective. With 1,000 parquet files and 64 ranks, a rank reads 16 footers, not 1,000."""
    files = source.dealt_files()
    assert files is not None, "a source dealt by piece"
    try:
        sizes = source.file_sizes()
        mine = {str(k): source.file_layout(k) for k in range(rank, len(files), world)}
    except Exception as exc:
        gather_checked(all_gather, {"error": describe_failure(exc)}, world)  # the others stop with it
        raise
    gathered = gather_checked(all_gather, {"sizes": sizes, "layouts": mine}, world)
    raise_from_others(gathered)
    for other, g in enumerate(gathered):
        if g["sizes"] != sizes:
            raise ExtractionError(f"rank {other} sees other files than rank {rank} in {source.description} (another "
                                  "copy, or a revision committed meanwhile): every rank must read the same files, of "
                                  "the same sizes")
    layouts: list[Any] = [None] * len(files)
    for g in gathered:
        for k, layout in g["layouts"].items():
            layouts[int(k)] = layout
    return build_pieces(layouts, sizes)


def owner_of_piece(piece: int, world: int) -> int:
    """The rank that reads piece ``piece``.

    >>> [owner_of_piece(p, 3) for p in range(5)]
    [0, 1, 2, 0, 1]
    """
    return piece % world


def pieces_digest(pieces: Sequence[Piece]) -> str:
    """What every rank must agree on before dealing: the same pieces (files, row groups, their sizes)."""
    text = json.dumps([[p.file, p.row_group, p.rows, p.nbytes] for p in pieces])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def starting_dealt(progress: Mapping[str, int] | None, pieces: Sequence[Piece]) -> dict[str, Any]:
    """What a rank sends in the first exchange of a dealt plan: its position, how its part was dealt, and the
    pieces it sees."""
    return {"position": Position.from_progress(progress).to_json(),
            "dealt": None if not progress else DEALT_KEY in progress, "pieces": pieces_digest(pieces)}


def check_started(gathered: list[Mapping[str, Any]], limit: int | None) -> tuple[list[Position], Cutoff | None]:
    """Every rank's position, and the budget's end recorded for ``limit`` (a pure function: every rank raises
    the same error or computes the same result)."""
    for rank, g in enumerate(gathered):
        if g["pieces"] != gathered[0]["pieces"]:
            raise ExtractionError(f"rank {rank} sees other files than rank 0 in the source (another copy, or a "
                                  "revision committed meanwhile): every rank must read the same files, of the same "
                                  "sizes")
    for rank, g in enumerate(gathered):
        if g["dealt"] is False:
            raise ExtractionError(f"rank {rank}'s partial part was written with documents dealt one by one to the "
                                  "ranks (an earlier lmprobe); this source of many files is now dealt to the ranks by "
                                  "file: pass --overwrite to start over")
    positions = [Position.from_json(g["position"]) for g in gathered]
    if limit is None:
        return positions, None
    recorded = {p.cutoff for p in positions if p.cutoff is not None and p.cutoff.limit == limit}
    if len(recorded) > 1:
        raise ExtractionError(f"the ranks' partial parts record different ends of --max-tokens {limit:,}: the "
                              "source changed since they were written; pass --overwrite to start over")
    return positions, (recorded.pop() if recorded else None)


def deal_pieces(pieces: Sequence[Piece], *, rank: int, world: int, limit: int | None, context_len: int,
                all_gather: Gather, count: Count, progress: Mapping[str, int] | None) -> Iterator[Placed]:
    """Rank ``rank``'s pieces, placed, in source order, until the source or the budget of ``limit`` stored
    tokens ends. A collective: every rank runs it with the same ``pieces``, ``world``, ``limit`` and
    ``context_len``; ``count`` counts one of the rank's own pieces; ``progress`` is the rank's writer progress.
    The last piece yielded holds the cutoff when the budget ends before the source does.
    """
    start = gather_checked(all_gather, starting_dealt(progress, pieces), world)
    positions, recorded = check_started(start, limit)
    plan_tokens = limit is not None and recorded is None
    exchanging = plan_tokens or any(p.rows is None for p in pieces)
    document, used = 0, 0  # the first document of the round's first piece; the tokens stored before it
    finished = False
    try:
        for lo in range(0, len(pieces), world):
            group = pieces[lo : lo + world]  # piece lo + k is rank k's (owner_of_piece)
            mine = group[rank] if rank < len(group) else None
            counts: list[int] | None = None
            if exchanging:
                try:
                    payload: dict[str, Any] = {}
                    if mine is not None:
                        rows, counts = count(mine, plan_tokens)
                        payload = {"rows": rows, "tokens": None if counts is None else sum(counts)}
                except Exception as exc:
                    gather_checked(all_gather, {"error": describe_failure(exc)}, world)  # the others stop with it
                    raise
                gathered = gather_checked(all_gather, payload, world)
                raise_from_others(gathered)
            firsts, rows_of, cut_at = [], [], None
            for k, piece in enumerate(group):
                n = piece.rows if piece.rows is not None else gathered[k]["rows"]
                firsts.append(document)
                rows_of.append(n)
                if plan_tokens and cut_at is None:
                    tokens = gathered[k]["tokens"]
                    if used + tokens >= limit:
                        cut_at = k  # the budget ends in this piece
                    else:
                        used += tokens
                document += n
            cutoff = recorded
            if plan_tokens:
                try:
                    cutoff, problem = _round_end(group, rank, cut_at, firsts, used, counts, positions[rank], limit,
                                                 context_len)
                    end = {"cutoff": cutoff and [cutoff.document, cutoff.window, cutoff.tokens, cutoff.limit],
                           "problem": problem}
                except Exception as exc:
                    gather_checked(all_gather, {"error": describe_failure(exc)}, world)  # the others stop with it
                    raise
                ends = gather_checked(all_gather, end, world)
                raise_from_others(ends)
                cutoff = next((Cutoff(*e["cutoff"]) for e in ends if e["cutoff"] is not None), None)
                problems = [e["problem"] for e in ends if e["problem"] is not None]
                if problems:
                    raise ExtractionError(problems[0])
                if cutoff is not None:
                    _check_past(positions, cutoff)
            last = lo + world >= len(pieces) or (cutoff is not None and cutoff.document < document)
            if last:
                finished = True
                _check_ends(positions, document)
            if mine is not None:
                k = rank
                ends_here = cutoff is not None and firsts[k] <= cutoff.document
                if cutoff is None or ends_here:
                    yield Placed(mine, firsts[k], rows_of[k], cutoff)
            if last:
                return
    except GeneratorExit:
        if exchanging and not finished:  # this rank's extraction stopped: the others would wait for its counts
            gather_checked(all_gather, {"stop": True}, world)
        raise


def _round_end(group: Sequence[Piece], rank: int, cut_at: int | None, firsts: list[int], used: int,
               counts: list[int] | None, position: Position, limit: int, context_len: int
               ) -> tuple[Cutoff | None, str | None]:
    """This rank's part of a round's end: the cutoff when the budget ends in its piece, and what is wrong with
    its own stored windows under the plan (its position lies in its own pieces, whose counts only it has)."""
    if rank >= len(group):
        return None, None
    assert counts is not None
    first = firsts[rank]
    cutoff = None
    if cut_at == rank:
        cutoff, _ = find_cutoff(((first + j, n) for j, n in enumerate(counts)), used=used, limit=limit,
                                context_len=context_len)
    d, w = position.document, position.window - 1  # the rank's last stored window
    if position.window < 1 or not first <= d < first + len(counts):
        return cutoff, None
    if cut_at is not None and cut_at < rank:
        return cutoff, None  # past the budget: every rank says so (_check_past)
    full = min(context_len, counts[d - first] - w * context_len)
    if full < 1:
        return cutoff, (f"the source changed since rank {rank}'s part was written (document {d} has no window {w} "
                        "now); pass --overwrite to start over")
    kept = full if cutoff is None else cutoff.keep(d, w, full)
    if kept and position.last_tokens is not None and position.last_tokens != kept:
        return cutoff, (f"rank {rank}'s part ends with window {w} of document {d} cut to {position.last_tokens} "
                        f"tokens by another --max-tokens (--max-tokens {limit:,} keeps {kept}): pass the "
                        "--max-tokens it was started with to finish it, or --overwrite to start over")
    return cutoff, None


def _check_past(positions: list[Position], cutoff: Cutoff) -> None:
    for rank, p in enumerate(positions):
        if p.window >= 1 and (p.document, p.window - 1) > (cutoff.document, cutoff.window):
            raise ExtractionError(f"the partial output holds windows past the end of --max-tokens {cutoff.limit:,} "
                                  f"(rank {rank} stored document {p.document}; the budget ends in document "
                                  f"{cutoff.document}): pass the --max-tokens it was started with to finish it, "
                                  "or --overwrite to start over")


def _check_ends(positions: list[Position], documents: int) -> None:
    for rank, p in enumerate(positions):
        if p.window >= 1 and p.document >= documents:
            raise ExtractionError(f"the source changed since rank {rank}'s part was written (it holds document "
                                  f"{p.document}, which the source no longer has); pass --overwrite to start over")
