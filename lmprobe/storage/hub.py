"""Dataset files in a Hugging Face Hub repo, and the one ``hf://`` grammar lmprobe accepts.

    hf://[datasets/|models/]OWNER/NAME[@REVISION][/PATH/IN/REPO]

As in huggingface_hub's HfFileSystem, a URL without a type prefix names a model repo. A bare
``OWNER/NAME`` (not a URL) where a dataset is expected names a dataset repo.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import io
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import unquote

from ..base.display import hide_credentials
from ..base.paths import check_relpath
from ..base.retry import (
    TRANSIENT_HTTP_STATUS,
    RetryLog,
    RetryPolicy,
    call_with_retry,
    describe,
    retry_after,
    status_code,
)
from ..errors import (
    DatasetNotFoundError,
    HubBusyError,
    HubError,
    HubUnreachableError,
    InvalidArgumentError,
    LmprobeError,
    OutOfSpaceError,
    ShardMissingError,
)
from .urls import hub_path, is_hub_url

logger = logging.getLogger(__name__)

#: seconds without a byte after which a read from the Hub is abandoned and tried again (a stalled connection)
READ_TIMEOUT = 60.0
#: the longest wait between two tries, whatever a server's Retry-After asks
MAX_WAIT = 60.0
#: how long a command (info, pull, export-saev, ...) keeps trying through 429/5xx answers and dropped
#: connections before it gives up with one line; the training reader's default (``ShardStream(deadline=)``)
COMMAND_DEADLINE = 300.0
READER_DEADLINE = 1800.0
#: seconds before the first retry of a read (doubled for each further one, up to ``MAX_WAIT``)
BASE_WAIT = 1.0
#: statuses huggingface_hub's own downloads wait out themselves: lmprobe does not try those again on top
_HF_RETRIES = frozenset({408, 429})

REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_TYPE_PREFIXES = {"datasets/": "dataset", "models/": "model"}


def transport_errors() -> tuple[type[BaseException], ...]:
    """Exception classes of a dropped or refused connection, for whichever HTTP clients are installed."""
    import importlib

    classes: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)),
                          ("requests.exceptions", ("ConnectionError", "Timeout")),
                          ("urllib3.exceptions", ("ProtocolError", "NewConnectionError"))):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        classes += [getattr(mod, n) for n in names if isinstance(getattr(mod, n, None), type)]
    return tuple(classes)


def hub_read_policy(*, deadline: float | None = COMMAND_DEADLINE, max_retries: int = 3,
                    base_wait: float | None = None, wait_what_is_asked: bool = False) -> RetryPolicy:
    """Reads from the Hub retry dropped connections, timeouts and 429/5xx answers: waits of at most ``MAX_WAIT``,
    no try after ``deadline`` seconds. Commands give up after ``max_retries``, and at once when the server asks for
    a wait longer than ``MAX_WAIT`` (``Retry-After: 100000``: one line naming the server's time, ``busy``); the
    training reader (``reader_policy``, ``wait_what_is_asked``) cuts such a wait to ``MAX_WAIT`` and waits a storm
    out until its deadline."""
    return RetryPolicy(retry_on_exceptions=transport_errors(), retry_on_status_codes=TRANSIENT_HTTP_STATUS,
                       max_retries=max_retries, base_wait=BASE_WAIT if base_wait is None else base_wait,
                       max_wait=MAX_WAIT, deadline=deadline,
                       longest_asked_wait=None if wait_what_is_asked else MAX_WAIT)


def reader_policy(deadline: float = READER_DEADLINE, *, base_wait: float | None = None) -> RetryPolicy:
    """The training reader's: 429/5xx answers and dropped or stalled connections are waited out, however many,
    for ``deadline`` seconds from the first failed try of a piece."""
    return hub_read_policy(deadline=deadline, max_retries=1 << 30, base_wait=base_wait, wait_what_is_asked=True)


def busy(what: str, exc: BaseException, asked: float) -> HubBusyError:
    """One line: the Hub asks for a longer wait than a command takes; the server's time and how to go on."""
    import datetime

    until = (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=min(asked, 10**9))
             ).strftime("%Y-%m-%d %H:%M UTC")
    status = status_code(exc)
    hours = f", {asked / 3600:.1f} h" if asked >= 3600 else ""
    return HubBusyError(f"{what}: the Hub at {endpoint_for_messages()} answers HTTP {status} and asks lmprobe to "
                        f"wait {asked:.0f} s{hours}, until {until}; a command waits at most {MAX_WAIT:.0f} s, so it "
                        f"stops here: run the same command again after {until} (what is already fetched is kept)",
                        what=what, status=status, asked=asked, until=until)


