"""Reliability, round 3 (issue 27): what an outside red-team pass found, one test per finding.

Each test failed on main before its fix. The interrupted-operation matrix is in docs/security.md.
"""

from __future__ import annotations

import pytest
from conftest import ROOT, write_dataset

from lmprobe.cli import main as cli_main

INDEX = "index/train-00000-of-00001.parquet"


# ------------------------------------------------------------------ 3. num_tokens beyond the address lists


# ------------------------------------------------------------------ 4. metadata listing 100,000 layers


# ------------------------------------------------------------------ 5. kill -9 during merge


# ------------------------------------------------------------------ 7. --max-tokens on a labelled prompt file


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
