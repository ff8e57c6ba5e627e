"""One retry helper. What counts as transient is named by each caller, never guessed.

A caller states which exception classes and which HTTP status codes are worth another try
(huggingface_hub's ``http_backoff`` does the same with ``retry_on_exceptions`` and
``retry_on_status_codes``). Anything else, a ``TypeError`` from a bug included, propagates at once.

A wait is never longer than ``max_wait``, whatever a server's ``Retry-After`` asks (the try after it
may be answered sooner, and a reader must not go silent for a day), and no try starts after
``deadline`` seconds from the first: a caller states how long it is willing to wait, and its error
message can say so. ``what`` names what is waited for; a long wait is logged with it.

Rate limits (``rate_limit_status_codes``, 429 for the Hub) are the server pacing the client, not a
failure: they are waited out until the deadline however many there are, without counting against
``max_retries``. A caller may instead refuse to wait longer than it is willing to
(``longest_asked_wait``): a server asking for a day ends the call at once, and the caller names the time.
After a failure that may have taken effect (an answer lost), ``landed`` is asked
before anything is tried again, and asked again if asking fails: an operation is never repeated on
a guess (a commit made twice).

>>> policy = RetryPolicy(retry_on_exceptions=(ConnectionError,), max_retries=3, base_wait=0.5)
>>> call_with_retry(lambda: 42, policy=policy)
42
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .display import hide_credentials

logger = logging.getLogger(__name__)

#: waits at least this long are logged (shorter ones, as in a storm of 429s, would flood the log)
LOG_WAITS_FROM = 5.0

T = TypeVar("T")

#: Answers of an HTTP server that mean "try again later".
TRANSIENT_HTTP_STATUS = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    """When and how often to try again."""

    retry_on_exceptions: tuple[type[BaseException], ...] = ()
    """Exception classes (and their subclasses) that are transient."""
    retry_on_status_codes: frozenset[int] = frozenset()
    """HTTP status codes that are transient, read from ``exc.response.status_code`` of any exception."""
    never_retry: tuple[type[BaseException], ...] = ()
    """Subclasses of ``retry_on_exceptions`` that are not transient (``FileNotFoundError`` under ``OSError``)."""
    never_retry_errnos: frozenset[int] = frozenset()
    """``OSError`` numbers that are not transient (a full local disk: ``ENOSPC``)."""
    max_retries: int = 5
    """Tries after the first one."""
    base_wait: float = 1.0
    """Seconds before the first retry; doubled for each further one."""
    max_wait: float = 60.0
    """Upper bound of one wait, a server's Retry-After included (a longer one is cut to this)."""
    deadline: float | None = None
    """Seconds after the first try past which no further try starts (None: ``max_retries`` alone decides)."""
    rate_limit_status_codes: frozenset[int] = frozenset()
    """Transient answers that mean "too many requests, wait" (429): waited out until ``deadline``, however
    many, without counting against ``max_retries`` (they are the server pacing us, not failing)."""
    longest_asked_wait: float | None = None
    """A server that asks for a longer wait than this (``retry_after``) is not waited for: its error propagates
    at once and ``RetryLog.asked`` says what it asked, so that the caller can say when to come back. None: the
    wait is cut to ``max_wait`` and taken (the reader, which waits until its deadline, and commits)."""

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.base_wait < 0 or self.max_wait < 0:
            raise ValueError("max_retries, base_wait and max_wait must be >= 0")
        if self.deadline is not None and self.deadline < 0:
            raise ValueError("deadline must be >= 0")
        if self.longest_asked_wait is not None and self.longest_asked_wait < 0:
            raise ValueError("longest_asked_wait must be >= 0")

    def asks_too_long(self, exc: BaseException) -> float | None:
        """The seconds ``exc``'s server asks to wait when that is longer than ``longest_asked_wait``, else None."""
        asked = retry_after(exc)
        if self.longest_asked_wait is None or asked is None or asked <= self.longest_asked_wait:
            return None
        return asked

    def is_transient(self, exc: BaseException) -> bool:
        """Whether ``exc`` (or an exception it was explicitly raised from) is one this policy retries.

        Only ``raise ... from`` chains count: an error raised while handling another (a bug in an
        ``except`` block) is judged by itself.
        """
        seen: set[int] = set()
        node: BaseException | None = exc
        while node is not None and id(node) not in seen:
            seen.add(id(node))
            if self.never_retry and isinstance(node, self.never_retry):
                return False
            if isinstance(node, OSError) and node.errno in self.never_retry_errnos:
                return False
            status = status_code(node)
            if status is not None:
                return status in self.retry_on_status_codes
            if self.retry_on_exceptions and isinstance(node, self.retry_on_exceptions):
                return True
            node = node.__cause__
        return False

    def is_rate_limit(self, exc: BaseException) -> bool:
        """Whether ``exc`` is an answer in ``rate_limit_status_codes`` (the server asks us to slow down)."""
        return status_code(exc) in self.rate_limit_status_codes

    def wait(self, attempt: int, exc: BaseException) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based) after ``exc``: the backoff, or the server's
        Retry-After when longer, never more than ``max_wait``."""
        w = self.base_wait * 2 ** min(attempt, 60)
        asked = retry_after(exc)
        if asked is not None:
            w = max(w, asked)
        return min(self.max_wait, w)


_RATELIMIT = re.compile(r";\s*r\s*=\s*(\d+)\s*;\s*t\s*=\s*(\d+)")


def retry_after(exc: BaseException) -> float | None:
    """The seconds a server's answer (``exc.response.headers``) asks the client to wait, if it asks.

    ``Retry-After`` as seconds or as an HTTP date, or a ``RateLimit`` header with no requests left
    (``"api";r=0;t=55``: 55 s, the Hub's).
    """
    headers = getattr(getattr(exc, "response", None), "headers", None) or {}
    if not hasattr(headers, "get"):
        return None
    value = str(headers.get("Retry-After") or headers.get("retry-after") or "").strip()
    if value.isdigit():
        return float(value)
    if value:
        from email.utils import parsedate_to_datetime

        try:
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError, IndexError, OverflowError):
            pass
    m = _RATELIMIT.search(str(headers.get("RateLimit") or headers.get("ratelimit") or ""))
    if m and int(m.group(1)) == 0:
        return float(m.group(2))
    return None


@dataclass
class RetryLog:
    """What a ``call_with_retry`` did, for its caller's message: tries made and seconds since the first."""

    tries: int = 0
    seconds: float = 0.0
    deadline_passed: bool = False
    asked: float | None = None  # the server asked for a longer wait than the policy's longest_asked_wait


def status_code(exc: BaseException) -> int | None:
    """The HTTP status code an exception carries (``exc.response.status_code``), if any."""
    code = getattr(getattr(exc, "response", None), "status_code", None)
    return code if isinstance(code, int) else None


def describe(exc: BaseException) -> str:
    """One line for a failed request: ``HTTP 503: ...`` or ``ConnectionError: ...``."""
    text = hide_credentials(str(exc).splitlines()[0]) if str(exc) else type(exc).__name__  # messages quote URLs
    code = status_code(exc)
    return f"HTTP {code}: {text}" if code else f"{type(exc).__name__}: {text}"


def call_with_retry(
    fn: Callable[[], T],
    *,
    policy: RetryPolicy,
    landed: Callable[[], bool] | None = None,
    sleep: Callable[[float], Any] | None = None,
    clock: Callable[[], float] = time.monotonic,
    what: str | None = None,
    log: RetryLog | None = None,
    on_wait: Callable[[BaseException, float, bool], Any] | None = None,
) -> T | None:
    """Call ``fn`` until it succeeds, a non-transient error occurs, or the retries or the deadline run out.

    The last error propagates unchanged (callers add their own context; ``log``, when given, says
    how many tries were made over how long, and whether the deadline ended them). ``landed``, when
    given, is asked after a transient failure whether the operation took effect anyway (an answer
    lost on the way back); if it did, ``None`` is returned without trying again. A rate-limit answer
    (``policy.rate_limit_status_codes``) was a refusal, so nothing is asked after it. Errors raised
    by ``landed`` itself are transient-checked like any other: a non-transient one propagates, a
    transient one means asking again (after a wait), never repeating ``fn`` on a guess. ``what``
    names what is waited for in the log line of a long wait; ``on_wait(exc, seconds, rate_limited)``
    is told of every wait before it starts.
    """
    failures = 0  # transient failures that count against max_retries (rate limits do not)
    waits = 0
    start = clock()
    log = log if log is not None else RetryLog()
    must_check = False  # the last try may have taken effect: ask ``landed`` before trying again
    while True:
        try:
            if must_check and landed is not None:
                if landed():
                    return None
                must_check = False
            log.tries += 1
            return fn()
        except BaseException as exc:
            log.seconds = clock() - start
            if not policy.is_transient(exc):
                raise
            log.asked = policy.asks_too_long(exc)
            if log.asked is not None:  # the caller says when to come back rather than sleep through it
                raise
            limited = policy.is_rate_limit(exc)
            if not limited:
                failures += 1
                if failures > policy.max_retries:
                    raise
            w = policy.wait(waits, exc)
            if policy.deadline is not None:
                left = policy.deadline - log.seconds
                if left <= 0:
                    log.deadline_passed = True
                    raise
                w = min(w, left)
            if what is not None and w >= LOG_WAITS_FROM:
                asked = retry_after(exc)
                told = f"; the server asked for {asked:.0f} s" if asked is not None and asked > w else ""
                until = f", giving up {policy.deadline:.0f} s after the first" if policy.deadline is not None else ""
                logger.warning("lmprobe: %s: %s; trying again in %.0f s (try %d%s%s)", what, describe(exc), w,
                               log.tries + 1, until, told)
            if on_wait is not None:
                on_wait(exc, w, limited)
            (sleep or time.sleep)(w)  # looked up now: a test may stand in for time.sleep
            waits += 1
            must_check = must_check or not limited
