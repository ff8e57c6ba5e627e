"""Corpus extraction: documents streamed from files, folders and Hub datasets, cut into context windows."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.paths import SUPPORT

import lmprobe
from lmprobe.cli import main as cli_main
from lmprobe.errors import ExtractionError, OutOfSpaceError, PromptError, ResumeMismatchError
from lmprobe.extraction import model as model_mod
from lmprobe.extraction.windows import Affixes, Budget, windows

INDEX = "index/train-00000-of-00001.parquet"
DOCS = [
    "The cat sat on the mat and looked at the bird. A quick brown fox jumps over the lazy dog, then naps.",
    "Hi",
    "Interpretability researchers study the activations of language models. The weather today is sunny.",
    "I loved this film, the acting was wonderful and the story moving. This was a terrible meal, cold.",
    "Numbers like 12, 345 and 6789 appear in text as well.",
    "She said: \"hello there!\" and walked away quickly, then came back for her umbrella and her hat.",
]


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def direct_hidden(model_dir, ids, layer):
    """What a plain forward pass of one window gives at the output of block ``layer``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = direct_hidden.cache.get(str(model_dir))
    if model is None:
        model = direct_hidden.cache[str(model_dir)] = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    blocks = model.model.layers if hasattr(model, "model") else model.transformer.h  # Llama, GPT-2
    got = []
    handle = blocks[layer].register_forward_hook(lambda _m, _i, out: got.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    handle.remove()
    return got[0][0].numpy()


direct_hidden.cache = {}


# ---------------------------------------------------------------- the arithmetic


@given(n=st.integers(0, 500), per=st.integers(1, 64))
def test_windows_cover_every_content_token_once_in_equal_pieces(n, per):
    ws = windows(n, per)
    assert [t for a, b in ws for t in range(a, b)] == list(range(n))
    assert all(b - a == per for a, b in ws[:-1]) and all(0 < b - a <= per for a, b in ws)


def test_affixes_sit_inside_the_context_and_a_budget_is_exact():
    aff = Affixes((1,), (2,))
    assert aff.wrap([7, 8]) == [1, 7, 8, 2] and aff.content_per_window(5) == 3
    with pytest.raises(ExtractionError, match="no room for content.*--no-special-tokens"):
        aff.content_per_window(2)
    b = Budget(10, used=4)
    assert (b.take(4), b.take(4), b.take(4), b.spent) == (4, 2, 0, True)
    assert Budget(None).take(10**9) == 10**9


# ---------------------------------------------------------------- extraction


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "docs.jsonl", DOCS)


