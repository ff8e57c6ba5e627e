"""The nnsight backend: the same extraction through an nnsight trace, locally or on NDIF.

Inside the trace only what the dataset stores is kept and saved: the requested blocks' outputs
(sliced to the last real token for pooled storage), the top-k of the last token's logits, and the
(batch, tokens - 1) next-token NLLs for perplexity. A remote run moves nothing else. Transient
remote failures are retried with backoff; a batch that keeps failing stops the run, which the
same command then resumes.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from ..base.retry import TRANSIENT_HTTP_STATUS, RetryPolicy, call_with_retry, describe
from ..errors import NnsightError
from .backend_hf import (
    BatchOutput,
    as_batch_tokens,
    device_statistics,
    last_token_index,
    perplexity_from_nll,
)
from .examine import InputPolicy, forward_kwargs
from .hookpoints import Capture, Site, assemble_readings, first_input, first_output


def require_nnsight():
    try:
        import nnsight
    except ImportError:
        raise NnsightError("the nnsight backend needs nnsight: pip install 'lmprobe[nnsight]'") from None
    return nnsight


def nnsight_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("nnsight")
    except Exception:
        return None


def check_api_key() -> None:
    """Remote runs need an NDIF key: NNSIGHT_API_KEY, NDIF_API_KEY, or nnsight's saved config. Never printed."""
    require_nnsight()
    from nnsight import CONFIG

    key = os.environ.get("NNSIGHT_API_KEY")
    if key:
        CONFIG.API.APIKEY = key
    if not CONFIG.API.APIKEY:
        raise NnsightError(
            "remote extraction needs an NDIF API key: set NNSIGHT_API_KEY (or NDIF_API_KEY), or run "
            "`python -c \"import nnsight; nnsight.login()\"` once"
        )


