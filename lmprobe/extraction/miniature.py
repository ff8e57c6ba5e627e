"""Miniatures of a model: the same architecture and layer pattern, every width shrunk, random weights.

lmprobe checks its hookpoints numerically on a miniature of the user's model before it loads the real
weights, and the test zoo builds one tiny model per architecture the same way. A miniature keeps what
decides *where* activations are (the config class, the number of layers, every per-layer pattern:
``layer_types``, attention and expert periods and offsets, per-layer overrides of heterogeneous configs)
and shrinks what only decides *how big* they are (widths, head counts, expert counts, vocabularies).

The shrinking goes by what a config attribute means, read from its name, never by model type:

- widths (``hidden_size``, ``n_embd``, ``d_model``, ``*_intermediate_size``, ``ffn_dim``, ...) scale by one
  factor over the whole config tree (the widest residual width becomes WIDTH), so that two attributes that
  were equal stay equal (an adapter's input width that must match ``hidden_size``, BLT's
  ``hidden_size_global``) and a feed-forward keeps its ratio to the residual width; a list of sizes that
  splits a width (Reformer's ``axial_pos_embds_dim``) splits the shrunk one; a per-layer input width
  (Gemma's ``hidden_size_per_layer_input``) drops to PER_LAYER_WIDTH;
- head sizes (``head_dim``, ``rotary_dim``, MLA's ``qk_rope_head_dim``/``qk_nope_head_dim``/``v_head_dim``,
  linear-attention head sizes, ...) scale by one factor too, so sums such as ``qk_head_dim = nope + rope``
  and the rotary share of a head survive;
- head counts drop to a few; key-value head counts keep their kind (multi-query stays 1, multi-head equals the
  head count, grouped-query stays a proper divisor); a head count whose product with a head size made up a
  width (Mamba-2's ``num_heads * head_dim == expand * hidden_size``) is recomputed so the product still holds;
- expert counts drop to about MAX_EXPERTS (distinct per-layer counts stay distinct), top-k stays sparse and
  group-limited routing feasible;
- every vocabulary shrinks to MIN_VOCAB entries or to just above the largest token id that was inside it;
- rope parameters listed per rotary frequency (longrope's factors) or per section (``mrope_section``) follow
  the shrunk head size.

Layer counts, layer types, periods, offsets, windows, positions and everything else stays as it is.

Example::

    >>> from transformers import LlamaConfig
    >>> mini = miniature_config(LlamaConfig(num_hidden_layers=3))
    >>> (mini.num_hidden_layers, mini.hidden_size, mini.num_attention_heads, mini.num_key_value_heads)
    (3, 64, 4, 4)

About 600 lines, on purpose: the shrinking rules above are one idea, read attribute by attribute,
and each rule needs the others' factors (a head count times a head size makes a width).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ModelError

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

#: the residual width of a miniature; head sizes scale so that the main attention head has HEAD_DIM entries
WIDTH = 64
HEAD_DIM = 16
HEADS = 4
#: enough experts to route sparsely (top-k at most MAX_EXPERTS // 2); product-key experts (Doge) route over
#: the largest square grid that fits, 2 x 2 here, which still holds every top-k a miniature keeps
MAX_EXPERTS = 8
MIN_VOCAB = 512
SSM_STATE = 16
#: a width given per layer (Gemma's per-layer inputs) is multiplied by the layer count in its embedding table,
#: whose rows follow a vocabulary that may have to stay large to hold the config's token ids
PER_LAYER_WIDTH = 2
DEFAULT_MAX_PARAMETERS = 50_000_000

# ------------------------------------------------------------------------------------- what a name means
# Each pattern is matched against the whole attribute name (lower case). Order matters: the first role wins.

_ID = re.compile(r".*token_(id|ids|index)|(unk|mask|pad|bos|eos|sep|cls)_(id|index)|(begin_)?suppress_tokens")
_VOCAB = re.compile(r".*vocab(_size)?(_.*)?")
_EXACT = {
    "experts": re.compile(r"num_experts|num_local_experts|n_routed_experts|moe_num_experts|num_routed_experts|"
                          r"zero_expert_num"),
    "shared_experts": re.compile(r"n_shared_experts|num_shared_experts|moe_num_shared_experts"),
    "top_k": re.compile(r"num_experts_per_tok|num_experts_per_token|moe_topk|moe_top_k|moe_k"),
    "expert_groups": re.compile(r"n_group|num_expert_group"),
    "topk_groups": re.compile(r"topk_group"),
    "ssm_groups": re.compile(r"n_groups|mamba_n_groups|mamba_ngroups"),
    "ssm_state": re.compile(r"state_size|mamba_d_state|ssm_state_size|d_state"),
}
_KV_HEADS = re.compile(r".*(key_value_heads|kv_heads|kv_n_heads|multi_query_group_num|num_query_groups|"
                       r"linear_num_key_heads)")
_HEADS = re.compile(r"(.*_)?(num_heads|n_heads|n_head|attention_heads|num_attention_heads|mamba_heads|"
                    r"linear_num_value_heads)(_per_layer)?")
_HEAD_DIM = re.compile(r".*(head_dim|head_size|headdim|d_head|kv_channels|dim_head|rotary_dim|rotary_emb_dim)|"
                       r"d_kv|d_rel")
_RANK = re.compile(r".*(_rank|lowrank)")
_WIDTH = re.compile(
    r".*(hidden_size|hidden_dim|intermediate_size|intermediate_dim|embed_dim|embedding_dim|emb_dim|embedding_size|"
    r"ffn_dim|ffn_hidden_size|feed_forward_size|mlp_dim|_d_ssm|proj_dim|_in_dim|_out_dim|input_dim|output_dim|"
    r"_input_size|_output_size|"
    r"lru_width).*|n_embd|d_model|dim|d_ff|dff|dim_ff|d_inner|n_inner|width"
)
# width-looking names that are counts, multipliers or input/output geometry rather than a model width
_NOT_WIDTH = re.compile(r".*(multiple|divisible|factor|ratio|position|max_|patch|image|kernel|window|chunk|"
                        r"bucket|sampling|length|channels|conv|mel|feat_size|ngram|layers|blocks).*")
_MAIN_WIDTH = ("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "embedding_dim", "emb_dim")
_MAIN_HEADS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads", "decoder_attention_heads")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _role(key: str) -> str | None:
    """What an integer attribute called `key` measures, or None when it is kept as it is."""
    k = key.lower()
    if _ID.fullmatch(k):
        return "id"
    if _VOCAB.fullmatch(k) and "divisible" not in k:
        return "vocab"
    for role, pattern in _EXACT.items():
        if pattern.fullmatch(k):
            return role
    for role, pattern in (("kv_heads", _KV_HEADS), ("heads", _HEADS), ("head_dim", _HEAD_DIM), ("rank", _RANK)):
        if pattern.fullmatch(k):
            return role
    if _WIDTH.fullmatch(k) and not _NOT_WIDTH.fullmatch(k):
        return "per_layer_width" if "per_layer" in k else "width"
    return None


def attribute_role(key: str) -> str | None:
    """What an integer config attribute called ``key`` measures ("width", "heads", "head_dim", "kv_heads",
    "vocab", "experts", ...), or None when a miniature keeps it as it is (configfile.py bounds the same names).

    >>> attribute_role("num_key_value_heads"), attribute_role("intermediate_size"), attribute_role("rope_theta")
    ('kv_heads', 'width', None)
    """
    return _role(key)


# ---------------------------------------------------------------------------------------------- the scale


@dataclass(frozen=True)
class _Tree:
    """What holds across a whole config tree: the width scale, the token ids, the expert counts."""

    ref: int  # the widest original residual width in the tree
    ids: frozenset[int]  # every token id the config names
    experts: dict[int, int]  # original expert count -> shrunk

    @classmethod
    def of(cls, original: dict[str, Any]) -> _Tree:
        counts = sorted(set(_values(original, "experts")))
        sparse_k = [k for k in _values(original, "top_k") if k < max(counts, default=0)]
        floor = max((_top_k(k) for k in sparse_k), default=0) + 1
        experts: dict[int, int] = {}
        previous = 0
        for e in counts:  # monotone and one-to-one: per-layer expert counts stay distinct
            target = math.ceil(e * MAX_EXPERTS / counts[-1])
            experts[e] = previous = min(e, max(target, previous + 1, floor))
        return cls(_widest(original) or WIDTH, frozenset(_values(original, "id")), experts)

    def vocab(self, v: int) -> int:
        """A vocabulary keeps room for every token id that was inside it."""
        return min(v, max([MIN_VOCAB] + [i + 1 for i in self.ids if i < v]))


def _top_k(k: int) -> int:
    return min(k, MAX_EXPERTS // 2)


def _values(tree: Any, role: str) -> list[int]:
    """Every non-negative integer (or list entry) under an attribute of `role` anywhere in the tree."""
    found: list[int] = []
    if isinstance(tree, dict):
        for k, v in tree.items():
            if isinstance(k, str) and _role(k) == role:
                found.extend(x for x in (v if isinstance(v, list) else [v]) if _is_int(x) and x >= 0)
            else:
                found.extend(_values(v, role))
    elif isinstance(tree, list):
        for v in tree:
            found.extend(_values(v, role))
    return found


@dataclass(frozen=True)
class _Scale:
    """How one config (or sub-config) shrinks.

    Widths scale by one factor over the whole config tree (the widest config's residual width becomes
    WIDTH), so that a width one sub-config names of another (BLT's ``hidden_size_global``) stays equal to it.
    Head counts and head sizes scale per config: its main head size becomes the shrunk width over the shrunk
    head count (or HEAD_DIM when the config states ``head_dim``)."""

    tree: _Tree
    width: int  # this config's original residual width
    heads: int  # this config's original main head count
    new_heads: int
    head_dim_divisor: float  # head sizes are divided by this

    @classmethod
    def of(cls, d: dict[str, Any], parent: _Scale | None, tree: _Tree) -> _Scale:
        width = _main(d, _MAIN_WIDTH)
        heads = _main(d, _MAIN_HEADS) or max(_scalars(d, "heads").values(), default=None)
        if width is None and heads is None and parent is not None:
            return parent
        width = width or (parent.width if parent else tree.ref)
        heads = heads or (parent.heads if parent else HEADS)
        new_heads = min(heads, HEADS)
        scale = cls(tree, width, heads, new_heads, 1.0)
        head_dim = d.get("head_dim")
        new_width = scale.width_like(width)
        if _is_int(head_dim) and head_dim > 0 and (head_dim * heads != width or new_width % new_heads):
            return cls(tree, width, heads, new_heads, max(1.0, head_dim / HEAD_DIM))
        # the head size is (or is stated equal to) the width over the heads: keep it so
        return cls(tree, width, heads, new_heads, max(1.0, width / heads / (new_width / new_heads)))

    def width_like(self, v: int) -> int:
        ref = self.tree.ref
        return min(v, max(8, 8 * round(v * min(ref, WIDTH) / ref / 8)))

    def head_dim(self, v: int) -> int:
        return min(v, max(2, 2 * round(v / self.head_dim_divisor / 2)))

    def head_count(self, v: int) -> int:
        return max(1, min(v, round(v * self.new_heads / self.heads)))

    def rank(self, v: int) -> int:
        return self.width_like(v)

    @property
    def new_width(self) -> int:
        return self.width_like(self.width)


def _main(d: dict[str, Any], names: tuple[str, ...]) -> int | None:
    return next((d[k] for k in names if _is_int(d.get(k)) and d[k] > 0), None)


def _widest(tree: Any) -> int | None:
    """The widest residual width of any config in the tree."""
    found = []
    if isinstance(tree, dict):
        if (w := _main(tree, _MAIN_WIDTH)) is not None:
            found.append(w)
        found.extend(w for v in tree.values() if (w := _widest(v)) is not None)
    elif isinstance(tree, list):
        found.extend(w for v in tree if (w := _widest(v)) is not None)
    return max(found, default=None)


# ---------------------------------------------------------------------------------------------- the walk

_NAME_WORDS_IGNORED = {"num", "n", "heads", "head", "dim", "d", "headdim", "attention", "size", "groups", "ngroups",
                       "per", "layer"}


def _words(key: str) -> frozenset[str]:
    """The words that say *which* heads a head count or head size belongs to (``mamba_n_heads`` -> {mamba})."""
    return frozenset(w for w in key.lower().split("_") if w and w not in _NAME_WORDS_IGNORED)


def _map_ints(value: Any, fn) -> Any:
    if _is_int(value):
        return fn(value) if value > 0 else value
    if isinstance(value, list) and value and all(_is_int(x) for x in value):
        return [fn(x) if x > 0 else x for x in value]
    return value


def _scalars(d: dict[str, Any], role: str) -> dict[str, int]:
    return {k: v for k, v in d.items() if isinstance(k, str) and _is_int(v) and v > 0 and _role(k) == role}


def _largest_divisor(n: int, at_most: int, *, min_quotient: int = 1) -> int:
    """The largest divisor of `n` no larger than `at_most` that leaves at least `min_quotient` (or 1)."""
    fits = [g for g in range(1, n + 1) if n % g == 0 and g <= at_most and n // g >= min_quotient]
    return max(fits, default=1)


def _shrink_dict(d: dict[str, Any], parent: _Scale | None, tree: _Tree,
                 outer: tuple[dict[str, Any], dict[str, Any]] | None) -> dict[str, Any]:
    """Shrink one config dict. `outer` is the enclosing config's (original, shrunk) dicts: a partial dict
    (per-layer overrides, rope parameters) takes the partners of its attributes from there."""
    is_config = "model_type" in d or parent is None
    scale = _Scale.of(d, parent, tree) if is_config else parent
    assert scale is not None
    out: dict[str, Any] = {}
    for k, v in d.items():
        role = _role(k) if isinstance(k, str) else None
        fn = {"width": scale.width_like, "head_dim": scale.head_dim, "rank": scale.rank, "vocab": tree.vocab,
              "heads": scale.head_count, "ssm_state": lambda x: min(x, SSM_STATE),
              "per_layer_width": lambda x: min(x, PER_LAYER_WIDTH)}.get(role or "")
        out[k] = _map_ints(v, fn) if fn else v
    # a partial dict finds partners (the heads of its key-value heads, say) in its enclosing config
    orig, new = (d, dict(out)) if is_config or outer is None else ({**outer[0], **d}, {**outer[1], **out})
    _repair_head_products(orig, new, out, scale)
    _fit_kv_heads(orig, new, out, scale)
    _fit_ssm_groups(orig, new, out)
    _fit_experts(orig, out, tree)
    _fit_rope_lists(d, orig, new, out)
    _fit_width_splits(d, orig, new, out)
    new.update(out)
    for k, v in d.items():
        if isinstance(v, dict):
            out[k] = _shrink_dict(v, scale, tree, (orig, new))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            out[k] = [_shrink_dict(x, scale, tree, (orig, new)) for x in v]
    return out


def _repair_head_products(orig: dict, new: dict, out: dict, scale: _Scale) -> None:
    """A head count whose product with a head size made up a width (Mamba-2: ``num_heads * head_dim ==
    expand * hidden_size``; Zamba: ``heads * attention_head_dim == attention_hidden_size``) is recomputed
    from the shrunk width and head size, so the product still holds."""
    widths = {k: (v, new[k]) for k, v in _scalars(orig, "width").items() if _is_int(new.get(k))}
    for k, v in orig.items():
        if isinstance(k, str) and k.lower().endswith("expand") and isinstance(v, int | float) and v > 0:
            widths[k] = (v * scale.width, v * scale.new_width)
    for hk, h in _scalars(orig, "heads").items():
        if hk not in out:
            continue
        for dk, hd in _scalars(orig, "head_dim").items():
            if _words(dk) != _words(hk) or not _is_int(new.get(dk)):
                continue
            made_up = [w_new for w_old, w_new in widths.values() if h * hd == w_old and w_new % new[dk] == 0]
            if made_up:
                out[hk] = new[hk] = int(made_up[0] // new[dk])
                break


_KV_FRAGMENTS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_n_heads", "multi_query_group_num",
                 "num_query_groups", "num_key_heads")
_HEAD_NAMES = ("num_attention_heads", "num_heads", "n_heads", "n_head", "attention_heads", "num_value_heads")


def _kv_partner(kv_key: str, orig: dict, new: dict) -> str | None:
    prefix = kv_key
    for frag in _KV_FRAGMENTS:
        if kv_key.endswith(frag):
            prefix = kv_key[: -len(frag)]
            break
    for name in _HEAD_NAMES:
        if _is_int(orig.get(prefix + name)) and _is_int(new.get(prefix + name)):
            return prefix + name
    for name in _MAIN_HEADS:
        if _is_int(orig.get(name)) and _is_int(new.get(name)):
            return name
    return None


def _kv_count(kv: int, heads: int, new_heads: int) -> int:
    """Multi-query stays 1, multi-head stays equal to the heads, grouped-query stays a proper divisor."""
    if kv <= 1:
        return kv
    if kv >= heads:
        return new_heads
    proper = [g for g in range(2, new_heads) if new_heads % g == 0]
    if not proper:
        return 1
    return min(proper, key=lambda g: (abs(g - new_heads * kv / heads), g))


def _fit_kv_heads(orig: dict, new: dict, out: dict, scale: _Scale) -> None:
    for kk, kv in orig.items():
        if not (isinstance(kk, str) and kk in out and _role(kk) == "kv_heads"):
            continue
        partner = _kv_partner(kk, orig, new)
        h, h_new = (orig[partner], new[partner]) if partner else (scale.heads, scale.new_heads)
        out[kk] = new[kk] = _map_ints(kv, lambda x, h=h, h_new=h_new: _kv_count(x, h, h_new))
        # other head counts that the key-value heads divided must stay multiples of them (per-layer lists)
        if _is_int(kv) and kv > 1 and _is_int(new[kk]):
            for hk in _scalars(orig, "heads").keys() | {k for k, v in orig.items() if _role(k) == "heads"
                                                         and isinstance(v, list)}:
                if hk in out and hk != partner and _words(hk) == _words(partner or ""):
                    kvn = new[kk]
                    out[hk] = new[hk] = _map_ints(orig[hk], lambda x, kvn=kvn, kv=kv: math.ceil(
                        scale.head_count(x) / kvn) * kvn if x % kv == 0 else scale.head_count(x))


def _fit_ssm_groups(orig: dict, new: dict, out: dict) -> None:
    for gk, g in _scalars(orig, "ssm_groups").items():
        if gk not in out:
            continue
        heads = [hk for hk in _scalars(orig, "heads") if _words(hk) & _words(gk) or not _words(gk)]
        for hk in heads:
            if h := new.get(hk):
                out[gk] = new[gk] = _largest_divisor(h, g)
                break


def _fit_experts(orig: dict, out: dict, tree: _Tree) -> None:
    """Expert counts follow the tree's map (at most about MAX_EXPERTS, distinct ones stay distinct); top-k
    stays sparse (or dense when it was); group-limited routing keeps at least two experts a group and a
    top-k within the experts of the chosen groups."""
    experts = _scalars(orig, "experts")
    for k, v in experts.items():
        if k in out:
            out[k] = tree.experts.get(v, v)
    if not experts:
        return
    e_old = max(experts.values())
    e_new = tree.experts.get(e_old, e_old)
    g_old, g_new = 1, 1
    for gk, g in _scalars(orig, "expert_groups").items():
        g_old, g_new = g, _largest_divisor(e_new, g, min_quotient=2) if g > 1 else 1
        if gk in out:
            out[gk] = g_new
    t_new = g_new
    for tk, t in _scalars(orig, "topk_groups").items():
        t_new = g_new if t >= g_old else max(1, min(t, g_new - 1))
        if tk in out:
            out[tk] = t_new
    for kk, k in _scalars(orig, "top_k").items():
        if kk in out:
            out[kk] = min(e_new if k >= e_old else _top_k(k), t_new * (e_new // g_new))
    for sk, s in _scalars(orig, "shared_experts").items():
        if sk in out:
            out[sk] = min(s, 2)


def _fit_width_splits(d: dict, orig: dict, new: dict, out: dict) -> None:
    """A list of sizes that splits a width into parts (Reformer's ``axial_pos_embds_dim`` sums to
    ``hidden_size``) splits the shrunk width in the same proportions."""
    widths = {v: new[k] for k, v in _scalars(orig, "width").items() if _is_int(new.get(k))}
    for k, v in d.items():
        if (isinstance(k, str) and _role(k) is None and re.search(r"dim|size|width", k) and isinstance(v, list)
                and len(v) > 1 and all(_is_int(x) and x > 0 for x in v) and sum(v) in widths):
            out[k] = _split(widths[sum(v)], v)


def _head_dim_of(d: dict[str, Any]) -> int | None:
    head_dim = d.get("head_dim")
    if _is_int(head_dim) and head_dim > 0:
        return head_dim
    width = next((d[k] for k in _MAIN_WIDTH if _is_int(d.get(k)) and d[k] > 0), None)
    heads = next((d[k] for k in _MAIN_HEADS if _is_int(d.get(k)) and d[k] > 0), None)
    return width // heads if width and heads else None


def _fit_rope_lists(d: dict, orig: dict, new: dict, out: dict) -> None:
    """Rope parameters that list one entry per rotary frequency (longrope's factors) or split the
    frequencies into sections (multimodal rope) follow the shrunk head size."""
    lists = {k: d[k] for k in ("short_factor", "long_factor", "mrope_section") if isinstance(d.get(k), list)}
    old_hd, new_hd = _head_dim_of(orig), _head_dim_of(new)
    if not lists or not old_hd or not new_hd:
        return
    partial = d.get("partial_rotary_factor") or orig.get("partial_rotary_factor") or 1.0
    half = max(1, int(new_hd * partial) // 2)
    for k, values in lists.items():
        if k == "mrope_section" and all(_is_int(x) for x in values):
            out[k] = _split(half, values)
        elif len(values) > half:  # one factor per frequency: keep evenly spaced ones, first and last included
            out[k] = [values[round(i * (len(values) - 1) / max(1, half - 1))] for i in range(half)]


def _split(total: int, weights: list[int]) -> list[int]:
    """`total` split in proportion to `weights` (largest remainders), every part at least 1 when possible."""
    raw = [total * w / sum(weights) for w in weights]
    parts = [max(1 if total >= len(weights) else 0, int(r)) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - int(raw[i]), reverse=True)
    i = 0
    while sum(parts) < total:
        parts[order[i % len(order)]] += 1
        i += 1
    while sum(parts) > total:
        j = max(range(len(parts)), key=lambda i: parts[i])
        parts[j] -= 1
    return parts


# ---------------------------------------------------------------------------------------------- public


def miniature_config(config: PretrainedConfig, *, token_ids: Iterable[int] = ()) -> PretrainedConfig:
    """A copy of `config` with every width, head count, expert count and vocabulary shrunk; the number of
    layers and every per-layer pattern kept. Raises lmprobe.errors.ModelError when it cannot.

    ``token_ids``: ids besides those the config names that must stay valid (the tokenizer's pad id).

    Works on ``config.to_dict()`` and rebuilds with ``type(config).from_dict``, so sub-configs (text,
    vision, attention and feed-forward configs) and heterogeneous per-layer overrides shrink by the same
    rules as the top level. Token ids the config names stay valid: a vocabulary keeps room for every id that
    was inside it.

    Example::

        >>> from transformers import MistralConfig
        >>> mini = miniature_config(MistralConfig())
        >>> mini.num_hidden_layers, mini.hidden_size, mini.num_key_value_heads, mini.vocab_size
        (32, 64, 2, 512)
    """
    try:
        original = config.to_dict()
    except Exception as exc:  # a config object lmprobe cannot read is the caller's input, not our bug
        raise ModelError(f"cannot read the config {type(config).__name__}: {exc}; pass a transformers "
                         "PretrainedConfig") from exc
    tree = _Tree.of(original)
    extra = frozenset(int(i) for i in token_ids if _is_int(i) and i >= 0)
    if extra:
        tree = dataclasses.replace(tree, ids=tree.ids | extra)
    small = _shrink_dict(original, None, tree, None)
    small.pop("transformers_version", None)
    try:
        return type(config).from_dict(small)
    except Exception as exc:
        raise ModelError(f"cannot build a miniature of {type(config).__name__} "
                         f"({getattr(config, 'model_type', '?')}): the shrunk config is rejected: "
                         f"{_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {' '.join(lines[:3])[:300]}"


def build_miniature(config: PretrainedConfig, *, seed: int = 0, max_parameters: int = DEFAULT_MAX_PARAMETERS,
                    causal_lm: bool | None = None, token_ids: Iterable[int] = (),
                    trust_remote_code: bool = False) -> torch.nn.Module:
    """AutoModelForCausalLM (or AutoModel when the config is not a causal LM) of ``miniature_config(config)``,
    float32, CPU, eval mode, random weights.

    ``causal_lm`` picks the class as the real model is loaded (default: by the model type); ``token_ids`` stay
    valid (see ``miniature_config``).

    Every floating-point entry of the state dict (parameters and persistent buffers: norm weights, biases,
    per-layer scalars) is drawn at random around its initial value, so that no scale is exactly 1 and no bias
    exactly 0 and a hookpoint that skips a norm or a bias shows up numerically. Non-persistent buffers (rotary
    frequencies, masks) stay as the model computes them. The model is first built on the meta device: more
    than `max_parameters` parameters (or buffers larger than as many float32 entries: causal masks of a long
    context) raise ModelError before anything is allocated.

    Example::

        >>> from transformers import Qwen2Config
        >>> model = build_miniature(Qwen2Config(num_hidden_layers=2), seed=1)
        >>> model.config.hidden_size, model.training
        (64, False)
    """
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not _is_int(max_parameters) or max_parameters <= 0:
        raise ModelError(f"max_parameters must be a positive integer, got {max_parameters!r}")
    mini = miniature_config(config, token_ids=token_ids)
    if causal_lm is None:
        causal_lm = mini.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    auto = AutoModelForCausalLM if causal_lm else AutoModel
    remote = {"trust_remote_code": True} if trust_remote_code else {}
    n_params, n_buffer_bytes = _count_on_meta(mini, auto, remote)
    if n_params > max_parameters:
        raise ModelError(f"the miniature of {mini.model_type} would have {n_params:,} parameters, more than "
                         f"max_parameters={max_parameters:,}; raise max_parameters")
    if n_buffer_bytes > 4 * max_parameters:
        raise ModelError(f"the miniature of {mini.model_type} would hold {n_buffer_bytes:,} bytes of buffers, "
                         f"more than max_parameters float32 parameters would ({4 * max_parameters:,}); "
                         "raise max_parameters")
    torch.manual_seed(seed)
    try:
        model = auto.from_config(mini, dtype=torch.float32, **remote)
    except Exception as exc:
        raise ModelError(f"cannot build a miniature of {mini.model_type}: {_first_line(exc)}") from exc
    _randomize(model, seed=seed)
    return model.eval()


def skeleton(config: PretrainedConfig, *, causal_lm: bool, trust_remote_code: bool = False) -> torch.nn.Module:
    """The full-size model of ``config`` on the ``meta`` device (no memory, no weights): what module paths measure."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    remote = {"trust_remote_code": True} if trust_remote_code else {}
    with torch.device("meta"):  # eager attention: sdpa's mask checks read values, which meta tensors lack
        return (AutoModelForCausalLM if causal_lm else AutoModel).from_config(config, attn_implementation="eager",
                                                                            **remote)


def _count_on_meta(config, auto, remote: dict) -> tuple[int, int]:
    """(parameters, bytes of buffers) of the model `config` describes, built on the meta device."""
    import torch

    try:
        with torch.device("meta"):
            model = auto.from_config(config, **remote)
    except Exception as exc:
        raise ModelError(f"cannot build {config.model_type} from its config: {_first_line(exc)}") from exc
    n_params = sum(t.numel() for t in model.parameters())
    return n_params, sum(t.numel() * t.element_size() for t in model.buffers())


def _randomize(model, *, seed: int = 0) -> None:
    """Draw every floating-point state-dict entry of `model` (in place) around its current value.

    Entries with a spread get noise of a fifth of their root mean square; constant ones (norm weights of
    1, per-layer scalars) move by a fifth of their value; all-zero ones (biases) get a spread of
    ``1/sqrt(fan_in)`` (matrices) or 0.1. Non-finite entries (masks) stay. Tied tensors are drawn once.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    with torch.no_grad():
        for tensor in model.state_dict(keep_vars=True).values():
            data = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
            if not data.is_floating_point() or id(tensor) in seen or data.numel() == 0:
                continue
            seen.add(id(tensor))
            finite = torch.isfinite(data)
            all_finite = bool(finite.all())
            values = data if all_finite else data[finite]
            rms = (torch.linalg.vector_norm(values.float()) / math.sqrt(max(1, values.numel()))).item()
            if rms > 0:
                sigma = 0.2 * rms
            else:
                sigma = 1 / math.sqrt(data.shape[-1]) if data.dim() >= 2 else 0.1
            noise = torch.randn(data.shape, generator=gen, dtype=torch.float32).mul_(sigma).to(data.dtype)
            data.add_(noise if all_finite else torch.where(finite, noise, torch.zeros((), dtype=data.dtype)))