@dataclass(frozen=True)
class _Guard:
    what: str
    policy: RetryPolicy
    start: float


_GUARD: contextvars.ContextVar[_Guard | None] = contextvars.ContextVar("lmprobe_hub_guard", default=None)


def _cap_waits(response: Any) -> None:
    """A response hook on huggingface_hub's HTTP client, active inside ``guarded``: a 429/5xx answer's
    Retry-After (and rate-limit reset) is cut to the policy's ``max_wait``, said in the log, and past the
    deadline the call ends with one line (huggingface_hub would otherwise sleep what the server asks, 27
    hours for ``Retry-After: 100000``)."""
    guard = _GUARD.get()
    if guard is None or response.status_code not in TRANSIENT_HTTP_STATUS:
        return
    cap = int(guard.policy.max_wait)
    headers = response.headers
    asked = retry_after(response_error(response))
    if guard.policy.asks_too_long(response_error(response)) is not None:
        raise busy(guard.what, response_error(response), asked)
    if asked is not None and asked > cap:
        headers["Retry-After"] = str(cap)
    for key in [k for k in headers if k.lower() == "ratelimit"]:
        headers[key] = re.sub(r"t=(\d+)", lambda m: f"t={min(int(m.group(1)), cap)}", headers[key])
    elapsed = time.monotonic() - guard.start
    if guard.policy.deadline is not None and elapsed > guard.policy.deadline:
        raise HubError(f"{guard.what}: the Hub still answers HTTP {response.status_code} after {elapsed:.0f} s "
                       f"(lmprobe waits {guard.policy.deadline:.0f} s); try again later")
    logger.warning("lmprobe: %s: HTTP %d from the Hub; trying again in at most %d s%s", guard.what,
                   response.status_code, cap, f" (it asked for {asked:.0f} s)" if asked and asked > cap else "")


def response_error(response: Any) -> BaseException:
    """An exception carrying ``response`` (what ``retry_after`` and ``describe`` read)."""
    exc = HubError(f"HTTP {response.status_code}")
    exc.response = response  # type: ignore[attr-defined]
    return exc


@contextlib.contextmanager
def guarded(what: str, policy: RetryPolicy) -> Iterator[None]:
    """huggingface_hub calls made inside have their waits capped and the policy's deadline (``_cap_waits``)."""
    from huggingface_hub.utils import get_session

    session = get_session()
    hooks = session.event_hooks
    if _cap_waits not in hooks.get("response", []):
        hooks.setdefault("response", []).append(_cap_waits)
        session.event_hooks = hooks
    token = _GUARD.set(_Guard(what, policy, time.monotonic()))
    try:
        yield
    finally:
        _GUARD.reset(token)


@dataclass(frozen=True)
class HubRef:
    """A repo on the Hub, optionally a revision and a path inside it."""

    repo_id: str
    repo_type: str = "dataset"
    revision: str | None = None
    path: str = ""

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        sub = f"/{self.path}" if self.path else ""
        return f"hf://{self.repo_type}s/{self.repo_id}{rev}{sub}"


