"""Publishing to the Hugging Face Hub and reading from it.

Push: shards go up in commits of bounded size (the Hub asks for under ~100 files per commit), the
index and card last, so the repo never shows an index pointing at missing shards. A re-run skips
files already on the Hub with the same content (sha256 from the Hub's LFS metadata, compared with
the sha256 lmprobe recorded when it wrote each shard). 429/5xx answers and dropped connections
are retried with backoff; before a commit is retried, the repo is checked for it, so a commit
whose answer was lost is not made twice.

Load: ``lmprobe.load("owner/name")`` fetches the index, then only the shard files a call reads,
through the normal Hugging Face cache, all from one pinned commit.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import DatasetNotFoundError, LmprobeError, ShardMissingError
from .format.paths import check_relpath
from .format.spec import CARD_PATH, INDEX_PATH
from .hashing import sha256_file

REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")
DEFAULT_COMMIT_FILES = 50
DEFAULT_COMMIT_BYTES = 20 * 1024**3


class PushError(LmprobeError, RuntimeError):
    """A push failed after its retries. Re-running the same push resumes it."""


@dataclass(frozen=True)
class RepoRef:
    repo_id: str
    revision: str | None
    repo_type: str = "dataset"


def parse_repo_ref(path: Any, revision: str | None = None) -> RepoRef | None:
    """``owner/name`` or ``hf://datasets/owner/name[@rev]`` -> RepoRef; a local path -> None."""
    s = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(s, str):
        return None
    if s.startswith("hf://"):
        rest = s[len("hf://") :]
        repo_type = "dataset"
        for prefix, kind in (("datasets/", "dataset"), ("models/", "model")):
            if rest.startswith(prefix):
                rest, repo_type = rest[len(prefix) :], kind
                break
        else:
            if rest.startswith("spaces/"):
                raise ValueError(f"{s}: lmprobe reads dataset and model repos, not Spaces")
        parts = rest.strip("/").split("/")
        if len(parts) != 2:
            raise ValueError(f"{s}: expected hf://datasets/OWNER/NAME (optionally @REVISION)")
        name, _, rev = parts[1].partition("@")
        repo_id = f"{parts[0]}/{name}"
        if not REPO_ID_RE.match(repo_id):
            raise ValueError(f"{s}: {repo_id!r} is not a valid repo id")
        return RepoRef(repo_id, revision or (rev or None), repo_type)
    if os.path.exists(s):
        return None
    if REPO_ID_RE.match(s):
        return RepoRef(s, revision)
    return None


def _api(token: str | bool | None = None):
    from huggingface_hub import HfApi

    return HfApi(token=token)


class HubFiles:
    """Dataset files in a Hub repo, downloaded on first use into the Hugging Face cache."""

    def __init__(self, ref: RepoRef, *, token: str | bool | None = None):
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

        self.ref = ref
        self.token = token
        api = _api(token)
        try:
            info = api.repo_info(ref.repo_id, repo_type=ref.repo_type, revision=ref.revision)
        except RepositoryNotFoundError:
            raise DatasetNotFoundError(
                f"no {ref.repo_type} repo {ref.repo_id!r} on the Hub (or it is private: log in or pass token=)"
            ) from None
        except RevisionNotFoundError:
            raise DatasetNotFoundError(f"{ref.repo_id} has no revision {ref.revision!r}") from None
        self.commit: str = info.sha  # every file comes from this commit, even if the branch moves on
        self.siblings = [s.rfilename for s in (info.siblings or [])]

    def __str__(self) -> str:
        return f"hf://{self.ref.repo_type}s/{self.ref.repo_id}@{self.commit[:10]}"

    def fetch(self, rel: str, *, what: str = "file") -> Path:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        check_relpath(rel, what)
        try:
            return Path(hf_hub_download(self.ref.repo_id, rel, repo_type=self.ref.repo_type, revision=self.commit,
                                        token=self.token))
        except EntryNotFoundError:
            raise ShardMissingError(self.missing_hint(rel)) from None


    def missing_hint(self, rel: str) -> str:
        return f"{rel} is not in {self}; the repo is incomplete (was its push interrupted? re-run `lmprobe push`)"


