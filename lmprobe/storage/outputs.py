"""Where an extraction writes: a local folder, object storage (``s3://...``), or a Hub dataset repo
(``hf://datasets/OWNER/NAME[@revision]``).

Every output does the same few things, so that the extraction itself is written once:

- ``finished()``: the complete dataset it holds, if any (one "already done?" check for every output);
- ``staging()``: the local folder the writer writes in: the output itself when it is local, else a folder
  of this machine's own under ``$LMPROBE_CACHE`` (no shared disk is assumed);
- ``session()``: what takes the writer's files as they are finished. A remote output uploads them from a
  bounded queue while the model computes and deletes them here once they are safe there, so that the
  staging folder holds a few shards per stored site whatever the dataset's size; provisional files
  (sequence shards, whose numbers are known at the end) are renamed where they went; the card and the
  index go up last, so that the output never shows an index whose shards are missing;
- ``part(rank, world)``: the output of one rank of a multi-process job (a folder, a prefix, a branch),
  itself an output of the same kind; ``merge(parts)`` makes the parts one dataset without moving shard
  data through one machine (local renames, server-side copies in object storage and on the Hub).

One file past 600 lines, on purpose: the three outputs implement one protocol and are read side by side; what of the
Hub's stands alone lives beside it (hubrecords, hubrepo, storage/commits, storage/claim).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from ..base.atomic import atomic_write, move_into_place
from ..base.hashing import sha256_file
from ..base.lock import OutputLock
from ..base.paths import check_output_path, check_relpath
from ..base.retry import call_with_retry
from ..errors import DatasetNotFoundError, ExtractionError, InvalidArgumentError
from ..format.merge import MergePlan, plan_merge
from ..format.metadata import FileRecord
from ..format.reader import Dataset, open_local
from ..format.resume import settings_fingerprint
from ..format.spec import CARD_PATH, INDEX_PATH, STAGING_DIR
from ..format.staging import PROVISIONAL_DIR
from .budget import CommitWindow, commits_per_hour, hour_seconds, in_flight_files
from .claim import RepoClaim
from .commits import HubCommitter, PushConfig, RepoFile
from .hub import HubRef, check_pull_request_open, hub_api, is_pull_request, parse_hf_url
from .hubrecords import LEDGER, RENAMES, final_files, part_renames, read_ledger, staged_record
from .hubrepo import card_merger, old_shards
from .hubresume import RESUME_DIR, RESUME_FILE, CheckpointCopies, seed_from_hub
from .objectstore import UploadSink, cache_dir, filesystem, is_object_store_url, object_store_policy
from .relay import Relay, StoreRelay
from .remote import open_hub, open_object_store
from .urls import is_hub_url

logger = logging.getLogger(__name__)

#: where the parts of a multi-process job are kept until they are merged (a folder, or a prefix)
PARTS_DIR = ".lmprobe-parts"
#: an overwrite's deletes of the old dataset's shards, per commit
DELETES_PER_COMMIT = 1000


def part_name(rank: int) -> str:
    return f"part-{rank:05d}"


class Session(ABC):
    """What takes an extraction's files as the writer finishes them (``writer_callbacks``), then finishes the output."""

    def writer_callbacks(self) -> dict[str, Any]:
        """The writer's ``on_file_complete``/``on_file_renamed`` (none: the files stay where they are written)."""
        return {}

    def seed(self, settings: dict) -> bool:
        """Before the writer opens: when this machine holds nothing of the output but the remote output holds a
        checkpoint of it, copy that checkpoint into the staging folder (True), so that the writer resumes from it."""
        return False

    def resume(self, recorded: dict[str, tuple[int, str]]) -> None:
        """The writer reopened what an earlier run left: ``recorded`` (path -> bytes, sha256) is what it recorded,
        the only files of that run the output may still take."""
        return None

    @abstractmethod
    def finish(self) -> Dataset | None:
        """After the writer closed: everything in place (the index last); the dataset, opened (None: a part of a job
        whose last files the job's committer commits when the job ends)."""

    @abstractmethod
    def abort(self) -> None:
        """The extraction stopped: stop sending, keep what is resumable."""

    #: the writer had closed when an earlier run was killed (its files are staged or uploaded): ``finish`` alone
    #: completes the output, and nothing is extracted again
    finishing: bool = False


