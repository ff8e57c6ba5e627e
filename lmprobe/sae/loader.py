"""SAE dictionaries: lazy loading of per-layer CSR encoders, and top-k feature projection.

Layout (docs/sae.md):

    <root>/<name>/meta.json                 version, model_hash, feature_count, dtype, format[, layer_ranges]
    <root>/<name>/layer_<L>/encoder.npz     CSR of W_enc [features, hidden_dim]: data f16, indices i32, indptr i32, shape
    <root>/<name>/layer_<L>/bias.npy        optional f16 bias, one per feature
    (or encoder.safetensors / bias.safetensors with the same tensors, format "csr.safetensors")

numpy is optional: without it, arrays are read by a small pure-Python parser and projections use
a bounded heap; both paths give the same features and scores (float32 accumulation on the numpy
path, rounded to float32 on the pure-Python one). torch is never needed.

One file past 600 lines, on purpose: the dictionary document (libs/sae/loader.py) names this one
module as the loader a third party copies, with its pure-Python fallback beside the numpy path.
"""

from __future__ import annotations

import heapq
import importlib
import math
import os
import re
import struct
import sys
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..base.allocator import check_memory
from ..base.paths import resolve_inside
from ..base.safeio import check_regular, read_json
from ..errors import DictionaryError, InvalidArgumentError, UnsafePathError
from ..storage.folders import remote_folder
from .activation import RELU, activate, activate_list, activation_rule, check_rule
from .npyio import check_declared_sizes, load_npy, load_npz, load_safetensors

REQUIRED_META = {"version": str, "model_hash": str, "feature_count": int, "dtype": str, "format": str}
FORMATS = ("csr.npz", "csr.safetensors")
#: the largest hidden size a dictionary may declare: its shape is read from a file and sizes every
#: probe vector and dense expansion, so a damaged one must not allocate without bound
MAX_HIDDEN_DIM = 1 << 20
SEMVER_RE = re.compile(r"^\d+\.\d+\.\d+(?:[-+][0-9A-Za-z.-]+)?$")


def _numpy():
    """numpy if importable, else None (the pure-Python path)."""
    try:
        return importlib.import_module("numpy")
    except ImportError:
        return None


def _may_have_cuda() -> bool:
    """Whether torch could see a GPU, answered without importing it (about a second, on every ``sae-topk``):
    torch is imported already, or a GPU device node exists (NVIDIA, or AMD's for ROCm) and CUDA_VISIBLE_DEVICES
    does not hide every device. Elsewhere than Linux, only torch can tell."""
    if "torch" in sys.modules or not sys.platform.startswith("linux"):
        return True
    if os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return False
    return any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/kfd").exists()


def detect_device(device: str = "auto") -> str:
    """The device projections run on: 'cpu', or 'cuda[:N]' (batched projections then run in torch there).

    'auto' picks CUDA when torch is installed and sees a GPU, else the CPU. Asking for CUDA where
    it is not available is an error, not a silent fallback.
    """
    if device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", str(device)):
        raise InvalidArgumentError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if device == "cpu" or (device == "auto" and not _may_have_cuda()):
        return "cpu"
    try:
        torch = importlib.import_module("torch")
        available = torch.cuda.is_available()
    except ImportError:
        available = False
    if device == "auto":
        return "cuda" if available else "cpu"
    if not available:
        raise InvalidArgumentError(f"device {device!r} was asked for, but CUDA is not available here "
                                   "(needs torch with a GPU); use device='cpu' or 'auto'")
    return device


