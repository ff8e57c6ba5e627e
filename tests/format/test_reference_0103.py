"""The reference implementation (``lmprobe==0.10.3`` from PyPI, in its own virtual environment) reads what we write.

This guards every format addition: 0.10.3 walks every entry of ``lmprobe:tensors`` and reads
hidden shards by its own rules, so a new key in the wrong place breaks all of its readers. Each
dataset is read with 0.10.3's ``load_activation_dataset``, ``load_activations``, ``pull_dataset``
and ``ActivationStore.from_dataset``, and the values are compared with lmprobe's own reading.

The environment is made once (tests/reference/envs.py; .ci/run makes it before the tests run).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from reference.envs import reference_python
from safetensors.numpy import load_file
from support.paths import REFERENCE

import lmprobe

pytestmark = pytest.mark.slow  # a second Python environment and subprocesses

READER = REFERENCE / "read_with_0103.py"


@pytest.fixture(scope="session")
def ref_python() -> Path:
    return reference_python()


def read_with_reference(python: Path, dataset: Path, tmp_path: Path) -> tuple[dict, dict]:
    out = tmp_path / f"{dataset.name}-0103.safetensors"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    r = subprocess.run([str(python), "-I", str(READER), str(dataset), str(out)], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return load_file(str(out)), json.loads(r.stdout.strip().splitlines()[-1])


def shard_order_rows(ds, layer: int) -> np.ndarray:
    """Every stored row of ``layer``, in shard-file order (what load_activation_dataset concatenates)."""
    shard = ds.column("shard_index")
    offset = ds.column("row_offset")
    if ds.storage == "full_sequence":
        ids, offs, _ = ds.shards.token_addresses()
        shard, offset = np.concatenate([shard, ids]), np.concatenate([offset, offs])
        uniq = np.unique(np.stack([shard, offset], axis=1), axis=0)
        shard, offset = uniq[:, 0], uniq[:, 1]
    order = np.lexsort((offset, shard))
    return np.asarray(ds.shards.read_hidden_rows(layer, shard[order], offset[order]), dtype=np.float32)


PROMPTS = [{"text": f"Prompt number {i}: " + " ".join(["the cat sat", "a dog ran far", "numbers 12 and 345"][i % 3]
                                                       for _ in range(1 + i % 4)), "label": i % 2} for i in range(14)]


@pytest.mark.parametrize(("storage", "dtype"), [("pooled", "float32"), ("full_sequence", "float32"),
                                                ("pooled", "float16"), ("full_sequence", "bfloat16")])
def test_reference_implementation_reads_our_default_output(ref_python, tmp_path, storage, dtype):
    out = tmp_path / f"{storage}-{dtype}"
    ds = lmprobe.extract("lmprobe-tiny", PROMPTS, out=out, layers="0,2,-1", storage=storage, dtype=dtype,
                         logits_topk=4, perplexity=True, token_strings=True, shard_size="3KB", batch_size=4,
                         quiet=True)
    assert ds.meta.statistics is not None  # the default output, statistics included
    got, summary = read_with_reference(ref_python, out, tmp_path)
    assert summary["pulled"] == len(PROMPTS)
    assert summary["store_prompts"] == ds.texts
    assert summary["layers"] == ds.layers
    for layer in ds.layers:
        want = np.asarray(ds.hidden(layer), dtype=np.float32)
        np.testing.assert_array_equal(got[f"load_activations/{layer}"], want)
        np.testing.assert_array_equal(got[f"ActivationStore/{layer}"], want)
        np.testing.assert_array_equal(got[f"load_activation_dataset/hidden.layer_{layer}"], shard_order_rows(ds, layer))


@pytest.mark.parametrize("hookpoints", ["resid_post,mlp_out,attn_out", "mlp_in"])
def test_reference_implementation_reads_hidden_layers_of_hookpoint_datasets(ref_python, tmp_path, hookpoints):
    """Other hookpoints are more descriptors of type hidden: 0.10.3 still reads hidden_layers (what it holds:
    resid_post, or the first hookpoint when resid_post was not asked for)."""
    out = tmp_path / hookpoints.replace(",", "-")
    ds = lmprobe.extract("lmprobe-tiny", PROMPTS, out=out, layers="0,-1", hookpoints=hookpoints,
                         storage="full_sequence", shard_size="3KB", batch_size=4, quiet=True)
    assert len(ds.hookpoints) == len(hookpoints.split(","))
    got, summary = read_with_reference(ref_python, out, tmp_path)
    assert summary["pulled"] == len(PROMPTS) and summary["layers"] == ds.layers
    for layer in ds.layers:
        want = np.asarray(ds.hidden(layer), dtype=np.float32)
        np.testing.assert_array_equal(got[f"load_activations/{layer}"], want)
        np.testing.assert_array_equal(got[f"ActivationStore/{layer}"], want)
        np.testing.assert_array_equal(got[f"load_activation_dataset/hidden.layer_{layer}"], shard_order_rows(ds, layer))


@pytest.mark.parametrize(("storage", "dtype"), [("pooled", "float32"), ("full_sequence", "bfloat16")])
def test_reference_implementation_reads_a_merged_dataset(ref_python, tmp_path, storage, dtype):
    """The merge writes its index streaming, with the index's encodings (delta-encoded integers, zstd): 0.10.3
    reads it as it reads one extraction's."""
    from lmprobe.format.merge import merge_datasets

    parts = []
    for k, prompts in enumerate((PROMPTS[:8], PROMPTS[8:])):
        parts.append(tmp_path / f"part{k}")
        lmprobe.extract("lmprobe-tiny", prompts, out=parts[-1], layers="0,-1", storage=storage, dtype=dtype,
                        logits_topk=4, token_ids=True, shard_size="3KB", batch_size=4, quiet=True)
    out = merge_datasets(parts, tmp_path / "merged")
    ds = lmprobe.load(out)
    got, summary = read_with_reference(ref_python, out, tmp_path)
    assert summary["pulled"] == len(PROMPTS) and summary["store_prompts"] == ds.texts
    for layer in ds.layers:
        want = np.asarray(ds.hidden(layer), dtype=np.float32)
        np.testing.assert_array_equal(got[f"load_activations/{layer}"], want)
        np.testing.assert_array_equal(got[f"ActivationStore/{layer}"], want)
        np.testing.assert_array_equal(got[f"load_activation_dataset/hidden.layer_{layer}"], shard_order_rows(ds, layer))


