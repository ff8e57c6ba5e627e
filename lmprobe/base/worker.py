"""One background worker: a thread that handles items in order and hands its first error to the caller.

Extraction writes batches on it while the next forward pass runs, object-storage uploads run on
it while the model computes, and the training reader reads shards ahead on it.

>>> w = BackgroundWorker(print, max_pending=2)
>>> w.submit("hello")
>>> w.finish()
hello
"""

from __future__ import annotations

import itertools
import queue
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import wait
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

_STOP = object()


class BackgroundWorker:
    """Runs ``fn(item)`` for every submitted item, in order, on one daemon thread.

    ``submit`` blocks while ``max_pending`` items wait (0: never blocks). The first exception
    ``fn`` raises is kept: later items are skipped, and the next ``submit``, ``result`` or
    ``finish`` raises it in the caller's thread with its original traceback. With
    ``keep_results=True`` each return value is queued for ``result()``.
    """

    def __init__(self, fn: Callable[[Any], Any], *, max_pending: int = 1, name: str = "lmprobe-worker",
                 keep_results: bool = False):
        self._fn = fn
        self._in: queue.Queue = queue.Queue(maxsize=max(0, max_pending))
        self._out: queue.Queue | None = queue.Queue() if keep_results else None
        self._error: BaseException | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def error(self) -> BaseException | None:
        """The first exception ``fn`` raised, if any."""
        return self._error

    def _run(self) -> None:
        while True:
            item = self._in.get()
            if item is _STOP:
                if self._out is not None:
                    self._out.put(_STOP)
                return
            if self._error is not None or self._stopping.is_set():
                continue
            try:
                result = self._fn(item)
            except BaseException as exc:  # handed to the caller's thread
                self._error = exc
                if self._out is not None:
                    self._out.put(_STOP)
                continue
            if self._out is not None:
                self._out.put(result)
            del item, result  # hold nothing while waiting for the next item

    def _raise_pending(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, item: Any) -> None:
        """Queue ``item``; raises the worker's error if ``fn`` failed on an earlier one."""
        self._raise_pending()
        self._in.put(item)

    def result(self) -> Any:
        """The next result, in submission order (``keep_results=True``); raises the worker's error."""
        if self._out is None:
            raise RuntimeError("this worker keeps no results")
        out = self._out.get()
        if out is _STOP:
            self._raise_pending()
            raise RuntimeError("the worker has stopped")
        return out

    def stop(self, *, skip_pending: bool = False) -> None:
        """End the thread without raising its error: after handling what is queued, or (``skip_pending``)
        after the current item only."""
        if skip_pending:
            self._stopping.set()
            while True:  # drop queued items so that a full queue cannot block the stop marker
                try:
                    self._in.get_nowait()
                except queue.Empty:
                    break
        self._in.put(_STOP)
        self._thread.join()

    def finish(self) -> None:
        """Wait until every submitted item is handled; raises the worker's error if there was one."""
        self._in.put(_STOP)
        self._thread.join()
        self._raise_pending()


def prefetched(fn: Callable[[T], R], items: Iterable[T], *, depth: int, name: str = "lmprobe-prefetch") -> Iterator[R]:
    """Yield ``fn(item)`` for each item in order, computing up to ``depth`` items ahead on a background thread.

    >>> list(prefetched(lambda x: x * x, range(4), depth=2))
    [0, 1, 4, 9]
    """
    worker = BackgroundWorker(fn, max_pending=0, name=name, keep_results=True)
    it = iter(items)
    pending = 0
    try:
        for item in itertools.islice(it, max(1, depth)):
            worker.submit(item)
            pending += 1
        while pending:
            result = worker.result()  # raises the error of an item once its turn comes
            pending -= 1
            if worker.error is None:
                nxt = next(it, _STOP)
                if nxt is not _STOP:
                    worker.submit(nxt)
                    pending += 1
            yield result
    finally:
        worker.stop(skip_pending=True)


def settle(futures: Iterable[Any]) -> None:
    """Wait for every future (None entries skipped): nothing they do may outlive the caller's block.

    Then raises the first future's error, unless an exception is already propagating (called from
    a ``finally`` block): that one is the error to report.
    """
    pending = [f for f in futures if f is not None]
    wait(pending)
    if sys.exc_info()[0] is None:
        for f in pending:
            f.result()
