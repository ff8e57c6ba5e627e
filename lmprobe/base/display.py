"""Printing text that came from a dataset: control characters are shown, never sent to the terminal.

A model name such as ``"evil\\x1b]0;title\\x07\\x1b[2J"`` would set the terminal's title and clear
the screen if printed as it is.
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
#: the user and password part of a URL (``scheme://user:password@``), up to the host
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)[^\s/?#@]*@")


def one_line(text: object) -> str:
    """``str(text)`` on one line, its runs of whitespace (newlines included) made one space: for a third
    party's message inside lmprobe's one-line errors (transformers' and datasets' messages hold newlines)."""
    return " ".join(str(text).split())


def hide_credentials(text: object) -> str:
    """``str(text)`` with the credentials of every URL in it written ``***``.

    An endpoint may carry them (``HF_ENDPOINT=http://user:KEY@host``), and third-party messages
    quote the URL they failed on; neither may print the key.

    >>> hide_credentials("cannot reach http://user:KEY@host:8080/api")
    'cannot reach http://***@host:8080/api'
    """
    return _USERINFO.sub(r"\1***@", str(text))


def escape_controls(text: object, *, keep_newlines: bool = True) -> str:
    """``str(text)`` with control characters (and bidi overrides) written as escapes, e.g. ``\\x1b``."""
    s = str(text)
    if not keep_newlines:
        s = s.replace("\n", "\\n").replace("\t", "\\t")
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), s)
