"""The causal check: add a probe's direction to the model's stream (or remove its component) and measure what
changes: the log-probability of chosen next tokens, and the probe's own score at a later layer.

>>> import lmprobe.probe as probe
>>> p = probe.train_probe("out/tiny", layer=2, method="mass_mean")                         # doctest: +SKIP
>>> probe.steer("lmprobe-tiny", p, ["The film was"], alphas=[-8, 0, 8], targets=[" great", " awful"])  # doctest: +SKIP

The model loads as ``extract`` loads it (``extraction.model.load_model``), its blocks and hookpoints
are found by the same ``examine`` (any architecture ``lmprobe hookpoints`` accepts), and the
hookpoint is steered where ``extract`` reads it: a forward hook on the output of the module (or
the block) it is read from, a pre-hook on an input. The direction is added at every position.
Prompts run one at a time (no padding), so a prompt's last token is the last position: cost is
(len(alphas) + 1) forward passes per prompt.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import ProbeError
from ..extraction.examine import forward_kwargs
from ..extraction.hookpoints import Reading, Site, first_input, first_output
from ..extraction.model import get_module, load_model, load_tokenizer, pick_device, read_model_spec
from ..extraction.placement import Placement
from ..extraction.preparation import examine_model
from ..extraction.prompts import read_prompts
from .linear import LinearProbe


def _probe(probe: LinearProbe | str | os.PathLike) -> LinearProbe:
    p = probe if isinstance(probe, LinearProbe) else LinearProbe.load(probe)
    if not isinstance(p.layer, int):
        raise ProbeError(f"this probe reads layers {p.layer} concatenated; steering needs a probe of one layer")
    if p.coef.shape[0] != 1:
        raise ProbeError(f"a probe of {p.coef.shape[0]} classes has no single direction to steer along")
    return p


def _read_layer(p: LinearProbe, layer: int, num_layers: int) -> int:
    """The next layer after ``layer`` that the probe's dataset stored; else the next block; else ``layer``."""
    later = [x for x in p.settings.get("stored_layers", []) if isinstance(x, int) and layer < x < num_layers]
    if later:
        return min(later)
    return layer + 1 if layer + 1 < num_layers else layer


def _site_module(block: Any, site: Site) -> Any:
    return get_module(block, site.path) if site.path else block


def steer(model: str, probe: LinearProbe | str | os.PathLike, prompts: Any, *, alphas: Sequence[float] = (-4, 0, 4),
          layer: int | None = None, hookpoint: str | None = None, ablate: bool = False,
          targets: Sequence[str] = (), read_layer: int | None = None, text_column: str = "text",
          device: str = "auto", compute_dtype: str = "auto", revision: str | None = None,
          trust_remote_code: bool = False, block_path: str | None = None):
    """Run ``model`` on ``prompts`` with ``alpha x probe.direction`` added at ``layer`` (default: the probe's) and
    ``hookpoint`` (default: the probe's, else resid_post), for each alpha; with ``ablate=True`` the direction's
    component is removed instead (one row, alpha NaN). ``probe``: a LinearProbe or the path it was saved to.

    Returns a DataFrame, one row per alpha: ``probe_score`` (the probe's decision value on the last token at
    ``read_layer``, default the next layer the probe's dataset stored, averaged over prompts) and
    ``delta_probe_score`` against the unsteered model; for each target token ``logprob[T]`` and
    ``delta_logprob[T]``, its next-token log-probability after each prompt. Deltas are exactly 0 at alpha = 0.
    """
    import pandas as pd
    import torch

    p = _probe(probe)
    layer = p.layer if layer is None else int(layer)
    hookpoint = hookpoint or p.settings.get("hookpoint") or "resid_post"
    alphas = [float(a) for a in alphas]
    if not ablate and not alphas:
        raise ProbeError("alphas is empty: pass the multiples of the direction to add, e.g. alphas=[-4, 0, 4]")
    texts = read_prompts(prompts, text_column=text_column).texts
    if not texts:
        raise ProbeError("no prompts to steer")
    spec = read_model_spec(model, revision=revision, trust_remote_code=trust_remote_code)
    tok = load_tokenizer(spec)
    target_ids = _target_ids(tok, targets)
    arch = examine_model(model, revision=revision, trust_remote_code=trust_remote_code, block_path=block_path)
    if not 0 <= layer < arch.num_layers:
        raise ProbeError(f"layer {layer} is not a block of {spec.name} (it has {arch.num_layers})")
    read_layer = _read_layer(p, layer, arch.num_layers) if read_layer is None else int(read_layer)
    if not 0 <= read_layer < arch.num_layers:
        raise ProbeError(f"read_layer {read_layer} is not a block of {spec.name} (it has {arch.num_layers})")
    steered: Reading = arch.reading(hookpoint, layer)
    reading: Reading = arch.reading(hookpoint, read_layer)
    if ablate and steered.minus is not None:
        raise ProbeError(f"{hookpoint} is read as a difference ({steered}); ablation needs a hookpoint read from one "
                         "tensor (resid_pre, resid_post, mlp_in, or a module path)")
    width = p.coef.shape[1]
    if width != spec.hidden_size and hookpoint in ("resid_pre", "resid_post", "resid_mid"):
        raise ProbeError(f"the probe takes {width}-dim activations; {spec.name}'s stream is {spec.hidden_size}-dim")

    # the whole model on one device (load_model takes a placement since models can be spread over GPUs)
    lm, _ = load_model(spec, placement=Placement(pick_device(device)), compute_dtype=compute_dtype, quiet=True)
    dev = next(lm.parameters()).device
    blocks = get_module(lm, arch.block_path)
    direction = torch.tensor(p.direction, dtype=torch.float32, device=dev)  # (dim,), unit
    state: dict[str, Any] = {"alpha": None}
    captured: dict[Site, Any] = {}
    handles = [_steering_hook(_site_module(blocks[layer], steered.site), steered.site, direction, state),
               *_reading_hooks(blocks[read_layer], reading, captured)]

    def run(alpha) -> tuple[np.ndarray, np.ndarray]:
        """(probe score per prompt, target log-probabilities per prompt) with the stream edited by ``alpha``."""
        state["alpha"] = alpha
        scores, logps = [], []
        for text in texts:
            enc = tok(text, return_tensors="pt")
            ids = enc["input_ids"].to(dev)
            captured.clear()
            with torch.no_grad():
                out = lm(**forward_kwargs(lm, arch.inputs, ids, torch.ones_like(ids)))
            h = captured[reading.site] if reading.minus is None else captured[reading.site] - captured[reading.minus]
            scores.append(float(p.decision_function(h.numpy()[None])[0, 0]))
            logits = getattr(out, "logits", None)
            if target_ids:
                if logits is None:
                    raise ProbeError(f"{spec.name} has no language-model head: targets need next-token logits")
                lp = torch.log_softmax(logits[0, -1].float(), dim=-1)
                logps.append(lp[target_ids].cpu().numpy())
        return np.asarray(scores), np.asarray(logps).reshape(len(texts), len(target_ids))

    try:
        base_scores, base_logps = run(None)
        settings = ["ablate"] if ablate else alphas
        rows = []
        for a in settings:
            scores, logps = run(a)
            row = {"mode": "ablate" if a == "ablate" else "add", "alpha": float("nan") if a == "ablate" else a,
                   "layer": layer, "hookpoint": hookpoint, "read_layer": read_layer,
                   **_effects(scores, logps, base_scores, base_logps, targets)}
            rows.append(row)
    finally:
        for h in handles:
            h.remove()
    table = pd.DataFrame(rows)
    table.attrs["unsteered_probe_score"] = float(base_scores.mean())
    return table


