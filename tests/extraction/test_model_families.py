"""Every architecture: each named hookpoint right on every block, or refused before the weights load.

Fast tests examine toy models whose blocks are built to order (tests/support/toy_models.py): each variant a
real architecture has (residual multipliers, residuals added inside a module, branches after the MLP,
interpolated residuals, parallel blocks, mixture-of-experts naming, hybrids, position offsets) is
read where the identities of docs/hookpoints.md hold, or refused. The slow zoo test does the same
for a tiny random model of every model type in the installed transformers' causal-LM mapping
against transformers itself (tests/support/zoo_check.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.toy_models import ToyModel

from lmprobe.errors import ModelError
from lmprobe.extraction.backend_hf import TransformersBackend
from lmprobe.extraction.examine import examine, plan_captures
from lmprobe.extraction.hookpoints import Reading, Site

NAMED = ["resid_pre", "attn_out", "resid_mid", "mlp_in", "mlp_out", "resid_post"]
PRE, POST = Site("", "input"), Site("", "output")


def _examine(model, side="right"):
    return examine(model, pad_token_id=0, padding_side=side)


def _extract(model, arch, hookpoints, layers, prompts):
    """Each hookpoint on each layer for a right-padded batch of ``prompts``: {(hookpoint, layer): [per prompt]}."""
    caps = plan_captures(arch, hookpoints, layers, hidden_size=8)
    backend = TransformersBackend(model, model.layers, causal_lm=False, inputs=arch.inputs)
    t = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), t), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        s = t - len(p) if arch.inputs.padding_side == "left" else 0
        ids[b, s:s + len(p)] = torch.tensor(p)
        mask[b, s:s + len(p)] = 1
    with torch.no_grad():
        res = backend.run(ids, mask, layers=layers, storage="full_sequence", out_dtype=torch.float32, logits_topk=None,
                          perplexity=False, captures=caps)
    starts = np.concatenate([[0], np.cumsum([len(p) for p in prompts])])
    return {k: [v.numpy()[starts[i]:starts[i + 1]] for i in range(len(prompts))] for k, v in res.hidden.items()}


def _sublayer_outputs(model, layer, prompt):
    """What block ``layer``'s attention (or mixer) and MLP modules return for one unpadded prompt."""
    got = {}
    block = model.layers[layer]

    def hook(name):
        def keep(_m, _a, out):
            got.setdefault(name, out.detach()[0].numpy())
        return keep

    handles = [m.register_forward_hook(hook(n)) for n, m in block.named_children() if n in ("self_attn", "mixer", "mlp")]
    with torch.no_grad():
        model(torch.tensor([prompt]))
    for h in handles:
        h.remove()
    return got


PROMPTS = [[5, 9, 3, 7, 11], [4, 2], [8, 6, 13]]


def test_plain_pre_norm_blocks_read_each_module_with_a_hook():
    arch = _examine(ToyModel(["plain", "plain"]))
    r = arch.blocks[1].readings
    assert r["attn_out"] == Reading(Site("self_attn", "output"))
    assert r["resid_mid"] == Reading(Site("post_attention_layernorm", "input"))
    assert r["mlp_in"] == Reading(Site("mlp", "input"))
    assert r["mlp_out"] == Reading(Site("mlp", "output"))
    assert arch.blocks[1].kind == "pre_norm" and not arch.blocks[1].refusals


