"""The test zoo: one tiny random model per model type of the installed transformers' causal-LM auto mapping.

Each zoo model is ``lmprobe.extraction.miniature.build_miniature`` applied to the config class's defaults, saved
with a locally trained tokenizer, so that ``AutoModelForCausalLM.from_pretrained(folder)`` and
``AutoTokenizer.from_pretrained(folder)`` work offline. The token ids the config names are rewritten to agree
with the tokenizer (pad/bos/eos/unk are the tokenizer's; image, audio and other special ids get fresh ids
just above its vocabulary), so the vocabularies of the zoo stay small.

Where transformers' defaults cannot run as they are, ZOO_DEFAULT_FIXES changes the defaults (one comment each
saying why); types that cannot run at all with plain transformers are in ZOO_SKIPPED with the reason.
"""

from __future__ import annotations

import atexit
import copy
import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any

from transformers import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

#: every model type AutoModelForCausalLM knows in the installed transformers
ZOO_TYPES: tuple[str, ...] = tuple(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)

#: model type -> why no zoo model is built for it
ZOO_SKIPPED: dict[str, str] = {
    "gemma3n": "needs package timm (the vision tower of Gemma3nForConditionalGeneration is a TimmWrapperModel)",
    "musicgen": "cannot run with plain transformers: AutoModelForCausalLM builds MusicgenForCausalLM from the "
                "composite MusicgenConfig, which lacks the decoder's attributes, and no auto class loads a "
                "musicgen_decoder config",
    "musicgen_melody": "cannot run with plain transformers: AutoModelForCausalLM builds "
                       "MusicgenMelodyForCausalLM from the composite MusicgenMelodyConfig, which lacks the "
                       "decoder's attributes, and no auto class loads a musicgen_melody_decoder config",
    "gemma4_assistant": "cannot run with plain transformers on its own: a speculative-decoding drafter whose "
                        "forward needs the key/value states of its target model (shared_kv_states)",
    "gemma4_unified_assistant": "cannot run with plain transformers on its own: a speculative-decoding drafter "
                                "whose forward needs the key/value states of its target model (shared_kv_states)",
}

_QSA_INDEXER = {"n_heads": 8, "kv_heads": 1, "head_dim": 256, "budget": 2048, "compress_ratio": 4}

#: model type -> {dotted attribute path: value} applied to the defaults before shrinking
ZOO_DEFAULT_FIXES: dict[str, dict[str, Any]] = {
    # the defaults name no rope parameters, but every layer type looks its own entry up
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # the attention sub-config's defaults lack rope_theta, which DbrxAttention reads, and clip_qkv, which it
    # clamps with (DBRX's checkpoints state both)
    "dbrx": {"attn_config.rope_theta": 500000.0, "attn_config.clip_qkv": 8.0},
    # top-k is None by default, but every MoE layer routes to top-k experts (DeepSeek-V2 uses 6)
    "deepseek_v2": {"num_experts_per_tok": 6},
    # expert counts are None by default although every layer past first_k_dense_replace=0 is MoE (dots.llm1's)
    "dots1": {"n_routed_experts": 128, "n_shared_experts": 2, "num_experts_per_tok": 6},
    # head_dim is None by default, but the attention divides by it (hidden_size / num_attention_heads)
    "hunyuan_v1_dense": {"head_dim": 128},
    "hunyuan_v1_moe": {"head_dim": 128},
    "ministral": {"head_dim": 128},
    # layer_types is None by default, but every decoder layer reads its type (LFM2: short convolutions
    # with attention every few layers)
    "lfm2_moe": {"layer_types": ["full_attention" if i % 4 == 3 else "conv" for i in range(32)]},
    # num_key_value_heads is None by default, but the attention divides by it (Nemotron-4 uses 8)
    "nemotron": {"num_key_value_heads": 8},
    # the default layer types include indexed attention, whose QSA indexer settings are all None by default
    # (the indexer head must hold the attention's rotary dimensions: 256 here)
    "qwen4_exp": {f"text_config.indexer_{k}": v for k, v in _QSA_INDEXER.items()},
    "qwen4_exp_text": {f"indexer_{k}": v for k, v in _QSA_INDEXER.items()},
    # ReformerModelWithLMHead refuses a config that is not a decoder
    "reformer": {"is_decoder": True},
    # X-MOD's adapters need a language; without a default one the forward raises
    "xmod": {"default_language": "en_XX"},
}