def load_from_hub(ref: RepoRef, *, token: str | bool | None = None):
    import pyarrow.parquet as pq

    from .format.reader import Dataset

    files = HubFiles(ref, token=token)
    if INDEX_PATH in files.siblings:
        index = INDEX_PATH
    else:
        found = sorted(s for s in files.siblings if s.startswith("index/") and s.endswith(".parquet"))
        if len(found) != 1:
            raise DatasetNotFoundError(f"{files} holds no lmprobe dataset: {INDEX_PATH} is missing")
        index = found[0]
    return Dataset(files, pq.read_table(files.fetch(index, what="index")))


# ---------------------------------------------------------------------------------------------- push


@dataclass
class _File:
    rel: str
    local: Path
    size: int
    sha256: str | None  # as recorded in the metadata, when it was


def dataset_files(root: Path) -> list[_File]:
    """Every shard file the dataset's metadata names, with the sizes and hashes it records."""
    from .format.reader import load

    ds = load(root)
    out: list[_File] = []
    h = ds._info.hidden
    if h is not None:
        for s, d in enumerate(h.shards):
            recorded = d.get("files") or {}
            for layer in h.layers:
                rel = h.file(layer, s)
                rec = recorded.get(str(layer)) or {}
                out.append(_File(rel, root / rel, rec.get("bytes", -1), rec.get("sha256")))
    lg = ds._info.logits
    if lg is not None:
        for s, d in enumerate(lg.shards):
            rel = lg.file(s)
            out.append(_File(rel, root / rel, d.get("bytes", -1), d.get("sha256")))
    st = ds._info.statistics
    if st is not None:
        out.append(_File(st.file, root / st.file, st.raw.get("bytes", -1), st.raw.get("sha256")))
    return out



def _status(exc: BaseException) -> int | None:
    resp = getattr(exc, "response", None)
    return getattr(resp, "status_code", None)


