"""Publishing SAE dictionaries to a Hub repo of their own (``lmprobe export-sae --push``)."""

from __future__ import annotations

import os
from pathlib import Path

from ..base.display import hide_credentials
from ..errors import DictionaryError
from ..sae.loader import validate_dictionary
from ..storage.commits import HubCommitter, PushConfig, RepoFile
from ..storage.hub import check_repo_id


def dictionary_files(root: str | os.PathLike, name: str, prefix: str | None = None) -> tuple[list[RepoFile], list[RepoFile]]:
    """(layer files, [meta.json]) of a local dictionary, as repo paths under ``prefix`` (default: name)."""
    ddir = Path(root) / name
    prefix = name if prefix is None else prefix
    layer_files = sorted(p for p in ddir.rglob("*") if p.is_file() and p.parent.name.startswith("layer_"))

    def rel(p: Path) -> str:
        r = p.relative_to(ddir).as_posix()
        return f"{prefix}/{r}" if prefix else r

    return [RepoFile(rel(p), p) for p in layer_files], [RepoFile(rel(ddir / "meta.json"), ddir / "meta.json")]


def push_dictionary(root: str | os.PathLike, name: str, repo_id: str, *, private: bool = False,
                    revision: str | None = None, token: str | None = None, repo_type: str = "model",
                    prefix: str | None = None, commit_files: int | None = None, max_retries: int = 5,
                    base_wait: float = 2.0, quiet: bool = False) -> str:
    """Upload a validated dictionary; layer files in bounded commits, meta.json last. Resumable.

    >>> push_dictionary("sae", "my-sae", "me/my-sae")  # doctest: +SKIP
    """
    check_repo_id(repo_id)
    problems = validate_dictionary(root, name)
    if problems:
        raise DictionaryError(f"dictionary {name!r} does not validate, nothing pushed: " + "; ".join(problems))
    files, last = dictionary_files(root, name, prefix)
    config = PushConfig(commit_files=commit_files, max_retries=max_retries, base_wait=base_wait)
    committer = HubCommitter(repo_id, token=token, revision=revision, repo_type=repo_type, config=config,
                             label=f"SAE {name}", quiet=quiet)
    committer.prepare(private)
    committer.push_files(files, last)
    kind = "" if repo_type == "model" else f"{repo_type}s/"
    return f"{hide_credentials(committer.api.endpoint.rstrip('/'))}/{kind}{repo_id}"
