"""The node-shared reader cache (storage.cache, storage.cachedir) against its other users: links planted in the
shared folder are never followed, and readers sharing one budget cannot wait on each other forever."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from lmprobe.errors import OutOfSpaceError, UnsafePathError
from lmprobe.storage.cache import BoundedCache

# ----------------------------------------------------------------------------- links planted in the cache


def _victim(path: Path) -> dict[str, bytes]:
    """A user's folder outside the cache, laid out like a cache folder (so that every reaper finds something):
    5 files of its own, 5 in pieces/ and parts/, 5 in readers/<dead reader>/."""
    files = {"notes.txt": b"mine", "thesis.tex": b"\\begin", "data.bin": b"\0" * 64, "a.part": b"x", "b.json": b"{}",
             "pieces/p0": b"0", "pieces/p1": b"1", "parts/q.r-1.9.part": b"2", "parts/q2": b"3", "parts/q3": b"4",
             "readers/123-dead/alive": b"", "readers/123-dead/info.json": b"{}", "readers/123-dead/holds/p0": b"",
             "readers/old/x": b"5", "readers/old/y": b"6"}
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    return files


def _intact(path: Path, files: dict[str, bytes]) -> None:
    there = {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}
    assert there == files, "the cache deleted or created files outside its root"


def _download(name, dst):
    with open(dst, "wb") as f:
        f.write(b"\7" * 100)


def _read_all(root: Path, key: str = "acts") -> None:
    """One reader of the shared folder: opens it, reads two pieces, closes (every reaper runs: at the start, while
    claiming room, at the end)."""
    cache = BoundedCache(_download, 300, key=key, sizes={"p0": 100, "p1": 100}, root=root, workers=1)
    try:
        cache.schedule(["p0", "p1"])
        for name in ("p0", "p1"):
            assert cache.get(name).read_bytes() == b"\7" * 100
            cache.release(name)
    finally:
        cache.close()


@pytest.mark.parametrize("plant", ["x", "y/pieces", "z/parts", "w/readers", "v/readers/123-dead"])
def test_links_planted_in_the_shared_cache_are_never_followed(tmp_path, plant):
    """Another user of the node plants `stream/x -> dir` (or a link for one of a cache folder's
    parts); a reader of another dataset deletes nothing outside the cache and creates nothing there."""
    root = tmp_path / "stream"
    root.mkdir()
    victim = tmp_path / "victim"
    files = _victim(victim)
    link = root / plant
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim, target_is_directory=True)
    _read_all(root)
    _intact(victim, files)
    assert link.is_symlink()  # not followed, and not the reader's to remove either


@pytest.mark.parametrize("plant", ["acts", "acts/pieces", "acts/parts", "acts/readers", "acts/notes", "acts/.lock"])
def test_a_link_in_the_readers_own_folder_is_one_line_and_nothing_outside_changes(tmp_path, plant):
    """The folder of the dataset being read holds a link where a folder (or the lock) belongs: the reader refuses in
    one line naming it, before any download, and the link's target is left as it was."""
    root = tmp_path / "stream"
    root.mkdir()
    victim = tmp_path / "victim"
    files = _victim(victim)
    target = victim / "lockfile" if plant.endswith(".lock") else victim
    (root / plant).parent.mkdir(parents=True, exist_ok=True)
    (root / plant).symlink_to(target)
    with pytest.raises(UnsafePathError, match="link") as err:
        _read_all(root)
    assert "\n" not in str(err.value) and "remove" in str(err.value)
    _intact(victim, files)


def test_a_dangling_link_for_a_lock_creates_nothing_outside_the_cache(tmp_path):
    """`stream/k/.lock -> victim/new`: taking the folder's lock (collecting what dead readers left in k) must not
    create the link's target."""
    root = tmp_path / "stream"
    (root / "k").mkdir(parents=True)
    victim = tmp_path / "victim"
    files = _victim(victim)
    (root / "k" / ".lock").symlink_to(victim / "created-by-the-cache")
    _read_all(root)
    _intact(victim, files)


def test_a_cache_root_that_is_a_link_is_refused(tmp_path, monkeypatch):
    """`$LMPROBE_CACHE/stream -> somebody's home`: every folder under the root is collected, so the root is never
    followed through a link."""
    victim = tmp_path / "victim"
    files = _victim(victim)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "stream").symlink_to(victim, target_is_directory=True)
    monkeypatch.setenv("LMPROBE_CACHE", str(tmp_path / "c"))
    with pytest.raises(UnsafePathError, match="link"):
        BoundedCache(_download, 300, key="acts", sizes={"p0": 100})
    _intact(victim, files)


def test_a_piece_swapped_for_a_link_is_not_deleted_through(tmp_path):
    """A finished piece replaced by a link to a user's file while a reader holds it: releasing it removes at most
    the link, never the file it points to."""
    root = tmp_path / "stream"
    victim = tmp_path / "victim"
    files = _victim(victim)
    cache = BoundedCache(_download, 300, key="acts", sizes={"p0": 100}, root=root, workers=1)
    try:
        cache.schedule(["p0"])
        path = cache.get("p0")
        path.unlink()
        path.symlink_to(victim / "notes.txt")
        cache.release("p0")
    finally:
        cache.close()
    _intact(victim, files)


# ----------------------------------------------------------------------------- readers sharing one budget


def _window_reader(cache, windows, served, errors, pause=0.0):
    """A consumer like the stream's: each window is scheduled in one call, all its pieces are taken, then all are
    given back."""
    try:
        for window in windows:
            cache.schedule(window)
        for window in windows:
            for name in window:
                assert cache.get(name).read_bytes() == b"\5" * 1000
            time.sleep(pause)
            for name in window:
                cache.release(name)
            served.extend(window)
    except Exception as exc:  # handed to the test
        errors.append(exc)


