"""Miniatures: the same architecture and layer pattern as a config, every width shrunk, random weights.

The fast tests check miniature_config on the defaults of architectures whose configs carry the patterns
and relations that matter (layer types, attention and expert periods, heterogeneous per-layer configs,
MLA head sizes, Mamba-2's head products, rope frequency lists, token ids) and build_miniature's
promises (float32 on CPU in eval mode, every float state-dict entry drawn at random, the parameter cap
checked before anything is allocated). The slow test builds the whole zoo (tests/support/zoo.py) and runs each
model on a padded batch.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import transformers
from support.zoo import ZOO_DEFAULT_FIXES, ZOO_SKIPPED, ZOO_TYPES, build_zoo_model
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoTokenizer

from lmprobe.errors import ModelError
from lmprobe.extraction.miniature import build_miniature, miniature_config

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

# model types whose defaults carry per-layer patterns: layer types, periods and offsets, per-layer lists,
# heterogeneous per-layer configs, dense-then-MoE layers, hybrid layer ids, loops
PATTERNED = ["gemma3", "jamba", "llama4_text", "qwen3_next", "deepseek_v3", "dots3_note", "zamba2", "gemma3n_text",
             "ernie4_5_moe", "granitemoehybrid", "nemotron_h", "mllama", "afmoe", "inkling2_loop_text", "cohere2_moe",
             "falcon_h1", "lfm2", "smollm3", "exaone4", "hrm_text"]
LAYER_WORDS = ("layer", "period", "offset", "interval", "step", "every", "first_k", "cycles", "loop", "pattern")
SIZE_WORDS = ("size", "dim", "vocab", "width", "rank")  # hidden_size_per_layer_input is a width, not a pattern


def _is_layer_word(key: str) -> bool:
    key = key.lower()
    return any(w in key for w in LAYER_WORDS) and not any(w in key for w in SIZE_WORDS)


def _walk(tree, path=""):
    """(path, key, value) for every attribute of every (sub-)config dict in a to_dict() tree."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield path, k, v
            yield from _walk(v, f"{path}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            if isinstance(v, dict):
                yield from _walk(v, f"{path}{i}.")


def _partition(values):
    """Which positions hold equal values: [0, 1, 0] for [a, b, a]."""
    firsts = {}
    return [firsts.setdefault(repr(v), i) for i, v in enumerate(values)]


def _layer_patterns(config) -> dict:
    """Everything that says which layer does what, by path: layer counts, periods and offsets exactly,
    per-layer lists by which layers are alike (exactly for lists of names), per-layer overrides of a
    heterogeneous config by which layers they cover and which are alike."""
    facts = {}
    for path, k, v in _walk(config.to_dict()):
        if not isinstance(k, str):
            continue
        if k == "per_layer_config" and isinstance(v, dict):
            keys = sorted(v, key=int)
            facts[path + k] = ([int(i) for i in keys], _partition([v[i] for i in keys]))
        elif isinstance(v, int) and not isinstance(v, bool) and _is_layer_word(k):
            facts[path + k] = v
        elif isinstance(v, list) and len(v) > 1 and not any(isinstance(x, dict) for x in v):
            if all(isinstance(x, str) for x in v) or _is_layer_word(k):
                facts[path + k] = v if all(isinstance(x, str) for x in v) else _partition(v)
            else:
                facts[path + k + ":pattern"] = _partition(v)
    return facts


@pytest.mark.parametrize("model_type", PATTERNED)
def test_layer_counts_and_per_layer_patterns_are_kept(model_type):
    config = CONFIG_MAPPING[model_type]()
    mini = miniature_config(config)
    assert type(mini) is type(config)
    before, after = _layer_patterns(config), _layer_patterns(mini)
    assert before, "the pattern extractor found nothing: the test would not notice a lost pattern"
    assert {k: v for k, v in after.items() if k in before} == before
    assert mini.get_text_config().num_hidden_layers == config.get_text_config().num_hidden_layers


def test_heterogeneous_per_layer_values_stay_distinct_where_they_were():
    config = CONFIG_MAPPING["dots3_note"]()
    mini = miniature_config(config)
    for old, new in ((config.text_config, mini.text_config), (config.vision_config, mini.vision_config)):
        old_layers, new_layers = old.per_layer_config, new.per_layer_config
        assert len(new_layers) == len(old_layers)
        for attr in old.per_layer_attributes:
            old_values = [getattr(layer, attr) for layer in old_layers]
            new_values = [getattr(layer, attr) for layer in new_layers]
            assert _partition(new_values) == _partition(old_values), attr
            assert max(new_values) < max(old_values), f"{attr} was not shrunk"


def _text(config) -> dict:
    """The text config's attributes, per-layer ones of a heterogeneous config (Gemma 4) included."""
    return config.get_text_config().to_dict()


def test_per_layer_head_counts_keep_their_pattern_and_their_key_value_groups():
    config = CONFIG_MAPPING["laguna"](num_hidden_layers=4, num_attention_heads_per_layer=[48, 64, 48, 64])
    mini = miniature_config(config)
    per_layer = mini.num_attention_heads_per_layer
    assert _partition(per_layer) == [0, 1, 0, 1] and per_layer[1] > per_layer[0]
    assert 1 < mini.num_key_value_heads < min(per_layer)
    assert all(h % mini.num_key_value_heads == 0 for h in per_layer)
    _runs(build_miniature(config))


def _ids(tree) -> set[int]:
    return {x for _, k, v in _walk(tree) if isinstance(k, str) and k.endswith(("token_id", "token_index"))
            for x in (v if isinstance(v, list) else [v]) if isinstance(x, int)}


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "deepseek_v3", "qwen3_moe", "gemma4_text", "falcon_h1",
                                        "mixtral", "qwen3_next", "bart", "doge", "jamba"])
