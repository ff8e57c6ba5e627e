"""What the command line says when something goes wrong (docs/security.md, "Messages"): a user error is one line
with exit code 2 that says what was wrong and what to do, a bug keeps its traceback, Ctrl-C says how to go on, an
unreachable Hub is one attempt and one line, and text from a dataset is escaped before it is printed."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from support.datasets import write_dataset
from support.paths import ROOT

import lmprobe
from lmprobe.cli import main as cli_main
from lmprobe.format import DatasetWriter


def test_cli_prints_one_line_for_user_errors_and_a_traceback_for_bugs(tmp_path):
    r = subprocess.run([sys.executable, "-m", "lmprobe", "info", str(tmp_path / "missing")], capture_output=True,
                       text=True)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    bug = ("import sys, lmprobe.cli.app as c\n"
           "def boom(args):\n    raise KeyError('internal')\n"
           "p = c.build_parser\n"
           "def patched():\n    parser = p()\n    parser.set_defaults(func=boom)\n"
           "    for a in parser._subparsers._group_actions[0].choices.values(): a.set_defaults(func=boom)\n"
           "    return parser\n"
           "c.build_parser = patched\nsys.exit(c.main(['info', 'x']))\n")
    r = subprocess.run([sys.executable, "-c", bug], capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" in r.stderr and "KeyError: 'internal'" in r.stderr


def test_info_escapes_control_characters(tmp_path, capsys):
    w = DatasetWriter(tmp_path / "ds", layers=[0], dim=2, model_name="evil\x1b]0;pwned\x07\x1b[2J")
    w.add_batch(texts=["a"], num_tokens=[1], hidden={0: np.zeros((1, 2))})
    w.close()
    assert cli_main(["info", str(tmp_path / "ds")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\\x1b" in out


def test_user_errors_are_one_line(tmp_path, llama_dir, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello there\n")

    def run(*args) -> str:
        code = cli_main(["extract", "--model", str(llama_dir), "--quiet", *args])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, err
        return err

    assert "1:2:3:4" in run("--prompts", str(prompts), "--out", str(tmp_path / "o"), "--layers", "1:2:3:4")
    (tmp_path / "afile").write_text("x")
    assert "is a file" in run("--prompts", str(prompts), "--out", str(tmp_path / "afile" / "o"))
    (tmp_path / "bad.txt").write_bytes(b"ok line\n\xff\xfe broken\n")
    err = run("--prompts", str(tmp_path / "bad.txt"), "--out", str(tmp_path / "o2"))
    assert "bad.txt" in err and "line 2" in err and "UTF-8" in err
    (tmp_path / "s.jsonl").write_text('{"text": "fine"}\n{"text": "bad \\ud800 surrogate"}\n')
    err = run("--prompts", str(tmp_path / "s.jsonl"), "--out", str(tmp_path / "o3"))
    assert "line 2" in err and "surrogate" in err


def test_out_of_space_says_how_to_resume(tmp_path, llama_dir, monkeypatch, capsys):
    import errno

    from lmprobe.format import safetensors_io

    real = safetensors_io.StreamingSafetensorsWriter.append
    calls = {"n": 0}

    def full(self, arrays):
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, arrays)

    monkeypatch.setattr(safetensors_io.StreamingSafetensorsWriter, "append", full)
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(f"prompt number {i}" for i in range(12)) + "\n")
    code = cli_main(["extract", "--model", str(llama_dir), "--prompts", str(prompts), "--out", str(tmp_path / "o"),
                     "--batch-size", "2", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "space" in err and "run the same command again" in err
    monkeypatch.setattr(safetensors_io.StreamingSafetensorsWriter, "append", real)
    assert cli_main(["extract", "--model", str(llama_dir), "--prompts", str(prompts), "--out", str(tmp_path / "o"),
                     "--batch-size", "2", "--quiet"]) == 0
    assert lmprobe.load(tmp_path / "o").num_prompts == 12


def test_an_unreachable_hub_is_one_line(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "cache"))
    from lmprobe.storage import hub as hub_mod

    monkeypatch.setattr(hub_mod, "hub_read_policy",
                        lambda: hub_mod.RetryPolicy(retry_on_exceptions=hub_mod.transport_errors(), max_retries=0))
    assert cli_main(["info", "someone/some-dataset"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot reach the Hub" in err, err


def test_a_prompt_folder_is_not_said_to_be_missing(tmp_path, capsys):
    (tmp_path / "prompts").mkdir()
    assert cli_main(["extract", "--model", "lmprobe-tiny", "--prompts", str(tmp_path / "prompts"), "--out",
                     str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" not in err and "prompts" in err


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
    """Ctrl-C says how to go on (resume, finish the merge, run again), not only 'interrupted'."""
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
