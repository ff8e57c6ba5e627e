"""`lmprobe COMMAND --help` documents every option: a help text, its default, related options grouped."""

from __future__ import annotations

import argparse
import re

import pytest

from lmprobe.cli import build_parser
from lmprobe.cli import main as cli_main


def _arguments():
    """(command, parser, action) for every argument of every subcommand, positionals included."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        for action in parser._actions:
            if not isinstance(action, argparse._HelpAction):
                yield name, parser, action


def test_every_option_has_help_and_shows_its_default():
    missing, no_default = [], []
    for name, parser, action in _arguments():
        flag = "/".join(action.option_strings) or action.dest
        if not (action.help or "").strip():
            missing.append(f"{name} {flag}")
        if action.option_strings and action.nargs != 0 and not (action.default is None or action.default == []):
            # the option's own entry in the formatted help (after the usage): from its flag to the next one
            body = parser.format_help().split("\n\n", 1)[1]
            entry = re.search(rf"\n  {re.escape(action.option_strings[0])}\b(.*?)(?=\n  -|\n\n|$)", body, re.S)
            if "default" not in entry.group(1):
                no_default.append(f"{name} {flag}")
    assert not missing, f"arguments without help: {missing}"
    assert not no_default, f"options whose help does not show the default: {no_default}"


def test_help_shows_defaults_and_groups_the_corpus_options(capsys):
    with pytest.raises(SystemExit):
        cli_main(["extract", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--batch-size N prompts per forward pass." in text and "lmprobe:runs) (default: 8)" in text
    # a setting that is on by default is turned off by its --no- flag, and says so
    assert "--no-statistics keep running per-layer statistics" in text and "on by default, this flag turns it off" in text
    assert "Run MODEL over the prompts in SOURCE" in text and "--prompts SOURCE" in text
    corpus = text.split("corpus extraction (one row per window of a long text):")[1].split(" what to store:")[0]
    assert "--context-len" in corpus and "--max-tokens" in corpus and "--no-special-tokens" in corpus
    with pytest.raises(SystemExit):
        cli_main(["merge", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--overwrite replace an existing dataset in DIR" in text
    with pytest.raises(SystemExit):
        cli_main(["probe", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--seed SEED seed of the fold split and the classifier (default: 0)" in text


# ------------------------------------------------------------------ a new user's first commands


def test_bare_lmprobe_shows_the_help_not_an_error(capsys):
    assert cli_main([]) == 0
    out = capsys.readouterr()
    assert out.err == "" and out.out.startswith("usage: lmprobe") and "extract" in out.out and "validate" in out.out


def test_a_mistyped_option_names_the_close_one_and_shows_the_commands_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["extract", "--model", "m", "--prompts", "p.jsonl", "--out", "o", "--storge", "pooled"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: lmprobe extract"), err  # the subcommand's usage, not the top level's
    assert "unrecognized arguments: --storge pooled" in err and "did you mean --storage?" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("lmprobe extract: error:"), last


def test_a_mistyped_option_with_a_value_and_one_with_no_close_match(capsys):
    with pytest.raises(SystemExit):
        cli_main(["probe", "ds", "--lyaers=3"])
    assert "did you mean --layers?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["info", "ds", "--zzzzzz"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzzzz" in err and "did you mean" not in err and err.startswith("usage: lmprobe info")


def test_a_mistyped_command_names_the_close_one(capsys):
    with pytest.raises(SystemExit):
        cli_main(["extrac", "--model", "m"])
    assert "did you mean 'extract'?" in capsys.readouterr().err


def test_help_speaks_command_line_only(capsys):
    """`--help` describes what a command line can pass: no Python-only values (a list, a DataFrame, "local"),
    which the field's docstring still tells a Python user (help(lmprobe.extract))."""
    import lmprobe

    for command in ("extract", "push", "pull", "probe", "export-saev", "report", "features"):
        with pytest.raises(SystemExit):
            cli_main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "in Python" not in text and "In Python" not in text and "DataFrame" not in text, (command, text)
    doc = " ".join(lmprobe.extract.__doc__.split())
    assert "In Python also a list of ints" in doc and "In Python, \"local\" runs" in doc
