"""Reliability, round 3 (issue 27): what an outside red-team pass found, one test per finding.

Each test failed on main before its fix. The interrupted-operation matrix is in docs/security.md.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, write_dataset

import lmprobe
from lmprobe.cli import main as cli_main
from lmprobe.errors import FormatError

INDEX = "index/train-00000-of-00001.parquet"


def edit_index_column(root, name, edit):
    """Rewrite one index column (keeping the schema metadata): ``edit(list) -> list``."""
    path = root / INDEX
    table = pq.read_table(path)
    field = table.schema.field(name)
    values = edit(table.column(name).to_pylist())
    table = table.set_column(table.column_names.index(name), field, pa.array(values, field.type))
    pq.write_table(table.replace_schema_metadata(pq.read_schema(path).metadata), path)


# ------------------------------------------------------------------ 3. num_tokens beyond the address lists


@pytest.mark.parametrize("extra", [1, 5, 10**6])
def test_num_tokens_beyond_the_address_lists_is_a_format_error(tmp_path, rng, capsys, extra):
    write_dataset(tmp_path / "ds", rng, n=20, layers=(0,), dim=4, storage="full_sequence", shard_size="256B",
                  token_ids=True)

    def more(n):
        n[3] += extra
        return n

    edit_index_column(tmp_path / "ds", "num_tokens", more)
    with pytest.raises(FormatError, match="row 3: .* token addresses for num_tokens="):
        lmprobe.load(tmp_path / "ds").shards.token_addresses()
    assert cli_main(["export-saev", str(tmp_path / "ds"), "--out", str(tmp_path / "saev"), "--context-len", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "num_tokens" in err[0] and "lmprobe validate" in err[0], err
    assert not list((tmp_path / "saev").glob("[!.]*"))


def test_token_id_lists_shorter_than_num_tokens_are_refused_before_export(tmp_path, rng):
    from lmprobe.saev import export_saev

    write_dataset(tmp_path / "ds", rng, n=20, layers=(0,), dim=4, storage="full_sequence", shard_size="256B",
                  token_ids=True)

    def shorter(lists):
        lists[2] = lists[2][:-1]
        return lists

    edit_index_column(tmp_path / "ds", "token_ids", shorter)
    with pytest.raises(FormatError, match="row 2: .* token ids for num_tokens="):
        export_saev(tmp_path / "ds", tmp_path / "saev", context_len=4, quiet=True)
    assert not list((tmp_path / "saev").glob("[!.]*"))


# ------------------------------------------------------------------ 4. metadata listing 100,000 layers


def test_validate_of_metadata_listing_huge_numbers_of_layers_counts_the_missing_files(tmp_path, rng):
    import json

    write_dataset(tmp_path / "ds", rng, n=20, layers=(0,), dim=4, storage="full_sequence", shard_size="256B")
    path = tmp_path / "ds" / INDEX
    meta = dict(pq.read_schema(path).metadata)
    tensors = json.loads(meta[b"lmprobe:tensors"])
    n_shards = len(tensors["hidden_layers"]["shards"])
    tensors["hidden_layers"]["layers"] = list(range(20_000))
    meta[b"lmprobe:tensors"] = json.dumps(tensors).encode()
    pq.write_table(pq.read_table(path).replace_schema_metadata(meta), path)
    report = lmprobe.validate(tmp_path / "ds")
    assert not report.ok and report.checked_files == n_shards  # layer 0's files, each checked
    assert len(report.errors) <= 51, len(report.errors)  # listed one by one, then counted
    listed = sum("file is missing" in e for e in report.errors)
    assert report.errors[-1] == (f"... and {19_999 * n_shards - listed:,} more shard files listed in the metadata "
                                 "are missing (20,000 layers listed)")


# ------------------------------------------------------------------ 5. kill -9 during merge

KILL_DURING_MERGE = r"""
import os, sys
import lmprobe.format.merge as merge
real, n = merge._link, [0]
def link(src, dst):
    n[0] += 1
    if n[0] == int(sys.argv[3]):
        os.kill(os.getpid(), 9)
    real(src, dst)
