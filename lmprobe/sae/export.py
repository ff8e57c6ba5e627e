"""Exporting trained SAE encoders as sparse dictionaries (``lmprobe export-sae``)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..base.atomic import atomic_write, move_into_place
from ..base.lock import OutputLock
from ..base.paths import check_output_path
from ..errors import DictionaryError
from ..format.values import to_numpy
from .activation import RELU, check_rule, describe, parse_rule
from .loader import SAEConfig, load_dictionary, validate_dictionary
from .sources import EncoderWeights, load_tensors, read_sae_folder

DICT_VERSION = "1.0.0"


@dataclass
class ExportReport:
    layer: int
    features: int
    hidden_dim: int
    nnz: int
    mass_kept: float  # fraction of the encoder's L1 weight mass kept by sparsification
    path: Path
    activation: dict = field(default_factory=lambda: dict(RELU))  # the SAE's activation rule

    def __str__(self) -> str:
        density = self.nnz / (self.features * self.hidden_dim)
        return (f"layer {self.layer}: {self.features} features x {self.hidden_dim} dims, activation "
                f"{describe(self.activation)}; {self.nnz} encoder weights kept ({density:.1%} of the weight matrix, "
                f"{self.mass_kept:.1%} of its weight mass) -> {self.path}")


def read_encoder(source: str | os.PathLike, *, weight_key: str | None = None, bias_key: str | None = None,
                 b_dec_key: str | None = None, orientation: str = "auto",
                 hookpoint: str | None = None) -> EncoderWeights:
    """An encoder as ``score = W x + b`` from a SAELens or sparsify folder, or a .safetensors/.npz file.

    Folders are recognised by their layout (see ``lmprobe.sae.sources``), decoder biases folded in.
    A single file needs ``weight_key`` (and ``bias_key`` when there is a bias; ``b_dec_key`` names
    a decoder bias the SAE subtracts from its input, folded into the bias). ``orientation``:
    "in_out" ([hidden, features], SAELens), "out_in" ([features, hidden], nn.Linear), or "auto"
    (decided by the bias length, which is the feature count).
    """
    src = Path(source)
    if src.is_dir():
        if weight_key or bias_key or b_dec_key:
            raise DictionaryError(f"{src} is a folder: --weight-key/--bias-key/--b-dec-key apply to a single file")
        return read_sae_folder(src, hookpoint=hookpoint)
    if hookpoint is not None:
        raise DictionaryError("--hookpoint chooses a subfolder of a folder holding several SAEs; the source is a file")
    if not src.exists():
        raise DictionaryError(f"{src} does not exist")
    if src.suffix == ".safetensors":
        tensors = load_tensors(src)
    elif src.suffix == ".npz":
        with np.load(src, allow_pickle=False) as z:
            tensors = {k: z[k] for k in z.files}
    else:
        raise DictionaryError(f"{src}: expected a .safetensors or .npz file, or a SAELens or sparsify folder")
    if weight_key is None:
        raise DictionaryError(f"{src}: pass --weight-key (the file holds {sorted(tensors)})")
    for key in (weight_key, bias_key, b_dec_key):
        if key is not None and key not in tensors:
            raise DictionaryError(f"{src}: no tensor {key!r} (the file holds {sorted(tensors)})")
    W = np.asarray(tensors[weight_key], dtype=np.float64)
    if W.ndim != 2:
        raise DictionaryError(f"{src}: {weight_key} must be 2-D, got shape {W.shape}")
    b = None if bias_key is None else np.asarray(tensors[bias_key], dtype=np.float64).reshape(-1)
    W = orient(W, b, orientation)
    info: dict = {"source": "file", "b_dec_folded": b_dec_key is not None}
    if b_dec_key is not None:
        b_dec = np.asarray(tensors[b_dec_key], dtype=np.float64).reshape(-1)
        if len(b_dec) != W.shape[1]:
            raise DictionaryError(f"{src}: {b_dec_key} has {len(b_dec)} entries for inputs of {W.shape[1]}")
        b = (np.zeros(W.shape[0]) if b is None else b) - W @ b_dec
    return EncoderWeights(np.ascontiguousarray(W, dtype=np.float32), None if b is None else b.astype(np.float32), info)


def orient(W: np.ndarray, b: np.ndarray | None, orientation: str) -> np.ndarray:
    if orientation == "in_out":
        W = W.T
    elif orientation == "auto":
        if b is None or W.shape[0] == W.shape[1]:
            raise DictionaryError(
                f"cannot tell which axis of the {W.shape} encoder holds the features; pass orientation "
                "'in_out' ([hidden, features], as SAELens) or 'out_in' ([features, hidden], as nn.Linear)"
            )
        if W.shape[1] == len(b):
            W = W.T
        elif W.shape[0] != len(b):
            raise DictionaryError(f"the bias has {len(b)} entries, matching neither axis of the {W.shape} encoder")
    elif orientation != "out_in":
        raise DictionaryError(f"orientation must be 'auto', 'in_out' or 'out_in', got {orientation!r}")
    if b is not None and len(b) != W.shape[0]:
        raise DictionaryError(f"the bias has {len(b)} entries for {W.shape[0]} features")
    return np.ascontiguousarray(W)


def sparsify(W: np.ndarray, *, threshold: float | None = None, topk_per_feature: int | None = None):
    """CSR (data, indices, indptr) of W [features, hidden], keeping weights by magnitude; + mass kept."""
    if threshold is not None and topk_per_feature is not None:
        raise DictionaryError("pass either threshold or topk_per_feature, not both")
    absW = np.abs(W)
    if topk_per_feature is not None:
        if topk_per_feature < 1:
            raise DictionaryError("topk_per_feature must be >= 1")
        k = min(topk_per_feature, W.shape[1])
        top = np.argpartition(-absW, k - 1, axis=1)[:, :k]
        keep = np.zeros(W.shape, dtype=bool)
        np.put_along_axis(keep, top, True, axis=1)
        keep &= W != 0
    else:
        if threshold is not None and threshold < 0:
            raise DictionaryError("threshold must be >= 0")
        keep = absW >= threshold if threshold else W != 0
    total = float(absW.sum(dtype=np.float64))
    kept = float(absW[keep].sum(dtype=np.float64))
    rows, cols = np.nonzero(keep)  # row-major order: CSR
    data = W[rows, cols]
    if data.size and np.abs(data).max() > np.finfo(np.float16).max:
        raise DictionaryError("a weight does not fit in float16 (|w| > 65504); rescale the encoder first")
    if data.size >= 2**31:
        raise DictionaryError("more than 2^31 weights kept: int32 indptr cannot address them; sparsify further")
    indptr = np.zeros(W.shape[0] + 1, dtype=np.int32)
    np.cumsum(np.bincount(rows, minlength=W.shape[0]), out=indptr[1:])
    return data.astype(np.float16), cols.astype(np.int32), indptr, (kept / total if total else 1.0)


def model_hash_of(revision: str | None = None, config: dict | str | os.PathLike | None = None) -> str:
    """The model's revision when known, else sha256 of its canonical config JSON, else 'unknown'."""
    if revision:
        return revision
    if config is not None:
        if not isinstance(config, dict):
            config = json.loads(Path(config).read_text())
        canon = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
        return "sha256:" + hashlib.sha256(canon).hexdigest()
    return "unknown"


