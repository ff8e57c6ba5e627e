"""The ``lmprobe`` command line: the parser of every command group, and ``main``."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from typing import Any

from ..api import __version__
from ..base.display import escape_controls, hide_credentials
from ..base.progress import messages_shown
from ..errors import LmprobeError
from . import analysis, datasets, exports, extract, hub


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it or there is none to say."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if action.option_strings and action.nargs != 0 and "default" not in text \
                and not (default is None or default is False or default == [] or default == argparse.SUPPRESS):
            text += " (default: %(default)s)"  # flags (nargs 0) have no value to show
        return text


class _Parser(argparse.ArgumentParser):
    """argparse that names the command a mistyped one was probably meant to be (Python 3.14's suggest_on_error)."""

    def error(self, message: str) -> Any:
        m = re.match(r"argument COMMAND: invalid choice: '([^']*)'", message)
        sub = _subcommands(self)
        if m and sub is not None:
            close = difflib.get_close_matches(m.group(1), list(sub.choices), n=1, cutoff=0.6)
            if close:
                message = f"unknown command {m.group(1)!r}; did you mean {close[0]!r}? (`lmprobe --help` lists them)"
        return super().error(message)


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _unrecognized(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """argparse's message for arguments a command does not take, with the closest option of each mistyped one."""
    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for arg in extra:
        if arg.startswith("--"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], options, n=1, cutoff=0.6)
            hints += [f"did you mean {close[0]}?"] if close else []
    return f"unrecognized arguments: {' '.join(extra)}" + (f"; {'; '.join(hints)}" if hints else "")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="lmprobe", formatter_class=_HelpFormatter,
        description="Extract language-model activations into the lmprobe dataset format 2.0, publish and read them.",
    )
    parser.add_argument("--version", action="version", version=f"lmprobe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def command(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, formatter_class=_HelpFormatter, **kwargs)

    for group in (extract, hub, datasets, analysis, exports):
        group.add_commands(command)
    return parser


#: what re-running a command after Ctrl-C (or kill -9) does (docs/security.md, the interrupted-operation matrix)
_RESUMES = {
    "extract": "run the same command again to resume from the last checkpoint (--overwrite starts over)",
    "merge": "run the same command again to finish the merge",
    "features": "run the same command again to resume from the last checkpoint",
    "push": "run the same command again: files already on the Hub are not sent again",
    "pull": "run the same command again: files already here are not fetched again",
    "import-saelens": "run the same command again to resume from the last checkpoint (--overwrite starts over)",
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:  # a first look: the commands, not an error
        parser.print_help()
        return 0
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the command's own parser: its usage, and the option a typo was meant to be
        command = _subcommands(parser).choices[args.command]
        command.error(_unrecognized(command, extra))
    try:
        with messages_shown():  # what a command says; the library alone is quiet
            return int(args.func(args) or 0)
    except LmprobeError as exc:
        # the user's input or environment: one line that says what to do; anything else is a bug
        # and keeps its traceback
        text = escape_controls(hide_credentials(exc), keep_newlines=False)  # an endpoint's user:key@ never shows
        print(f"lmprobe {args.command}: error: {text}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        hint = _RESUMES.get(args.command, "nothing was left half-written; run the command again")
        print(f"lmprobe {args.command}: interrupted; {hint}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
