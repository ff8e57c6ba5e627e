"""Hookpoints: where in a block an activation is read, located by the model's dataflow.

Named hookpoints (``NAMED``, in the order a block computes them):

- ``resid_pre``: the input of block i (the residual stream before it);
- ``attn_out``: what the attention sublayer adds to the stream (its output; Gemma-2/3 and OLMo-2:
  after their post-attention norm; BERT: the output projection, before dropout, add and norm);
- ``resid_mid``: the stream between the two sublayers (pre-norm blocks: the input of the norm
  before the MLP; post-norm blocks: the normalised stream the MLP reads). Parallel blocks
  (GPT-J, GPT-NeoX with ``use_parallel_residual``, Phi, Falcon) have none;
- ``mlp_in``: the input of the MLP module (after its normalisation);
- ``mlp_out``: what the MLP sublayer adds to the stream (Gemma-2/3, OLMo-2: after the
  post-feedforward norm);
- ``resid_post``: the output of block i.

Anything else is a module path relative to the block with ``:input`` or ``:output``
(``mlp.act_fn:output``). An input is the module's first positional argument, else its
``hidden_states`` keyword, else its first keyword; an output is the first element of a tuple.

The named sites are found without family names: the block's attention and MLP children are
picked by class name, then one forward pass on a two-token input follows the tensors (the
norm whose output is the MLP's input is the pre-MLP norm, and so on). The probe runs on the
model's skeleton on the ``meta`` device when it can, so an unsupported hookpoint is an error
before the weights load.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ModelError
from ..format.spec import HOOKPOINTS as NAMED
from ..format.spec import check_hookpoint
from .model import find_blocks, forward_takes

__all__ = ["NAMED", "Anatomy", "Capture", "Site", "first_input", "first_output", "locate", "parse_hookpoints",
           "plan_captures", "probe_block", "probe_loaded", "probe_skeleton"]

_NORM = re.compile(r"norm", re.I)
_ATTN = re.compile(r"attn|attention", re.I)
_MLP = re.compile(r"mlp|feedforward|feed_forward|ffn|moe|experts?$", re.I)
_MLP_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "moe")
_ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention", "mixer")


@dataclass(frozen=True)
class Site:
    """A module of the block (``""``: the block itself) and which side of it is read."""

    path: str
    kind: str  # "input" or "output"

    def __str__(self) -> str:
        return f"{self.path or '<block>'}:{self.kind}"


def parse_hookpoints(value: str | Sequence[str] | None) -> list[str]:
    """Hookpoint names from ``"resid_post,mlp_out"`` or a list: checked, deduplicated, named ones first in block order."""
    if value is None:
        return ["resid_post"]
    items = [x.strip() for x in value.split(",")] if isinstance(value, str) else [str(x).strip() for x in value]
    items = [x for x in items if x]
    if not items:
        raise ModelError("--hookpoints is empty; name at least one, e.g. resid_post")
    for hp in items:
        check_hookpoint(hp)
    named = [hp for hp in NAMED if hp in items]
    custom = list(dict.fromkeys(hp for hp in items if hp not in NAMED))
    return named + custom


def first_input(args: tuple, kwargs: dict) -> Any:
    if args:
        return args[0]
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]
    return next(iter(kwargs.values()), None)


def first_output(out: Any) -> Any:
    return out[0] if isinstance(out, (tuple, list)) else out


@dataclass
class Anatomy:
    """The sites of one block, as found by ``probe_block``."""

    kind: str  # "pre_norm", "post_norm" or "parallel"
    sites: dict[str, Site | None]  # named hookpoint -> site (None: the block has no such point)
    order: dict[Site, int] = field(default_factory=dict)  # when each site is reached in a forward pass
    children: list[str] = field(default_factory=list)  # the block's direct children, for messages
    widths: dict[Site, int] = field(default_factory=dict)  # the last dimension of each site's tensor

    def site(self, hookpoint: str) -> Site:
        if hookpoint in NAMED:
            s = self.sites.get(hookpoint)
            if s is None:
                why = ("its attention and MLP read the same input in parallel, so there is no stream between them"
                       if hookpoint == "resid_mid" and self.kind == "parallel"
                       else f"no {hookpoint} could be located")
                raise ModelError(f"this model's blocks have no {hookpoint}: {why}; blocks have {self.children}. "
                                 "Name a module instead, e.g. --hookpoints 'mlp:input'")
            return s
        path, _, kind = hookpoint.rpartition(":")
        return Site(path, kind)


def _children(block: Any) -> dict[str, Any]:
    return dict(block.named_children())


def _is_norm(module: Any) -> bool:
    import torch

    return isinstance(module, torch.nn.LayerNorm) or bool(_NORM.search(type(module).__name__))


def _find_attention(block: Any) -> str | None:
    kids = {n: m for n, m in _children(block).items() if not _is_norm(m)}
    found = [n for n, m in kids.items() if _ATTN.search(type(m).__name__) and "cross" not in n.lower()]
    if len(found) == 1:
        return found[0]
    named = [n for n in _ATTN_NAMES if n in kids]
    return named[0] if named else None


def _find_mlp(block: Any) -> tuple[str | None, str | None]:
    """(mlp input module, mlp output module): one container, BERT's intermediate/output, or OPT's fc1/fc2."""
    import torch

    kids = {n: m for n, m in _children(block).items() if not _is_norm(m)}
    found = [n for n, m in kids.items() if _MLP.search(type(m).__name__) or n in _MLP_NAMES]
    if len(found) == 1:
        return found[0], found[0]
    if "intermediate" in kids and "output" in kids and hasattr(kids["output"], "dense"):
        return "intermediate", "output.dense"
    linears = [n for n, m in kids.items() if isinstance(m, torch.nn.Linear)]
    if len(linears) >= 2:
        return linears[0], linears[-1]
    return None, None


def probe_block(block: Any, run_forward: Callable[[], None]) -> Anatomy:
    """Follow the tensors of one forward pass through ``block`` and name its sites.

    ``run_forward`` runs the model on a small input (block 0 is enough: it may stop right after
    ``block`` returns by raising ``_StopProbe``). Every module of the block is hooked; tensors are
    matched by identity (or by storage and shape, through views).
    """
    counter = itertools.count()
    seen_in: dict[str, tuple[Any, int]] = {}
    seen_out: dict[str, tuple[Any, int]] = {}
    handles = []
    modules = dict(block.named_modules())

    def pre(name: str):
        def hook(_m, args, kwargs):
            if name not in seen_in:
                seen_in[name] = (first_input(args, kwargs), next(counter))
        return hook

    def post(name: str):
        def hook(_m, _args, _kwargs, out):
            if name not in seen_out:
                seen_out[name] = (first_output(out), next(counter))
            if name == "":
                raise _StopProbe
        return hook

    for name, m in modules.items():
        handles.append(m.register_forward_pre_hook(pre(name), with_kwargs=True))
        handles.append(m.register_forward_hook(post(name), with_kwargs=True))
    try:
        run_forward()
    except _StopProbe:
        pass
    finally:
        for h in handles:
            h.remove()
    if "" not in seen_out:
        raise ModelError("the probe forward pass never reached the first block")
    return anatomy_from_probe(block, seen_in, seen_out)


class _StopProbe(Exception):
    """Raised once the probed block has returned: nothing after it is needed."""


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return False
    if a is b:
        return True
    try:
        return (a.device.type != "meta" and a.data_ptr() == b.data_ptr() and tuple(a.shape) == tuple(b.shape)
                and a.stride() == b.stride())
    except (AttributeError, RuntimeError):
        return False


def anatomy_from_probe(block: Any, seen_in: dict, seen_out: dict) -> Anatomy:
    children = list(_children(block))
    kids = _children(block)
    norms = [n for n, m in kids.items() if _is_norm(m)]
    attn = _find_attention(block)
    mlp_in_mod, mlp_out_mod = _find_mlp(block)

    def inp(n: str | None) -> Any:
        return seen_in.get(n, (None, 0))[0] if n is not None else None

    def out(n: str | None) -> Any:
        return seen_out.get(n, (None, 0))[0] if n is not None else None

    def norm_where(pred: Callable[[str], bool]) -> str | None:
        hits = [n for n in norms if pred(n)]
        return hits[0] if hits else None

    block_in = inp("")
    ln_attn = norm_where(lambda n: _same(out(n), inp(attn)))
    attn_post_norm = norm_where(lambda n: _same(inp(n), out(attn)))
    ln_mlp = norm_where(lambda n: _same(out(n), inp(mlp_in_mod)))
    mlp_post_norm = norm_where(lambda n: mlp_out_mod == mlp_in_mod and _same(inp(n), out(mlp_out_mod)))
    parallel = attn is not None and mlp_in_mod is not None and (
        _same(inp(mlp_in_mod), inp(attn)) or _same(inp(mlp_in_mod), block_in)
        or (ln_mlp is not None and _same(inp(ln_mlp), block_in)))
    post_norm = (not parallel and ln_attn is None and attn_post_norm is None and attn is not None
                 and _same(inp(attn), block_in))
    sites: dict[str, Site | None] = {"resid_pre": Site("", "input"), "resid_post": Site("", "output")}
    if attn is not None:
        attn_site = Site(attn_post_norm, "output") if attn_post_norm else Site(attn, "output")
        if post_norm:
            # BERT's attention module returns LayerNorm(x + attn): its last projection is what it adds
            inner_norms = [n for n in seen_out if n.startswith(attn + ".") and _is_norm(block.get_submodule(n))]
            if any(_same(out(n), out(attn)) for n in inner_norms):
                linears = sorted((seen_out[n][1], n) for n in seen_out if n.startswith(attn + ".")
                                 and type(block.get_submodule(n)).__name__ in ("Linear", "Conv1D"))
                attn_site = Site(linears[-1][1], "output") if linears else attn_site
        sites["attn_out"] = attn_site
    if mlp_in_mod is not None:
        sites["mlp_in"] = Site(mlp_in_mod, "input")
        sites["mlp_out"] = Site(mlp_post_norm, "output") if mlp_post_norm else Site(mlp_out_mod, "output")
        if parallel:
            sites["resid_mid"] = None
        elif post_norm:
            sites["resid_mid"] = Site(ln_mlp, "output") if ln_mlp else Site(mlp_in_mod, "input")
        else:
            sites["resid_mid"] = Site(ln_mlp, "input") if ln_mlp else Site(mlp_in_mod, "input")
    order: dict[Site, int] = {}
    widths: dict[Site, int] = {}
    for side, seen in (("input", seen_in), ("output", seen_out)):
        for name, (t, k) in seen.items():
            order[Site(name, side)] = k
            shape = getattr(t, "shape", None)
            if shape is not None and len(shape) >= 2:
                widths[Site(name, side)] = int(shape[-1])
    kind = "parallel" if parallel else "post_norm" if post_norm else "pre_norm"
    return Anatomy(kind, sites, order, children, widths)


@dataclass(frozen=True)
class Capture:
    """One hookpoint to read in every requested block: where, and how wide its vectors are."""

    hookpoint: str
    site: Site
    width: int


def plan_captures(hookpoints: list[str], anatomy: Anatomy, block: Any) -> list[Capture]:
    """The captures of ``hookpoints`` in the order a forward pass reaches them (the order nnsight needs)."""
    sites = locate(hookpoints, anatomy, block)
    out = []
    for hp, site in sites.items():
        width = anatomy.widths.get(site)
        if width is None:
            raise ModelError(f"hookpoint {hp!r}: {site} is not a tensor of shape (batch, tokens, width)")
        out.append(Capture(hp, site, width))
    return sorted(out, key=lambda c: anatomy.order.get(c.site, 0))


def locate(hookpoints: list[str], anatomy: Anatomy, block: Any) -> dict[str, Site]:
    """The site of every hookpoint; an unknown module path or an absent named point is a clear error."""
    out = {}
    for hp in hookpoints:
        site = anatomy.site(hp)
        if site.path:
            try:
                block.get_submodule(site.path)
            except AttributeError:
                raise ModelError(f"hookpoint {hp!r}: the blocks have no module {site.path!r}; their modules are "
                                 f"{_module_list(block)}") from None
            if site not in anatomy.order:
                raise ModelError(f"hookpoint {hp!r}: module {site.path!r} is never called in a forward pass")
        out[hp] = site
    return out


def _module_list(block: Any, limit: int = 40) -> str:
    names = [n for n, _ in block.named_modules() if n]
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def skeleton(config: Any, *, trust_remote_code: bool = False) -> Any:
    """A one-block model of ``config``'s architecture on the ``meta`` device: no memory, no weights."""
    import copy

    import torch
    from transformers import AutoModel

    cfg = copy.deepcopy(config)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for attr in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(getattr(text, attr, None), int):
            setattr(text, attr, 1)
    for attr in ("layer_types", "block_types"):  # per-layer lists must match the one block
        v = getattr(text, attr, None)
        if isinstance(v, list) and v:
            setattr(text, attr, v[:1])
    with torch.device("meta"):  # eager attention: sdpa's mask checks read values, which meta tensors lack
        return AutoModel.from_config(cfg, trust_remote_code=trust_remote_code, attn_implementation="eager")