def test_widths_heads_experts_and_vocabularies_shrink(model_type):
    config = CONFIG_MAPPING[model_type]()
    mini = miniature_config(config)
    old, new = _text(config), _text(mini)
    width = next(k for k in ("hidden_size", "n_embd", "d_model") if k in old)
    heads = next(k for k in ("num_attention_heads", "n_head", "num_heads", "decoder_attention_heads") if k in old)
    assert new[width] == 64 < old[width]
    assert new[heads] <= 4 < old[heads]
    ids = _ids(config.to_dict())
    assert new["vocab_size"] == min(old["vocab_size"], max([512] + [i + 1 for i in ids if i < old["vocab_size"]]))
    for attr in ("intermediate_size", "moe_intermediate_size", "num_experts", "num_local_experts",
                 "n_routed_experts", "head_dim", "kv_lora_rank", "q_lora_rank", "state_size"):
        if isinstance(old.get(attr), int) and old[attr] > 16:
            assert new[attr] < old[attr], attr
    for attr in ("num_experts", "num_local_experts", "n_routed_experts"):
        if isinstance(new.get(attr), int):
            assert new[attr] <= 8
            assert new["num_experts_per_tok"] < new[attr]  # routing stays sparse
    n_params = sum(p.numel() for p in build_miniature(config).parameters())
    assert n_params < 12_000_000


@pytest.mark.parametrize(("kv", "expected"), [(1, 1), (8, 2), (16, 2), (32, 4)])
def test_key_value_heads_keep_their_kind(kv, expected):
    """Multi-query stays 1, multi-head equals the heads, grouped-query a proper divisor."""
    from transformers import LlamaConfig

    mini = miniature_config(LlamaConfig(num_attention_heads=32, num_key_value_heads=kv))
    assert (mini.num_attention_heads, mini.num_key_value_heads) == (4, expected)