class Output(ABC):
    """An extraction's destination (see the module docstring)."""

    url: str

    def __str__(self) -> str:
        return self.url

    @abstractmethod
    def finished(self) -> Dataset | None:
        """The complete dataset the output holds, opened; None when it holds none."""

    @abstractmethod
    def staging(self) -> Path:
        """The local folder the writer writes in."""

    @abstractmethod
    def session(self, *, overwrite: bool, settings: dict | None = None, shard_bytes: int | None = None) -> Session:
        """Start writing (``overwrite``: what an earlier run left is replaced, never resumed; ``settings``: the
        extraction's, which a finished staging copy left by a killed run must record to be resumed)."""

    @abstractmethod
    def part(self, rank: int) -> Output:
        """Where rank ``rank`` of a multi-process job writes its part."""

    @abstractmethod
    def merge(self, parts: list[Output], *, settings: dict, order: str, quiet: bool) -> Dataset:
        """Make the finished parts one dataset here (shards renamed, never read), and remove the parts."""

    @property
    def local(self) -> bool:
        return False

    def release_staging(self) -> None:
        """The job is complete: what this output kept on this machine for a re-run may go (nothing by default)."""
        return None

    def check(self) -> None:
        """What can be checked of the output before the model is read (a Hub output: that the pull request it names
        is open); nothing by default."""
        return None

    def for_world(self, world: int) -> Output:
        """This output for a job of ``world`` processes."""
        return self

    def start_job(self, store: Any, *, rank: int, world: int, settings: dict | None = None,
                  overwrite: bool = False) -> Output:
        """This output for rank ``rank`` of a multi-process job whose ranks share ``store`` (torch.distributed's
        c10d store): the Hub's sends every rank's commits to one committer on rank 0, started here, after rank 0
        claimed the folder for the job (``settings``, ``overwrite``: as for ``session``)."""
        return self

    def end_job(self) -> None:
        """Rank 0, after every rank finished its part: the job's committer lands what it holds and stops."""
        return None


def open_output(out: str | os.PathLike, *, token: str | None = None) -> Output:
    """The output ``out`` names, checked before anything expensive runs; ``token`` is the identity of every Hub call
    a Hub output makes (None: HF_TOKEN or the saved login), kept in memory only."""
    s = os.fspath(out)
    if is_hub_url(s):
        return HubOutput.parse(s, token=token)
    if is_object_store_url(s):
        return ObjectStoreOutput(s.rstrip("/"))
    return LocalOutput(check_output_path(out, "output folder"))


# ---------------------------------------------------------------------------------------------- a local folder


class _LocalSession(Session):
    def __init__(self, path: Path):
        self.path = path

    def finish(self) -> Dataset:
        return open_local(self.path)

    def abort(self) -> None:
        """Nothing to stop: the files are where they were written."""


