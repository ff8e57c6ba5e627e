"""Reliability, round 3 (issue 27): what an outside red-team pass found, one test per finding.

Each test failed on main before its fix. The interrupted-operation matrix is in docs/security.md.
"""

from __future__ import annotations

from conftest import ROOT

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


# ------------------------------------------------------------------ S3 outputs: a shard uploaded before its hash


# ------------------------------------------------------------------ features: damaged caches and partial states
