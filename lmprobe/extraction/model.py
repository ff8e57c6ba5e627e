"""Resolving a model name, reading its config, loading weights and finding its decoder blocks."""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..base.display import one_line
from ..base.hashing import sha256_file
from ..base.layers import parse_layers as parse_layer_spec
from ..base.progress import third_party_bars
from ..base.tokenizer import EMBEDDED_MODELS, close_embedded_name, embedded_model_dir, hub_access
from ..errors import LmprobeError, ModelError
from ..format.values import torch_dtype
from .configfile import check_config_file
from .placement import Placement, describe_spread, input_device, require_accelerate

logger = logging.getLogger(__name__)


def resolve_model_path(name: str) -> tuple[str, bool]:
    """(path or Hub id, is_local). Embedded names resolve to the model shipped inside lmprobe."""
    path = embedded_model_dir(name)
    if path is not None:
        if not (path / "config.json").exists():
            raise ModelError(f"the embedded model {name!r} is missing from {path}; reinstall lmprobe")
        return str(path), True
    if os.path.isdir(name):
        return name, True
    if os.path.exists(name):
        raise ModelError(f"--model {name!r} is a file; pass the folder that holds config.json")
    meant = close_embedded_name(name)
    if meant is not None:
        raise ModelError(f"--model {name!r} is neither a local folder nor a model shipped with lmprobe; did you "
                         f"mean {meant!r}?")
    return name, False


@dataclass
class ModelSpec:
    name: str  # as recorded in metadata
    path: str  # what from_pretrained gets
    local: bool
    revision: str | None
    trust_remote_code: bool
    config: Any
    num_layers: int
    hidden_size: int
    causal_lm: bool
    recorded_revision: str | None = None  # what the dataset records as model.revision
    cached_only: bool = False  # the Hub is unreachable and the files are in the local cache: never ask it
    weights: str | None = None  # a local folder's weights fingerprint (``weights_fingerprint``): no commit names them
    # the Hub identity of every download of the model's files (config, tokenizer, weights; None: HF_TOKEN or the
    # saved login): kept in memory only, never shown (repr) nor recorded
    token: str | bool | None = field(default=None, repr=False, compare=False)


_IDENTITY_LOCK = threading.Lock()


@contextmanager
def transformers_identity(token: str | bool | None) -> Iterator[None]:
    """While transformers loads a Hub model's files, its shared Hub client (``transformers.utils.hub.hf_api()``)
    carries ``token`` too: the token given to ``from_pretrained`` reaches its downloads, but not every request it
    makes (the tokenizer lists the repo's files with ``list_repo_files`` and no token), which would go with
    HF_TOKEN's identity, or with none. Nothing changes when ``token`` is not a string."""
    api = None
    if isinstance(token, str):
        from transformers.utils import hub as transformers_hub

        maker = getattr(transformers_hub, "hf_api", None)
        api = maker() if callable(maker) else None
    if api is None or not hasattr(api, "token"):
        yield
        return
    with _IDENTITY_LOCK:  # one load at a time changes the shared client
        before = api.token
        api.token = token
        try:
            yield
        finally:
            api.token = before


def _is_causal_lm(config: Any) -> bool:
    archs = getattr(config, "architectures", None) or []
    if archs:
        return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not getattr(config, "is_encoder_decoder", False)