def test_three_readers_on_one_budget_never_wait_on_each_other_for_ever(tmp_path):
    """Three readers of one dataset on a node share a budget of six pieces; each reads windows of
    three pieces at once. Before, each could hold two pieces of its window and wait for room for its third, which the
    others held while waiting for theirs: nobody ever released anything (here forced: every reader's second download
    waits until the three have started theirs). Now a window's pieces are claimed together and the reader that waited
    longest goes first, so every reader serves every window, well within the bound."""
    gate = threading.Barrier(3, timeout=1.0)
    started: dict[str, int] = {}
    lock = threading.Lock()

    def download(name, dst):
        reader = name[0]
        with lock:
            started[reader] = started.get(reader, 0) + 1
            second = started[reader] == 2
        if second:
            try:
                gate.wait()
            except threading.BrokenBarrierError:  # not every reader got this far: nobody is stuck
                pass
        with open(dst, "wb") as f:
            f.write(b"\5" * 1000)

    readers = "abc"
    windows = {r: [[f"{r}{w}-{i}" for i in range(3)] for w in range(4)] for r in readers}
    caches = [BoundedCache(download, 6000, key="acts", sizes={n: 1000 for ws in windows.values() for w in ws
                                                              for n in w}, root=tmp_path, workers=1, patience=5)
              for _ in readers]
    served: dict[str, list] = {r: [] for r in readers}
    errors: list[BaseException] = []
    threads = [threading.Thread(target=_window_reader, args=(c, windows[r], served[r], errors, 0.05))
               for c, r in zip(caches, readers, strict=True)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    took = time.monotonic() - t0
    for c in caches:
        c.close()
    assert not errors, errors
    assert all(len(served[r]) == 12 for r in readers), {r: len(v) for r, v in served.items()}
    assert took < 5, took  # no reader waited out the bound


def test_a_reader_that_cannot_get_budget_within_the_bound_says_why_in_one_line(tmp_path):
    """Another reader of the node holds the whole budget and stops reading (a training loop that keeps an iterator
    alive): a reader needing room waits at most ``patience`` seconds, then its read fails with one line saying who
    holds the budget and what to do."""

    def download(name, dst):
        with open(dst, "wb") as f:
            f.write(b"\5" * 1000)

    sizes = {f"p{i}": 1000 for i in range(4)}
    idle = BoundedCache(download, 3000, key="acts", sizes=sizes, root=tmp_path, workers=1)
    idle.schedule(["p0", "p1", "p2"])
    for name in ("p0", "p1", "p2"):
        idle.get(name)  # held, never given back
    late = BoundedCache(download, 3000, key="acts", sizes=sizes, root=tmp_path, workers=1, patience=1.0)
    try:
        late.schedule(["p3"])
        t0 = time.monotonic()
        with pytest.raises(OutOfSpaceError) as err:
            late.get("p3")
        took = time.monotonic() - t0
    finally:
        late.close()
        idle.close()
    assert 0.9 < took < 4, took
    msg = str(err.value)
    assert "\n" not in msg and "1 other reader" in msg and "cache=" in msg, msg


def test_a_window_of_pieces_already_scheduled_does_not_stall_the_next(tmp_path):
    """Consecutive windows reading the same pieces: the second schedules nothing new, and the third's pieces are
    still downloaded (an empty group at the head of the queue once stalled every later one)."""

    def download(name, dst):
        with open(dst, "wb") as f:
            f.write(b"\5" * 1000)

    cache = BoundedCache(download, 3000, key="acts", sizes={f"p{i}": 1000 for i in range(3)}, root=tmp_path,
                         workers=1, patience=2)
    served, errors = [], []
    windows = [["p0", "p1"], ["p0", "p1"], ["p2"]]
    t = threading.Thread(target=_window_reader, args=(cache, windows, served, errors))
    t.start()
    t.join(10)
    alive = t.is_alive()
    cache.close()
    assert not alive and not errors and served == ["p0", "p1", "p0", "p1", "p2"], (alive, errors, served)


def test_a_cache_home_the_user_linked_elsewhere_still_works(tmp_path, monkeypatch):
    """The folders above the cache root are the user's choice: `LMPROBE_CACHE` (or ~/.cache/lmprobe) may be a link to
    a larger disk; only the root and what is below it are never followed."""
    (tmp_path / "scratch").mkdir()
    (tmp_path / "home-cache").symlink_to(tmp_path / "scratch", target_is_directory=True)
    monkeypatch.setenv("LMPROBE_CACHE", str(tmp_path / "home-cache"))
    from lmprobe.storage.cache import cache_budget

    assert cache_budget(None, "a remote", announce=False) > 0
    cache = BoundedCache(_download, 300, key="acts", sizes={"p0": 100}, workers=1)
    cache.schedule(["p0"])
    assert cache.get("p0").read_bytes() == b"\7" * 100
    assert (tmp_path / "scratch" / "stream" / "acts" / "pieces").is_dir()
    cache.release("p0")
    cache.close()


def test_a_deep_tree_planted_in_a_dead_readers_folder_is_left_not_a_traceback(tmp_path):
    """Another user plants folders deeper than Python's recursion limit where a dead reader's registration was:
    removing it stops at a depth the cache never uses (no RecursionError), and the reader reads. (The limit is
    lowered to 300 for the test, so that the tree stays shallow enough for any tool to remove.)"""
    root = tmp_path / "stream"
    deep = root / "acts" / "readers" / "123-dead"
    deep.mkdir(parents=True)
    fd = os.open(deep, os.O_RDONLY)
    for _ in range(400):
        os.mkdir("d", dir_fd=fd)
        sub = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = sub
    os.close(fd)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(300)
    try:
        _read_all(root)
    finally:
        sys.setrecursionlimit(limit)
        assert (deep / "d").is_dir()
        _remove_deep(deep)


def _remove_deep(path: Path) -> None:
    """Remove a chain of nested folders ``d/d/...`` without recursion (shutil.rmtree, pytest's too, recurses)."""
    fds = [os.open(path, os.O_RDONLY)]
    while True:
        try:
            fds.append(os.open("d", os.O_RDONLY, dir_fd=fds[-1]))
        except FileNotFoundError:
            break
    os.close(fds.pop())
    while fds:
        os.rmdir("d", dir_fd=fds[-1])
        os.close(fds.pop())