def parse_hf_url(url: str, *, revision: str | None = None) -> HubRef:
    """Parse ``hf://[datasets/|models/]OWNER/NAME[@REV][/PATH]`` (no prefix: a model repo).

    >>> parse_hf_url("hf://datasets/me/acts@v1/saev/abc")
    HubRef(repo_id='me/acts', repo_type='dataset', revision='v1', path='saev/abc')
    >>> parse_hf_url("hf://me/my-sae").repo_type
    'model'
    >>> parse_hf_url("hf://datasets/me/acts@refs/pr/1/saev").revision   # a PR's ref, as huggingface_hub reads it
    'refs/pr/1'
    """
    if not is_hub_url(url):
        raise InvalidArgumentError(f"{url!r} is not an hf:// URL")
    rest = hub_path(url)
    repo_type = "model"
    for prefix, kind in _TYPE_PREFIXES.items():
        if rest.startswith(prefix):
            rest, repo_type = rest[len(prefix) :], kind
            break
    else:
        if rest.startswith("spaces/"):
            raise InvalidArgumentError(f"{url}: lmprobe reads dataset and model repos, not Spaces")
    parts = rest.strip("/").split("/", 2)
    if len(parts) < 2:
        raise InvalidArgumentError(f"{url}: expected hf://[datasets/|models/]OWNER/NAME[@REVISION][/PATH]")
    name, at, rev = parts[1].partition("@")
    repo_id = f"{parts[0]}/{name}"
    if not REPO_ID_RE.match(repo_id):
        raise InvalidArgumentError(f"{url}: {repo_id!r} is not a valid repo id")
    sub = parts[2] if len(parts) > 2 else ""
    if at:
        rev, sub = _split_revision(url, f"{rev}/{sub}" if sub else rev)
    if sub:
        _check_repo_folder(url, sub, str(HubRef(repo_id, repo_type, rev or None)))
    if revision and rev and revision != rev:
        raise InvalidArgumentError(f"{url} names revision {rev!r} but revision={revision!r} was passed")
    return HubRef(repo_id, repo_type, revision or rev or None, sub)


#: the Hub's revisions with slashes, as huggingface_hub reads them (``SPECIAL_REFS_REVISION_REGEX``): a PR's ref and a
#: conversion's; any other revision is one path component (a branch with a slash is written with %2F)
_SPECIAL_REF_RE = re.compile(r"^refs/(?:pr/\d+|convert/\w+)(?=/|$)")


def _split_revision(url: str, rev_path: str) -> tuple[str, str]:
    """``REV[/PATH]`` after the ``@``: the revision and the path in the repo."""
    first, _, rest = rev_path.partition("/")
    if "%" in first:  # refs%2Fpr%2F1, feature%2Fx: a quoted revision is one component
        rev = unquote(first)
    elif first == "refs":
        m = _SPECIAL_REF_RE.match(rev_path)
        if m is None:
            raise InvalidArgumentError(f"{url}: a revision under refs/ is refs/pr/N or refs/convert/NAME; write another "
                                       "revision with slashes quoted (@refs%2Fname)")
        rev, rest = m.group(0), rev_path[m.end():].lstrip("/")
    else:
        rev = first
    if not rev or rev.strip() != rev or any(c in rev for c in "\x00\n\r"):
        raise InvalidArgumentError(f"{url}: the revision after '@' is empty or not a revision; write @BRANCH, @TAG, "
                                   "@COMMIT or @refs/pr/N, or leave it out for main")
    return rev, rest


#: a pull request's ref: made by opening the pull request, then written to like a branch; never created as a branch
#: (the Hub answers 400 to a branch of that name)
_PULL_REQUEST_RE = re.compile(r"^refs/pr/\d+$")


def is_pull_request(revision: str | None) -> bool:
    """Whether ``revision`` is a pull request's ref, ``refs/pr/N``.

    >>> is_pull_request("refs/pr/3"), is_pull_request("main"), is_pull_request("refs/convert/parquet")
    (True, False, False)
    """
    return isinstance(revision, str) and _PULL_REQUEST_RE.match(revision) is not None


def check_pull_request_open(ref: HubRef, *, token: str | bool | None = None) -> None:
    """A write to ``ref``, a pull request's ref, needs the pull request open: one request, and a one-line
    InvalidArgumentError naming the way out when the repo has no such ref (nothing is created for it)."""
    try:
        resolve_commit(ref, token=token)
    except DatasetNotFoundError as exc:
        raise InvalidArgumentError(f"{ref}: {exc}; a pull request's ref exists once the pull request is open: open "
                                   "the pull request first, e.g. with huggingface_hub.create_pull_request, or write "
                                   "to a branch (@BRANCH, created when missing)") from None


