"""Context windows and token budgets: how documents become rows, as pure arithmetic.

A document's content tokens (its token ids without special tokens) are cut into consecutive
windows. Each window becomes one sequence of at most ``context_len`` tokens: the tokenizer's
special tokens (a BOS prefix, for instance) are added to every window, within the
``context_len`` tokens, so that every window starts as a normal sequence does. All windows of a
document hold the same number of content tokens except its last, so batches need almost no
padding. A token budget stops the stream at exactly N stored tokens, cutting the last window.

Where a budget ends follows from each document's stored-token count alone (every window but a
document's last stores exactly ``context_len`` tokens), which is how ranks that each read a
share of the documents agree on it (:class:`Cutoff`, :mod:`.ranks`).

>>> windows(10, 4)
[(0, 4), (4, 8), (8, 10)]
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import ExtractionError


def windows(n_content: int, per_window: int) -> list[tuple[int, int]]:
    """(start, end) content-token ranges of consecutive windows covering ``n_content`` tokens."""
    if per_window < 1:
        raise ValueError(f"per_window must be >= 1, got {per_window}")
    return [(a, min(a + per_window, n_content)) for a in range(0, n_content, per_window)]


@dataclass(frozen=True)
class Affixes:
    """The special tokens a tokenizer puts around a sequence (e.g. BOS before; CLS and SEP around)."""

    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.prefix) + len(self.suffix)

    def wrap(self, content: list[int]) -> list[int]:
        return [*self.prefix, *content, *self.suffix]

    def content_per_window(self, context_len: int) -> int:
        n = context_len - len(self)
        if n < 1:
            raise ExtractionError(
                f"--context-len {context_len} leaves no room for content: the tokenizer adds {len(self)} special "
                "token(s) to every window; raise --context-len or pass --no-special-tokens")
        return n


def affixes_of(tok, *, special_tokens: bool) -> Affixes:
    """The tokenizer's special tokens around a sequence, read off by encoding a probe text both ways."""
    if not special_tokens:
        return Affixes()
    probe = "lmprobe probe text"
    plain = tok(probe, add_special_tokens=False)["input_ids"]
    full = tok(probe, add_special_tokens=True)["input_ids"]
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return Affixes(tuple(full[:i]), tuple(full[i + len(plain) :]))
    raise ExtractionError("cannot tell which special tokens this tokenizer adds around a text; "
                          "pass --no-special-tokens to add none")


@dataclass
class Budget:
    """At most ``limit`` stored tokens (None: no limit); ``used`` counts those already stored."""

    limit: int | None
    used: int = 0

    @property
    def left(self) -> int | None:
        return None if self.limit is None else self.limit - self.used

    @property
    def spent(self) -> bool:
        return self.limit is not None and self.used >= self.limit

    def take(self, n: int) -> int:
        """How many of ``n`` tokens fit (all of them without a limit), and count them as stored."""
        k = n if self.limit is None else max(0, min(n, self.limit - self.used))
        self.used += k
        return k


def stored_tokens(n_content: int, per_window: int, n_affixes: int) -> int:
    """Tokens a document of ``n_content`` content tokens stores: its content plus each window's special tokens
    (``n_affixes`` of them, ``per_window`` content tokens a window). An empty document stores none.

    >>> stored_tokens(10, 4, 1)  # windows of BOS + 4, BOS + 4, BOS + 2
    13
    """
    return n_content + -(-n_content // per_window) * n_affixes


@dataclass(frozen=True)
class Cutoff:
    """Where a budget of ``limit`` stored tokens ends in a source: the last window stored is window ``window``
    of document ``document``, cut to its first ``tokens`` stored tokens (all of them when the budget ends
    with that window). Every window before it in source order is stored whole; none after it is stored."""

    document: int
    window: int
    tokens: int
    limit: int

    def keep(self, document: int, window: int, n: int) -> int:
        """How many of the ``n`` stored tokens of window ``window`` of ``document`` the budget keeps.

        >>> c = Cutoff(document=3, window=1, tokens=2, limit=40)
        >>> c.keep(2, 5, 8), c.keep(3, 1, 8), c.keep(3, 2, 8), c.keep(4, 0, 8)
        (8, 2, 0, 0)
        """
        at, end = (document, window), (self.document, self.window)
        if at < end:
            return n
        return min(n, self.tokens) if at == end else 0


def find_cutoff(counts: Iterable[tuple[int, int]], *, used: int, limit: int, context_len: int
                ) -> tuple[Cutoff | None, int]:
    """Where a budget of ``limit`` stored tokens ends among documents given in source order as ``(document,
    stored tokens)`` (see :func:`stored_tokens`), ``used`` tokens being stored before the first of them.

    Returns ``(cutoff, tokens stored before the cutoff's document)`` when the budget ends in one of them, else
    ``(None, tokens stored after them all)``. Every window of a document but its last stores exactly
    ``context_len`` tokens, so the window where the budget ends, and how much of it is kept, follow from
    the tokens left at the document's start: the windows are those a single process stores.

    >>> find_cutoff([(0, 13), (1, 0), (2, 13)], used=0, limit=20, context_len=5)
    (Cutoff(document=2, window=1, tokens=2, limit=20), 13)
    >>> find_cutoff([(0, 13)], used=0, limit=20, context_len=5)
    (None, 13)
    """
    for document, n in counts:
        if used + n >= limit:
            left = limit - used  # >= 1: the budget was not reached before this document
            w = (left - 1) // context_len
            return Cutoff(document, w, left - w * context_len, limit), used
        used += n
    return None, used
