"""Activation rules of SAE dictionaries: which features fire on a vector, and how strongly.

A dictionary stores each layer's encoder as scores ``s = W x + b`` (docs/sae.md). The SAE it came
from turned its pre-activations into feature activations by a rule of its own; meta.json records
that rule per layer (``layer_sources[L].activation``), in one spelling whatever library saved the SAE:

    {"rule": "relu"}                       a = max(s, 0)                  standard and gated SAEs, plain arrays
    {"rule": "topk", "k": K}               the K largest s of the vector, clamped at 0; the rest 0
                                                                           sparsify; SAELens top-k
    {"rule": "groupmax", "k": K}           the features in K equal groups; each group's largest s, clamped at 0
                                                                           sparsify's groupmax
    {"rule": "jumprelu"}                   the threshold is folded into the bias, so a feature fires iff s > 0;
                                           a = s + theta there (theta: the layer's threshold file, the amount
                                           folded; 0 without one), else 0   SAELens JumpReLU (and batch-top-k
                                                                           SAEs, which SAELens saves as JumpReLU)
    {"rule": "batchtopk", "threshold": T}  a = s where s > max(T, 0), else 0: batch-top-k's inference threshold

so that a top-k SAE's features fire k at a time, and activations equal the library's own ``encode``
on the same vectors (up to the dictionary's float16 weights). Exports before this spelling wrote
sparsify's ``"activation": "topk", "k"``, SAELens' ``"architecture": "topk", "k"`` and
``"threshold_folded"``; ``activation_rule`` reads those too.

numpy is optional, as for the rest of the loader: ``activate`` takes numpy arrays,
``activate_list`` one vector's scores as a list.
"""

from __future__ import annotations

import heapq
import math
from typing import Any

from ..errors import DictionaryError

RULES = ("relu", "topk", "groupmax", "jumprelu", "batchtopk")
RELU = {"rule": "relu"}


def activation_rule(source: Any) -> dict:
    """The rule of a layer from its ``layer_sources`` entry in meta.json, in the one spelling (see above)."""
    src = source if isinstance(source, dict) else {}
    act = src.get("activation")
    if isinstance(act, dict):
        return dict(act)
    if act in ("topk", "groupmax"):  # sparsify saves, exported before the rule had one spelling
        return {"rule": act, "k": src.get("k")}
    if src.get("architecture") == "topk":  # SAELens top-k saves, likewise
        return {"rule": "topk", "k": src.get("k")}
    if src.get("threshold_folded"):
        return {"rule": "jumprelu"}
    return dict(RELU)


def parse_rule(text: str) -> dict:
    """A rule from its command-line spelling: ``relu``, ``topk:K``, ``groupmax:K``, ``jumprelu``, ``batchtopk:T``."""
    name, _, arg = str(text).partition(":")
    try:
        if name in ("topk", "groupmax") and arg:
            return {"rule": name, "k": int(arg)}
        if name == "batchtopk" and arg:
            return {"rule": name, "threshold": float(arg)}
    except ValueError:
        pass
    if name in ("relu", "jumprelu") and not arg:
        return {"rule": name}
    raise DictionaryError(f"--activation {text!r}: use relu, topk:K, groupmax:K, jumprelu or batchtopk:THRESHOLD")


def check_rule(rule: Any, features: int, where: str) -> dict:
    """``rule`` if it is well-formed for a layer of ``features`` features; else a DictionaryError naming the fix."""
    if not isinstance(rule, dict) or rule.get("rule") not in RULES:
        raise DictionaryError(f"{where}: activation {rule!r:.80} is not one of the rules {list(RULES)} (docs/sae.md)")
    name = rule["rule"]
    if name in ("topk", "groupmax"):
        k = rule.get("k")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= features:
            raise DictionaryError(f"{where}: a {name} activation needs k in 1..{features} (the features), got {k!r:.40}")
        if name == "groupmax" and features % k:
            raise DictionaryError(f"{where}: groupmax with k={k} needs a feature count divisible by k, got {features}")
    if name == "batchtopk":
        t = rule.get("threshold")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise DictionaryError(f"{where}: a batchtopk activation needs a finite threshold, got {t!r:.40}")
    return rule


def describe(rule: dict) -> str:
    """The rule in words, for messages and pages."""
    name = rule["rule"]
    if name in ("topk", "groupmax"):
        return f"{name} (k={rule['k']})"
    if name == "batchtopk":
        return f"batchtopk (threshold {rule['threshold']:g})"
    return name


def activate(rule: dict, scores: Any, threshold: Any = None) -> Any:
    """(batch, features) activations from (batch, features) float32 scores under ``rule`` (numpy)."""
    import numpy as np

    s = np.asarray(scores, dtype=np.float32)
    name = rule["rule"]
    if name == "relu":
        return np.maximum(s, 0)
    if name == "topk":
        k = rule["k"]
        out = np.zeros_like(s)
        if k >= s.shape[1]:
            return np.maximum(s, 0)
        top = np.argpartition(-s, k - 1, axis=1)[:, :k]
        np.put_along_axis(out, top, np.maximum(np.take_along_axis(s, top, axis=1), 0), axis=1)
        return out
    if name == "groupmax":
        k = rule["k"]
        grouped = s.reshape(len(s), k, -1)
        best = grouped.argmax(axis=2)  # (batch, k)
        out = np.zeros_like(grouped)
        np.put_along_axis(out, best[..., None], np.maximum(np.take_along_axis(grouped, best[..., None], axis=2), 0),
                          axis=2)
        return out.reshape(s.shape)
    if name == "jumprelu":
        fired = s > 0
        theta = 0 if threshold is None else np.asarray(threshold, dtype=np.float32)
        return np.where(fired, s + theta, 0).astype(np.float32)
    t = max(float(rule["threshold"]), 0.0)  # batchtopk
    return np.where(s > t, s, 0).astype(np.float32)


def activate_list(rule: dict, scores: list[float], threshold: Any = None) -> list[float]:
    """``activate`` for one vector's scores as a list (no numpy)."""
    name = rule["rule"]
    if name == "relu":
        return [max(x, 0.0) for x in scores]
    if name == "topk":
        keep = set(heapq.nlargest(rule["k"], range(len(scores)), key=lambda i: (scores[i], -i)))
        return [max(x, 0.0) if i in keep else 0.0 for i, x in enumerate(scores)]
    if name == "groupmax":
        size = len(scores) // rule["k"]
        out = [0.0] * len(scores)
        for g in range(0, len(scores), size):
            i = max(range(g, g + size), key=lambda j: (scores[j], -j))
            out[i] = max(scores[i], 0.0)
        return out
    if name == "jumprelu":
        theta = [0.0] * len(scores) if threshold is None else [float(v) for v in threshold]
        return [x + t if x > 0 else 0.0 for x, t in zip(scores, theta, strict=True)]
    t = max(float(rule["threshold"]), 0.0)
    return [x if x > t else 0.0 for x in scores]
