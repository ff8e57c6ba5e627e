"""One retry helper. What counts as transient is named by each caller, never guessed.

A caller states which exception classes and which HTTP status codes are worth another try
(huggingface_hub's ``http_backoff`` does the same with ``retry_on_exceptions`` and
``retry_on_status_codes``). Anything else, a ``TypeError`` from a bug included, propagates at once.

A wait is never longer than ``max_wait``, whatever a server's ``Retry-After`` asks (the try after it
may be answered sooner, and a reader must not go silent for a day), and no try starts after
``deadline`` seconds from the first: a caller states how long it is willing to wait, and its error
message can say so. ``what`` names what is waited for; a long wait is logged with it.

>>> policy = RetryPolicy(retry_on_exceptions=(ConnectionError,), max_retries=3, base_wait=0.5)
>>> call_with_retry(lambda: 42, policy=policy)
42
"""

from __future__ import annotations

import logging
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

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.base_wait < 0 or self.max_wait < 0:
            raise ValueError("max_retries, base_wait and max_wait must be >= 0")
        if self.deadline is not None and self.deadline < 0:
            raise ValueError("deadline must be >= 0")

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

    def wait(self, attempt: int, exc: BaseException) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based) after ``exc``: the backoff, or the server's
        Retry-After when longer, never more than ``max_wait``."""
        w = self.base_wait * 2 ** min(attempt, 60)
        asked = retry_after(exc)
        if asked is not None:
            w = max(w, asked)
        return min(self.max_wait, w)


def retry_after(exc: BaseException) -> float | None:
    """The seconds a server's ``Retry-After`` header asks for (``exc.response.headers``), if it gives a number."""
    headers = getattr(getattr(exc, "response", None), "headers", None) or {}
    value = str(headers.get("Retry-After", "")).strip() if hasattr(headers, "get") else ""
    return float(value) if value.isdigit() else None


@dataclass
class RetryLog:
    """What a ``call_with_retry`` did, for its caller's message: tries made and seconds since the first."""

    tries: int = 0
    seconds: float = 0.0
    deadline_passed: bool = False


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
) -> T | None:
    """Call ``fn`` until it succeeds, a non-transient error occurs, or the retries or the deadline run out.

    The last error propagates unchanged (callers add their own context; ``log``, when given, says
    how many tries were made over how long, and whether the deadline ended them). ``landed``, when
    given, is asked after each transient failure whether the operation took effect anyway (an
    answer lost on the way back); if it did, ``None`` is returned without trying again. Errors
    raised by ``landed`` itself are transient-checked like any other: a non-transient one
    propagates. ``what`` names what is waited for in the log line of a long wait.
    """
    attempt = 0
    start = clock()
    log = log if log is not None else RetryLog()
    while True:
        log.tries = attempt + 1
        try:
            return fn()
        except BaseException as exc:
            log.seconds = clock() - start
            if attempt >= policy.max_retries or not policy.is_transient(exc):
                raise
            w = policy.wait(attempt, exc)
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
                               attempt + 2, until, told)
            (sleep or time.sleep)(w)  # looked up now: a test may stand in for time.sleep
            attempt += 1
            if landed is not None:
                try:
                    if landed():
                        return None
                except BaseException as check_exc:
                    if not policy.is_transient(check_exc):
                        raise