def export_sae(
    source: Any = None,
    *,
    layer: int,
    root: str | os.PathLike,
    dictionary: str,
    W_enc: Any = None,
    b_enc: Any = None,
    orientation: str = "auto",
    weight_key: str | None = None,
    bias_key: str | None = None,
    b_dec_key: str | None = None,
    hookpoint: str | None = None,
    threshold: float | None = None,
    topk_per_feature: int | None = None,
    model_revision: str | None = None,
    model_config: dict | str | os.PathLike | None = None,
    file_format: str = "npz",
    activation: str | dict | None = None,
) -> ExportReport:
    """Add one layer's encoder to dictionary ``root/dictionary`` (created if needed); returns a report.

    >>> export_sae("sae-folder/", layer=12, root="sae", dictionary="my-sae", topk_per_feature=64)  # doctest: +SKIP
    >>> export_sae("sparsify-run/", layer=6, root="sae", dictionary="s", hookpoint="layers.6")    # doctest: +SKIP
    >>> export_sae(layer=3, root="sae", dictionary="d", W_enc=w, b_enc=b, threshold=0.01)        # doctest: +SKIP

    ``source`` is a SAELens or sparsify save (a folder; ``hookpoint`` picks one SAE of a folder
    holding several) or a .safetensors/.npz file. Decoder biases that the SAE subtracts from its
    input are folded into the bias (``b' = b_enc - W_enc b_dec``), so the dictionary's scores equal
    the SAE's own pre-activations; meta.json records what was folded for each layer.

    ``activation`` is the SAE's activation rule (``relu``, ``topk:K``, ``groupmax:K``, ``jumprelu``,
    ``batchtopk:T``, or its dict; lmprobe.sae.activation): a SAELens or sparsify save records its
    own, and plain arrays default to relu. meta.json keeps it, so that ``lmprobe features``,
    ``sae-topk`` and ``encode`` fire features as the SAE does.

    Layers already in the dictionary are replaced; meta.json's feature_count and layer_ranges are
    rewritten to match. Every file is written under a temporary name and renamed into place, the
    metadata last, and the result is validated.
    """
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise DictionaryError(f"layer must be a non-negative integer, got {layer!r}")
    if file_format not in ("npz", "safetensors"):
        raise DictionaryError("file_format must be 'npz' or 'safetensors'")
    if (source is None) == (W_enc is None):
        raise DictionaryError("pass either a source (file or SAELens folder) or W_enc arrays")
    given = parse_rule(activation) if isinstance(activation, str) else activation  # checked before reading weights
    if source is not None:
        enc = read_encoder(source, weight_key=weight_key, bias_key=bias_key, b_dec_key=b_dec_key,
                           orientation=orientation, hookpoint=hookpoint)
        W, b, source_info, folded = enc.W, enc.b, dict(enc.info), enc.threshold
    else:
        b = None if b_enc is None else to_numpy(b_enc).astype(np.float32).reshape(-1)
        W = orient(to_numpy(W_enc).astype(np.float32), b, orientation)
        source_info, folded = {"source": "arrays", "b_dec_folded": False}, None
    recorded = source_info.get("activation")
    if given is not None and recorded is not None and given != recorded:
        raise DictionaryError(f"the save records activation {describe(recorded)}; --activation {describe(given)} "
                              "contradicts it (leave --activation out for a SAELens or sparsify save)")
    if recorded is None:  # a save's own rule was checked as it was read
        source_info["activation"] = check_rule(given or dict(RELU), W.shape[0], "the activation rule")
    data, indices, indptr, mass = sparsify(W, threshold=threshold, topk_per_feature=topk_per_feature)
    ddir = check_output_path(Path(root) / dictionary, "dictionary")
    with OutputLock(ddir):
        return _write_layer(ddir, layer, W, b, data, indices, indptr, mass, source_info, file_format=file_format,
                            model_revision=model_revision, model_config=model_config, threshold=folded)


