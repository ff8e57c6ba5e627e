"""A model's config.json, read as untrusted input before transformers sees it.

A config file decides how much lmprobe builds: a miniature and a weightless skeleton keep its layer count,
so ``num_hidden_layers: 1000000`` would grow a model of a million blocks on the meta device for minutes.
transformers reads whatever the file says: a negative width reaches ``torch.empty`` as a raw RuntimeError,
5,000 nested lists a RecursionError in the JSON decoder, an ``auto_map`` without ``--trust-remote-code``
its own multi-line ValueError. ``check_config_file`` reads the file once, with every bound below, and
refuses each of these in one line before anything grows with the file:

- the file: a regular file of at most MAX_CONFIG_BYTES, nested at most MAX_DEPTH deep (counted on the
  text, before the decoder recurses), one JSON object;
- layer counts (every attribute named as transformers names one, in any sub-config): 0 to MAX_LAYERS;
- sizes (widths, head counts and sizes, vocabularies, expert counts, as the miniature reads names):
  no negative value, none above MAX_SIZE, expert counts at most MAX_EXPERTS;
- code: an ``auto_map`` for a model type transformers does not know needs ``--trust-remote-code``.

The bounds are far above real models (the deepest has about 130 blocks, the widest MoE 512 routed experts
(Doge 16,384 product-key ones), and configs are tens of KB) and far below what would take a machine's memory or minutes.
"""

from __future__ import annotations

import json
import os
import re
import stat
from typing import Any

from ..errors import ModelError
from .miniature import attribute_role

__all__ = ["MAX_CONFIG_BYTES", "MAX_DEPTH", "MAX_EXPERTS", "MAX_LAYERS", "MAX_SIZE", "check_config",
           "check_config_file", "nesting_depth"]

#: configs are tens of KB (a classifier's label names make the largest, about 1 MB)
MAX_CONFIG_BYTES = 8 * 2**20
#: nesting of objects and lists: a multimodal config holds sub-configs three or four deep
MAX_DEPTH = 32
#: blocks of any one stack: real models have up to about 130; a miniature keeps the count
MAX_LAYERS = 1024
#: experts of one layer: routed MoEs have up to 512, product-key experts (Doge) 16,384; a skeleton may build
#: every one as a module
MAX_EXPERTS = 65536
#: any width, head count, head size or vocabulary (torch's sizes are int64; nothing real comes near)
MAX_SIZE = 2**31 - 1

#: the attributes that count a stack's blocks (model.read_model_spec reads the decoder's)
LAYER_COUNTS = frozenset({"num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers",
                          "num_decoder_layers", "encoder_layers", "num_encoder_layers"})
_SIZE_ROLES = frozenset({"width", "per_layer_width", "head_dim", "heads", "kv_heads", "vocab", "experts",
                         "shared_experts", "top_k", "rank", "ssm_state"})
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(rb"[\[\]{}]")


def nesting_depth(text: bytes) -> int:
    """How deep the objects and lists of the JSON ``text`` nest, counted on the text (no recursion).

    >>> nesting_depth(b'{"a": [1, {"b": "]]]"}]}')
    3
    """
    depth = deepest = 0
    for m in _BRACKETS.finditer(_STRINGS.sub(b'""', text)):
        depth += 1 if m.group() in (b"[", b"{") else -1
        deepest = max(deepest, depth)
    return deepest


def check_config_file(path: str | os.PathLike, *, model: str, trust_remote_code: bool) -> dict[str, Any]:
    """The config.json at ``path``, parsed and checked (see the module docstring); a one-line ModelError
    naming ``model`` and what to do otherwise.

    >>> import json, tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "config.json"
    >>> _ = p.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 1000000}))
    >>> check_config_file(p, model="m", trust_remote_code=False)
    Traceback (most recent call last):
    ...
    lmprobe.errors.ModelError: the config.json of model 'm' gives num_hidden_layers=1000000, more than 1024 layers; it is not a model lmprobe can examine (check the file)
    """
    where = f"the config.json of model {model!r}"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block the open
    except OSError as exc:
        raise ModelError(f"cannot read {where}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ModelError(f"{where} is not a regular file; pass a folder that holds the model's config.json")
        if st.st_size > MAX_CONFIG_BYTES:
            raise ModelError(f"{where} is {st.st_size:,} bytes, more than {MAX_CONFIG_BYTES:,}; it is not a model "
                             "config lmprobe reads (check the file)")
        text = f.read(MAX_CONFIG_BYTES + 1)
    if len(text) > MAX_CONFIG_BYTES:
        raise ModelError(f"{where} is more than {MAX_CONFIG_BYTES:,} bytes; it is not a model config lmprobe reads")
    depth = nesting_depth(text)
    if depth > MAX_DEPTH:
        raise ModelError(f"{where} nests {depth} levels deep, more than {MAX_DEPTH}; it is not a model config "
                         "lmprobe reads (check the file)")
    try:
        config = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, invalid UTF-8, an integer of more than 4300 digits
        raise ModelError(f"{where} is not valid JSON ({exc}); fix or replace the file") from None
    if not isinstance(config, dict):
        raise ModelError(f"{where} holds a JSON {type(config).__name__}, not an object; fix or replace the file")
    check_config(config, model=model, trust_remote_code=trust_remote_code)
    return config


def check_config(config: dict[str, Any], *, model: str, trust_remote_code: bool) -> None:
    """Check a parsed config dict's layer counts, sizes and ``auto_map`` (see the module docstring)."""
    where = f"the config.json of model {model!r}"
    for path, key, value in _integers(config, ""):
        name = f"{path}{key}"
        if key in LAYER_COUNTS and not 0 <= value <= MAX_LAYERS:
            raise ModelError(f"{where} gives {name}={value}, " + ("a negative number of layers" if value < 0 else
                             f"more than {MAX_LAYERS} layers") + "; it is not a model lmprobe can examine (check "
                             "the file)")
        role = attribute_role(key)
        if role not in _SIZE_ROLES:
            continue
        if value < 0:
            raise ModelError(f"{where} gives {name}={value}: a size cannot be negative; fix or replace the file")
        limit = MAX_EXPERTS if role == "experts" else MAX_SIZE
        if value > limit:
            raise ModelError(f"{where} gives {name}={value}, more than {limit:,}; it is not a model lmprobe can "
                             "examine (check the file)")
    if "auto_map" in config and not trust_remote_code and not _known_type(config.get("model_type")):
        kind = config.get("model_type")
        raise ModelError(f"model {model!r} ships its own code (config.json names auto_map for model type "
                         f"{kind!r}, which transformers does not know); read that code, then pass "
                         "--trust-remote-code (trust_remote_code=True) to run it")


def _integers(tree: Any, path: str):
    """(path, key, value) of every integer attribute, or integer entry of a list attribute, in the tree."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            if not isinstance(k, str):
                continue
            items = v if isinstance(v, list) else [v]
            for x in items:
                if isinstance(x, int) and not isinstance(x, bool):
                    yield path, k, x
            if isinstance(v, dict | list):
                yield from _integers(v, f"{path}{k}.")
    elif isinstance(tree, list):
        for v in tree:
            yield from _integers(v, path)


def _known_type(model_type: Any) -> bool:
    from transformers import CONFIG_MAPPING

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING
