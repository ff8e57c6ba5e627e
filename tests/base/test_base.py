"""The base layer: one retry helper, one background worker, one atomic write, the heap trimmer, progress.

The CLI's error contract is tested in test_errors.py."""

from __future__ import annotations

import threading
import time

import pytest

from lmprobe.base.atomic import atomic_output, atomic_write
from lmprobe.base.retry import RetryPolicy, call_with_retry
from lmprobe.base.worker import BackgroundWorker, prefetched, settle


class Flaky(ConnectionError):
    pass


class Response:
    def __init__(self, status, headers=None):
        self.status_code = status
        self.headers = headers or {}


class HTTPFailure(Exception):
    def __init__(self, status, headers=None):
        super().__init__(f"HTTP {status}")
        self.response = Response(status, headers)


def failing(times: int, exc: BaseException):
    calls = {"n": 0}

    def fn():
        calls["n"] += 1
        if calls["n"] <= times:
            raise exc
        return "ok"

    return fn, calls


def test_retry_retries_what_the_caller_names_and_nothing_else():
    waits = []
    policy = RetryPolicy(retry_on_exceptions=(Flaky,), max_retries=3, base_wait=0.5)
    fn, calls = failing(2, Flaky("reset"))
    assert call_with_retry(fn, policy=policy, sleep=waits.append) == "ok"
    assert calls["n"] == 3 and waits == [0.5, 1.0]

    fn, calls = failing(1, TypeError("a bug"))
    with pytest.raises(TypeError, match="a bug"):
        call_with_retry(fn, policy=policy, sleep=waits.append)
    assert calls["n"] == 1  # a bug is never retried

    fn, calls = failing(9, Flaky("down"))
    with pytest.raises(Flaky):
        call_with_retry(fn, policy=policy, sleep=lambda s: None)
    assert calls["n"] == 4  # the first try and three retries


def test_retry_by_status_code_and_retry_after():
    waits = []
    policy = RetryPolicy(retry_on_status_codes=frozenset({429, 503}), base_wait=1.0)
    fn, calls = failing(1, HTTPFailure(429, {"Retry-After": "7"}))
    assert call_with_retry(fn, policy=policy, sleep=waits.append) == "ok"
    assert waits == [7.0]
    fn, calls = failing(1, HTTPFailure(404))
    with pytest.raises(HTTPFailure):
        call_with_retry(fn, policy=policy, sleep=waits.append)
    assert calls["n"] == 1


def test_a_wait_longer_than_the_caller_takes_ends_the_call_at_once():
    """A command refuses to sleep through `Retry-After: 100000`; the log says what was asked."""
    from lmprobe.base.retry import RetryLog

    waits = []
    policy = RetryPolicy(retry_on_status_codes=frozenset({429}), rate_limit_status_codes=frozenset({429}),
                         max_wait=60.0, deadline=300.0, longest_asked_wait=60.0)
    fn, calls = failing(99, HTTPFailure(429, {"Retry-After": "100000"}))
    log = RetryLog()
    with pytest.raises(HTTPFailure):
        call_with_retry(fn, policy=policy, sleep=waits.append, log=log)
    assert calls["n"] == 1 and waits == [] and log.asked == 100000.0
    fn, calls = failing(2, HTTPFailure(429, {"Retry-After": "45"}))  # a wait it takes is taken
    assert call_with_retry(fn, policy=policy, sleep=waits.append) == "ok" and waits == [45.0, 45.0]


def test_never_retry_excludes_subclasses():
    policy = RetryPolicy(retry_on_exceptions=(OSError,), never_retry=(FileNotFoundError,), base_wait=0)
    assert policy.is_transient(OSError("io"))
    assert not policy.is_transient(FileNotFoundError("gone"))


def test_a_transient_cause_counts():
    policy = RetryPolicy(retry_on_exceptions=(Flaky,))
    try:
        try:
            raise Flaky("inner")
        except Flaky as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert policy.is_transient(outer)


