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
        "storage": "full_sequence", "dtype": "float16", "logits_k": 4, "perplexity": True, "token_perplexity": True,
        "token_strings": True, "checksums": False, "statistics": False, "hookpoints": ("resid_pre", "resid_post")}
    described = {f.name for f in fields(DatasetSpec)}
    assert set(cfg.spec_settings()) <= described
