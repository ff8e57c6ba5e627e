"""Extraction against an independent reference: hooks on the blocks of an unpadded forward pass."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from support.datasets import PROMPTS

import lmprobe
from lmprobe.cli import main as cli_main
from lmprobe.extraction import model as model_mod
from lmprobe.extraction.model import ModelError
from lmprobe.extraction.prompts import PromptError
from lmprobe.format.validate import validate

#: where each test family keeps its blocks, written by hand (independent of lmprobe's own search)
BLOCKS = {"llama": "model.layers", "gpt2": "transformer.h", "bert": "encoder.layer"}


def reference(model_dir, texts, *, causal=True):
    """Block outputs (all tokens), full logits and NLL for each prompt run alone, without padding."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = (AutoModelForCausalLM if causal else AutoModel).from_pretrained(model_dir, dtype=torch.float32).eval()
    blocks = model.get_submodule(BLOCKS[model.config.model_type])
    out = []
    for text in texts:
        ids = tok(text, return_tensors="pt")["input_ids"]
        acts = {}
        hs = [blocks[i].register_forward_hook(
            lambda m, a, o, i=i, acts=acts: acts.__setitem__(i, (o[0] if isinstance(o, tuple) else o)[0]))
            for i in range(len(blocks))]
        with torch.no_grad():
            res = model(input_ids=ids)
        for h in hs:
            h.remove()
        item = {"ids": ids[0], "acts": acts}
        if causal:
            logits = res.logits[0]
            nll = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="none").double()
            item.update(logits=logits, nll=nll)
        out.append(item)
    return out


@pytest.mark.parametrize("which", ["llama_dir", "gpt2_dir"])
def test_pooled_matches_reference(request, tmp_path, which):
    model_dir = request.getfixturevalue(which)
    ds = lmprobe.extract(str(model_dir), PROMPTS, out=tmp_path / "ds", layers="all", batch_size=3, logits_topk=5,
                         perplexity=True, token_strings=True, quiet=True)
    ref = reference(model_dir, [p["text"] for p in PROMPTS])
    assert ds.layers == list(range(len(ref[0]["acts"])))
    for layer in ds.layers:
        got = ds.hidden(layer)
        for i, r in enumerate(ref):
            np.testing.assert_allclose(got[i], r["acts"][layer][-1].numpy(), atol=1e-4, rtol=0)
    values, indices = ds.logits_topk()
    df = ds.index
    for i, r in enumerate(ref):
        top = torch.topk(r["logits"][-1], 5)
        np.testing.assert_allclose(values[i], top.values.numpy(), atol=1e-4)
        assert indices[i].tolist() == top.indices.tolist()
        assert df["perplexity_mean"][i] == pytest.approx(float(torch.exp(r["nll"].mean())), rel=1e-4)
        assert df["perplexity_max"][i] == pytest.approx(float(torch.exp(r["nll"]).max()), rel=1e-4)
        np.testing.assert_allclose(df["token_perplexity"][i], torch.exp(r["nll"]).numpy(), rtol=1e-4)
        assert df["num_tokens"][i] == len(r["ids"]) and list(df["token_ids"][i]) == r["ids"].tolist()
        assert len(df["token_strings"][i]) == len(r["ids"])
    assert df["text"].tolist() == [p["text"] for p in PROMPTS]
    assert df["label"].tolist() == [p["label"] for p in PROMPTS]
    assert df["source"].tolist() == [p["source"] for p in PROMPTS]
    assert ds.info["provenance"]["extraction_backend"] == "local"
    assert ds.info["model"]["revision"] is None
    assert validate(tmp_path / "ds").ok


def test_full_sequence_matches_reference(llama_dir, tmp_path):
    ds = lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "ds", layers="0,-1", storage="full_sequence",
                         batch_size=4, shard_size="2KB", quiet=True)
    assert ds.layers == [0, 3]
    ref = reference(llama_dir, [p["text"] for p in PROMPTS])
    for i, r in enumerate(ref):
        for layer in ds.layers:
            np.testing.assert_allclose(ds.token_hidden(i, layer), r["acts"][layer].numpy(), atol=1e-4, rtol=0)
    assert validate(tmp_path / "ds").ok