@dataclass
class SAEConfig:
    """Where a dictionary lives and how to hold it.

    ``root_path`` is a folder holding dictionaries, a Hub model repo (``hf://owner/name`` or
    ``hf://models/owner/name``) or an object-storage prefix (``s3://bucket/saes``) holding ``<dictionary_name>/...``.
    """

    root_path: str | os.PathLike
    """A folder holding dictionaries, an ``hf://`` repo URL, or an object-storage URL (``s3://``, fsspec's)."""
    dictionary_name: str
    """The dictionary's folder name under ``root_path``."""
    device: str = "auto"
    """Where batched projections run: 'cpu' (numpy), 'cuda[:N]' (torch), or 'auto'."""
    dtype: str = "fp16"
    """How weights are held in memory: 'fp16' (as stored) or 'fp32' (converted once at load: faster
    single-vector projections, twice the memory)."""
    prefer_sparse: bool = True
    """Keep layers as CSR; False expands each layer to a dense float32 matrix when it loads."""
    cache_layers: int = 2
    """Layers kept in memory (least recently used ones are dropped)."""
    revision: str | None = None
    """Hub revision of an ``hf://`` root."""
    token: str | None = None
    """Hub token for a private ``hf://`` root (never stored)."""

    def __post_init__(self):
        if not isinstance(self.dictionary_name, str) or not re.fullmatch(r"[A-Za-z0-9][\w.\-]*", self.dictionary_name):
            raise DictionaryError(f"dictionary_name {self.dictionary_name!r} must be a plain folder name")
        if not isinstance(self.cache_layers, int) or self.cache_layers < 1:
            raise DictionaryError(f"cache_layers must be a positive integer, got {self.cache_layers!r}")
        if self.dtype not in ("fp16", "fp32"):
            raise DictionaryError(f"dtype must be 'fp16' or 'fp32', got {self.dtype!r}")
        self.device = detect_device(self.device)


@dataclass
class SAELayerWeights:
    """One layer's encoder in CSR form: row i is feature i, columns are hidden dimensions."""

    layer: int
    data: Any  # float16 values (numpy array or list)
    indices: Any  # int32 column of each value
    indptr: Any  # int32 row starts, features + 1 entries
    shape: tuple[int, int]  # (features, hidden_dim)
    bias: Any = None  # float16 (float32 when loaded with dtype="fp32"), one per feature
    device: str = "cpu"  # where batched projections of this layer run
    activation: dict = field(default_factory=lambda: dict(RELU))  # the SAE's rule (lmprobe.sae.activation)
    threshold: Any = None  # jumprelu: the threshold folded into the bias, one per feature (float32)
    _dense: Any = field(default=None, repr=False)
    _data32: Any = field(default=None, repr=False)
    _dense_torch: Any = field(default=None, repr=False)

    @property
    def feature_count(self) -> int:
        return self.shape[0]

    @property
    def hidden_dim(self) -> int:
        return self.shape[1]

    @property
    def nnz(self) -> int:
        return len(self.data)


def _check_meta(meta: Any, path: Path) -> dict:
    if not isinstance(meta, dict):
        raise DictionaryError(f"{path}: meta.json must hold a JSON object")
    problems = []
    for key, typ in REQUIRED_META.items():
        if key not in meta:
            problems.append(f"missing required field {key!r}")
        elif not isinstance(meta[key], typ) or isinstance(meta[key], bool):
            problems.append(f"field {key!r} must be a {typ.__name__}, got {type(meta[key]).__name__}")
    if not problems:
        if not SEMVER_RE.match(meta["version"]):
            problems.append(f"version {meta['version']!r} is not semver (MAJOR.MINOR.PATCH)")
        if meta["feature_count"] < 1:
            problems.append("feature_count must be positive")
        if meta["format"] not in FORMATS:
            problems.append(f"format {meta['format']!r} is not one of {list(FORMATS)}")
    ranges = meta.get("layer_ranges")
    if ranges is not None:
        items = ranges.items() if isinstance(ranges, dict) else enumerate(ranges) if isinstance(ranges, list) else None
        if items is None:
            problems.append("layer_ranges must be a dict {layer: [start, end]} or a list")
        else:
            for k, v in items:
                if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v) and 0 <= v[0] <= v[1]):
                    problems.append(f"layer_ranges[{k!r}] must be [start, end] with 0 <= start <= end")
    if problems:
        raise DictionaryError(f"{path}: " + "; ".join(problems))
    return meta


def _load_arrays(files: dict[str, Path], fmt: str, layer: int) -> tuple[dict, Any]:
    """Read encoder (and bias) arrays: numpy arrays when numpy is there, else (list, shape) pairs."""
    np = _numpy()
    enc_path, bias_path = files["encoder"], files.get("bias")
    if fmt == "csr.npz":
        if np is not None:
            need = sum(check_declared_sizes(p) for p in (enc_path, bias_path) if p is not None)
            check_memory(need, f"layer {layer}'s encoder ({enc_path})", error=DictionaryError,
                         fix="use a machine with more memory, or a dictionary with fewer features")
            with np.load(enc_path, allow_pickle=False) as z:
                enc = {k: z[k] for k in z.files}
            bias = np.load(bias_path, allow_pickle=False) if bias_path else None
        else:
            enc = load_npz(enc_path)
            bias = load_npy(bias_path) if bias_path else None
    else:
        if np is not None:
            from safetensors.numpy import load_file

            enc = load_file(str(enc_path))
            bias = load_file(str(bias_path)).get("bias") if bias_path else enc.pop("bias", None)
        else:
            enc = load_safetensors(enc_path)
            bias = load_safetensors(bias_path).get("bias") if bias_path else enc.pop("bias", None)
    return enc, bias