@pytest.mark.parametrize("model_type", ["gemma3", "gemma4", "qwen3_5", "llama4", "whisper", "bart", "blt"])
def test_token_ids_stay_inside_every_vocabulary_that_held_them(model_type):
    config = CONFIG_MAPPING[model_type]()
    original, mini = config.to_dict(), miniature_config(config).to_dict()
    ids = _ids(original)
    vocabs = {(p, k): v for p, k, v in _walk(original) if "vocab_size" in str(k) and isinstance(v, int)}
    assert vocabs
    shrunk = {(p, k): v for p, k, v in _walk(mini) if (p, k) in vocabs}
    for key, size in vocabs.items():
        inside = [i for i in ids if i < size]
        assert all(i < shrunk[key] for i in inside), key
        assert shrunk[key] <= size


def test_mla_head_sizes_stay_consistent_and_run():
    config = CONFIG_MAPPING["deepseek_v3"]()
    mini = miniature_config(config)
    assert mini.qk_head_dim == mini.qk_nope_head_dim + mini.qk_rope_head_dim
    assert mini.head_dim == mini.qk_rope_head_dim and mini.qk_rope_head_dim % 2 == 0
    assert mini.kv_lora_rank < config.kv_lora_rank and mini.q_lora_rank < config.q_lora_rank
    # group-limited routing: at least two experts a group, top-k within the chosen groups
    assert mini.n_routed_experts % mini.n_group == 0 and mini.n_routed_experts // mini.n_group >= 2
    assert mini.num_experts_per_tok <= mini.topk_group * mini.n_routed_experts // mini.n_group
    _runs(build_miniature(config))


