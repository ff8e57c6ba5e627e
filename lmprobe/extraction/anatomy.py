"""Where each named hookpoint is in one block, found and checked on the values of a forward pass.

The input is what every module of the block received and returned in one forward pass (a
``BlockRecord``). The block's attention (or other token mixer) and MLP children are picked by
class and child name; the norms are placed by following the values (the norm whose output is the
MLP's input is the pre-MLP norm, and so on). Then every named hookpoint is checked against the
identities docs/hookpoints.md states:

- ``resid_mid = resid_pre + attn_out`` and ``resid_post = resid_mid + mlp_out`` (pre-norm blocks);
- ``resid_post = resid_pre + attn_out + mlp_out`` (parallel blocks, which have no ``resid_mid``);
- post-norm blocks (BERT): the norm after each sublayer reads the stream plus the sublayer's output.

A sublayer whose module output is exactly what the block adds to the stream is read there with a
hook. When the block scales it (Granite's ``residual_multiplier``, MiniCPM's depth scale) or the
module adds the residual itself (BLOOM, MPT), the hookpoint is read as the difference of two stream
sites (``resid_mid - resid_pre``), which the same forward pass shows is the sublayer's output.
Anything else (a stream that is not a sum, a branch the block adds besides the sublayer) leaves
the hookpoint refused, with the reason, rather than stored with a meaning it does not have.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .hookpoints import Reading, Site

__all__ = ["BlockAnatomy", "BlockRecord", "block_anatomy", "close", "is_norm"]

_NORM = re.compile(r"norm", re.I)
_ATTN = re.compile(r"attn|attention", re.I)
_MLP_CLASS = re.compile(r"mlp|feedforward|feed_forward|ffn|moe|experts?$|sparse", re.I)
_MLP_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "moe", "mlp_block", "feedforward")
_ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention", "linear_attn")
_INERT = ("Dropout", "Identity", "GELU", "ReLU", "SiLU", "Tanh", "Sigmoid", "GELUActivation", "NewGELUActivation",
          "FastGELUActivation", "SiLUActivation", "ACT2FN")


@dataclass
class BlockRecord:
    """What every module of one block received and returned in one forward pass (first call of each).

    Paths are relative to the block (``""`` is the block itself); tensors are the first positional
    input (else the ``hidden_states`` keyword) and the first output.
    """

    inputs: dict[str, Any]
    outputs: dict[str, Any]
    order: dict[Site, int] = field(default_factory=dict)  # when each site was reached


@dataclass
class BlockAnatomy:
    """The named hookpoints of one block: how each is read, or why it is refused."""

    kind: str  # "pre_norm", "post_norm", "parallel" or "mixer_only"
    readings: dict[str, Reading]
    refusals: dict[str, str]
    children: list[str]
    mixer: str | None = None  # the attention (or other token mixer) child
    attention: bool = False  # whether the mixer is attention
    mlp: str | None = None
    order: dict[Site, int] = field(default_factory=dict)  # when each site is reached in a forward pass
    modules: list[str] = field(default_factory=list)  # every module path inside the block

    def describe(self) -> str:
        """The block's shape in a few words, for messages and the architecture table."""
        mixer = (f"attention {self.mixer!r}" if self.attention else f"mixer {self.mixer!r}") if self.mixer else "no mixer"
        mlp = f"MLP {self.mlp!r}" if self.mlp else "no MLP"
        return f"{self.kind.replace('_', '-')} block ({mixer}, {mlp})"


def is_norm(module: Any) -> bool:
    """A normalisation: a LayerNorm, or a module named like one that holds no module with weights of its own
    (DBRX's NormAttentionNorm and RoBERTa-PreLayerNorm's attention are blocks that contain norms, not norms)."""
    import torch

    if isinstance(module, (torch.nn.LayerNorm, torch.nn.GroupNorm)):
        return True
    name = type(module).__name__
    if not _NORM.search(name) or _ATTN.search(name):
        return False
    return not any(any(True for _ in child.parameters()) for child in module.children())


def _inert(module: Any) -> bool:
    import torch

    return type(module).__name__ in _INERT or isinstance(module, (torch.nn.Dropout, torch.nn.Identity))


def _flat(t: Any) -> Any:
    return t.detach().reshape(-1).double()


