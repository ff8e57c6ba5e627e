"""A hostile config.json (lmprobe/extraction/configfile.py): each is one line, before transformers reads the file.

A million layers would grow a meta model for minutes, a negative width reaches torch as a raw RuntimeError,
5,000 nested lists a RecursionError, an auto_map without --trust-remote-code transformers' traceback.
"""

from __future__ import annotations

import json
import shutil

import pytest

from lmprobe.cli import main as cli_main
from lmprobe.errors import ModelError
from lmprobe.extraction.configfile import (
    MAX_CONFIG_BYTES,
    MAX_DEPTH,
    check_config,
    check_config_file,
    nesting_depth,
)


def _deep(cfg: dict) -> str:
    return json.dumps(cfg)[:-1] + ', "x": ' + "[" * 5000 + "]" * 5000 + "}"


HOSTILE = {
    "a million layers": (lambda c: json.dumps({**c, "num_hidden_layers": 1_000_000}), "more than 1024 layers"),
    "a negative width": (lambda c: json.dumps({**c, "hidden_size": -32}), "hidden_size=-32"),
    "a negative feed-forward": (lambda c: json.dumps({**c, "intermediate_size": -5}), "cannot be negative"),
    "negative layers": (lambda c: json.dumps({**c, "num_hidden_layers": -2}), "negative number of layers"),
    "a million layers in a sub-config": (lambda c: json.dumps({**c, "vision_config": {"num_hidden_layers": 10**6}}),
                                         "vision_config.num_hidden_layers"),
    "5,000 levels deep": (_deep, "5001 levels deep"),
    "auto_map without --trust-remote-code": (
        lambda c: json.dumps({**c, "model_type": "hostile", "auto_map": {"AutoConfig": "configuration_x.XConfig"}}),
        "--trust-remote-code"),
    "not JSON": (lambda c: "{'model_type': ", "not valid JSON"),
    "a list": (lambda c: "[1, 2]", "not an object"),
}


@pytest.fixture
def hostile(llama_dir, tmp_path):
    original = json.loads((llama_dir / "config.json").read_text())

    def make(case: str):
        folder = tmp_path / "model"
        shutil.copytree(llama_dir, folder, dirs_exist_ok=True)
        (folder / "config.json").write_text(HOSTILE[case][0](original))
        return folder
    return make


@pytest.fixture
def no_transformers_config(monkeypatch):
    """transformers never reads a hostile file: nothing grows with it (a miniature keeps the layer count)."""
    from transformers import AutoConfig

    def refuse(*a, **k):
        raise AssertionError("transformers read a config that lmprobe should have refused")

    monkeypatch.setattr(AutoConfig, "from_pretrained", refuse)


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hookpoints_and_a_dry_run_refuse_a_hostile_config_in_one_line(case, hostile, no_transformers_config,
                                                                        tmp_path, capsys):
    folder = hostile(case)
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    for argv in (["hookpoints", "--model", str(folder)],
                 ["extract", "--model", str(folder), "--prompts", str(prompts), "--out", str(tmp_path / "o"),
                  "--dry-run", "--quiet"]):
        code = cli_main(argv)
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, err
        assert HOSTILE[case][1] in err and "Traceback" not in err
        assert not (tmp_path / "o").exists()


def test_the_api_refuses_a_hostile_config_with_a_model_error(hostile, no_transformers_config):
    import lmprobe

    with pytest.raises(ModelError, match="more than 1024 layers"):
        lmprobe.hookpoints(str(hostile("a million layers")))


def test_a_real_config_passes_and_trust_remote_code_lets_auto_map_through(llama_dir, tmp_path):
    cfg = check_config_file(llama_dir / "config.json", model="m", trust_remote_code=False)
    assert cfg["model_type"] == "llama"
    custom = {"model_type": "hostile", "auto_map": {"AutoConfig": "configuration_x.XConfig"}}
    check_config(custom, model="m", trust_remote_code=True)
    # a known model type with an auto_map runs transformers' own code, as transformers does
    check_config({"model_type": "llama", "auto_map": {"AutoConfig": "x.Y"}}, model="m", trust_remote_code=False)


def test_every_default_config_of_transformers_passes():
    """No false alarm: the bounds hold for the default config of every architecture transformers knows."""
    from transformers import CONFIG_MAPPING

    checked = 0
    for model_type in list(CONFIG_MAPPING.keys()):
        try:
            d = CONFIG_MAPPING[model_type]().to_dict()
        except Exception:  # noqa: BLE001 - a config that needs arguments or an optional package
            continue
        check_config(d, model=model_type, trust_remote_code=False)
        assert nesting_depth(json.dumps(d).encode()) <= MAX_DEPTH
        checked += 1
    assert checked > 200


def test_an_oversized_config_file_is_refused_before_it_is_read(tmp_path):
    p = tmp_path / "config.json"
    with open(p, "wb") as f:
        f.truncate(MAX_CONFIG_BYTES + 1)
    with pytest.raises(ModelError, match="bytes, more than"):
        check_config_file(p, model="m", trust_remote_code=False)


def test_a_config_that_is_not_a_regular_file_is_refused_without_blocking(llama_dir, tmp_path,
                                                                        no_transformers_config, capsys):
    import os

    folder = tmp_path / "fifo"
    shutil.copytree(llama_dir, folder)
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")  # an open for reading would wait for a writer forever
    assert cli_main(["hookpoints", "--model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a regular file" in err, err


def test_nesting_is_counted_outside_strings():
    assert nesting_depth(b'{"a": "[[[[{{{{", "b": [[1]], "c": "\\"[["}') == 3
    assert nesting_depth(b"[" * 5000 + b"]" * 5000) == 5000


def test_a_hostile_config_on_the_hub_is_refused_in_one_line(hub, hostile, no_transformers_config, fresh_hf_cache,
                                                            capsys):
    import uuid

    from huggingface_hub import HfApi

    token = "hf_testSECRETtoken1234567890"
    repo = f"tester/hostile-{uuid.uuid4().hex[:8]}"
    api = HfApi(token=token)
    api.create_repo(repo, repo_type="model")
    api.upload_folder(folder_path=hostile("a million layers"), repo_id=repo, repo_type="model")
    capsys.readouterr()
    assert cli_main(["hookpoints", "--model", repo]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "more than 1024 layers" in err, err
