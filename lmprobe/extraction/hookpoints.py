"""Hookpoints: where in a block an activation is read.

Named hookpoints (``NAMED``, in the order a block computes them):

- ``resid_pre``: the input of block i (the residual stream before it);
- ``attn_out``: what the attention sublayer adds to the stream (``resid_mid - resid_pre``);
- ``resid_mid``: the stream between the two sublayers (pre-norm blocks: the input of the norm
  before the MLP; post-norm blocks: the normalised stream the MLP reads). Parallel blocks
  (GPT-J, GPT-NeoX with ``use_parallel_residual``, Phi, Falcon) have none;
- ``mlp_in``: the input of the MLP module (after its normalisation);
- ``mlp_out``: what the MLP sublayer adds to the stream (``resid_post - resid_mid``);
- ``resid_post``: the output of block i.

Anything else is a module path relative to the block with ``:input`` or ``:output``
(``mlp.act_fn:output``). An input is the module's first positional argument, else its
``hidden_states`` keyword, else its first keyword; an output is the first element of a tuple.

Where each named hookpoint is in a model's blocks, and whether it exists there at all, is found
and checked by ``examine`` (examine.py, anatomy.py): a ``Reading`` per block, which is one
site's tensor or the difference of two.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ModelError
from ..format.spec import HOOKPOINTS as NAMED
from ..format.spec import check_hookpoint

__all__ = ["NAMED", "Capture", "Reading", "Site", "first_input", "first_output", "parse_hookpoints"]


@dataclass(frozen=True)
class Site:
    """A module of the block (``""``: the block itself) and which side of it is read."""

    path: str
    kind: str  # "input" or "output"

    def __str__(self) -> str:
        return f"{self.path or '<block>'}:{self.kind}"


@dataclass(frozen=True)
class Reading:
    """How a hookpoint is read in one block: one site's tensor, or ``site - minus`` (computed in float32)."""

    site: Site
    minus: Site | None = None

    @property
    def sites(self) -> tuple[Site, ...]:
        return (self.site,) if self.minus is None else (self.minus, self.site)

    def __str__(self) -> str:
        return str(self.site) if self.minus is None else f"{self.site} - {self.minus}"


@dataclass
class Capture:
    """One hookpoint to read in every requested block: how on each layer, and how wide its vectors are."""

    hookpoint: str
    readings: dict[int, Reading]  # layer -> reading
    width: int
    order: dict[int, dict[Site, int]] = field(default_factory=dict)  # layer -> when each site is reached


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


def assemble_readings(captures: Sequence[Capture], layers: Sequence[int], kept: dict, out_dtype: Any) -> dict:
    """Each (hookpoint, layer)'s vectors from the tensors a backend kept: ``kept[(layer, site, "out")]`` for a
    site read as it is, ``kept[(layer, site, "f32")]`` for the sides of a difference (taken in float32, then cast
    to ``out_dtype``)."""
    out: dict[tuple[str, int], Any] = {}
    for c in captures:
        for layer in layers:
            reading = c.readings[layer]
            if reading.minus is None:
                out[(c.hookpoint, layer)] = kept[(layer, reading.site, "out")]
            else:
                diff = kept[(layer, reading.site, "f32")] - kept[(layer, reading.minus, "f32")]
                out[(c.hookpoint, layer)] = diff.to(out_dtype)
    return out


def first_input(args: tuple, kwargs: dict) -> Any:
    if args:
        return args[0]
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]
    return next(iter(kwargs.values()), None)


def first_output(out: Any) -> Any:
    return out[0] if isinstance(out, (tuple, list)) else out