def read_model_spec(name: str, *, revision: str | None = None, trust_remote_code: bool = False,
                    token: str | bool | None = None) -> ModelSpec:
    """Read the config only (no weights): enough to check layers and heads before loading. ``token``: the Hub
    identity of every download of a Hub model's files, here and in ``load_tokenizer``/``load_model`` (None:
    HF_TOKEN or the saved login)."""
    from transformers import AutoConfig

    path, local = resolve_model_path(name)
    access = {} if local else hub_access(path, revision, "model", token=token)
    hint = "" if local else " (is it a Hub id you can reach, or a local folder with config.json?)"
    try:
        # the file is untrusted: its sizes, depth and code are checked before transformers reads it (configfile.py)
        file = Path(path) / "config.json" if local else _hub_config(path, revision, access, token)
        if file.exists():  # a FIFO or a folder named config.json is refused, not handed to transformers
            check_config_file(file, model=name, trust_remote_code=trust_remote_code)
        with transformers_identity(token):
            config = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code,
                                                token=token, **access)
    except OSError as exc:
        raise ModelError(f"cannot load the config of model {name!r}{hint}: {one_line(exc)}") from None
    except (ValueError, TypeError, KeyError, ArithmeticError) as exc:
        if isinstance(exc, LmprobeError):
            raise
        # transformers refuses the file (an unknown model type, values its config class rejects)
        raise ModelError(f"transformers cannot read the config of model {name!r}: {one_line(exc)}"[:600]) from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_layers = next((getattr(text, a) for a in LAYER_ATTRIBUTES if _is_int(getattr(text, a, None))), None)
    hidden = next((getattr(text, a) for a in ("hidden_size", "n_embd", "d_model") if hasattr(text, a)), None)
    if not isinstance(n_layers, int) or not isinstance(hidden, int):
        raise ModelError(f"cannot tell the number of layers or the hidden size of {name!r} from its config")
    if n_layers < 1 or hidden < 1:
        raise ModelError(f"the config of model {name!r} gives {n_layers} layers of width {hidden}; a model has at "
                         "least one layer of positive width (check its config.json)")
    embedded = name.removeprefix("builtin:") in EMBEDDED_MODELS
    display = name.removeprefix("builtin:") if embedded else name
    if embedded:  # shipped inside lmprobe: its weights are its identity
        recorded = weights_revision(Path(path))
    elif local:  # a folder: no commit to record
        recorded = None
    else:
        recorded = getattr(config, "_commit_hash", None) or revision
    weights = weights_fingerprint(Path(path)) if local and not embedded else None
    return ModelSpec(display, path, local, revision, trust_remote_code, config, n_layers, hidden, _is_causal_lm(config),
                     recorded, bool(access), weights, token=token)


#: the attributes that count a model's blocks, in the order they are asked: an encoder-decoder's layers are its
#: decoder's (BART's num_hidden_layers means its encoder's)
LAYER_ATTRIBUTES = ("decoder_layers", "num_decoder_layers", "num_hidden_layers", "n_layer", "num_layers")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def declared_layers(name: str, *, revision: str | None = None, trust_remote_code: bool = False) -> int | None:
    """The number of layers a model's config.json declares, read as JSON without transformers or torch (a second,
    not half a minute, before a wrong ``--layers`` is said); None when the file is not on this machine (a Hub
    model not in the local cache: ``read_model_spec`` asks the Hub) or declares none that can be read this way.

    >>> declared_layers("lmprobe-tiny")
    6
    """
    path, local = resolve_model_path(name)
    if local:
        file: Path | None = Path(path) / "config.json"
    else:
        from huggingface_hub import try_to_load_from_cache  # no request: the cache only

        cached = try_to_load_from_cache(path, "config.json", revision=revision)
        file = Path(cached) if isinstance(cached, str) else None
    if file is None or not file.is_file():
        return None  # read_model_spec says what is wrong with it
    config = check_config_file(file, model=name, trust_remote_code=True)  # remote code is checked by the real read
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    n = next((text[a] for a in LAYER_ATTRIBUTES if _is_int(text.get(a))), None)
    return n if n is not None and n > 0 else None


def _hub_config(repo_id: str, revision: str | None, access: dict, token: str | bool | None) -> Path:
    """The local copy of a Hub model's config.json (the one AutoConfig then reads from the cache)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(repo_id, "config.json", revision=revision, token=token, **access))
    except EntryNotFoundError:
        raise ModelError(f"the Hub repo {repo_id!r} holds no config.json; lmprobe reads transformers models "
                         "(a repo with config.json and weights)") from None


def weights_revision(folder: Path) -> str:
    """``sha256:`` + the SHA-256 over a model folder's weight files (names and contents, in name order)."""
    import hashlib

    h = hashlib.sha256()
    for p in sorted(folder.glob("*.safetensors")):
        h.update(p.name.encode() + b"\0" + bytes.fromhex(sha256_file(p)))
    return "sha256:" + h.hexdigest()


#: the weight files of a local model folder that its fingerprint covers
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.msgpack", "*.h5")
#: the largest safetensors header read for a fingerprint (safetensors itself refuses headers over 100 MB)
MAX_HEADER_BYTES = 100 * 10**6


