"""Examining a model before it extracts: its blocks, every block's hookpoints, and the inputs its forward wants.

lmprobe keeps no table of families. It runs the model (a miniature of it with random weights,
before the real weights load; the loaded model when no miniature can be built) and reads the
answers off the values:

1. **The block list** is the list of modules whose block i reads transformers' own
   ``hidden_states[i]`` and returns ``hidden_states[i + 1]`` (the last may differ by the final
   norm). A model whose hidden states are not one list of blocks (several streams, blocks run more
   than once, a layout other than (batch, tokens, width)) is refused: its layers would not mean
   "the output of block i".
2. **Every block's anatomy** (``anatomy.block_anatomy``): each named hookpoint is read where it
   satisfies the identities of docs/hookpoints.md on that block, or refused with the reason.
   Blocks of a hybrid model are examined one by one, so an attention block after five Mamba
   blocks gets its own answer.
3. **The inputs** (``InputPolicy``): a padded batch must give, at every real token, what each
   prompt gives alone with transformers' own defaults. The policy that does is kept: which side to
   pad, and whether to pass position ids counted over the real tokens (models that count positions
   from the padding index, such as RoBERTa, compute their own; a model that takes none gets none).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ModelError
from .anatomy import BlockAnatomy, BlockRecord, block_anatomy, close
from .hookpoints import NAMED, Capture, Reading, Site, first_input, first_output
from .model import forward_takes
from .placement import input_device

__all__ = ["Architecture", "InputPolicy", "examine", "first_jump", "forward_kwargs", "plan_captures",
           "position_ids_for", "ranges", "record_blocks", "relative_difference", "site_widths"]

#: relative tolerance of the identity checks: float32 miniature, and a loaded model in 16-bit floats
TOLERANCE = {"float32": 1e-5, "low": 3e-2}
#: a padded batch against each prompt alone: float32 rounding grows with depth (1e-5 after 32 blocks of a
#: Mamba hybrid), while a wrong input (positions off by an offset, padding seen) changes values by 1e-1 or more
POLICY_TOLERANCE = 1e-3
#: a miniature's random weights can make a deep stack chaotic: rounding differences then grow by a steady
#: factor per block (2-3x in MiniMax's), which is not a wrong input. A wrong input shows as a jump: a block
#: whose difference is this many times the one before it (and above POLICY_TOLERANCE)
POLICY_JUMP = 30.0


@dataclass(frozen=True)
class InputPolicy:
    """What the extraction passes to the model's forward besides ``input_ids``."""

    padding_side: str = "right"  # "left" or "right"
    attention_mask: bool = True
    position_ids: bool = False  # position ids counted over the real tokens
    use_cache: bool = True  # pass use_cache=False (the forward takes it)
    decoder_inputs: bool = False  # an encoder-decoder: the decoder reads the prompt shifted right


@dataclass
class Architecture:
    """What ``examine`` found: the block list, each block's anatomy, and the inputs to pass."""

    block_path: str
    blocks: list[BlockAnatomy]
    inputs: InputPolicy
    checked_on: str  # "miniature" or "loaded model"
    width: int  # the stream's width in the examined model
    stream: str = "hidden_states"  # which of the output's hidden states the blocks produce (STREAMS)
    notes: list[str] = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    def reading(self, hookpoint: str, layer: int) -> Reading:
        """How ``hookpoint`` is read on block ``layer``; a ModelError saying why when it cannot be."""
        block = self.blocks[layer]
        if hookpoint in NAMED:
            if hookpoint in block.readings:
                return block.readings[hookpoint]
            why = block.refusals.get(hookpoint, "it could not be located")
            where = self.layers_with(hookpoint)
            if not where:
                raise ModelError(f"this model's blocks have no {hookpoint}: {why}; blocks have {block.children}. "
                                 f"Name a module instead, e.g. --hookpoints '{_example_path(block)}'")
            raise ModelError(f"hookpoint {hookpoint!r} does not exist on layer {layer}: {why}. It exists on layers "
                             f"{ranges(where)}: pass --layers {_layers_arg(where)} for it, or extract "
                             "the other layers without it")
        path, _, kind = hookpoint.rpartition(":")
        return Reading(Site(path, kind))

    def layers_with(self, hookpoint: str) -> list[int]:
        return [i for i, b in enumerate(self.blocks) if hookpoint in b.readings]

    def describe(self) -> str:
        """The block list, each kind of block with how every named hookpoint is read there, and the inputs."""
        on = "a miniature with random weights" if self.checked_on == "miniature" else "the loaded model"
        lines = [f"{self.block_path}: {self.num_layers} blocks, checked on {on}"]
        for layers, block in self.kinds():
            lines.append(f"layers {ranges(layers)}: {block.describe()}")
            for hp in NAMED:
                how = str(block.readings[hp]) if hp in block.readings else f"none: {block.refusals.get(hp, '?')}"
                lines.append(f"  {hp:<11} {how}")
        i = self.inputs
        pos = "position ids counted over the real tokens" if i.position_ids else "the model's own positions"
        lines.append(f"inputs: {i.padding_side} padding, {pos}"
                     + (", the decoder reads the prompt shifted right" if i.decoder_inputs else ""))
        return "\n".join(lines)

    def kinds(self) -> list[tuple[list[int], BlockAnatomy]]:
        """Layers grouped by the anatomy of their block (one entry per distinct kind, in layer order)."""
        groups: dict[tuple, tuple[list[int], BlockAnatomy]] = {}
        for i, b in enumerate(self.blocks):
            key = (b.kind, b.mixer, b.mlp, tuple(sorted(b.readings.items(), key=str)), tuple(sorted(b.refusals)))
            groups.setdefault(key, ([], b))[0].append(i)
        return list(groups.values())


