"""The command line's other formats: ``export-saev``, ``export-saelens``, ``import-saelens``, ``export-sae``, ``sae-topk``."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import api
from ..sae import export_sae
from ..saelens import choose_hook, export_saelens, import_saelens
from ..saev import compat_mode, export_saev
from .options import (
    add_cache_option,
    add_quiet_option,
    add_token_option,
    default_of,
    open_source,
    positive_int,
    stored_layers,
)


def cmd_export_saev(args: argparse.Namespace) -> int:
    compat_mode(args.saev_compat)  # an unknown version fails before the source is opened
    ds = open_source(args.source, args.cache, args.quiet)
    layers = stored_layers(args.layers, ds.layers)
    folder = export_saev(ds, args.out, layers=layers, context_len=args.context_len,
                         patches_per_shard=args.patches_per_shard, drop_first_token=args.drop_first_token,
                         tokens=False if args.no_tokens else None, saev_compat=args.saev_compat,
                         hookpoint=args.hookpoint, quiet=args.quiet)
    if args.push:
        where = api.publish_attachment(args.push, folder, "saev", token=args.token, quiet=args.quiet)
        if not args.quiet:
            print(f"published {folder.name} to {args.push} under {where}/ (index and card updated)")
    return 0


def cmd_export_saelens(args: argparse.Namespace) -> int:
    def check(ds: Any) -> None:  # a missing --layer is said before the cache line and any download
        choose_hook(ds, args.source, layer=args.layer, hookpoint=args.hookpoint)

    export_saelens(open_source(args.source, args.cache, args.quiet, check), args.out, layer=args.layer,
                   hookpoint=args.hookpoint, context_len=args.context_len, tokens=False if args.no_tokens else None,
                   windows=args.windows, quiet=args.quiet)
    return 0


def cmd_import_saelens(args: argparse.Namespace) -> int:
    import_saelens(args.cache, args.out, model_name=args.model_name, revision=args.revision, token=args.token,
                   overwrite=args.overwrite, quiet=args.quiet)
    return 0


def cmd_export_sae(args: argparse.Namespace) -> int:
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
        where = api.publish_attachment(args.push, Path(args.root) / args.dict, "sae", token=args.token)
        print(f"published dictionary {args.dict} to dataset {args.push} under {where}/ (index and card updated)")
    elif args.push:
        print(api.push_dictionary(args.root, args.dict, args.push, token=args.token, quiet=False))
    return 0


def cmd_sae_topk(args: argparse.Namespace) -> int:
    found = api.top_features(args.root, args.dictionary, args.layer, k=args.topk, dataset=args.dataset, prompt=args.prompt,
                         seed=args.seed, device=args.device, scores=args.scores)
    print("\n".join(found.lines()))
    return 0


def add_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    """Add this group's subcommands through ``command(name, **kwargs)`` (the parser's add_parser)."""
    p = command("export-saev", help="export a full_sequence dataset to the saev sharded activation protocol")
    p.add_argument("source", metavar="SOURCE", help="lmprobe full_sequence dataset (folder or Hub repo)")
    p.add_argument("--out", required=True, metavar="DUMP_TO", help="writes DUMP_TO/<HASH>/")
    p.add_argument("--layers", default=None, help="layers to export: all (every stored layer), '16', '0,8,-1' "
                   "(default: all)")
    p.add_argument("--hookpoint", default=None, help="stored hookpoint to export (default: what hidden_layers holds)")
    add_cache_option(p)
    p.add_argument("--context-len", type=positive_int, default=default_of(export_saev, "context_len"),
                   metavar="T", help="tokens per example")
    p.add_argument("--patches-per-shard", type=positive_int, default=default_of(export_saev, "patches_per_shard"),
                   metavar="N",
                   help="vectors per shard budget (default 2,400,000: ~10 GiB at d_model 1024)")
    p.add_argument("--drop-first-token", action="store_true", help="leave out each prompt's first token (e.g. BOS)")
    p.add_argument("--no-tokens", action="store_true",
                   help="do not write tokens.bin (written by default when the source stores token ids)")
    p.add_argument("--saev-compat", nargs="?", const="2.0", default=None, metavar="VERSION",
                   help="write what saev's own loaders read: 2.0 (alone: saev e43e7dd) or 2.1 (saev 3d73f1f); "
                   "--out must end in saev/shards; see docs/saev.md")
    p.add_argument("--push", default=None, metavar="REPO",
                   help="publish the export into this dataset repo under saev/<HASH>/ (the dataset must be there)")
    add_token_option(p)
    add_quiet_option(p)
    p.set_defaults(func=cmd_export_saev)

    p = command("export-saelens", help="write a full_sequence dataset as a SAELens activation cache")
    p.add_argument("source", metavar="SOURCE", help="lmprobe full_sequence dataset (folder or Hub repo)")
    p.add_argument("--out", required=True, metavar="DIR", help="a new or empty folder (cached_activations_path)")
    p.add_argument("--layer", type=int, default=None, help="the layer to write (needed when the source stores several)")
    p.add_argument("--hookpoint", default=None, help="stored hookpoint to write (default: what hidden_layers holds)")
    p.add_argument("--context-len", type=positive_int, default=None, metavar="T",
                   help="tokens per window (default: the longest stored prompt's)")
    p.add_argument("--windows", choices=["pack", "exact"], default=default_of(export_saelens, "windows"),
                   help="pack: every stored token in index order, cut into windows of T (as SAELens packs a corpus; "
                   "only the last partial window is left out); exact: one window per prompt of exactly T tokens, "
                   "the others left out")
    p.add_argument("--no-tokens", action="store_true", help="leave out token_ids (written when the source has them)")
    add_cache_option(p)
    add_quiet_option(p)
    p.set_defaults(func=cmd_export_saelens)

    p = command("import-saelens", help="write a SAELens activation cache (folder or Hub repo) as a dataset")
    p.add_argument("cache", metavar="CACHE", help="a SAELens cache folder, or a Hub dataset repo (owner/name)")
    p.add_argument("--out", required=True, metavar="DIR", help="the lmprobe dataset to write (an interrupted "
                   "import is resumed by the same command)")
    p.add_argument("--model-name", default=None, help="the model to record (default: the runner config's, else unknown)")
    p.add_argument("--revision", default=None, help="Hub revision of CACHE")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset (or a partial import of another "
                   "cache) in DIR")
    add_token_option(p)
    add_quiet_option(p)
    p.set_defaults(func=cmd_import_saelens)
    _add_dictionary_commands(command)


def _add_dictionary_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    """export-sae and sae-topk: a trained SAE as a sparse dictionary, and its top features."""
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
    p.add_argument("--orientation", choices=["auto", "in_out", "out_in"], default=default_of(export_sae, "orientation"),
                   help="in_out: [hidden, features] (SAELens); out_in: [features, hidden] (nn.Linear); auto: from the bias")
    p.add_argument("--model-revision", default=None, help="commit hash of the model (recorded as model_hash)")
    p.add_argument("--model-config", default=None, help="config.json of the model (its sha256 becomes model_hash)")
    p.add_argument("--file-format", choices=["npz", "safetensors"], default=default_of(export_sae, "file_format"),
                   help="file format of the weights")
    p.add_argument("--activation", default=None, metavar="RULE",
                   help="the SAE's activation rule for a .safetensors/.npz file: relu (default), topk:K, groupmax:K, "
                   "jumprelu or batchtopk:THRESHOLD (a SAELens or sparsify save records its own)")
    p.add_argument("--push", default=None, metavar="REPO", help="publish the dictionary to this Hub repo")
    p.add_argument("--repo-type", choices=["model", "dataset"], default=default_of(api.push_dictionary, "repo_type"),
                   help="model: REPO/<dict>/; dataset: beside a dataset, under sae/<dict>/, index updated")
    add_token_option(p)
    p.set_defaults(func=cmd_export_sae)

    p = command("sae-topk", help="print the top SAE features of a probe vector (smoke test)",
                description="Load one layer of a dictionary and print its top features for a probe vector (also "
                "`python -m lmprobe.sae ARGS`).")
    p.add_argument("--root", required=True, help="folder holding dictionaries, or hf://OWNER/NAME (a model repo)")
    p.add_argument("--dict", required=True, dest="dictionary", help="dictionary name (a folder under --root)")
    p.add_argument("--layer", required=True, type=int, help="the layer of the dictionary to load (-1: its last)")
    p.add_argument("--topk", type=positive_int, default=default_of(api.top_features, "k"), help="features to print")
    p.add_argument("--dataset", default=None, help="take the probe vector from this lmprobe dataset (path or repo)")
    p.add_argument("--prompt", type=int, default=default_of(api.top_features, "prompt"),
                   help="with --dataset: the prompt (index row) to use")
    p.add_argument("--seed", type=int, default=default_of(api.top_features, "seed"),
                   help="seed of the random probe vector")
    p.add_argument("--device", default=default_of(api.top_features, "device"),
                   help="auto (cuda when available), cpu, cuda or cuda:N")
    p.add_argument("--scores", action="store_true",
                   help="rank raw scores W x + b (the dictionary format's projection) instead of the SAE's "
                   "activations under its recorded rule (relu, top-k, JumpReLU)")
    p.set_defaults(func=cmd_sae_topk)