def _check_repo_folder(url: str, sub: str, repo_url: str) -> None:
    """A path in a repo is one spelling of one folder: no empty or '.' component (``a//b`` was committed under
    ``a//b/``, ``/.`` ran a whole extraction and then failed), and not lmprobe's own working folders."""
    comps = sub.split("/")
    if "" in comps or "." in comps:
        clean = "/".join(c for c in comps if c not in ("", "."))
        raise InvalidArgumentError(f"{url}: the path {sub!r} has an empty or '.' component; write "
                                   + (f"{repo_url}/{clean}" if clean else f"{repo_url} (the repo's root)"))
    if any(c.startswith(".lmprobe-") for c in comps):
        raise InvalidArgumentError(f"{url}: {sub!r} is inside a folder lmprobe keeps for its own work (.lmprobe-*); "
                                   "name another folder")
    check_relpath(sub, "path in the repo")


def parse_dataset_ref(path: Any, revision: str | None = None) -> HubRef | None:
    """A dataset on the Hub named by ``path`` (an hf:// URL, or OWNER/NAME that is not a local path); else None.

    OWNER/NAME is local when it exists, or when OWNER is a folder here (a mistyped local path must
    be a local "does not exist", not a Hub request); ``hf://datasets/OWNER/NAME`` is always the Hub.
    """
    s = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(s, str):
        return None
    if is_hub_url(s):
        return parse_hf_url(s, revision=revision)
    if os.path.exists(s):
        return None
    if REPO_ID_RE.match(s) and not os.path.isdir(s.split("/", 1)[0]):  # out/missing with ./out here: local
        return HubRef(s, "dataset", revision)
    return None


def check_repo_id(repo_id: str) -> str:
    if not isinstance(repo_id, str) or not REPO_ID_RE.match(repo_id):
        raise InvalidArgumentError(f"{repo_id!r} is not a repo id; use OWNER/NAME")
    return repo_id


def endpoint_for_messages() -> str:
    """HF_ENDPOINT as a message may print it: its user name and password hidden."""
    from huggingface_hub import constants

    return hide_credentials(constants.ENDPOINT)


def hub_api(token: str | bool | None = None):
    from huggingface_hub import HfApi

    return HfApi(token=token)


def _unreachable(ref: HubRef, exc: BaseException) -> HubUnreachableError:
    from huggingface_hub import constants

    return HubUnreachableError(
        f"cannot reach the Hub at {hide_credentials(constants.ENDPOINT)} to read {ref.repo_id} ({describe(exc)}); check the network "
        "(or HF_ENDPOINT), or read a local copy (made by `lmprobe pull` while the Hub answers)",
        endpoint=hide_credentials(constants.ENDPOINT), repo_id=ref.repo_id, reason=describe(exc))