def _example_path(block: BlockAnatomy) -> str:
    name = block.mlp or block.mixer or (block.children[0] if block.children else "mlp")
    return f"{name}:output"


def _layers_arg(layers: Sequence[int]) -> str:
    """``layers`` as a --layers value (ranges as Python slices)."""
    return ",".join(f"{int(a)}:{int(b) + 1}" if "-" in part and (a := part.split("-")[0]) and (b := part.split("-")[1])
                    else part for part in ranges(layers).split(","))


def ranges(layers: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out, start, prev = [], None, None
    for i in layers:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = i
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(out)


def position_ids_for(attention_mask):
    """Positions counted over real tokens only, so left padding does not shift them."""
    pos = attention_mask.long().cumsum(dim=1) - 1
    return pos.clamp(min=0)


def _shift_right(model: Any, input_ids, attention_mask):
    """The decoder's input of an encoder-decoder given no decoder input: the prompt shifted right by one."""
    import torch

    cfg = model.config
    start = getattr(cfg, "decoder_start_token_id", None)
    if start is None:
        start = getattr(cfg, "bos_token_id", None) or getattr(cfg, "pad_token_id", None) or 0
    ids = torch.full_like(input_ids, int(start))
    ids[:, 1:] = input_ids[:, :-1]
    mask = torch.ones_like(attention_mask)
    mask[:, 1:] = attention_mask[:, :-1]
    return ids, mask


def forward_kwargs(model: Any, policy: InputPolicy, input_ids, attention_mask) -> dict[str, Any]:
    """The keyword arguments of one forward pass under ``policy``."""
    kwargs: dict[str, Any] = {"input_ids": input_ids}
    if policy.attention_mask:
        kwargs["attention_mask"] = attention_mask
    if policy.position_ids:
        kwargs["position_ids"] = position_ids_for(attention_mask)
    if policy.use_cache:
        kwargs["use_cache"] = False
    if policy.decoder_inputs:
        ids, mask = _shift_right(model, input_ids, attention_mask)
        kwargs["decoder_input_ids"] = ids
        if policy.attention_mask:
            kwargs["decoder_attention_mask"] = mask
    return kwargs


#: where a model's output keeps the hidden states of its blocks: a decoder's first (an encoder-decoder's
#: layers are its decoder's), an encoder's only when --block-path names the encoder's blocks
STREAMS = ("decoder_hidden_states", "hidden_states", "encoder_hidden_states")


def _hidden_states(out: Any, stream: str) -> Any:
    return getattr(out, stream, None)


def record_blocks(blocks: Sequence[Any], forward: Callable[[], Any], *, deep: bool) -> tuple[list[BlockRecord], Any]:
    """Run ``forward`` with hooks on each block (``deep``: and on every module inside it); return each
    block's record (first calls only) and what ``forward`` returned."""
    import itertools

    counter = itertools.count()
    records = [BlockRecord({}, {}, {}) for _ in blocks]
    handles = []

    def hooks(rec: BlockRecord, name: str):
        def pre(_m, args, kwargs):
            if name not in rec.inputs:
                rec.inputs[name] = _detach(first_input(args, kwargs))
                rec.order[Site(name, "input")] = next(counter)

        def post(_m, _args, _kwargs, out):
            if name not in rec.outputs:
                rec.outputs[name] = _detach(first_output(out))
                rec.order[Site(name, "output")] = next(counter)
        return pre, post

    for block, rec in zip(blocks, records, strict=True):
        modules = block.named_modules() if deep else [("", block)]
        for name, m in modules:
            pre, post = hooks(rec, name)
            handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(m.register_forward_hook(post, with_kwargs=True))
    try:
        result = forward()
    finally:
        for h in handles:
            h.remove()
    return records, result


def _detach(t: Any) -> Any:
    return t.detach().clone() if hasattr(t, "detach") else t


def _module_lists(model: Any, block_path: str | None) -> list[tuple[str, Any]]:
    import torch

    if block_path:
        obj = model
        for part in block_path.split("."):
            obj = getattr(obj, part, None)
        if not isinstance(obj, torch.nn.ModuleList) or len(obj) == 0:
            raise ModelError(f"--block-path {block_path!r} does not name a list of modules in this model")
        return [(block_path, obj)]
    return [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]


def _probe_ids(model: Any, n: int, *, avoid: set[int], seed: int = 0):
    """``n`` token ids a model's embedding takes, none of them a special or pad id."""
    import torch

    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None) or getattr(model.config, "vocab_size", None) or 100
    lo, hi = min(10, vocab - 1), min(int(vocab), 1000)
    g = torch.Generator().manual_seed(seed)
    ids = []
    while len(ids) < n:
        i = int(torch.randint(lo, hi, (1,), generator=g))
        if i not in avoid:
            ids.append(i)
    return torch.tensor(ids, dtype=torch.long)


