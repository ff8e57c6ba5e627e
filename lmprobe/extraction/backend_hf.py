"""The transformers backend: forward hooks on the decoder blocks of a local model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ModelError
from ..format.statistics import RunningStats, batch_statistics
from .hookpoints import Capture, Site, first_input, first_output
from .model import forward_takes

#: what a default extraction reads: the output of each block
RESID_POST = Capture("resid_post", Site("", "output"), 0)


def as_batch_tokens(h: Any, shape: tuple, name: str) -> Any:
    """A captured tensor as (batch, tokens, width); modules that flatten tokens (OPT's fc1) give (batch*tokens, width)."""
    b, t = shape[0], shape[1]
    if not hasattr(h, "shape"):
        raise ModelError(f"hookpoint {name!r} gave a {type(h).__name__}, not a tensor")
    if h.dim() == 2 and h.shape[0] == b * t:
        return h.view(b, t, -1)
    if h.dim() != 3 or tuple(h.shape[:2]) != (b, t):
        raise ModelError(f"hookpoint {name!r} gave a tensor of shape {tuple(h.shape)}; expected (batch, tokens, width) "
                         f"= ({b}, {t}, ...)")
    return h


class _StopForward(Exception):
    """Raised by the hook of the last needed block when nothing after it is needed."""


@dataclass
class BatchOutput:
    hidden: dict[tuple[str, int], Any]  # (hookpoint, layer) -> CPU tensor: (B, dim) pooled, (sum(num_tokens), dim) packed
    num_tokens: np.ndarray  # (B,)
    token_ids: list[list[int]]
    logits_values: np.ndarray | None = None  # (B, k) float32
    logits_indices: np.ndarray | None = None  # (B, k) int64
    perplexity: dict[str, list] = field(default_factory=dict)  # mean/min/max per prompt, token lists
    #: (hookpoint, layer) -> the stored vectors' partial statistics, computed on the model's device
    statistics: dict[tuple[str, int], RunningStats] | None = None


def device_statistics(captured: dict[tuple[str, int], Any]) -> dict[tuple[str, int], RunningStats]:
    """Each captured site's partial statistics, computed in torch where the tensors are (a GPU's work, not the host's)."""
    return {key: batch_statistics(value) for key, value in captured.items()}


def last_token_index(attention_mask):
    """Index of the last real token per row, whatever the padding side: (B,)."""
    import torch

    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (attention_mask.long() * (positions + 1)).argmax(dim=1)


def position_ids_for(attention_mask):
    """Positions counted over real tokens only, so left padding does not shift them."""
    pos = attention_mask.long().cumsum(dim=1) - 1
    return pos.clamp(min=0)


def prediction_positions(keep, b: int):
    """Positions t-1 whose logits predict the stored tokens t of row b (every stored token but the first)."""
    idx = keep[b].nonzero().squeeze(1)
    return idx[1:] - 1, idx[1:]


def _summarise(rows: list) -> dict[str, list]:
    """mean = exp(mean NLL); min/max over per-token perplexities exp(NLL_t); token = those perplexities."""
    import torch

    out: dict[str, list] = {"mean": [], "min": [], "max": [], "token": []}
    for v in rows:  # one float64 NLL vector per prompt
        if len(v) == 0:  # a prompt with a single stored token has no prediction
            for key in ("mean", "min", "max"):
                out[key].append(float("nan"))
            out["token"].append([])
            continue
        ppl = torch.exp(v)
        out["mean"].append(float(torch.exp(v.mean())))
        out["min"].append(float(ppl.min()))
        out["max"].append(float(ppl.max()))
        out["token"].append(ppl.cpu().tolist())
    return out


def perplexity_from_nll(nll, keep) -> dict[str, list]:
    """Per-prompt perplexity from (B, T-1) next-token NLLs (nll[b, t] predicts token t+1)."""
    return _summarise([nll[b][prediction_positions(keep, b)[0]].double() for b in range(nll.shape[0])])


def perplexity_from_logits(logits, input_ids, keep) -> dict[str, list]:
    """Per-prompt perplexity from (B, T, V) logits, computed row by row on the logits' device.

    Per-token values cover the stored tokens after the first, each predicted from everything before
    it (``keep`` marks the stored tokens; by default every real token). See ``_summarise``.
    """
    import torch.nn.functional as F

    rows = []
    for b in range(input_ids.shape[0]):
        pred, target = prediction_positions(keep, b)
        rows.append(F.cross_entropy(logits[b, pred].float(), input_ids[b, target], reduction="none").double())
    return _summarise(rows)


class TransformersBackend:
    name = "local"

    def __init__(self, model: Any, blocks: Any, *, causal_lm: bool):
        self.model = model
        self.blocks = blocks
        self.causal_lm = causal_lm
        self._takes_position_ids = forward_takes(model, "position_ids", via_kwargs=False)
        self._takes_use_cache = forward_takes(model, "use_cache")
        self.device = next(model.parameters()).device

    def run(self, input_ids, attention_mask, *, layers: list[int], storage: str, out_dtype: Any,
            logits_k: int | None, perplexity: bool, keep=None, captures: list[Capture] | None = None,
            statistics: bool = False) -> BatchOutput:
        """``keep`` marks the tokens to store (default: every real token); the model sees them all.

        ``captures`` are the hookpoints to read in each block of ``layers`` (default: the block
        outputs); ``BatchOutput.hidden`` is keyed by (hookpoint, layer). ``statistics``: compute each
        site's partial statistics on the model's device (``BatchOutput.statistics``).
        """
        import torch

        input_ids = input_ids.to(self.device)
        attention_mask = attention_mask.to(self.device)
        real = (attention_mask.bool() if keep is None else keep.to(self.device))
        b = input_ids.shape[0]
        last = last_token_index(real)
        rows = torch.arange(b, device=self.device)
        need_head = bool(logits_k) or perplexity
        captures = captures or [RESID_POST]
        captured: dict[tuple[str, int], Any] = {}
        wanted = len(layers) * len(captures)

        def keep_rows(name: str, h: Any) -> Any:
            h = as_batch_tokens(h, input_ids.shape, name)
            return h[rows, last].to(out_dtype) if storage == "pooled" else h[real].to(out_dtype)

        def store(names: list[tuple[str, int]], value: Any) -> None:
            for key in names:  # a copy per hookpoint: later in-place updates of the stream cannot reach it
                if key not in captured:  # a module called twice in a block: its first call
                    captured[key] = keep_rows(key[0], value)
            if not need_head and len(captured) == wanted:
                raise _StopForward  # everything asked for is read: nothing after this point is needed

        handles = []
        for layer in layers:
            by_site: dict[Site, list[tuple[str, int]]] = {}
            for c in captures:
                by_site.setdefault(c.site, []).append((c.hookpoint, layer))
            for site, names in by_site.items():
                module = self.blocks[layer].get_submodule(site.path) if site.path else self.blocks[layer]
                if site.kind == "input":
                    def pre(_m, args, kwargs, names=names):
                        store(names, first_input(args, kwargs))
                    handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
                else:
                    def post(_m, _args, output, names=names):
                        store(names, first_output(output))
                    handles.append(module.register_forward_hook(post))
        head = self.model.get_output_embeddings() if need_head else None
        if logits_k and not perplexity and head is not None:
            # only the last token's logits are needed: feed the head one row per prompt
            def gather_last(_module, args):
                hs = args[0]
                return (hs[rows, last].unsqueeze(1), *args[1:])

            handles.append(head.register_forward_pre_hook(gather_last))
        kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self._takes_position_ids:
            kwargs["position_ids"] = position_ids_for(attention_mask)
        if self._takes_use_cache:
            kwargs["use_cache"] = False
        result = None
        try:
            result = self.model(**kwargs)
        except _StopForward:
            pass
        finally:
            for h in handles:
                h.remove()
        missing = [(c.hookpoint, layer) for layer in layers for c in captures if (c.hookpoint, layer) not in captured]
        if missing:
            raise ModelError(f"the forward pass never reached {missing[:4]} (hookpoint, layer); a module that the "
                             "model skips cannot be read")
        lengths = real.sum(dim=1)
        ids = input_ids[real].cpu()
        token_ids = [t.tolist() for t in torch.split(ids, lengths.cpu().tolist())]
        out = BatchOutput(
            hidden={key: value.cpu() for key, value in captured.items()},
            num_tokens=lengths.cpu().numpy().astype(np.int64),
            token_ids=token_ids,
            statistics=device_statistics(captured) if statistics else None,
        )
        if need_head:
            logits = result.logits if hasattr(result, "logits") else result[0]
            if perplexity:
                out.perplexity = perplexity_from_logits(logits, input_ids, real)
                last_logits = logits[rows, last]
            else:
                last_logits = logits[:, -1] if logits.shape[1] == 1 else logits[rows, last]
            if logits_k:
                top = torch.topk(last_logits.float(), logits_k, dim=-1)
                out.logits_values = top.values.cpu().numpy().astype(np.float32)
                out.logits_indices = top.indices.cpu().numpy()
        return out