def remote_errors() -> tuple[type[BaseException], ...]:
    """What a failed NDIF request raises: nnsight's RemoteError, and dropped or timed-out connections."""
    classes: list[type[BaseException]] = [ConnectionError, TimeoutError]
    try:
        from nnsight.intervention.backends.remote import RemoteError

        classes.append(RemoteError)
    except ImportError:  # another nnsight layout: connection errors only
        pass
    for module in ("httpx2", "httpx"):
        try:
            classes.append(__import__(module).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(classes)


def default_retry() -> RetryPolicy:
    """Remote batches retry NDIF's errors, dropped connections and 429/5xx answers, never a bug."""
    return RetryPolicy(retry_on_exceptions=remote_errors(), retry_on_status_codes=TRANSIENT_HTTP_STATUS,
                       max_retries=4, base_wait=2.0)


class NnsightBackend:
    name = "nnsight"

    def __init__(self, nn_model: Any, block_path: str, *, causal_lm: bool, inputs: InputPolicy,
                 remote: bool | str = False, retry: RetryPolicy | None = None):
        self.model = nn_model
        self.block_path = block_path
        self.inputs = inputs
        self.causal_lm = causal_lm
        self.remote = remote
        self.retry = retry or default_retry()

    def _envoy(self, path: str) -> Any:
        obj = self.model
        for part in path.split("."):
            obj = getattr(obj, part)
        return obj

    def _module(self) -> Any:
        return self.model.__dict__["_module"]  # the wrapped torch module (real, or meta for remote runs)

    def _head_path(self) -> str:
        head = self._module().get_output_embeddings()
        for name, module in self._module().named_modules():
            if module is head:
                return name
        raise NnsightError("cannot find the model's LM head for logits/perplexity")

    def run(self, input_ids, attention_mask, *, layers: list[int], storage: str, out_dtype: Any,
            logits_topk: int | None, perplexity: bool, captures: list[Capture], keep=None,
            statistics: bool = False) -> BatchOutput:
        try:
            return call_with_retry(
                lambda: self.run_once(input_ids, attention_mask, layers=layers, storage=storage, out_dtype=out_dtype,
                                      logits_topk=logits_topk, perplexity=perplexity, keep=keep, captures=captures,
                                      statistics=statistics),
                policy=self.retry)
        except Exception as exc:
            if self.retry.is_transient(exc):
                raise NnsightError(
                    f"a batch failed {self.retry.max_retries + 1} times on the nnsight backend ({describe(exc)}); "
                    "the batches before it are saved: run the same command again to resume"
                ) from exc
            raise

    def run_once(self, input_ids, attention_mask, *, layers, storage, out_dtype, logits_topk, perplexity,
                  captures: list[Capture], keep=None, statistics: bool = False) -> BatchOutput:
        import torch

        b = input_ids.shape[0]
        real = attention_mask.bool() if keep is None else keep
        last = last_token_index(real)
        rows = torch.arange(b)
        policy = dataclasses.replace(self.inputs, use_cache=False)  # nnsight's inputs are tensors only
        inputs = forward_kwargs(self._module(), policy, input_ids, attention_mask)
        blocks = self._envoy(self.block_path)
        need_head = bool(logits_topk) or perplexity
        head = self._envoy(self._head_path()) if need_head else None
        kept: dict[tuple[int, Site, str], Any] = {}
        targets = input_ids[:, 1:]
        top_values = top_indices = nll = None
        forms: dict[tuple[int, Site], set[str]] = {}
        for c in captures:
            for layer in layers:
                reading = c.readings[layer]
                for site in reading.sites:
                    forms.setdefault((layer, site), set()).add("out" if reading.minus is None else "f32")
        order = {layer: c.order.get(layer, {}) for c in captures for layer in layers}
        with self.model.trace(inputs, remote=self.remote) as tracer:
            for layer in layers:  # in forward order, as nnsight requires
                sites = sorted((s for (lay, s) in forms if lay == layer), key=lambda s: order[layer].get(s, 0))
                for site in sites:
                    env = _submodule(blocks[layer], site.path)
                    h = first_input(*env.inputs) if site.kind == "input" else first_output(env.output)
                    h = as_batch_tokens(h, tuple(input_ids.shape), str(site))
                    h = h[rows, last] if storage == "pooled" else h[real]  # only these rows leave the trace
                    for form in forms[(layer, site)]:
                        kept[(layer, site, form)] = (h.to(out_dtype) if form == "out" else h.float()).save()
            if need_head:
                logits = head.output
                if logits_topk:
                    top = logits[rows, last].float().topk(logits_topk, dim=-1)
                    top_values, top_indices = top.values.save(), top.indices.save()
                if perplexity:
                    lg = logits[:, :-1].float()
                    nll = torch.nn.functional.cross_entropy(lg.transpose(1, 2), targets.to(lg.device),
                                                            reduction="none").save()
            else:
                tracer.stop()  # nothing after the last requested block is needed
        saved = assemble_readings(captures, layers, kept, out_dtype)
        lengths = real.sum(dim=1)
        ids = input_ids[real]
        out = BatchOutput(
            hidden={key: value.cpu() for key, value in saved.items()},
            num_tokens=lengths.numpy().astype(np.int64),
            token_ids=[t.tolist() for t in torch.split(ids, lengths.tolist())],
            statistics=device_statistics(saved) if statistics else None,  # where the saved tensors are
        )
        if logits_topk:
            out.logits_values = top_values.cpu().numpy().astype(np.float32)
            out.logits_indices = top_indices.cpu().numpy()
        if perplexity:
            out.perplexity = perplexity_from_nll(nll.cpu(), real)
        return out


def _submodule(envoy: Any, path: str) -> Any:
    """The envoy of a module path inside a block. nnsight serves ``.input``/``.output`` itself, so a
    submodule with one of those names (BERT's ``output``) is reached as ``E_output``."""
    import inspect

    from nnsight.intervention.envoy import Envoy

    for part in path.split(".") if path else []:
        if not part.startswith("_") and inspect.isdatadescriptor(getattr(Envoy, part, None)):
            part = Envoy.OVERLOAD_PREFIX + part
        envoy = getattr(envoy, part)
    return envoy


def build_backend(spec: Any, hf_model: Any, tokenizer: Any, *, block_path: str, inputs: InputPolicy,
                  remote: bool | str, retry: RetryPolicy | None = None):
    """Wrap a loaded model (local runs, and remote="local") or name a remote one (remote=True)."""
    require_nnsight()
    from nnsight.modeling.transformers import TransformersModel

    if remote is True:
        nn_model = TransformersModel(spec.path, tokenizer=tokenizer, revision=spec.revision,
                                     trust_remote_code=spec.trust_remote_code)  # the user's flag, never a prompt
    else:
        # nnsight infers a pipeline task from the class; a bare encoder (BERT's BertModel) has none to infer
        task = {} if spec.causal_lm else {"task": "feature-extraction"}
        nn_model = TransformersModel(hf_model, tokenizer=tokenizer, **task)
    return NnsightBackend(nn_model, block_path, causal_lm=spec.causal_lm, inputs=inputs, remote=remote, retry=retry)
