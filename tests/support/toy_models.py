"""Toy transformers-like models whose blocks are built to order, for the architecture checks' unit tests.

Each toy is a plain torch module with what ``lmprobe.extraction.examine`` relies on: a ``config``, an
input embedding, a ``forward(input_ids, attention_mask=None, position_ids=None, use_cache=None,
output_hidden_states=False)`` that returns ``hidden_states`` (the block inputs, then the last block's
output after a final norm) and a list of blocks under ``layers``. Attention is real causal softmax
attention over the tokens the mask allows, so padded batches and unpadded prompts can be compared.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import nn

WIDTH = 8


class ToyRMSNorm(nn.Module):
    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.3 * torch.randn(width))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class ToyAttention(nn.Module):
    """Causal softmax attention; ``mask`` (batch, tokens) hides padding."""

    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x, mask=None, residual=None):
        t = x.shape[1]
        scores = self.q(x) @ self.k(x).transpose(1, 2) / math.sqrt(x.shape[-1])
        allowed = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[None]
        if mask is not None:
            allowed = allowed & mask[:, None, :].bool()
        scores = scores.masked_fill(~allowed, -1e9)
        out = self.o(scores.softmax(-1) @ self.v(x))
        return out if residual is None else out + residual  # BLOOM adds the residual inside


class ToyMoeAttention(ToyAttention):
    """An attention whose class name says "Moe" (Qwen3-MoE, OLMoE): it is still the attention."""


class ToyMLP(nn.Module):
    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x, residual=None):
        out = self.down(torch.nn.functional.gelu(self.up(x)))
        return out if residual is None else out + residual


class ToySparseMoeBlock(nn.Module):
    """Two experts mixed by a router: the MLP of a mixture-of-experts block."""

    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.gate = nn.Linear(width, 2)
        self.experts = nn.ModuleList([ToyMLP(width), ToyMLP(width)])

    def forward(self, x):
        w = self.gate(x).softmax(-1)
        return w[..., :1] * self.experts[0](x) + w[..., 1:] * self.experts[1](x)


class ToyMixer(nn.Module):
    """A recurrent token mixer (Mamba's place in a hybrid): a causal running mean, then a projection."""

    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x, mask=None):
        if mask is not None:
            x = x * mask[..., None]
        n = torch.arange(1, x.shape[1] + 1, device=x.device)[None, :, None]
        return self.proj(x.cumsum(1) / n)


class ToyBlock(nn.Module):
    """A pre-norm block; ``style`` picks a variant the checks must read right or refuse.

    - ``plain``: x + attn(norm(x)), then + mlp(norm(.)) (Llama);
    - ``scaled``: each branch times 0.25 before its add (Granite's residual_multiplier);
    - ``inside``: attention and MLP add the residual themselves (BLOOM);
    - ``extra``: a second branch added after the MLP (Gemma 4's per-layer input);
    - ``interpolated``: a * x + b * branch (a depth-scaled residual);
    - ``parallel``: x + attn(norm(x)) + mlp(norm(x)) (GPT-J);
    - ``moe``: attention named ...MoeAttention and a sparse MoE block as its MLP;
    - ``mixer``: a recurrent mixer instead of attention (a hybrid's Mamba block);
    - ``no_mlp``: attention only.
    """

    def __init__(self, style: str = "plain", width: int = WIDTH):
        super().__init__()
        self.style = style
        self.input_layernorm = ToyRMSNorm(width)
        if style == "mixer":
            self.mixer = ToyMixer(width)
        elif style == "moe":
            self.self_attn = ToyMoeAttention(width)
        else:
            self.self_attn = ToyAttention(width)
        if style != "no_mlp":
            self.post_attention_layernorm = ToyRMSNorm(width)
            self.mlp = ToySparseMoeBlock(width) if style == "moe" else ToyMLP(width)
        if style == "extra":
            self.branch = nn.Linear(width, width)

    def forward(self, x, mask=None):
        h = self.input_layernorm(x)
        if self.style == "mixer":
            a = self.mixer(h, mask)
        elif self.style == "inside":
            mid = self.self_attn(h, mask, residual=x)
            return self.mlp(self.post_attention_layernorm(mid), residual=mid)
        else:
            a = self.self_attn(h, mask)
        if self.style == "no_mlp":
            return x + a
        if self.style == "parallel":
            return x + a + self.mlp(self.post_attention_layernorm(x))
        if self.style == "interpolated":
            mid = 0.8 * x + 0.6 * a
            return 0.8 * mid + 0.6 * self.mlp(self.post_attention_layernorm(mid))
        scale = 0.25 if self.style == "scaled" else 1.0
        mid = x + scale * a
        out = mid + scale * self.mlp(self.post_attention_layernorm(mid))
        if self.style == "extra":
            out = out + self.branch(out)
        return out


class ToyModel(nn.Module):
    """Embeddings (+ learned absolute positions counted from ``position_offset``), blocks, a final norm.

    ``position_offset`` mimics RoBERTa, whose positions start after the padding index and are computed
    from the input ids when none are passed. ``between`` scales the stream between blocks (hidden
    states that are not the blocks' outputs).
    """

    def __init__(self, styles: list[str], *, vocab: int = 64, position_offset: int = 0, between: float = 1.0,
                 pad_token_id: int = 0, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.config = SimpleNamespace(is_encoder_decoder=False, vocab_size=vocab, pad_token_id=pad_token_id,
                                      model_type="toy")
        self.embed_tokens = nn.Embedding(vocab, WIDTH)
        self.embed_positions = nn.Embedding(64 + position_offset, WIDTH)
        self.layers = nn.ModuleList([ToyBlock(s) for s in styles])
        self.norm = ToyRMSNorm(WIDTH)
        self.position_offset = position_offset
        self.between = between
        self.eval()

    def get_input_embeddings(self):
        return self.embed_tokens

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None, output_hidden_states=False):
        if position_ids is None:
            if self.position_offset:  # RoBERTa: count the non-pad tokens, after the padding index
                real = input_ids.ne(self.config.pad_token_id).long()
                position_ids = real.cumsum(1) * real + self.position_offset - 1
            else:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        x = self.embed_tokens(input_ids) + self.embed_positions(position_ids)
        states = []
        for i, block in enumerate(self.layers):
            states.append(x)
            x = block(x, attention_mask)
            if i < len(self.layers) - 1:
                x = x * self.between
        states.append(self.norm(x))
        return SimpleNamespace(hidden_states=tuple(states) if output_hidden_states else None)