# ids the tokenizer has a token for; every other id the config names gets a fresh id above the vocabulary
_TOKENIZER_IDS = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>", "cls": "<s>", "sep": "</s>",
                  "decoder_start": "</s>", "forced_eos": "</s>", "forced_bos": "<s>"}
_TOKENIZER_VOCAB = 300
_MIN_BYTE_VOCAB = 260  # a byte-level BPE holds 256 bytes and 4 special tokens before any merge


def _id_key(key: str) -> str | None:
    """The name of the special token `key` holds the id of ("pad" for pad_token_id), or None."""
    for suffix in ("_token_id", "_token_ids", "_token_index", "_index"):
        if key.endswith(suffix) and (suffix != "_index" or key in ("unk_index", "mask_index")):
            return key[: -len(suffix)]
    return "suppress" if key in ("suppress_tokens", "begin_suppress_tokens") else None


def _remap_ids(tree: Any, tokenizer_ids: dict[str, int], fresh: dict[int, int], first_free: int) -> Any:
    if isinstance(tree, list):
        return [_remap_ids(x, tokenizer_ids, fresh, first_free) for x in tree]
    if not isinstance(tree, dict):
        return tree
    out = {}
    for k, v in tree.items():
        name = _id_key(k) if isinstance(k, str) else None
        if name is None:
            out[k] = _remap_ids(v, tokenizer_ids, fresh, first_free)
            continue

        def one(x: Any, name: str = name) -> Any:
            if not isinstance(x, int) or isinstance(x, bool) or x < 0:
                return x
            if name in tokenizer_ids:
                return tokenizer_ids[name]
            return fresh.setdefault(x, first_free + len(fresh))

        out[k] = list(dict.fromkeys(one(x) for x in v)) if isinstance(v, list) else one(v)
    return out


def _set_path(d: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for p in parents:
        d = d[p]
    d[last] = copy.deepcopy(value)


def zoo_config(model_type: str, tokenizer_ids: dict[str, int], vocab: int):
    """The config class's defaults, fixed where they cannot run, with ids that agree with the tokenizer."""
    cls = CONFIG_MAPPING[model_type]
    d = cls().to_dict()
    d.pop("transformers_version", None)
    for path, value in ZOO_DEFAULT_FIXES.get(model_type, {}).items():
        _set_path(d, path, value)
    d = _remap_ids(d, tokenizer_ids, {}, vocab)
    for name in ("pad", "bos", "eos"):
        d[f"{name}_token_id"] = tokenizer_ids[name]
    return cls.from_dict(d)


@functools.lru_cache(maxsize=4)
def _tokenizer_dir(vocab_size: int) -> Path:
    """One trained tokenizer per vocabulary size, per process (training takes about a second)."""
    from support.tiny_models import train_tokenizer

    out = Path(tempfile.mkdtemp(prefix=f"lmprobe-zoo-tokenizer-{vocab_size}-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    train_tokenizer(out, kind="llama", padding_side="left", vocab_size=vocab_size)
    return out


def _default_vocab(model_type: str) -> int | None:
    config = CONFIG_MAPPING[model_type]()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None)


def build_zoo_model(model_type: str, out_dir, *, seed: int = 0) -> Path | None:
    """Save a tiny random `model_type` model and its tokenizer to `out_dir`; None for a type in ZOO_SKIPPED.

    The parameter count is checked on the meta device before any weight is allocated (build_miniature).
    """
    from transformers import AutoTokenizer

    from lmprobe.extraction.miniature import build_miniature
    from lmprobe.extraction.miniature import miniature_config as build_miniature_config

    if model_type in ZOO_SKIPPED:
        return None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    default_vocab = _default_vocab(model_type) or _TOKENIZER_VOCAB
    vocab = max(_MIN_BYTE_VOCAB, min(_TOKENIZER_VOCAB, default_vocab))
    tok_dir = _tokenizer_dir(vocab)
    for f in tok_dir.iterdir():
        shutil.copy(f, out_dir / f.name)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in _TOKENIZER_IDS.items()}
    config = zoo_config(model_type, ids, len(tokenizer))
    model = build_miniature(config, seed=seed)
    model.save_pretrained(out_dir)
    # Some causal-LM classes of composite models (Emu3, Mllama) keep only their text config; the folder
    # keeps the composite one, as real checkpoints do, so that AutoModelForCausalLM finds the same class
    if model.config.model_type != config.model_type:
        model_config = build_miniature_config(config)
        model_config.architectures = model.config.architectures
        model_config.save_pretrained(out_dir)
    return out_dir