def test_windows_hold_the_documents_tokens_and_equal_a_direct_forward(llama_dir, corpus, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    ds = lmprobe.extract(str(llama_dir), corpus, out=tmp_path / "ds", context_len=12, storage="full_sequence",
                         token_ids=True, layers="0,3", batch_size=3, quiet=True)
    t = ds.table.to_pylist()
    bos = tok.bos_token_id
    # stored tokens: each document's own ids, window after window, each window led by BOS (inside 12)
    for d, text in enumerate(DOCS):
        content = tok(text, add_special_tokens=False)["input_ids"]
        rows = [r for r in t if r["document"] == d]
        assert [r["window_start"] for r in rows] == list(range(0, len(content), 11))
        assert all(r["token_ids"][0] == bos and len(r["token_ids"]) <= 12 for r in rows)
        assert [i for r in rows for i in r["token_ids"][1:]] == content
        assert all(r["num_tokens"] == 12 for r in rows[:-1])  # equal windows but the document's last
    assert [r["document"] for r in t] == sorted(r["document"] for r in t)  # source order
    assert t[0]["text"] + t[1]["text"] in DOCS[0]
    for row in (0, 3, len(t) - 1):
        for layer in (0, 3):
            want = direct_hidden(llama_dir, t[row]["token_ids"], layer)
            np.testing.assert_allclose(ds.token_hidden(row, layer), want, atol=2e-5, rtol=1e-4)
    assert ds.info["extraction"]["settings"]["context_len"] == 12


def test_budget_is_exact_and_the_source_is_not_read_past_it(llama_dir, tmp_path):
    f = tmp_path / "docs.jsonl"
    write_jsonl(f, DOCS * 40)
    with open(f, "a") as fh:
        fh.write("{this line is not JSON\n")  # never reached: the budget is spent long before
    ds = lmprobe.extract(str(llama_dir), f, out=tmp_path / "ds", context_len=16, max_tokens=101,
                         storage="full_sequence", token_ids=True, layers="1", quiet=True)
    n = ds.column("num_tokens")
    assert int(n.sum()) == 101
    assert sum(ds.token_hidden(i, 1).shape[0] for i in range(ds.num_prompts)) == 101
    assert ds.info["extraction"]["settings"]["max_tokens"] == 101


def test_pooled_windows_and_gpt2_without_special_tokens(gpt2_dir, corpus, tmp_path):
    ds = lmprobe.extract(str(gpt2_dir), corpus, out=tmp_path / "ds", context_len=8, max_tokens=40, layers="2",
                         token_ids=True, quiet=True)
    t = ds.table.to_pylist()
    assert sum(r["num_tokens"] for r in t) == 40 and all(r["num_tokens"] <= 8 for r in t)
    for row in (0, len(t) - 1):  # pooled: the window's last token
        want = direct_hidden(gpt2_dir, t[row]["token_ids"], 2)[-1]
        np.testing.assert_allclose(ds.hidden(2, [row])[0], want, atol=2e-5, rtol=1e-4)


def test_no_special_tokens_and_encoder_affixes(bert_dir, llama_dir, corpus, tmp_path):
    from transformers import AutoTokenizer

    ds = lmprobe.extract(str(llama_dir), corpus, out=tmp_path / "plain", context_len=10, special_tokens=False,
                         storage="full_sequence", token_ids=True, layers="0", quiet=True)
    tok = AutoTokenizer.from_pretrained(llama_dir)
    first = [r for r in ds.table.to_pylist() if r["document"] == 0]
    assert [i for r in first for i in r["token_ids"]] == tok(DOCS[0], add_special_tokens=False)["input_ids"]
    # BERT adds [CLS] before and [SEP] after: both go into every window
    ds = lmprobe.extract(str(bert_dir), corpus, out=tmp_path / "bert", context_len=10, storage="full_sequence",
                         token_ids=True, layers="0", quiet=True)
    btok = AutoTokenizer.from_pretrained(bert_dir)
    rows = ds.table.to_pylist()
    assert all(r["token_ids"][0] == btok.cls_token_id and r["token_ids"][-1] == btok.sep_token_id for r in rows)
    assert [r["window_start"] for r in rows if r["document"] == 0][:2] == [0, 8]


def test_folder_source_reads_files_in_path_order(llama_dir, tmp_path):
    folder = tmp_path / "corpus"
    (folder / "b").mkdir(parents=True)
    write_jsonl(folder / "a.jsonl", DOCS[:2])
    pq.write_table(pa.table({"text": DOCS[2:4], "meta": [1, 2]}), folder / "b" / "c.parquet", row_group_size=1)
    (folder / "d.txt").write_text(DOCS[4] + "\n\n" + DOCS[5] + "\n")
    (folder / ".hidden.jsonl").write_text('{"text": "never read"}\n')
    (folder / "notes.md").write_text("not a corpus file")
    ds = lmprobe.extract(str(llama_dir), folder, out=tmp_path / "ds", context_len=128, token_ids=True, layers="0",
                         quiet=True)
    t = ds.table.to_pylist()
    assert [r["document"] for r in t] == list(range(6))
    assert [r["text"] for r in t] == DOCS  # a.jsonl, b/c.parquet, d.txt (blank lines skipped)


def test_pretokenized_source_skips_the_tokenizer_and_checks_the_vocabulary(llama_dir, tmp_path, monkeypatch):
    ids = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    f = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"input_ids": ids}), f)
    ds = lmprobe.extract(str(llama_dir), f, out=tmp_path / "ds", context_len=5, special_tokens=False,
                         storage="full_sequence", token_ids=True, layers="0", quiet=True)
    assert [r["token_ids"] for r in ds.table.to_pylist()] == [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    # prompt mode: one row per pretokenized prompt, ids as given
    ds = lmprobe.extract(str(llama_dir), f, out=tmp_path / "p", storage="full_sequence", token_ids=True, layers="0",
                         quiet=True)
    assert sorted(r["token_ids"] for r in ds.table.to_pylist()) == sorted(ids)
    np.testing.assert_allclose(ds.token_hidden(0, 0), direct_hidden(llama_dir, ds.table["token_ids"][0].as_py(), 0),
                               atol=2e-5, rtol=1e-4)
    monkeypatch.setattr(model_mod, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    pq.write_table(pa.table({"input_ids": [[1, 2, 10**6]]}), tmp_path / "bad.parquet")
    for kw in ({"context_len": 8}, {}):
        with pytest.raises(PromptError, match=r"bad.parquet, row 0: token id 1000000 is outside the model's vocabulary"):
            lmprobe.extract(str(llama_dir), tmp_path / "bad.parquet", out=tmp_path / "bad", quiet=True, **kw)


def test_hub_dataset_source_streams_through_datasets(hub, llama_dir, corpus, tmp_path):
    from huggingface_hub import HfApi

    repo = f"tester/corpus-{uuid.uuid4().hex[:8]}"
    api = HfApi()
    api.create_repo(repo, repo_type="dataset")
    local = tmp_path / "train.parquet"
    pq.write_table(pa.table({"text": DOCS}), local)
    api.upload_file(path_or_fileobj=str(local), path_in_repo="data/train-00000-of-00001.parquet", repo_id=repo,
                    repo_type="dataset")
    kw = dict(context_len=12, max_tokens=70, storage="full_sequence", token_ids=True, layers="1", quiet=True)
    from_hub = lmprobe.extract(str(llama_dir), f"hf://datasets/{repo}", out=tmp_path / "hub", **kw)
    from_file = lmprobe.extract(str(llama_dir), corpus, out=tmp_path / "file", **kw)
    for col in ("token_ids", "document", "window_start", "text"):
        assert from_hub.table[col].to_pylist() == from_file.table[col].to_pylist()
    for i in range(from_hub.num_prompts):
        np.testing.assert_array_equal(from_hub.token_hidden(i, 1), from_file.token_hidden(i, 1))
    source = from_hub.info["extraction"]["settings"]["source"]
    assert source["repo"] == repo and source["split"] == "train"
    with pytest.raises(PromptError, match="cannot open"):
        lmprobe.extract(str(llama_dir), f"hf://datasets/{repo}", out=tmp_path / "x", split="nope", **kw)


CRASH_EXTRACT = SUPPORT / "_crash_extract.py"  # extract, then die like kill -9


@pytest.mark.slow
@pytest.mark.parametrize("die_after", [0, 2, 5])
def test_killed_corpus_run_resumes_without_loss_or_duplicates(llama_dir, tmp_path, die_after):
    f = write_jsonl(tmp_path / "docs.jsonl", DOCS * 3)
    kw = dict(context_len=10, max_tokens=150, storage="full_sequence", token_ids=True, layers="0,2", batch_size=2,
              shard_size="2KB", quiet=True)
    ref = lmprobe.extract(str(llama_dir), f, out=tmp_path / "ref", **kw)
    out = tmp_path / "ds"
    r = subprocess.run([sys.executable, str(CRASH_EXTRACT), json.dumps([str(f), str(llama_dir), str(out), die_after, kw])],
                       capture_output=True, text=True)
    assert r.returncode == 9, r.stderr
    ds = lmprobe.extract(str(llama_dir), f, out=out, **kw)
    for col in ("token_ids", "document", "window_start", "num_tokens", "text"):
        assert ds.table[col].to_pylist() == ref.table[col].to_pylist(), col
    for layer in (0, 2):
        for i in range(ds.num_prompts):
            np.testing.assert_array_equal(ds.token_hidden(i, layer), ref.token_hidden(i, layer))
    assert int(ds.column("num_tokens").sum()) == 150


def test_errors_come_before_the_weights_load(llama_dir, corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(model_mod, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    cases = [
        (dict(context_len=1000), ExtractionError, "longer than .* limit of 128"),
        (dict(context_len=1), ExtractionError, "no room for content"),
        (dict(context_len=8, chat_template=True), ExtractionError, "--chat-template does not apply"),
        (dict(context_len=8, truncate="left"), ExtractionError, "--truncate does not apply"),
        (dict(max_tokens=0), ExtractionError, "max_tokens must be a positive integer"),
        (dict(context_len=8, text_column="body"), PromptError, r"line 1: no 'body' field.*--text-column"),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            lmprobe.extract(str(llama_dir), corpus, out=tmp_path / "ds", quiet=True, **kw)
    with pytest.raises(PromptError, match="does not exist"):
        lmprobe.extract(str(llama_dir), tmp_path / "missing.jsonl", out=tmp_path / "ds", context_len=8)
    assert not (tmp_path / "ds").exists() or not any((tmp_path / "ds").iterdir())


def test_planned_bytes_are_printed_and_checked_against_free_space(llama_dir, corpus, tmp_path, monkeypatch, capsys):
    import shutil as shutil_mod

    from lmprobe.extraction import runner

    monkeypatch.setattr(model_mod, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    usage = shutil_mod.disk_usage(tmp_path)
    monkeypatch.setattr(runner.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    rc = cli_main(["extract", "--model", str(llama_dir), "--prompts", str(corpus), "--out", str(tmp_path / "ds"),
                   "--context-len", "16", "--max-tokens", "2k", "--storage", "full_sequence"])
    err = capsys.readouterr().err
    assert rc != 0
    # 2000 tokens x 4 layers x 32 dims x 4 bytes
    assert "2,000 tokens in windows of 16 (4 layers x 32 dims, float32): about 1000.0 KiB" in err
    assert "has 1000 B free but this extraction will write about 1000.0 KiB" in err and "--no-space-check" in err
    with pytest.raises(OutOfSpaceError):
        lmprobe.extract(str(llama_dir), ["a prompt"], out=tmp_path / "p", storage="full_sequence", quiet=True)


def test_cli_corpus_run_with_a_budget(llama_dir, corpus, tmp_path, capsys):
    rc = cli_main(["extract", "--model", str(llama_dir), "--prompts", str(corpus), "--out", str(tmp_path / "ds"),
                   "--context-len", "16", "--max-tokens", "0.1k", "--layers", "-1", "--storage", "full_sequence"])
    assert rc == 0
    out = capsys.readouterr()
    assert "windows (100 tokens)" in out.out
    ds = lmprobe.load(tmp_path / "ds")
    assert int(ds.column("num_tokens").sum()) == 100
    # a re-run of the finished command does nothing
    assert cli_main(["extract", "--model", str(llama_dir), "--prompts", str(corpus), "--out", str(tmp_path / "ds"),
                     "--context-len", "16", "--max-tokens", "100", "--layers", "-1", "--storage",
                     "full_sequence"]) == 0
    assert "nothing to do" in capsys.readouterr().err


def test_info_of_a_corpus_dataset_shows_documents_window_length_and_budget(llama_dir, corpus, tmp_path, capsys):
    lmprobe.extract(str(llama_dir), corpus, out=tmp_path / "ds", context_len=12, max_tokens=200, layers="0",
                    quiet=True)
    assert cli_main(["info", str(tmp_path / "ds")]) == 0
    out = capsys.readouterr().out
    assert "windows      " in out and "prompts " not in out
    docs = len(set(lmprobe.load(tmp_path / "ds").column("document").tolist()))
    assert docs > 1
    assert (f"corpus       {docs} documents, 200 tokens, windows of at most 12 tokens, token budget 200 (reached)"
            in out)


@pytest.mark.slow
def test_a_killed_run_resumes_with_a_lower_budget_and_names_other_changes(llama_dir, tmp_path, capsys):
    """The budget only says when to stop; any other change is named, one setting each."""
    f = write_jsonl(tmp_path / "docs.jsonl", DOCS * 3)
    kw = dict(context_len=10, max_tokens=150, storage="full_sequence", token_ids=True, layers="0", batch_size=2,
              shard_size="2KB", quiet=True)
    out = tmp_path / "ds"
    r = subprocess.run([sys.executable, str(CRASH_EXTRACT), json.dumps([str(f), str(llama_dir), str(out), 3, kw])],
                       capture_output=True, text=True)
    assert r.returncode == 9, r.stderr
    with pytest.raises(ResumeMismatchError) as err:
        lmprobe.extract(str(llama_dir), f, out=out, **{**kw, "context_len": 12})
    msg = str(err.value)
    assert "context_len: 10 -> 12" in msg and "--overwrite" in msg and "max_tokens" not in msg and len(msg) < 400
    with pytest.raises(ExtractionError, match=r"already holds [\d,]+ tokens, more than --max-tokens 5; pass"):
        lmprobe.extract(str(llama_dir), f, out=out, **{**kw, "max_tokens": 5})
    ds = lmprobe.extract(str(llama_dir), f, out=out, **{**kw, "max_tokens": 60})
    ref = lmprobe.extract(str(llama_dir), f, out=tmp_path / "ref", **{**kw, "max_tokens": 60})
    assert int(ds.column("num_tokens").sum()) == 60 and ds.info["extraction"]["settings"]["max_tokens"] == 60
    assert ds.table["token_ids"].to_pylist() == ref.table["token_ids"].to_pylist()
    # a finished dataset asked for another budget names it too
    capsys.readouterr()
    args = ["extract", "--model", str(llama_dir), "--prompts", str(f), "--out", str(out), "--context-len", "10",
            "--max-tokens", "50", "--storage", "full_sequence", "--token-ids", "--layers", "0", "--batch-size", "2",
            "--shard-size", "2KB"]
    assert cli_main(args) == 2
    line = capsys.readouterr().err.strip()
    assert "max_tokens: 60 -> 50" in line and "--overwrite" in line and len(line) < 400, line


def test_a_hub_corpus_whose_column_type_changes_between_files_is_one_line(hub, llama_dir, tmp_path, capsys):
    """A corpus whose second parquet file holds input_ids as strings is a one-line error, not a 65-line traceback
    from inside the `datasets` stream."""
    from huggingface_hub import HfApi

    repo = f"tester/mixed-{uuid.uuid4().hex[:8]}"
    api = HfApi()
    api.create_repo(repo, repo_type="dataset")
    capsys.readouterr()
    for k, ids in enumerate(([[5, 6, 7, 8]] * 20, [["a", "b"]] * 20)):
        local = tmp_path / f"part{k}.parquet"
        pq.write_table(pa.table({"input_ids": ids}), local)
        api.upload_file(path_or_fileobj=str(local), path_in_repo=f"data/train-0000{k}-of-00002.parquet", repo_id=repo,
                        repo_type="dataset")
    rc = cli_main(["extract", "--model", str(llama_dir), "--prompts", f"hf://datasets/{repo}", "--out",
                   str(tmp_path / "out"), "--context-len", "8", "--max-tokens", "1k", "--layers", "1", "--storage",
                   "full_sequence", "--quiet"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lmprobe extract")]
    assert rc == 2 and len(err) == 1 and "record 20" in err[0] and "cannot be read" in err[0], err


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
