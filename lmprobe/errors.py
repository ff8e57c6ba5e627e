"""The project's exceptions.

Each class also inherits the builtin exception users already catch, so ``except ValueError`` or
``except FileNotFoundError`` keeps working around lmprobe calls.
"""

from __future__ import annotations


class LmprobeError(Exception):
    """Base class of every error lmprobe raises on purpose."""


class FormatError(LmprobeError, ValueError):
    """A dataset (or its metadata) does not follow the lmprobe format 2.0."""


class UnsafePathError(FormatError):
    """Metadata names a file outside the dataset root, or a pattern that is not a plain format string."""


class DatasetNotFoundError(LmprobeError, FileNotFoundError):
    """No lmprobe dataset at the given path."""


class ShardMissingError(LmprobeError, FileNotFoundError):
    """A shard named by the index is not on disk."""


class ColumnTypeError(LmprobeError, TypeError):
    """A value does not fit the type of its index column."""


class OutputExistsError(LmprobeError, FileExistsError):
    """The output folder already holds something that would be overwritten."""


class ResumeMismatchError(LmprobeError, ValueError):
    """A partial output was written with a different configuration than the one asked for now."""


class ValidationError(LmprobeError, ValueError):
    """``lmprobe validate`` found problems; ``.problems`` lists every one of them."""

    def __init__(self, path: str, problems: list[str]):
        self.path = path
        self.problems = list(problems)
        head = f"{path}: {len(self.problems)} problem(s)"
        super().__init__(head + "\n" + "\n".join(f"  - {p}" for p in self.problems))
