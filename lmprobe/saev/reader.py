"""Reading a saev folder: random access, shuffled batches, the training reader's rows, and validation."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..base.safeio import read_json
from ..base.units import parse_size
from ..errors import SaevError
from ..storage.folders import remote_folder
from ..storage.urls import remote_of, split_url
from ..stream.engine import Engine, RowSource, rank_world
from .protocol import (
    METADATA_KEYS,
    METADATA_KEYS_21,
    PIXEL_AGG_21,
    PROTOCOL,
    canonical_metadata,
    ex_per_shard,
    file_inside,
    metadata_hash,
    shard_bytes,
    shard_sizes,
)


class SaevDataset:
    """A saev folder (``<dump_to>/<HASH>``): random access and shuffled batches over memory-mapped shards.

    >>> sv = SaevDataset("saev-dumps/0f3a...")          # doctest: +SKIP
    >>> sv.get(12, layer=6, token=3).shape              # doctest: +SKIP
    (1024,)
    """

    def __init__(self, path: str | os.PathLike, *, verify_hash: bool = True, token: str | None = None):
        # a folder in a Hub repo or in object storage: metadata now, each shard on first use (into the HF cache, or
        # the object store's cache, where the folder's files keep their names)
        self._remote = remote_folder(path, token=token)
        name = None
        if self._remote is not None:
            meta = self._remote.fetch("metadata.json", what="saev metadata")
            self._remote.fetch("shards.json", what="saev shard list")
            if remote_of(path) == "object":  # the cache folder is named by the URL's hash: the folder's name is the URL's
                name = split_url(path)[1].rstrip("/").rsplit("/", 1)[-1]
            path = meta.parent
        self.path = Path(path)
        problems = validate_saev(self.path, check_hash=verify_hash, check_sizes=self._remote is None,
                                 local=self._remote is None, name=name)
        if problems:
            raise SaevError(f"{self.path}: " + "; ".join(problems))
        # protocol 2.1 folders are read under the 2.0 names (n_examples -> n_ex, ...)
        self.metadata = canonical_metadata(read_json(self._local("metadata.json"), error=SaevError))
        self.shards = [canonical_metadata(sh) for sh in read_json(self._local("shards.json"), error=SaevError)]
        m = self.metadata
        self.layers: list[int] = list(m["layers"])
        self.tokens_per_ex = m["patches_per_ex"] + (1 if m["cls_token"] else 0)
        self.d_model = m["d_model"]
        self.n_ex = m["n_ex"]
        self.ex_per_shard = ex_per_shard(m["patches_per_shard"], self.tokens_per_ex, len(self.layers))
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return self.n_ex

    def __repr__(self) -> str:
        return (f"<lmprobe SaevDataset {self._remote or self.path}: {self.n_ex:,} examples x {self.tokens_per_ex} tokens, "
                f"layers {self.layers}, d_model {self.d_model}, {self.metadata.get('dtype', 'float32')}>")

    def _local(self, name: str) -> Path:
        return file_inside(self.path, name) if self._remote is None else self.path / name

    def _file(self, name: str, *, required: bool = True) -> Path | None:
        """Local path of a file of this folder; from the Hub, downloaded now."""
        if self._remote is None:
            p = file_inside(self.path, name)
            return p if p.exists() or required else None
        if not required and not self._remote.has(name):
            return None
        try:
            return self._remote.fetch(name, what="saev file")
        except FileNotFoundError:
            raise SaevError(f"{name} is missing from {self._remote}") from None

    def shard(self, i: int) -> np.memmap:
        """Shard ``i`` as a read-only (n_ex, L, T, D) float32 memory map."""
        if i not in self._maps:
            n = self.shards[i]["n_ex"]
            path = self._file(self.shards[i]["name"])
            ex_bytes = len(self.layers) * self.tokens_per_ex * self.d_model * 4
            if path.stat().st_size not in shard_bytes(n, self.ex_per_shard, i == len(self.shards) - 1, ex_bytes):
                raise SaevError(f"{path} is {path.stat().st_size} bytes, expected {n * ex_bytes}")
            self._maps[i] = np.memmap(path, dtype="<f4", mode="r",
                                      shape=(n, len(self.layers), self.tokens_per_ex, self.d_model))
        return self._maps[i]

    def layer_index(self, layer: int) -> int:
        if layer not in self.layers:
            raise SaevError(f"layer {layer} is not recorded in {self.path} (layers {self.layers})")
        return self.layers.index(layer)

    def locate(self, ex: int, layer: int, token: int) -> tuple[Path, int]:
        """Section 4.2: (shard file, byte offset) of the vector at (example, layer, token)."""
        if not 0 <= ex < self.n_ex:
            raise IndexError(f"example {ex} is outside 0..{self.n_ex - 1}")
        if not 0 <= token < self.tokens_per_ex:
            raise IndexError(f"token {token} is outside 0..{self.tokens_per_ex - 1}")
        li = self.layer_index(layer)
        shard_idx, ex_in_shard = divmod(ex, self.ex_per_shard)
        L, T = len(self.layers), self.tokens_per_ex
        offset_vectors = ex_in_shard * L * T + li * T + token
        return self.path / f"acts{shard_idx:06d}.bin", offset_vectors * self.d_model * 4

    def get(self, ex: int, layer: int, token: int) -> np.ndarray:
        """The (d_model,) vector at (example, layer, token), from the shard's memory map."""
        self.locate(ex, layer, token)  # checks the coordinate
        shard_idx, ex_in_shard = divmod(ex, self.ex_per_shard)
        return np.array(self.shard(shard_idx)[ex_in_shard, self.layer_index(layer), token])

    def tokens(self) -> np.ndarray | None:
        p = self._file("tokens.bin", required=False)
        return np.memmap(p, dtype="<u4", mode="r", shape=(self.n_ex, self.tokens_per_ex)) if p else None

    def labels(self) -> np.ndarray | None:
        p = self._file("labels.bin", required=False)
        return np.memmap(p, dtype="u1", mode="r", shape=(self.n_ex, self.tokens_per_ex)) if p else None

    def batches(self, layer: int, batch_size: int, *, seed: int = 0, shuffle: bool = True, memory: int | str = "1GiB",
                drop_last: bool = False, worker: tuple[int, int] = (0, 1), rank: int | None = None,
                world_size: int | None = None, epoch: int = 0) -> Iterator[np.ndarray]:
        """Yield (batch_size, d_model) float32 batches of one layer's token vectors, globally shuffled.

        The same training reader as ``lmprobe.stream.ShardStream`` (docs/training.md): blocks of
        consecutive vectors from all over the folder, read a memory budget's worth at a time and
        shuffled together, so a batch mixes like a uniform sample. Each vector appears once per
        pass; ``rank``/``world_size`` and ``worker=(i, n)`` split a pass without overlap.
        """
        li = self.layer_index(layer)
        r, w = rank_world(rank, world_size)
        engine = Engine(_SaevRows(self, li), batch_size, seed=seed, shuffle=shuffle, rank=r, world=w,
                        memory=parse_size(memory), drop_last=drop_last)
        for batch in engine.iterate(epoch, worker):
            yield batch[:, 0]

    def torch_dataset(self, layer: int, batch_size: int, **kwargs: Any):
        """A torch IterableDataset of (batch_size, d_model) tensors; splits runs across DataLoader workers.

        Use ``DataLoader(ds, batch_size=None, num_workers=N)``; ``set_epoch(epoch)`` reshuffles.
        """
        import torch

        parent = self

        class _Iterable(torch.utils.data.IterableDataset):
            def __init__(self):
                self.epoch = 0

            def set_epoch(self, epoch: int) -> None:
                self.epoch = epoch

            def __iter__(self):
                info = torch.utils.data.get_worker_info()
                worker = (info.id, info.num_workers) if info else (0, 1)
                for batch in parent.batches(layer, batch_size, worker=worker, epoch=self.epoch, **kwargs):
                    yield torch.from_numpy(batch)

        return _Iterable()