class LocalOutput(Output):
    """A folder: the writer writes in it; parts are subfolders (a shared filesystem for several nodes)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.url = str(self.path)

    @property
    def local(self) -> bool:
        return True

    def finished(self) -> Dataset | None:
        return open_local(self.path) if (self.path / INDEX_PATH).exists() else None

    def staging(self) -> Path:
        return self.path

    def session(self, *, overwrite: bool, settings: dict | None = None, shard_bytes: int | None = None) -> Session:
        return _LocalSession(self.path)

    def part(self, rank: int) -> Output:
        return LocalOutput(self.path / PARTS_DIR / part_name(rank))

    def merge(self, parts: list[Output], *, settings: dict, order: str, quiet: bool) -> Dataset:
        dss = [open_local(p.staging()) for p in parts]
        with OutputLock(self.path):
            if (self.path / INDEX_PATH).exists():
                (self.path / INDEX_PATH).unlink()  # the index goes first: a half-merged folder never looks complete
            merge = plan_merge(dss, settings=settings, order=order)
            for k, src, dst in merge.moves:
                move_into_place(dss[k].shards.fetch(src, "shard file"), self.path / dst)
            merge.finish(dss, self.path)
        shutil.rmtree(self.path / PARTS_DIR, ignore_errors=True)
        return open_local(self.path)


# ---------------------------------------------------------------------------------------------- object storage


class _ObjectStoreSession(Session):
    def __init__(self, output: ObjectStoreOutput, *, overwrite: bool):
        self.output = output
        self.local = output.staging()
        if (self.local / INDEX_PATH).exists():
            shutil.rmtree(self.local)  # a finished staging copy left by an earlier run: the bucket decides
        self.sink = UploadSink(output.url, self.local, keep=(INDEX_PATH, CARD_PATH))
        if overwrite:
            # the old index goes before any new shard does: an interrupted overwrite leaves no complete-looking
            # dataset of old texts over new vectors
            self.sink.remove(INDEX_PATH)
        else:
            self.sink.submit_existing()  # files an interrupted run finished but may not have uploaded
        self.renames: list[tuple[str, str]] = []

    def writer_callbacks(self) -> dict[str, Any]:
        return {"on_file_complete": self.sink.submit, "on_file_renamed": self._renamed}

    def _renamed(self, old: str, new: str) -> None:
        self.renames.append((old, new))  # done once every upload has landed, before the index goes up

    def finish(self) -> Dataset:
        self.sink.finish()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # server-side copies: no byte comes back here
            list(pool.map(lambda m: self.output.move(m[0], m[1]), self.renames))
        self._check_uploaded()
        for rel in (CARD_PATH, INDEX_PATH):  # the index last: the bucket shows a dataset only once it is complete
            if (self.local / rel).exists():
                self.sink.put(rel)
        shutil.rmtree(self.local)  # everything is in the bucket now
        return open_object_store(self.output.url)

    def _check_uploaded(self) -> None:
        """Every data file the index names is in the bucket. Files an interrupted run uploaded (and deleted here)
        may have gone since; an index over them would be a dataset with holes."""
        there = self.sink.listing()
        missing = [f.rel for f in open_local(self.local).meta.files() if f.rel not in there]
        if missing:
            raise ExtractionError(f"{self.output.url} is missing {len(missing)} data file(s) that an earlier, "
                                  f"interrupted run uploaded ({missing[0]}{', ...' if len(missing) > 1 else ''}); "
                                  "the bucket changed since: re-run with --overwrite to extract again")

    def abort(self) -> None:
        self.sink.abort()


class ObjectStoreOutput(Output):
    """An fsspec URL (``s3://bucket/prefix``): shards upload while the model computes; parts are prefixes."""

    def __init__(self, url: str):
        self.url = url
        self.fs, self.root = filesystem(url)
        self.policy = object_store_policy()

    def finished(self) -> Dataset | None:
        try:
            return open_object_store(self.url)
        except DatasetNotFoundError:
            return None

    def staging(self) -> Path:
        return cache_dir(self.url, "outputs")

    def session(self, *, overwrite: bool, settings: dict | None = None, shard_bytes: int | None = None) -> Session:
        return _ObjectStoreSession(self, overwrite=overwrite)

    def part(self, rank: int) -> Output:
        return ObjectStoreOutput(f"{self.url}/{PARTS_DIR}/{part_name(rank)}")

    def move(self, old: str, new: str, *, source: ObjectStoreOutput | None = None) -> None:
        """Rename ``old`` (of ``source``, default: this output) to ``new`` here, server-side (copy, then delete)."""
        check_relpath(old, "file")
        check_relpath(new, "file")
        src = f"{(source or self).root}/{old}"
        dst = f"{self.root}/{new}"
        try:
            call_with_retry(lambda: self.fs.copy(src, dst), policy=self.policy)
        except FileNotFoundError:
            if self.fs.exists(dst):  # moved by an interrupted run of the same merge
                return
            raise
        call_with_retry(lambda: self.fs.rm_file(src), policy=self.policy)

    def merge(self, parts: list[Output], *, settings: dict, order: str, quiet: bool) -> Dataset:
        import tempfile

        sources = [p for p in parts if isinstance(p, ObjectStoreOutput)]
        if len(sources) != len(parts):
            raise InvalidArgumentError("object-storage parts merge into object storage only")
        dss = [open_object_store(p.url) for p in sources]
        sink = UploadSink(self.url, Path(tempfile.mkdtemp(prefix="lmprobe-merge-")), delete_after=False)
        sink.remove(INDEX_PATH)  # the index goes first: a half-merged prefix never looks complete
        merge: MergePlan = plan_merge(dss, settings=settings, order=order)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda m: self.move(m[1], m[2], source=sources[m[0]]), merge.moves))
        for rel in merge.finish(dss, sink.local):  # statistics, card, index: in that order
            sink.put(rel)
        shutil.rmtree(sink.local, ignore_errors=True)
        self.fs.rm(f"{self.root}/{PARTS_DIR}", recursive=True)
        return open_object_store(self.url)