merge._link = link
from lmprobe.cli import main
sys.exit(main(["merge", *sys.argv[1].split(","), "--out", sys.argv[2]]))
"""


@pytest.mark.parametrize("kill_at", [2, 5, 9])
def test_the_same_merge_command_finishes_a_killed_merge(tmp_path, rng, capsys, kill_at):
    import subprocess
    import sys

    parts = []
    for k in range(2):
        write_dataset(tmp_path / f"p{k}", rng, n=12, layers=(0, 1), dim=4, storage="full_sequence",
                      shard_size="256B", logits_k=2)
        parts.append(str(tmp_path / f"p{k}"))
    out = tmp_path / "m"
    killed = subprocess.run([sys.executable, "-c", KILL_DURING_MERGE, ",".join(parts), str(out), str(kill_at)])
    assert killed.returncode == -9
    assert any(out.iterdir()) and not (out / INDEX).exists()
    assert cli_main(["merge", *parts, "--out", str(out)]) == 0
    assert cli_main(["merge", *parts, "--out", str(tmp_path / "whole")]) == 0
    got, want = lmprobe.load(out), lmprobe.load(tmp_path / "whole")
    assert lmprobe.validate(out).ok
    for layer in (0, 1):
        for i in range(24):
            np.testing.assert_array_equal(got.token_hidden(i, layer), want.token_hidden(i, layer))
    np.testing.assert_array_equal(got.logits_topk()[0], want.logits_topk()[0])
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == sorted(
        p.name for p in (tmp_path / "whole").rglob("*") if p.is_file())
    # another merge into the interrupted folder is refused: it would mix two merges' files
    killed = subprocess.run([sys.executable, "-c", KILL_DURING_MERGE, ",".join(parts), str(tmp_path / "k"), "2"])
    capsys.readouterr()
    assert cli_main(["merge", parts[0], "--out", str(tmp_path / "k")]) == 2
    assert "interrupted merge of other inputs" in capsys.readouterr().err


# ------------------------------------------------------------------ 7. --max-tokens on a labelled prompt file


def test_max_tokens_on_labelled_prompts_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    from lmprobe.extraction import loop, preparation

    loaded = []
    for module in (preparation, loop):
        monkeypatch.setattr(module, "load_model",
                            lambda *a, **k: loaded.append(1) or (_ for _ in ()).throw(AssertionError))
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


@pytest.mark.parametrize("path", ["out/nonexistent", "./gone", "~/gone/x", "/abs/gone", "a/b/c"])
def test_a_missing_local_path_is_a_local_error_with_no_request(tmp_path, monkeypatch, capsys, path):
    import huggingface_hub

    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    calls = []
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", lambda *a, **k: calls.append(a) or 1 / 0)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda *a, **k: calls.append(a) or 1 / 0)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: a request would fail loudly
    assert cli_main(["info", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0] and "cannot reach" not in err[0], err
    assert not calls


def test_owner_name_without_such_a_local_folder_still_means_the_hub():
    from lmprobe.storage.hub import parse_dataset_ref

    assert parse_dataset_ref("someone/acts").repo_id == "someone/acts"
    assert parse_dataset_ref("out/nonexistent") is not None  # no ./out here: a Hub repo name


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


def test_a_resumed_remote_output_never_needs_an_uploaded_shard_back(tmp_path, rng, monkeypatch):
    """Found by the interrupted-operation matrix (an interrupted S3 overwrite, then the same command): a
    checkpoint recorded a closed shard without its hash, the upload thread then deleted the local file,
    and the resumed writer could not re-hash it ("shard ... is missing; the partial output is damaged")."""
    import threading

    import lmprobe.format.shards as shards
    from lmprobe.base.hashing import sha256_file
    from lmprobe.format import DatasetWriter

    gate = threading.Event()
    threading.Timer(0.5, gate.set).start()  # the hasher falls half a second behind

    def slow(f):
        gate.wait(10)
        return sha256_file(f)

    monkeypatch.setattr(shards, "sha256_file", slow)
    out = tmp_path / "staging"
    uploaded = []

    def upload_and_delete(rel):  # what UploadSink does with a finished shard
        uploaded.append(rel)
        (out / rel).unlink()

    kw = dict(layers=[0], dim=4, model_name="m", shard_size="256B", on_file_complete=upload_and_delete,
              checkpoint_interval=3600)
    w = DatasetWriter(out, **kw)
    for b in range(4):
        w.add_batch(texts=[f"t{b}{i}" for i in range(10)], num_tokens=np.full(10, 3),
                    hidden={0: rng.normal(size=(10, 4)).astype(np.float32)})
    w.checkpoint()
    assert uploaded  # shards left the machine
    gate.set()
    w.abort()  # stops where the checkpoint stands, as a crash would: the next run resumes from it
    monkeypatch.setattr(shards, "sha256_file", sha256_file)
    resumed = DatasetWriter(out, **kw)  # raised FormatError "... is missing" before the fix
    resumed.close()


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


def test_a_remote_output_killed_while_its_last_shards_upload_finishes_on_the_same_command(tmp_path, rng, monkeypatch):
    """The matrix, run again after the fix above: killed after 60-230 of ~250 objects, the re-run still said
    "shard ... is missing": the sequence shards go up as the writer finishes, are deleted here once uploaded,
    and the resumed finish looked for them here."""
    from lmprobe.format import DatasetWriter, writer

    out = tmp_path / "staging"
    uploaded = []

    def upload_and_delete(rel):
        uploaded.append(rel)
        (out / rel).unlink()

    kw = dict(layers=[0], dim=4, model_name="m", storage="full_sequence", shard_size="256B",
              on_file_complete=upload_and_delete)
    w = DatasetWriter(out, **kw)
    for b in range(4):
        w.add_batch(texts=[f"t{b}{i}" for i in range(5)], num_tokens=np.full(5, 4),
                    hidden={0: rng.normal(size=(20, 4)).astype(np.float32)})
    real = writer.index.write_index

    def killed(*a, **k):
        raise KeyboardInterrupt  # after the shards went up, before the index: as kill -9 there

    monkeypatch.setattr(writer.index, "write_index", killed)
    with pytest.raises(KeyboardInterrupt):
        w.close()
    w.abort()
    assert any("shard" in r for r in uploaded)
    monkeypatch.setattr(writer.index, "write_index", real)
    DatasetWriter(out, **kw).close()  # raised FormatError "shard ... is missing" before the fix
    assert (out / INDEX).exists()
