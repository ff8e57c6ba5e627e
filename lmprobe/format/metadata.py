"""The ``lmprobe:`` schema metadata of an index: parsing and checking it, and building it.

Parsing treats metadata as untrusted input: types are checked, numbers bounded and patterns
vetted (paths.py) before anything uses them to open a file. The ``build_*`` functions are the
writer's side of the same keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..base.paths import check_pattern, check_relpath, format_relpath
from ..errors import FormatError
from ..version import __version__
from .datasetspec import DatasetSpec
from .dtypes import DTYPES, HIDDEN_DTYPES, READ_MAJORS, SCALE_DTYPE, scale_key
from .spec import (
    ATTACHMENT_KINDS,
    DEFAULT_HOOKPOINT,
    LEGACY_LOGITS_KEYS,
    LOGITS_INDICES_KEY,
    LOGITS_VALUES_KEY,
    META_PREFIX,
    STORAGES,
)


def decode_schema_metadata(raw: dict[bytes, bytes] | None) -> dict[str, Any]:
    """The ``lmprobe:`` keys of a parquet schema, prefix removed, JSON-decoded."""
    info: dict[str, Any] = {}
    for k, v in (raw or {}).items():
        key = k.decode("utf-8", "replace")
        if not key.startswith(META_PREFIX):
            continue
        try:
            info[key[len(META_PREFIX) :]] = json.loads(v)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise FormatError(f"schema metadata key {key!r} is not valid JSON") from None
    return info


def recorded_attachments(info: dict[str, Any]) -> dict[str, list[dict]]:
    """The attachments a dataset's metadata records (``lmprobe:attachments``, or the older ``lmprobe:extras``):
    one list per kind, empty when none; entries that are not objects are left out."""
    raw = info.get("attachments", info.get("extras")) or {}
    if not isinstance(raw, dict):
        return {kind: [] for kind in ATTACHMENT_KINDS}
    return {kind: [x for x in (raw.get(kind) or []) if isinstance(x, dict)] for kind in ATTACHMENT_KINDS}


def encode_schema_metadata(info: dict[str, Any]) -> dict[bytes, bytes]:
    return {f"{META_PREFIX}{k}".encode(): json.dumps(v).encode() for k, v in info.items()}


def _int(value: Any, what: str, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise FormatError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def _str(value: Any, what: str, choices: tuple[str, ...] | None = None) -> str:
    if not isinstance(value, str):
        raise FormatError(f"{what} must be a string, got {value!r}")
    if choices is not None and value not in choices:
        raise FormatError(f"{what} is {value!r}; expected one of {list(choices)}")
    return value


def _dict(value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise FormatError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


@dataclass
class HiddenDescriptor:
    layers: list[int]
    dim: int
    dtype: str
    file_pattern: str
    key_pattern: str
    storage: str
    shards: list[dict]
    last_token_shards: int  # == len(shards) for pooled storage
    row_bytes: int | None = None
    pooling: str | None = None
    raw: dict = field(default_factory=dict, repr=False)
    name: str = "hidden_layers"  # the entry of ``lmprobe:tensors``
    hookpoint: str = DEFAULT_HOOKPOINT  # where in the block the vectors were read
    scale_key_pattern: str | None = None  # a scaled dtype's (int8) per-row float32 scales, beside the codes

    def file(self, layer: int, shard: int) -> str:
        return format_relpath(self.file_pattern, f"{self.name}.file_pattern", layer=layer, shard=shard)

    def key(self, layer: int) -> str:
        return self.key_pattern.format(layer=layer)

    def scale_key(self, layer: int) -> str | None:
        """The key of a layer's per-row scales in its shards, or None for an unscaled dtype."""
        return None if self.scale_key_pattern is None else self.scale_key_pattern.format(layer=layer)

    @property
    def kind(self):
        """The stored dtype's behaviour (``dtypes.DType``): bytes per row, decoding."""
        return DTYPES[self.dtype]

    def shard_rows(self, shard: int) -> int:
        """Rows in the shard's tensor: prompts for last-token shards, tokens for sequence shards."""
        d = self.shards[shard]
        if shard < self.last_token_shards:
            return d["num_prompts"]
        return d["num_tokens"]

    @property
    def sequence_shards(self) -> range:
        return range(self.last_token_shards, len(self.shards))


