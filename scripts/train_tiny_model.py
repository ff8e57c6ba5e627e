"""Train ``lmprobe-tiny``, the small causal LM shipped inside lmprobe, on a corpus this script generates.

    python scripts/train_tiny_model.py                 # writes lmprobe/models/tiny/ and examples/prompts.jsonl

The corpus is template English with a learnable structure: sentiment sentences ("the film was
wonderful and I loved it"), facts ("the capital of France is Paris"), counting, days and months. A
~1M-parameter Llama-style model learns it within a few CPU minutes, so its next-token predictions
and perplexities mean something, and a linear probe can read sentiment from its hidden states.
Everything is seeded: the same script gives the same tokenizer and a model of the same quality.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "lmprobe" / "models" / "tiny"
EXAMPLES = ROOT / "examples" / "prompts.jsonl"

SUBJECTS = ["the film", "the movie", "this book", "the meal", "the pizza", "our hotel", "the concert", "the service",
            "the game", "this phone", "the coffee", "the show", "the album", "the trip", "the class", "the room"]
POSITIVE = ["wonderful", "great", "excellent", "delightful", "amazing", "lovely", "brilliant", "fantastic", "superb",
            "charming"]
NEGATIVE = ["terrible", "awful", "boring", "dreadful", "horrible", "disappointing", "bland", "poor", "dull", "rude"]
POS_VERBS = ["loved", "enjoyed", "adored", "liked"]
NEG_VERBS = ["hated", "regretted", "disliked", "loathed"]
TRAIN_TEMPLATES = [
    "{s} was {a}.",
    "I thought {s} was {a}.",
    "Honestly, {s} was {a} and I {v} it.",
    "We all agreed that {s} was really {a}.",
    "Everyone said {s} was {a}, and they {v} it.",
    "In the end {s} was {a}.",
]
FACTS = [("France", "Paris"), ("Spain", "Madrid"), ("Italy", "Rome"), ("Germany", "Berlin"), ("Japan", "Tokyo"),
         ("Egypt", "Cairo"), ("Peru", "Lima"), ("Kenya", "Nairobi"), ("Norway", "Oslo"), ("Greece", "Athens"),
         ("Canada", "Ottawa"), ("Chile", "Santiago")]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
COLORS = [("sky", "blue"), ("grass", "green"), ("snow", "white"), ("coal", "black"), ("blood", "red"),
          ("sun", "yellow")]


def sentiment_sentence(rng: random.Random, templates: list[str], label: int) -> str:
    adj = rng.choice(POSITIVE if label else NEGATIVE)
    verb = rng.choice(POS_VERBS if label else NEG_VERBS)
    text = rng.choice(templates).format(s=rng.choice(SUBJECTS), a=adj, v=verb)
    return text[0].upper() + text[1:]


def corpus(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.55:
            out.append(sentiment_sentence(rng, TRAIN_TEMPLATES, rng.randrange(2)))
        elif kind < 0.7:
            country, city = rng.choice(FACTS)
            out.append(f"The capital of {country} is {city}.")
        elif kind < 0.8:
            start = rng.randrange(len(NUMBERS) - 4)
            out.append(" ".join(NUMBERS[start : start + rng.randrange(4, len(NUMBERS) - start + 1)]))
        elif kind < 0.9:
            seq = DAYS if rng.random() < 0.5 else MONTHS
            start = rng.randrange(len(seq) - 3)
            out.append(", ".join(seq[start : start + rng.randrange(3, len(seq) - start + 1)]) + ".")
        else:
            thing, color = rng.choice(COLORS)
            out.append(f"The {thing} is {color}.")
    return out


# Example prompts: whole sentences, and sentences cut before a word that depends on the sentiment
# (where the model must carry it to the last token). Text outside the corpus gets very high
# perplexity from a model this small, so the examples keep to the corpus's templates.
EXAMPLE_TEMPLATES = TRAIN_TEMPLATES + ["Honestly, {s} was {a} and I", "Everyone said {s} was {a}, and they"]


def example_prompts(rng: random.Random, n: int = 48) -> list[dict]:
    """Labelled sentiment prompts (1 = positive)."""
    rows = []
    for i in range(n):
        label = i % 2
        rows.append({"text": sentiment_sentence(rng, EXAMPLE_TEMPLATES, label), "label": label,
                     "sentiment": "positive" if label else "negative"})
    return rows


def build_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", padding_side="left", model_max_length=128)


def main() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--examples-only", action="store_true", help="only rewrite examples/prompts.jsonl")
    args = ap.parse_args()
    if args.examples_only:
        write_examples(args.seed)
        return

    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    train = corpus(rng, 30000)
    valid = corpus(random.Random(args.seed + 1), 1000)
    tok = build_tokenizer(train, vocab_size=512)
    eos = tok.eos_token_id
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=320, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=tok.bos_token_id, eos_token_id=eos, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.2f}M parameters, vocab {len(tok)}, {len(train)} training sentences")

    def batch(texts: list[str]):
        enc = tok([t + tok.eos_token for t in texts], padding=True, return_tensors="pt")
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        pos = (enc["attention_mask"].cumsum(1) - 1).clamp(min=0)
        return enc["input_ids"], enc["attention_mask"], pos, labels

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    model.train()
    t0 = time.time()
    for step in range(args.steps):
        ids, mask, pos, labels = batch(rng.sample(train, 64))
        loss = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 250 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.time() - t0:.0f}s")
    model.eval()
    with torch.no_grad():
        ids, mask, pos, labels = batch(valid[:256])
        vloss = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss.item()
    print(f"validation loss {vloss:.3f}, perplexity {math.exp(vloss):.2f}")

    if args.out.exists():
        shutil.rmtree(args.out)
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save_pretrained(args.out)
    (args.out / "README.md").write_text(
        "# lmprobe-tiny\n\n"
        f"A {n_params / 1e6:.2f}M-parameter Llama-style causal LM (6 layers, hidden 128, vocab {len(tok)}) shipped with "
        "lmprobe so that `lmprobe extract --model lmprobe-tiny` works offline. Trained by "
        f"`scripts/train_tiny_model.py` ({args.steps} steps, seed {args.seed}) on template English the script "
        "generates: sentiment sentences, capitals, counting, days and months. Validation perplexity "
        f"{math.exp(vloss):.2f}. Left padding, a BOS token added by default. Not a useful language model "
        "beyond that corpus: text outside it gets perplexities in the thousands.\n"
    )
    write_examples(args.seed)
    print(f"wrote {args.out} and {EXAMPLES}")


def write_examples(seed: int) -> None:
    EXAMPLES.parent.mkdir(parents=True, exist_ok=True)
    with open(EXAMPLES, "w") as f:
        for row in example_prompts(random.Random(seed + 2)):
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