def _write_layer(ddir: Path, layer: int, W, b, data, indices, indptr, mass: float, source_info: dict, *,
                 file_format: str, model_revision, model_config, threshold: np.ndarray | None) -> ExportReport:
    root, dictionary = ddir.parent, ddir.name
    fmt = "csr.npz" if file_format == "npz" else "csr.safetensors"
    ddir.mkdir(parents=True, exist_ok=True)
    meta_path = ddir / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else None
    if meta is not None and meta.get("format") != fmt:
        raise DictionaryError(f"{meta_path} says format {meta.get('format')!r}; this export writes {fmt!r}")

    # write the layer folder next to its final place, then swap it in
    tmp = ddir / f".tmp-layer_{layer}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    shape = np.array(W.shape, dtype=np.int64)
    if file_format == "npz":
        with open(tmp / "encoder.npz", "wb") as f:
            np.savez(f, data=data, indices=indices, indptr=indptr, shape=shape)
        if b is not None:
            np.save(tmp / "bias.npy", b.astype(np.float16))
        if threshold is not None:
            np.save(tmp / "threshold.npy", threshold.astype(np.float32))
    else:
        from safetensors.numpy import save_file

        save_file({"data": data, "indices": indices, "indptr": indptr, "shape": shape}, str(tmp / "encoder.safetensors"))
        if b is not None:
            save_file({"bias": b.astype(np.float16)}, str(tmp / "bias.safetensors"))
        if threshold is not None:
            save_file({"threshold": threshold.astype(np.float32)}, str(tmp / "threshold.safetensors"))
    final = ddir / f"layer_{layer}"
    old = None
    if final.exists():
        old = ddir / f".old-layer_{layer}-{uuid.uuid4().hex[:8]}"
        move_into_place(final, old)
    move_into_place(tmp, final)
    if old is not None:
        shutil.rmtree(old)

    # meta.json last: feature ranges in layer order
    sizes = {}
    for p in ddir.iterdir():
        if p.is_dir() and p.name.startswith("layer_") and p.name[6:].isdigit():
            n = W.shape[0] if int(p.name[6:]) == layer else _features_of(ddir, int(p.name[6:]), meta)
            sizes[int(p.name[6:])] = n
    ranges, start = {}, 0
    for lyr in sorted(sizes):
        ranges[str(lyr)] = [start, start + sizes[lyr]]
        start += sizes[lyr]
    new_hash = model_hash_of(model_revision, model_config)
    if meta is not None and meta.get("model_hash") not in (None, "unknown", new_hash) and new_hash != "unknown":
        raise DictionaryError(
            f"{meta_path} belongs to model {meta['model_hash']!r}, this encoder to {new_hash!r}; use another dictionary"
        )
    sources = {k: v for k, v in ((meta or {}).get("layer_sources") or {}).items() if k in ranges}
    sources[str(layer)] = source_info
    new_meta = {
        "version": (meta or {}).get("version", DICT_VERSION),
        "model_hash": new_hash if new_hash != "unknown" else (meta or {}).get("model_hash", "unknown"),
        "feature_count": start,
        "dtype": "fp16",
        "format": fmt,
        "layer_ranges": ranges,
        "layer_sources": dict(sorted(sources.items(), key=lambda kv: int(kv[0]))),
    }
    atomic_write(meta_path, json.dumps(new_meta, indent=2) + "\n")
    problems = validate_dictionary(root, dictionary)
    if problems:
        raise DictionaryError("the exported dictionary does not validate: " + "; ".join(problems))
    return ExportReport(layer, W.shape[0], W.shape[1], int(data.size), mass, final, source_info["activation"])


def _features_of(ddir: Path, layer: int, meta: dict | None) -> int:
    ranges = (meta or {}).get("layer_ranges") or {}
    if str(layer) in ranges:
        a, b = ranges[str(layer)]
        return b - a
    dct = load_dictionary(SAEConfig(root_path=ddir.parent, dictionary_name=ddir.name, device="cpu"))
    return dct.get_layer(layer).feature_count