def resolve_commit(ref: HubRef, *, token: str | bool | None = None) -> tuple[str, list[str]]:
    """The commit the revision points at now, and the repo's file list there."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    api = hub_api(token)
    what = f"reading the description of {ref.repo_id} from the Hub"
    log = RetryLog()
    try:
        info = call_with_retry(lambda: api.repo_info(ref.repo_id, repo_type=ref.repo_type, revision=ref.revision,
                                                     files_metadata=False, timeout=READ_TIMEOUT),
                               policy=hub_read_policy(), what=what, log=log)
    except RevisionNotFoundError:
        raise DatasetNotFoundError(f"{ref.repo_id} has no revision {ref.revision!r}") from None
    except (RepositoryNotFoundError, GatedRepoError):
        hint = ""
        if ref.repo_type == "model":
            hint = f"; a dataset repo is written hf://datasets/{ref.repo_id}"
        raise DatasetNotFoundError(
            f"no {ref.repo_type} repo {ref.repo_id!r} on the Hub (or it is private: log in or pass token=){hint}"
        ) from None
    except Exception as exc:
        if log.asked is not None:
            raise busy(what, exc, log.asked) from None
        if hub_read_policy().is_transient(exc):
            raise _unreachable(ref, exc) from exc
        raise
    return info.sha, [s.rfilename for s in (info.siblings or [])]


class HubFiles:
    """Files of a Hub repo (under ``ref.path``), downloaded on first use into the Hugging Face cache.

    Every file comes from the commit the revision pointed at when this object was made, even if
    the branch moves on. ``policy`` is how reads wait through 429/5xx answers and dropped
    connections (default: ``hub_read_policy()``, a command's); every request times out after
    ``READ_TIMEOUT`` seconds without a byte.
    """

    remote = True
    origin = None

    def __init__(self, ref: HubRef, *, token: str | bool | None = None, policy: RetryPolicy | None = None):
        self.token = token
        self.policy = policy
        commit, files = resolve_commit(ref, token=token)
        self.ref = replace(ref, revision=commit)
        self.commit = commit
        prefix = f"{ref.path}/" if ref.path else ""
        self.repo_files = [f[len(prefix) :] for f in files if f.startswith(prefix)]

    def __str__(self) -> str:
        sub = f"/{self.ref.path}" if self.ref.path else ""
        return f"hf://{self.ref.repo_type}s/{self.ref.repo_id}@{self.commit[:10]}{sub}"

    def repo_path(self, rel: str) -> str:
        return f"{self.ref.path}/{rel}" if self.ref.path else rel

    def _policy(self, policy: RetryPolicy | None) -> RetryPolicy:
        return policy or self.policy or hub_read_policy()

    def _gave_up(self, what: str, exc: BaseException, log: RetryLog, policy: RetryPolicy) -> HubError:
        """One line: the Hub kept failing a read, what was tried for how long, and what to do."""
        if log.asked is not None:
            return busy(what, exc, log.asked)
        endpoint = endpoint_for_messages()
        over = f" after {log.tries} tries over {log.seconds:.0f} s" if log.tries > 1 else ""
        limit = f" (lmprobe waits {policy.deadline:.0f} s)" if log.deadline_passed and policy.deadline else ""
        if status_code(exc) is not None:
            return HubError(f"the Hub at {endpoint} kept refusing {what} ({describe(exc)}){over}{limit}; "
                            "try again later (a training reader waits longer with deadline=)")
        return HubError(f"cannot reach the Hub at {endpoint} for {what} ({describe(exc)}){over}{limit}; "
                        "check the network (or HF_ENDPOINT) and try again, or use a local copy (`lmprobe pull`)")

    def _call(self, fn: Any, rel: str, what: str, policy: RetryPolicy | None = None) -> Any:
        """``fn()`` (a huggingface_hub download) with waits capped and a deadline; a missing file or an unreachable
        Hub as lmprobe's errors. huggingface_hub waits out 408/429 itself: lmprobe does not repeat its tries."""
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

        policy = self._policy(policy)
        ours = replace(policy, retry_on_status_codes=policy.retry_on_status_codes - _HF_RETRIES)
        log = RetryLog()
        try:
            with guarded(what, policy):
                return call_with_retry(fn, policy=ours, what=what, log=log)
        except LmprobeError:
            raise
        except LocalEntryNotFoundError as exc:  # not in the cache, and the Hub could not be asked (or refused)
            if isinstance(exc.__cause__, HubBusyError):
                raise exc.__cause__ from None
            raise self._gave_up(what, exc.__cause__ or exc, log, policy) from exc
        except EntryNotFoundError:
            raise ShardMissingError(self.missing_hint(rel)) from None
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                from huggingface_hub import constants

                raise OutOfSpaceError(f"the disk holding the Hugging Face cache {constants.HF_HUB_CACHE} is full "
                                      f"while {what}: free some space, or set HF_HOME to a larger disk") from exc
            if policy.is_transient(exc):
                raise self._gave_up(what, exc, log, policy) from exc
            raise
        except Exception as exc:
            if policy.is_transient(exc):
                raise self._gave_up(what, exc, log, policy) from exc
            raise

    def fetch(self, rel: str, *, what: str = "file") -> Path:
        from huggingface_hub import hf_hub_download

        check_relpath(rel, what)
        return Path(self._call(lambda: hf_hub_download(self.ref.repo_id, self.repo_path(rel), repo_type=self.ref.repo_type,
                                                       revision=self.commit, token=self.token), rel,
                               f"downloading {rel} from {self}"))

    def download(self, rel: str, dst: Path, *, policy: RetryPolicy | None = None) -> None:
        """Download ``rel`` (at the pinned commit) to ``dst``, outside the Hugging Face cache (bounded caches): one
        streamed request, resumed where it stopped if the connection drops."""
        check_relpath(rel, "file")
        with open(dst, "wb") as f:
            self._get(rel, None, None, f, policy)

    def read_range(self, rel: str, start: int, end: int, *, out: BinaryIO | None = None,
                   policy: RetryPolicy | None = None) -> bytes | None:
        """Bytes ``start:end`` of ``rel`` at the pinned commit, with one HTTP range request: returned, or written
        to the binary file ``out`` (streamed: memory stays small; a dropped connection resumes where it stopped).

        A 429/5xx answer, a dropped connection or a read that stalls for ``READ_TIMEOUT`` is tried again as
        ``policy`` says (waits cut to ``MAX_WAIT``, nothing after its deadline), each long wait logged.
        """
        check_relpath(rel, "file")
        if end <= start:
            return b"" if out is None else None
        return self._get(rel, start, end, out, policy)

    def _get(self, rel: str, start: int | None, end: int | None, out: BinaryIO | None,
             policy: RetryPolicy | None) -> bytes | None:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        url = hf_hub_url(self.ref.repo_id, self.repo_path(rel), repo_type=self.ref.repo_type, revision=self.commit)
        base = build_hf_headers(token=self.token)
        sink = out if out is not None else io.BytesIO()
        first = start or 0
        done = 0
        span = "" if start is None else f" bytes {start}-{end}"
        what = f"reading {rel}{span} from {self}"

        def attempt() -> None:
            nonlocal done
            headers = dict(base)
            ranged = start is not None or done > 0
            if ranged:
                headers["Range"] = f"bytes={first + done}-{'' if end is None else end - 1}"
            with get_session().stream("GET", url, headers=headers, follow_redirects=True,
                                      timeout=READ_TIMEOUT) as r:
                if r.status_code == 404:
                    raise ShardMissingError(self.missing_hint(rel))
                if r.status_code >= 400:
                    r.read()
                    hf_raise_for_status(r)
                if ranged and r.status_code != 206:
                    raise HubError(f"{self}: a range request for{span or ' the rest'} of {rel} was answered with "
                                   f"status {r.status_code}, not 206: the server ignores ranges")
                for chunk in r.iter_bytes(1 << 20):
                    sink.write(chunk)
                    done += len(chunk)
            if end is not None and first + done != end:
                raise HubError(f"{self}: a range request for{span} of {rel} got {done} bytes; the file is shorter "
                               "than the dataset's metadata says (was the repo changed?)")

        policy = self._policy(policy)
        log = RetryLog()
        try:
            call_with_retry(attempt, policy=policy, what=what, log=log)
        except LmprobeError:
            raise
        except Exception as exc:
            if policy.is_transient(exc):
                raise self._gave_up(what, exc, log, policy) from exc
            raise
        return sink.getvalue() if out is None else None

    def has(self, rel: str) -> bool:
        """Whether the repo holds ``rel`` at the pinned commit (its listing, read when opened)."""
        return rel in self.repo_files

    def listing(self) -> list[str]:
        """Every file under the folder at the pinned commit, relative to it."""
        return list(self.repo_files)

    def pin(self) -> None:
        """Nothing to fix: every file comes from the commit resolved when this object was made."""

    def missing_hint(self, rel: str) -> str:
        return f"{rel} is not in {self}; the repo is incomplete (was its push interrupted? re-run `lmprobe push`)"
