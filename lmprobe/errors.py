"""Every exception lmprobe raises on purpose.

Each class also inherits the builtin exception users already catch, so ``except ValueError`` or
``except FileNotFoundError`` keeps working around lmprobe calls, and carries what it is about
(a path, a layer, a repo id) as attributes where that helps a caller.

The command line prints an ``LmprobeError`` as one line and exits 2: it is the user's input or
environment that is wrong, and the message says what to do. Any other exception is a bug in
lmprobe and keeps its traceback.
"""

from __future__ import annotations


class LmprobeError(Exception):
    """Base class of every error lmprobe raises on purpose."""


# ---------------------------------------------------------------------------------------------- input


class InvalidArgumentError(LmprobeError, ValueError):
    """An argument has a value lmprobe cannot use (a size, a layer spec, a setting)."""


class LayerNotFoundError(LmprobeError, KeyError):
    """A layer (or hookpoint) that the dataset or model does not have."""

    def __init__(self, message: str, *, layer: object = None, available: object = None):
        super().__init__(message)
        self.layer = layer
        self.available = available

    def __str__(self) -> str:  # KeyError quotes its message; this one is a sentence
        return str(self.args[0]) if self.args else ""


class PromptError(LmprobeError, ValueError):
    """The prompts cannot be used as given; the message names the line and what to fix."""


class TokenError(LmprobeError, ValueError):
    """Prompts cannot be encoded as asked."""


class ExtractionError(LmprobeError, ValueError):
    """An extraction setting is invalid; raised before the model loads."""


class PeerStoppedError(LmprobeError, ConnectionError):
    """Another rank of a ``torchrun`` job stopped (killed, its node lost): this rank stops too, and the same command
    run again on every node resumes. ``.rank`` is the rank that stopped (None: not known)."""

    def __init__(self, message: str, *, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class ModelError(LmprobeError, ValueError):
    """The model cannot do what was asked (no LM head, unknown block layout, bad layer, ...)."""


class NnsightError(LmprobeError, RuntimeError):
    """nnsight is missing, not configured, or a remote batch kept failing."""


class ProbeError(LmprobeError, ValueError):
    """A probing request that cannot work (no labels, one class, pooling not possible, ...)."""


class TensorDictError(LmprobeError, TypeError):
    """A dict of tensors holds something that is not an array, or a key that cannot be flattened."""


# ---------------------------------------------------------------------------------------------- datasets


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


class OutputInUseError(LmprobeError, BlockingIOError):
    """Another live process is writing the same output."""

    def __init__(self, message: str, *, path: object = None, pid: int | None = None):
        super().__init__(message)
        self.path = path
        self.pid = pid

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ResumeMismatchError(LmprobeError, ValueError):
    """A partial output was written with a different configuration than the one asked for now."""


class OtherExtractionError(OutputInUseError, ResumeMismatchError):
    """A Hub folder holds the job marker of an extraction with other settings: a job writing it now, or a killed one
    that left a partial output (the marker cannot tell which)."""


class ValidationError(LmprobeError, ValueError):
    """A dataset does not validate; ``.problems`` lists every problem found."""

    def __init__(self, path: str, problems: list[str]):
        self.path = path
        self.problems = list(problems)
        head = f"{path} does not validate: {len(self.problems)} problem(s): "
        super().__init__(head + "; ".join(self.problems))


class OutOfSpaceError(LmprobeError, OSError):
    """The output's disk is full, or would be: the message says how much is needed."""


# ---------------------------------------------------------------------------------------------- artefacts


class SaevError(LmprobeError, ValueError):
    """A saev export or folder is invalid."""


class SaelensError(LmprobeError, ValueError):
    """A SAELens activation cache is invalid, or a dataset cannot be exported to one."""


class DictionaryError(LmprobeError, ValueError):
    """An SAE dictionary (meta.json, a layer's encoder or bias) is missing or invalid, or an SAE cannot be exported."""


class AttachmentError(LmprobeError, ValueError):
    """An artefact published beside a dataset (a saev export, an SAE dictionary) is invalid."""


# ---------------------------------------------------------------------------------------------- storage


class PushError(LmprobeError, RuntimeError):
    """A push failed after its retries. Re-running the same push resumes it."""


class HubError(LmprobeError, OSError):
    """The Hub could not be reached, or refused a request, when reading from it."""


class HubUnreachableError(HubError):
    """No answer from the Hub at all (no network, a wrong HF_ENDPOINT): ``.endpoint``, ``.repo_id`` and ``.reason``
    let a caller say what to do in its own terms."""

    def __init__(self, message: str, *, endpoint: str = "", repo_id: str = "", reason: str = ""):
        super().__init__(message)
        self.endpoint, self.repo_id, self.reason = endpoint, repo_id, reason

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class HubBusyError(HubError):
    """The Hub asks for a longer wait than lmprobe takes (``Retry-After: 100000``): ``.what`` was asked,
    ``.asked`` seconds from ``.status`` (an HTTP status), until ``.until`` (UTC, as text), so that a caller can
    say how to go on in its own terms."""

    def __init__(self, message: str, *, what: str = "", status: int | None = None, asked: float = 0.0,
                 until: str = ""):
        super().__init__(message)
        self.what, self.status, self.asked, self.until = what, status, asked, until

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ObjectStoreError(LmprobeError, OSError):
    """Object storage could not be reached or written after retries."""