def validate_saev(path: str | os.PathLike, *, check_hash: bool = True, check_sizes: bool = True,
                  local: bool = True, name: str | None = None) -> list[str]:
    """Every problem of a saev folder against the protocol (empty list: valid).

    ``local=False``: the folder is a local copy of a remote one (a Hugging Face cache snapshot, whose files link
    into the cache; object storage's cache); ``name``: the folder's own name when the copy's differs.
    """
    p = Path(path)

    def _inside(folder: Path, name: str) -> Path:
        return file_inside(folder, name) if local else folder / name

    problems: list[str] = []
    try:
        m = read_json(_inside(p, "metadata.json"), what="metadata.json", error=SaevError)
    except SaevError as exc:
        return [str(exc)]
    if not isinstance(m, dict):
        return ["metadata.json must hold an object"]
    v21 = m.get("protocol") == "2.1"
    keys = set(m)
    # saev e43e7dd writes pixel_agg (null, or a label aggregation) beside the protocol document's keys
    allowed = [set(METADATA_KEYS_21)] if v21 else [set(METADATA_KEYS), {*METADATA_KEYS, "pixel_agg"}]
    if keys not in allowed:
        missing, extra = sorted(allowed[0] - keys), sorted(keys - allowed[-1])
        problems.append(f"metadata.json keys differ from the protocol's (missing {missing}, extra {extra})")
    if "pixel_agg" in m and m["pixel_agg"] not in (PIXEL_AGG_21 if v21 else (None, *PIXEL_AGG_21)):
        problems.append(f"metadata.json pixel_agg {m['pixel_agg']!r} is not one of {list(PIXEL_AGG_21)}")
    hash_name = metadata_hash(m)
    m = canonical_metadata(m)
    types = {"family": str, "ckpt": str, "layers": list, "patches_per_ex": int, "cls_token": bool, "d_model": int,
             "n_ex": int, "patches_per_shard": int, "data": str if v21 else dict, "dataset": str, "dtype": str,
             "protocol": str}
    bad_types = [f"metadata.json {k!r} must be a {t.__name__}" for k, t in types.items()
                 if k in m and (not isinstance(m[k], t) or (t is int and isinstance(m[k], bool)))]
    if bad_types or not set(types) <= set(m):
        return problems + bad_types  # the checks below need every key, well typed
    if m["protocol"].split(".")[0] != PROTOCOL.split(".")[0]:
        problems.append(f"protocol {m['protocol']!r} is not {PROTOCOL} (a different major version)")
    if m["dtype"] != "float32":
        problems.append(f"dtype {m['dtype']!r}: the protocol fixes float32")
    if check_hash and (name or p.name) != hash_name:
        problems.append(f"folder name {name or p.name} is not the sha256 of metadata.json ({hash_name})")
    if not m["layers"] or not all(isinstance(x, int) and not isinstance(x, bool) for x in m["layers"]):
        problems.append("layers must be a non-empty list of integers")
        return problems
    small = [k for k in ("patches_per_ex", "d_model", "patches_per_shard") if m[k] < 1] + (["n_ex"] if m["n_ex"] < 0
                                                                                         else [])
    if small:
        return problems + [f"metadata.json {k!r} is {m[k]}, which no folder can have" for k in small]
    T = m["patches_per_ex"] + (1 if m["cls_token"] else 0)
    L, D = len(m["layers"]), m["d_model"]
    try:
        shards = read_json(_inside(p, "shards.json"), what="shards.json", error=SaevError)
    except SaevError as exc:
        return problems + [str(exc)]
    count = "n_examples" if v21 else "n_ex"
    if not isinstance(shards, list) or not all(isinstance(s, dict) and isinstance(s.get("name"), str)
                                               and isinstance(s.get(count), int) for s in shards):
        return problems + [f"shards.json must be a list of {{name, {count}}}"]
    shards = [canonical_metadata(s) for s in shards]
    per = ex_per_shard(m["patches_per_shard"], T, L)
    try:
        want = shard_sizes(m["n_ex"], per)
    except SaevError as exc:
        return problems + [str(exc)]
    got = [s["n_ex"] for s in shards]
    if got != want:
        problems.append(f"shards.json n_ex {got} differ from the protocol's sizing {want}")
    for i, s in enumerate(shards):
        if s["name"] != f"acts{i:06d}.bin":
            problems.append(f"shard {i} is named {s['name']!r}, expected acts{i:06d}.bin")
            continue
        try:
            f = _inside(p, s["name"])
        except SaevError as exc:
            problems.append(str(exc))
            continue
        if not f.exists():
            if check_sizes:  # a folder read from the Hub downloads its shards later
                problems.append(f"{s['name']} is missing")
        elif check_sizes and f.stat().st_size not in shard_bytes(s["n_ex"], per, i == len(shards) - 1, L * T * D * 4):
            problems.append(f"{s['name']} is {f.stat().st_size} bytes, expected {s['n_ex'] * L * T * D * 4}")
    for name, item in (("labels.bin", 1), ("tokens.bin", 4)):
        try:
            f = _inside(p, name)
        except SaevError as exc:
            problems.append(str(exc))
            continue
        if f.exists() and f.stat().st_size != m["n_ex"] * T * item:
            problems.append(f"{name} is {f.stat().st_size} bytes, expected {m['n_ex'] * T * item}")
    return problems