def test_partial_rotary_keeps_its_share_of_the_head():
    config = CONFIG_MAPPING["gptj"]()
    mini = miniature_config(config)
    assert mini.rotary_dim / (mini.n_embd // mini.n_head) == config.rotary_dim / (config.n_embd // config.n_head)


@pytest.mark.parametrize("model_type", ["mamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2"])
def test_state_space_head_products_still_make_up_the_inner_width(model_type):
    mini = miniature_config(CONFIG_MAPPING[model_type]())
    d = mini.to_dict()
    heads = next(d[k] for k in ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads", "num_heads") if k in d)
    head_dim = next(d[k] for k in ("mamba_d_head", "mamba_head_dim", "mamba_headdim", "head_dim") if k in d)
    expand = d.get("expand", d.get("mamba_expand"))
    inner = d.get("mamba_d_ssm") or expand * mini.hidden_size
    assert heads * head_dim == inner
    groups = next(d[k] for k in ("n_groups", "mamba_n_groups", "mamba_ngroups") if k in d)
    assert heads % groups == 0


def test_longrope_factor_lists_follow_the_head_size():
    from transformers import Phi3Config

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 4096,
            "short_factor": [1.0 + i / 100 for i in range(48)], "long_factor": [2.0 + i / 10 for i in range(48)]}
    config = Phi3Config(hidden_size=3072, num_attention_heads=32, num_hidden_layers=2, rope_parameters=rope)
    mini = miniature_config(config)
    half = mini.hidden_size // mini.num_attention_heads // 2
    assert len(mini.rope_parameters["short_factor"]) == len(mini.rope_parameters["long_factor"]) == half
    assert mini.rope_parameters["short_factor"][0] == 1.0 and mini.rope_parameters["long_factor"][-1] == 6.7
    _runs(build_miniature(config))


def test_multimodal_rope_sections_follow_the_head_size_and_a_non_causal_config_gets_its_base_model():
    from transformers import Qwen2VLConfig, Qwen2VLModel

    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
    config = Qwen2VLConfig(text_config={"rope_parameters": rope, "num_hidden_layers": 2}, vision_config={"depth": 2})
    text = miniature_config(config).text_config
    sections = text.rope_parameters["mrope_section"]
    assert sum(sections) == text.hidden_size // text.num_attention_heads // 2
    assert sections[1] == sections[2] > sections[0]
    model = build_miniature(config)  # qwen2_vl is no causal-LM type: AutoModel builds it
    assert type(model) is Qwen2VLModel
    with torch.no_grad():
        out = model(input_ids=torch.randint(3, 100, (2, 5)), use_cache=False)
    assert out.last_hidden_state.shape == (2, 5, 64)


def test_widths_one_sub_config_names_of_another_stay_equal():
    """BLT's local models name the global model's width (hidden_size_global)."""
    mini = miniature_config(CONFIG_MAPPING["blt"]())
    assert mini.encoder_config.hidden_size_global == mini.global_config.hidden_size
    assert mini.decoder_config.hidden_size_global == mini.global_config.hidden_size


def _runs(model):
    ids = torch.randint(3, 100, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    assert out.hidden_states[-1].shape[:2] == (2, 7)
    assert all(torch.isfinite(h).all() for h in out.hidden_states)


def test_every_float_state_dict_entry_is_drawn_and_non_persistent_buffers_are_computed():
    """Gemma 4 carries a persistent per-layer scalar buffer besides norms (all ones) and rotary frequencies."""
    config = CONFIG_MAPPING["gemma4_text"](num_hidden_layers=3, hidden_size_per_layer_input=0)
    model = build_miniature(config, seed=3)
    assert not model.training and all(not m.training for m in model.modules())
    torch.manual_seed(3)
    fresh = AutoModelForCausalLM.from_config(miniature_config(config), dtype=torch.float32)
    built, init = model.state_dict(), fresh.state_dict()
    assert any("layer_scalar" in k for k in built), "the persistent buffer this test is about is gone"
    floats = [k for k, v in built.items() if v.is_floating_point()]
    assert floats == [k for k, v in init.items() if v.is_floating_point()]
    for k in floats:
        assert built[k].dtype == torch.float32 and built[k].device.type == "cpu"
        assert (built[k] != init[k]).all(), f"{k} kept entries of its initial value"
        if init[k].numel() > 1 and bool((init[k] == init[k].flatten()[0]).all()):
            assert built[k].std() > 0, f"{k} is still constant"
    persistent = set(built)
    computed = {k: v for k, v in fresh.named_buffers() if k not in persistent}
    assert any("inv_freq" in k for k in computed)
    for k, v in model.named_buffers():
        if k in computed:
            assert torch.equal(v, computed[k]), k


def test_the_seed_decides_the_weights():
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=2)
    a, b, c = (build_miniature(config, seed=s).state_dict() for s in (0, 0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not any(torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())


def test_the_parameter_cap_is_checked_before_anything_is_allocated(monkeypatch):
    from transformers import LlamaConfig

    devices = []
    real = AutoModelForCausalLM.from_config.__func__

    def spy(cls, config, **kwargs):
        devices.append(torch.get_default_device().type)
        return real(cls, config, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", classmethod(spy))
    n_params = sum(p.numel() for p in build_miniature(LlamaConfig(num_hidden_layers=2)).parameters())
    assert devices == ["meta", "cpu"]
    devices.clear()
    with pytest.raises(ModelError, match=f"{n_params:,} parameters, more than max_parameters={n_params - 1:,}"):
        build_miniature(LlamaConfig(num_hidden_layers=2), max_parameters=n_params - 1)
    assert devices == ["meta"]


@pytest.mark.parametrize("bad", [0, -5, 2.5, "10"])
def test_a_bad_parameter_cap_is_a_model_error(bad):
    from transformers import LlamaConfig

    with pytest.raises(ModelError, match="max_parameters must be a positive integer"):
        build_miniature(LlamaConfig(num_hidden_layers=1), max_parameters=bad)


def test_something_that_is_not_a_config_is_a_model_error():
    with pytest.raises(ModelError, match="cannot read the config"):
        miniature_config(object())


def test_a_miniature_the_config_class_rejects_is_a_model_error():
    """A config edited past its own validation (Mamba-2 heads * head_dim no longer the inner width) cannot
    keep its relations when shrunk; the error names the config and what its class rejected."""
    config = CONFIG_MAPPING["mamba2"]()
    config.head_dim = 48
    with pytest.raises(ModelError, match=r"miniature of Mamba2Config \(mamba2\).*hidden_size \* expand"):
        miniature_config(config)


# ---------------------------------------------------------------------------------------------- the zoo


def test_the_zoo_lists_every_causal_lm_type_and_says_why_it_leaves_one_out():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    assert {cfg.model_type for cfg in MODEL_FOR_CAUSAL_LM_MAPPING.keys()} <= set(ZOO_TYPES)
    assert len(ZOO_TYPES) == len(set(ZOO_TYPES)) >= 196  # transformers 5.24 maps 196 types
    assert set(ZOO_SKIPPED) <= set(ZOO_TYPES) and set(ZOO_DEFAULT_FIXES) <= set(ZOO_TYPES) - set(ZOO_SKIPPED)
    for model_type, reason in ZOO_SKIPPED.items():
        assert reason.startswith(("needs package ", "cannot run with plain transformers")), model_type
        if reason.startswith("needs package "):
            package = reason.split()[2]
            assert importlib.util.find_spec(package) is None, f"{package} is installed: build {model_type}"


@pytest.mark.parametrize("model_type", sorted(ZOO_SKIPPED))
def test_build_zoo_model_returns_none_for_a_skipped_type(model_type, tmp_path):
    assert build_zoo_model(model_type, tmp_path / model_type) is None


def test_a_zoo_model_loads_offline_and_agrees_with_its_tokenizer(tmp_path):
    out = build_zoo_model("gemma3", tmp_path / "gemma3")
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    text = model.config.get_text_config()
    for name in ("pad", "bos", "eos"):
        assert getattr(model.config, f"{name}_token_id") == getattr(tok, f"{name}_token_id")
    assert len(tok) <= text.vocab_size < 1024
    assert tok.pad_token_id != tok.eos_token_id
    assert len(tok) <= model.config.image_token_id < text.vocab_size  # a fresh id above the tokenizer's


def _widths(config) -> set[int]:
    names = ("hidden_size", "n_embd", "d_model", "dim", "emb_dim", "embed_dim")
    return {v for _, k, v in _walk(config.to_dict()) if k in names and isinstance(v, int)}


def _batch_tokens_width(h: torch.Tensor, batch: int, tokens: int) -> tuple[int, int, int]:
    """(batch, tokens, width) of a hidden state; multi-stream models (AltUp, hyper-connections) add a
    stream axis before the batch or before the width."""
    shape = tuple(h.shape)
    if len(shape) == 4:
        shape = shape[1:] if shape[1:3] == (batch, tokens) else (shape[0], shape[1], shape[3])
    assert len(shape) == 3, tuple(h.shape)
    return shape


ZOO_BUILT = [t for t in ZOO_TYPES if t not in ZOO_SKIPPED]


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from intra-op threads; on a busy 2-core machine the spinning threads triple
    the zoo's CPU time."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ZOO_BUILT)
def test_every_zoo_model_loads_and_runs_a_padded_batch(model_type, tmp_path, one_thread):
    out = build_zoo_model(model_type, tmp_path / model_type)
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    tok = AutoTokenizer.from_pretrained(out)
    batch = tok(["The cat sat on the mat and looked at the bird.", "A quick fox"], return_tensors="pt",
                padding=True)
    assert (batch["attention_mask"] == 0).any()  # the batch is padded
    with torch.no_grad():
        output = model(**batch, output_hidden_states=True, use_cache=False)
    n_tokens = batch["input_ids"].shape[1]
    widths = _widths(model.config)
    assert len(output.hidden_states) >= 2
    for h in output.hidden_states:
        b, t, w = _batch_tokens_width(h, 2, n_tokens)
        assert (b, t) == (2, n_tokens)
        assert any(w % width == 0 for width in widths), (w, widths)
        assert torch.isfinite(h).all()
    assert output.logits.shape[:2] == (2, n_tokens) and output.logits.shape[-1] >= len(tok)
    assert sum(p.numel() for p in model.parameters()) < 50_000_000
    assert math.isfinite(float(output.logits.float().abs().max()))