def _to_layer(enc: dict, bias: Any, layer: int, where: str) -> SAELayerWeights:
    np = _numpy()
    missing = [k for k in ("data", "indices", "indptr", "shape") if k not in enc]
    if missing:
        raise DictionaryError(f"{where}: encoder is missing key(s) {missing} (needs data, indices, indptr, shape)")

    def ndim(v) -> int:  # a numpy array, or the pure-Python path's (values, shape)
        return v.ndim if np is not None and hasattr(v, "dtype") else len(v[1])

    def flat(v):
        return v if np is not None and hasattr(v, "dtype") else v[0]

    for name in ("data", "indices", "indptr", "shape", "bias"):
        v = bias if name == "bias" else enc[name]
        if v is not None and ndim(v) != 1:  # a 2-D bias would broadcast into a (features, features) score
            shape = list(v.shape) if hasattr(v, "shape") else list(v[1])
            raise DictionaryError(f"{where}: {name} must be a 1-D array, got shape {shape}" + (
                "; shape must be [features, hidden_dim]" if name == "shape" else ""))
    data, indices, indptr, shape = (flat(enc[k]) for k in ("data", "indices", "indptr", "shape"))
    if len(shape) != 2 or any(isinstance(x, float) or not float(x).is_integer() for x in shape) \
            or min(int(x) for x in shape) < 1:
        raise DictionaryError(f"{where}: shape must be [features, hidden_dim], got {list(shape)[:4]}")
    shape = tuple(int(x) for x in shape)
    if np is not None:
        for name, arr, want in (("data", data, ("float16", "float32")), ("indices", indices, ("int32",)),
                                ("indptr", indptr, ("int32", "int64"))):
            if str(arr.dtype) not in want:
                raise DictionaryError(f"{where}: {name} must be a 1-D {want[0]} array, got {arr.dtype} {arr.shape}")
    _check_finite(data, f"{where}: {{n}} of the encoder's weights are not finite (NaN or infinity); the dictionary "
                        "is damaged: export it again")
    rows, cols = shape
    if cols > MAX_HIDDEN_DIM:
        raise DictionaryError(f"{where}: hidden_dim {cols} is larger than any model's hidden size (lmprobe reads up to "
                              f"{MAX_HIDDEN_DIM}); the shape is damaged")
    if len(indptr) != rows + 1:
        raise DictionaryError(f"{where}: indptr has {len(indptr)} entries, expected features + 1 = {rows + 1}")
    if len(data) != len(indices) or int(indptr[-1]) != len(data) or int(indptr[0]) != 0:
        raise DictionaryError(f"{where}: inconsistent CSR: {len(data)} values, {len(indices)} indices, indptr ends at {indptr[-1]}")
    if np is not None:
        if np.any(np.diff(indptr) < 0):
            raise DictionaryError(f"{where}: indptr must not decrease")
        if len(indices) and (indices.min() < 0 or indices.max() >= cols):
            raise DictionaryError(f"{where}: a column index is outside 0..{cols - 1}")
    else:
        if any(b < a for a, b in zip(indptr[:-1], indptr[1:], strict=True)):
            raise DictionaryError(f"{where}: indptr must not decrease")
        if indices and (min(indices) < 0 or max(indices) >= cols):
            raise DictionaryError(f"{where}: a column index is outside 0..{cols - 1}")
    if bias is not None:
        b = bias if np is not None and hasattr(bias, "dtype") else bias[0]
        if np is not None and hasattr(b, "dtype") and b.dtype.kind != "f":
            raise DictionaryError(f"{where}: bias must be a 1-D float16 array, got {b.dtype}")
        if len(b) != rows:
            raise DictionaryError(f"{where}: bias has {len(b)} entries, expected one per feature ({rows})")
        _check_finite(b, f"{where}: {{n}} bias values are not finite (NaN or infinity); the dictionary is damaged: "
                         "export it again")
        bias = b
    return SAELayerWeights(layer, data, indices, indptr, (rows, cols), bias)