# ---------------------------------------------------------------------------------------------- a Hub dataset repo



_WINDOWS: dict[tuple[str, str], CommitWindow] = {}


def job_window(repo_id: str, revision: str) -> CommitWindow:
    """The commit window of this process's job on a repo's branch: every commit this process makes to it (the
    shards', the renames', the merge's) counts in one sliding hour (budget.py)."""
    key = (repo_id, revision)
    if key not in _WINDOWS:
        _WINDOWS[key] = CommitWindow(commits_per_hour(), hour=hour_seconds())
    return _WINDOWS[key]


class _HubSession(Session):
    """Uploads the writer's files as they are finished (LFS or Xet, several at once), deletes each local copy once
    its content is on the Hub, commits them in batches paced for the repo's commit rate (shared by the job's
    ranks), renames provisional files server-side, and commits the statistics, card and index last."""

    def __init__(self, output: HubOutput, *, overwrite: bool, settings: dict | None = None,
                 shard_bytes: int | None = None):
        self.output = output
        self.local = output.staging()
        record = None
        if (self.local / INDEX_PATH).exists():  # a run killed in its tail: the writer had closed
            record = None if overwrite else staged_record(self.local, settings)
            if record is None:
                shutil.rmtree(self.local)  # another extraction's, or one without hashes: the repo decides
        self.finishing = record is not None
        self.local.mkdir(parents=True, exist_ok=True)
        self.ledger = self.local / LEDGER
        # one rank of a job hands its files' records to the job's committer (relay.py); one process commits itself
        # what waits on this node's disk for its upload: a few shards, whatever the dataset's size (budget.py)
        config = PushConfig(max_in_flight=in_flight_files(shard_bytes), workers=4)
        self.committer = HubCommitter(output.ref.repo_id, token=output.token, revision=output.ref.revision,
                                      config=config, label="extraction", on_uploaded=self._uploaded,
                                      on_landed=self._landed, under=output.ref.path, send_to=output.relay,
                                      window=job_window(output.ref.repo_id, output.ref.revision))
        output.prepare(self.committer)
        if output.relay is None:  # one process: it claims the folder itself (a job's rank 0 did in start_job)
            output.start_writing(settings, overwrite=overwrite, committer=self.committer)
        self.committer.claim = output.claim
        if overwrite:
            if output.holds(INDEX_PATH):  # the old index goes before any new shard: never old texts over new vectors
                stale = output.old_shards()
                output.delete([INDEX_PATH], self.committer, "remove the index before an overwrite")
                # then the old dataset's own shards (an overwrite with fewer layers left them outside the new
                # index): only files under tensors/ that the old index named and the repo holds; at full size
                # 10^5 old shards are 100 commits of 1,000 deletes, within the commit window like any other
                for k in range(0, len(stale), DELETES_PER_COMMIT):
                    output.delete(stale[k:k + DELETES_PER_COMMIT], self.committer,
                                  "remove the old dataset's shards before an overwrite")
            if output.holds(RESUME_FILE):  # an earlier run's checkpoint copy: it names shards about to go
                output.delete([RESUME_DIR], self.committer, "remove the checkpoint copy before an overwrite",
                              folder=True)
            self.ledger.unlink(missing_ok=True)
        self.committer.start()
        self.renames: list[tuple[str, str]] = []
        self.remove: list[str] = []
        # the writer's checkpoints, copied to the Hub once their shards landed: a rank on another node resumes there
        self.copies = CheckpointCopies(self.local, output.repo_path, set(self.committer.remote),
                                       self.committer.holds)
        # what a killed run left, before the reopened writer hands anything over: committed once it says what it
        # recorded (resume)
        self._staged = [] if overwrite or record is not None else \
            [f.relative_to(self.local).as_posix() for f in sorted(self.local.glob("tensors/**/*.safetensors"))]
        if record is not None:
            self._resume_tail(record)

    def resume(self, recorded: dict[str, tuple[int, str]]) -> None:
        """What a killed run uploaded (the ledger) or handed over without sending (in the staging folder) is
        committed when the reopened writer recorded it, with the same size and sha256; anything else is not
        (a foreign file, a ledger line the writer never recorded)."""
        for e in read_ledger(self.ledger):  # uploaded by a killed run, maybe not committed: by reference
            if recorded.get(e["rel"]) == (e["size"], e["sha256"]) and not (self.local / e["rel"]).exists():
                self.committer.add_uploaded(RepoFile(self.output.repo_path(e["rel"]), self.local / e["rel"],
                                                     e["size"], e["sha256"]))
        for rel in self._staged:  # handed over by a killed run, not sent
            if rel in recorded:
                self._submit(rel, recorded[rel][1])
            else:
                logger.warning("%s: %s is not a file this extraction recorded; it is not uploaded",
                               self.output, self.local / rel)

    def _resume_tail(self, record: dict[str, FileRecord]) -> None:
        """Commit what the closed writer recorded (path, size, sha256) and nothing else: each file from its staged
        copy, else by reference to its content on the Hub (uploaded, as the ledger says, or committed under a
        provisional name); a provisional name committed before the kill goes with the final commit."""
        uploaded = {(e["sha256"], e["size"]) for e in read_ledger(self.ledger)}
        on_hub = {v.partition(":")[2] for v in self.committer.remote.values() if v.startswith("sha256:")}
        staged_seq: dict[tuple[str, int], Path] | None = None
        sent: set[Path] = set()
        for f in record.values():
            if (self.local / f.rel).is_file():
                self._submit(f.rel, f.sha256)
                continue
            if f.sha256 in on_hub or (f.sha256, f.bytes) in uploaded:
                self.committer.add_uploaded(RepoFile(self.output.repo_path(f.rel), self.local / f.rel, f.bytes,
                                                     f.sha256))
                continue
            if staged_seq is None:
                staged_seq = self._staged_provisional()
            if (f.sha256, f.bytes) in staged_seq:
                # a sequence shard still staged under its provisional name (its upload was cut short), its content
                # the writer's record: it goes up under its final name (a job's part: under the provisional name its
                # renames file maps, which the merge copies)
                local = staged_seq[f.sha256, f.bytes]
                if local in sent:  # two shards of the same content (its upload deletes the staged copy): a copy each
                    shutil.copyfile(local, local := local.with_name(f"{local.stem}-{len(sent)}{local.suffix}"))
                sent.add(local)
                rel = local.relative_to(self.local).as_posix() if self.output.relay is not None else f.rel
                self.committer.add(RepoFile(self.output.repo_path(rel), local, sha256=f.sha256))
            else:
                raise ExtractionError(f"{self.output}: {f.rel}, which an interrupted run wrote, is neither staged in "
                                      f"{self.local} nor on the Hub; the repo changed since: re-run with --overwrite")
        provisional = self.output.repo_path(PROVISIONAL_DIR)
        if self.output.relay is None and any(p.startswith(provisional + "/") for p in self.committer.remote):
            self.remove.append(provisional)  # (a job's part: the merge removes the parts' folder, provisional names too)

    def _staged_provisional(self) -> dict[tuple[str, int], Path]:
        """The sequence shards a killed run left staged under their provisional names, by (sha256, bytes): a few
        (those whose upload had not finished), hashed here once."""
        folder = self.local / PROVISIONAL_DIR
        files = sorted(p for p in folder.glob("*.safetensors") if p.is_file() and not p.is_symlink()) \
            if folder.is_dir() else []
        return {(sha256_file(p), p.stat().st_size): p for p in files}

    def writer_callbacks(self) -> dict[str, Any]:
        return {"on_file_complete": self._submit, "on_file_renamed": self._renamed,
                "on_checkpoint": lambda *a: [self.committer.add(f) for f in self.copies.checkpointed(*a)]}

    def seed(self, settings: dict) -> bool:
        """A rank that comes back on another node: nothing staged here, but its checkpoint on the Hub (hubresume.py),
        checked as untrusted input, seeds the staging folder (state, index rows, statistics; never a shard)."""
        if self.finishing or (self.local / STAGING_DIR / "state.json").exists():
            return False
        return seed_from_hub(self.output.ref, self.output.token, self.local, self.committer.remote, settings)

    def _submit(self, rel: str, sha256: str | None = None) -> None:
        # the sha256 the writer recorded goes with the file (LFS and hf_xet take it as is); without one, the upload
        # computes it as it reads the file, once
        self.committer.add(RepoFile(self.output.repo_path(rel), self.local / rel, sha256=sha256))

    def _uploaded(self, f: RepoFile) -> None:
        """``f``'s content is on the Hub: recorded (for a re-run), then its local copy goes."""
        if f.sha256 is None:  # (the upload did not say: hashed here, once)
            f.sha256 = sha256_file(f.local)
        rel = f.local.relative_to(self.local).as_posix()
        with open(self.ledger, "a") as ledger:
            ledger.write(json.dumps({"rel": rel, "sha256": f.sha256, "size": f.size}) + "\n")
            ledger.flush()
            os.fsync(ledger.fileno())
        f.local.unlink(missing_ok=True)

    def _landed(self, files: list[RepoFile]) -> None:
        self.copies.landed(files)
        for f in files:  # committed (or on the Hub already): nothing local is needed any more
            if f.local.name != INDEX_PATH and f.local.parent != self.local:
                f.local.unlink(missing_ok=True)

    def _renamed(self, old: str, new: str) -> None:
        self.renames.append((old, new))

    def finish(self) -> Dataset:
        if self.output.relay is None and self.copies.sent:  # (a job's part: the merge removes the parts' folder)
            if self.committer.holds(self.output.repo_path(RESUME_FILE)):
                self.committer.flush()  # (a copy on its way: landed first, not added and removed in one commit)
            self.remove.append(self.output.repo_path(RESUME_DIR))
        # one commit ends the part: what is uploaded, the provisional files renamed, the statistics, card and index
        last = [RepoFile(self.output.repo_path(rel), self.local / rel) for rel in final_files(self.local)]
        moves = [(self.output.repo_path(old), self.output.repo_path(new)) for old, new in self.renames]
        if self.output.relay is not None and self.renames:
            # a job's part: its sequence shards stay under their provisional names, which a small file maps to the
            # part's own names; the merge copies each straight to its place in the dataset (one copy a shard, in the
            # merge's commits, instead of a copy and a delete in the job's tail first)
            atomic_write(self.local / RENAMES, json.dumps({new: old for old, new in self.renames}).encode())
            last.insert(0, RepoFile(self.output.repo_path(RENAMES), self.local / RENAMES))
            moves = []
        if self.output.relay is not None:
            # a job's part: handed over, committed with the other ranks' last groups when the job ends (its staging
            # stays until then: a kill before that commit finishes from it)
            self.committer.finish(last, moves=moves, remove=self.remove, wait=False)
            return None
        # the job's marker goes in the commit that publishes the index: a finished dataset holds none
        # (the card merged into the owner's README.md as the revision the commit is made on holds it: an edit meanwhile
        # is kept)
        self.committer.finish(last, moves=moves, remove=self.remove, drop=self.output.marker_paths(),
                              before=card_merger(self.output, self.local),
                              message="lmprobe: add the last shards, statistics, card and index")
        shutil.rmtree(self.local)
        return self.output.finished_or_raise()

    def abort(self) -> None:
        self.committer.close()


