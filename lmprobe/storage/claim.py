"""One writer at a time in a folder of a Hub repo's branch: a job marker committed first, and every commit of the job
made on the revision the job last saw.

Two machines extracting into the same ``hf://`` folder at once used to interleave their commits: one job's texts
over the other's vectors, or a shard shorter than its index says. A job now commits a small
marker, ``<folder>/.lmprobe-job.json`` (a random job id, the fingerprint of the job's settings, when it started;
never a token), before any other commit, on the revision it read (``parent_commit``): of two jobs that read the
same revision, one commit lands and the other is answered 412. Every later commit of the job names the revision
the job last saw as its parent, so it lands only if nobody committed since; when the Hub answers 412 the marker is
read again: still this job's (the owner edited README.md meanwhile), the commit is tried again on the new
revision; another job's (it took the folder over), the job stops before publishing anything more, its index
included. The last commit (the one that publishes the index) removes the marker, so a finished dataset holds none.

A marker cannot tell a live job from a dead one. A job that finds another job's marker is refused, unless it is
the same work (the same settings fingerprint: a re-run of a killed job resumes and takes the marker over) or it
was asked to take the folder over (``--overwrite``, the documented way to clear a dead job's marker).

Costs at full size: one commit for the marker (one turn of the job's commit window, budget.py), nothing more per
commit while nobody else writes; each 412 costs one revision read, one paths-info and a download of the marker
(under 1 KiB) before the commit is tried again.

>>> claim = RepoClaim(api, "me/acts", "main", "", url="hf://datasets/me/acts", fingerprint="0" * 64)  # doctest: +SKIP
>>> claim.claim(take_over=False)                                    # the marker, committed  # doctest: +SKIP
>>> claim.commit(lambda parent: api.create_commit(..., parent_commit=parent))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..base.retry import status_code
from ..base.safeio import loads
from ..errors import FormatError, OtherExtractionError, OutputInUseError
from ..format.staging import describe_mismatch

logger = logging.getLogger(__name__)

#: the job marker's name, in the folder the job writes
MARKER = ".lmprobe-job.json"
#: a marker larger than this is not read (it is not one lmprobe wrote); settings larger than half of it are not
#: recorded in it (a refusal then says "other settings" without naming them)
MAX_MARKER_BYTES = 64 * 1024
#: the longest list of differing settings a refusal quotes from a marker (untrusted text)
MAX_MISMATCH_CHARS = 400
#: tries of one commit whose parent kept moving under it (someone else committing to the repo all the time)
MAX_PARENT_TRIES = 20

_HEX = re.compile(r"[0-9a-f]{8,64}")
_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


@dataclass(frozen=True)
class JobMarker:
    """What the marker says: which job writes the folder, the work it does (a fingerprint of its settings, and the
    settings, as the dataset will record them, to name a difference), since when. Read back as untrusted input:
    ``decode`` returns None for anything that is not a marker lmprobe wrote."""

    job: str
    fingerprint: str
    created: str
    settings: dict | None = None

    @classmethod
    def new(cls, fingerprint: str, settings: dict | None = None) -> JobMarker:
        return cls(uuid.uuid4().hex, fingerprint, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), settings)

    def encode(self) -> bytes:
        d: dict[str, Any] = {"lmprobe_job": self.job, "settings_fingerprint": self.fingerprint,
                             "created": self.created}
        settings = json.dumps(self.settings, sort_keys=True, default=str) if self.settings else ""
        if settings and len(settings) <= MAX_MARKER_BYTES // 2:
            d["settings"] = json.loads(settings)
        return json.dumps(d, indent=1).encode() + b"\n"

    @classmethod
    def decode(cls, raw: bytes) -> JobMarker | None:
        try:
            d = loads(raw, what="a job marker")
        except FormatError:
            return None
        if not isinstance(d, dict):
            return None
        job, fp, created = d.get("lmprobe_job"), d.get("settings_fingerprint"), d.get("created")
        if not all(isinstance(v, str) and _HEX.fullmatch(v) for v in (job, fp)):
            return None
        settings = d.get("settings")
        return cls(job, fp, created if isinstance(created, str) and _TIME.fullmatch(created) else "at an unknown time",
                   settings if isinstance(settings, dict) else None)

    def who(self) -> str:
        return f"job {self.job[:12]}, started {self.created}"


#: a marker found in the folder that lmprobe cannot read (not one it wrote)
UNREADABLE = JobMarker("?", "?", "?")


class RepoClaim:
    """This job's claim on ``folder`` of a repo's branch (see the module docstring).

    ``claim`` commits the marker; ``commit(make)`` runs ``make(parent)``, a ``create_commit`` with
    ``parent_commit=parent``, on the revision the job last saw, and on a 412 reads the marker again and tries
    once more, or stops with an ``OutputInUseError`` when another job holds the folder now. Thread-safe: a job's
    committer and its merge may commit from different threads.
    """

    def __init__(self, api: Any, repo_id: str, revision: str, folder: str, *, url: str, fingerprint: str,
                 settings: dict | None = None, repo_type: str = "dataset", token: str | bool | None = None,
                 job: str | None = None):
        self.api, self.repo_id, self.revision, self.repo_type = api, repo_id, revision, repo_type
        self.url, self.token = url, token
        self.path = f"{folder}/{MARKER}" if folder else MARKER
        self.marker = JobMarker.new(fingerprint, settings)
        if job is not None:  # another process of the same job (a rank of torchrun): the marker rank 0 committed
            self.marker = JobMarker(job, fingerprint, self.marker.created, settings)
        self.parent: str | None = None  # the revision this job last saw (None: read it, and the marker, first)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ reading
    def head(self) -> str:
        """The branch's current commit."""
        return self.api.repo_info(self.repo_id, repo_type=self.repo_type, revision=self.revision).sha

    def marker_at(self, commit: str) -> JobMarker | None:
        """The marker the folder holds at ``commit``: None when there is none, ``UNREADABLE`` when it is not a
        marker lmprobe wrote."""
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        found = self.api.get_paths_info(self.repo_id, [self.path], repo_type=self.repo_type, revision=commit)
        if not found:
            return None
        if not hasattr(found[0], "size") or (found[0].size or 0) > MAX_MARKER_BYTES:
            return UNREADABLE
        try:
            local = hf_hub_download(self.repo_id, self.path, repo_type=self.repo_type, revision=commit,
                                    token=self.token)
        except EntryNotFoundError:
            return None
        raw = Path(local).read_bytes()[: MAX_MARKER_BYTES + 1]
        return JobMarker.decode(raw) or UNREADABLE

    def ours(self, found: JobMarker | None) -> bool:
        return found is not None and found.job == self.marker.job

    # ------------------------------------------------------------------ claiming
    def claim(self, *, take_over: bool, take_turn: Callable[[], None] = lambda: None) -> JobMarker | None:
        """Commit this job's marker on the revision read now (what the folder held stays as it is). Another job's
        marker is taken over when it is the same work (same fingerprint: a killed run resumed) or ``take_over``
        (``--overwrite``); otherwise an ``OutputInUseError`` says what to do. Returns the marker replaced, if any."""
        from huggingface_hub import CommitOperationAdd

        for _ in range(MAX_PARENT_TRIES):
            head = self.head()
            found = self.marker_at(head)
            if self.ours(found):  # a retry after a lost answer: the marker landed
                with self._lock:
                    self.parent = head
                return None
            if found is not None and not take_over and found.fingerprint != self.marker.fingerprint:
                raise self.refusal(found)
            take_turn()
            try:
                info = self.api.create_commit(
                    self.repo_id, [CommitOperationAdd(path_in_repo=self.path, path_or_fileobj=self.marker.encode())],
                    repo_type=self.repo_type, revision=self.revision, parent_commit=head,
                    commit_message=f"lmprobe: extraction job {self.marker.job[:12]} starts writing here")
            except Exception as exc:
                if status_code(exc) == 412:  # someone committed between our read and our commit: read again
                    continue
                raise
            with self._lock:
                self.parent = _oid(info)
            if found is not None:
                logger.info("%s: took the folder over from %s", self.url,
                            "a marker lmprobe cannot read" if found is UNREADABLE else found.who())
            return found
        raise self.busy()

    def refusal(self, found: JobMarker) -> OutputInUseError:
        how = (f"wait for it to finish, write to another --out, or, once it has stopped, pass --overwrite to take the "
               f"folder over and start again (or delete {self.path} from the repo)")
        if found is UNREADABLE:
            return OutputInUseError(f"{self.url} holds a job marker lmprobe cannot read ({self.path}): an extraction "
                                    f"may be writing it; {how}", path=self.url)
        differ = ""
        if found.settings is not None and self.marker.settings is not None:
            try:  # untrusted text, quoted on one line and cut short
                differ = describe_mismatch(found.settings, self.marker.settings)
            except (RecursionError, TypeError, ValueError):
                differ = ""
            differ = "".join(c if c.isprintable() else "?" for c in differ)
            if len(differ) > MAX_MISMATCH_CHARS:
                differ = differ[: MAX_MISMATCH_CHARS - 3] + "..."
        return OtherExtractionError(
            f"{self.url} is being written by an extraction with other settings ({differ or 'not recorded'}; "
            f"{found.who()}), or holds what it left when it stopped; {how}", path=self.url)

    def lost(self, found: JobMarker | None) -> OutputInUseError:
        who = "its job marker was removed" if found is None else \
            "an extraction lmprobe cannot identify took it over" if found is UNREADABLE else \
            f"another extraction took it over ({found.who()})"
        return OutputInUseError(
            f"{self.url} changed hands while this extraction ran ({who}); this run stopped without publishing its "
            "index: wait for the other run to finish, or write to another --out", path=self.url)

    def busy(self) -> OutputInUseError:
        return OutputInUseError(
            f"{self.url}: the branch {self.revision} moved under each of {MAX_PARENT_TRIES} commits of this "
            "extraction (someone else commits to the repo all the time); run the same command again later: it "
            "resumes", path=self.url)

    # ------------------------------------------------------------------ committing
    def commit(self, make: Callable[[str], Any]) -> Any:
        """``make(parent)`` (a ``create_commit`` with ``parent_commit=parent``) on the revision this job last saw;
        after a 412, on the new revision if the folder is still this job's, else an ``OutputInUseError``."""
        for _ in range(MAX_PARENT_TRIES):
            with self._lock:
                parent = self.parent
            if parent is None:
                parent = self.head()
                found = self.marker_at(parent)
                if not self.ours(found):
                    raise self.lost(found)
            try:
                info = make(parent)
            except Exception as exc:
                with self._lock:
                    if self.parent == parent:
                        self.parent = None  # (a lost answer: the commit may have landed; read the branch again)
                if status_code(exc) == 412:
                    continue
                raise
            with self._lock:
                self.parent = _oid(info)
            return info
        raise self.busy()


def _oid(info: Any) -> str | None:
    """The commit a ``create_commit`` made (None when its answer does not say: the next commit reads the branch)."""
    oid = getattr(info, "oid", None)
    return oid if isinstance(oid, str) and oid else None
