"""Reading trained SAE encoders as they are saved by SAELens and by EleutherAI's sparsify, or as plain arrays.

A dictionary stores one affine map per layer, ``score = W x + b`` (rows of W are features). Each
library's encoder is brought to that form exactly, by folding what it does to the input before
the affine map into W and b:

- SAELens (``cfg.json`` + ``sae_weights.safetensors``, versions 5 and 6): ``pre = (norm(x) -
  b_dec * apply_b_dec_to_input) @ W_enc + b_enc`` (``b_gate`` for gated SAEs), so
  ``W = W_enc.T`` and ``b = b_enc - W_enc.T @ b_dec`` when ``apply_b_dec_to_input`` (the default;
  never for transcoders). A top-k SAE saved with ``rescale_acts_by_decoder_norm`` scales row i
  by ``||W_dec[i]||``; a JumpReLU SAE's threshold is folded into the bias, so that a feature
  fires exactly when its score is above zero; an unfolded ``expected_average_only_in`` scaling
  factor or whitening (training checkpoints) is folded into W. Per-input normalisations
  (``constant_norm_rescale``, ``layer_norm``) are not affine and are refused.
- sparsify (``cfg.json`` + ``sae.safetensors``, one folder per hookpoint): ``pre = encoder(x -
  b_dec)`` for every SAE, ``encoder(x)`` for transcoders, so ``W = encoder.weight`` and
  ``b = encoder.bias - encoder.weight @ b_dec`` unless ``transcode``.
- A folder holding several such SAEs (a sparsify run, a SAELens multi-SAE output or Hub release)
  is read one hookpoint at a time, named by its subfolder.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..base.safeio import read_json
from ..errors import DictionaryError
from ..format.dtypes import DTYPES
from ..format.safetensors_io import read_header
from ..format.values import bfloat16_bits_to_float32
from .activation import RELU, check_rule

SAELENS_WEIGHTS = "sae_weights.safetensors"
SPARSIFY_WEIGHTS = "sae.safetensors"
_UNFOLDABLE = {
    "constant_norm_rescale": "rescales every input to norm sqrt(d_in)",
    "layer_norm": "layer-normalises every input",
}


@dataclass
class EncoderWeights:
    """An encoder as ``score = W x + b``: W (features, d_in) float32, b (features,) float32 or None."""

    W: np.ndarray
    b: np.ndarray | None
    info: dict[str, Any] = field(default_factory=dict)
    """What it was read from, what was folded, and its ``activation`` rule (recorded in the dictionary's meta.json)."""
    threshold: np.ndarray | None = None
    """A JumpReLU SAE's threshold folded into ``b``, one per feature (stored beside the layer: activation values)."""


def load_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as float64 (bfloat16 and float16 included) or its integer dtype."""
    header = read_header(path)
    out: dict[str, np.ndarray] = {}
    with open(path, "rb") as f:
        for key, e in header.tensors.items():
            f.seek(e.start)
            raw = np.frombuffer(f.read(e.end - e.start), dtype=DTYPES[e.dtype].np_storage).reshape(e.shape)
            if DTYPES[e.dtype].half_of_float32:
                raw = bfloat16_bits_to_float32(raw)
            out[key] = raw.astype(np.float64) if raw.dtype.kind == "f" else raw
    return out


def _read_json(path: Path) -> dict:
    cfg = read_json(path, error=DictionaryError)
    if not isinstance(cfg, dict):
        raise DictionaryError(f"{path} must hold a JSON object")
    return cfg


def layout_of(folder: Path) -> str | None:
    """'saelens', 'sparsify', or None for a folder holding one SAE."""
    if not (folder / "cfg.json").is_file():
        return None
    if (folder / SAELENS_WEIGHTS).is_file():
        return "saelens"
    if (folder / SPARSIFY_WEIGHTS).is_file():
        return "sparsify"
    return None


def hookpoints(folder: Path) -> dict[str, Path]:
    """The SAEs in a container folder, by hookpoint name (subfolder, or ``hook/seedN``), in natural order."""
    found: dict[str, Path] = {}
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if sub.name == "best":  # sparsify's best-so-far copies of the same hookpoints
            continue
        if layout_of(sub):
            found[sub.name] = sub
            continue
        for seed in sorted(p for p in sub.iterdir() if p.is_dir()):  # sparsify: hook/seedN
            if layout_of(seed):
                found[f"{sub.name}/{seed.name}"] = seed

    def natural(name: str):
        return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]

    return dict(sorted(found.items(), key=lambda kv: natural(kv[0])))


def read_sae_folder(folder: str | os.PathLike, *, hookpoint: str | None = None) -> EncoderWeights:
    """The encoder of a SAELens or sparsify save (or of one hookpoint of a folder holding several)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DictionaryError(f"{folder} is not a folder")
    kind = layout_of(folder)
    if kind is None:
        available = hookpoints(folder)
        if not available:
            raise DictionaryError(
                f"{folder} holds no SAE lmprobe can read: expected cfg.json with sae_weights.safetensors (SAELens) "
                "or sae.safetensors (sparsify), or subfolders holding them; for a single weights file pass it "
                "with --weight-key")
        if hookpoint is None:
            if len(available) > 1:
                raise DictionaryError(f"{folder} holds SAEs for several hookpoints ({', '.join(available)}); "
                                      "choose one with --hookpoint NAME")
            hookpoint = next(iter(available))
        if hookpoint not in available:
            raise DictionaryError(f"{folder} has no SAE for hookpoint {hookpoint!r}; it has {', '.join(available)}")
        enc = read_sae_folder(available[hookpoint])
        enc.info["hookpoint"] = hookpoint
        return enc
    if hookpoint is not None:
        raise DictionaryError(f"{folder} holds a single SAE; --hookpoint applies to folders holding several")
    enc = _read_saelens(folder) if kind == "saelens" else _read_sparsify(folder)
    enc.info.setdefault("hookpoint", folder.name)
    return enc


def _read_saelens(folder: Path) -> EncoderWeights:
    cfg = _read_json(folder / "cfg.json")
    t = load_tensors(folder / SAELENS_WEIGHTS)
    arch = cfg.get("architecture") or "standard"
    act = cfg.get("activation_fn_str", cfg.get("activation_fn"))
    if arch == "standard" and act == "topk":  # SAELens 5 wrote top-k SAEs this way
        arch = "topk"
    if arch in ("temporal", "matching_pursuit"):
        raise DictionaryError(f"{folder}: a {arch} SAE is not an affine encoder; it cannot become a dictionary")
    if "W_enc" not in t or "b_dec" not in t:
        raise DictionaryError(f"{folder / SAELENS_WEIGHTS} has no W_enc/b_dec (has {sorted(t)})")
    W_enc = t["W_enc"]  # (d_in, d_sae)
    if W_enc.ndim != 2:
        raise DictionaryError(f"{folder}: W_enc must be 2-D, got shape {W_enc.shape}")
    bias_key = "b_gate" if arch == "gated" else "b_enc"  # the gate decides which features fire
    if bias_key not in t:
        raise DictionaryError(f"{folder / SAELENS_WEIGHTS} has no {bias_key} (has {sorted(t)})")
    b = t[bias_key].reshape(-1)
    b_dec = t["b_dec"].reshape(-1)
    apply = bool(cfg.get("apply_b_dec_to_input", True)) and "transcoder" not in arch
    norm = cfg.get("normalize_activations", "none")
    norm = {True: "expected_average_only_in", False: "none", None: "none"}.get(norm, norm)
    W = W_enc.T  # (d_sae, d_in)
    if norm in _UNFOLDABLE:
        raise DictionaryError(f"{folder}: normalize_activations={norm!r} {_UNFOLDABLE[norm]}, which is not an affine "
                              "map of the input; the encoder cannot be stored as W x + b")
    if norm == "covariance_whitening":
        white = folder / "activation_whitening.safetensors"
        if not white.is_file():
            raise DictionaryError(f"{folder}: normalize_activations is covariance_whitening but {white.name} is missing")
        wt = load_tensors(white)
        M, mean = wt["matrix"], wt["mean"].reshape(-1)
        W = (M @ W_enc).T
        b = b - mean @ M @ W_enc
    elif norm == "expected_average_only_in":
        scaler = folder / "activation_scaler.json"
        s = _read_json(scaler).get("scaling_factor") if scaler.is_file() else None
        if not isinstance(s, (int, float)):
            raise DictionaryError(
                f"{folder}: normalize_activations is expected_average_only_in but no scaling factor was saved "
                "(activation_scaler.json); fold it first (SAELens: sae.fold_activation_norm_scaling_factor)")
        W = W * s
    elif norm != "none":
        raise DictionaryError(f"{folder}: unknown normalize_activations {norm!r}")
    if apply:
        b = b - W_enc.T @ b_dec  # pre = (x - b_dec) @ W_enc + b_enc, with x already normalised
    info: dict[str, Any] = {"source": "saelens", "architecture": arch, "b_dec_folded": apply}
    if arch == "topk" and cfg.get("rescale_acts_by_decoder_norm"):
        scale = np.linalg.norm(t["W_dec"], axis=-1)
        W, b = W * scale[:, None], b * scale
        info["decoder_norm_folded"] = True
    folded = None
    if "threshold" in t or "log_threshold" in t:
        theta = t["threshold"] if "threshold" in t else np.exp(t["log_threshold"])
        folded = np.broadcast_to(np.maximum(theta.reshape(-1), 0.0), b.shape).astype(np.float32)
        b = b - folded  # fires iff pre > threshold: iff score > 0; the activation is then score + folded
        info["threshold_folded"] = True
        info["activation"] = {"rule": "jumprelu"}
    elif "topk_threshold" in t:  # a batch-top-k training save: its inference threshold
        info["activation"] = {"rule": "batchtopk", "threshold": float(np.asarray(t["topk_threshold"]).reshape(-1)[0])}
    elif arch == "topk":
        k = cfg.get("k", (cfg.get("activation_fn_kwargs") or {}).get("k"))
        info["activation"] = {"rule": "topk", "k": k}
    elif arch == "batchtopk":
        raise DictionaryError(f"{folder}: a batchtopk SAE saved without its topk_threshold has no inference rule; "
                              "save it for inference (SAELens converts it to JumpReLU)")
    else:
        info["activation"] = dict(RELU)
    if norm != "none":
        info["input_normalisation_folded"] = norm
    hook = (cfg.get("metadata") or {}).get("hook_name") or cfg.get("hook_name") or cfg.get("hook_point")
    if hook:
        info["hook_name"] = hook
    check_rule(info["activation"], W.shape[0], str(folder / "cfg.json"))
    return EncoderWeights(np.ascontiguousarray(W, dtype=np.float32), b.astype(np.float32), info, folded)


def _read_sparsify(folder: Path) -> EncoderWeights:
    cfg = _read_json(folder / "cfg.json")
    t = load_tensors(folder / SPARSIFY_WEIGHTS)
    if "encoder.weight" in t:
        W = t["encoder.weight"]  # (num_latents, d_in)
        b = t["encoder.bias"].reshape(-1) if "encoder.bias" in t else np.zeros(W.shape[0])
    elif "W_enc" in t:  # the layout of June 2024
        W = t["W_enc"].T
        b = t["b_enc"].reshape(-1) if "b_enc" in t else np.zeros(W.shape[0])
    else:
        raise DictionaryError(f"{folder / SPARSIFY_WEIGHTS} has no encoder.weight (has {sorted(t)})")
    transcode = bool(cfg.get("transcode", False))
    if not transcode:
        if "b_dec" not in t:
            raise DictionaryError(f"{folder / SPARSIFY_WEIGHTS} has no b_dec (has {sorted(t)})")
        b = b - W @ t["b_dec"].reshape(-1)  # sparsify encodes x - b_dec
    act = cfg.get("activation", "topk")
    if act not in ("topk", "groupmax"):
        raise DictionaryError(f"{folder / 'cfg.json'}: sparsify activation {act!r} is not one lmprobe knows "
                              "(topk, groupmax)")
    info = {"source": "sparsify", "architecture": "transcoder" if transcode else "sae", "b_dec_folded": not transcode,
            "activation": check_rule({"rule": act, "k": cfg.get("k")}, W.shape[0], str(folder / "cfg.json"))}
    if cfg.get("signed"):
        info["signed"] = True
    return EncoderWeights(np.ascontiguousarray(W, dtype=np.float32), b.astype(np.float32), info)
