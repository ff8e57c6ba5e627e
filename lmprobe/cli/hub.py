"""The command line's publishing: ``push`` and ``pull``."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from .. import api
from ..opening import load
from .options import (
    add_quiet_option,
    add_token_option,
    default_of,
    hookpoint_list,
    positive_int,
    stored_layers,
)


def cmd_push(args: argparse.Namespace) -> int:
    api.push_to_hub(args.path, args.repo, private=args.private, revision=args.revision, token=args.token, quiet=args.quiet,
                    saev=args.saev, sae=args.sae, workers=args.workers, commit_deadline=args.commit_deadline)
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    layers = None
    if args.layers not in (None, "all") and args.only in (None, "dataset"):
        layers = stored_layers(args.layers, load(args.repo, revision=args.revision, token=args.token).layers)
    hookpoints = hookpoint_list(args.hookpoints)
    api.pull(args.repo, args.out, layers=layers, hookpoints=hookpoints, logits=not args.no_logits, revision=args.revision,
             token=args.token, quiet=args.quiet, only=args.only, overwrite=args.overwrite)
    return 0


def add_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    """Add this group's subcommands through ``command(name, **kwargs)`` (the parser's add_parser)."""
    p = command("push", help="publish a dataset folder to a Hub dataset repo (resumable)")
    p.add_argument("path", metavar="DIR", help="the dataset folder")
    p.add_argument("repo", metavar="REPO", help="OWNER/NAME of the dataset repo (created if needed)")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--revision", default=None, metavar="BRANCH", help="push to this branch (created if needed; "
                   "default: main)")
    add_token_option(p)
    p.add_argument("--saev", action="append", default=list(default_of(api.push_to_hub, "saev")), metavar="FOLDER",
                   help="also publish this saev export (copied into DIR/saev/<HASH>/); repeatable")
    p.add_argument("--sae", action="append", default=list(default_of(api.push_to_hub, "sae")), metavar="FOLDER",
                   help="also publish this SAE dictionary folder (copied into DIR/sae/<name>/); repeatable")
    p.add_argument("--workers", type=positive_int, default=default_of(api.push_to_hub, "workers"), metavar="N",
                   help="files uploading at the same time, while earlier ones are committed")
    p.add_argument("--commit-deadline", type=float, default=default_of(api.push_to_hub, "commit_deadline"),
                   metavar="SECONDS",
                   help="how long a request refused by the Hub's rate limit (429) keeps being retried")
    add_quiet_option(p)
    p.set_defaults(func=cmd_push)

    p = command("pull", help="copy the index and some layers of a Hub dataset to a local folder")
    p.add_argument("repo", metavar="REPO", help="OWNER/NAME or hf://datasets/OWNER/NAME")
    p.add_argument("--out", required=True, metavar="DIR", help="a new or empty folder, or an earlier pull of REPO "
                   "(a re-run resumes; more --layers extend it)")
    p.add_argument("--layers", default=None, help="layers to fetch: all, '16', '0,8,-1', '10:20' (default: all)")
    p.add_argument("--hookpoints", default=None, help="hookpoints to fetch, a comma list (default: all stored)")
    p.add_argument("--no-logits", action="store_true", help="do not fetch the logits shards")
    p.add_argument("--only", default=None, metavar="PART",
                   help="dataset (default), saev, sae, or a path such as saev/<HASH>: fetch just that part")
    p.add_argument("--revision", default=None, help="branch, tag or commit of the dataset repo (default: main)")
    p.add_argument("--overwrite", action="store_true", help="replace an lmprobe dataset in DIR that is not a copy "
                   "of REPO (a local extraction, a copy of another repo)")
    add_token_option(p)
    add_quiet_option(p)
    p.set_defaults(func=cmd_pull)