def _special_ids(model: Any, pad_token_id: int | None) -> set[int]:
    out = {pad_token_id} if pad_token_id is not None else set()
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for c in (cfg, text):
        for k, v in vars(c).items():
            if k.endswith(("_token_id", "_token_index")) and isinstance(v, int):
                out.add(v)
    return out


def examine(model: Any, *, pad_token_id: int | None, padding_side: str, block_path: str | None = None,
            checked_on: str = "miniature", tolerance: float = TOLERANCE["float32"]) -> Architecture:
    """Find the block list, the anatomy of every block and the input policy of ``model`` (see the module docstring)."""
    import torch

    threads = torch.get_num_threads()
    if checked_on == "miniature":
        torch.set_num_threads(1)  # a miniature's tensors are tiny: threads would only add their overhead
    try:
        return _examine(model, pad_token_id=pad_token_id, padding_side=padding_side, block_path=block_path,
                        checked_on=checked_on, tolerance=tolerance)
    finally:
        torch.set_num_threads(threads)


def _examine(model: Any, *, pad_token_id: int | None, padding_side: str, block_path: str | None,
             checked_on: str, tolerance: float) -> Architecture:
    import torch

    device = input_device(model)  # the first device of a spread model
    avoid = _special_ids(model, pad_token_id)
    encdec = bool(getattr(model.config, "is_encoder_decoder", False)) and forward_takes(model, "decoder_input_ids", via_kwargs=False)
    base = InputPolicy(padding_side=padding_side, attention_mask=forward_takes(model, "attention_mask", via_kwargs=False),
                       use_cache=forward_takes(model, "use_cache"), decoder_inputs=encdec)
    ids = _probe_ids(model, 6, avoid=avoid).to(device)[None]

    def run(policy: InputPolicy, input_ids, mask) -> Callable[[], Any]:
        def forward():
            with torch.no_grad():
                return model(**forward_kwargs(model, policy, input_ids, mask), output_hidden_states=True)
        return forward

    lists = _module_lists(model, block_path)
    plain = InputPolicy(use_cache=base.use_cache, attention_mask=False, decoder_inputs=encdec)
    ones = torch.ones_like(ids)
    flat = [(name, i, b) for name, ml in lists for i, b in enumerate(ml)]
    records, out = record_blocks([b for _, _, b in flat], run(plain, ids, ones), deep=False)
    streams = [k for k in STREAMS if _hidden_states(out, k) is not None and (block_path or k != "encoder_hidden_states")]
    errors = []
    for stream in streams or ["hidden_states"]:
        hs = _hidden_states(out, stream)
        try:
            path, blocks = _choose_blocks(lists, flat, records, hs, ids.shape[1], tolerance, block_path)
            break
        except ModelError as exc:
            errors.append(exc)
    else:
        raise errors[0]
    width = int(hs[0].shape[-1]) if hs is not None else int(records[0].inputs[""].shape[-1])
    stated = _hidden_size(model.config)
    if stated is not None and stated != width:
        raise ModelError(f"this model's hidden states are {width} wide where its config's hidden size is {stated} "
                         "(several streams side by side, as with hyper-connections); lmprobe stores one stream of the "
                         "hidden size per layer, so it is not supported")
    deep, _ = record_blocks(list(blocks), run(plain, ids, ones), deep=True)
    anatomies = [block_anatomy(b, r, tol=tolerance) for b, r in zip(blocks, deep, strict=True)]
    for layer, (a, r, b) in enumerate(zip(anatomies, deep, blocks, strict=True)):
        _check_widths(a, r, width, ids.shape[1], layer)
        a.order = r.order
        a.modules = [n for n, _ in b.named_modules() if n]
    policy = _choose_inputs(model, base, avoid, pad_token_id, tolerance, run, stream)
    return Architecture(path, anatomies, policy, checked_on, width, stream)


