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
    """The readings of every named hookpoint of ``block``, checked on ``rec`` (see the module docstring).

    The steps: find the block's parts (norms, token mixer, MLP) and how they were called; a block without an MLP
    reads its mixer's contribution only; else the MLP's input is read, and a parallel block reads its two branches,
    a sequential one the stream between them (or, when that fails, the post-norm reading that explains more)."""
    parts = _Parts(block, rec, tol)
    anatomy = BlockAnatomy(parts.kind, {"resid_pre": Reading(parts.pre), "resid_post": Reading(parts.post)}, {},
                           parts.children, parts.mixer, parts.attention, parts.mlp_in)
    if not parts.attention:
        anatomy.refusals["attn_out"] = parts.no_attention()
    if parts.mlp_in is None:
        return parts.read_mixer_only(anatomy)
    parts.read_mlp_in(anatomy)
    if parts.parallel:
        anatomy.refusals["resid_mid"] = ("its attention and MLP read the same input in parallel, so there is no "
                                         "stream between them")
        _parallel_branches(anatomy, parts.x, parts.y, parts.mixer_sites(), parts.mlp_sites(), tol, parts.attention)
        return anatomy
    return parts.read_sequential(anatomy)


class _Parts:
    """A block's parts as one forward pass showed them: its norms, token mixer and MLP, what each read and
    returned, and how a sublayer's contribution to the stream is read."""

    def __init__(self, block: Any, rec: BlockRecord, tol: float):
        self.block, self.rec, self.tol = block, rec, tol
        self.kids = _children(block)
        self.norms = [n for n, m in self.kids.items() if is_norm(m)]
        mixer, self.attention = _find_mixer(block)
        mlp_in, mlp_out = _find_mlp(block, mixer)
        self.x, self.y = self.inp(""), self.out("")
        self.pre, self.post = Site("", "input"), Site("", "output")
        self.children = list(self.kids)
        self.mixer = mixer if mixer is not None and mixer in rec.outputs else None  # a mixer never called is none
        if mlp_in is not None and (mlp_in not in rec.inputs or mlp_out not in rec.outputs):
            mlp_in = mlp_out = None
        self.mlp_in, self.mlp_out = mlp_in, mlp_out
        self.ln_mix = self.norm_where(lambda n: self.same(self.out(n), self.inp(self.mixer)))
        self.mix_post_norm = self.norm_where(lambda n: self.same(self.inp(n), self.out(self.mixer)))
        # the pre-MLP norm may sit inside another child (DBRX keeps it in norm_attn_norm): any norm of the block
        deep_norms = [n for n in rec.outputs if n and n in rec.inputs and is_norm(block.get_submodule(n))
                      and not (mlp_in and n.startswith(mlp_in + "."))]
        self.ln_mlp = self.norm_where(lambda n: self.same(self.out(n), self.inp(mlp_in))) or next(
            (n for n in deep_norms if self.same(self.out(n), self.inp(mlp_in))), None)
        self.mlp_post_norm = self.norm_where(lambda n: mlp_out == mlp_in and self.same(self.inp(n), self.out(mlp_out)))
        x = self.x
        self.parallel = self.mixer is not None and mlp_in is not None and (
            self.same(self.inp(mlp_in), self.inp(self.mixer)) or self.same(self.inp(mlp_in), x)
            or (self.ln_mlp is not None and self.same(self.inp(self.ln_mlp), x)))
        self.post_norm = (not self.parallel and self.mixer is not None and self.ln_mix is None
                          and self.mix_post_norm is None and self.same(self.inp(self.mixer), x))
        self.kind = "parallel" if self.parallel else "pre_norm" if mlp_in is not None else "mixer_only"

    def inp(self, n: str | None) -> Any:
        return self.rec.inputs.get(n) if n is not None else None

    def out(self, n: str | None) -> Any:
        return self.rec.outputs.get(n) if n is not None else None

    def same(self, a: Any, b: Any) -> bool:
        return a is not None and b is not None and (a is b or close(a, b, self.tol))

    def norm_where(self, pred: Callable[[str], bool]) -> str | None:
        hits = [n for n in self.norms if pred(n)]
        return hits[0] if hits else None

    def after(self, module: str | None) -> str | None:
        """A module the sublayer's output goes through before its add (Inkling's short convolutions), norms
        aside."""
        hits = [n for n, m in self.kids.items() if n not in (self.mixer, self.mlp_in, self.mlp_out) and not is_norm(m)
                and not _inert(m) and n in self.rec.inputs and self.same(self.inp(n), self.out(module))]
        return hits[0] if module is not None and hits else None

    def no_attention(self) -> str:
        name = type(self.block).__name__
        return (f"block {name} has no attention (its token mixer is {self.mixer!r}: read it with "
                f"'{self.mixer}:output')" if self.mixer else
                f"block {name} has no attention (children: {', '.join(self.children)})")

    def inner(self, module: str | None) -> list[tuple[Site, Any]]:
        """Outputs of the modules inside ``module``, the last computed first (BLOOM's ``dense`` before the
        residual add inside its attention)."""
        if module is None:
            return []
        rec = self.rec
        found = sorted(((rec.order.get(Site(n, "output"), 0), n) for n in rec.outputs
                        if n.startswith(module + ".") and not _inert(self.block.get_submodule(n))), reverse=True)
        return [(Site(n, "output"), rec.outputs[n]) for _, n in found]

    def ends_in_norm(self, module: str | None) -> bool:
        """Whether the module's output is what a norm inside it returned (post-norm: BERT's attention)."""
        value = self.out(module)
        return any(close(v, value, self.tol) for site, v in self.inner(module)
                   if is_norm(self.block.get_submodule(site.path)))

    def mixer_sites(self) -> list[tuple[Site, Any]]:
        sites = []
        if self.after(self.mixer):
            sites.append((Site(self.after(self.mixer), "output"), self.out(self.after(self.mixer))))
        if self.mix_post_norm:
            sites.append((Site(self.mix_post_norm, "output"), self.out(self.mix_post_norm)))
        if self.mixer:
            sites.append((Site(self.mixer, "output"), self.out(self.mixer)))
        return sites

    def mlp_sites(self) -> list[tuple[Site, Any]]:
        sites = []
        if self.mlp_out == self.mlp_in and self.after(self.mlp_out):
            sites.append((Site(self.after(self.mlp_out), "output"), self.out(self.after(self.mlp_out))))
        if self.mlp_post_norm:
            sites.append((Site(self.mlp_post_norm, "output"), self.out(self.mlp_post_norm)))
        if self.mlp_out:
            sites.append((Site(self.mlp_out, "output"), self.out(self.mlp_out)))
        return sites

    def contribution(self, before: Any, after: Any, candidates: list[tuple[Site, Any]], module: str | None,
                     site_after: Site, site_before: Site) -> Reading | None:
        """How to read what a sublayer (``module``) adds between two stream tensors, or None when it adds no such
        thing: a module whose output is exactly that, else the stream's difference when the sublayer's output is
        scaled, offset by a bias, or has the residual added inside the module (never when a norm ends it)."""
        tol = self.tol
        if before is None or after is None or not hasattr(after, "shape") or not hasattr(before, "shape") \
                or tuple(after.shape) != tuple(before.shape):
            return None  # not two states of one stream
        delta = after.detach().double() - before.detach().to(after.device).double()
        for site, value in [*candidates, *self.inner(module)]:
            if value is not None and close(value, delta, tol):
                return Reading(site)
        for _site, value in candidates:
            if value is None:
                continue
            inside = close(value, after, tol) and not self.ends_in_norm(module)
            if inside or _scaled(delta, value, tol) or _offset(delta, value, tol):
                # a multiplier (Granite), a bias the block adds (GPT-NeoX-Japanese), or a residual inside
                return Reading(site_after, minus=site_before)
        return None

    def read_mixer_only(self, anatomy: BlockAnatomy) -> BlockAnatomy:
        """A block without an MLP: its attention's contribution, if it has attention."""
        no_mlp = f"block {type(self.block).__name__} has no MLP (children: {', '.join(self.children)})"
        for hp in ("resid_mid", "mlp_in", "mlp_out"):
            anatomy.refusals[hp] = no_mlp
        if self.attention:
            r = self.contribution(self.x, self.y, self.mixer_sites(), self.mixer, self.post, self.pre)
            if r is None:
                anatomy.refusals["attn_out"] = (f"block {type(self.block).__name__} does not add its attention's "
                                                f"output to the stream; read the module with '{self.mixer}:output'")
            else:
                anatomy.readings["attn_out"] = r
        return anatomy

    def read_mlp_in(self, anatomy: BlockAnatomy) -> None:
        """mlp_in is "after its normalisation": a norm at the start of the MLP module (RoBERTa-PreLayerNorm's
        intermediate), else the MLP's input."""
        mlp_in, rec = self.mlp_in, self.rec
        inner_norm = next((n for n in rec.outputs if mlp_in and n.startswith(mlp_in + ".") and n in rec.inputs
                           and is_norm(self.block.get_submodule(n)) and self.same(self.inp(n), self.inp(mlp_in))),
                          None)
        anatomy.readings["mlp_in"] = Reading(Site(inner_norm, "output") if inner_norm else Site(mlp_in, "input"))

    def read_sequential(self, anatomy: BlockAnatomy) -> BlockAnatomy:
        """A block whose attention and MLP come one after the other: the stream between them (resid_mid) and each
        sublayer's contribution; a post-norm reading instead where that explains more of the block."""
        mixer, mlp_in, mlp_out = self.mixer, self.mlp_in, self.mlp_out
        readings, refusals, name = anatomy.readings, anatomy.refusals, type(self.block).__name__
        mid_site = Site(self.ln_mlp, "input") if self.ln_mlp else Site(mlp_in, "input")
        mid = self.inp(mid_site.path)
        mixed = self.contribution(self.x, mid, self.mixer_sites(), mixer, mid_site, self.pre) if mixer else None
        mlp_read = self.contribution(mid, self.y, self.mlp_sites(), mlp_out if mlp_out == mlp_in else None, self.post,
                                     mid_site)
        if self.post_norm and (mixed is None or mlp_read is None):
            # the attention reads the block's input: the norms may come after the adds (BERT, BART's encoder), where
            # the stream is the normalised sum. Whichever reading explains more of the block is the block's.
            alt = BlockAnatomy("post_norm", dict(readings), dict(refusals), self.children, mixer, self.attention,
                               mlp_in)
            _post_norm(alt, self.block, self.rec, mixer, mlp_in, mlp_out, self.ln_mlp, self.tol)
            if len(alt.readings) > len(readings) + (mixed is not None) + (mlp_read is not None) + (mixed is not None):
                return alt
        anatomy.kind = "pre_norm"
        if mixer is None or mixed is None:
            what = f"its token mixer {mixer!r}" if mixer else "no token mixer"
            why = (f"block {name}'s stream before its MLP is not its input plus the output of {what}; "
                   f"read a module with PATH:input or PATH:output instead (children: {', '.join(self.children)})")
            refusals["resid_mid"] = why
            if self.attention:
                refusals["attn_out"] = why
        else:
            readings["resid_mid"] = Reading(mid_site)
            if self.attention:
                readings["attn_out"] = mixed
        if mlp_read is None:
            refusals["mlp_out"] = (f"block {name} adds more than its MLP's output to the stream after the MLP "
                                   f"(resid_post - resid_mid is not {mlp_out!r}'s output); read the MLP with "
                                   f"'{mlp_out}:output'")
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
