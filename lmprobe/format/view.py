"""One prompt of a dataset, as a person looks at it: its tokens, their perplexity, what the model predicted next.

``Dataset.prompt(i)`` returns a ``Prompt``; in a notebook it displays as coloured tokens
(``_repr_html_``), and ``lmprobe report`` draws the same view.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..base.html import esc, table, tokens_html, visible_whitespace


@dataclass
class Prompt:
    """A row of the index with what the dataset stores about its tokens."""

    index: int
    text: str
    num_tokens: int
    label: Any = None
    token_ids: list[int] | None = None
    tokens: list[str] | None = None
    """The stored tokens' strings: from ``token_strings``, or decoded from the ids with a tokenizer."""
    token_perplexity: list[float] | None = None
    """exp(NLL) of tokens 1..n-1, each predicted from the tokens before it (token 0 has none)."""
    perplexity_mean: float | None = None
    topk: list[tuple[str, float]] = field(default_factory=list)
    """The top-k next-token predictions after the last token: (token, logit), best first."""
    noun: str = "prompt"
    """What a row is: ``prompt``, or ``window`` (a window of a document, in a corpus extraction)."""

    def token_strings(self) -> list[str]:
        if self.tokens is not None:
            return self.tokens
        if self.token_ids is not None:
            return [f"#{t} " for t in self.token_ids]
        return [self.text]

    def html(self, *, vmax: float | None = None) -> str:
        """The prompt's tokens shaded by log-perplexity (darker: more surprising), then the model's top-k."""
        toks = self.token_strings()
        values: list[float | None] = [None] * len(toks)
        titles = [f"token {i}" for i in range(len(toks))]
        if self.token_perplexity is not None and len(toks) == self.num_tokens:
            for i, p in enumerate(self.token_perplexity, start=1):
                if i < len(values) and p is not None and math.isfinite(p) and p > 0:
                    values[i] = math.log(p)
                    titles[i] = f"token {i}: perplexity {p:.4g}"
        head = f"{self.noun} {self.index}"
        bits = [f"{self.num_tokens} tokens"]
        if self.label is not None:
            bits.append(f"label {esc(self.label)}")
        if self.perplexity_mean is not None and math.isfinite(self.perplexity_mean):
            bits.append(f"perplexity {self.perplexity_mean:.4g}")
        out = [f'<div class="prompt"><div class="meta"><b>{head}</b> · {" · ".join(bits)}</div>',
               tokens_html(toks, values, vmax=vmax, titles=titles)]
        if self.topk:
            preds = ", ".join(f"<b>{esc(visible_whitespace(t))}</b> {v:.3g}" for t, v in self.topk)  # " " is ␣
            # stored are the top-k logits, not the whole distribution: no probability can be computed
            out.append(f'<div class="pred">next token, top {len(self.topk)} by logit: {preds}</div>')
        out.append("</div>")
        return "".join(out)

    def _repr_html_(self) -> str:
        return self.html()


def dataset_html(ds: Any, *, rows: int = 3) -> str:
    """A dataset's summary as HTML: what a notebook shows for ``ds``."""
    h = ds.meta.hidden
    model = ds.model
    facts = [("model", f"{model.get('name')}" + (f" @ {model.get('revision')}" if model.get("revision") else "")),
             ("prompts", ds.num_prompts)]
    if h is not None:
        facts += [("layers", ", ".join(map(str, h.layers))), ("hookpoints", ", ".join(ds.hookpoints)),
                  ("dim", h.dim), ("dtype", h.dtype), ("storage", h.storage)]
    facts.append(("source", str(ds.files)))
    body = [f"<div><b>lmprobe.Dataset</b>{table(facts)}"]
    first = ds.prompt_table.column("text").slice(0, rows).to_pylist()
    for i, text in enumerate(first):
        body.append(f'<div class="meta">{i}: {esc(text[:200])}</div>')
    body.append("</div>")
    return "".join(body)