@dataclass
class LogitsDescriptor:
    k: int
    dtype: str
    file_pattern: str | None
    shards: list[dict]
    values_key: str | None  # None: look for the standard key, then the lmprobe 0.10.3 one
    indices_key: str | None
    row_bytes: int | None = None
    raw: dict = field(default_factory=dict, repr=False)

    def file(self, shard: int) -> str:
        d = self.shards[shard]
        if "file" in d:
            return d["file"]
        if self.file_pattern is None:
            raise FormatError(f"logits_topk shard {shard} has no 'file' and the descriptor no file_pattern")
        return format_relpath(self.file_pattern, "logits_topk.file_pattern", shard=shard)

    def keys_for(self, available: set[str]) -> tuple[str, str]:
        """The (values, indices) tensor keys to read from a shard holding ``available`` keys."""
        if self.values_key and self.indices_key:
            return self.values_key, self.indices_key
        for pair in ((LOGITS_VALUES_KEY, LOGITS_INDICES_KEY), LEGACY_LOGITS_KEYS):
            if set(pair) <= available:
                return pair
        raise FormatError(
            f"logits shard has keys {sorted(available)}; expected {LOGITS_VALUES_KEY!r}/{LOGITS_INDICES_KEY!r}"
        )


def parse_hidden(d: Any, name: str = "hidden_layers") -> HiddenDescriptor:
    d = _dict(d, f"tensors.{name}")
    w = name
    layers = d.get("layers")
    if not isinstance(layers, list) or not layers:
        raise FormatError(f"{w}.layers must be a non-empty list of layer indices, got {layers!r}")
    layers = [_int(x, f"{w}.layers[]") for x in layers]
    if len(set(layers)) != len(layers):
        raise FormatError(f"{w}.layers lists a layer twice: {layers}")
    dim = _int(d.get("dim"), f"{w}.dim", minimum=1)
    dtype = _str(d.get("dtype"), f"{w}.dtype", HIDDEN_DTYPES + ("float64",))
    file_pattern = check_pattern(d.get("file_pattern"), ("layer", "shard"), f"{w}.file_pattern")
    key_pattern = check_pattern(d.get("key_pattern"), ("layer",), f"{w}.key_pattern")
    scale_pattern = None
    if DTYPES[dtype].scaled:
        scale_pattern = check_pattern(d.get("scale_key_pattern"), ("layer",), f"{w}.scale_key_pattern")
        if scale_pattern == key_pattern:
            raise FormatError(f"{w}.scale_key_pattern is its key_pattern; the scales need a tensor of their own")
        _str(d.get("scale_dtype"), f"{w}.scale_dtype", (SCALE_DTYPE,))
    storage = _str(d.get("storage", "pooled"), f"{w}.storage", STORAGES)
    shards = d.get("shards")
    if not isinstance(shards, list):
        raise FormatError(f"{w}.shards must be a list of shard descriptors")
    for i, s in enumerate(shards):
        _dict(s, f"{w}.shards[{i}]")
        _int(s.get("num_prompts"), f"{w}.shards[{i}].num_prompts")
        if storage == "full_sequence":
            _int(s.get("num_tokens"), f"{w}.shards[{i}].num_tokens")
    if storage == "full_sequence":
        lts = _int(d.get("last_token_shards"), f"{w}.last_token_shards")
        if lts > len(shards):
            raise FormatError(f"{w}.last_token_shards is {lts} but only {len(shards)} shards are listed")
    else:
        lts = len(shards)
    row_bytes = d.get("row_bytes")
    if row_bytes is not None:
        row_bytes = _int(row_bytes, f"{w}.row_bytes")
    pooling = d.get("pooling")
    hookpoint = d.get("hookpoint", DEFAULT_HOOKPOINT)
    if not isinstance(hookpoint, str) or not hookpoint or len(hookpoint) > 200:
        raise FormatError(f"{w}.hookpoint must be a hookpoint name, got {str(hookpoint)[:60]!r}")
    return HiddenDescriptor(
        layers=layers,
        dim=dim,
        dtype=dtype,
        file_pattern=file_pattern,
        key_pattern=key_pattern,
        storage=storage,
        shards=shards,
        last_token_shards=lts,
        row_bytes=row_bytes,
        pooling=pooling if isinstance(pooling, str) else None,
        raw=d,
        name=name,
        hookpoint=hookpoint,
        scale_key_pattern=scale_pattern,
    )