def _target_ids(tok: Any, targets: Sequence[str]) -> list[int]:
    """The token id of each target; a target that is not one token is an error."""
    target_ids = []
    for t in targets:
        ids = tok(t, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ProbeError(f"target {t!r} is {len(ids)} tokens for this tokenizer; a target is one token (a leading "
                             "space often makes a word one token: ' good')")
        target_ids.append(ids[0])
    return target_ids


def _steering_hook(module: Any, site: Site, direction: Any, state: dict[str, Any]) -> Any:
    """A hook on ``module`` that edits the stream at ``site`` by ``state["alpha"]`` x ``direction`` (or ablates the
    direction, for alpha "ablate"; nothing for None); its handle."""

    def edit(h):
        if state["alpha"] is None:
            return h
        d = direction.to(h.dtype)
        if state["alpha"] == "ablate":
            return h - (h @ d)[..., None] * d
        return h + state["alpha"] * d

    if site.kind == "output":
        def out_hook(_m, _args, out):
            if isinstance(out, (tuple, list)):
                return type(out)((edit(out[0]), *out[1:]))
            return edit(out)
        return module.register_forward_hook(out_hook)

    def pre_hook(_m, args, kwargs):
        if args:
            return (edit(args[0]), *args[1:]), kwargs
        key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
        return args, {**kwargs, key: edit(kwargs[key])}
    return module.register_forward_pre_hook(pre_hook, with_kwargs=True)


def _reading_hooks(block: Any, reading: Reading, captured: dict[Site, Any]) -> list[Any]:
    """Hooks that keep the last token's value at each site of ``reading`` in ``captured``; their handles."""

    def reader(s: Site):
        if s.kind == "output":
            return lambda _m, _a, out: captured.__setitem__(s, first_output(out)[0, -1].float().cpu())
        return lambda _m, args, kwargs: captured.__setitem__(s, first_input(args, kwargs)[0, -1].float().cpu())

    handles = []
    for s in reading.sites:
        m = _site_module(block, s)
        if s.kind == "output":
            handles.append(m.register_forward_hook(reader(s)))
        else:
            handles.append(m.register_forward_pre_hook(reader(s), with_kwargs=True))
    return handles


def _effects(scores: np.ndarray, logps: np.ndarray, base_scores: np.ndarray, base_logps: np.ndarray,
             targets: Sequence[str]) -> dict[str, float]:
    """One setting's columns: the probe's score and each target's log-probability, and their change against the
    unsteered model, averaged over prompts."""
    row = {"probe_score": float(scores.mean()), "delta_probe_score": float((scores - base_scores).mean()),
           "delta_probe_score_std": float((scores - base_scores).std())}
    for j, t in enumerate(targets):
        row[f"logprob[{t}]"] = float(logps[:, j].mean())
        row[f"delta_logprob[{t}]"] = float((logps[:, j] - base_logps[:, j]).mean())
    return row
