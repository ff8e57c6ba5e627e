"""Running per-layer statistics over every stored vector: count, mean, population std, mean L2 norm.

Batches are merged with the parallel algorithm of Chan et al. (float64 accumulators), so the result
does not depend on how the data was batched beyond floating-point rounding, and statistics of
separately written parts merge exactly the same way (``lmprobe merge``, multi-process extraction).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..atomic import atomic_output
from ..hashing import sha256_file
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
    def of(cls, x: np.ndarray) -> RunningStats:
        x = np.asarray(x, dtype=np.float64)
        if len(x) == 0:
            return cls.empty(x.shape[1])
        mean = x.mean(axis=0)
        return cls(len(x), mean, ((x - mean) ** 2).sum(axis=0), float(np.linalg.norm(x, axis=1).sum()))

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