def _check_same_shards(h: HiddenDescriptor, primary: HiddenDescriptor) -> None:
    """Every hookpoint shares the shards of ``hidden_layers``: the index addresses them all alike."""
    w = h.name
    if h.storage != primary.storage or len(h.shards) != len(primary.shards) \
            or h.last_token_shards != primary.last_token_shards:
        raise FormatError(f"{w} does not have the shards of hidden_layers (storage, shard count or last-token shards "
                          "differ); every hookpoint is addressed by the same index columns")
    for i, (a, b) in enumerate(zip(h.shards, primary.shards, strict=True)):
        if a.get("num_prompts") != b.get("num_prompts") or a.get("num_tokens") != b.get("num_tokens"):
            raise FormatError(f"{w}.shards[{i}] holds other rows than hidden_layers.shards[{i}]")


def parse_logits(d: Any) -> LogitsDescriptor:
    d = _dict(d, "tensors.logits_topk")
    w = "logits_topk"
    k = _int(d.get("k"), f"{w}.k", minimum=1)
    dtype = _str(d.get("dtype", "float32"), f"{w}.dtype", tuple(DTYPES))
    pattern = d.get("file_pattern")
    if pattern is not None:
        pattern = check_pattern(pattern, ("shard",), f"{w}.file_pattern")
    shards = d.get("shards")
    if not isinstance(shards, list):
        raise FormatError(f"{w}.shards must be a list of shard descriptors")
    for i, s in enumerate(shards):
        _dict(s, f"{w}.shards[{i}]")
        _int(s.get("num_prompts"), f"{w}.shards[{i}].num_prompts")
        if "file" in s:
            check_relpath(s["file"], f"{w}.shards[{i}].file")
        elif pattern is None:
            raise FormatError(f"{w}.shards[{i}] has no 'file' and the descriptor has no file_pattern")
    keys = d.get("keys")
    values_key = indices_key = None
    if keys is not None:
        keys = _dict(keys, f"{w}.keys")
        values_key = _str(keys.get("values"), f"{w}.keys.values")
        indices_key = _str(keys.get("indices"), f"{w}.keys.indices")
    row_bytes = d.get("row_bytes")
    if row_bytes is not None:
        row_bytes = _int(row_bytes, f"{w}.row_bytes")
    return LogitsDescriptor(k, dtype, pattern, shards, values_key, indices_key, row_bytes, raw=d)


@dataclass(frozen=True)
class FileRecord:
    """A data file the metadata names, with the size and SHA-256 recorded for it (None when not recorded)."""

    rel: str
    bytes: int | None
    sha256: str | None


@dataclass
class DatasetInfo:
    """The parsed and checked metadata of one dataset."""

    raw: dict[str, Any]
    format_version: str
    num_prompts: int
    hidden: HiddenDescriptor | None
    logits: LogitsDescriptor | None
    statistics: StatisticsDescriptor | None = None
    hookpoints: dict[str, HiddenDescriptor] = field(default_factory=dict)
    """Every stored hookpoint's descriptor, ``hidden_layers``' first."""

    def files(self, layers: list[int] | None = None, *, logits: bool = True,
              hookpoints: list[str] | None = None) -> list[FileRecord]:
        """Every shard file (of ``layers`` and ``hookpoints``, default all) and the statistics file, with records."""

        def record(rel: str, rec: Any) -> FileRecord:
            rec = rec if isinstance(rec, dict) else {}
            size, sha = rec.get("bytes"), rec.get("sha256")
            return FileRecord(rel, size if isinstance(size, int) else None, sha if isinstance(sha, str) else None)

        out: list[FileRecord] = []
        for hp, h in self.hookpoints.items():
            if hookpoints is not None and hp not in hookpoints:
                continue
            for layer in h.layers if layers is None else [x for x in layers if x in h.layers]:
                for s, d in enumerate(h.shards):
                    out.append(record(h.file(layer, s), (d.get("files") or {}).get(str(layer))))
        if logits and self.logits is not None:
            out += [record(self.logits.file(s), d) for s, d in enumerate(self.logits.shards)]
        if self.statistics is not None:
            out.append(record(self.statistics.file, self.statistics.raw))
        return out


