"""The causal check on lmprobe-tiny: a direction known by construction moves the probe by exactly alpha, a trained
probe's score at a later layer rises with alpha, alpha = 0 changes nothing, ablation removes the component."""

from __future__ import annotations

import numpy as np
import pytest
from support.paths import ROOT

import lmprobe
import lmprobe.probe as probe
from lmprobe.cli import main as cli_main

PROMPTS = ["The film was great.", "The service was terrible.", "I loved the book.", "The coffee was cold."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """lmprobe-tiny over its example prompts, every layer; a mass-mean sentiment probe at layer 2."""
    out = tmp_path_factory.mktemp("steer") / "ds"
    ds = lmprobe.extract("lmprobe-tiny", ROOT / "examples/prompts.jsonl", out=out, layers="all", quiet=True)
    return ds, probe.train_probe(ds, layer=2, method="mass_mean")


def known_probe(dim: int, layer: int, seed: int = 0) -> probe.LinearProbe:
    d = np.random.default_rng(seed).normal(size=dim).astype(np.float32)
    d /= np.linalg.norm(d)
    return probe.LinearProbe(layer, [0, 1], np.zeros(dim, np.float32), np.ones(dim, np.float32), d[None],
                             np.array([0.25], np.float32), {"hookpoint": "resid_post"})


def test_a_direction_known_by_construction_moves_its_own_score_by_alpha(tiny):
    ds, _ = tiny
    p = known_probe(ds.hidden_desc(None).dim, layer=2)
    t = probe.steer("lmprobe-tiny", p, PROMPTS, alphas=[-3, 0, 1.5, 6], read_layer=2, device="cpu")
    np.testing.assert_allclose(t.delta_probe_score, [-3, 0, 1.5, 6], atol=1e-4)  # coef . (alpha d) = alpha
    assert t.delta_probe_score[1] == 0.0 and t.delta_probe_score_std[1] == 0.0
    ab = probe.steer("lmprobe-tiny", p, PROMPTS, ablate=True, read_layer=2, device="cpu")
    assert ab["mode"][0] == "ablate" and ab.probe_score[0] == pytest.approx(0.25, abs=1e-4)  # only the intercept


def test_a_trained_probe_rises_with_alpha_at_a_later_layer_and_alpha_zero_changes_nothing(tiny):
    _, p = tiny
    texts = lmprobe.load(p.settings["trained_on"]).texts[:10]
    t = probe.steer("lmprobe-tiny", p, texts, alphas=[-8, -4, -2, 0, 2, 4, 8], targets=[".", "!"], device="cpu")
    assert (t.read_layer == 3).all()  # the next stored layer
    assert np.all(np.diff(t.probe_score) > 0), t.probe_score.tolist()
    zero = t[t.alpha == 0].iloc[0]
    assert zero.delta_probe_score == 0.0 and zero["delta_logprob[.]"] == 0.0 and zero["delta_logprob[!]"] == 0.0
    assert (t["delta_logprob[.]"].abs().iloc[[0, -1]] > 0).all()  # steering does reach the output


def test_the_unsteered_score_is_what_extract_stored(tiny):
    """The hooks read where extract reads: with a probe at layer 2 and no edit, its score at layer 3 is its score
    on the stored layer-3 vectors."""
    ds, p = tiny
    texts = ds.texts[:6]
    t = probe.steer("lmprobe-tiny", p, texts, alphas=[0], device="cpu")
    assert t.attrs["unsteered_probe_score"] == pytest.approx(float(p.decision_function(ds.hidden(3, rows=range(6)))
                                                                   .mean()), abs=1e-3)


def test_steer_errors_are_one_line_and_early(tiny, tmp_path):
    ds, p = tiny
    with pytest.raises(probe.ProbeError, match="is 3 tokens for this tokenizer"):
        probe.steer("lmprobe-tiny", p, PROMPTS, targets=[" good"])
    with pytest.raises(probe.ProbeError, match="layer 9 is not a block"):
        probe.steer("lmprobe-tiny", p, PROMPTS, layer=9)
    two = probe.train_probe(ds, layer=[1, 2], method="mass_mean")
    with pytest.raises(probe.ProbeError, match="steering needs a probe of one layer"):
        probe.steer("lmprobe-tiny", two, PROMPTS)


def test_cli_steer(tiny, tmp_path, capsys):
    _, p = tiny
    p.save(tmp_path / "p")
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    assert cli_main(["steer", "--model", "lmprobe-tiny", "--probe", str(tmp_path / "p"), "--prompts",
                     str(tmp_path / "prompts.txt"), "--alphas=-4,0,4", "--target", ".", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "delta_probe_score" in out and "logprob[.]" in out and "unsteered probe score at layer 3" in out
    assert cli_main(["steer", "--model", "lmprobe-tiny", "--probe", str(tmp_path / "missing"), "--prompts",
                     str(tmp_path / "prompts.txt")]) == 2


@pytest.mark.parametrize("hookpoint", ["resid_pre", "mlp_out", "mlp_in"])
def test_other_hookpoints_are_steered_where_extract_reads_them(tiny, hookpoint):
    """A pre-hook on an input (resid_pre, mlp_in) or a hook on a sublayer's output (mlp_out): the direction added
    there moves its own score there by exactly alpha."""
    ds, _ = tiny
    p = known_probe(ds.hidden_desc(None).dim, layer=3, seed=1)
    p.settings["hookpoint"] = hookpoint
    t = probe.steer("lmprobe-tiny", p, PROMPTS[:2], alphas=[-2, 0, 3], read_layer=3, device="cpu")
    assert (t.hookpoint == hookpoint).all()
    np.testing.assert_allclose(t.delta_probe_score, [-2, 0, 3], atol=1e-4)