def _check_finite(values: Any, message: str) -> None:
    """DictionaryError(``message`` with ``{n}`` the count) unless every value is finite: a NaN weight, bias or
    threshold makes every score NaN, and a NaN never fires, so the SAE would silently say nothing."""
    np = _numpy()
    if np is not None and hasattr(values, "dtype"):
        n = int(values.size - np.count_nonzero(np.isfinite(values)))
    else:
        n = sum(1 for v in values if not math.isfinite(v))
    if n:
        raise DictionaryError(message.format(n=n))


class SAEDictionary:
    """A dictionary whose layers load on first use and stay in an LRU of ``cache_layers`` layers."""

    def __init__(self, cfg: SAEConfig):
        self.cfg = cfg
        self._source = _DictSource(cfg)
        meta_path = self._source.fetch("meta.json")
        meta = read_json(meta_path, what=str(meta_path), error=DictionaryError)
        self.meta = _check_meta(meta, Path(meta_path))
        self._cache: OrderedDict[int, SAELayerWeights] = OrderedDict()

    @property
    def device(self) -> str:
        return self.cfg.device

    @property
    def layers(self) -> list[int]:
        ranges = self.meta.get("layer_ranges")
        if isinstance(ranges, dict):
            return sorted(int(k) for k in ranges)
        return self._source.list_layers()

    def _files(self, layer: int) -> dict[str, Path]:
        fmt = self.meta["format"]
        ext = "npz" if fmt == "csr.npz" else "safetensors"
        bias_ext = "npy" if fmt == "csr.npz" else "safetensors"
        d = f"layer_{layer}"
        enc = self._source.fetch(f"{d}/encoder.{ext}", required=False)
        if enc is None:
            raise DictionaryError(
                f"{self._source.describe(d)}/encoder.{ext} is missing: layer {layer} is not in dictionary "
                f"{self.cfg.dictionary_name!r} (layers: {self.layers})"
            )
        files = {"encoder": Path(enc)}
        bias = self._source.fetch(f"{d}/bias.{bias_ext}", required=False)
        if bias is not None:
            files["bias"] = Path(bias)
        return files

    def get_layer(self, layer: int) -> SAELayerWeights:
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise DictionaryError(f"layer must be a non-negative integer, got {layer!r}")
        if layer in self._cache:
            self._cache.move_to_end(layer)
            return self._cache[layer]
        files = self._files(layer)
        try:
            enc, bias = _load_arrays(files, self.meta["format"], layer)
        except (OSError, KeyError, ValueError, EOFError, struct.error, zipfile.BadZipFile) as exc:
            if isinstance(exc, DictionaryError) and str(files["encoder"]) in str(exc):
                raise
            raise DictionaryError(f"{files['encoder']}: cannot read the encoder ({type(exc).__name__}: {exc})") from None
        weights = _to_layer(enc, bias, layer, str(files["encoder"]))
        ranges = self.meta.get("layer_ranges")
        if isinstance(ranges, dict) and str(layer) in ranges:
            start, end = ranges[str(layer)]
            if end - start != weights.feature_count:
                raise DictionaryError(
                    f"{files['encoder']}: {weights.feature_count} features but meta.json layer_ranges gives "
                    f"[{start}, {end}]"
                )
        weights.device = self.cfg.device
        where = f"{self._source.describe('meta.json')} layer {layer}"
        source = (self.meta.get("layer_sources") or {}).get(str(layer)) if isinstance(
            self.meta.get("layer_sources"), dict) else None
        weights.activation = check_rule(activation_rule(source), weights.feature_count, where)
        if weights.activation["rule"] == "jumprelu":
            weights.threshold = self._threshold(layer, weights.feature_count)
        np = _numpy()
        if self.cfg.dtype == "fp32":
            if np is not None:
                weights.data = weights.data.astype(np.float32)
                weights._data32 = weights.data
                if weights.bias is not None:
                    weights.bias = weights.bias.astype(np.float32)
            # the pure-Python path holds Python floats already
        if not self.cfg.prefer_sparse and np is not None:
            dense_encoder(weights)  # expand now: batched projections are then a matrix product
        self._cache[layer] = weights
        while len(self._cache) > self.cfg.cache_layers:
            self._cache.popitem(last=False)
        return weights

    def _threshold(self, layer: int, features: int) -> Any:
        """A JumpReLU layer's folded thresholds (``layer_<L>/threshold.npy`` or ``.safetensors``), or None."""
        npz = self.meta["format"] == "csr.npz"
        rel = f"layer_{layer}/threshold.{'npy' if npz else 'safetensors'}"
        path = self._source.fetch(rel, required=False)
        if path is None:
            return None
        np = _numpy()
        try:
            if npz:
                if np is not None:
                    check_declared_sizes(path)  # numpy allocates what the header declares before reading
                t = np.load(path, allow_pickle=False) if np is not None else load_npy(path)[0]
            else:
                if np is not None:
                    from safetensors.numpy import load_file

                    t = load_file(str(path)).get("threshold")
                else:
                    t = load_safetensors(path).get("threshold")
                    t = t[0] if t is not None else None
        except (OSError, KeyError, ValueError, EOFError, struct.error) as exc:
            raise DictionaryError(f"{path}: cannot read the thresholds ({type(exc).__name__}: {exc})") from None
        if t is None or len(t) != features or (np is not None and getattr(t, "ndim", 1) != 1) \
                or (np is not None and t.dtype.kind != "f"):
            raise DictionaryError(f"{path}: expected one float threshold per feature ({features})")
        _check_finite(t, f"{path}: {{n}} thresholds are not finite (NaN or infinity); the dictionary is damaged: "
                         "export it again")
        return np.asarray(t, dtype=np.float32) if np is not None else [float(v) for v in t]

    def cached_layers(self) -> list[int]:
        return list(self._cache)