def parse_info(info: dict[str, Any]) -> DatasetInfo:
    """Check the decoded ``lmprobe:`` metadata and return its descriptors.

    Raises FormatError naming the first offending key. Unknown tensor types are ignored so that
    later additions do not break this reader.
    """
    version = info.get("format_version")
    if not isinstance(version, str) or version.split(".")[0] not in READ_MAJORS or "." not in version:
        raise FormatError(
            f"format_version is {version!r}; this reader understands the lmprobe formats 2.x and 3.x "
            "(is this an lmprobe dataset? its index needs 'lmprobe:' schema metadata; a newer format: upgrade lmprobe)"
        )
    num_prompts = _int(info.get("num_prompts"), "num_prompts")
    tensors = _dict(info.get("tensors", {}), "tensors")
    hidden = parse_hidden(tensors["hidden_layers"]) if "hidden_layers" in tensors else None
    hookpoints: dict[str, HiddenDescriptor] = {hidden.hookpoint: hidden} if hidden is not None else {}
    for name, d in tensors.items():
        if name == "hidden_layers" or not isinstance(d, dict) or d.get("type") != "hidden":
            continue
        if hidden is None:
            raise FormatError(f"tensors.{name} is a hidden descriptor but there is no hidden_layers")
        h = parse_hidden(d, name)
        if "hookpoint" not in d or h.hookpoint in hookpoints:
            raise FormatError(f"tensors.{name} needs a hookpoint of its own (has {d.get('hookpoint')!r})")
        _check_same_shards(h, hidden)
        hookpoints[h.hookpoint] = h
    for h in hookpoints.values():
        if h.kind.scaled and version.split(".")[0] != h.kind.format_version.split(".")[0]:
            # a reader of format 2 would return the codes as values: a scaled dtype is never written under 2.x
            raise FormatError(f"tensors.{h.name} is {h.dtype}, which format {version} cannot hold (it needs "
                              f"{h.kind.format_version}); the metadata is damaged")
    logits = parse_logits(tensors["logits_topk"]) if "logits_topk" in tensors else None
    # statistics have a key of their own: readers that walk every entry of `tensors` (lmprobe 0.10.3)
    # expect shards in each; datasets written before that kept them in `tensors`
    stats_raw = info["statistics"] if "statistics" in info else tensors.get("statistics")
    stats = parse_statistics(stats_raw) if stats_raw is not None else None
    return DatasetInfo(info, version, num_prompts, hidden, logits, stats, hookpoints)


@dataclass
class StatisticsDescriptor:
    file: str
    layers: list[int]
    key_pattern: str
    raw: dict = field(default_factory=dict, repr=False)

    def key(self, layer: int, stat: str) -> str:
        return self.key_pattern.format(layer=layer, stat=stat)

    def for_hookpoint(self, hookpoint: str) -> StatisticsDescriptor:
        """The statistics of another hookpoint than ``hidden_layers``' (same file, its own keys)."""
        entry = (self.raw.get("hookpoints") or {}).get(hookpoint)
        if not isinstance(entry, dict):
            raise FormatError(f"the statistics file holds no statistics of hookpoint {hookpoint!r}")
        layers = entry.get("layers")
        if not isinstance(layers, list):
            raise FormatError(f"statistics.hookpoints.{hookpoint}.layers must be a list of layers")
        layers = [_int(x, f"statistics.hookpoints.{hookpoint}.layers[]") for x in layers]
        key_pattern = check_pattern(entry.get("key_pattern"), ("layer", "stat"),
                                    f"statistics.hookpoints.{hookpoint}.key_pattern")
        return StatisticsDescriptor(self.file, layers, key_pattern, raw=entry)


def parse_statistics(d: Any) -> StatisticsDescriptor:
    d = _dict(d, "tensors.statistics")
    file = check_relpath(d.get("file"), "statistics.file")
    layers = d.get("layers")
    if not isinstance(layers, list):
        raise FormatError("statistics.layers must be a list of layers")
    layers = [_int(x, "statistics.layers[]") for x in layers]
    key_pattern = check_pattern(d.get("key_pattern"), ("layer", "stat"), "statistics.key_pattern")
    return StatisticsDescriptor(file, layers, key_pattern, raw=d)


# ---------------------------------------------------------------------------------------------- building


#: ``provenance.writer`` of datasets written by this package's DatasetWriter: ``lmprobe validate`` holds
#: them to the letter of docs/format.md, and reports other writers' departures as warnings
WRITER = "lmprobe.format.DatasetWriter"


