"""Simple mistakes are answered at once, and --help, info, validate and every argument error
import nothing heavy (torch, transformers): each command runs here with ``sys.modules["torch"] = None``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

from support.datasets import write_dataset
from support.paths import ROOT

import lmprobe
from lmprobe.base.tokenizer import embedded_model_dir

PROMPTS = str(ROOT / "examples" / "prompts.jsonl")

#: runs the command line with torch and transformers unimportable: an import of either fails the command
NO_TORCH = """
import sys
for name in ("torch", "transformers", "nnsight", "sklearn"):
    sys.modules[name] = None
from lmprobe.cli import main
sys.exit(main(sys.argv[1:]))
"""


def lmprobe_without_torch(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)


def one_line_error(result: subprocess.CompletedProcess, command: str) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lmprobe {command}: error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_help_imports_nothing_heavy():
    for args in (["--help"], ["extract", "--help"], ["probe", "--help"]):
        result = lmprobe_without_torch(*args)
        assert result.returncode == 0, result.stderr
        assert "usage: lmprobe" in result.stdout


def test_a_layer_past_the_embedded_model_is_refused_before_torch(tmp_path):
    result = lmprobe_without_torch("extract", "--model", "lmprobe-tiny", "--prompts", PROMPTS,
                                   "--out", str(tmp_path / "out"), "--layers", "9")
    line = one_line_error(result, "extract")
    assert "layer 9 does not exist" in line and "6 layers" in line
    assert not (tmp_path / "out").exists()


def test_a_layer_past_a_local_models_config_is_refused_before_torch(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(embedded_model_dir("lmprobe-tiny") / "config.json", model / "config.json")  # no weights needed
    config = json.loads((model / "config.json").read_text())
    n = config["num_hidden_layers"]
    result = lmprobe_without_torch("extract", "--model", str(model), "--prompts", PROMPTS,
                                   "--out", str(tmp_path / "out"), "--layers", f"0,{n + 3}")
    line = one_line_error(result, "extract")
    assert f"layer {n + 3} does not exist" in line


def test_a_missing_column_and_an_option_conflict_are_refused_before_torch(tmp_path):
    result = lmprobe_without_torch("extract", "--model", "lmprobe-tiny", "--prompts", PROMPTS,
                                   "--out", str(tmp_path / "out"), "--text-column", "body")
    assert "no 'body' column" in one_line_error(result, "extract")
    result = lmprobe_without_torch("extract", "--model", "lmprobe-tiny", "--prompts", PROMPTS,
                                   "--out", str(tmp_path / "out"), "--chat-template", "--truncate", "left")
    assert "--truncate cannot be combined with --chat-template" in one_line_error(result, "extract")


def test_info_and_validate_import_nothing_heavy(tmp_path, rng):
    write_dataset(tmp_path / "ds", rng, n=5, layers=(0, 1))
    result = lmprobe_without_torch("info", str(tmp_path / "ds"))
    assert result.returncode == 0, result.stderr
    assert "layers" in result.stdout
    result = lmprobe_without_torch("validate", str(tmp_path / "ds"))
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout


def test_export_saelens_without_layer_is_one_line_and_no_cache_line(hub, tmp_path, rng, fresh_hf_cache, capsys):
    from lmprobe.cli import main as cli_main

    write_dataset(tmp_path / "ds", rng, n=6, layers=(0, 1), dim=4, storage="full_sequence")
    repo = f"tester/fast-{uuid.uuid4().hex[:8]}"
    lmprobe.push_to_hub(tmp_path / "ds", repo, quiet=True)
    capsys.readouterr()
    assert cli_main(["export-saelens", f"hf://datasets/{repo}", "--out", str(tmp_path / "sl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pass --layer" in err[0], err  # the cache line comes only with work to do


def test_skip_special_tokens_needs_no_transformers(tmp_path):
    """The special ids come from the tokenizer's files read as JSON: the same ids, without transformers."""
    from lmprobe.base.tokenizer import resolve_tokenizer, special_token_ids
    from lmprobe.stream import ShardStream

    lmprobe.extract("lmprobe-tiny", PROMPTS, out=tmp_path / "ds", layers="1", storage="full_sequence",
                    token_ids=True, max_prompts=6, quiet=True)
    tok = resolve_tokenizer("lmprobe-tiny", None, need="the test")
    assert special_token_ids("lmprobe-tiny") == sorted(set(tok.all_special_ids))
    expected = sum(len(b) for b in ShardStream(tmp_path / "ds", 1, 4, skip_special_tokens=tok.all_special_ids))
    everything = sum(len(b) for b in ShardStream(tmp_path / "ds", 1, 4))
    assert expected < everything  # the prompts start with <s>: something is skipped
    code = (
        "import sys\n"
        "for name in ('torch', 'transformers', 'tokenizers'):\n"
        "    sys.modules[name] = None\n"
        "from lmprobe.stream import ShardStream\n"
        f"s = ShardStream({str(tmp_path / 'ds')!r}, 1, 4, skip_special_tokens=True)\n"
        "print(sum(len(b) for b in s))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) == expected