def close(a: Any, b: Any, tol: float) -> bool:
    """Whether two tensors hold the same values up to ``tol`` relative to their size (same element count)."""
    if a is None or b is None or not hasattr(a, "shape") or not hasattr(b, "shape"):
        return False
    if a.numel() != b.numel() or a.numel() == 0 or not a.is_floating_point() or not b.is_floating_point():
        return False
    if a.device.type == "meta" or b.device.type == "meta":
        return a is b
    x, y = _flat(a), _flat(b.to(a.device))
    scale = float(x.norm() + y.norm())
    return float((x - y).norm()) <= tol * scale + 1e-30


def _scaled(d: Any, o: Any, tol: float) -> bool:
    """Whether ``d`` is ``c * o`` for one number ``c`` (a residual multiplier), ``o`` not zero."""
    if d is None or o is None or not hasattr(o, "shape") or d.numel() != o.numel() or o.numel() == 0:
        return False
    if not d.is_floating_point() or not o.is_floating_point() or d.device.type == "meta":
        return False
    x, y = _flat(d), _flat(o.to(d.device))
    oo = float(y @ y)
    if oo == 0.0:
        return False
    c = float(x @ y) / oo
    return c != 0.0 and float((x - c * y).norm()) <= tol * float(x.norm())


def _offset(d: Any, o: Any, tol: float) -> bool:
    """Whether ``d`` is ``o`` plus one vector added at every token (a bias the block adds after the module)."""
    if d is None or o is None or not hasattr(o, "shape") or d.shape != o.shape or d.dim() < 2 or d.shape[-2] < 2:
        return False
    if not o.is_floating_point() or d.device.type == "meta":
        return False
    diff = d.detach().double() - o.detach().to(d.device).double()
    rows = diff.reshape(-1, diff.shape[-1])
    return close(rows, rows[:1].expand_as(rows), tol) and float(rows[0].norm()) > 0


def _children(block: Any) -> dict[str, Any]:
    return dict(block.named_children())


def _find_mixer(block: Any) -> tuple[str | None, bool]:
    """(the child that mixes tokens, whether it is attention). Cross-attention is never the mixer."""
    kids = {n: m for n, m in _children(block).items() if not is_norm(m) and not _inert(m)}

    def attention_like(n: str, m: Any) -> bool:
        cls = type(m).__name__
        return "cross" not in n.lower() and "Cross" not in cls and bool(_ATTN.search(cls) or _ATTN.search(n))

    found = [n for n, m in kids.items() if attention_like(n, m)]
    if len(found) > 1:
        named = [n for n in _ATTN_NAMES if n in found]
        found = named[:1] or found[:1]
    if found:
        return found[0], True
    others = [n for n, m in kids.items() if n not in _MLP_NAMES and not _MLP_CLASS.search(type(m).__name__)
              and any(True for _ in m.parameters())]
    return (others[0], False) if len(others) == 1 else (None, False)


def _find_mlp(block: Any, mixer: str | None) -> tuple[str | None, str | None]:
    """(MLP input module, MLP output module): one container, BERT's intermediate/output, or OPT's fc1/fc2."""
    import torch

    kids = {n: m for n, m in _children(block).items() if not is_norm(m) and not _inert(m) and n != mixer}
    named = [n for n in _MLP_NAMES if n in kids]
    if named:
        return named[0], named[0]
    found = [n for n, m in kids.items() if _MLP_CLASS.search(type(m).__name__) and not _ATTN.search(type(m).__name__)]
    if len(found) == 1:
        return found[0], found[0]
    if "intermediate" in kids and "output" in kids and hasattr(kids["output"], "dense"):
        return "intermediate", "output.dense"
    linears = [n for n, m in kids.items() if isinstance(m, torch.nn.Linear)]
    if len(linears) >= 2:
        return linears[0], linears[-1]
    return None, None


