"""Tiny random models with locally trained tokenizers (no downloads), for extraction tests."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "The cat sat on the mat and looked at the bird.",
    "A quick brown fox jumps over the lazy dog.",
    "Interpretability researchers study the activations of language models.",
    "The weather today is sunny with a light breeze from the west.",
    "I loved this film, the acting was wonderful and the story moving.",
    "This was a terrible meal, cold and far too salty.",
    "Numbers like 12, 345 and 6789 appear in text as well.",
    "She said: \"hello there!\" and walked away quickly.",
] * 4


def train_tokenizer(out: Path, *, kind: str, padding_side: str, vocab_size: int = 300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<pad>"] if kind != "bert" else ["[UNK]", "[CLS]", "[SEP]", "[PAD]"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    if kind == "llama":
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                       pad_token="<pad>", padding_side=padding_side)
    elif kind == "gpt2":
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="</s>", eos_token="</s>", unk_token="<unk>",
                                       padding_side=padding_side)  # no pad token: lmprobe must pick one
    else:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                       sep_token="[SEP]", padding_side=padding_side)
    fast.save_pretrained(out)
    return fast


def build_llama(out: Path, *, padding_side: str = "left", layers: int = 4, hidden: int = 32, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = train_tokenizer(out, kind="llama", padding_side=padding_side)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def build_gpt2(out: Path, *, padding_side: str = "right", layers: int = 3, hidden: int = 32, seed: int = 0) -> Path:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = train_tokenizer(out, kind="gpt2", padding_side=padding_side)
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=len(tok), n_embd=hidden, n_layer=layers, n_head=4, n_positions=128,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    GPT2LMHeadModel(cfg).save_pretrained(out)
    return out


def build_bert(out: Path, *, layers: int = 2, hidden: int = 32, seed: int = 0) -> Path:
    import torch
    from transformers import BertConfig, BertModel

    tok = train_tokenizer(out, kind="bert", padding_side="right")
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                     intermediate_size=2 * hidden, max_position_embeddings=128, pad_token_id=tok.pad_token_id)
    BertModel(cfg).save_pretrained(out)
    return out
