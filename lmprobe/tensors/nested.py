"""Saving nested dicts of arrays as flat safetensors files.

safetensors takes ``{str: array}``. Handed a nested dict, its numpy path wraps the inner dict in
an object array and fails with the opaque "dtype object is not covered". We flatten nested dicts
(and lists) to dotted keys (``{"encoder": {"weight": w}}`` -> ``"encoder.weight"``, list items as
integers) and back, and reject anything that is not an array with an error naming its key path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..base.atomic import atomic_output
from ..errors import TensorDictError


def _as_numpy(value: Any, path: str) -> np.ndarray:
    mod = type(value).__module__.split(".")[0]
    if mod == "torch":
        import torch

        t = value.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            raise TensorDictError(f"{path}: bfloat16 tensors are saved with framework='pt' (save_file(..., framework='pt'))")
        return t.numpy()
    if isinstance(value, np.ndarray) or mod in ("jax", "jaxlib") or hasattr(value, "__array__"):
        arr = np.asarray(value)
        if arr.dtype == object:
            raise TensorDictError(f"{path}: holds an object array, not numbers")
        return np.ascontiguousarray(arr)
    if isinstance(value, (bool, int, float, np.generic)):
        return np.asarray(value)
    raise TensorDictError(
        f"{path}: expected an array (numpy, torch or JAX) or a nested dict of them, got {type(value).__name__}"
    )


def flatten(tree: Mapping[str, Any], *, sep: str = ".") -> dict[str, Any]:
    """Flatten nested dicts/lists of arrays to ``{"a.b.0": array}``; leaves are returned as given.

    >>> sorted(flatten({"enc": {"w": np.zeros(2), "b": [np.ones(1)]}}))
    ['enc.b.0', 'enc.w']
    """
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping):
            if not node and prefix:
                raise TensorDictError(f"{prefix}: empty dicts cannot be stored")
            for k, v in node.items():
                if not isinstance(k, (str, int)):
                    raise TensorDictError(f"{prefix or '<root>'}: key {k!r} is not a string or an int")
                k = str(k)
                if not k or sep in k:
                    raise TensorDictError(f"{prefix or '<root>'}: key {k!r} is empty or contains {sep!r}")
                walk(v, f"{prefix}{sep}{k}" if prefix else k)
        elif isinstance(node, (list, tuple)):
            if not node:
                raise TensorDictError(f"{prefix}: empty lists cannot be stored")
            for i, v in enumerate(node):
                walk(v, f"{prefix}{sep}{i}" if prefix else str(i))
        else:
            if not prefix:
                raise TensorDictError("expected a dict of arrays at the top level")
            out[prefix] = node

    walk(tree, "")
    return out


def unflatten(flat: Mapping[str, Any], *, sep: str = ".") -> dict[str, Any]:
    """Inverse of ``flatten``: dotted keys back to nested dicts; integer-keyed levels become lists."""
    root: dict[str, Any] = {}
    for key, value in flat.items():
        parts = key.split(sep)
        node = root
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise TensorDictError(f"{key}: {p!r} is both a tensor and a group")
        if parts[-1] in node:
            raise TensorDictError(f"{key}: defined twice")
        node[parts[-1]] = value

    def listify(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        node = {k: listify(v) for k, v in node.items()}
        keys = list(node)
        if keys and all(k.isdigit() for k in keys) and sorted(int(k) for k in keys) == list(range(len(keys))):
            return [node[str(i)] for i in range(len(keys))]
        return node

    return listify(root)


def save_file(tree: Mapping[str, Any], path: str | os.PathLike, *, metadata: Mapping[str, str] | None = None,
              framework: str = "np") -> None:
    """Save a (nested) dict of numpy/torch/JAX arrays to one safetensors file, atomically.

    >>> save_file({"probe": {"weight": np.ones((2, 3)), "bias": np.zeros(2)}}, "probe.safetensors")  # doctest: +SKIP
    """
    flat = flatten(tree)
    meta = dict(metadata) if metadata else None
    if framework == "pt":
        import torch
        from safetensors.torch import save_file as st_save

        tensors = {}
        for k, v in flat.items():
            tensors[k] = v.detach().cpu().contiguous() if isinstance(v, torch.Tensor) else torch.from_numpy(_as_numpy(v, k))
    else:
        from safetensors.numpy import save_file as st_save

        tensors = {k: _as_numpy(v, k) for k, v in flat.items()}
    with atomic_output(path) as tmp:
        st_save(tensors, str(tmp), metadata=meta)


def load_file(path: str | os.PathLike, *, framework: str = "np", nested: bool = True) -> dict[str, Any]:
    """Load a safetensors file, rebuilding the nested structure from dotted keys (``nested=False``: flat)."""
    if framework == "pt":
        from safetensors.torch import load_file as st_load
    else:
        from safetensors.numpy import load_file as st_load
    flat = st_load(os.fspath(path))
    return unflatten(flat) if nested else flat