REFUSER = REFERENCE / "refuse_with_0103.py"


def readers_of_0103(python: Path, dataset: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    r = subprocess.run([str(python), "-I", str(REFUSER), str(dataset)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_reference_implementation_refuses_int8_datasets_and_would_misread_them_as_2x(ref_python, tmp_path, rng):
    """0.10.3 never returns wrong numbers for an int8 dataset. It is format 3.0, which every reader
    of 0.10.3 refuses (a higher major version); the same bytes labelled 2.0 are read as codes cast to float,
    wrong by 1/scale, which is why int8 is not a 2.x dtype."""
    from support.datasets import write_dataset

    src = write_dataset(tmp_path / "ds", rng, n=6, layers=(0,), dim=4, dtype="int8")
    got = readers_of_0103(ref_python, tmp_path / "ds")
    for reader in ("load_activation_dataset", "load_activations", "pull_dataset", "ActivationStore"):
        assert "error" in got[reader], (reader, got[reader])
        assert "3.0" in got[reader]["error"] and "upgrade" in got[reader]["error"].lower(), got[reader]

    # the counterfactual: the same dataset labelled 2.0 is read as codes, wrong by orders of magnitude
    import pyarrow.parquet as pq

    path = tmp_path / "ds/index/train-00000-of-00001.parquet"
    table = pq.read_table(path)
    meta = dict(table.schema.metadata)
    meta[b"lmprobe:format_version"] = json.dumps("2.0").encode()
    pq.write_table(table.replace_schema_metadata(meta), path)
    misread = readers_of_0103(ref_python, tmp_path / "ds")
    wrong = [r for r, v in misread.items() if v.get("values")]
    assert wrong, misread
    true = src["hidden"][0][0]
    for r in wrong:
        assert np.abs(np.asarray(misread[r]["values"]) - true).max() > 10 * np.abs(true).max(), (r, misread[r])
