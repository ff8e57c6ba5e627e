"""SAELens' own activation cache, both ways, in the interop venv (tests/saelens/test_saelens.py).

    python saelens_cache.py write OUT      # CacheActivationsRunner writes OUT/cache from a tiny model
    python saelens_cache.py train CACHE HOOK CONTEXT D_IN OUT   # LanguageModelSAETrainingRunner trains from CACHE

No Hub: the model is a TransformerLens ``HookedTransformer`` built from a ``HookedTransformerConfig``
with random weights (seed 0), and the dataset is a local, already tokenized ``datasets.Dataset``.
``CacheActivationsRunner`` loads its model by name only (``sae_lens.load_model``, which downloads),
so ``load_model`` in its module is replaced by a function returning that tiny model; everything
else, the activation store and the dataset writing, is SAELens' own code.

``write`` also saves OUT/expected.npz: every row of the cache as ``datasets.load_from_disk`` reads
it (``acts`` (rows, context, d_in), ``token_ids``), and the TransformerLens activations of the
first row's tokens recomputed with ``run_with_cache`` (``recomputed``); and OUT/hub/, what the
runner's ``push_to_hub`` uploads (the shuffled rows as ``data/train-00000-of-00001.parquet``, and
``cache_activations_runner_cfg.json``), with those rows' activations as ``hub_acts``. ``train`` saves
OUT/trained.json (optimizer steps taken, whether W_dec is finite, the SAE folder) and OUT/read.npz:
the cache as ``load_from_disk`` reads it, and the first batch the activation store serves
(``store_first``, (2 * context, d_in)).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

CONTEXT, D_MODEL, HOOK = 8, 16, "blocks.1.hook_resid_post"


def tiny_model():
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(n_layers=2, d_model=D_MODEL, n_ctx=CONTEXT, d_head=4, n_heads=4, d_mlp=32, d_vocab=50,
                                  act_fn="relu", normalization_type="LN", seed=0, device="cpu")
    return HookedTransformer(cfg).eval()


def tokens_dataset(n: int):
    from datasets import Dataset

    rng = np.random.default_rng(0)
    return Dataset.from_dict({"tokens": rng.integers(0, 50, size=(n, CONTEXT)).tolist()})


def dump(cache: Path, hook: str) -> dict[str, np.ndarray]:
    from datasets import load_from_disk

    ds = load_from_disk(str(cache))
    ds.set_format("numpy")
    out = {"acts": np.asarray(ds[hook], dtype=np.float32)}
    if "token_ids" in ds.column_names:
        out["token_ids"] = np.asarray(ds["token_ids"], dtype=np.int64)
    return out


def write(out: Path) -> None:
    import sae_lens.cache_activations_runner as car
    from sae_lens import CacheActivationsRunner, CacheActivationsRunnerConfig

    model = tiny_model()
    car.load_model = lambda **kw: model  # no Hub: the runner's model is the tiny one
    batch, per_buffer, n_buffers = 4, 2, 3  # three buffers of two model batches: three data files
    tokens = batch * per_buffer * n_buffers * CONTEXT
    cfg = CacheActivationsRunnerConfig(
        dataset_path="local-tokens", model_name="tiny", model_batch_size=batch, hook_name=HOOK, d_in=D_MODEL,
        training_tokens=tokens, context_size=CONTEXT, new_cached_activations_path=str(out / "cache"), shuffle=True,
        seed=7, dtype="float32", device="cpu", buffer_size_gb=batch * per_buffer * CONTEXT * D_MODEL * 4 / 1e9,
        prepend_bos=False)
    shuffled = CacheActivationsRunner(cfg, override_dataset=tokens_dataset(64)).run()
    # what the runner's push_to_hub (hf_repo_id) uploads: the shuffled dataset as Parquet under data/,
    # and its config as cache_activations_runner_cfg.json (written the runner's way)
    (out / "hub" / "data").mkdir(parents=True)
    shuffled.to_parquet(str(out / "hub" / "data" / "train-00000-of-00001.parquet"))
    (out / "hub" / "cache_activations_runner_cfg.json").write_text(json.dumps(asdict(cfg), indent=2, ensure_ascii=False))
    shuffled.set_format("numpy")
    hub_acts = np.asarray(shuffled[HOOK], dtype=np.float32)
    got = dump(out / "cache", HOOK)
    with torch.no_grad():
        _, acts = model.run_with_cache(torch.as_tensor(got["token_ids"][:1]), names_filter=[HOOK])
    np.savez(out / "expected.npz", **got, recomputed=acts[HOOK][0].numpy(), hub_acts=hub_acts)


def train(cache: Path, hook: str, context: int, d_in: int, out: Path) -> None:
    from sae_lens import LanguageModelSAERunnerConfig, LanguageModelSAETrainingRunner, LoggingConfig
    from sae_lens.saes.standard_sae import StandardTrainingSAEConfig

    steps, batch_tokens = 5, 2 * context
    cfg = LanguageModelSAERunnerConfig(
        sae=StandardTrainingSAEConfig(d_in=d_in, d_sae=4 * d_in), model_name="tiny", hook_name=hook,
        dataset_path="local-tokens", is_dataset_tokenized=True, streaming=False, context_size=context,
        use_cached_activations=True, cached_activations_path=str(cache), training_tokens=steps * batch_tokens,
        train_batch_size_tokens=batch_tokens, store_batch_size_prompts=2, n_batches_in_buffer=2, device="cpu",
        act_store_device="cpu", prepend_bos=False, logger=LoggingConfig(log_to_wandb=False), checkpoint_path=None,
        output_path=str(out / "sae"), n_checkpoints=0)
    from sae_lens.training.activations_store import ActivationsStore
    from sae_lens.training.sae_trainer import SAETrainer

    fit, seen = SAETrainer.fit, {}

    def counted_fit(self):  # the number of optimizer steps the trainer took
        sae = fit(self)
        seen["steps"] = self.n_training_steps
        return sae

    SAETrainer.fit = counted_fit
    model = tiny_model()
    sae = LanguageModelSAETrainingRunner(cfg, override_model=model, override_dataset=tokens_dataset(8)).run()
    w = sae.W_dec.detach().numpy()
    (out / "trained.json").write_text(json.dumps({"steps": seen.get("steps"), "W_dec_finite": bool(np.isfinite(w).all()),
                                                  "d_in": int(w.shape[1]), "sae_dir": str(out / "sae")}))
    # the store's first batch: what training reads, from the cache (store_batch_size_prompts rows)
    store = ActivationsStore.from_config(model, cfg, override_dataset=tokens_dataset(8))
    first, _ = store.get_raw_llm_batch()
    np.savez(out / "read.npz", **dump(cache, hook), store_first=first.numpy().astype(np.float32))


if __name__ == "__main__":
    torch.manual_seed(0)
    if sys.argv[1] == "write":
        write(Path(sys.argv[2]))
    else:
        train(Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), Path(sys.argv[6]))
