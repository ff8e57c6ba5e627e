"""Running per-layer statistics: equal to numpy over the stored data, stable across resumes and merges."""

from __future__ import annotations

import numpy as np
import pytest
from support.datasets import PROMPTS, write_dataset
from support.paths import SUPPORT

import lmprobe
from lmprobe.format.statistics import RunningStats
from lmprobe.format.validate import validate


def _numpy_stats(x):
    x = np.asarray(x, dtype=np.float64)
    return {"count": len(x), "mean": x.mean(0), "std": x.std(0, ddof=0),
            "mean_norm": float(np.linalg.norm(x, axis=1).mean())}


def _check(got, want):
    """Equal to the float64 reference within 1e-6 relative; a mean near zero is compared at the data's scale."""
    assert got["count"] == want["count"]
    np.testing.assert_allclose(got["mean"], want["mean"], rtol=1e-6, atol=1e-6 * float(np.max(want["std"])))
    np.testing.assert_allclose(got["std"], want["std"], rtol=1e-6)
    assert got["mean_norm"] == pytest.approx(want["mean_norm"], rel=1e-6)


@pytest.mark.parametrize("storage", ["pooled", "full_sequence"])
def test_statistics_equal_numpy_over_every_stored_vector(tmp_path, rng, storage):
    write_dataset(tmp_path / "ds", rng, n=37, layers=(0, 4), dim=5, storage=storage, batch=6, statistics=True)
    ds = lmprobe.load(tmp_path / "ds")
    for layer in ds.layers:
        if storage == "pooled":
            stored = ds.hidden(layer)
        else:
            stored = np.concatenate([ds.token_hidden(i, layer) for i in range(ds.num_prompts)])
        _check(ds.statistics(layer), _numpy_stats(stored))
    desc = ds.info["statistics"]
    assert "statistics" not in ds.info["tensors"]  # lmprobe 0.10.3 expects shards in every tensors entry
    assert desc["type"] == "statistics" and desc["file"] == "tensors/statistics.safetensors" and desc["ddof"] == 0
    assert validate(tmp_path / "ds").ok


def test_bfloat16_statistics_are_over_the_stored_values(tmp_path, rng):
    write_dataset(tmp_path / "ds", rng, n=10, layers=(1,), dim=4, dtype="bfloat16", statistics=True)
    ds = lmprobe.load(tmp_path / "ds")
    _check(ds.statistics(1), _numpy_stats(ds.hidden(1)))


def test_parallel_merge_equals_one_pass(rng):
    x = rng.normal(size=(1000, 6)) * 100 + 1e4  # large offset: naive sums would lose precision
    parts = np.split(x, [1, 7, 300, 301, 999])
    s = RunningStats.empty(6)
    for p in parts:
        s = s.merge(RunningStats.of(p))
    _check(s.result(), _numpy_stats(x))


def test_extraction_records_statistics_by_default(llama_dir, tmp_path):
    ds = lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "ds", layers="1,3", storage="full_sequence",
                         batch_size=3, quiet=True)
    stored = np.concatenate([ds.token_hidden(i, 3) for i in range(ds.num_prompts)])
    _check(ds.statistics(3), _numpy_stats(stored))
    with pytest.raises(KeyError, match="layer 0 is not stored in this dataset; stored layers: \\[1, 3\\]"):
        ds.statistics(0)
    off = lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "off", layers="1", statistics=False, quiet=True)
    with pytest.raises(ValueError, match="no statistics"):
        off.statistics(1)


def test_resumed_writer_keeps_its_statistics(tmp_path):
    import subprocess
    import sys

    ref, out = tmp_path / "ref", tmp_path / "ds"
    assert subprocess.run([sys.executable, str(SUPPORT / "_crash_writer.py"), str(ref), "none", "0"]).returncode == 0
    assert subprocess.run([sys.executable, str(SUPPORT / "_crash_writer.py"), str(out), "batch", "5"]).returncode == 9
    assert subprocess.run([sys.executable, str(SUPPORT / "_crash_writer.py"), str(out), "none", "0"]).returncode == 0
    a, b = lmprobe.load(ref), lmprobe.load(out)
    for layer in a.layers:
        _check(b.statistics(layer), a.statistics(layer))


def test_datasets_with_statistics_inside_tensors_still_read(tmp_path, rng):
    """Datasets written before statistics got their own key kept the descriptor in lmprobe:tensors."""
    import json

    import pyarrow.parquet as pq

    write_dataset(tmp_path / "ds", rng, n=9, layers=(0,), dim=4, statistics=True)
    index = tmp_path / "ds/index/train-00000-of-00001.parquet"
    table = pq.read_table(index)
    meta = dict(table.schema.metadata)
    tensors = json.loads(meta[b"lmprobe:tensors"])
    tensors["statistics"] = json.loads(meta.pop(b"lmprobe:statistics"))
    meta[b"lmprobe:tensors"] = json.dumps(tensors).encode()
    pq.write_table(table.replace_schema_metadata(meta), index)
    ds = lmprobe.load(tmp_path / "ds")
    _check(ds.statistics(0), _numpy_stats(ds.hidden(0)))
    assert validate(tmp_path / "ds").ok
