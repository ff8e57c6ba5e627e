"""The README and the docs: their commands and snippets run as a user would run them, every command line in them
parses, their links resolve, and the CLI reference matches the parser."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import ROOT

import lmprobe
from lmprobe.cli import build_parser
from lmprobe.cli import main as cli_main

DOCS = ROOT / "docs"


def _subcommands() -> list[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return sorted(action.choices)


@pytest.mark.slow  # end-to-end: real processes and model loads
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


@pytest.mark.slow
def test_cli_reference_lists_every_command():
    text = (DOCS / "cli.md").read_text()
    documented = sorted(set(re.findall(r"^\| `([a-z-]+)` \|", text, flags=re.M)))
    assert documented == _subcommands()


@pytest.mark.slow
@pytest.mark.parametrize("command", _subcommands())
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main([command, "--help"])
    assert exc.value.code == 0
    assert "usage: lmprobe " + command in capsys.readouterr().out


def _readme_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quickstart", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    cmds = []
    for part in quick.strip().split("&&"):
        argv = shlex.split(part)
        if argv and argv[0].endswith("bin/lmprobe"):
            cmds.append(argv[1:])
    return cmds


def test_tests_start_in_an_empty_folder_of_their_own():
    """conftest's guard: no test sees what the folder pytest was started from holds."""
    assert Path.cwd() != ROOT and not any(Path.cwd().iterdir())


@pytest.mark.slow
def test_the_readme_first_command_then_the_hub_name_test_in_the_same_folder(tmp_path):
    """A new user runs the README's first command, then its second, in one folder: the first leaves out/, and the
    suite's Hub-name test (``out/nonexistent`` is a repo id when there is no ./out) must pass beside it."""
    cmds = _readme_commands()
    assert [c[0] for c in cmds] == ["extract", "info"]
    (tmp_path / "examples").mkdir()  # a fresh clone's files, as the README's paths name them
    shutil.copy(ROOT / "examples/prompts.jsonl", tmp_path / "examples")
    said = ""
    for argv in cmds:
        r = subprocess.run([sys.executable, "-m", "lmprobe", *argv], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        said += r.stdout
    assert "wrote 48 prompts" in said and "top-5" in said and "lmprobe-tiny" in said, said
    assert (tmp_path / "out" / "tiny-demo" / "index").is_dir()
    tests = ["tests/publish/test_hub.py::test_owner_name_without_such_a_local_folder_still_means_the_hub",
             "tests/docs/test_docs.py::test_tests_start_in_an_empty_folder_of_their_own"]
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


@pytest.mark.slow
def test_readme_links_point_at_existing_files():
    text = (ROOT / "README.md").read_text()
    for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if link.startswith("http"):
            continue
        assert (ROOT / link).exists(), link


def _command_line_problems(text: str) -> tuple[int, list[str]]:
    """(how many ``lmprobe ...`` lines the page's code blocks hold, what is wrong with them).

    Every fenced block counts, with a language or without. A concrete command line must parse; a synopsis
    (``[--layers L]``, ``PATH...``) must name a command that exists and only options that command takes.
    """
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    seen, problems = 0, []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        for cmd in re.split(r"\n|&&|;", block.replace("\\\n", " ")):
            cmd = cmd.split(" #")[0].strip()
            if cmd.startswith(".venv/bin/"):
                cmd = cmd[len(".venv/bin/"):]
            if not cmd.startswith("lmprobe "):
                continue
            seen += 1
            words = cmd.split()
            if words[1] not in commands:
                if words[1] not in ("--help", "--version", "COMMAND"):
                    problems.append(f"{cmd}: no command {words[1]!r}")
                continue
            if "[" in cmd or "..." in cmd or "|" in cmd:  # a synopsis: its options must exist
                options = {o for act in commands[words[1]]._actions for o in act.option_strings}
                problems += [f"{cmd}: {words[1]} takes no {o}" for o in re.findall(r"--[a-z][\w-]*", cmd)
                             if o not in options]
                continue
            try:
                parser.parse_args(shlex.split(cmd)[1:])
            except SystemExit:
                problems.append(f"{cmd}: does not parse")
    return seen, problems


@pytest.mark.slow
@pytest.mark.parametrize("page", ["README.md", "docs/cli.md", "docs/corpus.md", "docs/quickstart.md",
                                  "docs/publishing.md", "docs/saev.md", "docs/pages.md", "docs/probing.md"])
def test_documented_command_lines_parse(page):
    """Every `lmprobe ...` line in a page's code blocks is one the parser accepts (a synopsis: its options exist)."""
    seen, problems = _command_line_problems((ROOT / page).read_text())
    assert seen, f"{page} shows no command line"
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_the_command_line_check_catches_a_line_that_does_not_parse(capsys):
    seen, problems = _command_line_problems("```\nlmprobe extract --model m --prompts p --out o --nope\n"
                                            "lmprobe info [--colour]\nlmprobe exract x\n```\n")
    assert seen == 3 and len(problems) == 3, problems


def test_cli_md_lists_every_option_of_extract():
    """A setting added to ExtractionConfig becomes an option of extract; docs/cli.md's synopsis must name it."""
    from lmprobe.cli.app import build_parser

    parser = build_parser()
    extract = next(a for a in parser._actions if a.dest == "command").choices["extract"]
    synopsis = (ROOT / "docs/cli.md").read_text().split("```\nlmprobe extract ", 1)[1].split("```", 1)[0]
    missing = [o for a in extract._actions for o in a.option_strings
               if o.startswith("--") and o != "--help" and not re.search(re.escape(o) + r"\b(?!-)", synopsis)]
    assert not missing, f"options of extract missing from docs/cli.md's synopsis: {missing}"


def _extract_commands(text: str) -> list[list[str]]:
    """The concrete `lmprobe extract` command lines of a page's code blocks, as words."""
    out = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        for cmd in re.split(r"\n|&&|;", block.replace("\\\n", " ")):
            cmd = cmd.split(" #")[0].strip().removeprefix(".venv/bin/")
            if cmd.startswith("lmprobe extract ") and "[" not in cmd and "..." not in cmd:
                out.append(shlex.split(cmd))
    return out


def test_documented_extractions_into_one_folder_agree():
    """docs/publishing.md extracted into the README's out/tiny-demo with other settings, so it
    failed right after the quickstart ("already holds a dataset made with other settings"). The commands with the
    embedded model run as written, in any order: two of them into one folder must be the same extraction."""
    by_out: dict[str, dict[str, tuple[str, list[str]]]] = {}
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for words in _extract_commands(page.read_text()):
            args = build_parser().parse_args(words[1:])
            if args.model != "lmprobe-tiny":
                continue  # an example for a model of the reader's own, not a command to run as written
            settings = {k: v for k, v in vars(args).items() if k not in ("push", "private", "token", "quiet", "func",
                                                                          "overwrite", "dry_run")}
            by_out.setdefault(str(args.out), {})[repr(sorted(settings.items()))] = (page.name, words)
    clashes = {out: [f"{page}: {' '.join(words)}" for page, words in seen.values()]
               for out, seen in by_out.items() if len(seen) > 1}
    assert not clashes, f"extractions into the same --out with other settings: {clashes}"