def is_saev_folder(path: str | os.PathLike) -> bool:
    """A folder holding metadata.json and shards.json (and no lmprobe index) is judged as a saev folder."""
    p = Path(path)
    return (p / "metadata.json").exists() and (p / "shards.json").exists() and not (p / "index").is_dir()


def saev_exports(path: str | os.PathLike) -> list[Path]:
    """The saev folders directly inside ``path`` (what ``export-saev --out DUMP_TO`` made: DUMP_TO/<HASH>/)."""
    p = Path(path)
    if not p.is_dir() or is_saev_folder(p) or (p / "index").is_dir():
        return []
    return sorted(c for c in p.iterdir() if c.is_dir() and not c.is_symlink() and is_saev_folder(c))


class _SaevRows(RowSource):
    """One layer of a saev folder as rows for the training reader: example after example, token after token."""

    def __init__(self, sv: SaevDataset, li: int):
        self.sv, self.li = sv, li
        self.T = sv.tokens_per_ex
        self.shard_rows = [sh["n_ex"] * self.T for sh in sv.shards]
        self.n_sites, self.dim = 1, sv.d_model

    def prepare(self, shards) -> None:
        for s in shards:
            self.sv.shard(s)  # downloaded (from the Hub) and size-checked here, on the reader's thread

    def read_rows(self, shard: int, rows: np.ndarray, site: int, out: np.ndarray) -> None:
        mm = self.sv.shard(shard)  # (n_ex, L, T, D)
        ex, tok = np.divmod(rows, self.T)
        flat = (ex * mm.shape[1] + self.li) * self.T + tok  # the row in the shard's (n_ex * L * T, D) view
        np.take(mm.reshape(-1, self.dim), flat, axis=0, out=out, mode="clip")  # one gather, no buffered copy
