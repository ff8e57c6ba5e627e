"""Hookpoints beyond the residual stream: each one equals a forward hook on the module it names.

The reference values come from hooks placed by hand on each family's modules (the table in
docs/hookpoints.md), run on one prompt at a time without padding; lmprobe locates the same sites
by structure and reads them in padded batches.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from support.paths import ROOT

import lmprobe
import lmprobe.extraction.model as model_mod
from lmprobe.errors import LmprobeError, ModelError

TOKEN = "hf_testSECRETtoken1234567890"
PROMPTS = ["the cat sat on the mat", "a b", "one two three four five six seven", "x"]
NAMED = ["resid_pre", "attn_out", "resid_mid", "mlp_in", "mlp_out", "resid_post"]

# family -> hookpoint -> (module path inside the block, "input" | "output"), written by hand
TABLE = {
    "llama": {"resid_pre": ("", "input"), "attn_out": ("self_attn", "output"),
              "resid_mid": ("post_attention_layernorm", "input"), "mlp_in": ("mlp", "input"),
              "mlp_out": ("mlp", "output"), "resid_post": ("", "output"), "mlp.act_fn:output": ("mlp.act_fn", "output")},
    "gpt2": {"resid_pre": ("", "input"), "attn_out": ("attn", "output"), "resid_mid": ("ln_2", "input"),
             "mlp_in": ("mlp", "input"), "mlp_out": ("mlp", "output"), "resid_post": ("", "output")},
    "bert": {"resid_pre": ("", "input"), "attn_out": ("attention.output.dense", "output"),
             "resid_mid": ("attention", "output"), "mlp_in": ("intermediate", "input"),
             "mlp_out": ("output.dense", "output"), "resid_post": ("", "output")},
}


def _reference(model_dir, family, layer, hookpoints):
    """{hookpoint: [(tokens, width) per prompt]} from hand-placed hooks, one unpadded prompt at a time."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    blocks = {"llama": lambda m: m.layers, "gpt2": lambda m: m.h, "bert": lambda m: m.encoder.layer}[family](model)
    out = {hp: [] for hp in hookpoints}
    for text in PROMPTS:
        got = {}
        handles = []
        for hp in hookpoints:
            path, side = TABLE[family][hp]
            module = blocks[layer].get_submodule(path) if path else blocks[layer]
            if side == "input":
                def pre(_m, args, kwargs, hp=hp, got=got):
                    got[hp] = (args[0] if args else kwargs["hidden_states"]).detach().clone()
                handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            else:
                def post(_m, _a, output, hp=hp, got=got):
                    got[hp] = (output[0] if isinstance(output, tuple) else output).detach().clone()
                handles.append(module.register_forward_hook(post))
        enc = tok(text, return_tensors="pt")
        with torch.no_grad():
            model(**enc)
        for h in handles:
            h.remove()
        for hp in hookpoints:
            out[hp].append(got[hp][0].numpy())
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_every_named_hookpoint_equals_a_hook_on_its_module(request, family, tmp_path):
    model_dir = request.getfixturevalue(f"{family}_dir")
    hookpoints = NAMED + (["mlp.act_fn:output"] if family == "llama" else [])
    ds = lmprobe.extract(str(model_dir), PROMPTS, out=tmp_path / "ds", layers="0,1", hookpoints=hookpoints,
                         storage="full_sequence", batch_size=4, device="cpu", quiet=True)
    assert set(ds.hookpoints) == set(hookpoints) and ds.hookpoints[0] == "resid_post"
    ref = _reference(model_dir, family, 1, hookpoints)
    for hp in hookpoints:
        for i in range(len(PROMPTS)):
            np.testing.assert_allclose(ds.token_hidden(i, 1, hookpoint=hp), ref[hp][i], atol=2e-5, rtol=1e-4,
                                       err_msg=f"{family} {hp} prompt {i}")
    if family == "llama":
        assert ds.token_hidden(0, 1, hookpoint="mlp.act_fn:output").shape[1] == 64  # the MLP's own width
        # the residual stream adds up: resid_mid = resid_pre + attn_out, resid_post = resid_mid + mlp_out
        pre, attn, mid, mlp, post = (ds.token_hidden(2, 0, hookpoint=h)
                                     for h in ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post"))
        np.testing.assert_allclose(pre + attn, mid, atol=1e-5)
        np.testing.assert_allclose(mid + mlp, post, atol=1e-5)
    assert lmprobe.validate(tmp_path / "ds").ok


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_pooled_hookpoints_read_the_last_real_token_whatever_the_padding(tmp_path, padding_side):
    from support.tiny_models import build_llama

    model_dir = build_llama(tmp_path / f"llama-{padding_side}", padding_side=padding_side, layers=2)
    ds = lmprobe.extract(str(model_dir), PROMPTS, out=tmp_path / "ds", layers="1", hookpoints="mlp_out,attn_out",
                         batch_size=4, device="cpu", quiet=True)
    ref = _reference(model_dir, "llama", 1, ["mlp_out", "attn_out"])
    for hp in ("mlp_out", "attn_out"):
        want = np.stack([r[-1] for r in ref[hp]])
        np.testing.assert_allclose(ds.hidden(1, hookpoint=hp), want, atol=2e-5, rtol=1e-4)
    # without resid_post, hidden_layers holds the first requested hookpoint and says so
    assert ds.hookpoints == ["attn_out", "mlp_out"]
    assert ds.info["tensors"]["hidden_layers"]["hookpoint"] == "attn_out"
    np.testing.assert_array_equal(ds.hidden(1), ds.hidden(1, hookpoint="attn_out"))


def test_default_extraction_is_unchanged(llama_dir, tmp_path):
    ds = lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "ds", layers="0", device="cpu", quiet=True)
    assert ds.hookpoints == ["resid_post"]
    assert list(ds.info["tensors"]) == ["hidden_layers"] and "hookpoint" not in ds.info["tensors"]["hidden_layers"]
    assert "hookpoints" not in ds.info["extraction"]["settings"]