def test_a_lost_answer_is_not_repeated():
    policy = RetryPolicy(retry_on_exceptions=(Flaky,), base_wait=0)
    fn, calls = failing(5, Flaky("answer lost"))
    assert call_with_retry(fn, policy=policy, landed=lambda: True) is None
    assert calls["n"] == 1
    # an error while asking is a bug, not a reason to assume anything
    with pytest.raises(KeyError):
        call_with_retry(failing(5, Flaky("x"))[0], policy=policy, landed=lambda: {}["missing"])


def test_a_failed_check_is_asked_again_before_the_operation_is_repeated():
    """A commit whose answer was lost, then a check that fails: trying the commit again could make it twice."""
    policy = RetryPolicy(retry_on_exceptions=(Flaky,), base_wait=0)
    fn, calls = failing(1, Flaky("answer lost"))
    checks = iter([Flaky("check dropped"), Flaky("check dropped"), True])

    def landed():
        answer = next(checks)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    assert call_with_retry(fn, policy=policy, landed=landed, sleep=lambda s: None) is None
    assert calls["n"] == 1  # asked three times, never made twice


def test_rate_limits_are_waited_out_until_the_deadline_not_counted_as_failures():
    clock = {"t": 0.0}
    waits, told = [], []

    def sleep(s):
        waits.append(s)
        clock["t"] += s

    policy = RetryPolicy(retry_on_status_codes=frozenset({429, 503}), rate_limit_status_codes=frozenset({429}),
                         max_retries=1, base_wait=0.1, max_wait=30.0, deadline=130.0)
    fn, calls = failing(6, HTTPFailure(429, {"Retry-After": "20"}))
    assert call_with_retry(fn, policy=policy, sleep=sleep, clock=lambda: clock["t"],
                           on_wait=lambda exc, w, limited: told.append((w, limited))) == "ok"
    assert calls["n"] == 7 and waits == [20.0] * 6  # six rate limits with max_retries=1: none counts
    assert told == [(20.0, True)] * 6
    # a Retry-After beyond max_wait waits max_wait; no try starts after the deadline
    clock["t"], waits[:] = 0.0, []
    fn, calls = failing(99, HTTPFailure(429, {"Retry-After": "3600"}))
    with pytest.raises(HTTPFailure):
        call_with_retry(fn, policy=policy, sleep=sleep, clock=lambda: clock["t"])
    assert waits == [30.0] * 4 + [10.0] and calls["n"] == 6  # the last wait ends at the deadline
    # other transient answers still count against max_retries
    clock["t"] = 0.0
    fn, calls = failing(5, HTTPFailure(503))
    with pytest.raises(HTTPFailure):
        call_with_retry(fn, policy=policy, sleep=sleep, clock=lambda: clock["t"])
    assert calls["n"] == 2


def test_retry_after_as_a_date_and_the_ratelimit_header():
    from email.utils import formatdate

    policy = RetryPolicy(retry_on_status_codes=frozenset({429}), base_wait=1.0, max_wait=600.0)
    in_40s = formatdate(time.time() + 40, usegmt=True)
    assert 38 <= policy.wait(0, HTTPFailure(429, {"Retry-After": in_40s})) <= 41
    assert policy.wait(0, HTTPFailure(429, {"RateLimit": '"api";r=0;t=55'})) == 55.0
    assert policy.wait(0, HTTPFailure(429, {"RateLimit": '"api";r=3;t=55'})) == 1.0  # requests left: no reset wait


def test_worker_hands_its_first_error_to_the_caller():
    seen = []

    def handle(x):
        if x == 2:
            raise ValueError("bad item 2")
        seen.append(x)

    w = BackgroundWorker(handle, max_pending=1)
    w.submit(1)
    w.submit(2)
    time.sleep(0.05)
    with pytest.raises(ValueError, match="bad item 2"):
        for i in range(3, 50):
            w.submit(i)
            time.sleep(0.01)
    with pytest.raises(ValueError):
        w.finish()
    assert seen == [1]


