"""Run inside a virtual environment holding SAELens and EleutherAI's sparsify (``sae-lens``, ``eai-sparsify``).

    python sae_libraries.py OUT_DIR

Saves SAEs of several architectures with each library's own code (random weights), encodes a
fixed batch of inputs with each library's own ``encode``, and writes what it returned, so that the
test (tests/sae/test_sae_sources.py) can compare it with lmprobe's exported dictionaries.
"""

import json
import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

out = Path(sys.argv[1])
torch.manual_seed(0)
d_in, d_sae = 16, 48
x = torch.randn(64, d_in)
results = {"x": x}


def randomise(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        if hasattr(module, "threshold"):
            module.threshold.data = module.threshold.data.abs()


from sae_lens import (  # noqa: E402
    SAE,
    GatedSAE,
    GatedSAEConfig,
    JumpReLUSAE,
    JumpReLUSAEConfig,
    StandardSAE,
    StandardSAEConfig,
    TopKSAE,
    TopKSAEConfig,
)
from sae_lens.saes.sae import SAEMetadata  # noqa: E402

for name, cls, cfg_cls, extra in [
    ("standard", StandardSAE, StandardSAEConfig, {}),
    ("standard_no_bdec", StandardSAE, StandardSAEConfig, {"apply_b_dec_to_input": False}),
    ("topk", TopKSAE, TopKSAEConfig, {"k": 6}),
    ("topk_rescaled", TopKSAE, TopKSAEConfig, {"k": 6, "rescale_acts_by_decoder_norm": True}),
    ("jumprelu", JumpReLUSAE, JumpReLUSAEConfig, {}),
    ("gated", GatedSAE, GatedSAEConfig, {}),
]:
    sae = cls(cfg_cls(d_in=d_in, d_sae=d_sae, metadata=SAEMetadata(hook_name="blocks.2.hook_resid_post"), **extra))
    randomise(sae)
    sae.save_model(str(out / "saelens" / name))
    loaded = SAE.load_from_disk(str(out / "saelens" / name), device="cpu")
    with torch.no_grad():
        results[f"saelens/{name}"] = loaded.encode(x)

from sparsify import SparseCoder, SparseCoderConfig  # noqa: E402

for name, cfg in [("layers.2", SparseCoderConfig(num_latents=d_sae, k=6)),
                  ("layers.3", SparseCoderConfig(num_latents=d_sae, k=6)),
                  ("layers.3.mlp", SparseCoderConfig(num_latents=d_sae, k=6, transcode=True))]:
    sc = SparseCoder(d_in, cfg)
    randomise(sc)
    sc.save_to_disk(out / "sparsify" / name)
    loaded = SparseCoder.load_from_disk(out / "sparsify" / name)
    with torch.no_grad():
        top_acts, top_indices, pre_acts = loaded.encode(x)
    results[f"sparsify/{name}/top_acts"] = top_acts
    results[f"sparsify/{name}/top_indices"] = top_indices
    results[f"sparsify/{name}/pre_acts"] = pre_acts

save_file({k: v.contiguous() for k, v in results.items()}, str(out / "encoded.safetensors"))
print(json.dumps(sorted(results)))
