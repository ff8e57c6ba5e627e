"""Check every named hookpoint of one architecture against transformers itself (the zoo test and its table).

For one tiny random model: lmprobe says where each named hookpoint exists (``examine_model``, run on
a miniature before the weights load); it extracts each one on the layers where it exists, from
padded batches; and each stored vector is compared with what transformers computes for each prompt
alone, unpadded, with its own default inputs: ``resid_pre[i] = hidden_states[i]``,
``resid_post[i] = hidden_states[i + 1]`` (the block's output for the last block, whose hidden state has
the final norm applied), and the identities of docs/hookpoints.md on every block. A hookpoint that
does not exist on a layer must be refused before the weights load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PROMPTS = ["the cat sat on the mat and looked at the bird", "a b", "numbers like 12 and 345 appear", "x y z"]
NAMED = ["resid_pre", "attn_out", "resid_mid", "mlp_in", "mlp_out", "resid_post"]
#: float32 on CPU, padded batches against unpadded prompts: rounding grows with depth (~1e-5 of the stream's
#: norm after 32 blocks); a wrong number (positions off, a sublayer misread) is off by 1e-2 or more
RTOL = 1e-4


@dataclass
class Row:
    """One architecture's result: per hookpoint, the layers where it is stored and what was found."""

    model_type: str
    kinds: list[str] = field(default_factory=list)  # the distinct block anatomies, in words
    layers: dict[str, list[int]] = field(default_factory=dict)  # hookpoint -> layers where it exists
    reading: dict[str, str] = field(default_factory=dict)  # hookpoint -> how it is read (first layer that has it)
    refused: dict[str, str] = field(default_factory=dict)  # hookpoint -> why (first layer that lacks it)
    model_refused: str | None = None  # the whole architecture refused, and why
    errors: list[str] = field(default_factory=list)  # disagreements with transformers (must stay empty)
    num_layers: int = 0