class _DictSource:
    """Dictionary files in a local folder, a Hub repo or object storage (downloaded on first use)."""

    def __init__(self, cfg: SAEConfig):
        root = os.fspath(cfg.root_path)
        self.name = cfg.dictionary_name
        # a remote root's files through the storage layer (HubFiles, ObjectStoreFiles); a local folder read here
        self.remote = remote_folder(root, self.name, revision=cfg.revision, token=cfg.token)
        if self.remote is None:
            self.dir = Path(root) / self.name
            if not self.dir.is_dir():
                raise DictionaryError(f"no dictionary {self.name!r} in {root} ({self.dir} is not a folder)")

    def describe(self, sub: str) -> str:
        return f"{self.remote}/{sub}" if self.remote else str(self.dir / sub)

    def fetch(self, rel: str, required: bool = True) -> Path | None:
        if self.remote is None:
            try:
                p = resolve_inside(self.dir, rel, "dictionary file")  # symlinks may not lead outside it
                if not p.exists():
                    if required:
                        raise DictionaryError(f"{self.dir / rel} is missing")
                    return None
                return check_regular(p, "dictionary file")
            except UnsafePathError as exc:
                raise DictionaryError(str(exc)) from None
        if not self.remote.has(rel):
            if required:
                raise DictionaryError(f"{self.describe(rel)} is missing")
            return None
        return self.remote.fetch(rel, what="dictionary file")

    def list_layers(self) -> list[int]:
        if self.remote is None:
            names = [p.name for p in self.dir.iterdir()]
        else:
            names = [f.split("/")[0] for f in self.remote.listing() if "/" in f]
        return sorted({int(n[6:]) for n in names if re.fullmatch(r"layer_\d+", n)})


def load_dictionary(cfg: SAEConfig) -> SAEDictionary:
    """Open a dictionary (reads meta.json only; layers load on first ``get_layer``).

    >>> dct = load_dictionary(SAEConfig(root_path="sae", dictionary_name="my-sae"))  # doctest: +SKIP
    >>> project_topk(dct.get_layer(12), vector, k=10)                                 # doctest: +SKIP
    """
    return SAEDictionary(cfg)


# ------------------------------------------------------------------------------------------ projection


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _check_vec_len(n: int, layer: SAELayerWeights) -> None:
    if n != layer.hidden_dim:
        raise InvalidArgumentError(f"probe vector has length {n}, but layer {layer.layer} expects hidden_dim {layer.hidden_dim}")