def block_anatomy(block: Any, rec: BlockRecord, *, tol: float) -> BlockAnatomy:
    """The readings of every named hookpoint of ``block``, checked on ``rec`` (see the module docstring)."""
    kids = _children(block)
    norms = [n for n, m in kids.items() if is_norm(m)]
    mixer, attention = _find_mixer(block)
    mlp_in_mod, mlp_out_mod = _find_mlp(block, mixer)

    def inp(n: str | None) -> Any:
        return rec.inputs.get(n) if n is not None else None

    def out(n: str | None) -> Any:
        return rec.outputs.get(n) if n is not None else None

    def same(a: Any, b: Any) -> bool:
        return a is not None and b is not None and (a is b or close(a, b, tol))

    def norm_where(pred: Callable[[str], bool]) -> str | None:
        hits = [n for n in norms if pred(n)]
        return hits[0] if hits else None

    x, y = inp(""), out("")
    pre, post = Site("", "input"), Site("", "output")
    readings: dict[str, Reading] = {"resid_pre": Reading(pre), "resid_post": Reading(post)}
    refusals: dict[str, str] = {}
    children = list(kids)
    called = mixer is not None and mixer in rec.outputs
    if mixer is not None and not called:
        mixer = None
    if mlp_in_mod is not None and (mlp_in_mod not in rec.inputs or mlp_out_mod not in rec.outputs):
        mlp_in_mod = mlp_out_mod = None
    ln_mix = norm_where(lambda n: same(out(n), inp(mixer)))
    mix_post_norm = norm_where(lambda n: same(inp(n), out(mixer)))
    # a module the sublayer's output goes through before its add (Inkling's short convolutions), norms aside
    def after(module: str | None) -> str | None:
        hits = [n for n, m in kids.items() if n not in (mixer, mlp_in_mod, mlp_out_mod) and not is_norm(m)
                and not _inert(m) and n in rec.inputs and same(inp(n), out(module))]
        return hits[0] if module is not None and hits else None

    # the pre-MLP norm may sit inside another child (DBRX keeps it in norm_attn_norm): any norm of the block
    deep_norms = [n for n in rec.outputs if n and n in rec.inputs and is_norm(block.get_submodule(n))
                  and not (mlp_in_mod and n.startswith(mlp_in_mod + "."))]
    ln_mlp = norm_where(lambda n: same(out(n), inp(mlp_in_mod))) or next(
        (n for n in deep_norms if same(out(n), inp(mlp_in_mod))), None)
    mlp_post_norm = norm_where(lambda n: mlp_out_mod == mlp_in_mod and same(inp(n), out(mlp_out_mod)))
    parallel = mixer is not None and mlp_in_mod is not None and (
        same(inp(mlp_in_mod), inp(mixer)) or same(inp(mlp_in_mod), x) or (ln_mlp is not None and same(inp(ln_mlp), x)))
    post_norm = (not parallel and mixer is not None and ln_mix is None and mix_post_norm is None
                 and same(inp(mixer), x))
    kind = "parallel" if parallel else "pre_norm" if mlp_in_mod is not None else "mixer_only"
    anatomy = BlockAnatomy(kind, readings, refusals, children, mixer, attention, mlp_in_mod)

    no_attention = (f"block {type(block).__name__} has no attention (its token mixer is "
                    f"{mixer!r}: read it with '{mixer}:output')" if mixer else
                    f"block {type(block).__name__} has no attention (children: {', '.join(children)})")
    no_mlp = f"block {type(block).__name__} has no MLP (children: {', '.join(children)})"

    def inner(module: str | None) -> list[tuple[Site, Any]]:
        """Outputs of the modules inside ``module``, the last computed first (BLOOM's ``dense`` before the
        residual add inside its attention)."""
        if module is None:
            return []
        found = sorted(((rec.order.get(Site(n, "output"), 0), n) for n in rec.outputs
                        if n.startswith(module + ".") and not _inert(block.get_submodule(n))), reverse=True)
        return [(Site(n, "output"), rec.outputs[n]) for _, n in found]

    def ends_in_norm(module: str | None) -> bool:
        """Whether the module's output is what a norm inside it returned (post-norm: BERT's attention)."""
        value = out(module)
        return any(close(v, value, tol) for site, v in inner(module) if is_norm(block.get_submodule(site.path)))

    def mixer_site() -> list[tuple[Site, Any]]:
        sites = []
        if after(mixer):
            sites.append((Site(after(mixer), "output"), out(after(mixer))))
        if mix_post_norm:
            sites.append((Site(mix_post_norm, "output"), out(mix_post_norm)))
        if mixer:
            sites.append((Site(mixer, "output"), out(mixer)))
        return sites

    def mlp_sites() -> list[tuple[Site, Any]]:
        sites = []
        if mlp_out_mod == mlp_in_mod and after(mlp_out_mod):
            sites.append((Site(after(mlp_out_mod), "output"), out(after(mlp_out_mod))))
        if mlp_post_norm:
            sites.append((Site(mlp_post_norm, "output"), out(mlp_post_norm)))
        if mlp_out_mod:
            sites.append((Site(mlp_out_mod, "output"), out(mlp_out_mod)))
        return sites

    def contribution(before: Any, after: Any, candidates: list[tuple[Site, Any]], module: str | None,
                     site_after: Site, site_before: Site) -> Reading | None:
        """How to read what a sublayer (``module``) adds between two stream tensors, or None when it adds no such
        thing: a module whose output is exactly that, else the stream's difference when the sublayer's output is
        scaled, offset by a bias, or has the residual added inside the module (never when a norm ends it)."""
        if before is None or after is None or not hasattr(after, "shape") or not hasattr(before, "shape") \
                or tuple(after.shape) != tuple(before.shape):
            return None  # not two states of one stream
        delta = after.detach().double() - before.detach().to(after.device).double()
        for site, value in [*candidates, *inner(module)]:
            if value is not None and close(value, delta, tol):
                return Reading(site)
        for _site, value in candidates:
            if value is None:
                continue
            inside = close(value, after, tol) and not ends_in_norm(module)
            if inside or _scaled(delta, value, tol) or _offset(delta, value, tol):
                # a multiplier (Granite), a bias the block adds (GPT-NeoX-Japanese), or a residual inside
                return Reading(site_after, minus=site_before)
        return None

    if not attention:
        refusals["attn_out"] = no_attention
    if mlp_in_mod is None:
        for hp in ("resid_mid", "mlp_in", "mlp_out"):
            refusals[hp] = no_mlp
        if attention:
            r = contribution(x, y, mixer_site(), mixer, post, pre)
            if r is None:
                refusals["attn_out"] = (f"block {type(block).__name__} does not add its attention's output to the "
                                        f"stream; read the module with '{mixer}:output'")
            else:
                readings["attn_out"] = r
        return anatomy

    # "after its normalisation": a norm at the start of the MLP module (RoBERTa-PreLayerNorm's intermediate)
    inner_norm = next((n for n in rec.outputs if mlp_in_mod and n.startswith(mlp_in_mod + ".") and n in rec.inputs
                       and is_norm(block.get_submodule(n)) and same(inp(n), inp(mlp_in_mod))), None)
    readings["mlp_in"] = Reading(Site(inner_norm, "output") if inner_norm else Site(mlp_in_mod, "input"))
    if parallel:
        refusals["resid_mid"] = ("its attention and MLP read the same input in parallel, so there is no stream "
                                 "between them")
        _parallel_branches(anatomy, x, y, mixer_site(), mlp_sites(), tol, attention)
        return anatomy

    mid_site = Site(ln_mlp, "input") if ln_mlp else Site(mlp_in_mod, "input")
    mid = inp(mid_site.path)
    mixed = contribution(x, mid, mixer_site(), mixer, mid_site, pre) if mixer else None
    mlp_read = contribution(mid, y, mlp_sites(), mlp_out_mod if mlp_out_mod == mlp_in_mod else None, post, mid_site)
    if post_norm and (mixed is None or mlp_read is None):
        # the attention reads the block's input: the norms may come after the adds (BERT, BART's encoder), where
        # the stream is the normalised sum. Whichever reading explains more of the block is the block's.
        alt = BlockAnatomy("post_norm", dict(readings), dict(refusals), children, mixer, attention, mlp_in_mod)
        _post_norm(alt, block, rec, mixer, mlp_in_mod, mlp_out_mod, ln_mlp, tol)
        if len(alt.readings) > len(readings) + (mixed is not None) + (mlp_read is not None) + (mixed is not None):
            return alt
    anatomy.kind = "pre_norm"
    if mixer is None or mixed is None:
        what = f"its token mixer {mixer!r}" if mixer else "no token mixer"
        why = (f"block {type(block).__name__}'s stream before its MLP is not its input plus the output of {what}; "
               f"read a module with PATH:input or PATH:output instead (children: {', '.join(children)})")
        refusals["resid_mid"] = why
        if attention:
            refusals["attn_out"] = why
    else:
        readings["resid_mid"] = Reading(mid_site)
        if attention:
            readings["attn_out"] = mixed
    if mlp_read is None:
        refusals["mlp_out"] = (f"block {type(block).__name__} adds more than its MLP's output to the stream after "
                               f"the MLP (resid_post - resid_mid is not {mlp_out_mod!r}'s output); read the MLP with "
                               f"'{mlp_out_mod}:output'")
    else:
        readings["mlp_out"] = mlp_read
    return anatomy


