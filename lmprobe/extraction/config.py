"""``ExtractionConfig``: every setting of an extraction, checked when it is made.

The command line builds one from its arguments, ``lmprobe.extract`` builds one from its keywords,
and the settings it records (``ExtractionConfig.settings``) are what a re-run compares to decide
whether a partial output can be resumed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Literal

from ..base.fields import option, recorded_of, spec_names_of
from ..base.units import parse_count, parse_size
from ..errors import ExtractionError, InvalidArgumentError
from ..format.dtypes import COMPUTE_DTYPES, HIDDEN_DTYPES
from ..format.resume import RESUMABLE_SETTINGS, same_extraction, settings_fingerprint  # noqa: F401
from ..format.spec import DEFAULT_HOOKPOINT, MAX_SHARD_SIZE, STORAGES
from ..storage.hub import check_repo_id
from ..storage.urls import is_url
from .hookpoints import parse_hookpoints
from .placement import parse_max_memory

BACKENDS = ("transformers", "nnsight")
#: the place of the prompt set's identity (``prompts_sha256``, ``num_prompts``) or the corpus source's in the
#: recorded settings: after the model's (``record=1``, ``2``), before the corpus windows' (``4``..)
_IDENTITY_PLACE = 3


@dataclass(frozen=True)
class ExtractionConfig:
    """What to extract, from which model and prompts, into which output."""

    model: str = option(group="model", metavar="MODEL", record=1)
    """A local model folder, a Hub model id, or ``lmprobe-tiny`` (the model shipped inside lmprobe)."""
    prompts: Any = option(group="input", metavar="SOURCE")
    """A .jsonl, .csv, .tsv, .parquet or .txt file (one prompt a line), a folder of them, or a Hugging Face dataset
    (``hf://datasets/OWNER/NAME`` or ``OWNER/NAME``).

    In Python also a list of strings or dicts, or a pandas DataFrame."""
    out: str | os.PathLike = option(group="output", metavar="DIR")
    """The dataset folder to write (or to resume), an object-storage URL such as ``s3://bucket/prefix``, or a Hub
    dataset repo to write straight to (``hf://datasets/OWNER/NAME``)."""

    # ---- the model and how it runs
    revision: str | None = option(None, group="model", record=2)
    """Model revision (branch, tag or commit) on the Hub; the commit is recorded. Default: main."""
    trust_remote_code: bool = option(False, group="model")
    """Let the model repo's own Python code run. Off unless asked for."""
    block_path: str | None = option(None, group="model")
    """Attribute path of the decoder block list, for architectures lmprobe does not find (default: found)."""
    backend: Literal["transformers", "nnsight"] = option("transformers", group="model", record=18)
    """``transformers``: hooks on a local model; ``nnsight``: an nnsight trace."""
    remote: bool | Literal["local"] = option(False, group="model", record=19)
    """With the nnsight backend: run on NDIF (API key from NNSIGHT_API_KEY or nnsight's config).

    In Python, ``"local"`` runs through nnsight's remote path locally."""
    device: str = option("auto", group="model")
    """``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:N``."""
    compute_dtype: Literal["auto", "float32", "float16", "bfloat16"] = option("auto", group="model", record=10)
    """dtype the model runs in (``auto``: float32 on CPU, the checkpoint's dtype on GPU)."""
    batch_size: int = option(8, group="model", metavar="N", record=15)
    """Prompts per forward pass. Changing it does not block a resume (each run is recorded in ``lmprobe:runs``)."""
    max_length: int | None = option(None, group="model", metavar="N", record=16, record_when="prompts")
    """Longest prompt in tokens (default: the model's limit)."""
    truncate: Literal["left", "right"] | None = option(None, group="model", record=17, record_when="prompts")
    """Cut prompts longer than ``max_length`` (left keeps the end) instead of failing (default: fail)."""
    device_map: Literal["auto"] | None = option(None, group="model")
    """``auto``: spread the model over this process's GPUs (then the CPU, then disk) with accelerate, for a model
    larger than one GPU (``pip install 'lmprobe[accelerate]'``). Default: the whole model on ``device``."""
    max_memory: str | None = option(None, group="model", metavar="MAP")
    """With ``device_map``: memory each device may hold, e.g. ``0=70GiB,1=70GiB,cpu=200GiB`` (accelerate's
    ``max_memory``); past it, layers go to the next device, then to disk. Default: accelerate's own."""

    # ---- the prompts
    text_column: str = option("text", group="input")
    """The column of a table source that holds the prompt text."""
    label_column: str | None = option("label", group="input")
    """The label column (ints or strings); optional when it is the default ``label``."""
    dataset_config: str | None = option(None, group="input", metavar="NAME")
    """The configuration (subset) of a Hugging Face dataset source."""
    split: str = option("train", group="input")
    """The split of a Hugging Face dataset source."""
    chat_template: bool = option(False, group="input", record=22, record_when="prompts")
    """Wrap each prompt in the tokenizer's chat template; store only the prompt's own tokens."""
    max_prompts: int | None = option(None, group="input", metavar="N")
    """Extract only the first N prompts of the source, which is read no further: a trial run on part of a large
    file (default: every prompt)."""

    # ---- corpus extraction
    context_len: int | None = option(None, group="corpus", metavar="T", record=4, record_when="corpus")
    """Corpus extraction: cut every document into windows of at most T tokens, one row each (default: the
    model's length when ``max_tokens`` is given)."""
    max_tokens: int | str | None = option(None, group="corpus", metavar="N", record=5, record_when="corpus")
    """Corpus extraction: stop at exactly N stored tokens (and stop reading the source); ``50M`` works."""
    special_tokens: bool = option(True, group="corpus", record=6, record_when="corpus")
    """Corpus extraction: add the tokenizer's special tokens (BOS, ...) to every window, within the window's
    length."""

    # ---- what to store
    layers: str | int | list[int] | None = option("all", group="store", record=7)
    """``all``, ``0,3,-1``, or ranges such as ``10:20`` (10 to 19: the end is left out, as in a Python slice).

    In Python also a list of ints."""
    hookpoints: str | tuple[str, ...] | list[str] = option("resid_post", group="store", spec=("hookpoints",))
    """Where in each block to read, a comma list: ``resid_pre``, ``attn_out``, ``resid_mid``, ``mlp_in``,
    ``mlp_out``, ``resid_post``, or a module path in the block with ``:input``/``:output``, e.g.
    ``mlp.act_fn:output`` (docs/hookpoints.md)."""
    storage: Literal["pooled", "full_sequence"] = option("pooled", group="store", record=8, spec=("storage",))
    """``pooled`` keeps the last stored token of each prompt; ``full_sequence`` keeps every token."""
    dtype: Literal["float32", "float16", "bfloat16", "int8"] = option("float32", group="store", record=9, spec=("dtype",))
    """Stored dtype of the hidden states. ``int8``: 8-bit codes with a float32 scale per vector (absmax), half the
    bytes of bfloat16; read back as float32 (format 3.0, docs/format.md)."""
    logits_topk: int | None = option(None, group="store", metavar="K", record=11, spec=("logits_topk",))
    """Store the top-K logits at the last token (default: none)."""
    perplexity: bool = option(False, group="store", record=12, spec=("perplexity", "token_perplexity"))
    """Store per-prompt and per-token perplexity."""
    token_strings: bool = option(False, group="store", record=14, spec=("token_strings",))
    """Store the decoded tokens (and their ids)."""
    token_ids: bool = option(False, group="store", record=13)
    """Store the token ids."""
    drop_special_tokens: bool = option(False, group="store", record=21, record_when="prompts")
    """Do not store the tokenizer's special tokens (BOS, EOS, ...); the model still sees them."""
    statistics: bool = option(True, group="store", record=20, spec=("statistics",))
    """Keep running per-layer statistics (count, mean, std, mean norm) over every stored vector."""

    # ---- the output
    shard_size: int | str | None = option(None, group="output")
    """Byte budget of one shard, e.g. ``512MB`` or ``1GiB`` (16GiB at most). Default: 1GiB, or larger where the
    plan needs it so that no folder passes 10,000 entries (the Hub's limit)."""
    checkpoint_interval: float = option(30.0, group="output", metavar="SECONDS")
    """Seconds between checkpoints: at most this much work is redone after an interruption."""
    space_check: bool = option(True, group="output")
    """Stop before the model runs when the output's disk has less free space than the planned bytes."""
    checksums: bool = option(True, group="output", spec=("checksums",))
    """Record the SHA-256 of every shard (lets a push skip files already on the Hub)."""
    overwrite: bool = option(False, group="output")
    """Replace an existing or partial output instead of resuming it."""
    quiet: bool = option(False, group="output")
    """No progress bar or summary."""

    # ---- the job's plan (``--dry-run`` prints it; a real run refuses a plan that cannot work)
    world_size: int | None = option(None, group="plan", metavar="N")
    """The GPUs of the whole job, for a plan made away from the cluster (default: torchrun's world, else 1)."""
    gpus_per_node: int | None = option(None, group="plan", metavar="G")
    """GPUs on each node of the job (default: the GPUs this machine has under torchrun, else 8)."""
    gpu_memory: str | None = option(None, group="plan", metavar="SIZE")
    """Memory of one GPU, e.g. ``80GB`` (default: this machine's first GPU, else 80GB): a model larger than
    one GPU is spread over a node's GPUs."""

    # ---- publishing
    push: str | None = option(None, group="publishing", metavar="REPO")
    """When done, publish the dataset folder to this Hub dataset repo (``OWNER/NAME``)."""
    private: bool = option(False, group="publishing")
    """With ``push``: create the repo private."""

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ExtractionError(msg)

        if not isinstance(self.model, str) or not self.model:
            bad(f"model must be a model id or folder, got {self.model!r}")
        if self.storage not in STORAGES:
            bad(f"storage must be one of {list(STORAGES)}, got {self.storage!r}")
        if self.dtype not in HIDDEN_DTYPES:
            bad(f"dtype must be one of {list(HIDDEN_DTYPES)}, got {self.dtype!r}")
        if self.compute_dtype not in ("auto", *COMPUTE_DTYPES):
            bad(f"compute_dtype must be auto or one of {list(COMPUTE_DTYPES)}, got {self.compute_dtype!r} "
                "(int8 is a storage dtype: --dtype int8)")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            bad(f"batch_size must be a positive integer, got {self.batch_size!r}")
        if self.logits_topk is not None and (isinstance(self.logits_topk, bool) or not isinstance(self.logits_topk, int)
                                             or self.logits_topk < 1):
            bad(f"logits_topk must be a positive integer, got {self.logits_topk!r}")
        if self.truncate not in (None, "left", "right"):
            bad(f"truncate must be 'left', 'right' or None, got {self.truncate!r}")
        if self.max_length is not None and (isinstance(self.max_length, bool) or not isinstance(self.max_length, int)
                                            or self.max_length < 1):
            bad(f"max_length must be a positive integer, got {self.max_length!r}")
        if self.backend not in BACKENDS:
            bad(f"unknown backend {self.backend!r}; use 'transformers' or 'nnsight'")
        if self.remote not in (False, True, "local"):
            bad(f"remote must be False, True or 'local', got {self.remote!r}")
        if self.remote and self.backend != "nnsight":
            bad("remote execution needs backend='nnsight' (--backend nnsight --remote)")
        if self.chat_template and self.truncate:
            bad("--truncate cannot be combined with --chat-template (it would cut the template); "
                "shorten the prompts or raise --max-length")
        object.__setattr__(self, "hookpoints", tuple(parse_hookpoints(self.hookpoints)))
        if isinstance(self.max_tokens, str):
            object.__setattr__(self, "max_tokens", parse_count(self.max_tokens))  # "50M"
        for name in ("context_len", "max_tokens", "max_prompts"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                bad(f"{name} must be a positive integer, got {v!r}")
        if self.corpus:
            flag = "--context-len" if self.context_len is not None else "--max-tokens"
            for name, on in (("--chat-template", self.chat_template), ("--drop-special-tokens", self.drop_special_tokens),
                             ("--truncate", self.truncate), ("--max-length", self.max_length),
                             ("--max-prompts", self.max_prompts)):
                if on:
                    hint = {"--drop-special-tokens": "; --no-special-tokens adds none to the windows",
                            "--truncate": "; windows cover every token of a document",
                            "--max-prompts": "; --max-tokens says how much of the source is read",
                            "--max-length": "; --context-len sets the window length"}.get(name, "")
                    bad(f"{name} does not apply to corpus extraction ({flag}){hint}")
            if self.label_column not in (None, "label"):
                bad(f"corpus extraction ({flag}) stores windows of documents, not labelled prompts; each row's "
                    "`document` column names its record in the source, to join labels on")
        if not isinstance(self.split, str) or not self.split:
            bad(f"split must name a split of the dataset, got {self.split!r}")
        if not isinstance(self.checkpoint_interval, (int, float)) or self.checkpoint_interval < 0:
            bad(f"checkpoint_interval must be a number of seconds >= 0, got {self.checkpoint_interval!r}")
        if self.out is None or str(self.out) == "":
            bad("out must name an output folder or URL")
        if self.push is not None:
            check_repo_id(self.push)  # before hours of extraction, not after
            if is_url(str(self.out)):
                raise InvalidArgumentError(
                    f"--push publishes the local folder --out names, and --out {self.out} is not one; write straight "
                    f"to the Hub with --out hf://datasets/{self.push} instead")
        elif self.private:
            bad("--private applies to the repo --push creates; pass --push OWNER/NAME too")
        for name in ("world_size", "gpus_per_node"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                bad(f"{name} must be a positive integer, got {v!r}")
        if self.gpu_memory is not None:
            parse_size(self.gpu_memory)  # raises on a bad size, naming it
        if self.device_map not in (None, "auto"):
            bad(f"device_map must be 'auto' or None, got {self.device_map!r}")
        if self.max_memory is not None and self.device_map is None:
            bad("--max-memory applies to a model spread with --device-map auto; pass --device-map auto too")
        if self.max_memory is not None:
            parse_max_memory(self.max_memory)  # raises on a bad map, naming it
        if self.device_map is not None and self.backend != "transformers":
            bad("--device-map spreads a model the transformers backend runs; it does not apply to --backend nnsight")
        if self.shard_size is not None and parse_size(self.shard_size) > MAX_SHARD_SIZE:  # parse_size raises on a bad size
            bad(f"--shard-size {self.shard_size} is more than a shard may hold (16GiB: the Hub takes files under "
                "20 GB); pass --shard-size 16GiB or less")

    @property
    def corpus(self) -> bool:
        """Documents streamed into context windows (``context_len`` or ``max_tokens`` given)."""
        return self.context_len is not None or self.max_tokens is not None

    @property
    def shard_bytes(self) -> int | None:
        """The shard size asked for; None: the plan chooses (plan.py)."""
        return None if self.shard_size is None else parse_size(self.shard_size)

    def spec_settings(self) -> dict[str, Any]:
        """The fields of the dataset's description (``DatasetSpec``) that are settings as asked for, from the fields
        marked ``spec=``, under the description's names (``perplexity`` sets both ``perplexity`` and
        ``token_perplexity``)."""
        return {name: getattr(self, f.name) for f in fields(self) for name in spec_names_of(f)}

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def settings(self, *, model_name: str, revision: str | None, layers: list[int], max_length: int | None,
                 prompts_sha256: str | None = None, num_prompts: int | None = None,
                 source: dict[str, Any] | None = None, weights: str | None = None) -> dict[str, Any]:
        """The settings recorded in the dataset (``lmprobe:extraction``) and compared when resuming.

        Values are resolved (layer indices, the model's commit, the prompt set's hash or the
        source's identity), so that the same work asked for in other words still matches.
        """
        # the fields marked ``record=`` in their place, resolved values where the config holds a request; the
        # prompt set's identity (or the corpus source's) follows the model's
        resolved = {"model": model_name, "revision": revision, "layers": layers, "max_length": max_length,
                    "context_len": max_length, "token_ids": self.token_ids or self.token_strings}
        identity = {"source": source} if self.corpus else {"prompts_sha256": prompts_sha256, "num_prompts": num_prompts}
        items = [(_IDENTITY_PLACE, key, value) for key, value in identity.items()]
        for f in fields(self):
            rec = recorded_of(f)
            if rec is not None and rec.when in ("always", "corpus" if self.corpus else "prompts"):
                items.append((rec.place, f.name, resolved.get(f.name, getattr(self, f.name))))
        out = {key: value for _, key, value in sorted(items, key=lambda item: item[0])}
        out["processing_order"] = "source" if self.corpus else "length_descending"
        if weights is not None:  # a local model folder's weights (no commit names them): a resume over others is refused
            out["weights"] = weights
        if self.hookpoints != (DEFAULT_HOOKPOINT,):  # absent by default: earlier partial outputs still resume
            out["hookpoints"] = list(self.hookpoints)
        return out