def _hidden_size(config: Any) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return next((getattr(text, a) for a in ("hidden_size", "n_embd", "d_model")
                 if isinstance(getattr(text, a, None), int)), None)


def _choose_blocks(lists, flat, records, hs, n_tokens: int, tol: float, block_path: str | None):
    """The block list whose blocks read and return transformers' hidden states, or a ModelError saying why none does."""
    if hs is None or not isinstance(hs, (tuple, list)) or not all(hasattr(h, "shape") for h in hs):
        raise ModelError("this model returns no hidden states (output_hidden_states), so lmprobe cannot check that "
                         "its blocks' outputs are the residual stream; it is not supported")
    shape = tuple(hs[0].shape)
    if len(shape) != 3 or shape[:2] != (1, n_tokens):
        raise ModelError(f"this model's hidden states have shape {shape} for one prompt of {n_tokens} tokens, not "
                         "(batch, tokens, width) (several parallel streams, or another layout); lmprobe stores one "
                         "vector per token and layer, so it is not supported")
    by_list: dict[str, list[BlockRecord]] = {}
    for (name, _i, _b), rec in zip(flat, records, strict=True):
        by_list.setdefault(name, []).append(rec)
    reasons = []
    for name, ml in lists:
        recs = by_list[name]
        n = len(ml)
        ins = [i < len(hs) and close(r.inputs.get(""), hs[i], tol) for i, r in enumerate(recs)]
        outs = [i + 1 < len(hs) and close(r.outputs.get(""), hs[i + 1], tol) for i, r in enumerate(recs)]
        if len(hs) == n + 1 and all(ins) and all(outs[:-1]):
            return _one_vector_per_token(name, recs[0], shape), ml
        # some models (the Mamba family) return every block's output and the final norm, not the embeddings
        given = [i < len(hs) and close(r.outputs.get(""), hs[i], tol) for i, r in enumerate(recs)]
        chained = [close(recs[i].inputs.get(""), recs[i - 1].outputs.get(""), tol) for i in range(1, n)]
        if len(hs) == n + 1 and all(given) and all(chained):
            return _one_vector_per_token(name, recs[0], shape), ml
        first = recs[0].inputs.get("")
        shape = tuple(getattr(first, "shape", ()))
        idle = [i for i, r in enumerate(recs) if "" not in r.inputs]
        if idle and (any(ins) or any(outs)):
            reasons.append(f"{len(idle)} of the {n} blocks of {name} do not run on text alone (layers "
                           f"{ranges(idle)}: cross-attention to another input, say), so its hidden states are not "
                           "one per block")
        elif any(ins) or any(outs):
            reasons.append(f"{name} has {n} blocks for {len(hs)} hidden states, and its blocks read or return "
                           f"them at {sum(ins) + sum(outs)} of {2 * n} places (blocks run more than once, or states "
                           "that are not block outputs)")
        elif len(shape) == 3 and shape[0] == 1 and shape[2] == hs[0].shape[-1] and shape[1] != n_tokens:
            reasons.append(f"the blocks of {name} see {shape[1]} tokens for a prompt of {n_tokens} (the model adds "
                           "tokens of its own), so their outputs are not one vector per token of the prompt")
        elif name == block_path or (n == len(hs) - 1 and len(shape) == 3):
            reasons.append(f"the blocks of {name} read and return other values than the hidden states (the stream "
                           "is transformed between blocks)")
    why = "; ".join(reasons) if reasons else "no list of modules reads or returns them"
    raise ModelError(f"this model's hidden states are not the inputs and outputs of one list of blocks: {why}. "
                     "Its layers would not mean 'the output of block i', so lmprobe does not extract from it")


