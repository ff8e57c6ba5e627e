"""The models shipped inside lmprobe, and a model's tokenizer found on this machine without the network.

A dataset records its model's name and revision. ``local_tokenizer`` loads that model's tokenizer
when it is here already: the embedded model, a local folder, or a Hub id in the local Hugging Face
cache (``local_files_only``: never a request). Readers use it to show token text instead of ids.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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

        return AutoTokenizer.from_pretrained(path, revision=revision, local_files_only=True)
    except Exception:  # not in the cache, no tokenizer files, a name that is no model: show ids instead
        return None
