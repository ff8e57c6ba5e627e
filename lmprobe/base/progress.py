"""How lmprobe tells the user what it is doing: the ``lmprobe`` logger, and progress of long work.

Every module logs through ``logging.getLogger(__name__)``, a child of the ``lmprobe`` logger, whose
handlers show its messages. Like huggingface_hub's, the ``lmprobe`` logger comes
with a handler of its own (plain messages on stderr) and is quiet by default in library use: it
shows warnings, and ``logging.getLogger("lmprobe").setLevel(logging.INFO)`` shows what the
command line shows (what is about to be written, what was pushed). The command line shows them
(:func:`messages_shown`); ``quiet`` / ``--quiet`` says nothing either way. An application may
replace the handler.

Progress is a tqdm bar on a terminal or in a notebook. Anywhere else (a log file, a Slurm job, a pipe) bars
would write escape codes and carriage returns, so ``Progress`` logs one line every
``LMPROBE_PROGRESS_INTERVAL`` seconds instead (default 30): what is done, the rate and the time
left. Third-party bars (huggingface_hub's uploads and downloads, transformers' "Loading weights")
are switched off where ours would not be drawn (``third_party_bars``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .units import format_size

#: the package's logger: every module's ``logging.getLogger(__name__)`` is a child of it, so its handler and
#: level apply to them all (``lmprobe/__init__.py`` imports this module, so the handler is there from the start)
package_logger = logging.getLogger("lmprobe")
logger = logging.getLogger(__name__)

#: seconds between progress lines when stderr is not a terminal (LMPROBE_PROGRESS_INTERVAL overrides it)
DEFAULT_INTERVAL = 30.0


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record comes (notebooks and pytest replace it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


if not package_logger.handlers:
    _handler = _StderrHandler()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    package_logger.addHandler(_handler)
    package_logger.setLevel(logging.WARNING)  # quiet in library use; the command line shows INFO (messages_shown)
    package_logger.propagate = False  # one copy of each line, even when the application configures the root logger


@contextmanager
def messages_shown() -> Iterator[None]:
    """The ``lmprobe`` logger's INFO messages shown for the block (a command of the command line), unless the
    application set a level of its own; the level it had comes back after."""
    before = package_logger.level
    if before == logging.WARNING:
        package_logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        package_logger.setLevel(before)


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel, where tqdm draws its bars as widgets."""
    shell = sys.modules.get("IPython")
    get = getattr(shell, "get_ipython", None)
    return get is not None and type(get()).__name__ == "ZMQInteractiveShell"


def on_terminal() -> bool:
    """Whether bars are drawn: stderr is a terminal, or this is a notebook; else (a file, a pipe) progress lines are
    logged."""
    try:
        return sys.stderr.isatty() or in_notebook()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False


def progress_interval() -> float:
    """Seconds between progress lines off a terminal: LMPROBE_PROGRESS_INTERVAL, else 30."""
    raw = os.environ.get("LMPROBE_PROGRESS_INTERVAL")
    try:
        value = float(raw) if raw else DEFAULT_INTERVAL
    except ValueError:
        return DEFAULT_INTERVAL
    return max(value, 0.0)


