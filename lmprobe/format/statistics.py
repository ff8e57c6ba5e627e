"""Running per-layer statistics over every stored vector: count, mean, population std, mean L2 norm.

A batch's statistics are computed where its activations are (``batch_statistics``: torch, on the
device that produced them, in float32 over chunks of bounded size, each chunk centred on its own
mean), and come to the host as a few ``dim``-sized vectors. Batches are merged with the parallel
algorithm of Chan et al. (float64 accumulators), so the result does not depend on how the data was
batched beyond floating-point rounding, and statistics of separately written parts merge exactly
the same way (``lmprobe merge``, multi-process extraction).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..base.atomic import atomic_output
from ..base.hashing import sha256_file
from .dtypes import DType
from .spec import hookpoint_slug

STATS_FILE = "tensors/statistics.safetensors"
KEY_PATTERN = "layer_{layer}.{stat}"


@dataclass
class RunningStats:
    count: int
    mean: np.ndarray  # float64 (dim,)
    m2: np.ndarray  # float64 (dim,): sum of squared deviations from the mean
    norm_sum: float

    @classmethod
    def empty(cls, dim: int) -> RunningStats:
        return cls(0, np.zeros(dim), np.zeros(dim), 0.0)

    @classmethod
    def of(cls, x: Any, *, bfloat16_bits: bool = False) -> RunningStats:
        """The statistics of the rows of ``x`` (see ``batch_statistics``)."""
        return batch_statistics(x, bfloat16_bits=bfloat16_bits)

    @classmethod
    def of_stored(cls, kind: DType, tensors: list[np.ndarray]) -> RunningStats:
        """The statistics of stored rows (``kind.encode``'s tensors) as a reader decodes them: of the values
        ``lmprobe.load`` returns, not of what the model handed the writer (int8: codes times scales)."""
        if kind.scaled:
            return batch_statistics(kind.decode(*tensors))
        return batch_statistics(tensors[0], bfloat16_bits=kind.half_of_float32)

    @classmethod
    def of_chunks(cls, counts: np.ndarray, sums: np.ndarray, m2s: np.ndarray, norm_sums: np.ndarray) -> RunningStats:
        """Merge chunks in float64 (Chan et al., all at once): ``counts`` (k,), ``sums``/``m2s`` (k, dim)."""
        counts = np.asarray(counts, dtype=np.float64)
        sums, m2s = np.asarray(sums, dtype=np.float64), np.asarray(m2s, dtype=np.float64)
        n = float(counts.sum())
        if n == 0:
            return cls.empty(sums.shape[1])
        mean = sums.sum(axis=0) / n
        dev = sums / counts[:, None] - mean  # each chunk's mean minus the whole's
        m2 = m2s.sum(axis=0) + np.einsum("k,kd,kd->d", counts, dev, dev)
        return cls(int(n), mean, m2, float(np.asarray(norm_sums, dtype=np.float64).sum()))

    @classmethod
    def from_result(cls, r: dict) -> RunningStats:
        """Back from ``result()`` (or ``Dataset.statistics``): exact up to the float64 rounding of std."""
        count = int(r["count"])
        std = np.asarray(r["std"], dtype=np.float64)
        return cls(count, np.asarray(r["mean"], dtype=np.float64), std**2 * count,
                   float(r["mean_norm"]) * count if count else 0.0)

    def merge(self, other: RunningStats) -> RunningStats:
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        n = self.count + other.count
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / n)
        m2 = self.m2 + other.m2 + delta**2 * (self.count * other.count / n)
        return RunningStats(n, mean, m2, self.norm_sum + other.norm_sum)

    def result(self) -> dict:
        if self.count == 0:
            return {"count": 0, "mean": self.mean, "std": self.m2, "mean_norm": float("nan")}
        return {"count": self.count, "mean": self.mean, "std": np.sqrt(self.m2 / self.count),
                "mean_norm": self.norm_sum / self.count}

    def to_tensors(self, layer: int, key_pattern: str = KEY_PATTERN) -> dict[str, np.ndarray]:
        r = self.result()
        return {
            key_pattern.format(layer=layer, stat="count"): np.array([self.count], dtype=np.int64),
            key_pattern.format(layer=layer, stat="mean"): r["mean"].astype(np.float64),
            key_pattern.format(layer=layer, stat="std"): r["std"].astype(np.float64),
            key_pattern.format(layer=layer, stat="mean_norm"): np.array([r["mean_norm"]], dtype=np.float64),
        }


#: float32 values per chunk: on a CPU a chunk stays in cache (4 MiB), on a GPU it bounds the temporaries (1 GiB)
_CHUNK_VALUES = {"cpu": 1 << 20, "other": 1 << 28}


def batch_statistics(x: Any, *, bfloat16_bits: bool = False) -> RunningStats:
    """Count, mean, M2 and summed L2 norms of the rows of ``x`` (n, dim), computed where ``x`` lives.

    ``x`` is a torch tensor on any device (any floating dtype), or a numpy array (``bfloat16_bits``:
    raw bfloat16 bits as uint16). The rows are taken in chunks of bounded size; each chunk is
    converted to float32 (float64 data stays float64) once and centred on its own mean before squaring, so a large offset does
    not cancel away the variance (naive float32 sums of squares do). Only the chunks' sums, M2 and
    norm sums, a few ``dim``-sized float32 vectors, leave the device; they are merged in float64.

    >>> s = batch_statistics(np.array([[1.0, 2.0], [3.0, 2.0]], dtype=np.float32))
    >>> s.count, s.mean.tolist(), s.m2.tolist()
    (2, [2.0, 2.0], [2.0, 0.0])
    """
    import torch

    if isinstance(x, torch.Tensor):
        t = x.detach()
    else:
        a = np.asarray(x)
        if not a.flags.writeable:  # torch warns on read-only memory
            a = a.copy()
        if bfloat16_bits:
            t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(a if a.dtype in (np.float32, np.float16, np.float64) else a.astype(np.float32))
    if t.dim() != 2:
        raise ValueError(f"expected (rows, dim) activations, got shape {tuple(t.shape)}")
    n, dim = t.shape
    if n == 0:
        return RunningStats.empty(dim)
    rows = max(1, _CHUNK_VALUES["cpu" if t.device.type == "cpu" else "other"] // max(1, dim))
    k = -(-n // rows)
    f32 = torch.float64 if t.dtype == torch.float64 else torch.float32  # float64 data keeps its precision
    buf = torch.empty((min(rows, n), dim), dtype=f32, device=t.device)
    means = torch.empty((k, dim), dtype=f32, device=t.device)  # each chunk's mean, as rounded to float32
    res = torch.empty((k, dim), dtype=f32, device=t.device)  # sum of the deviations from it: the correction
    m2s = torch.empty((k, dim), dtype=f32, device=t.device)  # sum of squared deviations from it
    norm_sums = torch.empty(k, dtype=f32, device=t.device)
    counts = np.empty(k, dtype=np.int64)
    with torch.inference_mode():
        for i, a in enumerate(range(0, n, rows)):
            chunk = t[a : a + rows]
            c = len(chunk)
            b = buf[:c]
            if chunk.dtype == f32:
                torch.sum(chunk, 0, out=means[i])
                norm_sums[i] = torch.linalg.vector_norm(chunk, dim=1).sum()
                means[i] /= c
                torch.sub(chunk, means[i], out=b)
            else:
                b.copy_(chunk)  # the one float32 copy of the chunk (a cast for bfloat16 and float16)
                torch.sum(b, 0, out=means[i])
                norm_sums[i] = torch.linalg.vector_norm(b, dim=1).sum()
                means[i] /= c
                b.sub_(means[i])
            torch.sum(b, 0, out=res[i])
            torch.sum(b.square_(), 0, out=m2s[i])
            counts[i] = c
        host = [v.cpu().numpy().astype(np.float64) for v in (means, res, m2s, norm_sums)]
    mean_f32, dev_sum, sq, norms = host
    c = counts[:, None].astype(np.float64)
    # a chunk's float32 sum is off by ~1e-7 of its offset; the deviations' sum puts the mean right (to
    # ~1e-7 of the spread), and the squares are moved from the rounded mean to the exact one
    return RunningStats.of_chunks(counts, (mean_f32 + dev_sum / c) * c, sq - dev_sum**2 / c, norms)


def hookpoint_key_pattern(hookpoint: str) -> str:
    """Statistics keys of a hookpoint other than ``hidden_layers``': ``mlp_out.layer_{layer}.{stat}``."""
    return f"{hookpoint_slug(hookpoint)}.{KEY_PATTERN}"


def save_stats(path: Path, stats: dict[int, RunningStats],
               others: dict[str, dict[int, RunningStats]] | None = None) -> None:
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {}
    for layer, s in stats.items():
        tensors.update(s.to_tensors(layer))
    for hp, by_layer in (others or {}).items():
        for layer, s in by_layer.items():
            tensors.update(s.to_tensors(layer, hookpoint_key_pattern(hp)))
    with atomic_output(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "np"})