def test_left_padding_alone_equals_batched(llama_dir, tmp_path):
    short = "A dog."
    batch = [short, PROMPTS[2]["text"], PROMPTS[4]["text"]]
    alone = lmprobe.extract(str(llama_dir), [short], out=tmp_path / "a", layers="all", quiet=True)
    mixed = lmprobe.extract(str(llama_dir), batch, out=tmp_path / "b", layers="all", batch_size=3, quiet=True)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(llama_dir).padding_side == "left"
    for layer in alone.layers:
        np.testing.assert_allclose(mixed.hidden(layer)[0], alone.hidden(layer)[0], atol=1e-5, rtol=0)


def test_half_precision_storage(gpt2_dir, tmp_path):
    ds = lmprobe.extract(str(gpt2_dir), PROMPTS, out=tmp_path / "ds", layers="1", dtype="bfloat16", quiet=True)
    ref = reference(gpt2_dir, [p["text"] for p in PROMPTS])
    assert ds.dtype == "bfloat16" and ds.hidden(1, as_torch=True).dtype == torch.bfloat16
    want = np.stack([r["acts"][1][-1].to(torch.bfloat16).float().numpy() for r in ref])
    np.testing.assert_allclose(ds.hidden(1), want, atol=2e-2, rtol=1e-2)


def test_encoder_without_lm_head(bert_dir, tmp_path, monkeypatch):
    ds = lmprobe.extract(str(bert_dir), PROMPTS, out=tmp_path / "ds", layers="all", batch_size=3, quiet=True)
    ref = reference(bert_dir, [p["text"] for p in PROMPTS], causal=False)
    for i, r in enumerate(ref):
        np.testing.assert_allclose(ds.hidden(1)[i], r["acts"][1][-1].numpy(), atol=1e-4, rtol=0)
    monkeypatch.setattr(model_mod, "load_model", lambda *a, **k: pytest.fail("weights loaded before the error"))
    with pytest.raises(ModelError, match="no language-model head.*--logits-topk"):
        lmprobe.extract(str(bert_dir), PROMPTS, out=tmp_path / "x", logits_topk=3)
    with pytest.raises(ModelError, match="--perplexity"):
        lmprobe.extract(str(bert_dir), PROMPTS, out=tmp_path / "x", perplexity=True)


def test_forward_stops_after_the_last_needed_block(llama_dir, tmp_path, monkeypatch):
    from transformers import LlamaForCausalLM

    calls = {"late": 0, "head": 0}
    real = LlamaForCausalLM.from_pretrained.__func__

    def spy(cls, *a, **k):
        m = real(cls, *a, **k)
        m.model.layers[3].register_forward_hook(lambda *_: calls.__setitem__("late", calls["late"] + 1))
        m.lm_head.register_forward_hook(lambda *_: calls.__setitem__("head", calls["head"] + 1))
        return m

    monkeypatch.setattr(LlamaForCausalLM, "from_pretrained", classmethod(spy))
    lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "a", layers="0:2", quiet=True)
    assert calls == {"late": 0, "head": 0}
    lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "b", layers="1", logits_topk=2, quiet=True)
    assert calls["late"] > 0 and calls["head"] > 0


@pytest.mark.parametrize("layers,msg", [("7", "layer 7 does not exist"), ("0,x", "cannot read layer 'x'"),
                                        ("9:12", "empty"), ("-5", "layer -5 does not exist")])
def test_invalid_layers_fail_before_weights_load(llama_dir, tmp_path, monkeypatch, layers, msg):
    monkeypatch.setattr(model_mod, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ModelError, match=msg):
        lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "ds", layers=layers)
    assert not (tmp_path / "ds").exists()


