"""The settings an extraction records (``lmprobe:extraction``) and the dataset description it writes are derived
from ExtractionConfig's field metadata, and come out exactly as the hand-written lists made them: the same keys, in
the same order (the metadata's bytes, and so a dataset's sha256, do not change)."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from lmprobe.extraction.config import ExtractionConfig
from lmprobe.format.datasetspec import DatasetSpec
from lmprobe.format.spec import DEFAULT_HOOKPOINT


def _listed_settings(cfg, *, model_name, revision, layers, max_length, prompts_sha256=None, num_prompts=None,
                     source=None, weights=None):
    """ExtractionConfig.settings as it was written out by hand, field by field: the reference."""
    what = {"prompts_sha256": prompts_sha256, "num_prompts": num_prompts}
    if cfg.corpus:
        what = {"source": source, "context_len": max_length, "max_tokens": cfg.max_tokens,
                "special_tokens": cfg.special_tokens}
    out = {
        "model": model_name, "revision": revision, **what, "layers": layers, "storage": cfg.storage,
        "dtype": cfg.dtype, "compute_dtype": cfg.compute_dtype, "logits_topk": cfg.logits_topk,
        "perplexity": cfg.perplexity, "token_ids": cfg.token_ids or cfg.token_strings,
        "token_strings": cfg.token_strings, "batch_size": cfg.batch_size, "max_length": max_length,
        "truncate": cfg.truncate, "backend": cfg.backend, "remote": cfg.remote, "statistics": cfg.statistics,
        "drop_special_tokens": cfg.drop_special_tokens, "chat_template": cfg.chat_template,
        "processing_order": "source" if cfg.corpus else "length_descending",
    }
    if cfg.corpus:
        for name in ("max_length", "truncate", "drop_special_tokens", "chat_template"):
            del out[name]
    if weights is not None:
        out["weights"] = weights
    if cfg.hookpoints != (DEFAULT_HOOKPOINT,):
        out["hookpoints"] = list(cfg.hookpoints)
    return out


CONFIGS = [
    dict(),
    dict(storage="full_sequence", dtype="bfloat16", logits_topk=5, perplexity=True, token_strings=True,
         batch_size=3, truncate="left", max_length=64, chat_template=False, drop_special_tokens=True,
         hookpoints="resid_pre,mlp_out", statistics=False),
    dict(token_ids=True, backend="nnsight", remote="local", compute_dtype="float16", revision="abc"),
    dict(context_len=128, max_tokens="50M", special_tokens=False, dtype="int8", label_column=None),
    dict(max_tokens=1000, storage="full_sequence", hookpoints="attn_out"),
]


@pytest.mark.parametrize("options", CONFIGS)
@pytest.mark.parametrize("weights", [None, "sha256:00ff"])
def test_the_recorded_settings_are_the_listed_ones_in_the_same_order(options, weights):
    cfg = ExtractionConfig(model="m", prompts=["a"], out="o", **options)
    kw = dict(model_name="org/m", revision="0123abcd", layers=[0, 3, 5], max_length=77, prompts_sha256="ab" * 32,
              num_prompts=12, source={"kind": "hub", "repo": "x/y"}, weights=weights)
    got, want = cfg.settings(**kw), _listed_settings(cfg, **kw)
    assert list(got.items()) == list(want.items())
    assert json.dumps(got) == json.dumps(want)  # the bytes written into the metadata


def test_the_description_takes_the_fields_marked_for_it():
    cfg = ExtractionConfig(model="m", prompts=["a"], out="o", storage="full_sequence", dtype="float16", logits_topk=4,
                           perplexity=True, token_strings=True, checksums=False, statistics=False,
                           hookpoints="resid_pre,resid_post")
    assert cfg.spec_settings() == {
        "storage": "full_sequence", "dtype": "float16", "logits_topk": 4, "perplexity": True, "token_perplexity": True,
        "token_strings": True, "checksums": False, "statistics": False, "hookpoints": ("resid_pre", "resid_post")}
    described = {f.name for f in fields(DatasetSpec)}
    assert set(cfg.spec_settings()) <= described


# ---- one name for the number of logits: ``logits_topk`` everywhere, ``logits_k=`` a deprecated keyword, the bytes
# on disk as before (the fingerprint's "logits_k", the metadata's "k")

_FIXED_PROVENANCE = {"lmprobe_version": "0", "writer": "w", "extraction_backend": None, "nnsight_version": None,
                     "torch_version": None, "transformers_version": None, "python_version": "3",
                     "created_at": "2026-01-01T00:00:00+00:00"}
_SPEC = dict(layers=[0, 2], dim=4, model_name="org/m", shard_size=64, label_type="int")


def _write_small_dataset(out, **logits):
    """Eleven prompts, two layers, top-3 logits, fixed provenance: (sha256 by shard file, the ``lmprobe:`` metadata)."""
    import hashlib

    import numpy as np
    import pyarrow.parquet as pq

    from lmprobe.format.metadata import decode_schema_metadata
    from lmprobe.format.spec import INDEX_PATH
    from lmprobe.format.writer import DatasetWriter

    rng = np.random.default_rng(7)
    w = DatasetWriter(out, provenance=_FIXED_PROVENANCE, **_SPEC, **logits)
    for i in range(11):
        values = -np.sort(-rng.normal(size=3).astype(np.float32))
        w.add(text=f"p{i}", hidden={0: rng.normal(size=4).astype(np.float32), 2: rng.normal(size=4).astype(np.float32)},
              num_tokens=2, label=i % 2, logits_values=values,
              logits_indices=rng.integers(0, 50, size=3).astype(np.int32))
    w.close()
    shards = {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
              for p in sorted(out.rglob("*.safetensors"))}
    return shards, decode_schema_metadata(pq.read_schema(out / INDEX_PATH).metadata)


def _sha256_of_json(value) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(value).encode()).hexdigest()


def test_the_description_names_the_number_of_logits_as_the_config_does():
    assert ExtractionConfig(model="m", prompts=["a"], out="o", logits_topk=4).spec_settings()["logits_topk"] == 4
    spec = DatasetSpec(**_SPEC, logits_topk=4)
    assert spec.logits_topk == 4 and spec.logits_rows_per_shard == 2
    assert "logits_topk" in {f.name for f in fields(DatasetSpec)} and "logits_k" not in {f.name for f in fields(DatasetSpec)}


def test_the_old_logits_k_keyword_warns_and_still_works(tmp_path):
    from lmprobe.format.writer import DatasetWriter

    with pytest.warns(DeprecationWarning, match="logits_topk"):
        old = DatasetSpec(**_SPEC, logits_k=3)
    assert old == DatasetSpec(**_SPEC, logits_topk=3)
    with pytest.warns(DeprecationWarning, match="logits_topk"):
        assert old.logits_k == 3  # the old attribute reads the new one
    with pytest.warns(DeprecationWarning, match="logits_topk") as caught:
        w = DatasetWriter(tmp_path / "ds", **_SPEC, logits_k=3)
    assert caught[0].filename == __file__  # the warning points at the caller's line
    assert w.spec.logits_topk == 3
    w.close()
    with pytest.raises(TypeError, match="logits_k"):
        DatasetSpec(**_SPEC, logits_k=3, logits_topk=3)


def test_a_dataset_with_logits_is_written_to_the_same_bytes_as_before(tmp_path):
    """The sha256 of every shard, the ``lmprobe:`` metadata (its ``"k"`` included) and the resume fingerprint (its
    ``"logits_k"`` key) as the writer made them before the keyword was renamed."""
    shards, meta = _write_small_dataset(tmp_path / "new", logits_topk=3)
    assert len(shards) == 12
    assert _sha256_of_json(shards) == "c45c21dfb94459bb1032e204452d5b98603e22e2ed75e696de30654c8a72706a"
    assert meta["tensors"]["logits_topk"]["k"] == 3
    assert _sha256_of_json(meta) == "591d2c56125a5fd0de6052eff47df189019e8833a19cf2e47dad5cf02e120566"
    with pytest.warns(DeprecationWarning):
        assert _write_small_dataset(tmp_path / "old", logits_k=3) == (shards, meta)
    assert DatasetSpec(**_SPEC, logits_topk=3).fingerprint() == {
        "format_version": "2.0", "layers": [0, 2], "dim": 4, "storage": "pooled", "dtype": "float32", "shard_size": 64,
        "logits_k": 3, "label_type": "int", "columns": {},
        "file_pattern": "tensors/hidden_layer{layer:03d}_shard{shard:03d}.safetensors", "key_pattern": "hidden.layer_{layer}",
        "logits_file_pattern": "tensors/logits_topk_{shard:03d}.safetensors", "model": {"name": "org/m", "revision": None},
        "perplexity": False, "token_ids": False, "token_strings": False, "token_perplexity": False, "statistics": False}