def default_provenance() -> dict[str, Any]:
    """Versions of the build environment, read from installed package metadata (no heavy imports)."""
    import platform
    from datetime import datetime, timezone
    from importlib.metadata import PackageNotFoundError, version

    def v(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {
        "lmprobe_version": __version__,
        "writer": WRITER,
        "extraction_backend": None,
        "nnsight_version": None,
        "torch_version": v("torch"),
        "transformers_version": v("transformers"),
        "python_version": platform.python_version(),
        "created_at": datetime.now(timezone.utc).isoformat(),
    }


def _recorded_files(d: dict, slots: dict[str, int] | None = None) -> dict[str, dict]:
    """A closed shard's file records without the writer's staging names; ``slots`` (slot -> layer) picks and rekeys."""
    files = d["files"]
    if slots is not None:
        return {str(layer): {k: v for k, v in files[slot].items() if k != "staging"} for slot, layer in slots.items()}
    return {slot: {k: v for k, v in f.items() if k != "staging"} for slot, f in files.items()}


def build_hidden_descriptor(spec: DatasetSpec, last_closed: list[dict], seq_closed: list[dict],
                            hookpoint: str | None = None) -> dict[str, Any]:
    """The descriptor of one hookpoint (default: ``hidden_layers``') from the closed last-token and sequence shards."""
    hp = spec.primary_hookpoint if hookpoint is None else hookpoint
    slots = {slot: layer for slot, (h, layer) in spec.sites.items() if h == hp}
    full = spec.full_sequence
    shards = []
    for d in last_closed:
        s: dict[str, Any] = {"num_prompts": d["num_prompts"]}
        if full:
            s["num_tokens"] = d["num_tokens"]
        s["files"] = _recorded_files(d, slots)
        shards.append(s)
    for d in seq_closed:
        shards.append({"num_prompts": d["num_prompts"], "num_tokens": d["num_tokens"],
                       "files": _recorded_files(d, slots)})
    file_pattern, key_pattern = spec.patterns(hp)
    hidden: dict[str, Any] = {
        "type": "hidden",
        "layers": list(spec.layers),
        "dim": spec.dim_of(hp),
        "dtype": spec.dtype,
        "layout": "per_layer",
        "file_pattern": file_pattern,
        "key_pattern": key_pattern,
        "storage": spec.storage,
    }
    if hp != DEFAULT_HOOKPOINT:
        hidden["hookpoint"] = hp  # hidden_layers of a default extraction stays as it always was
    if full:
        hidden["last_token_shards"] = len(last_closed)
    else:
        hidden["pooling"] = "last_token"
    kind = DTYPES[spec.dtype]
    if kind.scaled:
        hidden["scale_key_pattern"] = scale_key(key_pattern)
        hidden["scale_dtype"] = SCALE_DTYPE
    hidden["row_bytes"] = kind.row_bytes(spec.dim_of(hp))
    hidden["shards"] = shards
    return hidden


def build_logits_descriptor(spec: DatasetSpec, closed: list[dict]) -> dict[str, Any]:
    """The ``logits_topk`` descriptor from the closed logits shards."""
    shards = []
    for i, d in enumerate(closed):
        rel = format_relpath(spec.logits_file_pattern, "logits_file_pattern", shard=i)
        shards.append({"file": rel, "num_prompts": d["num_prompts"], **_recorded_files(d)["all"]})
    return {
        "type": "logits_topk",
        "k": spec.logits_topk,
        "dtype": "float32",
        "indices_dtype": "int32",
        "keys": {"values": LOGITS_VALUES_KEY, "indices": LOGITS_INDICES_KEY},
        "pooling": "last_token",
        "file_pattern": spec.logits_file_pattern,
        "row_bytes": 8 * spec.logits_topk,
        "shards": shards,
    }


def build_info(spec: DatasetSpec, *, num_prompts: int, tensors: dict[str, Any], provenance: dict[str, Any],
               prompt_ordering: str = "input", extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The decoded ``lmprobe:`` metadata of a dataset (encode_schema_metadata turns it into schema keys)."""
    info = {
        "format_version": DTYPES[spec.dtype].format_version,
        "model": {"name": spec.model_name, "revision": spec.model_revision},
        "num_prompts": num_prompts,
        "prompt_ordering": prompt_ordering,
        "tensors": tensors,
        "provenance": provenance,
    }
    info.update(extra or {})
    return info