def _scores_numpy(np, layer: SAELayerWeights, x):
    """(features,) float32 scores: a gather-dot per CSR row, float32 accumulation."""
    if layer._dense is not None:  # expanded already (prefer_sparse=False, or a batched call): one matvec
        scores = layer._dense @ x
        return scores + np.asarray(layer.bias, dtype=np.float32) if layer.bias is not None else scores
    if layer._data32 is None:
        layer._data32 = layer.data.astype(np.float32)
    prod = layer._data32 * x[layer.indices]
    indptr = np.asarray(layer.indptr, dtype=np.int64)
    scores = np.zeros(layer.feature_count, dtype=np.float32)
    nonempty = indptr[:-1] < indptr[1:]
    if prod.size:
        sums = np.add.reduceat(prod, indptr[:-1][nonempty]) if nonempty.any() else np.zeros(0, np.float32)
        scores[nonempty] = sums
    if layer.bias is not None:
        scores += np.asarray(layer.bias, dtype=np.float32)
    return scores


def _topk_from_scores(np, scores, k: int) -> list[tuple[int, float]]:
    k = min(k, len(scores))
    if k <= 0:
        return []
    idx = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
    order = np.lexsort((idx, -scores[idx]))  # score descending, then feature index
    return [(int(i), float(scores[i])) for i in idx[order]]


def _probe_vector(layer: SAELayerWeights, dense_vec: Any, k: int) -> tuple[Any, Any]:
    """(numpy, the vector as float32) for the numpy path, or (None, None) for the pure-Python one; checks k."""
    if not isinstance(k, int) or k < 1:
        raise InvalidArgumentError(f"k must be a positive integer, got {k!r}")
    np = _numpy()
    if np is None or not hasattr(layer.data, "dtype"):
        return None, None
    x = np.asarray(dense_vec, dtype=np.float32).reshape(-1)
    _check_vec_len(x.shape[0], layer)
    return np, x


def project_topk(layer: SAELayerWeights, dense_vec: Any, k: int = 256) -> list[tuple[int, float]]:
    """Top-``k`` features of one dense vector: ``[(feature_index, score)]`` by descending score.

    score_i = sum_j W_enc[i, j] * x[j] (+ bias[i]). No ReLU or normalisation is applied.
    """
    np, x = _probe_vector(layer, dense_vec, k)
    if np is not None:
        return _topk_from_scores(np, _scores_numpy(np, layer, x), k)
    x = [float(v) for v in dense_vec]
    _check_vec_len(len(x), layer)
    heap: list[tuple[float, int]] = []  # min-heap of (score, -index): the k best so far
    data, indices, indptr, bias = layer.data, layer.indices, layer.indptr, layer.bias
    for i in range(layer.feature_count):
        s = 0.0
        for p in range(indptr[i], indptr[i + 1]):
            s += data[p] * x[indices[p]]
        if bias is not None:
            s += bias[i]
        s = _f32(s)
        item = (s, -i)
        if len(heap) < k:
            heapq.heappush(heap, item)
        elif item > heap[0]:
            heapq.heapreplace(heap, item)
    return [(-neg, s) for s, neg in sorted(heap, key=lambda t: (-t[0], -t[1]))]


def project_topk_batch(layer: SAELayerWeights, vectors: Any, k: int = 256, *, chunk: int = 256) -> list[list[tuple[int, float]]]:
    """``project_topk`` for many vectors at once (``vectors``: (batch, hidden_dim)).

    With numpy, the layer is expanded once to a dense float32 matrix (cached on the layer, so
    it costs features x hidden_dim x 4 bytes) and scores are one matrix product per chunk.
    """
    np = _numpy()
    if np is None or not hasattr(layer.data, "dtype"):
        return [project_topk(layer, v, k) for v in vectors]
    X = np.asarray(vectors, dtype=np.float32)
    if X.ndim != 2:
        raise InvalidArgumentError(f"vectors must be 2-D (batch, hidden_dim), got shape {X.shape}")
    _check_vec_len(X.shape[1], layer)
    out = []
    for s in range(0, len(X), chunk):
        S = batch_scores(layer, X[s : s + chunk])  # (chunk, features)
        out.extend(_topk_from_scores(np, row, k) for row in S)
    return out


def encode(layer: SAELayerWeights, X: Any):
    """(batch, features) float32 feature activations of ``X`` (batch, hidden_dim) under the layer's recorded rule.

    What the SAE's own ``encode`` gives on the same vectors (lmprobe.sae.activation): a top-k
    layer's rows hold at most k non-zero activations; a relu layer's, every positive score.
    """
    return activate(layer.activation, batch_scores(layer, X), layer.threshold)