def _transient(exc: BaseException) -> bool:
    """429, 5xx and dropped connections are worth retrying; other HTTP errors are not."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        status = _status(exc)
        if status is not None:
            return status == 429 or status >= 500
        mod = type(exc).__module__.split(".")[0]
        if mod in ("httpx", "httpx2", "httpcore", "httpcore2", "urllib3", "requests") or isinstance(
            exc, (ConnectionError, TimeoutError)
        ):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _describe(exc: BaseException) -> str:
    status = _status(exc)
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"HTTP {status}: {text}" if status else f"{type(exc).__name__}: {text}"


class _Pusher:
    def __init__(self, repo_id: str, *, token, revision: str | None, max_retries: int, base_wait: float,
                 repo_type: str = "dataset", quiet: bool = True):
        self.api = _api(token)
        self.repo_id = repo_id
        self.repo_type = repo_type
        self.revision = revision or "main"
        self.max_retries = max_retries
        self.base_wait = base_wait
        self.quiet = quiet
        self.commits = 0

    def retry(self, what: str, fn: Callable[[], Any], landed: Callable[[], bool] | None = None) -> Any:
        for attempt in range(self.max_retries + 1):
            try:
                return fn()
            except Exception as exc:
                if not _transient(exc) or attempt == self.max_retries:
                    raise PushError(
                        f"{what} failed ({_describe(exc)})"
                        + (f" after {attempt + 1} attempts" if attempt else "")
                        + f"; the repo {self.repo_id} holds every commit made so far (shards only until the index "
                        "is pushed, last). Run the same push again to resume: files already there are skipped."
                    ) from exc
                wait = self.base_wait * 2**attempt
                retry_after = getattr(getattr(exc, "response", None), "headers", {}) or {}
                if str(retry_after.get("Retry-After", "")).isdigit():
                    wait = max(wait, float(retry_after["Retry-After"]))
                time.sleep(wait)
                if landed is not None:
                    try:
                        if landed():  # the commit went through but its answer was lost
                            return None
                    except Exception:
                        pass
        raise AssertionError("unreachable")

    def remote_files(self) -> dict[str, str]:
        """path -> sha256 (LFS files) or git blob id (regular files) at the target revision."""
        from huggingface_hub import RepoFile
        from huggingface_hub.errors import RevisionNotFoundError

        try:
            entries = self.api.list_repo_tree(self.repo_id, repo_type=self.repo_type, revision=self.revision,
                                              recursive=True)
            return {e.path: (e.lfs.sha256 if e.lfs else e.blob_id) for e in entries if isinstance(e, RepoFile)}
        except RevisionNotFoundError:
            return {}

    def prepare(self, private: bool) -> None:
        self.retry("creating the repo", lambda: self.api.create_repo(
            self.repo_id, repo_type=self.repo_type, private=private, exist_ok=True))
        if self.revision != "main":
            self.retry("creating the branch", lambda: self.api.create_branch(
                self.repo_id, repo_type=self.repo_type, branch=self.revision, exist_ok=True))

    def commit(self, files: list[_File], message: str) -> None:
        from huggingface_hub import CommitOperationAdd

        def ops():
            out = []
            for f in files:
                op = CommitOperationAdd(path_in_repo=f.rel, path_or_fileobj=str(f.local))
                if f.sha256:
                    op.upload_info.sha256 = bytes.fromhex(f.sha256)  # recorded at write time: no second hashing
                out.append(op)
            return out

        def landed() -> bool:
            remote = self.remote_files()
            return all(remote.get(f.rel) == f.sha256 for f in files if f.sha256)

        self.retry(
            f"committing {len(files)} file(s) to {self.repo_id}",
            lambda: self.api.create_commit(self.repo_id, ops(), commit_message=message, repo_type=self.repo_type,
                                           revision=self.revision),
            landed=landed if all(f.sha256 for f in files) else None,
        )
        self.commits += 1

    def push_files(self, files: list[_File], last: list[_File], *, commit_files: int, commit_bytes: int,
                   label: str) -> int:
        """Upload ``files`` in bounded commits (skipping those already there), then ``last`` in one commit."""
        from tqdm.auto import tqdm

        for f in [*files, *last]:
            if not f.local.is_file():
                raise PushError(f"{f.local} is missing; the local dataset is incomplete, nothing was pushed")
            if f.sha256 is None:
                f.sha256 = sha256_file(f.local)
            f.size = f.local.stat().st_size
        remote = self.retry(f"listing {self.repo_id}", self.remote_files)
        todo = [f for f in files if remote.get(f.rel) != f.sha256]
        final = [f for f in last if remote.get(f.rel) != f.sha256]
        batches: list[list[_File]] = []
        for f in todo:
            if not batches or len(batches[-1]) >= commit_files or sum(x.size for x in batches[-1]) + f.size > commit_bytes:
                batches.append([])
            batches[-1].append(f)
        bar = None if self.quiet else tqdm(total=sum(f.size for f in todo + final), unit="B", unit_scale=True,
                                           desc=f"push {self.repo_id}")
        try:
            for i, batch in enumerate(batches):
                self.commit(batch, f"lmprobe: add {label} files ({i + 1}/{len(batches)})")
                if bar is not None:
                    bar.update(sum(f.size for f in batch))
            if final:
                self.commit(final, f"lmprobe: add {label} index and card")
                if bar is not None:
                    bar.update(sum(f.size for f in final))
        finally:
            if bar is not None:
                bar.close()
        return len(todo) + len(final)


def push_to_hub(
    path: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    commit_files: int = DEFAULT_COMMIT_FILES,
    commit_bytes: int = DEFAULT_COMMIT_BYTES,
    max_retries: int = 5,
    base_wait: float = 2.0,
    quiet: bool = False,
    saev: Iterable[str | os.PathLike] = (),
    sae: Iterable[str | os.PathLike] = (),
) -> str:
    """Publish the dataset folder ``path`` to the Hub dataset repo ``repo_id``; returns its URL.

    saev exports in ``path/saev/<HASH>/`` and SAE dictionaries in ``path/sae/<name>/`` go up too
    (``saev=``/``sae=`` copy more folders in first). The index records them (``lmprobe:extras``)
    and the card lists them.

    >>> lmprobe.push_to_hub("out/tiny-demo", "me/tiny-demo-acts")  # doctest: +SKIP

    Safe to re-run: an interrupted push resumes, and files already on the Hub are skipped.
    The token (``token=``, else HF_TOKEN or the saved login) is never printed or stored.
    """
    if not REPO_ID_RE.match(repo_id):
        raise ValueError(f"{repo_id!r} is not a repo id; use OWNER/NAME")
    if commit_files < 1:
        raise ValueError("commit_files must be >= 1")
    from .extras import add_extra, attach_extras, extra_files, scan_extras

    root = Path(path)
    shards = dataset_files(root)  # loads and checks the metadata before anything is sent
    for folder in saev:
        add_extra(root, folder, "saev")
    for folder in sae:
        add_extra(root, folder, "sae")
    extras = scan_extras(root)  # validates every extra before anything is sent
    attach_extras(root, extras, repo_id)
    shards += [_File(rel, p, p.stat().st_size, None) for rel, p in extra_files(root, extras)]
    last = [_File(CARD_PATH, root / CARD_PATH, -1, None), _File(INDEX_PATH, root / INDEX_PATH, -1, None)]
    if not (root / CARD_PATH).exists():
        last = last[1:]
    if quiet:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    pusher = _Pusher(repo_id, token=token, revision=revision, max_retries=max_retries, base_wait=base_wait,
                     quiet=quiet)
    pusher.prepare(private)
    n = pusher.push_files(shards, last, commit_files=commit_files, commit_bytes=commit_bytes, label="dataset")
    endpoint = pusher.api.endpoint.rstrip("/")
    url = f"{endpoint}/datasets/{repo_id}" + (f"/tree/{revision}" if revision else "")
    if not quiet:
        skipped = len(shards) + len(last) - n
        print(f"pushed {n} file(s) to {url} in {pusher.commits} commit(s)"
              + (f"; {skipped} already there" if skipped else ""))
    return url


# ---------------------------------------------------------------------------------------------- pull


def pull(
    repo: str,
    out: str | os.PathLike,
    *,
    layers: Iterable[int] | None = None,
    logits: bool = True,
    only: str | None = None,
    revision: str | None = None,
    token: str | None = None,
    quiet: bool = False,
) -> Path:
    """Copy the index, the card and only the shards of ``layers`` (all when None) to a local folder.

    ``only="saev"`` or ``"sae"`` (or a path such as ``"saev/<HASH>"``) copies just those extra
    parts instead; ``only="dataset"`` (the default) copies the dataset.

    >>> lmprobe.hub.pull("me/acts", "acts-16", layers=[16])  # doctest: +SKIP
    """
    ref = parse_repo_ref(repo, revision)
    if ref is None:
        raise ValueError(f"{repo!r} is not a Hub repo id (OWNER/NAME or hf://datasets/OWNER/NAME)")
    ds = load_from_hub(ref, token=token)
    files: HubFiles = ds._files
    out = Path(out)
    from tqdm.auto import tqdm

    if only not in (None, "dataset"):
        prefix = only.strip("/") + "/"
        if not prefix.startswith(("saev/", "sae/")):
            raise ValueError(f"only must be 'dataset', 'saev', 'sae' or a path under them, got {only!r}")
        rels = sorted(s for s in files.siblings if s.startswith(prefix))
        if not rels:
            raise ShardMissingError(f"{files} has nothing under {prefix}")
        meta_names = ("metadata.json", "meta.json")
        rels.sort(key=lambda r: r.rsplit("/", 1)[-1] in meta_names)  # metadata last
        for rel in tqdm(rels, desc=f"pull {ref.repo_id}", unit="file", disable=quiet):
            _copy_into(files.fetch(rel), out / rel)
        if not quiet:
            print(f"pulled {len(rels)} file(s) under {prefix} of {files} to {out}")
        return out
    wanted = ds.layers if layers is None else [int(x) for x in layers]
    missing = [x for x in wanted if x not in ds.layers]
    if missing:
        raise KeyError(f"layers {missing} are not in {files}; it stores {ds.layers}")
    h = ds._info.hidden
    rels = [h.file(layer, s) for layer in wanted for s in range(len(h.shards))]
    if logits and ds._info.logits is not None:
        rels += [ds._info.logits.file(s) for s in range(len(ds._info.logits.shards))]
    if CARD_PATH in files.siblings:
        rels.append(CARD_PATH)
    rels.append(INDEX_PATH)  # last: a local folder with an index is complete
    for rel in tqdm(rels, desc=f"pull {ref.repo_id}", unit="file", disable=quiet):
        _copy_into(files.fetch(rel), out / rel)
    if not quiet:
        print(f"pulled {len(rels)} file(s) of {files} (layers {wanted}) to {out}")
    return out


def _copy_into(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def parse_hub_path(path: str) -> tuple[str, str, str]:
    """``hf://[datasets/|models/]OWNER/NAME[/SUB/PATH]`` -> (repo_id, repo_type, sub path)."""
    rest = path[len("hf://") :]
    repo_type = "model"
    for prefix, kind in (("datasets/", "dataset"), ("models/", "model")):
        if rest.startswith(prefix):
            rest, repo_type = rest[len(prefix) :], kind
            break
    parts = rest.strip("/").split("/")
    if len(parts) < 2 or not REPO_ID_RE.match("/".join(parts[:2])):
        raise ValueError(f"{path}: expected hf://[datasets/]OWNER/NAME[/path]")
    return "/".join(parts[:2]), repo_type, "/".join(parts[2:])