def format_duration(seconds: float) -> str:
    """``45s``, ``12m05s``, ``3h07m``.

    >>> format_duration(45.2), format_duration(725), format_duration(11250)
    ('45s', '12m05s', '3h07m')
    """
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """Progress of long work: ``update(n, tokens=...)`` as it goes, ``close()`` at the end (or ``with``).

    On a terminal it is a tqdm bar. Elsewhere it logs, every ``interval`` seconds, a line such as
    ``extract: 1,024/48,000 prompts (2.1%), 20,480 tokens, 512 tok/s, 25.6 prompts/s, ETA 30m40s``.
    ``quiet`` shows nothing. ``unit="B"`` counts bytes (shown as sizes).

    >>> with Progress(10, desc="demo", unit="item", quiet=True) as bar:   # doctest: +SKIP
    ...     bar.update(3)
    """

    def __init__(self, total: int | None, *, desc: str, unit: str, initial: int = 0, quiet: bool = False,
                 tokens: bool = False, interval: float | None = None):
        self.total, self.desc, self.unit = total, desc, unit
        self.done, self.initial, self.tokens, self.count_tokens = initial, initial, 0, tokens
        self.interval = progress_interval() if interval is None else interval
        self.started = self.last_line = time.monotonic()
        self.lines, self.logged = 0, initial
        self.note: str | None = None
        self.bar = None
        self.quiet = quiet
        if not quiet and on_terminal():
            from tqdm.auto import tqdm

            scale = unit == "B"
            self.bar = tqdm(total=total, initial=initial, unit=unit, unit_scale=scale, unit_divisor=1024 if scale else 1000,
                            desc=desc, dynamic_ncols=True, smoothing=0.1)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def update(self, n: int = 1, *, tokens: int = 0, note: str | None = None) -> None:
        """``n`` more units done (and ``tokens`` more tokens, for work that counts them); ``note``: where the work
        stands, shown beside the numbers (``document 1,204``)."""
        self.done += n
        self.tokens += tokens
        if note is not None:
            self.note = note
        if self.quiet:
            return
        if self.bar is not None:
            post = []
            if self.count_tokens:
                post.append(f"{self.tokens / max(time.monotonic() - self.started, 1e-9):,.0f} tok/s")
            if self.note:
                post.append(self.note)
            if post:
                self.bar.set_postfix_str(", ".join(post), refresh=False)
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.last_line >= self.interval and logger.isEnabledFor(logging.INFO):
            self.last_line, self.logged = now, self.done
            self.lines += 1
            logger.info(self.line(now))

    def _amount(self, n: float) -> str:
        return format_size(int(n)) if self.unit == "B" else f"{int(n):,}"

    def line(self, now: float | None = None) -> str:
        """The progress line as it would be logged now."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self.started, 1e-9)
        rate = (self.done - self.initial) / elapsed
        unit = "" if self.unit == "B" else f" {self.unit}s"
        if self.total:
            head = f"{self._amount(self.done)}/{self._amount(self.total)}{unit} ({100 * self.done / self.total:.1f}%)"
        else:
            head = f"{self._amount(self.done)}{unit}"
        bits = [head]
        if self.count_tokens and self.unit != "tok":
            bits.append(f"{self.tokens:,} tokens, {self.tokens / elapsed:,.0f} tok/s")
        bits.append(f"{format_size(int(rate))}/s" if self.unit == "B" else f"{rate:,.1f} {self.unit}s/s")
        if self.total and rate > 0 and self.done < self.total:
            bits.append(f"ETA {format_duration((self.total - self.done) / rate)}")
        elif self.total and self.done >= self.total:
            bits.append(f"done in {format_duration(elapsed)}")
        if self.note:
            bits.append(self.note)
        return f"{self.desc}: " + ", ".join(bits)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif not self.quiet and self.lines and self.logged != self.done:  # a log that showed progress shows its end
            logger.info(self.line())
        self.quiet = True  # closed: later updates say nothing


@contextmanager
def third_party_bars(show: bool) -> Iterator[None]:
    """huggingface_hub's and transformers' own progress bars on (``show``) or off for the block, restored after.

    Callers pass ``show=not quiet and on_terminal()``: in a log file those bars are escape codes.
    """
    restore = []
    hub_off = None
    try:
        from huggingface_hub import utils as hub_utils

        hub_off = hub_utils.are_progress_bars_disabled()
        if not show and not hub_off:
            hub_utils.disable_progress_bars()
            restore.append(hub_utils.enable_progress_bars)
    except ImportError:
        pass
    if not show and "transformers" in sys.modules:  # never imported just for this
        from transformers.utils import logging as hf_logging

        if hf_logging.is_progress_bar_enabled():
            hf_logging.disable_progress_bar()
            restore.append(hf_logging.enable_progress_bar)
    try:
        yield
    finally:
        for fn in restore:
            fn()
        if hub_off and not hub_utils.are_progress_bars_disabled():
            # transformers' enable_progress_bar() turns huggingface_hub's on too: off they stay, as someone (a
            # running upload) had them
            hub_utils.disable_progress_bars()
