"""ProbeEnsemble: members over resamples or methods, averaged; saved and loaded beside each other."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.features import gaussian, write

import lmprobe.probe as probe


def test_resampled_ensemble_is_stable_on_a_clear_signal_and_saves(tmp_path, rng):
    X, y = gaussian(rng, n=200, dim=8, shift=2.0, correlated=False)
    write(tmp_path / "ds", {0: X}, y)
    ens = probe.ProbeEnsemble.resampled(tmp_path / "ds", layer=0, n=8, method="mass_mean", seed=1)
    assert len(ens.probes) == 8 and len({tuple(p.direction.round(5)) for p in ens.probes}) == 8  # resamples differ
    mean_cos, min_cos = ens.direction_agreement()
    assert mean_cos > 0.95 and min_cos > 0.9
    assert ens.score(X, y) > 0.9
    meta = ens.save(tmp_path / "ens")
    assert json.loads(meta.read_text())["members"] == [f"ens-{i}" for i in range(8)]
    back = probe.ProbeEnsemble.load(tmp_path / "ens")
    np.testing.assert_allclose(back.decision_function(X), ens.decision_function(X), rtol=1e-6)
    meta.write_text(json.dumps({"format": "lmprobe-probe-ensemble/1", "members": ["../../etc/passwd"]}))
    with pytest.raises(probe.ProbeError, match="is not an lmprobe probe ensemble"):
        probe.ProbeEnsemble.load(tmp_path / "ens")


def test_ensemble_of_methods_averages_their_scores(tmp_path, rng):
    X, y = gaussian(rng, n=150, dim=6, shift=1.5)
    write(tmp_path / "ds", {0: X}, y)
    ens = probe.ProbeEnsemble.of_methods(tmp_path / "ds", layer=0, methods=["logistic", "mass_mean", "lda"])
    assert [p.settings["method"] for p in ens.probes] == ["logistic", "mass_mean", "lda"]
    np.testing.assert_allclose(ens.decision_function(X),
                               np.mean([p.decision_function(X) for p in ens.probes], axis=0), rtol=1e-6)
    assert ens.score(X, y) >= min(p.score(X, y) for p in ens.probes) - 0.02
