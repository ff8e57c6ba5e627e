"""What a Hub output finds in the repo it writes and must respect: the owner's README.md, which gets lmprobe's section
merged in instead of being replaced, and the old dataset's shards, which an overwrite removes (only those its index
named). Everything read from the repo is untrusted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..base.atomic import atomic_write
from ..base.paths import check_relpath
from ..errors import ExtractionError, LmprobeError
from ..format.card import update_card
from ..format.metadata import decode_schema_metadata
from ..format.spec import CARD_PATH, INDEX_PATH
from .hub import hub_api

logger = logging.getLogger(__name__)

#: the largest README.md read from a repo to merge lmprobe's section into
MAX_CARD_BYTES = 8 << 20


def old_shards(output: Any) -> list[str]:
    """The shard files of the dataset ``output`` (a HubOutput) holds, as its index names them, that the repo holds
    (under ``tensors/``, relative to the output): what an overwrite removes. Nothing when the old index cannot be read
    (then nothing it might have named is guessed at)."""
    from huggingface_hub.errors import EntryNotFoundError

    try:
        old = output.finished()
        named = {r.rel for r in old.meta.files()} if old is not None else set()
    except LmprobeError as exc:
        logger.warning("%s: the old index cannot be read (%s); its shards are left as they are", output, exc)
        return []
    named = {rel for rel in named if rel.startswith("tensors/") and _safe(rel)}
    if not named:
        return []
    try:
        held = {e.path for e in hub_api(output.token).list_repo_tree(
            output.ref.repo_id, path_in_repo=output.repo_path("tensors"), recursive=True, repo_type="dataset",
            revision=output.ref.revision)}
    except EntryNotFoundError:
        return []
    return sorted(rel for rel in named if output.repo_path(rel) in held)


def _safe(rel: str) -> bool:
    try:
        check_relpath(rel, "shard file")
    except LmprobeError:
        return False
    return ".." not in rel.split("/")


def card_merger(output: Any, local: Path) -> Callable[[str | None], None]:
    """What runs before each try of the commit that publishes the card (``HubCommitter.finish(before=...)``): the
    card merged into the README.md of the revision that commit is made on (the branch when None), once per
    revision, so that an edit the owner made meanwhile is kept (the job's commits are made on the revision it last
    saw: storage/claim.py)."""
    generated = (local / CARD_PATH).read_bytes() if (local / CARD_PATH).is_file() else None
    merged_at: list[str | None] = []

    def merge(parent: str | None) -> None:
        if generated is None or (parent is not None and merged_at == [parent]):
            return
        atomic_write(local / CARD_PATH, generated)  # the card as the writer made it, merged afresh
        keep_their_card(output, local, revision=parent)
        merged_at[:] = [parent]

    merge(None)  # now, at the branch: the card that goes up (and is compared with the repo's) is the merged one
    merged_at.clear()
    return merge


def keep_their_card(output: Any, local: Path, *, revision: str | None = None) -> None:
    """The generated card in ``local`` becomes the repo's README.md (at ``revision``, default the output's branch)
    with lmprobe's section and front-matter keys merged in (``format.card.update_card``): the owner's text and keys
    stay, as when attachments are published. The README read from the repo is untrusted: at most
    ``MAX_CARD_BYTES``, text, its YAML parsed safely."""
    import pyarrow.parquet as pq
    from huggingface_hub import hf_hub_download

    rel = output.repo_path(CARD_PATH)
    revision = revision or output.ref.revision
    found = hub_api(output.token).get_paths_info(output.ref.repo_id, [rel], repo_type="dataset", revision=revision)
    if not found:
        return
    if (getattr(found[0], "size", 0) or 0) > MAX_CARD_BYTES:
        raise ExtractionError(f"{output}: the repo's README.md is over {MAX_CARD_BYTES >> 20} MiB, so lmprobe's "
                              "section cannot be merged into it; shorten it, then run the same command again "
                              "(it resumes)")
    path = hf_hub_download(output.ref.repo_id, rel, repo_type="dataset", revision=revision, token=output.token)
    existing = Path(path).read_bytes()[:MAX_CARD_BYTES].decode("utf-8", errors="replace")
    schema = pq.read_schema(local / INDEX_PATH)
    atomic_write(local / CARD_PATH, update_card(existing, decode_schema_metadata(schema.metadata), schema).encode())