def _one_vector_per_token(name: str, first: BlockRecord, states: tuple[int, ...]) -> str:
    """``name``, once its blocks are seen to carry the stream as transformers returns it, (batch, tokens, width);
    a ModelError for another layout (XLNet's blocks run time-major: (tokens, batch, width))."""
    shape = tuple(getattr(first.inputs.get(""), "shape", ()))
    if shape not in (states, states[1:]):
        raise ModelError(f"the blocks of {name} carry the stream as {shape} for one prompt of {states[1]} tokens, not "
                         f"as transformers returns it, {states} (batch, tokens, width): another layout (time-major, "
                         "say), which lmprobe does not read; it is not supported")
    return name


def _check_widths(anatomy: BlockAnatomy, rec: BlockRecord, width: int, n_tokens: int, layer: int) -> None:
    """A named hookpoint is one vector of the stream's width per token; anything else is refused."""
    for hp, reading in list(anatomy.readings.items()):
        for site in (reading.site, reading.minus):
            if site is None:
                continue
            t = rec.inputs.get(site.path) if site.kind == "input" else rec.outputs.get(site.path)
            shape = tuple(getattr(t, "shape", ()))
            ok = shape in ((1, n_tokens, width), (n_tokens, width))
            if not ok:
                del anatomy.readings[hp]
                anatomy.refusals[hp] = (f"{site} gives {type(t).__name__ if not shape else shape} on layer {layer}, "
                                        f"not one vector of the stream's width ({width}) per token")
                break


def relative_difference(a: Any, b: Any) -> float:
    """``|a - b| / (|a| + |b|)`` in float64 (0 for two zeros)."""
    x, y = a.detach().double().reshape(-1), b.detach().to(a.device).double().reshape(-1)
    scale = float(x.norm() + y.norm())
    return float((x - y).norm()) / scale if scale > 0 else 0.0


def first_jump(errors: Sequence[float], tol: float, jump: float = POLICY_JUMP) -> int | None:
    """The first layer whose difference is above ``tol`` and ``jump`` times the one before (None: none is):
    a wrong input, not rounding that a chaotic stack amplifies block after block."""
    before = 0.0
    for i, e in enumerate(errors):
        if e > tol and e > jump * before:
            return i
        before = e
    return None


