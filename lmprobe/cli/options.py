"""Options and helpers several command groups share."""

from __future__ import annotations

import argparse
import inspect
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import Any, Literal

from .. import api
from ..base.fields import cli_of, command_line_text, field_docs
from ..base.layers import parse_layers


def default_of(func: Callable[..., Any], name: str) -> Any:
    """The default of ``func``'s parameter ``name``: an option takes the default of the API function it feeds,
    written once there (``--workers`` is ``push_to_hub``'s ``workers``), never a literal of the command line's."""
    return inspect.signature(func).parameters[name].default


def stored_layers(spec: str | None, stored: list[int]) -> list[int] | None:
    """--layers against the layers a dataset stores (negative indices count from the last one); None: all."""
    if spec in (None, "all"):
        return None
    return parse_layers(spec, max(stored) + 1, of=f"the dataset (layers {stored})")


def add_cache_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache", default=None, metavar="SIZE",
                   help="for a remote dataset (Hub, s3://): local disk for its files, e.g. 50GiB; least recently "
                   "read files are deleted first (default: the smaller of 20 GiB and half the free space)")


def add_token_option(p: Any) -> None:
    p.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or the saved login); never printed")


def add_quiet_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress bars or messages")


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def open_source(path: str, cache: str | None, quiet: bool, check: Callable[[Any], object] | None = None) -> Any:
    """A dataset for a command that reads it whole (``lmprobe.api.open_dataset``): a remote one through a bounded
    cache, said on stderr once ``check(ds)`` has passed."""
    return api.open_dataset(path, cache=cache, quiet=quiet, check=check)


def hookpoint_list(text: str | None) -> list[str] | None:
    """``--hookpoints a,b`` as a list (None: not given, every stored one)."""
    return [h.strip() for h in text.split(",") if h.strip()] if text else None


def add_settings(parser: argparse.ArgumentParser, settings: type, groups: dict[str, str]) -> dict[str, Any]:
    """Add an option for every field of the dataclass ``settings``, from the field itself: its name (``--batch-size``),
    its type (a Literal gives choices, an int a positive integer, a bool a flag: ``--no-NAME`` when it is on by
    default), its default, its docstring as the help, and its ``option(group=...)``: ``groups`` maps those to the
    headings of ``--help``, in order. The settings are written once, in the dataclass (base/fields.py). Returns
    the argument groups by key, for options of the command's own."""
    docs, hints = field_docs(settings), typing.get_type_hints(settings)
    sections = {key: parser.add_argument_group(title) for key, title in groups.items()}
    for f in fields(settings):
        cli = cli_of(f)
        help_text = _help_line(command_line_text(docs[f.name]))
        kind, choices = _kind(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": f.name}
        if f.default is MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = f.default
        if kind is bool and f.default is True:
            flag = "--no-" + f.name.replace("_", "-")
            kwargs.update(action="store_false", help=f"{help_text}; on by default, this flag turns it off")
        elif kind is bool:
            kwargs.update(action="store_true", help=help_text)
        else:
            kwargs.update(help=help_text, metavar=cli.metavar)
            if choices:
                kwargs.update(choices=choices, metavar=None)
            elif kind is int:
                kwargs["type"] = positive_int
            elif kind is float:
                kwargs["type"] = seconds
        sections[cli.group].add_argument(flag, **kwargs)
    return sections


def _help_line(doc: str) -> str:
    """A docstring sentence in the command line's style: lower case first, no final period (``--help`` adds the
    default after it)."""
    if len(doc) > 1 and not doc[1].isupper():
        doc = doc[0].lower() + doc[1:]
    return doc.removesuffix(".")


def _kind(hint: Any) -> tuple[type, list[str] | None]:
    """What a field's type asks of the command line: (bool, None), (int, None), (float, None), (str, choices) or
    (str, None), from hints such as ``int | None``, ``Literal["a", "b"] | None`` or ``bool | Literal["local"]``."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    args = tuple(a for a in args if a is not type(None))
    if bool in args:
        return bool, None
    if len(args) == 1 and typing.get_origin(args[0]) is Literal:
        return str, [str(v) for v in typing.get_args(args[0])]
    if args in ((int,), (float,)):
        return args[0], None
    return str, None  # sizes, counts such as 50M and layer lists: the settings parse them


def seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return v
