"""Publishing SAE dictionaries to a Hub model repo with the dataset push machinery."""

from __future__ import annotations

import os
from pathlib import Path

from ..hub import DEFAULT_COMMIT_BYTES, DEFAULT_COMMIT_FILES, REPO_ID_RE, _File, _Pusher
from .loader import validate_dictionary


def dictionary_files(root: str | os.PathLike, name: str, prefix: str | None = None) -> tuple[list[_File], list[_File]]:
    """(layer files, [meta.json]) of a local dictionary, as repo paths under ``prefix`` (default: name)."""
    ddir = Path(root) / name
    prefix = name if prefix is None else prefix
    layer_files = sorted(p for p in ddir.rglob("*") if p.is_file() and p.parent.name.startswith("layer_"))
    rel = (lambda p: f"{prefix}/{p.relative_to(ddir).as_posix()}") if prefix else (lambda p: p.relative_to(ddir).as_posix())
    return ([_File(rel(p), p, p.stat().st_size, None) for p in layer_files],
            [_File(rel(ddir / "meta.json"), ddir / "meta.json", -1, None)])


def push_dictionary(root: str | os.PathLike, name: str, repo_id: str, *, private: bool = False,
                    revision: str | None = None, token: str | None = None, repo_type: str = "model",
                    prefix: str | None = None, commit_files: int = DEFAULT_COMMIT_FILES, max_retries: int = 5, base_wait: float = 2.0,
                    quiet: bool = False) -> str:
    """Upload a validated dictionary; layer files in bounded commits, meta.json last. Resumable."""
    if not REPO_ID_RE.match(repo_id):
        raise ValueError(f"{repo_id!r} is not a repo id; use OWNER/NAME")
    problems = validate_dictionary(root, name)
    if problems:
        raise ValueError(f"dictionary {name!r} does not validate, nothing pushed: " + "; ".join(problems))
    files, last = dictionary_files(root, name, prefix)
    pusher = _Pusher(repo_id, token=token, revision=revision, max_retries=max_retries, base_wait=base_wait,
                     repo_type=repo_type, quiet=quiet)
    pusher.prepare(private)
    pusher.push_files(files, last, commit_files=commit_files, commit_bytes=DEFAULT_COMMIT_BYTES, label=f"SAE {name}")
    kind = "" if repo_type == "model" else f"{repo_type}s/"
    return f"{pusher.api.endpoint.rstrip('/')}/{kind}{repo_id}"
