"""``ExtractionConfig``: every setting of an extraction, checked when it is made.

The command line builds one from its arguments, ``lmprobe.extract`` builds one from its keywords,
and the settings it records (``ExtractionConfig.settings``) are what a re-run compares to decide
whether a partial output can be resumed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Literal

from ..base.units import parse_count, parse_size
from ..errors import ExtractionError
from ..format.spec import DEFAULT_HOOKPOINT, HIDDEN_DTYPES, MAX_SHARD_SIZE, RUN_SETTINGS, STORAGES
from .hookpoints import parse_hookpoints

BACKENDS = ("transformers", "nnsight")
#: recorded settings that change no stored value beyond float rounding: an output made under other values of
#: these is the same extraction, and a partial one resumes (a smaller batch after an out-of-memory error)
RESUMABLE_SETTINGS = RUN_SETTINGS


def same_extraction(recorded: dict[str, Any], settings: dict[str, Any]) -> bool:
    """Whether recorded extraction settings describe the same work as ``settings`` (RESUMABLE_SETTINGS aside)."""
    def work(d: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in d.items() if k not in RESUMABLE_SETTINGS}

    return work(recorded) == work(settings)


@dataclass(frozen=True)
class ExtractionConfig:
    """What to extract, from which model and prompts, into which output."""

    model: str
    """A local model folder, a Hub model id, or ``lmprobe-tiny`` (the model shipped inside lmprobe)."""
    prompts: Any
    """A prompt file (.jsonl/.csv/.tsv/.parquet/.txt), a folder of them, a Hugging Face dataset
    (``hf://datasets/OWNER/NAME`` or ``OWNER/NAME``), a list of strings or dicts, or a pandas DataFrame."""
    out: str | os.PathLike
    """The output folder, or an object-storage URL such as ``s3://bucket/prefix``."""
    layers: str | int | list[int] | None = "all"
    """``all``, ``"0,3,-1"``, ranges such as ``"10:20"`` (Python slices), or a list of ints."""
    hookpoints: str | tuple[str, ...] | list[str] = "resid_post"
    """Where in each block to read: a comma list or a list of ``resid_pre``, ``attn_out``, ``resid_mid``,
    ``mlp_in``, ``mlp_out``, ``resid_post`` and module paths with ``:input``/``:output`` (docs/hookpoints.md)."""
    storage: Literal["pooled", "full_sequence"] = "pooled"
    """``pooled`` keeps the last stored token of each prompt; ``full_sequence`` keeps every token."""
    logits_topk: int | None = None
    """Store the top-k logits at the last token."""
    perplexity: bool = False
    """Store per-prompt and per-token perplexity."""
    token_strings: bool = False
    """Store the decoded tokens (and their ids)."""
    token_ids: bool = False
    """Store the token ids."""
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    """Stored dtype of the hidden states."""
    batch_size: int = 8
    """Prompts per forward pass. Changing it does not block a resume (each run is recorded in ``lmprobe:runs``)."""
    max_length: int | None = None
    """Longest prompt in tokens (default: the model's limit)."""
    truncate: Literal["left", "right"] | None = None
    """Cut prompts longer than ``max_length`` (left keeps the end) instead of failing."""
    shard_size: int | str = "1GiB"
    """Byte budget of one shard: an int or a size such as ``"512MB"``."""
    device: str = "auto"
    """``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:N``."""
    compute_dtype: str = "auto"
    """dtype the model runs in (``auto``: float32 on CPU, the checkpoint's dtype on GPU)."""
    text_column: str = "text"
    """The prompt text column of a table source."""
    label_column: str | None = "label"
    """The label column (ints or strings); optional when it is the default ``label``."""
    dataset_config: str | None = None
    """The configuration (subset) of a Hugging Face dataset source."""
    split: str = "train"
    """The split of a Hugging Face dataset source."""
    context_len: int | None = None
    """Corpus extraction: cut every document into windows of at most this many tokens, one row each."""
    max_tokens: int | str | None = None
    """Corpus extraction: stop at exactly this many stored tokens (and stop reading the source); ``"50M"`` works."""
    special_tokens: bool = True
    """Corpus extraction: add the tokenizer's special tokens (BOS, ...) to every window, within ``context_len``."""
    space_check: bool = True
    """Stop before the model runs when the output's disk has less free space than the planned bytes."""
    revision: str | None = None
    """Model revision (branch, tag or commit) on the Hub; the commit is recorded."""
    trust_remote_code: bool = False
    """Let the model repo's own Python code run. Off unless asked for."""
    backend: Literal["transformers", "nnsight"] = "transformers"
    """``transformers``: hooks on a local model; ``nnsight``: an nnsight trace."""
    remote: bool | Literal["local"] = False
    """With the nnsight backend: run on NDIF (True), or through nnsight's remote path locally ("local")."""
    block_path: str | None = None
    """Attribute path of the decoder block list, for architectures lmprobe does not know."""
    checkpoint_interval: float = 30.0
    """Seconds between checkpoints: at most this much work is redone after an interruption."""
    checksums: bool = True
    """Record the SHA-256 of every shard (lets a push skip files already on the Hub)."""
    statistics: bool = True
    """Keep running per-layer statistics (count, mean, std, mean norm) over every stored vector."""
    drop_special_tokens: bool = False
    """Do not store the tokenizer's special tokens (BOS, EOS, ...); the model still sees them."""
    chat_template: bool = False
    """Wrap each prompt in the tokenizer's chat template; store only the prompt's own tokens."""
    overwrite: bool = False
    """Replace an existing or partial output instead of resuming it."""
    quiet: bool = False
    """No progress bar or summary."""

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ExtractionError(msg)

        if not isinstance(self.model, str) or not self.model:
            bad(f"model must be a model id or folder, got {self.model!r}")
        if self.storage not in STORAGES:
            bad(f"storage must be one of {list(STORAGES)}, got {self.storage!r}")
        if self.dtype not in HIDDEN_DTYPES:
            bad(f"dtype must be one of {list(HIDDEN_DTYPES)}, got {self.dtype!r}")
        if self.compute_dtype not in ("auto", *HIDDEN_DTYPES):
            bad(f"compute_dtype must be auto or one of {list(HIDDEN_DTYPES)}, got {self.compute_dtype!r}")
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
        for name in ("context_len", "max_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                bad(f"{name} must be a positive integer, got {v!r}")
        if self.corpus:
            flag = "--context-len" if self.context_len is not None else "--max-tokens"
            for name, on in (("--chat-template", self.chat_template), ("--drop-special-tokens", self.drop_special_tokens),
                             ("--truncate", self.truncate), ("--max-length", self.max_length)):
                if on:
                    hint = {"--drop-special-tokens": "; --no-special-tokens adds none to the windows",
                            "--truncate": "; windows cover every token of a document",
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
        if parse_size(self.shard_size) > MAX_SHARD_SIZE:  # parse_size raises on a bad size
            bad(f"--shard-size {self.shard_size} is more than a shard may hold (16GiB: the Hub takes files under "
                "20 GB); pass --shard-size 16GiB or less")

    @property
    def corpus(self) -> bool:
        """Documents streamed into context windows (``context_len`` or ``max_tokens`` given)."""
        return self.context_len is not None or self.max_tokens is not None

    @property
    def shard_bytes(self) -> int:
        return parse_size(self.shard_size)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def settings(self, *, model_name: str, revision: str | None, layers: list[int], max_length: int | None,
                 prompts_sha256: str | None = None, num_prompts: int | None = None,
                 source: dict[str, Any] | None = None) -> dict[str, Any]:
        """The settings recorded in the dataset (``lmprobe:extraction``) and compared when resuming.

        Values are resolved (layer indices, the model's commit, the prompt set's hash or the
        source's identity), so that the same work asked for in other words still matches.
        """
        what: dict[str, Any] = {"prompts_sha256": prompts_sha256, "num_prompts": num_prompts}
        if self.corpus:
            what = {"source": source, "context_len": max_length, "max_tokens": self.max_tokens,
                    "special_tokens": self.special_tokens}
        out = {
            "model": model_name,
            "revision": revision,
            **what,
            "layers": layers,
            "storage": self.storage,
            "dtype": self.dtype,
            "compute_dtype": self.compute_dtype,
            "logits_topk": self.logits_topk,
            "perplexity": self.perplexity,
            "token_ids": self.token_ids or self.token_strings,
            "token_strings": self.token_strings,
            "batch_size": self.batch_size,
            "max_length": max_length,
            "truncate": self.truncate,
            "backend": self.backend,
            "remote": self.remote,
            "statistics": self.statistics,
            "drop_special_tokens": self.drop_special_tokens,
            "chat_template": self.chat_template,
            "processing_order": "source" if self.corpus else "length_descending",
        }
        if self.corpus:
            for name in ("max_length", "truncate", "drop_special_tokens", "chat_template"):
                del out[name]
        if self.hookpoints != (DEFAULT_HOOKPOINT,):  # absent by default: earlier partial outputs still resume
            out["hookpoints"] = list(self.hookpoints)
        return out
