"""Dataset files in a Hugging Face Hub repo, and the one ``hf://`` grammar lmprobe accepts.

    hf://[datasets/|models/]OWNER/NAME[@REVISION][/PATH/IN/REPO]

As in huggingface_hub's HfFileSystem, a URL without a type prefix names a model repo. A bare
``OWNER/NAME`` (not a URL) where a dataset is expected names a dataset repo.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..display import hide_credentials
from ..errors import (
    DatasetNotFoundError,
    HubError,
    HubUnreachableError,
    InvalidArgumentError,
    ShardMissingError,
)
from ..paths import check_relpath
from ..retry import TRANSIENT_HTTP_STATUS, RetryPolicy, call_with_retry, describe

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


def hub_read_policy() -> RetryPolicy:
    """Reads from the Hub retry dropped connections and 429/5xx answers."""
    return RetryPolicy(retry_on_exceptions=transport_errors(), retry_on_status_codes=TRANSIENT_HTTP_STATUS,
                       max_retries=3, base_wait=1.0)


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
    """
    if not url.startswith("hf://"):
        raise InvalidArgumentError(f"{url!r} is not an hf:// URL")
    rest = url[len("hf://") :]
    repo_type = "model"
    for prefix, kind in _TYPE_PREFIXES.items():
        if rest.startswith(prefix):
            rest, repo_type = rest[len(prefix) :], kind
            break
    else:
        if rest.startswith("spaces/"):
            raise InvalidArgumentError(f"{url}: lmprobe reads dataset and model repos, not Spaces")
    parts = rest.strip("/").split("/")
    if len(parts) < 2:
        raise InvalidArgumentError(f"{url}: expected hf://[datasets/|models/]OWNER/NAME[@REVISION][/PATH]")
    name, _, rev = parts[1].partition("@")
    repo_id = f"{parts[0]}/{name}"
    if not REPO_ID_RE.match(repo_id):
        raise InvalidArgumentError(f"{url}: {repo_id!r} is not a valid repo id")
    sub = "/".join(parts[2:])
    if sub:
        check_relpath(sub, "path in the repo")
    if revision and rev and revision != rev:
        raise InvalidArgumentError(f"{url} names revision {rev!r} but revision={revision!r} was passed")
    return HubRef(repo_id, repo_type, revision or rev or None, sub)


def parse_dataset_ref(path: Any, revision: str | None = None) -> HubRef | None:
    """A dataset on the Hub named by ``path`` (an hf:// URL, or OWNER/NAME that is not a local path); else None.

    OWNER/NAME is local when it exists, or when OWNER is a folder here (a mistyped local path must
    be a local "does not exist", not a Hub request); ``hf://datasets/OWNER/NAME`` is always the Hub.
    """
    s = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(s, str):
        return None
    if s.startswith("hf://"):
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
    try:
        info = call_with_retry(lambda: api.repo_info(ref.repo_id, repo_type=ref.repo_type, revision=ref.revision,
                                                     files_metadata=False), policy=hub_read_policy())
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
        if hub_read_policy().is_transient(exc):
            raise _unreachable(ref, exc) from exc
        raise
    return info.sha, [s.rfilename for s in (info.siblings or [])]


class HubFiles:
    """Files of a Hub repo (under ``ref.path``), downloaded on first use into the Hugging Face cache.

    Every file comes from the commit the revision pointed at when this object was made, even if
    the branch moves on.
    """

    def __init__(self, ref: HubRef, *, token: str | bool | None = None):
        self.token = token
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

    def _call(self, fn: Any, rel: str) -> Any:
        """``fn()`` with the Hub's retries; a missing file or an unreachable Hub as lmprobe's errors."""
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

        try:
            return call_with_retry(fn, policy=hub_read_policy())
        except LocalEntryNotFoundError as exc:  # not in the cache, and the Hub could not be asked
            raise _unreachable(self.ref, exc) from exc
        except EntryNotFoundError:
            raise ShardMissingError(self.missing_hint(rel)) from None
        except Exception as exc:
            if hub_read_policy().is_transient(exc):
                raise _unreachable(self.ref, exc) from exc
            raise

    def fetch(self, rel: str, *, what: str = "file") -> Path:
        from huggingface_hub import hf_hub_download

        check_relpath(rel, what)
        return Path(self._call(lambda: hf_hub_download(self.ref.repo_id, self.repo_path(rel), repo_type=self.ref.repo_type,
                                                       revision=self.commit, token=self.token), rel))

    def download(self, rel: str, dst: Path) -> None:
        """Download ``rel`` (at the pinned commit) to ``dst``, outside the Hugging Face cache (bounded caches)."""
        import shutil
        import tempfile

        from huggingface_hub import hf_hub_download

        check_relpath(rel, "file")
        scratch = Path(tempfile.mkdtemp(prefix=".download-", dir=dst.parent))
        try:
            got = self._call(lambda: hf_hub_download(self.ref.repo_id, self.repo_path(rel), repo_type=self.ref.repo_type,
                                                     revision=self.commit, token=self.token, local_dir=scratch), rel)
            os.replace(got, dst)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)  # hf_hub_download's own metadata for local_dir

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        """Bytes ``start:end`` of ``rel`` at the pinned commit, with one HTTP range request."""
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        check_relpath(rel, "file")
        if end <= start:
            return b""
        url = hf_hub_url(self.ref.repo_id, self.repo_path(rel), repo_type=self.ref.repo_type, revision=self.commit)
        headers = {**build_hf_headers(token=self.token), "Range": f"bytes={start}-{end - 1}"}

        def get() -> bytes:
            r = get_session().get(url, headers=headers, follow_redirects=True)
            if r.status_code == 404:
                raise ShardMissingError(self.missing_hint(rel))
            hf_raise_for_status(r)
            if r.status_code != 206 or len(r.content) != end - start:
                raise HubError(f"{self}: a range request for bytes {start}-{end} of {rel} got {len(r.content)} bytes "
                               f"(status {r.status_code})")
            return r.content

        return self._call(get, rel)

    def fetch_optional(self, rel: str, *, what: str = "file") -> Path | None:
        """``fetch``, or None when the repo has no such file."""
        return self.fetch(rel, what=what) if rel in self.repo_files else None

    def missing_hint(self, rel: str) -> str:
        return f"{rel} is not in {self}; the repo is incomplete (was its push interrupted? re-run `lmprobe push`)"