def _alone(model_dir: Path, block_path: str, causal: bool, policy):
    """Per prompt: transformers' hidden states and every block's input and output, unpadded, default inputs."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = (AutoModelForCausalLM if causal else AutoModel).from_pretrained(model_dir, dtype=torch.float32).eval()
    blocks = model.get_submodule(block_path)
    out = []
    for text in PROMPTS:
        ids = tok(text, return_tensors="pt")["input_ids"]
        got: dict = {}
        handles = []
        for i, b in enumerate(blocks):
            def pre(_m, a, k, i=i, got=got):
                got.setdefault(("in", i), _first(a, k).detach().clone())
            def post(_m, _a, o, i=i, got=got):
                got.setdefault(("out", i), _first(o).detach().clone())
            handles += [b.register_forward_pre_hook(pre, with_kwargs=True), b.register_forward_hook(post)]
            for name, m in b.named_modules():  # every norm inside the block: what post-norm blocks normalise
                if name and "norm" in type(m).__name__.lower():
                    def norm_io(_m, a, k, o, key=(i, name), got=got):
                        x, y = _first(a, k), _first(o)
                        if hasattr(x, "detach") and hasattr(y, "detach"):
                            got.setdefault(("norm", key), (x.detach().clone(), y.detach().clone()))
                    handles.append(m.register_forward_hook(norm_io, with_kwargs=True))
        kwargs = {"use_cache": False} if policy.use_cache else {}
        if policy.decoder_inputs:
            from lmprobe.extraction.examine import forward_kwargs
            kwargs = forward_kwargs(model, type(policy)(use_cache=policy.use_cache, attention_mask=False,
                                                       decoder_inputs=True), ids, torch.ones_like(ids))
            kwargs.pop("input_ids")
        with torch.no_grad():
            res = model(input_ids=ids, output_hidden_states=True, **kwargs)
        for h in handles:
            h.remove()
        hs = getattr(res, "decoder_hidden_states", None) or res.hidden_states
        norms: dict = {}
        for key, value in got.items():
            if key[0] == "norm":
                norms.setdefault(key[1][0], []).append((value[0][0].numpy(), value[1][0].numpy()))
        out.append({"hs": [h[0].numpy() for h in hs], "in": {i: got[("in", i)][0].numpy() for i in range(len(blocks))},
                    "out": {i: got[("out", i)][0].numpy() for i in range(len(blocks))}, "norms": norms})
    return out


def check(model_type: str, model_dir: Path, work: Path) -> Row:
    import lmprobe
    from lmprobe.errors import ModelError
    from lmprobe.extraction import model as model_mod
    from lmprobe.extraction.examine import first_jump
    from lmprobe.extraction.preparation import examine_model

    row = Row(model_type)
    try:
        arch = examine_model(str(model_dir))
    except ModelError as exc:
        row.model_refused = str(exc)
        return row
    row.num_layers = arch.num_layers
    row.kinds = [f"layers {_r(ls)}: {b.describe()}" for ls, b in arch.kinds()]
    for hp in NAMED:
        row.layers[hp] = arch.layers_with(hp)
        have = row.layers[hp]
        if have:
            row.reading[hp] = str(arch.blocks[have[0]].readings[hp])
        lacking = [i for i in range(arch.num_layers) if i not in have]
        if lacking:
            row.refused[hp] = arch.blocks[lacking[0]].refusals.get(hp, "?")
    # every refusal comes before the weights load
    real_load = model_mod.load_model
    model_mod.load_model = _no_load
    try:
        for hp in row.refused:
            layer = next(i for i in range(arch.num_layers) if i not in row.layers[hp])
            try:
                lmprobe.extract(str(model_dir), PROMPTS, out=work / f"refused-{hp}", layers=[layer], hookpoints=[hp],
                                device="cpu", quiet=True)
                row.errors.append(f"{hp} on layer {layer} was not refused")
            except ModelError as exc:
                if "weights loaded" in str(exc):
                    row.errors.append(f"{hp} on layer {layer} was refused only after the weights loaded")
    finally:
        model_mod.load_model = real_load
    causal = model_mod.read_model_spec(str(model_dir)).causal_lm
    ref = _alone(model_dir, arch.block_path, causal, arch.inputs)
    groups: dict[tuple[int, ...], list[str]] = {}
    for hp in NAMED:
        if row.layers[hp]:
            groups.setdefault(tuple(row.layers[hp]), []).append(hp)
    stored: dict[tuple[str, int], list[np.ndarray]] = {}
    for k, (layers, hps) in enumerate(groups.items()):
        ds = lmprobe.extract(str(model_dir), PROMPTS, out=work / f"ds{k}", layers=list(layers), hookpoints=hps,
                             storage="full_sequence", batch_size=len(PROMPTS), device="cpu", quiet=True)
        for hp in hps:
            for layer in layers:
                stored[(hp, layer)] = [ds.token_hidden(i, layer, hookpoint=hp) for i in range(len(PROMPTS))]
    L = arch.num_layers
    # against transformers, prompt by prompt: each layer's difference, checked for a jump (a wrong number) rather
    # than against one tolerance, since a random deep stack can amplify rounding block after block
    for hp in ("resid_pre", "resid_post"):
        for i, r in enumerate(ref):
            # transformers' hidden states are the block inputs then the final norm's output, or (the Mamba
            # family) every block's output then the final norm's
            shifted = np.allclose(r["hs"][0], r["out"][0], atol=1e-6) and not np.allclose(r["hs"][0], r["in"][0])
            for source in ("hidden_states", "hooks"):
                errs, wants = [], []
                for layer in range(L):
                    if (hp, layer) not in stored:
                        continue
                    if source == "hooks":
                        want = r["in" if hp == "resid_pre" else "out"][layer]
                    elif hp == "resid_pre":
                        want = None if shifted and layer == 0 else r["hs"][layer - 1 if shifted else layer]
                    else:
                        want = r["hs"][layer if shifted else layer + 1] if shifted or layer < L - 1 else r["out"][layer]
                    if want is None:
                        continue
                    got = stored[(hp, layer)][i]
                    if got.shape != want.shape:
                        row.errors.append(f"{hp}[{layer}] vs transformers' {source}, prompt {i}: shapes {got.shape} "
                                          f"and {want.shape}")
                        continue
                    errs.append(_relative(got, want))
                    wants.append(layer)
                bad = first_jump(errs, RTOL)
                if bad is not None:
                    row.errors.append(f"{hp}[{wants[bad]}] vs transformers' {source}, prompt {i}: relative "
                                      f"difference {errs[bad]:.3g} (the layer before: {errs[bad - 1] if bad else 0:.3g})")
    for layer in range(L):
        for i in range(len(PROMPTS)):
            got = {hp: stored[(hp, layer)][i] for hp in NAMED if (hp, layer) in stored}
            # the identities hold within one forward pass: lmprobe's own stored stream, not the unpadded run's
            pre = got.get("resid_pre", ref[i]["in"][layer])
            post = got.get("resid_post", ref[i]["out"][layer])
            kind = arch.blocks[layer].kind
            if "attn_out" in got and "resid_mid" in got and kind != "post_norm":
                _same(row, pre + got["attn_out"], got["resid_mid"], f"resid_pre + attn_out vs resid_mid, layer {layer}")
            if "mlp_out" in got and "resid_mid" in got and kind != "post_norm":
                _same(row, got["resid_mid"] + got["mlp_out"], post, f"resid_mid + mlp_out vs resid_post, layer {layer}")
            if kind == "post_norm":  # a norm of the block reads the stream plus the sublayer's output (transformers')
                norms = ref[i]["norms"].get(layer, [])
                for hp, base, then in (("attn_out", pre, "resid_mid"), ("mlp_out", got.get("resid_mid"), "resid_post")):
                    if hp in got and base is not None and then in got and not any(
                            n_in.shape == base.shape and _relative(n_in, base + got[hp]) < 1e-3
                            and _relative(n_out, got[then]) < 1e-3 for n_in, n_out in norms):
                        row.errors.append(f"post-norm layer {layer}, prompt {i}: no norm of the block reads "
                                          f"{'resid_pre' if hp == 'attn_out' else 'resid_mid'} + {hp} and returns {then}")
            if kind == "parallel" and "mlp_out" in got and "attn_out" in got:
                _same(row, pre + got["attn_out"] + got["mlp_out"], post, f"parallel sum, layer {layer}")
            if layer > 0 and "resid_pre" in got and ("resid_post", layer - 1) in stored:
                _same(row, got["resid_pre"], stored[("resid_post", layer - 1)][i],
                      f"resid_pre[{layer}] vs resid_post[{layer - 1}]")
    return row


def _first(value, kwargs=None):
    """A module's first input (positional, else ``hidden_states``, else the first keyword) or first output."""
    if kwargs is not None:
        if value:
            value = value[0]
        elif "hidden_states" in kwargs:
            value = kwargs["hidden_states"]
        else:
            value = next(iter(kwargs.values()), None)
    while isinstance(value, (tuple, list)) and value:
        value = value[0]
    return value


def _no_load(*a, **k):
    from lmprobe.errors import ModelError

    raise ModelError("weights loaded")


def _relative(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    scale = float(np.linalg.norm(a) + np.linalg.norm(b))
    return float(np.linalg.norm(a - b)) / scale if scale > 0 else 0.0


def _same(row: Row, a, b, what: str) -> None:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        row.errors.append(f"{what}: shapes {a.shape} and {b.shape}")
        return
    if not a.size:
        return
    err = float(np.linalg.norm(a - b))
    scale = float(np.linalg.norm(a) + np.linalg.norm(b))
    if err > RTOL * max(scale, 1e-6):
        row.errors.append(f"{what}: |diff| {err:.3g} against |values| {scale:.3g} (max abs diff "
                          f"{float(np.abs(a - b).max()):.3g})")


def _r(layers: list[int]) -> str:
    from lmprobe.extraction.examine import ranges as _ranges

    return _ranges(layers)