def test_a_third_party_finds_every_hookpoint_from_the_descriptors(llama_dir, tmp_path):
    """Only pyarrow and safetensors, following docs/format.md: type "hidden" entries, their patterns and the index."""
    import pyarrow.parquet as pq
    from safetensors.numpy import load_file

    ds = lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "ds", layers="0,2", hookpoints="resid_post,mlp_in",
                         storage="full_sequence", shard_size=600, device="cpu", quiet=True)
    meta = pq.read_schema(tmp_path / "ds" / "index" / "train-00000-of-00001.parquet").metadata
    tensors = json.loads(meta[b"lmprobe:tensors"])
    found = {d.get("hookpoint", "resid_post"): d for d in tensors.values() if d.get("type") == "hidden"}
    assert set(found) == {"resid_post", "mlp_in"}
    table = pq.read_table(tmp_path / "ds" / "index" / "train-00000-of-00001.parquet")
    d = found["mlp_in"]
    row = table.slice(2, 1).to_pylist()[0]
    vecs = [load_file(str(tmp_path / "ds" / d["file_pattern"].format(layer=2, shard=s)))[d["key_pattern"].format(layer=2)][o]
            for s, o in zip(row["token_shard_ids"], row["token_shard_offsets"], strict=True)]
    np.testing.assert_array_equal(np.stack(vecs), ds.token_hidden(2, 2, hookpoint="mlp_in"))
    assert len(d["shards"]) == len(found["resid_post"]["shards"]) > 2  # the same shard structure


def test_hookpoint_errors_come_before_the_weights_load(request, tmp_path, monkeypatch):
    from support.tiny_models import train_tokenizer
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    monkeypatch.setattr(model_mod, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    llama = request.getfixturevalue("llama_dir")
    with pytest.raises(ModelError, match=r"no module 'mlp\.nope'.*mlp\.act_fn"):
        lmprobe.extract(str(llama), PROMPTS, out=tmp_path / "a", hookpoints="mlp.nope:output", device="cpu", quiet=True)
    with pytest.raises(LmprobeError, match="unknown hookpoint 'resid'"):
        lmprobe.extract(str(llama), PROMPTS, out=tmp_path / "b", hookpoints="resid", device="cpu", quiet=True)
    # a parallel block (GPT-NeoX's default) has no stream between its sublayers
    neox = tmp_path / "neox"
    tok = train_tokenizer(neox, kind="gpt2", padding_side="right")
    cfg = GPTNeoXConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64)
    cfg.save_pretrained(neox)
    with pytest.raises(ModelError, match="no resid_mid: its attention and MLP read the same input in parallel"):
        lmprobe.extract(str(neox), PROMPTS, out=tmp_path / "c", hookpoints="resid_mid", device="cpu", quiet=True)
    assert not (tmp_path / "c" / "index").exists()
    del GPTNeoXForCausalLM


