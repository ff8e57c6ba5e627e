"""The transformers backend: forward hooks on the decoder blocks of a local model."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class _StopForward(Exception):
    """Raised by the hook of the last needed block when nothing after it is needed."""


@dataclass
class BatchOutput:
    hidden: dict[int, Any]  # layer -> CPU tensor: (B, dim) pooled, or (sum(num_tokens), dim) packed
    num_tokens: np.ndarray  # (B,)
    token_ids: list[list[int]]
    logits_values: np.ndarray | None = None  # (B, k) float32
    logits_indices: np.ndarray | None = None  # (B, k) int64
    perplexity: dict[str, list] = field(default_factory=dict)  # mean/min/max per prompt, token lists


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
        params = inspect.signature(model.forward).parameters
        self._takes_position_ids = "position_ids" in params
        self._takes_use_cache = "use_cache" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
        self.device = next(model.parameters()).device

    def run(self, input_ids, attention_mask, *, layers: list[int], storage: str, out_dtype: Any,
            logits_k: int | None, perplexity: bool, keep=None) -> BatchOutput:
        """``keep`` marks the tokens to store (default: every real token); the model sees them all."""
        import torch

        input_ids = input_ids.to(self.device)
        attention_mask = attention_mask.to(self.device)
        real = (attention_mask.bool() if keep is None else keep.to(self.device))
        b = input_ids.shape[0]
        last = last_token_index(real)
        rows = torch.arange(b, device=self.device)
        need_head = bool(logits_k) or perplexity
        captured: dict[int, Any] = {}
        stop_at = max(layers)

        def hook_for(layer: int):
            def hook(_module, _inputs, output):
                h = output[0] if isinstance(output, (tuple, list)) else output
                if storage == "pooled":
                    captured[layer] = h[rows, last].to(out_dtype)
                else:
                    captured[layer] = h[real].to(out_dtype)  # real tokens, prompt after prompt
                if not need_head and layer == stop_at:
                    raise _StopForward
            return hook

        handles = [self.blocks[layer].register_forward_hook(hook_for(layer)) for layer in layers]
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
        missing = [layer for layer in layers if layer not in captured]
        if missing:
            raise RuntimeError(f"the forward pass never reached blocks {missing}")
        lengths = real.sum(dim=1)
        ids = input_ids[real].cpu()
        token_ids = [t.tolist() for t in torch.split(ids, lengths.cpu().tolist())]
        out = BatchOutput(
            hidden={layer: captured[layer].cpu() for layer in layers},
            num_tokens=lengths.cpu().numpy().astype(np.int64),
            token_ids=token_ids,
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