def _parallel_branches(anatomy: BlockAnatomy, x: Any, y: Any, mixers: list, mlps: list, tol: float,
                       attention: bool) -> None:
    """Parallel blocks: attn_out and mlp_out are the two branches when their sum is what the block adds."""
    if x is None or y is None or tuple(getattr(x, "shape", ())) != tuple(getattr(y, "shape", (None,))):
        return
    delta = y.detach().double() - x.detach().to(y.device).double()
    for a_site, a in mixers:
        for m_site, m in mlps:
            if a is None or m is None:
                continue
            if close(a.detach().double() + m.detach().to(a.device).double(), delta, tol):
                if attention:
                    anatomy.readings["attn_out"] = Reading(a_site)
                anatomy.readings["mlp_out"] = Reading(m_site)
                return
    why = "the block's output is not its input plus its attention's and its MLP's outputs"
    if attention:
        anatomy.refusals["attn_out"] = why
    anatomy.refusals["mlp_out"] = why


def _post_norm(anatomy: BlockAnatomy, block: Any, rec: BlockRecord, mixer: str, mlp_in_mod: str, mlp_out_mod: str,
               ln_mlp: str | None, tol: float) -> None:
    """Post-norm blocks (BERT): each sublayer's output is added to the stream and the sum normalised.

    attn_out is the sublayer's last projection when a norm inside or after it reads ``stream + that``;
    resid_mid is the normalised stream the MLP part reads.
    """
    x = rec.inputs.get("")
    mid_site = Site(ln_mlp, "output") if ln_mlp else Site(mlp_in_mod, "input")
    mid = rec.inputs.get(mid_site.path) if mid_site.kind == "input" else rec.outputs.get(mid_site.path)
    norms = [n for n in rec.inputs if n and n in rec.outputs and is_norm(block.get_submodule(n))]

    def adds(base: Any, prefix: str, last: str | None, then: Any) -> Site | None:
        """The site inside ``prefix`` (its last linear output, or the module output) whose sum with ``base`` a norm
        reads, that norm's output being ``then`` (the stream the next sublayer reads, or the block's output)."""
        if base is None or then is None:
            return None
        cands = [Site(last, "output")] if last else []  # the module itself first: a hook on what users name
        linears = sorted((rec.order.get(Site(n, "output"), 0), n) for n in rec.outputs
                         if n.startswith(prefix + ".") and type(block.get_submodule(n)).__name__ in ("Linear", "Conv1D"))
        if linears:
            cands.append(Site(linears[-1][1], "output"))
        for site in cands:
            value = rec.outputs.get(site.path)
            if value is None or value.numel() != base.numel():
                continue
            total = base.detach().double().reshape(-1) + value.detach().to(base.device).double().reshape(-1)
            if any(close(rec.inputs[n], total, tol) and close(rec.outputs[n], then, tol) for n in norms):
                return site
        return None

    a_site = adds(x, mixer, mixer, mid)
    if a_site is None:
        why = (f"block {type(block).__name__}'s normalised stream before its MLP is not its input plus its attention's "
               "output (a cross-attention between them, or a stream that is not a sum)")
        anatomy.refusals["resid_mid"] = why
        if anatomy.attention:
            anatomy.refusals["attn_out"] = why
    else:
        if anatomy.attention:
            anatomy.readings["attn_out"] = Reading(a_site)
        anatomy.readings["resid_mid"] = Reading(mid_site)
    prefix = mlp_out_mod.rsplit(".", 1)[0] if "." in mlp_out_mod else mlp_out_mod
    m_site = adds(mid, prefix, mlp_out_mod, rec.outputs.get(""))
    if m_site is None:
        anatomy.refusals["mlp_out"] = (f"block {type(block).__name__}'s output is not the normalised sum of its "
                                       f"stream and its MLP's output; read '{mlp_out_mod}:output' instead")
    else:
        anatomy.readings["mlp_out"] = Reading(m_site)
