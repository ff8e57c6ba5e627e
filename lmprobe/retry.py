"""One retry helper. What counts as transient is named by each caller, never guessed.

A caller states which exception classes and which HTTP status codes are worth another try
(huggingface_hub's ``http_backoff`` does the same with ``retry_on_exceptions`` and
``retry_on_status_codes``). Anything else, a ``TypeError`` from a bug included, propagates at once.

>>> policy = RetryPolicy(retry_on_exceptions=(ConnectionError,), max_retries=3, base_wait=0.5)
>>> call_with_retry(lambda: 42, policy=policy)
42
"""

from __future__ import annotations

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
    """Upper bound of one wait (a server's Retry-After can raise it)."""

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.base_wait < 0 or self.max_wait < 0:
            raise ValueError("max_retries, base_wait and max_wait must be >= 0")

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

    def wait(self, attempt: int, exc: BaseException) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based) after ``exc``."""
        w = min(self.max_wait, self.base_wait * 2**attempt)
        headers = getattr(getattr(exc, "response", None), "headers", None) or {}
        retry_after = str(headers.get("Retry-After", "")) if hasattr(headers, "get") else ""
        if retry_after.isdigit():
            w = max(w, float(retry_after))
        return w


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
) -> T | None:
    """Call ``fn`` until it succeeds, a non-transient error occurs, or the retries run out.

    The last error propagates unchanged (callers add their own context). ``landed``, when given,
    is asked after each transient failure whether the operation took effect anyway (an answer
    lost on the way back); if it did, ``None`` is returned without trying again. Errors raised by
    ``landed`` itself are transient-checked like any other: a non-transient one propagates.
    """
    attempt = 0
    while True:
        try:
            return fn()
        except BaseException as exc:
            if attempt >= policy.max_retries or not policy.is_transient(exc):
                raise
            sleep(policy.wait(attempt, exc))
            attempt += 1
            if landed is not None:
                try:
                    if landed():
                        return None
                except BaseException as check_exc:
                    if not policy.is_transient(check_exc):
                        raise