def test_prompt_errors_name_the_line_before_weights_load(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(model_mod, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    f = tmp_path / "p.jsonl"
    f.write_text('{"text": "fine", "label": 1}\n\n{"text": "   ", "label": 0}\n')
    with pytest.raises(PromptError, match=r"line 3: 'text' is empty"):
        lmprobe.extract(str(llama_dir), f, out=tmp_path / "ds")
    f.write_text('{"text": "a", "label": 1}\n{"text": "b", "label": "pos"}\n')
    with pytest.raises(PromptError, match=r"line 2: label 'pos' is a string but line 1 has a int label"):
        lmprobe.extract(str(llama_dir), f, out=tmp_path / "ds")
    f.write_text('{"prompt": "a"}\n')
    with pytest.raises(PromptError, match=r"no 'text' column.*--text-column"):
        lmprobe.extract(str(llama_dir), f, out=tmp_path / "ds")
    with pytest.raises(PromptError, match=r"no label column 'y'"):
        lmprobe.extract(str(llama_dir), f, out=tmp_path / "ds", text_column="prompt", label_column="y")
    f.write_text('{"text": 5}\n')
    with pytest.raises(PromptError, match=r"line 1: 'text' must be a string"):
        lmprobe.extract(str(llama_dir), f, out=tmp_path / "ds")
    assert not (tmp_path / "ds").exists()


def test_prompt_file_formats(llama_dir, tmp_path):
    import pandas as pd

    rows = [{"text": "one two", "label": "pos", "year": 2020}, {"text": "three", "label": "neg", "year": None}]
    pd.DataFrame(rows).to_csv(tmp_path / "p.csv", index=False)
    pd.DataFrame(rows).to_parquet(tmp_path / "p.parquet")
    (tmp_path / "p.txt").write_text("one two\nthree\n")
    for f in ("p.csv", "p.parquet"):
        ds = lmprobe.extract(str(llama_dir), tmp_path / f, out=tmp_path / f"o-{f}", layers="0", quiet=True)
        assert ds.labels.tolist() == ["pos", "neg"] and ds.index["year"].tolist()[0] == 2020
    ds = lmprobe.extract(str(llama_dir), tmp_path / "p.txt", out=tmp_path / "o-txt", layers="0", quiet=True)
    assert ds.texts == ["one two", "three"] and ds.labels is None
    df = pd.DataFrame(rows)
    ds = lmprobe.extract(str(llama_dir), df, out=tmp_path / "o-df", layers="0", quiet=True)
    assert ds.num_prompts == 2


def test_csv_text_that_looks_like_a_number_stays_text(tmp_path):
    from lmprobe.extraction.prompts import read_prompts

    (tmp_path / "p.csv").write_text("text,label\n007,1\n0123,0\n")
    assert read_prompts(tmp_path / "p.csv").texts == ["007", "0123"]


def test_max_length_and_truncation(llama_dir, tmp_path):
    long = PROMPTS[2]["text"]
    with pytest.raises(ValueError, match=r"prompt 0 has \d+ tokens, more than --max-length 5.*--truncate"):
        lmprobe.extract(str(llama_dir), [long], out=tmp_path / "x", max_length=5)
    ds = lmprobe.extract(str(llama_dir), [long], out=tmp_path / "l", max_length=5, truncate="left", layers="3",
                         token_ids=True, quiet=True)
    assert ds.index["num_tokens"][0] == 5
    assert ds.info["extraction"]["settings"]["truncate"] == "left"
    from transformers import AutoTokenizer

    full = AutoTokenizer.from_pretrained(llama_dir)(long)["input_ids"]
    assert list(ds.index["token_ids"][0]) == full[:1] + full[-4:]  # the BOS the tokenizer adds stays


def test_cli_extract_and_rerun_is_a_no_op(llama_dir, tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    args = ["extract", "--model", str(llama_dir), "--prompts", str(f), "--out", str(tmp_path / "ds"),
            "--layers", "0,2", "--logits-topk", "3", "--shard-size", "1KB", "--batch-size", "2"]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "wrote 7 prompts x 2 layers" in out
    before = (tmp_path / "ds/index/train-00000-of-00001.parquet").stat().st_mtime_ns
    assert cli_main(args) == 0
    out = capsys.readouterr()
    # the re-run says "nothing to do" and nothing after it (no "wrote 7 prompts")
    assert out.out == "" and out.err.strip().splitlines()[-1] == (
        f"{tmp_path / 'ds'} already holds this extraction (7 prompts x 2 layers x 32 dims, pooled, float32); "
        "nothing to do"), out
    # a batch size changes no stored value: still the same extraction
    assert cli_main([*args[:-1], "5"]) == 0
    assert "nothing to do" in capsys.readouterr().err
    assert (tmp_path / "ds/index/train-00000-of-00001.parquet").stat().st_mtime_ns == before
    other = [("4" if a == "3" and args[i - 1] == "--logits-topk" else a) for i, a in enumerate(args)]
    assert cli_main(other) == 2  # a setting that changes what is stored
    assert "other settings (logits_topk: 3 -> 4)" in capsys.readouterr().err
    assert cli_main([*other, "--overwrite", "--quiet"]) == 0
    assert lmprobe.load(tmp_path / "ds").info["extraction"]["settings"]["logits_topk"] == 4


def test_cli_errors_are_one_line(tmp_path, llama_dir, capsys):
    f = tmp_path / "p.txt"
    f.write_text("hello\n")
    assert cli_main(["extract", "--model", str(llama_dir), "--prompts", str(f), "--out", str(tmp_path / "o"),
                     "--layers", "99"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmprobe extract: error: layer 99 does not exist") and "Traceback" not in err


def test_cli_says_one_prompt_and_one_layer_in_the_singular(tmp_path, capsys):
    """One prompt and one layer are said in the singular ("1 layer", never "1 layers")."""
    f = tmp_path / "p.txt"
    f.write_text("The cat sat on the mat.\n")
    assert cli_main(["extract", "--model", "lmprobe-tiny", "--prompts", str(f), "--out", str(tmp_path / "ds"),
                     "--layers", "-1"]) == 0
    out = capsys.readouterr().out
    assert f"wrote 1 prompt x 1 layer x 128 dims (pooled, float32) to {tmp_path / 'ds'}" in out, out


def test_a_label_column_named_in_another_case_is_pointed_out(tmp_path, capsys):
    """A CSV with `Text,Label` does not lose its labels silently: the column named in another case is pointed
    out."""
    f = tmp_path / "p.csv"
    f.write_text("Text,Label\nThe cat sat.,1\nA dog ran.,0\n")
    assert cli_main(["extract", "--model", "lmprobe-tiny", "--prompts", str(f), "--out", str(tmp_path / "a"),
                     "--layers", "-1", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"lmprobe extract: error: {f}: no 'text' column (columns: ['Text', 'Label']); did you mean "
                   "--text-column Text?"), err
    assert cli_main(["extract", "--model", "lmprobe-tiny", "--prompts", str(f), "--out", str(tmp_path / "b"),
                     "--layers", "-1", "--text-column", "Text", "--quiet"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"note: {f} has a column 'Label' but no 'label': it is stored as an ordinary column, not as the "
                   "labels; pass --label-column Label to use it as the labels"], err
    ds = lmprobe.load(tmp_path / "b")
    assert ds.labels is None and ds.index["Label"].tolist() == [1, 0]
    assert cli_main(["extract", "--model", "lmprobe-tiny", "--prompts", str(f), "--out", str(tmp_path / "c"),
                     "--layers", "-1", "--text-column", "Text", "--label-column", "Label", "--quiet"]) == 0
    assert capsys.readouterr().err == "" and lmprobe.load(tmp_path / "c").labels.tolist() == [1, 0]


def test_a_log_file_gets_progress_lines_not_bars(llama_dir, tmp_path, capsys, monkeypatch):
    """Into a file, extract draws no bars (not transformers' "Loading weights" bar, then nothing until its last
    line). Off a terminal: no bars, no escape codes, a progress line every LMPROBE_PROGRESS_INTERVAL seconds."""
    monkeypatch.setenv("LMPROBE_PROGRESS_INTERVAL", "0")  # a line after every batch
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    assert cli_main(["extract", "--model", str(llama_dir), "--prompts", str(f), "--out", str(tmp_path / "ds"),
                     "--layers", "0", "--batch-size", "2"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err and "Loading weights" not in err, err
    lines = [x for x in err.splitlines() if x.startswith("extract: ")]
    assert len(lines) >= 4, err  # 7 prompts in batches of 2, and the closing line
    assert re.fullmatch(r"extract: 2/7 prompts \(28\.6%\), [\d,]+ tokens, [\d,]+ tok/s, [\d.,]+ prompts/s, ETA \d+s",
                        lines[0]), lines
    assert re.fullmatch(r"extract: 7/7 prompts \(100\.0%\), [\d,]+ tokens, .* done in \d+s", lines[-1]), lines
    assert cli_main(["extract", "--model", str(llama_dir), "--prompts", str(f), "--out", str(tmp_path / "q"),
                     "--layers", "0", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_truncation_is_recorded_per_prompt_and_shown(llama_dir, tmp_path, capsys):
    """What `--truncate left` cuts is recorded per prompt in the index, and `info` shows which prompts and how
    much."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    lengths = [len(tok(p["text"])["input_ids"]) for p in PROMPTS]
    limit = sorted(lengths)[len(lengths) // 2]
    ds = lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "ds", max_length=limit, truncate="left", layers="1",
                         storage="full_sequence", token_ids=True, quiet=True)
    cut = [max(0, n - limit) for n in lengths]
    assert ds.index["truncated_tokens"].tolist() == cut and sum(c > 0 for c in cut) >= 2
    assert ds.index["num_tokens"].tolist() == [min(n, limit) for n in lengths]
    assert ds.texts == [p["text"] for p in PROMPTS]  # the prompts as given; truncated_tokens says what was cut
    assert cli_main(["info", str(tmp_path / "ds")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("truncated"))
    n_cut = sum(c > 0 for c in cut)
    assert line == (f"truncated    {n_cut} of 7 prompts cut to {limit} tokens, from the left (up to {max(cut)} "
                    f"tokens cut; the truncated_tokens column says how many)"), line
    assert "truncated_tokens" not in next(x for x in cli_info_lines(tmp_path / "ds", capsys) if x.startswith("columns"))
    plain = lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "plain", layers="1", quiet=True)
    assert "truncated_tokens" not in plain.column_names


def cli_info_lines(path, capsys):
    assert cli_main(["info", str(path)]) == 0
    return capsys.readouterr().out.splitlines()


# ------------------------------------------------------------------ each setting written once, in ExtractionConfig


def test_every_extraction_setting_is_an_option_of_extract_with_its_docstring_as_help(capsys):
    """The command line is generated from ExtractionConfig: each field is an option, typed and documented by the
    field itself (a setting added to the config reaches the command line without a second copy)."""
    from dataclasses import fields

    from lmprobe.base.fields import command_line_text, field_docs
    from lmprobe.cli.app import build_parser
    from lmprobe.extraction.config import ExtractionConfig

    parser = build_parser()
    extract = next(a for a in parser._actions if a.dest == "command").choices["extract"]
    by_dest = {a.dest: a for a in extract._actions}
    docs = field_docs(ExtractionConfig)
    for f in fields(ExtractionConfig):
        action = by_dest[f.name]  # every setting is an option
        words = command_line_text(docs[f.name]).rstrip(".").split()  # (its "In Python ..." paragraph left out)
        assert docs[f.name] and " ".join(words[1:]) in action.help, (f.name, action.help)
        if f.default is True:
            assert action.option_strings == ["--no-" + f.name.replace("_", "-")]
    # --no-checksums existed in Python only before the command line was generated
    args = parser.parse_args(["extract", "--model", "m", "--prompts", "p", "--out", "o", "--no-checksums",
                              "--max-prompts", "3", "--compute-dtype", "bfloat16"])
    assert (args.checksums, args.max_prompts, args.compute_dtype) == (False, 3, "bfloat16")
    with pytest.raises(SystemExit):
        parser.parse_args(["extract", "--model", "m", "--prompts", "p", "--out", "o", "--max-prompts", "0"])
    assert "expected a positive integer, got '0'" in capsys.readouterr().err


def test_an_unknown_option_of_extract_names_the_close_one():
    with pytest.raises(TypeError, match="unexpected keyword argument 'layer'; did you mean 'layers'"):
        lmprobe.extract("lmprobe-tiny", ["a"], out="never-written", layer=3)


def test_max_prompts_extracts_the_first_prompts_and_reads_the_source_no_further(tmp_path, capsys):
    """--max-prompts, a setting written once in ExtractionConfig: a trial run on the start of a large file."""
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"text": f"prompt number {i}", "label": i % 2}) + "\n" for i in range(5))
                 + "{not json, and never read\n")
    assert cli_main(["extract", "--model", "lmprobe-tiny", "--prompts", str(f), "--out", str(tmp_path / "ds"),
                     "--layers", "-1", "--max-prompts", "3", "--quiet"]) == 0
    ds = lmprobe.load(tmp_path / "ds")
    assert ds.texts == [f"prompt number {i}" for i in range(3)] and list(ds.labels) == [0, 1, 0]
    assert ds.info["extraction"]["settings"]["num_prompts"] == 3
    whole = lmprobe.extract("lmprobe-tiny", [{"text": f"prompt number {i}", "label": i % 2} for i in range(5)],
                            out=tmp_path / "all", layers=-1, quiet=True)
    assert np.array_equal(ds.hidden(ds.layers[0]), whole.hidden(whole.layers[0])[:3])
    with pytest.raises(lmprobe.LmprobeError, match="--max-prompts does not apply to corpus extraction"):
        lmprobe.extract("lmprobe-tiny", str(f), out=tmp_path / "c", max_tokens=100, max_prompts=3)