@pytest.mark.parametrize("style", ["scaled", "inside"])
def test_a_scaled_branch_or_a_residual_added_inside_the_module_is_read_as_what_the_stream_gains(style):
    """Granite's residual_multiplier and BLOOM's residual inside its modules: attn_out/mlp_out are what the
    block adds (resid_mid - resid_pre, resid_post - resid_mid), so the identities hold exactly: the stream's
    difference for a multiplier, the module's own last projection when the residual is added inside."""
    model = ToyModel([style, style])
    arch = _examine(model)
    r = arch.blocks[0].readings
    if style == "scaled":
        assert r["attn_out"].minus == PRE and r["mlp_out"].site == POST
    else:
        assert r["attn_out"] == Reading(Site("self_attn.o", "output"))
        assert r["mlp_out"] == Reading(Site("mlp.down", "output"))
    got = _extract(model, arch, NAMED, [0, 1], PROMPTS)
    for layer in (0, 1):
        for i, p in enumerate(PROMPTS):
            pre, attn, mid, mlp, post = (got[(hp, layer)][i] for hp in
                                         ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post"))
            np.testing.assert_allclose(pre + attn, mid, atol=1e-5)
            np.testing.assert_allclose(mid + mlp, post, atol=1e-5)
            mods = _sublayer_outputs(model, layer, p)
            if style == "scaled":  # the module's output times the multiplier, not the module's output
                np.testing.assert_allclose(attn, 0.25 * mods["self_attn"], atol=1e-5)
                np.testing.assert_allclose(mlp, 0.25 * mods["mlp"], atol=1e-5)
            else:  # the module returns stream + branch: the branch alone
                np.testing.assert_allclose(attn, mods["self_attn"] - pre, atol=1e-5)


def test_a_branch_added_after_the_mlp_refuses_mlp_out_and_keeps_the_rest():
    arch = _examine(ToyModel(["extra", "extra"]))
    b = arch.blocks[0]
    assert "mlp_out" in b.refusals and "mlp:output" in b.refusals["mlp_out"]
    assert {"resid_pre", "attn_out", "resid_mid", "mlp_in", "resid_post"} <= set(b.readings)
    with pytest.raises(ModelError, match=r"no mlp_out: .*adds more than its MLP's output.*--hookpoints 'mlp:output'"):
        plan_captures(arch, ["mlp_out"], [0, 1], hidden_size=8)


def test_an_interpolated_residual_is_refused_rather_than_stored_with_a_meaning_it_does_not_have():
    arch = _examine(ToyModel(["interpolated"] * 2))
    assert set(arch.blocks[0].readings) == {"resid_pre", "resid_post", "mlp_in"}
    assert "is not its input plus the output" in arch.blocks[0].refusals["resid_mid"]
    for hp in ("attn_out", "resid_mid", "mlp_out"):
        with pytest.raises(ModelError, match=f"no {hp}"):
            plan_captures(arch, [hp], [1], hidden_size=8)


def test_parallel_blocks_have_two_branches_and_no_resid_mid():
    model = ToyModel(["parallel"] * 2)
    arch = _examine(model)
    b = arch.blocks[0]
    assert b.kind == "parallel" and "in parallel" in b.refusals["resid_mid"]
    got = _extract(model, arch, ["resid_pre", "attn_out", "mlp_out", "resid_post"], [1], PROMPTS)
    for i in range(len(PROMPTS)):
        np.testing.assert_allclose(got[("resid_pre", 1)][i] + got[("attn_out", 1)][i] + got[("mlp_out", 1)][i],
                                   got[("resid_post", 1)][i], atol=1e-5)


def test_an_attention_named_moe_does_not_hide_the_mixture_of_experts_mlp():
    """Qwen3-MoE's attention class is Qwen3MoeAttention: it must not count as a second MLP."""
    arch = _examine(ToyModel(["moe"] * 2))
    b = arch.blocks[1]
    assert b.mixer == "self_attn" and b.mlp == "mlp"
    assert set(b.readings) == set(NAMED)


def test_hybrid_blocks_are_examined_one_by_one_and_attn_out_exists_on_the_attention_blocks_only():
    model = ToyModel(["mixer", "plain", "mixer", "plain"])
    arch = _examine(model)
    assert arch.layers_with("attn_out") == [1, 3]
    assert arch.layers_with("resid_mid") == [0, 1, 2, 3]  # a Mamba block has a stream before its MLP too
    assert "has no attention" in arch.blocks[0].refusals["attn_out"] and "'mixer:output'" in arch.blocks[0].refusals["attn_out"]
    with pytest.raises(ModelError, match=r"'attn_out' does not exist on layer 0.*exists on layers 1,3: pass --layers 1,3"):
        plan_captures(arch, ["attn_out"], [0, 1, 2, 3], hidden_size=8)
    got = _extract(model, arch, ["resid_pre", "attn_out", "resid_mid"], [1, 3], PROMPTS)
    for i in range(len(PROMPTS)):
        np.testing.assert_allclose(got[("resid_pre", 3)][i] + got[("attn_out", 3)][i], got[("resid_mid", 3)][i],
                                   atol=1e-5)


def test_a_block_without_mlp_refuses_the_mlp_hookpoints():
    arch = _examine(ToyModel(["no_mlp"] * 2))
    for hp in ("resid_mid", "mlp_in", "mlp_out"):
        assert "has no MLP" in arch.blocks[0].refusals[hp]
    assert arch.blocks[0].readings["attn_out"] == Reading(Site("self_attn", "output"))


def test_hidden_states_that_are_not_the_blocks_outputs_are_refused():
    with pytest.raises(ModelError, match="not the inputs and outputs of one list of blocks"):
        _examine(ToyModel(["plain"] * 3, between=0.5))


def test_block_path_names_the_block_list_or_is_refused():
    model = ToyModel(["plain"] * 2)
    assert examine(model, pad_token_id=0, padding_side="right", block_path="layers").block_path == "layers"
    with pytest.raises(ModelError, match="--block-path 'norm' does not name a list of modules"):
        examine(model, pad_token_id=0, padding_side="right", block_path="norm")


@pytest.mark.parametrize("offset, side, want_positions", [(0, "left", True), (2, "left", False), (2, "right", False)])
def test_positions_are_passed_only_when_the_model_needs_them(offset, side, want_positions):
    """Learned absolute positions with left padding need positions counted over real tokens; a model that
    counts them from its padding index (RoBERTa) computes its own, and lmprobe's would be off by the offset."""
    model = ToyModel(["plain"] * 2, position_offset=offset)
    arch = _examine(model, side)
    assert arch.inputs.position_ids is want_positions
    got = _extract(model, arch, ["resid_post"], [0, 1], PROMPTS)
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            alone = model(torch.tensor([p]), output_hidden_states=True).hidden_states
        np.testing.assert_allclose(got[("resid_post", 0)][i], alone[1][0].numpy(), atol=1e-5)


# ------------------------------------------------------------------------------------------------ the zoo


def _zoo_types():
    from support.zoo import ZOO_SKIPPED, ZOO_TYPES

    return [t for t in ZOO_TYPES if t not in ZOO_SKIPPED]


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (tiny tensors: threads only add overhead, and 2 cores are shared), and the
    count restored after: the tests after it compare bytes with subprocesses that use the default."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", _zoo_types())
def test_every_architecture_stores_right_numbers_or_refuses(model_type, tmp_path, one_thread):
    """A tiny random model of each model type in the installed transformers' causal-LM mapping: every named
    hookpoint lmprobe stores equals what transformers computes (hidden states, hooks on the blocks) and satisfies
    its identities on every block, from padded batches; every one it does not store is refused before the
    weights load. A future transformers' new architectures are covered by running this again."""
    from support.zoo import build_zoo_model
    from support.zoo_check import check

    model_dir = build_zoo_model(model_type, tmp_path / "model")
    row = check(model_type, model_dir, tmp_path)
    assert not row.errors, "\n".join(row.errors)
    if row.model_refused is None:
        assert row.layers["resid_pre"] and row.layers["resid_post"]  # the stream itself is always there


def test_the_zoo_covers_every_causal_lm_type_of_the_installed_transformers():
    """Nothing is left out silently: every type is in the zoo, or skipped with a reason that is about the type."""
    from support.zoo import ZOO_SKIPPED, ZOO_TYPES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert set(ZOO_TYPES) == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert all(reason.strip() for reason in ZOO_SKIPPED.values())
    assert len(ZOO_SKIPPED) <= 0.05 * len(ZOO_TYPES)
