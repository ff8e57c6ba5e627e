"""The command line's datasets as they are: ``merge``, ``validate``, ``info``, ``demo``."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from .. import api
from ..base.display import escape_controls
from ..opening import is_remote
from .options import add_token_option


def cmd_merge(args: argparse.Namespace) -> int:
    api.merge(args.parts, args.out, overwrite=args.overwrite)
    print(f"merged {len(args.parts)} datasets into {args.out}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    worst = 0
    for path in [p for given in args.paths for p in api.artefact_paths(given)]:  # export-saev's --out: its exports
        report = api.validate(path, checksums=not args.no_checksums, full=args.full, token=args.token)
        print(escape_controls(report))
        if isinstance(report, api.ArtefactReport):  # a saev export or an SAE dictionary
            worst = max(worst, 0 if report.ok else 1)
            continue
        if is_remote(path) and not args.full:
            print("  (checked in place: the metadata, the index, every shard's header and size; --full downloads "
                  "every file and checks its sha256)")
        if not report.ok or (args.strict and report.warnings):
            worst = 1
    return worst


def cmd_info(args: argparse.Namespace) -> int:
    print(api.info(args.path))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    path = api.write_demo(args.out, overwrite=args.overwrite)
    print(f"wrote a synthetic demo dataset to {path}")
    return cmd_info(argparse.Namespace(path=str(path)))


def add_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    """Add this group's subcommands through ``command(name, **kwargs)`` (the parser's add_parser)."""
    p = command("merge", help="combine datasets made by independent jobs with the same model and settings")
    p.add_argument("parts", nargs="+", metavar="PART", help="dataset folders, in the order their prompts should appear")
    p.add_argument("--out", required=True, metavar="DIR", help="folder of the merged dataset (shards are linked, "
                   "not copied)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset in DIR")
    p.set_defaults(func=cmd_merge)

    p = command("validate", help="check datasets against the format document")
    p.add_argument("paths", nargs="+", metavar="PATH", help="dataset folder(s), Hub datasets (hf://datasets/OWNER/NAME), saev exports or SAE "
                   "dictionaries")
    p.add_argument("--no-checksums", action="store_true", help="skip sha256 checks (faster on large datasets)")
    p.add_argument("--strict", action="store_true", help="fail on warnings too")
    p.add_argument("--full", action="store_true", help="a Hub dataset: download every file and check its sha256 "
                   "(without it, the metadata, the index and every shard's header and size are checked in place)")
    add_token_option(p)
    p.set_defaults(func=cmd_validate)

    p = command("info", help="print a summary of a dataset")
    p.add_argument("path", metavar="PATH", help="dataset folder, Hub repo or fsspec URL")
    p.set_defaults(func=cmd_info)

    p = command("demo", help="write a small synthetic dataset (no model needed)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write the dataset into")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset in DIR")
    p.set_defaults(func=cmd_demo)
