"""The models shipped inside lmprobe, and a model's tokenizer found on this machine without the network.

A dataset records its model's name and revision. ``local_tokenizer`` loads that model's tokenizer
when it is here already: the embedded model, a local folder, or a Hub id in the local Hugging Face
cache (``local_files_only``: never a request). Readers use it to show token text instead of ids.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

from .display import hide_credentials
from .errors import ModelError
from .retry import describe

#: name -> folder under lmprobe/models/
EMBEDDED_MODELS = {"lmprobe-tiny": "tiny"}
MODELS_DIR = Path(__file__).resolve().parent / "models"


def embedded_model_dir(name: str) -> Path | None:
    """The folder of an embedded model (``lmprobe-tiny`` or ``builtin:lmprobe-tiny``), else None."""
    key = name.removeprefix("builtin:")
    return MODELS_DIR / EMBEDDED_MODELS[key] if key in EMBEDDED_MODELS else None


def local_tokenizer(name: Any, revision: Any = None) -> Any:
    """The tokenizer of model ``name`` at ``revision`` if it is on this machine, else None; never downloads.

    >>> tok = local_tokenizer("lmprobe-tiny")   # doctest: +SKIP
    """
    if not isinstance(name, str) or not name:
        return None
    embedded = embedded_model_dir(name)
    path = str(embedded) if embedded is not None else name
    if embedded is not None or os.path.isdir(name) or not isinstance(revision, str) or revision.startswith("sha256:"):
        revision = None  # a folder has no revisions; sha256: is the embedded model's weights digest
    try:
        from transformers import AutoTokenizer

        # trust_remote_code=False: a name read from a dataset never runs a repo's code (transformers would ask)
        return AutoTokenizer.from_pretrained(path, revision=revision, local_files_only=True, trust_remote_code=False)
    except Exception:  # not in the cache, no tokenizer files, a name that is no model: show ids instead
        return None


def close_embedded_name(name: str) -> str | None:
    """The embedded model a mistyped name was probably meant to be (``lmprobe-tinny``), else None."""
    found = difflib.get_close_matches(name.removeprefix("builtin:"), list(EMBEDDED_MODELS), n=1, cutoff=0.8)
    return found[0] if found else None


def hub_access(repo_id: str, revision: str | None, what: str) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments for loading Hub repo ``repo_id``, after one look at the Hub.

    ``{}`` when the Hub answers (or offline mode is on: transformers then reads the cache itself);
    ``{"local_files_only": True}`` when it cannot be reached but the files are in the local cache;
    otherwise a one-line ModelError at once (huggingface_hub would retry five times, about 30 s).
    """
    from huggingface_hub import constants, get_session, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE:
        return {}
    try:
        get_session().head(constants.ENDPOINT, timeout=10)
    except Exception as exc:  # noqa: BLE001 - any failure to get an answer is "unreachable"
        if isinstance(try_to_load_from_cache(repo_id, "config.json", revision=revision), str):
            return {"local_files_only": True}
        raise ModelError(f"cannot reach the Hub at {hide_credentials(constants.ENDPOINT)} to load {what} {repo_id!r} ({describe(exc)}), "
                         "and it is not in the local cache; check the network (or HF_ENDPOINT), or pass a local "
                         "folder") from None
    return {}
