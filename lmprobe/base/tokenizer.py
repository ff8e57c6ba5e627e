"""The models shipped inside lmprobe, and the one way lmprobe finds a dataset's tokenizer.

A dataset records its model's name and revision. ``resolve_tokenizer`` loads that model's
tokenizer, looking in this order: the embedded model (``lmprobe-tiny``), a local folder, the local
Hugging Face cache (never a request), and only then the Hub, after one look that it answers.
``ds.prompt()`` (no download), ``lmprobe report``/``features`` and ``ShardStream``'s
``skip_special_tokens=True`` all go through it.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError, ModelError
from .display import hide_credentials, one_line
from .retry import describe

#: name -> folder under lmprobe/models/
EMBEDDED_MODELS = {"lmprobe-tiny": "tiny"}
MODELS_DIR = Path(__file__).resolve().parent.parent / "models"  # lmprobe/models/


def embedded_model_dir(name: str) -> Path | None:
    """The folder of an embedded model (``lmprobe-tiny`` or ``builtin:lmprobe-tiny``), else None."""
    key = name.removeprefix("builtin:")
    return MODELS_DIR / EMBEDDED_MODELS[key] if key in EMBEDDED_MODELS else None


def resolve_tokenizer(name: Any, revision: Any = None, *, download: bool = True, need: str | None = None) -> Any:
    """The tokenizer of model ``name`` at ``revision``: embedded, a local folder, the local cache, then the Hub.

    ``download=False`` never sends a request. When it cannot be loaded: None, or with ``need`` (what
    needs it, for the message) an InvalidArgumentError that says why, in one line.

    >>> tok = resolve_tokenizer("lmprobe-tiny")   # doctest: +SKIP
    """
    def fail(why: str) -> None:
        if need:
            raise InvalidArgumentError(f"{need} needs the tokenizer of {name!r}, which cannot be loaded here ({why})")

    if not isinstance(name, str) or not name:
        return fail("the dataset records no model name")
    embedded = embedded_model_dir(name)
    local = embedded is not None or os.path.isdir(name)
    path = str(embedded) if embedded is not None else name
    if local or not isinstance(revision, str) or revision.startswith("sha256:"):
        revision = None  # a folder has no revisions; sha256: is the embedded model's weights digest
    from transformers import AutoTokenizer

    try:  # here already: never a request
        return AutoTokenizer.from_pretrained(path, revision=revision, local_files_only=True,
                                                 trust_remote_code=False)  # a dataset's name never runs code
    except Exception as exc:  # not in the cache, no tokenizer files, a name that is no model
        why = f"{type(exc).__name__}: {one_line(exc)}"
    if not local and download:
        try:
            if not hub_access(path, revision, "the tokenizer"):  # one look, not five retries (else: cached only)
                return AutoTokenizer.from_pretrained(path, revision=revision, trust_remote_code=False)
        except ModelError as exc:
            why = str(exc)
        except Exception as exc:  # noqa: BLE001 - a repo that is no model, no tokenizer files: said in the message
            why = f"{type(exc).__name__}: {one_line(exc)}"
    return fail(why)


#: the special-token attributes of a tokenizer_config.json whose ids make transformers' ``all_special_ids``
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
                      "additional_special_tokens", "extra_special_tokens")


def special_token_ids(name: Any, revision: Any = None) -> list[int] | None:
    """The ids of model ``name``'s special tokens (transformers' ``all_special_ids``) read from its tokenizer
    files as JSON, without loading transformers (seconds): the embedded model, a local folder or the local
    Hugging Face cache, never a request. None when the files are not here or do not say it plainly (a
    sentencepiece model without tokenizer.json, a token the vocabulary lacks): ``resolve_tokenizer`` then
    loads the tokenizer.

    >>> special_token_ids("lmprobe-tiny")
    [0, 1, 2, 3]
    """
    if not isinstance(name, str) or not name:
        return None
    embedded = embedded_model_dir(name)
    folder = embedded if embedded is not None else Path(name) if os.path.isdir(name) else None

    def file(rel: str) -> Path | None:
        if folder is not None:
            return folder / rel if (folder / rel).is_file() else None
        try:
            from huggingface_hub import try_to_load_from_cache  # the cache only: no request
        except ImportError:
            return None
        rev = revision if isinstance(revision, str) and not revision.startswith("sha256:") else None
        try:
            found = try_to_load_from_cache(name, rel, revision=rev)
        except ValueError:  # not a repo id
            return None
        return Path(found) if isinstance(found, str) else None

    def read(rel: str, limit: int) -> Any:
        path = file(rel)
        if path is None or path.stat().st_size > limit:
            return None
        try:
            return json.loads(path.read_bytes())
        except ValueError:
            return None

    config, tokens = read("tokenizer_config.json", 1 << 24), read("tokenizer.json", 1 << 30)
    mapped = read("special_tokens_map.json", 1 << 24) or {}
    if not isinstance(config, dict) or not isinstance(tokens, dict) or not isinstance(mapped, dict):
        return None
    if "auto_map" in config:  # a tokenizer of its own code: never guessed at (resolve_tokenizer refuses to run it)
        return None
    added = tokens.get("added_tokens") if isinstance(tokens.get("added_tokens"), list) else []
    vocab = (tokens.get("model") or {}).get("vocab") if isinstance(tokens.get("model"), dict) else None
    ids = {t.get("content"): t.get("id") for t in added if isinstance(t, dict)}
    if isinstance(vocab, dict):
        ids = {**vocab, **ids}
    elif vocab is not None:
        return None  # a vocabulary as a list (unigram): leave it to transformers
    out: set[int] = set()
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key, mapped.get(key))
        for token in value if isinstance(value, list) else [value] if value is not None else []:
            content = token.get("content") if isinstance(token, dict) else token
            found = ids.get(content) if isinstance(content, str) else None
            if not isinstance(found, int) or isinstance(found, bool):
                return None  # not plainly said: transformers knows better
            out.add(found)
    return sorted(out) if out else None


def local_tokenizer(name: Any, revision: Any = None) -> Any:
    """The tokenizer of model ``name`` if it is on this machine (``resolve_tokenizer`` without downloads), else None.

    >>> tok = local_tokenizer("lmprobe-tiny")   # doctest: +SKIP
    """
    return resolve_tokenizer(name, revision, download=False)


def close_embedded_name(name: str) -> str | None:
    """The embedded model a mistyped name was probably meant to be (``lmprobe-tinny``), else None."""
    found = difflib.get_close_matches(name.removeprefix("builtin:"), list(EMBEDDED_MODELS), n=1, cutoff=0.8)
    return found[0] if found else None


def hub_access(repo_id: str, revision: str | None, what: str, *, token: str | bool | None = None) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments for loading Hub repo ``repo_id``, after one look at the Hub.

    ``{}`` when the Hub answers (or offline mode is on: transformers then reads the cache itself);
    ``{"local_files_only": True}`` when it cannot be reached but the files are in the local cache;
    otherwise a one-line ModelError at once (huggingface_hub would retry five times, about 30 s).
    ``token``: the identity the look goes with, as the downloads that follow (a string; else none).
    """
    from huggingface_hub import constants, get_session, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE:
        return {}
    try:
        get_session().head(constants.ENDPOINT, timeout=10,
                           headers={"authorization": f"Bearer {token}"} if isinstance(token, str) else None)
    except Exception as exc:  # noqa: BLE001 - any failure to get an answer is "unreachable"
        if isinstance(try_to_load_from_cache(repo_id, "config.json", revision=revision), str):
            return {"local_files_only": True}
        raise ModelError(f"cannot reach the Hub at {hide_credentials(constants.ENDPOINT)} to load {what} {repo_id!r} ({describe(exc)}), "
                         "and it is not in the local cache; check the network (or HF_ENDPOINT), or pass a local "
                         "folder") from None
    return {}