def test_worker_stop_finishes_what_is_queued_unless_told_to_skip():
    seen = []
    gate = threading.Event()

    def handle(x):
        gate.wait(5)
        seen.append(x)

    w = BackgroundWorker(handle, max_pending=0)
    for i in range(3):
        w.submit(i)
    gate.set()
    w.stop()
    assert seen == [0, 1, 2]

    seen.clear()
    gate.clear()
    w = BackgroundWorker(handle, max_pending=0)
    for i in range(3):
        w.submit(i)
    threading.Timer(0.1, gate.set).start()
    w.stop(skip_pending=True)
    assert seen in ([], [0])


def test_prefetched_keeps_order_and_raises_in_the_consumer():
    assert list(prefetched(lambda x: x * 10, range(7), depth=3)) == [0, 10, 20, 30, 40, 50, 60]

    def boom(x):
        if x == 3:
            raise RuntimeError("read failed")
        return x

    got = []
    with pytest.raises(RuntimeError, match="read failed"):
        for v in prefetched(boom, range(10), depth=2):
            got.append(v)
    assert got == [0, 1, 2]


def _fast_error_and_slow_writer():
    """Two futures: the first fails at once, the second is still writing when it does."""
    from concurrent.futures import ThreadPoolExecutor

    written = threading.Event()

    def fail():
        raise ValueError("cast failed")

    def slow():
        time.sleep(0.2)
        written.set()

    pool = ThreadPoolExecutor(2)
    futures = [pool.submit(fail), pool.submit(slow)]
    pool.shutdown(wait=False)
    return futures, written


def test_settle_waits_for_every_future_before_it_raises():
    """A caller's buffers may be reused once settle returns or raises: no future may still be writing then."""
    futures, written = _fast_error_and_slow_writer()
    with pytest.raises(ValueError, match="cast failed"):
        settle(futures)
    assert written.is_set()
    futures, written = _fast_error_and_slow_writer()
    with pytest.raises(KeyError):  # an error already propagating is the one reported; the futures are waited for
        try:
            raise KeyError("the caller's own error")
        finally:
            settle([None, *futures])
    assert written.is_set()


def test_a_split_conversion_fails_only_once_every_part_is_done():
    from lmprobe.format.values import _all_done

    futures, written = _fast_error_and_slow_writer()
    with pytest.raises(ValueError, match="cast failed"):
        _all_done(futures, "out").result()
    assert written.is_set()