def _choose_inputs(model: Any, base: InputPolicy, avoid: set[int], pad_token_id: int | None, tol: float,
                   run: Callable, stream: str) -> InputPolicy:
    """The first input policy under which a padded batch gives each prompt's own hidden states."""
    import dataclasses

    import torch

    device = input_device(model)  # the first device of a spread model
    lengths = (5, 2, 3)
    prompts = [_probe_ids(model, n, avoid=avoid, seed=1 + k).to(device) for k, n in enumerate(lengths)]
    alone = []
    plain = dataclasses.replace(base, attention_mask=False, position_ids=False)
    for p in prompts:
        hs = _hidden_states(run(plain, p[None], torch.ones_like(p)[None])(), stream)
        alone.append([h[0] for h in hs])
    pad = pad_token_id if pad_token_id is not None else 0
    other = "left" if base.padding_side == "right" else "right"
    takes_pos = forward_takes(model, "position_ids", via_kwargs=False)
    candidates = []
    for side in (base.padding_side, other):
        for pos in ((True, False) if takes_pos and base.attention_mask else (False,)):
            candidates.append(dataclasses.replace(base, padding_side=side, position_ids=pos))
    worst = []
    for policy in candidates:
        T = max(lengths)
        ids = torch.full((len(prompts), T), pad, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        spans = []
        for b, p in enumerate(prompts):
            s = T - len(p) if policy.padding_side == "left" else 0
            ids[b, s:s + len(p)] = p
            mask[b, s:s + len(p)] = 1
            spans.append(slice(s, s + len(p)))
        try:
            hs = _hidden_states(run(policy, ids, mask)(), stream)
        except Exception as exc:  # a policy this model cannot run: try the next
            worst.append(f"{policy.padding_side} padding{' with position ids' if policy.position_ids else ''}: "
                         f"{type(exc).__name__}")
            continue
        errors = [max(relative_difference(h[b, span], alone[b][layer]) for b, span in enumerate(spans))
                  for layer, h in enumerate(hs)]
        bad = first_jump(errors, max(tol, POLICY_TOLERANCE))
        if bad is None:
            return policy
        worst.append(f"{policy.padding_side} padding{' with position ids' if policy.position_ids else ''}: "
                     f"other values from hidden state {bad} on")
    raise ModelError("no padded batch of this model gives each prompt's own hidden states "
                     f"({'; '.join(worst)}); run with --batch-size 1")


def plan_captures(arch: Architecture, hookpoints: Sequence[str], layers: Sequence[int], *, hidden_size: int,
                  widths: dict[tuple[int, Site], int] | None = None) -> list[Capture]:
    """The captures of ``hookpoints`` on ``layers``; a hookpoint that does not exist on one of them, a module a
    block lacks or never calls, or a module path of changing width is a ModelError naming it."""
    captures = []
    for hp in hookpoints:
        readings: dict[int, Reading] = {}
        order: dict[int, dict[Site, int]] = {}
        hp_widths = set()
        for layer in layers:
            block = arch.blocks[layer]
            reading = arch.reading(hp, layer)
            if hp not in NAMED:
                site = reading.site
                if site.path and site.path not in block.modules:
                    raise ModelError(f"hookpoint {hp!r}: the block of layer {layer} has no module {site.path!r}; its "
                                     f"modules are {_module_list(block.modules)}")
                if site not in block.order:
                    raise ModelError(f"hookpoint {hp!r}: module {site.path!r} is never called in a forward pass of "
                                     f"layer {layer}'s block")
                w = (widths or {}).get((layer, site))
                if w is None:
                    raise ModelError(f"hookpoint {hp!r}: the width of {site} on layer {layer} is unknown")
                hp_widths.add(w)
            readings[layer] = reading
            order[layer] = block.order
        if len(hp_widths) > 1:
            raise ModelError(f"hookpoint {hp!r} has different widths on the requested layers ({sorted(hp_widths)}); "
                             "extract the layers of each width separately")
        captures.append(Capture(hp, readings, hp_widths.pop() if hp_widths else hidden_size, order))
    return captures


def _module_list(names: Sequence[str], limit: int = 40) -> str:
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def site_widths(model: Any, block_path: str, sites: dict[int, list[Site]], *, n_tokens: int = 2) -> dict[tuple[int, Site], int]:
    """The last dimension of each (layer, site) in ``model`` (a skeleton on the meta device, or loaded)."""
    import torch

    blocks = _module_lists(model, block_path)[0][1]
    wanted = sorted(sites)
    device = input_device(model)  # the first device of a spread model
    ids = torch.zeros((1, n_tokens), dtype=torch.long, device=device)
    encdec = bool(getattr(model.config, "is_encoder_decoder", False)) and forward_takes(model, "decoder_input_ids",
                                                                                         via_kwargs=False)
    policy = InputPolicy(attention_mask=forward_takes(model, "attention_mask", via_kwargs=False),
                         use_cache=forward_takes(model, "use_cache"), decoder_inputs=encdec)

    def forward():
        with torch.no_grad():
            model(**forward_kwargs(model, policy, ids, torch.ones_like(ids)))

    records, _ = record_blocks([blocks[i] for i in wanted], forward, deep=True)
    out = {}
    for layer, rec in zip(wanted, records, strict=True):
        for site in sites[layer]:
            t = rec.inputs.get(site.path) if site.kind == "input" else rec.outputs.get(site.path)
            shape = getattr(t, "shape", None)
            if shape is not None and len(shape) >= 2:
                out[(layer, site)] = int(shape[-1])
    return out