def weights_fingerprint(folder: Path) -> str:
    """``files:`` + a SHA-256 over a local model folder's weight files: each name, size and modification time (ns),
    and for safetensors its header (every tensor's name, dtype, shape and offsets), in name order.

    Cheap at any size (a 70B model: ~30 headers of a few hundred KiB, no tensor bytes read), and it changes when a
    file is written again (a fine-tune saved over the old weights: same shapes and sizes, a new modification time).
    A copy that does not keep the times (``cp`` without ``-p``) counts as other weights: a resume over it is refused
    and ``--overwrite`` starts again; that is the safe side (a resume over changed weights would publish a mix
    of two models' rows).
    """
    import hashlib

    h = hashlib.sha256()
    files = sorted({p for pattern in WEIGHT_PATTERNS for p in folder.glob(pattern)}, key=lambda p: p.name)
    for p in files:
        st = p.stat()  # (a link to the weights: its target's, which from_pretrained reads)
        h.update(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        if p.suffix == ".safetensors" and st.st_size >= 8:
            with open(p, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if n <= min(MAX_HEADER_BYTES, st.st_size - 8):  # untrusted: a bad header is from_pretrained's to refuse
                    h.update(f.read(n))
    return "files:" + h.hexdigest()


def parse_layers(spec: str | int | list[int] | None, num_layers: int) -> list[int]:
    """``lmprobe.base.layers.parse_layers`` against a model, its errors as ModelError (before the weights load).

    >>> parse_layers("0,2:4,-1", 12)
    [0, 2, 3, 11]
    """
    try:
        return parse_layer_spec(spec, num_layers)
    except LmprobeError as exc:
        raise ModelError(str(exc)) from None


def forward_takes(model: Any, name: str, *, via_kwargs: bool = True) -> bool:
    """Whether ``model.forward`` accepts the keyword ``name`` (``via_kwargs``: a ``**kwargs`` counts)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return name in params or (via_kwargs and any(p.kind == p.VAR_KEYWORD for p in params.values()))


def get_module(model: Any, path: str) -> Any:
    """The submodule at the attribute path ``path`` (e.g. the block list ``model.layers``)."""
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def pick_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"--device {device} was asked for but CUDA is not available here; use --device cpu")
    if device != "cpu" and not device.startswith(("cuda", "mps", "xpu")):
        raise ModelError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N")
    return device


def load_model(spec: ModelSpec, *, placement: Placement, compute_dtype: str = "auto", quiet: bool = False):
    """Load the weights where ``placement`` says: the whole model on its device, or (``device_map``) spread by
    accelerate over the process's GPUs, then the CPU, then disk (a temporary folder that lives as long as the
    model; never ``model.to``, which would gather it on one device). Returns (model, commit hash or None)."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    device = placement.device
    if compute_dtype == "auto":
        dtype = torch.float32 if device == "cpu" else "auto"
    else:
        dtype = torch_dtype(compute_dtype)
    cls = AutoModelForCausalLM if spec.causal_lm else AutoModel
    spread: dict[str, Any] = {}
    offload = None
    if placement.spread:
        require_accelerate()
        # offloaded layers are written here when they cannot be read from the checkpoint as they are (another dtype)
        offload = tempfile.TemporaryDirectory(prefix="lmprobe-offload-")
        spread = {"device_map": placement.device_map, "offload_folder": offload.name}
        if placement.max_memory is not None:
            spread["max_memory"] = placement.max_memory
    with third_party_bars(not quiet), transformers_identity(spec.token):  # (the bars restored as they were: an
        # upload to the Hub may run meanwhile)
        model = cls.from_pretrained(spec.path, revision=spec.revision, trust_remote_code=spec.trust_remote_code,
                                    dtype=dtype, local_files_only=spec.cached_only, token=spec.token, **spread)
    if placement.spread:
        where = getattr(model, "hf_device_map", None) or {}
        if "disk" in where.values():
            model._lmprobe_offload = offload  # removed with the model
        else:
            offload.cleanup()
        logger.info(describe_spread(where) if where else "--device-map auto: the whole model fits "
                    f"{input_device(model)}")
    else:
        model.to(device)
    model.eval()
    commit = None if spec.local else getattr(model.config, "_commit_hash", None)
    return model, commit


def load_tokenizer(spec: ModelSpec):
    from transformers import AutoTokenizer

    with transformers_identity(spec.token):
        tok = AutoTokenizer.from_pretrained(spec.path, revision=spec.revision, trust_remote_code=spec.trust_remote_code,
                                            local_files_only=spec.cached_only, token=spec.token)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    if tok.pad_token is None:
        raise ModelError(f"the tokenizer of {spec.name!r} has no pad, eos or unk token to pad batches with")
    return tok