def probe_skeleton(config: Any, *, trust_remote_code: bool = False, block_path: str | None = None) -> tuple[Anatomy, Any]:
    """(anatomy, block 0) of ``config``'s architecture, from a forward pass on the ``meta`` device.

    Runs before the weights load, so an unsupported hookpoint is an error in seconds. Raises
    ModelError when the skeleton cannot run (then the caller probes the loaded model instead).
    """
    import torch

    try:
        model = skeleton(config, trust_remote_code=trust_remote_code)
        block = find_blocks(model, 1, block_path)[0]
    except Exception as exc:  # any architecture lmprobe cannot build on meta: probe the real model later
        raise ModelError(f"cannot build a skeleton of this architecture ({type(exc).__name__}: {exc})") from exc
    ids = torch.zeros((1, 2), dtype=torch.long, device="meta")
    mask = torch.ones((1, 2), dtype=torch.long, device="meta")
    errors = []
    no_cache = {"use_cache": False} if forward_takes(model, "use_cache") else {}
    for kwargs in ({"attention_mask": mask}, {}):  # decoders want a mask on meta; BERT's masking wants none

        def forward(kwargs=kwargs):
            model(input_ids=ids, **no_cache, **kwargs)

        try:
            return probe_block(block, forward), block
        except ModelError:
            raise
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    raise ModelError(f"the skeleton forward pass failed ({'; '.join(errors)})")


def probe_loaded(model: Any, block: Any, device: Any) -> Anatomy:
    """The anatomy of a loaded model's block, from a two-token forward pass that stops after it."""
    import torch

    ids = torch.zeros((1, 2), dtype=torch.long, device=device)
    mask = torch.ones((1, 2), dtype=torch.long, device=device)

    def forward():
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=mask)

    return probe_block(block, forward)

