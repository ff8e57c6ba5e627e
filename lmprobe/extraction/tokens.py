"""Turning prompts into model inputs, and deciding which tokens are stored.

By default every token the tokenizer produces (its default special tokens included) is stored.
``drop_special_tokens`` leaves the tokenizer's special tokens (BOS, EOS, ...) out of what is
stored; ``chat_template`` wraps each prompt as a user message with the tokenizer's chat template
and stores only the prompt's own tokens. The model always sees the whole input: excluded tokens
are context, not data. A prompt's stored tokens are what ``num_tokens``, ``token_ids`` and the
address columns describe, and its last stored token is its "last token".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import TokenError


class Encoder:
    def __init__(self, tok: Any, *, chat_template: bool = False, drop_special_tokens: bool = False,
                 max_length: int | None = None, truncate: str | None = None):
        self.tok = tok
        self.chat_template = chat_template
        self.drop_special = drop_special_tokens
        self.max_length = max_length
        self.truncate = truncate
        self.special = set(tok.all_special_ids) if drop_special_tokens else set()
        if chat_template and not getattr(tok, "chat_template", None):
            raise TokenError("--chat-template was asked for, but this tokenizer has no chat template")
        if chat_template and not getattr(tok, "is_fast", False):
            raise TokenError("--chat-template needs a fast tokenizer (character offsets locate the prompt's tokens)")

    @property
    def plain(self) -> bool:
        return not (self.chat_template or self.drop_special)

    def encode_one(self, text: str) -> tuple[list[int], list[bool]]:
        """(input ids, stored-token mask) of one prompt, untruncated."""
        if not self.chat_template:
            ids = self.tok(text, add_special_tokens=True, truncation=False)["input_ids"]
            return ids, [i not in self.special for i in ids]
        rendered = self.tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                add_generation_prompt=True)
        start = rendered.find(text)
        if start < 0:
            raise TokenError(f"the chat template does not contain the prompt verbatim: {text[:60]!r}")
        end = start + len(text)
        enc = self.tok(rendered, add_special_tokens=False, return_offsets_mapping=True, truncation=False)
        ids = enc["input_ids"]
        keep = [a >= start and b <= end and b > a and i not in self.special
                for i, (a, b) in zip(ids, enc["offset_mapping"], strict=True)]
        return ids, keep

    def lengths(self, texts: list[str], chunk: int = 1024, ids: list[list[int]] | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
        """(model input lengths, stored token counts) of every prompt (``ids``: pretokenized prompts)."""
        if ids is not None:
            n = np.array([len(i) for i in ids], dtype=np.int64)
            return n, n.copy()
        if self.plain:
            total = np.zeros(len(texts), dtype=np.int64)
            for s in range(0, len(texts), chunk):
                enc = self.tok(texts[s : s + chunk], add_special_tokens=True, truncation=False)["input_ids"]
                total[s : s + chunk] = [len(x) for x in enc]
            return total, total.copy()
        pairs = [self.encode_one(t) for t in texts]
        return (np.array([len(i) for i, _ in pairs], dtype=np.int64),
                np.array([sum(k) for _, k in pairs], dtype=np.int64))

    def batch(self, texts: list[str], ids: list[list[int]] | None = None):
        """Padded (input_ids, attention_mask, keep) tensors for one batch (``ids``: pretokenized prompts)."""
        if self.plain and ids is None:
            enc = self.tok(texts, add_special_tokens=True, padding=True, return_tensors="pt",
                           truncation=self.truncate is not None, max_length=self.max_length if self.truncate else None)
            return enc["input_ids"], enc["attention_mask"], enc["attention_mask"].bool()
        pairs = [(i, [True] * len(i)) for i in ids] if ids is not None else [self.encode_one(t) for t in texts]
        if self.truncate and self.max_length:
            cut = (lambda x: x[-self.max_length:]) if self.truncate == "left" else (lambda x: x[: self.max_length])
            pairs = [(cut(i), cut(k)) for i, k in pairs]
        return pad_sequences([i for i, _ in pairs], self.tok.pad_token_id, left=self.tok.padding_side == "left",
                             keep=[k for _, k in pairs])


def pad_sequences(seqs: list[list[int]], pad_id: int, *, left: bool, keep: list[list[bool]] | None = None):
    """(input_ids, attention_mask, keep) tensors of token id lists, padded on the left or the right."""
    import torch

    width = max(len(s) for s in seqs)
    ids = np.full((len(seqs), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), width), dtype=np.int64)
    kept = np.zeros((len(seqs), width), dtype=bool)
    for r, s in enumerate(seqs):
        a = width - len(s) if left else 0
        ids[r, a : a + len(s)] = s
        mask[r, a : a + len(s)] = 1
        kept[r, a : a + len(s)] = True if keep is None else keep[r]
    return torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(kept)
