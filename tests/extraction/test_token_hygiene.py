"""--drop-special-tokens and --chat-template: what the model sees versus what is stored."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from support.datasets import PROMPTS

import lmprobe
from lmprobe.format.validate import validate

TEXTS = [p["text"] for p in PROMPTS]


def _forward(model_dir, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    acts = {}
    hooks = [blk.register_forward_hook(lambda m, a, o, i=i: acts.__setitem__(i, o[0] if isinstance(o, tuple) else o))
             for i, blk in enumerate(model.model.layers)]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    for h in hooks:
        h.remove()
    return {i: a[0] for i, a in acts.items()}, logits


def test_drop_special_tokens(llama_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    ds = lmprobe.extract(str(llama_dir), TEXTS, out=tmp_path / "ds", layers="2", storage="full_sequence",
                         drop_special_tokens=True, token_ids=True, perplexity=True, batch_size=3, quiet=True)
    for i, text in enumerate(TEXTS):
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id
        acts, logits = _forward(llama_dir, ids)
        assert list(ds.index["token_ids"][i]) == ids[1:] and ds.index["num_tokens"][i] == len(ids) - 1
        np.testing.assert_allclose(ds.token_hidden(i, 2), acts[2][1:].numpy(), atol=1e-4, rtol=0)
        nll = torch.nn.functional.cross_entropy(logits[1:-1], torch.tensor(ids[2:]), reduction="none")
        np.testing.assert_allclose(ds.index["token_perplexity"][i], torch.exp(nll).numpy(), rtol=1e-4)
    assert validate(tmp_path / "ds").ok


@pytest.fixture(scope="module")
def chat_llama(llama_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("chat") / "m"
    shutil.copytree(llama_dir, d)
    tok = AutoTokenizer.from_pretrained(d)
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} [end]"
                         "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    tok.save_pretrained(d)
    return d


def test_chat_template_stores_only_the_prompt(chat_llama, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_llama)
    ds = lmprobe.extract(str(chat_llama), TEXTS, out=tmp_path / "ds", layers="1", storage="full_sequence",
                         chat_template=True, token_ids=True, batch_size=4, quiet=True)
    for i, text in enumerate(TEXTS):
        rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
        enc = tok(rendered, add_special_tokens=False, return_offsets_mapping=True)
        start = rendered.find(text)
        keep = [a >= start and b <= start + len(text) and b > a for a, b in enc["offset_mapping"]]
        stored = [t for t, k in zip(enc["input_ids"], keep, strict=True) if k]
        assert list(ds.index["token_ids"][i]) == stored
        assert tok.decode(stored).strip() == text.strip()
        acts, _ = _forward(chat_llama, enc["input_ids"])
        np.testing.assert_allclose(ds.token_hidden(i, 1), acts[1][torch.tensor(keep)].numpy(), atol=1e-4, rtol=0)
        np.testing.assert_allclose(ds.hidden(1)[i], acts[1][torch.tensor(keep)][-1].numpy(), atol=1e-4, rtol=0)


def test_chat_template_errors(llama_dir, chat_llama, tmp_path):
    with pytest.raises(ValueError, match="has no chat template"):
        lmprobe.extract(str(llama_dir), TEXTS, out=tmp_path / "a", chat_template=True)
    with pytest.raises(ValueError, match="--truncate cannot be combined"):
        lmprobe.extract(str(chat_llama), TEXTS, out=tmp_path / "b", chat_template=True, truncate="left")
