"""One retry helper. What counts as transient is named by each caller, never guessed.

A caller states which exception classes and which HTTP status codes are worth another try
(huggingface_hub's ``http_backoff`` does the same with ``retry_on_exceptions`` and
``retry_on_status_codes``). Anything else, a ``TypeError`` from a bug included, propagates at once.

>>> policy = RetryPolicy(retry_on_exceptions=(ConnectionError,), max_retries=3, base_wait=0.5)
>>> call_with_retry(lambda: 42, policy=policy)
42
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .display import hide_credentials

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
    max_retries: int = 5
    """Tries after the first one."""
    base_wait: float = 1.0
    """Seconds before the first retry; doubled for each further one."""
    max_wait: float = 60.0
    """Upper bound of one backoff wait (a server's Retry-After can raise it, up to ``max_retry_after``)."""
    rate_limit_status_codes: frozenset[int] = frozenset()
    """Transient answers that mean "too many requests, wait" (429): waited out until ``deadline``, however
    many, without counting against ``max_retries`` (they are the server pacing us, not failing)."""
    max_retry_after: float = 3600.0
    """Upper bound of a wait a server asks for (Retry-After, or the reset of a RateLimit header)."""
    deadline: float | None = None
    """Seconds after the first try past which no retry starts (None: only ``max_retries`` limits)."""

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.base_wait < 0 or self.max_wait < 0 or self.max_retry_after < 0:
            raise ValueError("max_retries, base_wait, max_wait and max_retry_after must be >= 0")
        if self.deadline is not None and self.deadline < 0:
            raise ValueError("deadline must be >= 0 or None")

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
        """Seconds to wait before retry number ``attempt`` (0-based) after ``exc``.

        Exponential backoff, or longer when the answer asks for it: ``Retry-After`` (seconds or an
        HTTP date), or a ``RateLimit`` header with no requests left (``"api";r=0;t=55``: 55 s), both
        capped at ``max_retry_after``.
        """
        w = min(self.max_wait, self.base_wait * 2**attempt)
        asked = server_wait(getattr(getattr(exc, "response", None), "headers", None))
        if asked is not None:
            w = max(w, min(asked, self.max_retry_after))
        return w


_RATELIMIT = re.compile(r";\s*r\s*=\s*(\d+)\s*;\s*t\s*=\s*(\d+)")


def server_wait(headers: Any) -> float | None:
    """Seconds an HTTP answer's headers ask the client to wait (Retry-After, RateLimit), if they ask."""
    if not hasattr(headers, "get"):
        return None
    retry_after = str(headers.get("Retry-After") or headers.get("retry-after") or "").strip()
    if retry_after.isdigit():
        return float(retry_after)
    if retry_after:
        from email.utils import parsedate_to_datetime

        try:
            return max(0.0, parsedate_to_datetime(retry_after).timestamp() - time.time())
        except (TypeError, ValueError, IndexError, OverflowError):
            pass
    m = _RATELIMIT.search(str(headers.get("RateLimit") or headers.get("ratelimit") or ""))
    if m and int(m.group(1)) == 0:
        return float(m.group(2))
    return None


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
    sleep: Callable[[float], Any] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    on_wait: Callable[[BaseException, float, bool], Any] | None = None,
) -> T | None:
    """Call ``fn`` until it succeeds, a non-transient error occurs, or the retries run out.

    The last error propagates unchanged (callers add their own context). ``landed``, when given,
    is asked after a transient failure whether the operation took effect anyway (an answer lost on
    the way back); if it did, ``None`` is returned without trying again. A rate-limit answer
    (``policy.rate_limit_status_codes``) was a refusal, so nothing is asked after it. Errors raised
    by ``landed`` itself are transient-checked like any other: a non-transient one propagates, a
    transient one means asking again (after a wait), never repeating ``fn`` on a guess.
    ``on_wait(exc, seconds, rate_limited)`` is told of every wait before it starts.
    """
    failures = 0  # transient failures that count against max_retries (rate limits do not)
    waits = 0
    start = clock()
    must_check = False  # the last try may have taken effect: ask ``landed`` before trying again
    while True:
        try:
            if must_check and landed is not None:
                if landed():
                    return None
                must_check = False
            return fn()
        except BaseException as exc:
            if not policy.is_transient(exc):
                raise
            limited = policy.is_rate_limit(exc)
            if not limited:
                failures += 1
                if failures > policy.max_retries:
                    raise
            w = policy.wait(waits, exc)
            if policy.deadline is not None and clock() - start + w > policy.deadline:
                raise
            if on_wait is not None:
                on_wait(exc, w, limited)
            sleep(w)
            waits += 1
            must_check = must_check or not limited
