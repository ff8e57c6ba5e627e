"""``lmprobe push``: publish a dataset folder, and its attachments, to a Hub dataset repo."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

from ..base.display import hide_credentials
from ..base.lock import OutputLock
from ..errors import DatasetNotFoundError, OutputInUseError
from ..format.reader import Dataset, open_local
from ..format.spec import CARD_PATH, INDEX_PATH
from ..storage.commits import DEFAULT_COMMIT_BYTES, HubCommitter, PushConfig, RepoFile
from ..storage.hub import check_repo_id
from .attachments import (
    SAE_DIR,
    SAEV_DIR,
    add_attachment,
    attach,
    attachment_files,
    describe,
    scan_attachments,
)

logger = logging.getLogger(__name__)


def dataset_files(ds: Dataset) -> list[RepoFile]:
    """Every shard file a local dataset's metadata names, with the sizes and hashes it records."""
    return [RepoFile(r.rel, ds.files.fetch(r.rel), -1 if r.bytes is None else r.bytes, r.sha256)
            for r in ds.meta.files()]


def push_to_hub(
    path: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    commit_files: int | None = None,
    commit_bytes: int = DEFAULT_COMMIT_BYTES,
    max_retries: int = 5,
    base_wait: float = 2.0,
    workers: int = 8,
    commit_deadline: float = 3600.0,
    quiet: bool = False,
    saev: Iterable[str | os.PathLike] = (),
    sae: Iterable[str | os.PathLike] = (),
) -> str:
    """Publish the dataset folder ``path`` to the Hub dataset repo ``repo_id``; returns its URL.

    saev exports in ``path/saev/<HASH>/`` and SAE dictionaries in ``path/sae/<name>/`` go up too
    (``saev=``/``sae=`` copy more folders in first). The index records them (``lmprobe:attachments``)
    and the card lists them.

    >>> lmprobe.push_to_hub("out/tiny-demo", "me/tiny-demo-acts")  # doctest: +SKIP

    Files upload ``workers`` at a time while earlier ones are committed, in commits that grow along
    huggingface_hub's ladder (250 files first, up to 1,000, or at most ``commit_files``), at most
    ``LMPROBE_HUB_COMMITS_PER_HOUR`` (100) in any hour; answers of the Hub's rate limits (429) are waited out for up to
    ``commit_deadline`` seconds. Safe to re-run: an interrupted push resumes, and files already on
    the Hub are skipped.
    The token (``token=``, else HF_TOKEN or the saved login) is never printed or stored.
    The push holds the folder's output lock: a folder another run is writing is refused in one line, and a run
    that starts writing it during the push is refused.
    """
    check_repo_id(repo_id)
    config = PushConfig(commit_files=commit_files, commit_bytes=commit_bytes, workers=workers,
                        max_retries=max_retries, base_wait=base_wait, commit_deadline=commit_deadline)
    root = Path(path)
    if not root.exists():  # not a Hub name: push sends a local folder
        raise DatasetNotFoundError(f"{root} does not exist; push publishes a local dataset folder "
                                   "(lmprobe push DIR OWNER/NAME)")
    # the output lock for the whole push: a folder that a run rewrites (extract --overwrite, merge) is refused,
    # and a rewrite that starts meanwhile is refused, so the files sent are the ones the index names (R40)
    try:
        lock = OutputLock(root).acquire()
    except OutputInUseError as exc:
        who = f"process {exc.pid}" if exc.pid else "another process"
        raise OutputInUseError(f"{root} is being written by {who} (an extraction, merge or export into it); pushing "
                               "it now would publish a mix of old and new files: wait for that run to finish, then "
                               "push again", path=root, pid=exc.pid) from None
    try:
        return _push(root, repo_id, private=private, revision=revision, token=token, config=config, quiet=quiet,
                     saev=saev, sae=sae)
    finally:
        lock.release()


def _push(root: Path, repo_id: str, *, private: bool, revision: str | None, token: str | None, config: PushConfig,
          quiet: bool, saev: Iterable[str | os.PathLike], sae: Iterable[str | os.PathLike]) -> str:
    ds = open_local(root)
    shards = dataset_files(ds)  # loads and checks the metadata before anything is sent
    for kind, folders in ((SAEV_DIR, saev), (SAE_DIR, sae)):
        for folder in folders:  # checked before it is copied in: a refused part is not left in the dataset
            describe(Path(os.path.realpath(folder)), kind, ds)  # "." has no name of its own
    for folder in saev:
        add_attachment(root, folder, SAEV_DIR)
    for folder in sae:
        add_attachment(root, folder, SAE_DIR)
    attachments = scan_attachments(root, ds)  # validates every attachment before anything is sent
    attach(root, attachments, repo_id)
    shards += [RepoFile(rel, p) for rel, p in attachment_files(root, attachments)]
    last = [RepoFile(CARD_PATH, root / CARD_PATH), RepoFile(INDEX_PATH, root / INDEX_PATH)]
    if not (root / CARD_PATH).exists():
        last = last[1:]
    committer = HubCommitter(repo_id, token=token, revision=revision, config=config, label="dataset", quiet=quiet)
    committer.prepare(private)
    n = committer.push_files(shards, last)
    endpoint = hide_credentials(committer.api.endpoint.rstrip("/"))  # HF_ENDPOINT may carry user:key@
    url = f"{endpoint}/datasets/{repo_id}" + (f"/tree/{revision}" if revision else "")
    if not quiet:
        skipped = len(shards) + len(last) - n
        if n == 0:
            logger.info("pushed 0 file(s) to %s: all %s are there already, nothing to send", url, skipped)
        else:
            logger.info("pushed %s file(s) to %s in %s commit(s)%s", n, url, committer.commits,
                        f"; {skipped} already there" if skipped else "")
    return url
