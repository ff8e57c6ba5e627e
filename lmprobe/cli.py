"""The ``lmprobe`` command line: argument parsing only; every command calls the Python API."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import api, summary
from .demo import write_demo
from .display import escape_controls, hide_credentials
from .errors import InvalidArgumentError, LmprobeError
from .extraction.config import ExtractionConfig
from .extraction.runner import execute, rows_text
from .layers import parse_layers
from .opening import is_remote, load
from .probe import plot_sweep, sweep
from .publish.attachments import publish_attachment
from .publish.dictionary import push_dictionary
from .sae.cli import add_topk_arguments, run_topk
from .sae.export import export_sae
from .sae.loader import is_dictionary_folder, validate_dictionary
from .saelens import export_saelens, import_saelens
from .saev import compat_mode, export_saev, is_saev_folder, validate_saev
from .storage.cache import cache_budget
from .storage.hub import check_repo_id
from .units import parse_count
from .version import __version__


def _cmd_validate(args: argparse.Namespace) -> int:
    worst = 0
    for path in args.paths:
        problems, kind = None, ""
        if is_saev_folder(path):
            problems, kind = validate_saev(path, check_sizes=True), "saev"
        elif is_dictionary_folder(path):
            problems, kind = validate_dictionary(Path(path).parent, Path(path).name), "SAE dictionary"
        if problems is not None:
            print(f"{path}: {kind} {'OK' if not problems else 'INVALID'} ({len(problems)} problem(s))")
            for p in problems:
                print(f"  error: {escape_controls(p, keep_newlines=False)}")
            worst = max(worst, 1 if problems else 0)
            continue
        summary.check_not_a_dump_folder(path, "validate")
        report = api.validate(path, checksums=not args.no_checksums)
        print(escape_controls(report))
        if not report.ok or (args.strict and report.warnings):
            worst = 1
    return worst


def _cmd_hookpoints(args: argparse.Namespace) -> int:
    arch = api.hookpoints(args.model, revision=args.revision, trust_remote_code=args.trust_remote_code,
                          block_path=args.block_path)
    print(escape_controls(arch.describe()))
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    text = summary.artefact_text(args.path) if not is_remote(args.path) else None  # a saev export, a dictionary
    if text is None:
        summary.check_not_a_dump_folder(args.path, "info")
        text = summary.text(load(args.path), path=args.path)
    print(text)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    path = write_demo(args.out, overwrite=args.overwrite)
    print(f"wrote a synthetic demo dataset to {path}")
    return _cmd_info(argparse.Namespace(path=str(path)))


def _cmd_extract(args: argparse.Namespace) -> int:
    if args.push:
        check_repo_id(args.push)  # before hours of extraction, not after
        if "://" in str(args.out):
            raise InvalidArgumentError(f"--push publishes the local folder --out names, and --out {args.out} is not "
                                       f"one; write straight to the Hub with --out hf://datasets/{args.push} instead")
    settings = {name: getattr(args, name) for name in ExtractionConfig.field_names() if hasattr(args, name)}
    cfg = ExtractionConfig(**settings, statistics=not args.no_statistics)
    outcome = execute(cfg)
    ds = outcome.dataset
    if outcome.wrote and not args.quiet:  # else the runner said it had nothing to do
        print(f"wrote {rows_text(ds, corpus=cfg.corpus)} ({ds.storage}, {ds.dtype}) to {args.out}")
    if args.push:
        api.push_to_hub(args.out, args.push, private=args.private, token=args.token, quiet=args.quiet)
    return 0


def _cmd_push(args: argparse.Namespace) -> int:
    api.push_to_hub(args.path, args.repo, private=args.private, revision=args.revision, token=args.token, quiet=args.quiet,
                    saev=args.saev, sae=args.sae, workers=args.workers, commit_deadline=args.commit_deadline)
    return 0


def _cmd_pull(args: argparse.Namespace) -> int:
    layers = None
    if args.layers not in (None, "all") and args.only in (None, "dataset"):
        layers = _stored_layers(args.layers, load(args.repo, revision=args.revision, token=args.token).layers)
    hookpoints = [h.strip() for h in args.hookpoints.split(",") if h.strip()] if args.hookpoints else None
    api.pull(args.repo, args.out, layers=layers, hookpoints=hookpoints, logits=not args.no_logits, revision=args.revision,
             token=args.token, quiet=args.quiet, only=args.only, overwrite=args.overwrite)
    return 0


def _cmd_export_sae(args: argparse.Namespace) -> int:
    report = export_sae(
        args.source,
        layer=args.layer,
        root=args.root,
        dictionary=args.dict,
        threshold=args.threshold,
        topk_per_feature=args.topk_per_feature,
        weight_key=args.weight_key,
        bias_key=args.bias_key,
        b_dec_key=args.b_dec_key,
        hookpoint=args.hookpoint,
        orientation=args.orientation,
        model_revision=args.model_revision,
        model_config=args.model_config,
        file_format=args.file_format,
        activation=args.activation,
    )
    print(report)
    if args.push and args.repo_type == "dataset":
        where = publish_attachment(args.push, Path(args.root) / args.dict, "sae", token=args.token)
        print(f"published dictionary {args.dict} to dataset {args.push} under {where}/ (index and card updated)")
    elif args.push:
        print(push_dictionary(args.root, args.dict, args.push, token=args.token, quiet=False))
    return 0


def _open_source(path: str, cache: str | None, quiet: bool) -> Any:
    """A dataset for a command that reads it whole: a remote one through a bounded cache (said on stderr)."""
    if not is_remote(path):
        return load(path)
    return load(path, cache=cache_budget(cache, path, announce=not quiet))


def _cmd_export_saelens(args: argparse.Namespace) -> int:
    export_saelens(_open_source(args.source, args.cache, args.quiet), args.out, layer=args.layer,
                   hookpoint=args.hookpoint, context_len=args.context_len, tokens=False if args.no_tokens else None,
                   windows=args.windows, quiet=args.quiet)
    return 0


def _cmd_import_saelens(args: argparse.Namespace) -> int:
    import_saelens(args.cache, args.out, model_name=args.model_name, revision=args.revision, token=args.token,
                   overwrite=args.overwrite, quiet=args.quiet)
    return 0


def _cmd_export_saev(args: argparse.Namespace) -> int:
    compat_mode(args.saev_compat)  # an unknown version fails before the source is opened
    ds = _open_source(args.source, args.cache, args.quiet)
    layers = _stored_layers(args.layers, ds.layers)
    folder = export_saev(ds, args.out, layers=layers, context_len=args.context_len,
                         patches_per_shard=args.patches_per_shard, drop_first_token=args.drop_first_token,
                         tokens=False if args.no_tokens else None, saev_compat=args.saev_compat,
                         hookpoint=args.hookpoint, quiet=args.quiet)
    if args.push:
        where = publish_attachment(args.push, folder, "saev", token=args.token, quiet=args.quiet)
        if not args.quiet:
            print(f"published {folder.name} to {args.push} under {where}/ (index and card updated)")
    return 0


def _cmd_probe(args: argparse.Namespace) -> int:
    ds = load(args.dataset)
    layers = _stored_layers(args.layers, ds.layers)
    hookpoints = [h.strip() for h in args.hookpoints.split(",") if h.strip()] if args.hookpoints else None
    table = sweep(ds, layers=layers, label_column=args.label_column, classifier=args.classifier, cv=args.cv,
                  pooling=args.pooling, seed=args.seed, hookpoints=hookpoints)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    best = table.loc[table["accuracy"].idxmax()]
    where = f"{best['hookpoint']} " if "hookpoint" in table.columns else ""
    print(f"best {where}layer {int(best['layer'])}: accuracy {best['accuracy']:.3f} +- {best['accuracy_std']:.3f} "
          f"({args.cv}-fold, {args.classifier}, {args.pooling})")
    if args.plot:
        plot_sweep(table, args.plot, title=f"{ds.model.get('name')}: {args.label_column} probe")
        print(f"wrote {args.plot}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    path = api.report(_open_source(args.dataset, args.cache, args.quiet), args.out, prompts=args.prompts, sample=args.sample, tokenizer=args.tokenizer,
                      probe=not args.no_probe, quiet=args.quiet)
    if not args.quiet:  # the library says nothing: this is the one line
        print(f"wrote {path}")
    return 0


def _cmd_features(args: argparse.Namespace) -> int:
    out = api.features(_open_source(args.dataset, args.cache, args.quiet), args.sae, args.dict, args.layer, args.out, top=args.top,
                       hookpoint=args.hookpoint, memory=args.memory, pages=args.pages, tokenizer=args.tokenizer,
                       overwrite=args.overwrite, report=args.report, quiet=args.quiet)
    if not args.quiet:
        print(f"wrote {out / 'features.safetensors'}, {out / 'manifest.json'} and the browser {out / 'index.html'}")
    return 0


def _cmd_merge(args: argparse.Namespace) -> int:
    api.merge(args.parts, args.out, overwrite=args.overwrite)
    print(f"merged {len(args.parts)} datasets into {args.out}")
    return 0


def _cmd_sae_topk(args: argparse.Namespace) -> int:
    return run_topk(args)


def _stored_layers(spec: str | None, stored: list[int]) -> list[int] | None:
    """--layers against the layers a dataset stores (negative indices count from the last one); None: all."""
    if spec in (None, "all"):
        return None
    return parse_layers(spec, max(stored) + 1, of=f"the dataset (layers {stored})")


def _count(text: str) -> int:
    try:
        return parse_count(text)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_cache_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache", default=None, metavar="SIZE",
                   help="for a remote dataset (Hub, s3://): local disk for its files, e.g. 50GiB; least recently "
                   "read files are deleted first (default: the smaller of 20 GiB and half the free space)")


def _add_token_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or the saved login); never printed")


def _add_quiet_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress bars or messages")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


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

    p = command(
        "extract",
        help="run a model over prompts and write an lmprobe dataset",
        description="Run MODEL over the prompts in SOURCE and store hidden states (and optionally top-k logits and "
        "perplexity) as an lmprobe dataset in DIR. Re-running after an interruption resumes.",
    )
    g = p.add_argument_group("model")
    g.add_argument("--model", required=True, help="local model folder, Hub id, or lmprobe-tiny (the embedded model)")
    g.add_argument("--revision", default=None, help="model revision (branch, tag or commit) on the Hub (default: main)")
    g.add_argument("--trust-remote-code", action="store_true", help="allow the model repo's own Python code to run")
    g.add_argument("--block-path", default=None,
                   help="attribute path of the decoder block list, for unknown architectures (default: found by name)")
    g.add_argument("--backend", choices=["transformers", "nnsight"], default="transformers",
                   help="transformers: hooks on a local model; nnsight: an nnsight trace")
    g.add_argument("--remote", action="store_true",
                   help="with --backend nnsight: run on NDIF (API key from NNSIGHT_API_KEY or nnsight's config)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--compute-dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                   help="dtype the model runs in (auto: float32 on CPU, the checkpoint's dtype on GPU)")
    g.add_argument("--batch-size", type=_positive_int, default=8, metavar="N", help="prompts per forward pass")
    g.add_argument("--max-length", type=_positive_int, default=None, metavar="N",
                   help="longest prompt in tokens (default: the model's)")
    g.add_argument("--truncate", choices=["left", "right"], default=None,
                   help="cut prompts longer than --max-length (left keeps the end) instead of failing (default: fail)")
    g = p.add_argument_group("input")
    g.add_argument("--prompts", required=True, metavar="SOURCE",
                   help="a .jsonl, .csv, .tsv, .parquet or .txt file (one per line), a folder of them, or a Hugging Face "
                   "dataset (hf://datasets/OWNER/NAME or OWNER/NAME)")
    g.add_argument("--text-column", default="text", help="column of SOURCE that holds the prompt text")
    g.add_argument("--label-column", default="label", help="label column (int or string); optional when 'label'")
    g.add_argument("--dataset-config", default=None, metavar="NAME", help="configuration of a Hugging Face dataset source")
    g.add_argument("--split", default="train", help="split of a Hugging Face dataset source")
    g.add_argument("--chat-template", action="store_true",
                   help="wrap each prompt in the tokenizer's chat template; store only the prompt's own tokens")
    g = p.add_argument_group("corpus extraction (one row per window of a long text)")
    g.add_argument("--context-len", type=_positive_int, default=None, metavar="T",
                   help="cut every document into windows of at most T tokens, one row each (default: the model's "
                   "length when --max-tokens is given)")
    g.add_argument("--max-tokens", type=_count, default=None, metavar="N",
                   help="stop at exactly N stored tokens, e.g. 50M (windows of the model's length unless --context-len)")
    g.add_argument("--no-special-tokens", dest="special_tokens", action="store_false",
                   help="add no special tokens (BOS, ...) to the windows")
    g = p.add_argument_group("what to store")
    g.add_argument("--layers", default="all", help="'all', '0,3,-1', ranges like '10:20' (Python slice: 10..19)")
    g.add_argument("--hookpoints", default="resid_post",
                   help="where in each block to read, a comma list: resid_pre, attn_out, resid_mid, mlp_in, mlp_out, "
                   "resid_post, or a module path in the block with :input/:output, e.g. mlp.act_fn:output")
    g.add_argument("--storage", choices=["pooled", "full_sequence"], default="pooled",
                   help="pooled: last token only; full_sequence: every token")
    g.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32", help="stored dtype")
    g.add_argument("--logits-topk", type=_positive_int, default=None, metavar="K",
                   help="store the top-K logits at the last token (default: none)")
    g.add_argument("--perplexity", action="store_true", help="store per-prompt and per-token perplexity")
    g.add_argument("--token-strings", action="store_true", help="store decoded tokens (and token ids)")
    g.add_argument("--token-ids", action="store_true", help="store token ids")
    g.add_argument("--drop-special-tokens", action="store_true",
                   help="do not store the tokenizer's special tokens (BOS, EOS, ...); the model still sees them")
    g.add_argument("--no-statistics", action="store_true",
                   help="skip the running per-layer statistics (count, mean, std, mean norm)")
    g = p.add_argument_group("output")
    g.add_argument("--out", required=True, metavar="DIR", help="dataset folder to write (or to resume)")
    g.add_argument("--shard-size", default="1GiB", help="shard byte budget, e.g. 512MB, 1GiB (16GiB at most)")
    g.add_argument("--checkpoint-interval", type=float, default=30.0, metavar="SECONDS",
                   help="seconds between checkpoints: at most this much work is redone after an interruption")
    g.add_argument("--no-space-check", dest="space_check", action="store_false",
                   help="start even when the output's disk has less free space than the planned bytes")
    g.add_argument("--overwrite", action="store_true", help="replace an existing or partial output instead of resuming")
    g.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    g = p.add_argument_group("publishing")
    g.add_argument("--push", default=None, metavar="REPO", help="publish the dataset to this Hub dataset repo when done")
    g.add_argument("--private", action="store_true", help="with --push: create the repo private")
    g.add_argument("--token", default=None, help="with --push: Hub token (default: HF_TOKEN or the saved login)")
    p.set_defaults(func=_cmd_extract)

    p = command("push", help="publish a dataset folder to a Hub dataset repo (resumable)")
    p.add_argument("path", metavar="DIR", help="the dataset folder")
    p.add_argument("repo", metavar="REPO", help="OWNER/NAME of the dataset repo (created if needed)")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--revision", default=None, metavar="BRANCH", help="push to this branch (created if needed; "
                   "default: main)")
    _add_token_option(p)
    p.add_argument("--saev", action="append", default=[], metavar="FOLDER",
                   help="also publish this saev export (copied into DIR/saev/<HASH>/); repeatable")
    p.add_argument("--sae", action="append", default=[], metavar="FOLDER",
                   help="also publish this SAE dictionary folder (copied into DIR/sae/<name>/); repeatable")
    p.add_argument("--workers", type=_positive_int, default=8, metavar="N",
                   help="files uploading at the same time, while earlier ones are committed")
    p.add_argument("--commit-deadline", type=float, default=3600.0, metavar="SECONDS",
                   help="how long a request refused by the Hub's rate limit (429) keeps being retried")
    _add_quiet_option(p)
    p.set_defaults(func=_cmd_push)

    p = command("pull", help="copy the index and some layers of a Hub dataset to a local folder")
    p.add_argument("repo", metavar="REPO", help="OWNER/NAME or hf://datasets/OWNER/NAME")
    p.add_argument("--out", required=True, metavar="DIR", help="a new or empty folder, or an earlier pull of REPO "
                   "(a re-run resumes; more --layers extend it)")
    p.add_argument("--layers", default="all", help="layers to fetch: all, '16', '0,8,-1', '10:20'")
    p.add_argument("--hookpoints", default=None, help="hookpoints to fetch, a comma list (default: all stored)")
    p.add_argument("--no-logits", action="store_true", help="do not fetch the logits shards")
    p.add_argument("--only", default=None, metavar="PART",
                   help="dataset (default), saev, sae, or a path such as saev/<HASH>: fetch just that part")
    p.add_argument("--revision", default=None, help="branch, tag or commit of the dataset repo (default: main)")
    p.add_argument("--overwrite", action="store_true", help="replace an lmprobe dataset in DIR that is not a copy "
                   "of REPO (a local extraction, a copy of another repo)")
    _add_token_option(p)
    _add_quiet_option(p)
    p.set_defaults(func=_cmd_pull)

    p = command("merge", help="combine datasets made by independent jobs with the same model and settings")
    p.add_argument("parts", nargs="+", metavar="PART", help="dataset folders, in the order their prompts should appear")
    p.add_argument("--out", required=True, metavar="DIR", help="folder of the merged dataset (shards are linked, "
                   "not copied)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset in DIR")
    p.set_defaults(func=_cmd_merge)

    p = command("probe", help="cross-validated linear probes per layer, as a table and a plot")
    p.add_argument("dataset", metavar="DATASET", help="dataset folder or Hub repo")
    p.add_argument("--layers", default="all", help="layers to probe: all, '16', '0,8,-1', '10:20'")
    p.add_argument("--label-column", default="label", help="index column holding the class of each prompt")
    p.add_argument("--classifier", choices=["logistic", "ridge"], default="logistic",
                   help="logistic regression or a ridge classifier (scikit-learn)")
    p.add_argument("--cv", type=_positive_int, default=5, metavar="K", help="cross-validation folds")
    p.add_argument("--pooling", choices=["last_token", "mean"], default="last_token",
                   help="the vector of a prompt: its last token, or the mean of its tokens (needs a full_sequence "
                   "dataset)")
    p.add_argument("--hookpoints", default=None, help="sweep these stored hookpoints too, a comma list "
                   "(default: what hidden_layers holds)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fold split and the classifier")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="write accuracy against layer to this image (default: no plot)")
    p.set_defaults(func=_cmd_probe)

    p = command("report", help="a self-contained HTML page about a dataset: facts, plots, prompts, labels")
    p.add_argument("dataset", metavar="DATASET", help="dataset folder, Hub repo or fsspec URL")
    p.add_argument("--out", required=True, metavar="DIR", help="writes DIR/index.html")
    p.add_argument("--prompts", default=None, metavar="ROWS", help="prompts to show besides the sample, e.g. 3,17 "
                   "(default: none)")
    p.add_argument("--sample", type=int, default=8, metavar="N", help="random prompts to show")
    p.add_argument("--tokenizer", default=None, help="decodes token ids (default: the dataset's model, if it loads)")
    p.add_argument("--no-probe", action="store_true", help="skip the probe sweep of labelled datasets")
    _add_cache_option(p)
    _add_quiet_option(p)
    p.set_defaults(func=_cmd_report)

    p = command("features", help="run an SAE dictionary over every stored token: feature cache and browser")
    p.add_argument("dataset", metavar="DATASET", help="a full_sequence dataset (folder, Hub repo or fsspec URL)")
    p.add_argument("--sae", required=True, metavar="ROOT", help="folder (or hf:// repo) holding the dictionary")
    p.add_argument("--dict", required=True, metavar="NAME", help="dictionary name")
    p.add_argument("--layer", required=True, type=int, help="the dataset's layer the dictionary reads")
    p.add_argument("--hookpoint", default=None, help="stored hookpoint to read (default: hidden_layers')")
    p.add_argument("--out", required=True, metavar="DIR", help="folder of the feature cache and browser")
    p.add_argument("--top", type=_positive_int, default=20, metavar="N", help="top activating tokens kept per feature")
    p.add_argument("--memory", default="512MiB", metavar="SIZE", help="memory for a batch of scores")
    p.add_argument("--pages", type=int, default=None, metavar="N", help="feature pages for the N most frequent "
                   "features (default: every feature that fired)")
    p.add_argument("--tokenizer", default=None, help="decodes token ids (default: the dataset's model, if it loads)")
    p.add_argument("--overwrite", action="store_true", help="recompute a cache made with other settings")
    p.add_argument("--report", default=None, metavar="PAGE",
                   help="the dataset's `lmprobe report` (its folder, index.html or an http(s) URL), linked from every "
                   "page (default: no link)")
    _add_cache_option(p)
    _add_quiet_option(p)
    p.set_defaults(func=_cmd_features)

    p = command("export-saev", help="export a full_sequence dataset to the saev sharded activation protocol")
    p.add_argument("source", metavar="SOURCE", help="lmprobe full_sequence dataset (folder or Hub repo)")
    p.add_argument("--out", required=True, metavar="DUMP_TO", help="writes DUMP_TO/<HASH>/")
    p.add_argument("--layers", default="all", help="layers to export: all (every stored layer), '16', '0,8,-1'")
    p.add_argument("--hookpoint", default=None, help="stored hookpoint to export (default: what hidden_layers holds)")
    _add_cache_option(p)
    p.add_argument("--context-len", type=_positive_int, default=128, metavar="T", help="tokens per example")
    p.add_argument("--patches-per-shard", type=_positive_int, default=2_400_000, metavar="N",
                   help="vectors per shard budget (default 2,400,000: ~10 GiB at d_model 1024)")
    p.add_argument("--drop-first-token", action="store_true", help="leave out each prompt's first token (e.g. BOS)")
    p.add_argument("--no-tokens", action="store_true",
                   help="do not write tokens.bin (written by default when the source stores token ids)")
    p.add_argument("--saev-compat", nargs="?", const="2.0", default=None, metavar="VERSION",
                   help="write what saev's own loaders read: 2.0 (alone: saev e43e7dd) or 2.1 (saev 3d73f1f); "
                   "--out must end in saev/shards; see docs/saev.md")
    p.add_argument("--push", default=None, metavar="REPO",
                   help="publish the export into this dataset repo under saev/<HASH>/ (the dataset must be there)")
    _add_token_option(p)
    _add_quiet_option(p)
    p.set_defaults(func=_cmd_export_saev)

    p = command("export-saelens", help="write a full_sequence dataset as a SAELens activation cache")
    p.add_argument("source", metavar="SOURCE", help="lmprobe full_sequence dataset (folder or Hub repo)")
    p.add_argument("--out", required=True, metavar="DIR", help="a new or empty folder (cached_activations_path)")
    p.add_argument("--layer", type=int, default=None, help="the layer to write (needed when the source stores several)")
    p.add_argument("--hookpoint", default=None, help="stored hookpoint to write (default: what hidden_layers holds)")
    p.add_argument("--context-len", type=_positive_int, default=None, metavar="T",
                   help="tokens per window (default: the longest stored prompt's)")
    p.add_argument("--windows", choices=["pack", "exact"], default="pack",
                   help="pack: every stored token in index order, cut into windows of T (as SAELens packs a corpus; "
                   "only the last partial window is left out); exact: one window per prompt of exactly T tokens, "
                   "the others left out")
    p.add_argument("--no-tokens", action="store_true", help="leave out token_ids (written when the source has them)")
    _add_cache_option(p)
    _add_quiet_option(p)
    p.set_defaults(func=_cmd_export_saelens)

    p = command("import-saelens", help="write a SAELens activation cache (folder or Hub repo) as a dataset")
    p.add_argument("cache", metavar="CACHE", help="a SAELens cache folder, or a Hub dataset repo (owner/name)")
    p.add_argument("--out", required=True, metavar="DIR", help="the lmprobe dataset to write (an interrupted "
                   "import is resumed by the same command)")
    p.add_argument("--model-name", default=None, help="the model to record (default: the runner config's, else unknown)")
    p.add_argument("--revision", default=None, help="Hub revision of CACHE")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset (or a partial import of another "
                   "cache) in DIR")
    _add_token_option(p)
    _add_quiet_option(p)
    p.set_defaults(func=_cmd_import_saelens)

    p = command("export-sae", help="export a trained SAE encoder layer as a sparse dictionary")
    p.add_argument("source", metavar="SOURCE",
                   help="a SAELens save (cfg.json + sae_weights.safetensors), a sparsify save (cfg.json + "
                   "sae.safetensors), a folder holding several of them (pick one with --hookpoint), or a "
                   ".safetensors/.npz file (with --weight-key)")
    p.add_argument("--layer", required=True, type=int, help="the model layer the SAE reads")
    p.add_argument("--root", required=True, help="folder that holds dictionaries")
    p.add_argument("--dict", required=True, help="dictionary name (created if needed; other layers are kept)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--threshold", type=float, default=None, help="keep weights with |w| >= X (default: keep all)")
    group.add_argument("--topk-per-feature", type=int, default=None, metavar="N",
                       help="keep the N largest |w| per feature (default: keep all)")
    p.add_argument("--weight-key", default=None, help="encoder tensor name in a .safetensors/.npz file")
    p.add_argument("--bias-key", default=None, help="encoder bias tensor name (default: no bias)")
    p.add_argument("--b-dec-key", default=None,
                   help="with --weight-key: a decoder bias the SAE subtracts from its input (folded into the bias)")
    p.add_argument("--hookpoint", default=None, metavar="NAME",
                   help="the SAE to export from a folder holding several (its subfolder, e.g. layers.6)")
    p.add_argument("--orientation", choices=["auto", "in_out", "out_in"], default="auto",
                   help="in_out: [hidden, features] (SAELens); out_in: [features, hidden] (nn.Linear); auto: from the bias")
    p.add_argument("--model-revision", default=None, help="commit hash of the model (recorded as model_hash)")
    p.add_argument("--model-config", default=None, help="config.json of the model (its sha256 becomes model_hash)")
    p.add_argument("--file-format", choices=["npz", "safetensors"], default="npz", help="file format of the weights")
    p.add_argument("--activation", default=None, metavar="RULE",
                   help="the SAE's activation rule for a .safetensors/.npz file: relu (default), topk:K, groupmax:K, "
                   "jumprelu or batchtopk:THRESHOLD (a SAELens or sparsify save records its own)")
    p.add_argument("--push", default=None, metavar="REPO", help="publish the dictionary to this Hub repo")
    p.add_argument("--repo-type", choices=["model", "dataset"], default="model",
                   help="model: REPO/<dict>/; dataset: beside a dataset, under sae/<dict>/, index updated")
    _add_token_option(p)
    p.set_defaults(func=_cmd_export_sae)

    p = command("sae-topk", help="print the top SAE features of a probe vector (smoke test)")
    add_topk_arguments(p)
    p.set_defaults(func=_cmd_sae_topk)

    p = command("validate", help="check datasets against the format document")
    p.add_argument("paths", nargs="+", metavar="PATH", help="dataset folder(s)")
    p.add_argument("--no-checksums", action="store_true", help="skip sha256 checks (faster on large datasets)")
    p.add_argument("--strict", action="store_true", help="fail on warnings too")
    p.set_defaults(func=_cmd_validate)

    p = command("hookpoints", help="show where each named hookpoint is on every block of a model",
                description="Examine MODEL as `extract` does before the weights load (a miniature with random weights) "
                "and print, for each kind of block, how each named hookpoint is read or why it does not exist there.")
    p.add_argument("--model", required=True, help="local model folder, Hub id, or lmprobe-tiny (the embedded model)")
    p.add_argument("--revision", default=None, help="model revision (branch, tag or commit) on the Hub")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model repo's own Python code to run")
    p.add_argument("--block-path", default=None, help="attribute path of the decoder block list (default: found)")
    p.set_defaults(func=_cmd_hookpoints)

    p = command("info", help="print a summary of a dataset")
    p.add_argument("path", metavar="PATH", help="dataset folder, Hub repo or fsspec URL")
    p.set_defaults(func=_cmd_info)

    p = command("demo", help="write a small synthetic dataset (no model needed)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write the dataset into")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset in DIR")
    p.set_defaults(func=_cmd_demo)
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
