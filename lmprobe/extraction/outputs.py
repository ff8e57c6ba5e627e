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
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from ..atomic import move_into_place
from ..errors import DatasetNotFoundError, ExtractionError, InvalidArgumentError
from ..format.merge import MergePlan, plan_merge
from ..format.reader import Dataset, open_local
from ..format.spec import CARD_PATH, INDEX_PATH
from ..lock import OutputLock
from ..opening import open_object_store
from ..paths import check_output_path, check_relpath
from ..storage.objectstore import UploadSink, cache_dir, filesystem, is_object_store_url, object_store_policy

logger = logging.getLogger("lmprobe")

#: where the parts of a multi-process job are kept until they are merged (a folder, or a prefix)
PARTS_DIR = ".lmprobe-parts"


def part_name(rank: int) -> str:
    return f"part-{rank:05d}"


class Session(ABC):
    """What takes an extraction's files as the writer finishes them (``writer_callbacks``), then finishes the output."""

    def writer_callbacks(self) -> dict[str, Any]:
        """The writer's ``on_file_complete``/``on_file_renamed`` (none: the files stay where they are written)."""
        return {}

    @abstractmethod
    def finish(self) -> Dataset:
        """After the writer closed: everything in place (the index last); the dataset, opened."""

    @abstractmethod
    def abort(self) -> None:
        """The extraction stopped: stop sending, keep what is resumable."""


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
    def session(self, *, overwrite: bool) -> Session:
        """Start writing (``overwrite``: what an earlier run left is replaced, never resumed)."""

    @abstractmethod
    def part(self, rank: int) -> Output:
        """Where rank ``rank`` of a multi-process job writes its part."""

    @abstractmethod
    def merge(self, parts: list[Output], *, settings: dict, order: str, quiet: bool) -> Dataset:
        """Make the finished parts one dataset here (shards renamed, never read), and remove the parts."""

    @property
    def local(self) -> bool:
        return False


def open_output(out: str | os.PathLike) -> Output:
    """The output ``out`` names, checked before anything expensive runs."""
    s = os.fspath(out)
    if isinstance(s, str) and s.startswith("hf://"):
        from .hub_output import HubOutput

        return HubOutput.parse(s)
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

    def session(self, *, overwrite: bool) -> Session:
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
                move_into_place(dss[k].fetch(src, "shard file"), self.path / dst)
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

    def session(self, *, overwrite: bool) -> Session:
        return _ObjectStoreSession(self, overwrite=overwrite)

    def part(self, rank: int) -> Output:
        return ObjectStoreOutput(f"{self.url}/{PARTS_DIR}/{part_name(rank)}")

    def move(self, old: str, new: str, *, source: ObjectStoreOutput | None = None) -> None:
        """Rename ``old`` (of ``source``, default: this output) to ``new`` here, server-side (copy, then delete)."""
        from ..retry import call_with_retry

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
