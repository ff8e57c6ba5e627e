"""Read a saev shards folder with saev's own loaders, in the interop venv (tests/saev/test_saev_interop.py).

    python saev_loaders.py SAEV_SRC SHARDS_DIR LAYER OUT_DIR

SAEV_SRC is one of the vendored saev commits beside this file (saev/<commit>, see saev/README.md).
saev declares Python >= 3.12, but its loader modules parse and run on 3.11: they are imported
from that source as they are. Only torchvision is stubbed (a module with the three names its
dataset module references at import time): PyPI's torchvision cannot be installed beside the CPU
torch 2.13.0 this project uses, and no loader calls it. Pillow, beartype, jaxtyping, einops,
orjson and scipy are real (tests/reference/envs.py installs them). saev's data/__init__.py, which
imports every vision model family, is not vendored, so ``saev.data`` is a namespace package.

Writes OUT_DIR/result.json: saev's ``Metadata.hash``, and for each loader (shuffled, ordered,
indexed) either ``{"n": ...}`` with OUT_DIR/<loader>.npz holding ``act`` (n, d_model) and
``example``/``token`` (n,), or ``{"error": "<type>: <message>"}``.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import torch


def _stub_torchvision() -> None:
    tv = types.ModuleType("torchvision")
    tv.datasets = types.ModuleType("torchvision.datasets")
    tv.datasets.ImageFolder = type("ImageFolder", (torch.utils.data.Dataset,), {})
    tv.datasets.folder = types.ModuleType("torchvision.datasets.folder")
    tv.datasets.folder.IMG_EXTENSIONS = (".jpg", ".png")
    sys.modules.update({"torchvision": tv, "torchvision.datasets": tv.datasets,
                        "torchvision.datasets.folder": tv.datasets.folder})


def _keys(batch) -> tuple[str, str]:
    """(example key, token key): saev e43e7dd names them image_i/ex_i and patch_i, 3d73f1f example_idx and token_idx."""
    ex = next(k for k in ("example_idx", "ex_i", "image_i") if k in batch)
    tok = next(k for k in ("token_idx", "patch_i") if k in batch)
    return ex, tok


def _collect(batches) -> dict[str, np.ndarray]:
    acts, exs, toks = [], [], []
    for b in batches:
        ex, tok = _keys(b)
        acts.append(np.asarray(b["act"], dtype=np.float32).reshape(-1, b["act"].shape[-1]))
        exs.append(np.asarray(b[ex]).reshape(-1))
        toks.append(np.asarray(b[tok]).reshape(-1))
    return {"act": np.concatenate(acts), "example": np.concatenate(exs), "token": np.concatenate(toks)}


def _python_312_shim() -> None:
    """The one Python 3.12 addition the loaders use: ``multiprocessing.queues.Queue[...]`` in annotations."""
    import multiprocessing.queues

    if not hasattr(multiprocessing.queues.Queue, "__class_getitem__"):
        multiprocessing.queues.Queue.__class_getitem__ = classmethod(types.GenericAlias)


def main(src: Path, shards_dir: Path, layer: int, out: Path) -> None:
    _python_312_shim()
    _stub_torchvision()
    sys.path.insert(0, str(src))
    from saev.data import indexed, ordered, shards, shuffled

    md = shards.Metadata.load(shards_dir)
    result: dict = {"hash": md.hash, "loaders": {}}

    def field(cfg_cls) -> dict:
        names = {f for f in cfg_cls.__dataclass_fields__}
        kw = {"shards": shards_dir, "layer": layer}
        kw.update({k: v for k, v in (("patches", "image"), ("tokens", "content")) if k in names})
        return kw

    def run_shuffled():
        cfg = shuffled.Config(**field(shuffled.Config), batch_size=7, n_threads=1, buffer_size=4, seed=3,
                              batch_timeout_s=20.0)
        return _collect(shuffled.DataLoader(cfg))

    def run_ordered():
        cfg = ordered.Config(**field(ordered.Config), batch_size=5, buffer_size=4, batch_timeout_s=20.0)
        return _collect(ordered.DataLoader(cfg))

    def run_indexed():
        ds = indexed.Dataset(indexed.Config(**field(indexed.Config)))
        return _collect({k: torch.as_tensor(np.asarray(v))[None] for k, v in ds[i].items()} for i in range(len(ds)))

    for name, fn in (("shuffled", run_shuffled), ("ordered", run_ordered), ("indexed", run_indexed)):
        try:
            arrays = fn()
        except Exception as exc:  # what the loader raised is the finding
            result["loaders"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            continue
        np.savez(out / f"{name}.npz", **arrays)
        result["loaders"][name] = {"n": int(len(arrays["act"]))}
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
