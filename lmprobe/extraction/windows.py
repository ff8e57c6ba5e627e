"""Context windows and token budgets: how documents become rows, as pure arithmetic.

A document's content tokens (its token ids without special tokens) are cut into consecutive
windows. Each window becomes one sequence of at most ``context_len`` tokens: the tokenizer's
special tokens (a BOS prefix, for instance) are added to every window, within the
``context_len`` tokens, so that every window starts as a normal sequence does. All windows of a
document hold the same number of content tokens except its last, so batches need almost no
padding. A token budget stops the stream at exactly N stored tokens, cutting the last window.

>>> windows(10, 4)
[(0, 4), (4, 8), (8, 10)]
"""

from __future__ import annotations

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
