"""Reliability, round 3 (issue 27): what an outside red-team pass found, one test per finding.

Each test failed on main before its fix. The interrupted-operation matrix is in docs/security.md.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ROOT, write_dataset

import lmprobe
from lmprobe.cli import main as cli_main

INDEX = "index/train-00000-of-00001.parquet"


# ------------------------------------------------------------------ 3. num_tokens beyond the address lists


# ------------------------------------------------------------------ 4. metadata listing 100,000 layers


# ------------------------------------------------------------------ 5. kill -9 during merge


# ------------------------------------------------------------------ 7. --max-tokens on a labelled prompt file


def test_max_tokens_on_labelled_prompts_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import lmprobe.extraction.runner as runner

    loaded = []
    monkeypatch.setattr(runner, "load_model", lambda *a, **k: loaded.append(1) or (_ for _ in ()).throw(AssertionError))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "the cat sat", "label": 1, "topic": "pets"}\n{"text": "a dog", "label": 0, '
                       '"topic": "pets"}\n')
    out = tmp_path / "m"
    assert cli_main(["extract", "--model", "lmprobe-tiny", "--prompts", str(prompts), "--out", str(out),
                     "--max-tokens", "10M"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'label'" in err[0] and "--context-len" in err[0] and "topic" in err[0], err
    assert not loaded and not (out / INDEX).exists()


def test_corpus_extraction_says_which_columns_it_does_not_store(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "the cat sat on the mat", "url": "a"}\n{"text": "a dog ran far", "url": "b"}\n')
    assert cli_main(["extract", "--model", "lmprobe-tiny", "--prompts", str(prompts), "--out", str(tmp_path / "m"),
                     "--max-tokens", "8", "--layers", "0", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "'url'" in err and "document" in err
    assert lmprobe.load(tmp_path / "m").num_prompts >= 1


# ------------------------------------------------------------------ 8. a missing local path is not sent to the Hub


# ------------------------------------------------------------------ 9. a mistyped model name, the Hub unreachable


def test_a_model_name_close_to_the_embedded_one_gets_did_you_mean(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert cli_main(["extract", "--model", "lmprobe-tinny", "--prompts", str(ROOT / "examples/prompts.jsonl"), "--out",
                     str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did you mean 'lmprobe-tiny'" in err[0], err


@pytest.mark.parametrize("command", [
    ["extract", "--model", "someone/no-such-model", "--prompts", "{root}/examples/prompts.jsonl", "--out", "{tmp}/m"],
    ["report", "{tmp}/ds", "--out", "{tmp}/r", "--tokenizer", "someone/no-such-tokenizer"],
])
def test_an_unreachable_hub_is_one_attempt_and_one_line(tmp_path, rng, capsys, monkeypatch, command):
    from huggingface_hub import constants

    write_dataset(tmp_path / "ds", rng, n=6, layers=(0,), dim=4)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert cli_main([a.replace("{tmp}", str(tmp_path)).replace("{root}", str(ROOT)) for a in command]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot reach the Hub at http://127.0.0.1:9" in err[0], err
    assert "\\n" not in err[0] and "Retry" not in err[0]


def test_ctrl_c_says_how_to_go_on(monkeypatch, capsys):
    """Issue 28, item 3: Ctrl-C said only 'interrupted'."""
    from lmprobe.cli import datasets, extract, main

    def interrupted(args):
        raise KeyboardInterrupt

    for command, words in [("extract", "run the same command again to resume"), ("merge", "finish the merge"),
                           ("validate", "run the command again")]:
        monkeypatch.setattr(extract if command == "extract" else datasets, f"cmd_{command}", interrupted)
        argv = {"extract": ["extract", "--model", "m", "--prompts", "p", "--out", "o"],
                "merge": ["merge", "a", "--out", "o"], "validate": ["validate", "x"]}[command]
        assert main(argv) == 130
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"lmprobe {command}: interrupted; ") and words in err, err


# ------------------------------------------------------------------ S3 outputs: a shard uploaded before its hash


# ------------------------------------------------------------------ features: damaged caches and partial states


@pytest.fixture(scope="module")
def feature_setup(tmp_path_factory):
    from lmprobe.sae.export import export_sae

    root = tmp_path_factory.mktemp("features")
    rng = np.random.default_rng(3)
    write_dataset(root / "ds", rng, n=30, layers=(1,), dim=16, storage="full_sequence", shard_size="1KB",
                  token_ids=True)
    W = rng.normal(size=(24, 16)).astype(np.float32) / 4
    export_sae(layer=1, root=root / "sae", dictionary="d", W_enc=W, b_enc=np.full(24, 0.1, np.float32),
               orientation="out_in", activation="topk:4")
    ref = lmprobe.features(root / "ds", root / "sae", "d", 1, root / "ref", top=3, quiet=True)
    return root, ref


def _features(root, out, **kw):
    return lmprobe.features(root / "ds", root / "sae", "d", 1, out, top=3, quiet=True, **kw)


def _same_cache(a, b):
    from safetensors.numpy import load_file

    x, y = load_file(str(a / "features.safetensors")), load_file(str(b / "features.safetensors"))
    assert sorted(x) == sorted(y)
    for k in x:
        np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def _damage_cache(path, how):
    from safetensors.numpy import load_file, save_file

    if how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "deleted":
        path.unlink()
    else:
        t = load_file(str(path))
        if how == "no frequency":
            del t["frequency"]
        elif how == "wrong shape":
            t["top_values"] = t["top_values"][:, :2].copy()
        elif how == "wrong dtype":
            t["top_prompt"] = t["top_prompt"].astype(np.float32)
        elif how == "prompt out of range":
            t["top_prompt"][0, 0] = 10**6
        elif how == "token out of range":
            t["top_token"][0, 0] = 10**6
        elif how == "no histogram edges":
            del t["histogram_edges"]
        save_file(t, str(path))


@pytest.mark.parametrize("how", ["truncated", "empty", "deleted", "no frequency", "wrong shape", "wrong dtype",
                                 "prompt out of range", "token out of range", "no histogram edges"])
def test_a_damaged_feature_cache_is_computed_again(feature_setup, tmp_path, capsys, how):
    """The interrupted-operation matrix (issue 27) found a complete cache trusted as it was: tracebacks."""
    import shutil

    root, ref = feature_setup
    out = tmp_path / "f"
    shutil.copytree(ref, out)
    _damage_cache(out / "features.safetensors", how)
    _features(root, out)
    _same_cache(ref, out)
    assert "computing it again" in capsys.readouterr().err


@pytest.mark.parametrize("manifest", ["[1, 2]", '"x"', "{}", '{"tokens": -5}'])
def test_a_manifest_that_is_not_this_runs_object_is_computed_again_or_refused(feature_setup, tmp_path, manifest,
                                                                              capsys):
    import json
    import shutil

    root, ref = feature_setup
    out = tmp_path / "f"
    shutil.copytree(ref, out)
    good = json.loads((ref / "manifest.json").read_text())
    text = json.dumps({**good, **json.loads(manifest)}) if manifest.startswith('{"tokens"') else manifest
    (out / "manifest.json").write_text(text)
    _features(root, out)
    _same_cache(ref, out)
    assert json.loads((out / "manifest.json").read_text())["tokens"] == good["tokens"]


def _partial(root, ds, out, monkeypatch):
    """A run killed after its first checkpoint: its partial cache and state."""
    import lmprobe.pages.features as F

    real, calls = F.FeatureCache.add, {"n": 0}

    def dying(self, *a):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self, *a)

    monkeypatch.setattr(F.FeatureCache, "add", dying)
    with pytest.raises(KeyboardInterrupt):
        lmprobe.features(ds, root / "sae", "d", 1, out, top=3, quiet=True, memory="20KB", checkpoint_tokens=1)
    monkeypatch.setattr(F.FeatureCache, "add", real)
    assert (out / ".features-partial.json").exists()
    return out


@pytest.mark.parametrize("edit", [
    {"next_prompt": "x"}, {"next_prompt": None}, {"next_prompt": -5}, {"next_prompt": 1.5}, {"next_prompt": 10**6},
    {"next_prompt": 2**70}, "a list", "truncated cache", "float16 cache", "negative tokens_seen", "tokens_seen off",
])
def test_a_tampered_partial_feature_state_starts_over(feature_setup, tmp_path, monkeypatch, capsys, edit):
    import json

    from safetensors.numpy import load_file, save_file

    root, ref = feature_setup
    out = _partial(root, root / "ds", tmp_path / "p", monkeypatch)
    state, cache = out / ".features-partial.json", out / ".features-partial.safetensors"
    if isinstance(edit, dict):
        state.write_text(json.dumps({**json.loads(state.read_text()), **edit}))
    elif edit == "a list":
        state.write_text("[1]")
    elif edit == "truncated cache":
        cache.write_bytes(cache.read_bytes()[:100])
    else:
        t = load_file(str(cache))
        if edit == "float16 cache":
            t["values"] = t["values"].astype(np.float16)
        elif edit == "negative tokens_seen":
            t["tokens_seen"] = np.array([-2**40], dtype=np.int64)
        else:
            t["tokens_seen"] = t["tokens_seen"] + 1
        save_file(t, str(cache))
    _features(root, out)
    _same_cache(ref, out)
    assert "starting over" in capsys.readouterr().err


def test_a_partial_feature_state_over_a_rewritten_dataset_starts_over(feature_setup, tmp_path, monkeypatch):
    """The matrix found a partial cache resumed over a dataset rewritten in place (same path, same prompt count)."""
    import shutil

    root, _ = feature_setup
    ds = tmp_path / "ds"
    shutil.copytree(root / "ds", ds)
    out = _partial(root, ds, tmp_path / "p", monkeypatch)
    shutil.rmtree(ds)
    write_dataset(ds, np.random.default_rng(9), n=30, layers=(1,), dim=16, storage="full_sequence",
                  shard_size="1KB", token_ids=True)  # the same path and prompt count, other data
    fresh = lmprobe.features(ds, root / "sae", "d", 1, tmp_path / "fresh", top=3, quiet=True)
    lmprobe.features(ds, root / "sae", "d", 1, out, top=3, quiet=True)
    _same_cache(fresh, out)
