"""The docs' commands run, and the CLI reference matches the parser."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest

from lmprobe.cli import build_parser
from lmprobe.cli import main as cli_main

pytestmark = pytest.mark.slow  # end-to-end: real processes and model loads

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _subcommands() -> list[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return sorted(action.choices)


def test_quickstart_commands_and_snippet_run(tmp_path, monkeypatch, hub, capsys):
    text = (DOCS / "quickstart.md").read_text()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").mkdir()
    shutil.copy(ROOT / "examples/prompts.jsonl", tmp_path / "examples")
    ran = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.strip().splitlines():
            line = line.split("#")[0].strip()
            if not line.startswith("lmprobe "):
                continue
            argv = shlex.split(line)[1:]
            assert cli_main(argv) == 0, line
            ran.append(argv[0])
    assert ran == ["extract", "info", "validate", "probe", "probe", "export-saev", "push"]
    assert (tmp_path / "out/quick-probe.png").exists()
    exec(re.findall(r"```python\n(.*?)```", text, flags=re.S)[0], {})


def test_cli_reference_lists_every_command():
    text = (DOCS / "cli.md").read_text()
    documented = sorted(set(re.findall(r"^\| `([a-z-]+)` \|", text, flags=re.M)))
    assert documented == _subcommands()


@pytest.mark.parametrize("command", _subcommands())
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main([command, "--help"])
    assert exc.value.code == 0
    assert "usage: lmprobe " + command in capsys.readouterr().out


def test_readme_links_point_at_existing_files():
    text = (ROOT / "README.md").read_text()
    for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if link.startswith("http"):
            continue
        assert (ROOT / link).exists(), link


@pytest.mark.parametrize("page", ["README.md", "docs/cli.md", "docs/corpus.md", "docs/quickstart.md"])
def test_documented_command_lines_parse(page):
    """Every `lmprobe ...` command shown in a page's code blocks is one the parser accepts."""
    text = (ROOT / page).read_text()
    parser = build_parser()
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for cmd in block.replace("\\\n", " ").splitlines():
            cmd = cmd.split(" #")[0].strip()
            if cmd.startswith("lmprobe ") and "[" not in cmd and "..." not in cmd:
                parser.parse_args(shlex.split(cmd)[1:])  # exits (fails the test) on an unknown flag
