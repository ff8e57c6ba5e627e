"""One commit budget for a whole job: how many files a commit takes and how often the job may commit.

Pure arithmetic, no I/O: the committer (commits.py) follows it at run time and the job's plan
(extraction/plan.py, ``lmprobe extract --dry-run``) uses the same functions to say in advance how many
commits a job makes and how long its tail lasts, so that the two cannot disagree.

- **Commit sizes** follow huggingface_hub's large-folder uploader (``COMMIT_SIZE_SCALE``): a ladder from 20
  to 1,000 files, starting at 250, one step up after a commit that landed in under 40 s, one step down
  after a slow or failed one.
- **The rate** is one budget for the job, not one per rank: at most ``commits_per_hour`` commits in any
  hour (a sliding window, 100 by default, never above the Hub's ~128 an hour per repo, which everyone who
  writes to the repo shares).

At full size (W1 in docs/publishing.md: 10^9 tokens, 3 layers of an 8B model, 64 ranks) the job makes
23,232 files: 25 commits (250, 400, 600, then 1,000 each), where one committer per rank at 50 files a commit needed 465 commits,
five hours at the Hub's rate.
"""

from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass, field

from ..errors import InvalidArgumentError

#: files per commit, from huggingface_hub's large-folder uploader
COMMIT_LADDER = (20, 50, 75, 100, 125, 200, 250, 400, 600, 1000)
START_COMMIT_FILES = 250
MAX_COMMIT_FILES = COMMIT_LADDER[-1]
#: a commit that lands faster than this lets the next one take a step more files
FAST_COMMIT_SECONDS = 40.0
#: the Hub's limit on commits an hour to one repo (shared by everyone who writes to it)
HUB_COMMITS_PER_HOUR = 128
DEFAULT_COMMITS_PER_HOUR = 100
HOUR = 3600.0
#: closed shards a rank holds on its disk while they upload, at most (in_flight_files)
MAX_IN_FLIGHT_FILES = 8
IN_FLIGHT_BYTES = 16 * 1024**3


def _env_number(name: str, default: float, most: float, what: str) -> float:
    """The number in environment variable ``name`` (``default`` when unset), above 0 and at most ``most``."""
    raw = os.environ.get(name, str(default))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= most:
        raise InvalidArgumentError(f"{name}={raw!r}: {what}: give a number above 0 and at most {most:g}")
    return value


def commits_per_hour() -> float:
    """The job's commits an hour, all ranks together (``LMPROBE_HUB_COMMITS_PER_HOUR``, default 100, at most 128)."""
    return _env_number("LMPROBE_HUB_COMMITS_PER_HOUR", DEFAULT_COMMITS_PER_HOUR, HUB_COMMITS_PER_HOUR,
                       "the commits an hour of the whole job (the Hub takes 128 an hour for one repo)")


def hour_seconds() -> float:
    """Seconds in the Hub's hour (``LMPROBE_HUB_HOUR_SECONDS``, default 3600): a test knob only. Tests and
    benchmarks against the local Hub test server, which enforces its commit rate on a scaled clock (128 commits
    an "hour" of 60 s), scale the committer's clock the same way: the window, the wait for a fuller commit and
    what counts as a fast commit."""
    return _env_number("LMPROBE_HUB_HOUR_SECONDS", HOUR, HOUR,
                       "a test knob, the seconds of the Hub's hour on a scaled clock")


def in_flight_files(shard_bytes: int | None) -> int:
    """Closed shards a rank may hold on its disk while they upload: 8, fewer for large shards (at most 16 GiB
    of them, at least 2), so that a node's staging stays a few shards per rank whatever the dataset's size.

    >>> in_flight_files(None), in_flight_files(2**30), in_flight_files(4 * 2**30), in_flight_files(16 * 2**30)
    (8, 8, 4, 2)
    """
    if not shard_bytes:
        return MAX_IN_FLIGHT_FILES
    return max(2, min(MAX_IN_FLIGHT_FILES, IN_FLIGHT_BYTES // shard_bytes))


def next_commit_files(current: int, *, seconds: float | None) -> int:
    """The next commit's size after one of ``current`` files took ``seconds`` (None: it failed).

    >>> next_commit_files(250, seconds=12.0), next_commit_files(250, seconds=None), next_commit_files(1000, seconds=1)
    (400, 200, 1000)
    """
    i = max(k for k, n in enumerate(COMMIT_LADDER) if n <= max(current, COMMIT_LADDER[0]))
    if seconds is not None and seconds < FAST_COMMIT_SECONDS:
        return COMMIT_LADDER[min(i + 1, len(COMMIT_LADDER) - 1)]
    return COMMIT_LADDER[max(i - 1, 0)]


def commits_for(files: int, *, start: int = START_COMMIT_FILES) -> int:
    """Commits that take ``files`` files when every commit lands fast (the ladder climbs to 1,000 and stays).

    >>> commits_for(0), commits_for(250), commits_for(251), commits_for(23_232)
    (0, 1, 2, 25)
    """
    n, size = 0, start
    while files > 0:
        files -= size
        n += 1
        size = next_commit_files(size, seconds=0.0)
    return n


@dataclass
class CommitWindow:
    """At most ``per_hour`` commits in any hour (sliding), measured on the caller's clock.

    >>> w = CommitWindow(per_hour=2)
    >>> w.wait(0.0), w.record(0.0), w.wait(1.0), w.record(1.0), w.wait(2.0)
    (0.0, None, 0.0, None, 3598.0)
    """

    per_hour: float
    hour: float = HOUR
    starts: deque = field(default_factory=deque)

    def wait(self, now: float) -> float:
        """Seconds from ``now`` until one more commit may start."""
        while self.starts and self.starts[0] <= now - self.hour:
            self.starts.popleft()
        if len(self.starts) < math.floor(self.per_hour):
            return 0.0
        return self.starts[len(self.starts) - math.floor(self.per_hour)] + self.hour - now

    def record(self, now: float) -> None:
        """A commit started at ``now``."""
        self.starts.append(now)

    def landed(self, started: float, now: float) -> None:
        """The commit that started at ``started`` was answered at ``now``: it counts from then on. The Hub counts a
        commit when it gets it, some time after the client started it; counting from the answer keeps a client
        that waits out its window from ever being refused.

        >>> w = CommitWindow(per_hour=1)
        >>> w.record(0.0), w.landed(0.0, 2.0), w.wait(1.0)
        (None, None, 3601.0)
        """
        if started in self.starts:
            self.starts.remove(started)
        self.starts.append(now)
        self.starts = deque(sorted(self.starts))


def tail_seconds(commits: int, *, earlier: int, per_hour: float, commit_seconds: float) -> float:
    """Seconds to land ``commits`` commits one after the other, each taking ``commit_seconds``, when ``earlier``
    commits of the job already started within the last hour (a worst case: all of them just before).

    >>> tail_seconds(24, earlier=30, per_hour=100, commit_seconds=20.0)
    480.0
    >>> tail_seconds(3, earlier=99, per_hour=100, commit_seconds=20.0) > 3600
    True
    """
    window = CommitWindow(per_hour, starts=deque([0.0] * earlier))
    t = 0.0
    for _ in range(commits):
        t += window.wait(t)
        window.record(t)
        t += commit_seconds
    return t
