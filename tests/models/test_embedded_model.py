"""The embedded model (lmprobe-tiny): small, meaningful, identified by a hash of its weights; the example prompts."""

from __future__ import annotations

import re

import numpy as np
from support.paths import ROOT

import lmprobe
from lmprobe.cli import main as cli_main


def test_embedded_model_is_small_and_meaningful(tmp_path):
    size = sum(p.stat().st_size for p in (ROOT / "lmprobe/models/tiny").iterdir())
    assert size < 10 * 2**20
    prompts = ["The capital of France is", "The capital of Japan is", "one two three four", "Monday, Tuesday,"]
    from transformers import AutoTokenizer

    from lmprobe.extraction.model import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("lmprobe-tiny")[0])
    texts = list(prompts)
    for step in range(6):  # greedy decoding, one lmprobe extraction per step
        ds = lmprobe.extract("lmprobe-tiny", texts, out=tmp_path / f"s{step}", layers="-1", logits_topk=3, quiet=True)
        _, idx = ds.logits_topk()
        texts = [t + tok.decode([int(i[0])]) for t, i in zip(texts, idx, strict=False)]
    continuations = [re.findall(r"\w+", t[len(p):])[0] for t, p in zip(texts, prompts, strict=False)]
    assert continuations == ["Paris", "Tokyo", "five", "Wednesday"], texts
    # shipped inside lmprobe, the model has a known identity: a content hash of its weights
    import hashlib

    weights = ROOT / "lmprobe/models/tiny/model.safetensors"
    want = hashlib.sha256(b"model.safetensors\0" + hashlib.sha256(weights.read_bytes()).digest()).hexdigest()
    assert ds.info["model"] == {"name": "lmprobe-tiny", "revision": f"sha256:{want}"}


def test_info_shows_the_embedded_models_revision(tmp_path, capsys):
    lmprobe.extract("lmprobe-tiny", ["a b c", "d e"], out=tmp_path / "ds", layers="-1", quiet=True)
    assert cli_main(["info", str(tmp_path / "ds")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("model"))
    assert re.fullmatch(r"model\s+lmprobe-tiny \(revision sha256:[0-9a-f]{64}\)", line), line


def test_a_model_name_close_to_the_embedded_one_gets_did_you_mean(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert cli_main(["extract", "--model", "lmprobe-tinny", "--prompts", str(ROOT / "examples/prompts.jsonl"), "--out",
                     str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did you mean 'lmprobe-tiny'" in err[0], err


def test_example_prompts_have_low_perplexity_and_a_readable_label(tmp_path):
    ds = lmprobe.extract("lmprobe-tiny", ROOT / "examples/prompts.jsonl", out=tmp_path / "ds", layers="all",
                         perplexity=True, quiet=True)
    assert ds.num_prompts >= 40 and set(ds.labels.tolist()) == {0, 1}
    assert float(np.median(ds.index["perplexity_mean"])) < 10  # vocabulary of 512: a random model is ~500
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import cross_val_score

    accs = [cross_val_score(LogisticRegression(max_iter=5000), ds.hidden(layer), ds.labels, cv=4).mean()
            for layer in ds.layers]
    assert max(accs) >= 0.8, accs  # chance is 0.5
