"""The transformers backend: forward hooks on the decoder blocks of a local model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ModelError
from ..format.statistics import RunningStats, batch_statistics
from .examine import InputPolicy, forward_kwargs
from .hookpoints import Capture, Site, assemble_readings, first_input, first_output
from .placement import input_device


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

    def __init__(self, model: Any, blocks: Any, *, causal_lm: bool, inputs: InputPolicy):
        self.model = model
        self.blocks = blocks
        self.causal_lm = causal_lm
        self.inputs = inputs
        # where the inputs go and the captured vectors gather: the first device of a spread model (placement.py)
        self.device = input_device(model)

    def run(self, input_ids, attention_mask, *, layers: list[int], storage: str, out_dtype: Any,
            logits_topk: int | None, perplexity: bool, captures: list[Capture], keep=None,
            statistics: bool = False) -> BatchOutput:
        """``keep`` marks the tokens to store (default: every real token); the model sees them all.

        ``captures`` are the hookpoints to read in each block of ``layers``, each with its reading
        on every layer (examine.py); ``BatchOutput.hidden`` is keyed by (hookpoint, layer). A reading
        that is the difference of two sites is computed in float32 from both, then cast.
        ``statistics``: compute each site's partial statistics on the model's device.
        """
        import torch

        input_ids = input_ids.to(self.device)
        attention_mask = attention_mask.to(self.device)
        real = (attention_mask.bool() if keep is None else keep.to(self.device))
        b = input_ids.shape[0]
        last = last_token_index(real)
        rows = torch.arange(b, device=self.device)
        need_head = bool(logits_topk) or perplexity
        forms = _forms(captures, layers)
        kept: dict[tuple[int, Site, str], Any] = {}

        def keep_rows(name: str, h: Any) -> Any:
            # a block of a spread model computes on its own device: pick the rows there (the indices are small),
            # then bring them to the inputs' device, where the readings are assembled and the statistics taken
            h = as_batch_tokens(h, input_ids.shape, name)
            where = on(h.device)
            return h[where["rows"], where["last"]] if storage == "pooled" else h[where["real"]]

        by_device: dict[Any, dict[str, Any]] = {}

        def on(device: Any) -> dict[str, Any]:
            """``rows``, ``last`` and ``real`` on ``device`` (copied once per device and batch)."""
            if device not in by_device:
                by_device[device] = {"rows": rows.to(device), "last": last.to(device), "real": real.to(device)}
            return by_device[device]

        def store(key: tuple[int, Site], value: Any) -> None:
            layer, site = key
            if (layer, site, next(iter(forms[key]))) in kept:  # a module called twice in a block: its first call
                return
            for form in forms[key]:  # a copy each: later in-place updates of the stream cannot reach it
                if form == "out":
                    kept[(layer, site, form)] = keep_rows(str(site), value).to(out_dtype).to(self.device)
                else:
                    kept[(layer, site, form)] = keep_rows(str(site), value).float().to(self.device)
            if not need_head and len(kept) == wanted:
                raise _StopForward  # everything asked for is read: nothing after this point is needed

        wanted = sum(len(f) for f in forms.values())
        handles = []
        for (layer, site) in forms:
            module = self.blocks[layer].get_submodule(site.path) if site.path else self.blocks[layer]
            if site.kind == "input":
                def pre(_m, args, kwargs, key=(layer, site)):
                    store(key, first_input(args, kwargs))
                handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            else:
                def post(_m, _args, output, key=(layer, site)):
                    store(key, first_output(output))
                handles.append(module.register_forward_hook(post))
        head = self.model.get_output_embeddings() if need_head else None
        if logits_topk and not perplexity and head is not None:
            # only the last token's logits are needed: feed the head one row per prompt
            def gather_last(_module, args):
                hs = args[0]  # on the head's device
                where = on(hs.device)
                return (hs[where["rows"], where["last"]].unsqueeze(1), *args[1:])

            handles.append(head.register_forward_pre_hook(gather_last))
        result = None
        try:
            result = self.model(**forward_kwargs(self.model, self.inputs, input_ids, attention_mask))
        except _StopForward:
            pass
        finally:
            for h in handles:
                h.remove()
        _check_reached(forms, kept)
        captured = assemble_readings(captures, layers, kept, out_dtype)
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
            logits = result.logits if hasattr(result, "logits") else result[0]  # on the head's device, when spread
            _read_head(out, logits, on(logits.device), input_ids, perplexity=perplexity, logits_topk=logits_topk)
        return out


def _forms(captures: list[Capture], layers: list[int]) -> dict[tuple[int, Site], set[str]]:
    """(layer, site) -> the forms it is kept in: out_dtype for a reading of its own, float32 for a difference."""
    forms: dict[tuple[int, Site], set[str]] = {}
    for c in captures:
        for layer in layers:
            reading = c.readings[layer]
            if reading.minus is None:
                forms.setdefault((layer, reading.site), set()).add("out")
            else:
                for site in reading.sites:
                    forms.setdefault((layer, site), set()).add("f32")
    return forms


def _check_reached(forms: dict[tuple[int, Site], set[str]], kept: dict[tuple[int, Site, str], Any]) -> None:
    """Every site asked for was read by the forward pass; a module the model skips is an error."""
    missing = sorted({(str(site), layer) for (layer, site), fs in forms.items() for f in fs
                      if (layer, site, f) not in kept})
    if missing:
        raise ModelError(f"the forward pass never reached {missing[:4]} (site, layer); a module that the "
                         "model skips cannot be read")


def _read_head(out: BatchOutput, logits: Any, where: dict[str, Any], input_ids: Any, *, perplexity: bool,
               logits_topk: int | None) -> None:
    """The perplexities and the last token's top-k logits, from the head's ``logits`` (``where``: the rows, last
    positions and real tokens on the logits' device)."""
    import torch

    if perplexity:
        out.perplexity = perplexity_from_logits(logits, input_ids.to(logits.device), where["real"])
        last_logits = logits[where["rows"], where["last"]]
    else:
        last_logits = logits[:, -1] if logits.shape[1] == 1 else logits[where["rows"], where["last"]]
    if logits_topk:
        top = torch.topk(last_logits.float(), logits_topk, dim=-1)
        out.logits_values = top.values.cpu().numpy().astype(np.float32)
        out.logits_indices = top.indices.cpu().numpy()