class HubOutput(Output):
    """A dataset repo on the Hub (``hf://datasets/OWNER/NAME[@branch][/folder]``): shards upload while the model
    computes; the parts of a multi-process job are folders ``.lmprobe-parts/part-NNNNN`` of the same branch,
    merged by server-side copies (no byte is sent again) and removed."""

    def __init__(self, ref: HubRef, *, token: str | bool | None = None, relay: Relay | None = None,
                 claim: RepoClaim | None = None):
        self.ref = ref
        self.url = str(ref)
        self.token = token
        self.relay = relay  # a rank of a job: its files are committed by the job's committer (relay.py)
        self.job: HubCommitter | None = None  # rank 0 of a job: that committer
        # the job's claim on the folder (storage/claim.py): its marker, and the revision every commit is made on
        self.claim = claim

    @classmethod
    def parse(cls, url: str, *, token: str | None = None) -> HubOutput:
        ref = parse_hf_url(url)
        if ref.repo_type != "dataset":
            raise InvalidArgumentError(f"--out {url}: an extraction writes to a dataset repo, "
                                       "hf://datasets/OWNER/NAME[@branch]")
        if ref.revision is not None and ref.revision.startswith("refs/") and not is_pull_request(ref.revision):
            raise InvalidArgumentError(f"--out {url}: {ref.revision} is the Hub's own conversion of the repo; write to "
                                       "a branch (@BRANCH) or an open pull request (@refs/pr/N)")
        return cls(HubRef(ref.repo_id, "dataset", ref.revision or "main", ref.path.strip("/")), token=token)

    def repo_path(self, rel: str) -> str:
        return f"{self.ref.path}/{rel}" if self.ref.path else rel

    def finished(self) -> Dataset | None:
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

        try:
            return open_hub(self.ref, token=self.token)
        except (DatasetNotFoundError, RepositoryNotFoundError, RevisionNotFoundError):
            return None

    def finished_or_raise(self) -> Dataset:
        ds = self.finished()
        if ds is None:
            raise ExtractionError(f"{self} holds no dataset after its index was committed")
        return ds

    def holds(self, rel: str) -> bool:
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

        try:
            return bool(hub_api(self.token).get_paths_info(self.ref.repo_id, [self.repo_path(rel)],
                                                           repo_type="dataset", revision=self.ref.revision))
        except (RepositoryNotFoundError, RevisionNotFoundError):
            return False

    def old_shards(self) -> list[str]:
        """What an overwrite removes of the old dataset (``hubrepo.old_shards``)."""
        return old_shards(self)

    def delete(self, rels: list[str], committer: HubCommitter, why: str, *, folder: bool = False) -> None:
        """Delete files (or folders) of this output in one commit."""
        from huggingface_hub import CommitOperationDelete

        ops = [CommitOperationDelete(path_in_repo=self.repo_path(r) + ("/" if folder else ""), is_folder=folder)
               for r in rels]
        committer.take_turn()
        committer.call(f"{why} in {self}", lambda: committer.create_commit(ops, f"lmprobe: {why}"))

    def start_writing(self, settings: dict | None, *, overwrite: bool, committer: HubCommitter) -> str:
        """Claim the folder for this job (its marker, storage/claim.py) before its first other commit; the job id."""
        self.claim = RepoClaim(committer.api, self.ref.repo_id, self.ref.revision, self.ref.path, url=self.url,
                               fingerprint=settings_fingerprint(settings or {}), settings=settings, token=self.token)
        committer.call(f"claiming {self}", lambda: self.claim.claim(take_over=overwrite, take_turn=committer.take_turn))
        return self.claim.marker.job

    def marker_paths(self) -> list[str]:
        return [self.claim.path] if self.claim is not None else []  # removed by the commit publishing the index

    def staging(self) -> Path:
        from huggingface_hub import constants

        # keyed by the endpoint too: a run killed against one Hub leaves nothing that the same command against
        # another would take for its own (an upload ledger naming objects that Hub never had)
        return cache_dir(f"{constants.ENDPOINT} {self.url}", "outputs")

    def check(self) -> None:
        """A pull request's ref is written to once the pull request is open (nothing creates it but opening it):
        one request before the model is read, and a one-line error naming the way out when it is not."""
        if is_pull_request(self.ref.revision):
            check_pull_request_open(HubRef(self.ref.repo_id, "dataset", self.ref.revision), token=self.token)

    def prepare(self, committer: HubCommitter) -> None:
        """The repo and the branch, created when missing (a pull request's ref: ``check`` found it open)."""
        committer.call(f"creating {self.ref.repo_id}", lambda: committer.api.create_repo(
            self.ref.repo_id, repo_type="dataset", exist_ok=True))
        if self.ref.revision != "main" and not is_pull_request(self.ref.revision):
            committer.call(f"creating the branch {self.ref.revision}", lambda: committer.api.create_branch(
                self.ref.repo_id, repo_type="dataset", branch=self.ref.revision, exist_ok=True))

    def session(self, *, overwrite: bool, settings: dict | None = None, shard_bytes: int | None = None) -> Session:
        return _HubSession(self, overwrite=overwrite, settings=settings, shard_bytes=shard_bytes)

    def part(self, rank: int) -> Output:
        return HubOutput(HubRef(self.ref.repo_id, "dataset", self.ref.revision,
                                self.repo_path(f"{PARTS_DIR}/{part_name(rank)}")), token=self.token, relay=self.relay,
                         claim=self.claim)

    def start_job(self, store: Any, *, rank: int, world: int, settings: dict | None = None,
                  overwrite: bool = False) -> Output:
        out = HubOutput(self.ref, token=self.token, relay=(relay := StoreRelay(store, rank=rank, world=world)))
        if rank == 0:  # the job's one committer: every rank's files, within one commit window (budget.py)
            out.job = HubCommitter(self.ref.repo_id, token=self.token, revision=self.ref.revision,
                                   label=f"extraction (rank 0 for the job's {world} ranks)",
                                   under=self.repo_path(PARTS_DIR), commit_for=StoreRelay(store, rank=0, world=world),
                                   window=job_window(self.ref.repo_id, self.ref.revision))
            self.prepare(out.job)  # the folder claimed for the job, told to every rank (a refusal too)
            relay.share_claim(lambda: out.start_writing(settings, overwrite=overwrite, committer=out.job))
            out.job.claim = out.claim
            out.job.start()
        else:  # the job's claim, as rank 0 made it: this rank's own commits (an overwrite's deletes) check it too
            out.claim = RepoClaim(hub_api(self.token), self.ref.repo_id, self.ref.revision, self.ref.path,
                                  url=self.url, fingerprint=settings_fingerprint(settings or {}), token=self.token,
                                  job=relay.claimed())
        return out

    def end_job(self) -> None:
        """Rank 0: commit what the ranks handed over and not yet committed (their last groups together)."""
        if self.job is not None:
            self.job.finish()
            self.job = None

    def release_staging(self) -> None:
        """The job is complete: this part's staging is not needed any more."""
        shutil.rmtree(self.staging(), ignore_errors=True)

    def merge(self, parts: list[Output], *, settings: dict, order: str, quiet: bool) -> Dataset:
        import tempfile

        hubs = [p for p in parts if isinstance(p, HubOutput) and p.ref.repo_id == self.ref.repo_id
                and p.ref.revision == self.ref.revision]
        if len(hubs) != len(parts):
            raise InvalidArgumentError("Hub parts merge into the branch of their own repo only")
        dss = [p.finished_or_raise() for p in hubs]
        committer = HubCommitter(self.ref.repo_id, token=self.token, revision=self.ref.revision, label="merge",
                                 under=self.ref.path, window=job_window(self.ref.repo_id, self.ref.revision),
                                 claim=self.claim)
        self.prepare(committer)
        if self.holds(INDEX_PATH):  # the index goes first: a half-merged repo never looks complete
            self.delete([INDEX_PATH], committer, "remove the index before a merge")
        committer.start()
        merge = plan_merge(dss, settings=settings, order=order)
        local = Path(tempfile.mkdtemp(prefix="lmprobe-merge-"))
        try:
            names = merge.finish(dss, local)
            last = [RepoFile(self.repo_path(rel), local / rel) for rel in names]
            # one commit: server-side copies out of the parts' folders (nothing is sent, nothing comes back), the
            # statistics, card and index, and the parts' folder removed
            renamed = [part_renames(ds) for ds in dss]
            committer.finish(last, moves=[(hubs[k].repo_path(renamed[k].get(src, src)), self.repo_path(dst))
                                          for k, src, dst in merge.moves],
                             remove=[self.repo_path(PARTS_DIR)], drop=self.marker_paths(),
                             before=card_merger(self, local), message="lmprobe: merge the parts")
        finally:
            shutil.rmtree(local, ignore_errors=True)
        return self.finished_or_raise()
