"""Options and helpers several command groups share."""

from __future__ import annotations

import argparse
from typing import Any

from ..base.layers import parse_layers
from ..base.units import parse_count
from ..errors import InvalidArgumentError
from ..opening import is_remote, load
from ..storage.cache import cache_budget


def stored_layers(spec: str | None, stored: list[int]) -> list[int] | None:
    """--layers against the layers a dataset stores (negative indices count from the last one); None: all."""
    if spec in (None, "all"):
        return None
    return parse_layers(spec, max(stored) + 1, of=f"the dataset (layers {stored})")


def count(text: str) -> int:
    try:
        return parse_count(text)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_cache_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache", default=None, metavar="SIZE",
                   help="for a remote dataset (Hub, s3://): local disk for its files, e.g. 50GiB; least recently "
                   "read files are deleted first (default: the smaller of 20 GiB and half the free space)")


def add_token_option(p: argparse.ArgumentParser) -> None:
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


def open_source(path: str, cache: str | None, quiet: bool) -> Any:
    """A dataset for a command that reads it whole: a remote one through a bounded cache (said on stderr)."""
    if not is_remote(path):
        return load(path)
    return load(path, cache=cache_budget(cache, path, announce=not quiet))


def hookpoint_list(text: str | None) -> list[str] | None:
    """``--hookpoints a,b`` as a list (None: not given, every stored one)."""
    return [h.strip() for h in text.split(",") if h.strip()] if text else None
