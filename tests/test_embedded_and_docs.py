"""The embedded model and the README's commands, run as a user would run them."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import lmprobe
from lmprobe.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent


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


def _readme_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quickstart", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    cmds = []
    for part in quick.strip().split("&&"):
        argv = shlex.split(part)
        if argv and argv[0].endswith("bin/lmprobe"):
            cmds.append(argv[1:])
    return cmds


def test_readme_quickstart_commands_work(tmp_path, monkeypatch, capsys):
    cmds = _readme_commands()
    assert [c[0] for c in cmds] == ["extract", "info"]
    monkeypatch.chdir(tmp_path)  # a fresh clone's files, as the README's paths name them
    (tmp_path / "examples").mkdir()
    shutil.copy(ROOT / "examples/prompts.jsonl", tmp_path / "examples")
    for argv in cmds:
        assert cli_main(argv) == 0, argv
    text = capsys.readouterr().out
    assert "wrote 48 prompts" in text and "top-5" in text and "lmprobe-tiny" in text


def test_tests_start_in_an_empty_folder_of_their_own():
    """conftest's guard: no test sees what the folder pytest was started from holds."""
    assert Path.cwd() != ROOT and not any(Path.cwd().iterdir())


@pytest.mark.slow
def test_the_readme_first_command_then_the_hub_name_test_in_the_same_folder(tmp_path):
    """A new user runs the README's first command, then its second, in one folder: the first leaves out/, and the
    suite's Hub-name test (``out/nonexistent`` is a repo id when there is no ./out) must pass beside it."""
    (tmp_path / "examples").mkdir()
    shutil.copy(ROOT / "examples/prompts.jsonl", tmp_path / "examples")
    for argv in _readme_commands():
        r = subprocess.run([sys.executable, "-m", "lmprobe", *argv], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "tiny-demo" / "index").is_dir()
    tests = ["tests/test_hub.py::test_owner_name_without_such_a_local_folder_still_means_the_hub",
             "tests/test_embedded_and_docs.py::test_tests_start_in_an_empty_folder_of_their_own"]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT),
                        *[str(ROOT / t) for t in tests]], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout[-3000:]


def test_readme_python_snippets_run(tmp_path, monkeypatch, hub):
    """Every Python block of the README, in order, in one namespace, as a reader would paste them."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples/prompts.jsonl").write_text((ROOT / "examples/prompts.jsonl").read_text())
    lmprobe.extract("lmprobe-tiny", "examples/prompts.jsonl", out="out/tiny-demo", logits_topk=5, perplexity=True,
                    quiet=True)
    lmprobe.push_to_hub("out/tiny-demo", "me/tiny-demo-acts", quiet=True)  # the repo the README reads
    ns: dict = {}
    for block in blocks:
        exec(block, ns)
    assert ns["X"].shape == (48, 128)


def test_ci_runs_the_readme_test_command():
    text = (ROOT / "README.md").read_text()
    test_cmd = text.split("Set up and run the whole test suite", 1)[1].split("```bash", 1)[1].split("```", 1)[0].strip()
    assert test_cmd in (ROOT / ".ci/run").read_text()