def encode_topk(layer: SAELayerWeights, dense_vec: Any, k: int = 256) -> list[tuple[int, float]]:
    """The ``k`` strongest *firing* features of one vector under the layer's rule: ``[(feature, activation)]``.

    Unlike ``project_topk`` (raw scores, as the dictionary format defines it), features that do not
    fire are left out, so a top-k SAE gives at most its k.
    """
    np, x = _probe_vector(layer, dense_vec, k)
    if np is not None:
        acts = activate(layer.activation, _scores_numpy(np, layer, x)[None, :], layer.threshold)[0]
        return [(i, a) for i, a in _topk_from_scores(np, acts, k) if a > 0]
    scores = [s for _, s in sorted(project_topk(layer, dense_vec, k=layer.feature_count))]
    acts = activate_list(layer.activation, scores, layer.threshold)
    best = sorted(((a, i) for i, a in enumerate(acts) if a > 0), key=lambda t: (-t[0], t[1]))[:k]
    return [(i, a) for a, i in best]


def batch_scores(layer: SAELayerWeights, X):
    """(batch, features) float32 scores ``X @ W_enc.T (+ bias)`` as numpy; on the layer's device.

    On the CPU a dense float32 copy of the layer is multiplied with numpy (BLAS beats sparse
    kernels at SAE densities); on a CUDA device the same copy lives on the GPU and torch multiplies.
    """
    np = _numpy()
    if layer.device == "cpu":
        S = np.asarray(X, dtype=np.float32) @ dense_encoder(layer).T
        if layer.bias is not None:
            S += np.asarray(layer.bias, dtype=np.float32)
        return S
    import torch

    if layer._dense_torch is None:
        W = torch.from_numpy(dense_encoder(layer)).to(layer.device)
        b = torch.from_numpy(np.asarray(layer.bias, dtype=np.float32)).to(layer.device) if layer.bias is not None else None
        layer._dense_torch = (W, b)
    W, b = layer._dense_torch
    S = torch.as_tensor(np.asarray(X, dtype=np.float32)).to(layer.device) @ W.T
    if b is not None:
        S += b
    return S.cpu().numpy()


def dense_encoder(layer: SAELayerWeights):
    """The layer's W_enc as a dense float32 (features, hidden_dim) array, built once and cached."""
    np = _numpy()
    if layer._dense is None:
        rows, cols = layer.shape  # from the file: a small one may claim millions of features
        check_memory(rows * cols * 4, f"layer {layer.layer} as a dense {rows} x {cols} float32 matrix",
                     fix="use a machine with more memory, or a dictionary with fewer features", error=DictionaryError)
        try:
            W = np.zeros(layer.shape, dtype=np.float32)
        except MemoryError:  # a limit check_memory could not see: still one line
            raise DictionaryError(f"layer {layer.layer} as a dense {rows} x {cols} float32 matrix needs "
                                  f"{rows * cols * 4:,} bytes of memory, more than this process can allocate; use a "
                                  "machine with more memory, or a dictionary with fewer features") from None
        rows = np.repeat(np.arange(layer.feature_count), np.diff(np.asarray(layer.indptr, dtype=np.int64)))
        W[rows, layer.indices] = layer.data.astype(np.float32)
        layer._dense = W
    return layer._dense


def is_dictionary_folder(path: str | os.PathLike) -> bool:
    """A folder holding an SAE dictionary's meta.json (``<root>/<name>/``), not an lmprobe dataset."""
    p = Path(path)
    return (p / "meta.json").is_file() and not (p / "index").is_dir() and not (p / "metadata.json").exists()


def validate_dictionary(root: str | os.PathLike, name: str) -> list[str]:
    """Every problem of a local dictionary, in one pass (empty list: valid)."""
    problems = []
    try:
        dct = load_dictionary(SAEConfig(root_path=root, dictionary_name=name, device="cpu", cache_layers=1))
    except DictionaryError as exc:
        return [str(exc)]
    total = 0
    for layer in dct.layers:
        try:
            total += dct.get_layer(layer).feature_count
        except DictionaryError as exc:
            problems.append(str(exc))
    if not problems and dct.meta["feature_count"] != total:
        problems.append(f"meta.json feature_count is {dct.meta['feature_count']}, the layers hold {total} features")
    if not dct.layers:
        problems.append(f"{Path(root) / name}: no layer_<L> folders")
    return problems