def write_statistics(out_dir: Path, stats: dict[int, RunningStats], *, storage: str, checksums: bool,
                     others: dict[str, dict[int, RunningStats]] | None = None) -> dict:
    """Write the statistics file of a dataset; returns its descriptor (docs/format.md).

    ``stats`` are those of ``hidden_layers``' layers; ``others`` those of each other hookpoint,
    listed in the descriptor's ``hookpoints`` entry with their own key patterns.
    """
    final = Path(out_dir) / STATS_FILE
    final.parent.mkdir(parents=True, exist_ok=True)
    save_stats(final, stats, others)
    desc = {
        "type": "statistics",
        "file": STATS_FILE,
        "layers": list(stats),
        "key_pattern": KEY_PATTERN,
        "stats": ["count", "mean", "std", "mean_norm"],
        "over": "every stored vector" + (" (all tokens)" if storage == "full_sequence" else " (last tokens)"),
        "ddof": 0,
        "dtype": "float64",
        "bytes": final.stat().st_size,
    }
    if others:
        desc["hookpoints"] = {hp: {"layers": list(by_layer), "key_pattern": hookpoint_key_pattern(hp)}
                              for hp, by_layer in others.items()}
    if checksums:
        desc["sha256"] = sha256_file(final)
    return desc


def save_accumulators(path: Path, stats: dict[str, RunningStats]) -> None:
    """Checkpoint the exact accumulators (count, mean, m2, norm sum), so a resumed run ends bit-identical."""
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {}
    for slot, s in stats.items():  # slot: the writer's series name (the layer number for hidden_layers)
        tensors[f"{slot}.count"] = np.array([s.count], dtype=np.int64)
        tensors[f"{slot}.mean"] = s.mean
        tensors[f"{slot}.m2"] = s.m2
        tensors[f"{slot}.norm_sum"] = np.array([s.norm_sum], dtype=np.float64)
    with atomic_output(path) as tmp:
        save_file(tensors, str(tmp))


def load_accumulators(path: Path, slots: list[str]) -> dict[str, RunningStats]:
    from safetensors.numpy import load_file

    t = load_file(str(path))
    return {slot: RunningStats(int(t[f"{slot}.count"][0]), t[f"{slot}.mean"], t[f"{slot}.m2"],
                               float(t[f"{slot}.norm_sum"][0])) for slot in slots}