def test_cli_hookpoints_and_pull_of_one_hookpoint(llama_dir, tmp_path, hub, fresh_hf_cache):
    out = tmp_path / "ds"
    r = subprocess.run([sys.executable, "-m", "lmprobe", "extract", "--model", str(llama_dir), "--prompts", str(ROOT / "examples/prompts.jsonl"),
                        "--out", str(out), "--layers", "1", "--hookpoints", "mlp_out,resid_post", "--device", "cpu",
                        "--quiet"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    ds = lmprobe.load(out)
    assert ds.hookpoints == ["resid_post", "mlp_out"]
    assert (out / "tensors" / "mlp_out_layer001_shard000.safetensors").is_file()
    lmprobe.push_to_hub(out, "me/hooks", token=TOKEN, quiet=True)
    pulled = lmprobe.pull("me/hooks", tmp_path / "pulled", hookpoints=["mlp_out"], token=TOKEN, quiet=True)
    files = sorted(p.name for p in (pulled / "tensors").iterdir())
    assert files == ["mlp_out_layer001_shard000.safetensors", "statistics.safetensors"]
    np.testing.assert_array_equal(lmprobe.load(pulled).hidden(1, hookpoint="mlp_out"), ds.hidden(1, hookpoint="mlp_out"))


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_nnsight_backend_reads_the_same_hookpoints(request, family, tmp_path):
    model_dir = request.getfixturevalue(f"{family}_dir")
    hookpoints = "resid_pre,attn_out,resid_mid,mlp_in,mlp_out,resid_post"  # BERT: attention.output / output.dense
    kw = dict(layers="0,1", hookpoints=hookpoints, storage="full_sequence", batch_size=2, device="cpu", quiet=True)
    a = lmprobe.extract(str(model_dir), PROMPTS, out=tmp_path / "hf", **kw)
    b = lmprobe.extract(str(model_dir), PROMPTS, out=tmp_path / "nn", backend="nnsight", **kw)
    for hp in a.hookpoints:
        for i in range(len(PROMPTS)):
            np.testing.assert_allclose(b.token_hidden(i, 1, hookpoint=hp), a.token_hidden(i, 1, hookpoint=hp),
                                       atol=1e-5, err_msg=hp)


def test_saev_export_probe_sweep_and_info_take_a_hookpoint(llama_dir, tmp_path):
    from lmprobe.pages.summary import text
    from lmprobe.probe import sweep
    from lmprobe.saev import SaevDataset, export_saev

    prompts = [{"text": t, "label": i % 2} for i, t in enumerate(PROMPTS * 3)]
    ds = lmprobe.extract(str(llama_dir), prompts, out=tmp_path / "ds", layers="0,1", hookpoints="resid_post,mlp_out",
                         storage="full_sequence", device="cpu", quiet=True)
    folder = export_saev(ds, tmp_path / "saev", layers=[1], context_len=4, hookpoint="mlp_out", quiet=True)
    sv = SaevDataset(folder)
    first = np.concatenate([ds.token_hidden(i, 1, hookpoint="mlp_out") for i in range(2)])[:4]
    np.testing.assert_array_equal(sv.shard(0)[0, 0], first)
    other = export_saev(ds, tmp_path / "saev", layers=[1], context_len=4, quiet=True)
    assert other != folder  # another hookpoint, another export
    table = sweep(ds, hookpoints=["resid_post", "mlp_out"], cv=2)
    assert list(table["hookpoint"]) == ["resid_post", "resid_post", "mlp_out", "mlp_out"]
    assert re.search(r"hookpoints +resid_post, mlp_out", text(ds))
    with pytest.raises(LmprobeError, match="hookpoint 'attn_out' is not"):
        export_saev(ds, tmp_path / "saev", layers=[1], context_len=4, hookpoint="attn_out", quiet=True)
