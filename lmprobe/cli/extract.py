"""The command line's extraction: ``extract`` and ``hookpoints``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from .. import api
from ..api import ExtractionConfig
from ..base.display import escape_controls
from .options import add_settings, add_token_option


def cmd_extract(args: argparse.Namespace) -> int:
    cfg = ExtractionConfig(**{name: getattr(args, name) for name in ExtractionConfig.field_names()})
    if args.dry_run is not None:
        return show_plan(cfg, args.dry_run, token=args.token)
    outcome = api.run_extraction(cfg, token=args.token)
    ds = outcome.dataset
    if outcome.wrote and not cfg.quiet:  # else the runner said it had nothing to do
        print(f"wrote {api.rows_text(ds, corpus=cfg.corpus)} ({ds.storage}, {ds.dtype}) to {cfg.out}")
    return 0


def show_plan(cfg: ExtractionConfig, form: str, *, token: str | None = None) -> int:
    """``--dry-run``: the job's plan (text or one JSON object) on stdout; exit 1 when the plan is refused."""
    plan = api.plan(cfg.model, cfg.prompts, out=cfg.out, token=token, **{name: getattr(cfg, name) for name in
                                                               ExtractionConfig.field_names()
                                                               if name not in ("model", "prompts", "out")})
    print(json.dumps(plan.as_json()) if form == "json" else escape_controls(plan.describe()))
    return 1 if plan.refused else 0


def cmd_hookpoints(args: argparse.Namespace) -> int:
    arch = api.hookpoints(args.model, revision=args.revision, trust_remote_code=args.trust_remote_code,
                          block_path=args.block_path)
    print(escape_controls(arch.describe()))
    return 0


def add_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    """Add this group's subcommands through ``command(name, **kwargs)`` (the parser's add_parser)."""
    p = command(
        "extract",
        help="run a model over prompts and write an lmprobe dataset",
        description="Run MODEL over the prompts in SOURCE and store hidden states (and optionally top-k logits and "
        "perplexity) as an lmprobe dataset in DIR. Re-running after an interruption resumes.",
    )
    groups = add_settings(p, ExtractionConfig, {
        "model": "model", "input": "input", "corpus": "corpus extraction (one row per window of a long text)",
        "store": "what to store", "output": "output", "plan": "the job's plan (--dry-run)",
        "publishing": "publishing"})
    groups["plan"].add_argument(
        "--dry-run", nargs="?", const="text", choices=["text", "json"], default=None,
        help="print the job's plan (files, folders, shard size, index, staging disk per node, model placement, Hub "
        "commits and the tail) without loading the weights, and exit (1 when the plan is refused); json: one object")
    add_token_option(groups["publishing"])  # the token is no setting: it is never stored
    p.set_defaults(func=cmd_extract)

    p = command("hookpoints", help="show where each named hookpoint is on every block of a model",
                description="Examine MODEL as `extract` does before the weights load (a miniature with random weights) "
                "and print, for each kind of block, how each named hookpoint is read or why it does not exist there.")
    p.add_argument("--model", required=True, help="local model folder, Hub id, or lmprobe-tiny (the embedded model)")
    p.add_argument("--revision", default=None, help="model revision (branch, tag or commit) on the Hub")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model repo's own Python code to run")
    p.add_argument("--block-path", default=None, help="attribute path of the decoder block list (default: found)")
    p.set_defaults(func=cmd_hookpoints)