def test_atomic_write_never_leaves_a_half_file(tmp_path):
    target = tmp_path / "f.json"
    atomic_write(target, "old")
    with pytest.raises(RuntimeError), atomic_output(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash while writing")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]
    atomic_write(target, b"new")
    assert target.read_text() == "new"


def test_heap_trimmer_trims_piled_up_memory_but_not_a_grown_working_set(monkeypatch):
    from lmprobe.base import allocator

    class FakeLibc:
        trims = 0

        def malloc_trim(self, pad):
            FakeLibc.trims += 1
            rss[0] = max(live[0], rss[0] - freed[0])  # free pages go back; live memory stays

        def mallopt(self, *a):
            return 1

    mib = 1 << 20
    rss, live, freed = [500 * mib], [500 * mib], [0]
    monkeypatch.setattr(allocator, "_glibc", lambda: FakeLibc())
    monkeypatch.setattr(allocator, "resident_bytes", lambda: rss[0])
    trim = allocator.HeapTrimmer(slack=0.5, floor=32 * mib)  # trims what loading freed, then starts at 500 MiB
    rss[0] = live[0] = 600 * mib  # the first batch's working set: +100 MiB
    trim()
    assert trim.limit == 650 * mib and FakeLibc.trims == 1
    rss[0], freed[0] = 640 * mib, 40 * mib  # within the slack: the next batch reuses it
    trim()
    assert FakeLibc.trims == 1
    rss[0] = 700 * mib  # freed memory piled up past the limit: handed back
    trim()
    assert (trim.trims, rss[0]) == (1, 660 * mib)
    live[0] = rss[0] = 900 * mib  # live memory really grew: one trim, then a new level, no trim per batch
    trim()
    trim()
    assert trim.trims == 2 and trim.limit == 900 * mib + 32 * mib


# ------------------------------------------------------------------ progress


def test_progress_off_a_terminal_is_a_line_every_interval_and_one_at_the_end(capsys, monkeypatch):
    from lmprobe.base import progress

    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    with progress.messages_shown():  # as under the command line
        bar = progress.Progress(1000, desc="export-saev", unit="example", interval=30)
        for _ in range(9):
            clock[0] += 10
            bar.update(100, note="shard 3")
        bar.update(100)
        bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["export-saev: 300/1,000 examples (30.0%), 10.0 examples/s, ETA 1m10s, shard 3",
                     "export-saev: 600/1,000 examples (60.0%), 10.0 examples/s, ETA 40s, shard 3",
                     "export-saev: 900/1,000 examples (90.0%), 10.0 examples/s, ETA 10s, shard 3",
                     "export-saev: 1,000/1,000 examples (100.0%), 11.1 examples/s, done in 1m30s, shard 3"], lines


def test_progress_of_bytes_shows_sizes_and_quiet_shows_nothing(capsys, monkeypatch):
    from lmprobe.base import progress

    with progress.messages_shown():
        bar = progress.Progress(4 * 2**30, desc="push me/acts", unit="B", initial=2**30, interval=0)
        bar.update(2**30)
    assert capsys.readouterr().err.startswith("push me/acts: 2.0 GiB/4.0 GiB (50.0%), ")
    quiet = progress.Progress(10, desc="x", unit="item", quiet=True, interval=0)
    quiet.update(5)
    quiet.close()
    assert capsys.readouterr().err == ""


def test_progress_on_a_terminal_is_a_tqdm_bar(capsys, monkeypatch):
    from lmprobe.base import progress

    monkeypatch.setattr(progress, "on_terminal", lambda: True)
    bar = progress.Progress(10, desc="pull me/acts", unit="file", interval=0)
    bar.update(10)
    bar.close()
    err = capsys.readouterr().err
    assert "\r" in err and "pull me/acts: 100%" in err and "10/10" in err


def test_the_library_is_quiet_by_default_and_the_command_line_shows_its_messages(tmp_path, capsys):
    """The lmprobe logger says nothing below a warning in library use, unless asked; the command
    line shows its messages, and leaves the logger as it found it."""
    import logging

    import lmprobe
    from lmprobe.cli import main as cli_main

    log = logging.getLogger("lmprobe")
    lmprobe.extract("lmprobe-tiny", ["the cat sat"], out=tmp_path / "a", layers=-1)
    assert capsys.readouterr().err == ""
    log.setLevel(logging.INFO)
    try:
        lmprobe.extract("lmprobe-tiny", ["the cat sat"], out=tmp_path / "b", layers=-1)
        assert "lmprobe: writing 1 prompt (" in capsys.readouterr().err
    finally:
        log.setLevel(logging.WARNING)
    (tmp_path / "p.txt").write_text("the cat sat\n")
    assert cli_main(["extract", "--model", "lmprobe-tiny", "--prompts", str(tmp_path / "p.txt"), "--out",
                     str(tmp_path / "c"), "--layers", "-1"]) == 0
    assert "lmprobe: writing 1 prompt (" in capsys.readouterr().err and log.level == logging.WARNING


def test_progress_in_a_notebook_is_a_bar(monkeypatch):
    import sys
    import types

    from lmprobe.base import progress

    class ZMQInteractiveShell:  # what get_ipython() returns in a Jupyter kernel
        pass

    assert not progress.on_terminal()  # pytest's captured stderr: lines, not bars
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=ZMQInteractiveShell))
    assert progress.on_terminal()
