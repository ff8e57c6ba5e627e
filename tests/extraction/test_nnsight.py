"""The nnsight backend gives the same dataset as the transformers backend, locally and through remote serialisation."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from support.datasets import PROMPTS

import lmprobe
from lmprobe.extraction import backend_nnsight
from lmprobe.extraction import model as model_mod

KW = dict(layers="all", batch_size=3, logits_topk=4, perplexity=True, quiet=True)


def _compare(a, b):
    assert a.layers == b.layers
    for layer in a.layers:
        np.testing.assert_allclose(a.hidden(layer), b.hidden(layer), atol=1e-4, rtol=0)
    va, ia = a.logits_topk()
    vb, ib = b.logits_topk()
    np.testing.assert_allclose(va, vb, atol=1e-4)
    np.testing.assert_array_equal(ia, ib)
    for col in ("perplexity_mean", "perplexity_min", "perplexity_max", "num_tokens"):
        np.testing.assert_allclose(a.index[col], b.index[col], rtol=1e-4)


@pytest.mark.parametrize("which", ["llama_dir", "gpt2_dir"])
@pytest.mark.parametrize("remote", [False, "local"])
def test_nnsight_matches_transformers(request, tmp_path, which, remote):
    model_dir = str(request.getfixturevalue(which))
    ref = lmprobe.extract(model_dir, PROMPTS, out=tmp_path / "hf", **KW)
    nn = lmprobe.extract(model_dir, PROMPTS, out=tmp_path / "nn", backend="nnsight", remote=remote, **KW)
    _compare(ref, nn)
    prov = nn.info["provenance"]
    assert prov["extraction_backend"] == "nnsight" and prov["nnsight_version"] and prov["nnsight_remote"] == remote


def test_nnsight_full_sequence_and_early_stop(llama_dir, tmp_path):
    ref = lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "hf", layers="0,2", storage="full_sequence",
                          quiet=True)
    nn = lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "nn", layers="0,2", storage="full_sequence",
                         backend="nnsight", quiet=True)
    for i in range(len(PROMPTS)):
        np.testing.assert_allclose(ref.token_hidden(i, 2), nn.token_hidden(i, 2), atol=1e-4, rtol=0)


def test_missing_nnsight_says_how_to_install(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "nnsight", None)
    with pytest.raises(backend_nnsight.NnsightError, match=r"pip install 'lmprobe\[nnsight\]'"):
        lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "x", backend="nnsight")


def test_remote_without_a_key_fails_before_any_work(llama_dir, tmp_path, monkeypatch):
    from nnsight import CONFIG

    monkeypatch.delenv("NNSIGHT_API_KEY", raising=False)
    monkeypatch.delenv("NDIF_API_KEY", raising=False)
    monkeypatch.setattr(CONFIG.API, "APIKEY", None)
    monkeypatch.setattr(model_mod, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(backend_nnsight.NnsightError, match="NNSIGHT_API_KEY"):
        lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "x", backend="nnsight", remote=True)
    assert not (tmp_path / "x").exists()


def test_transient_remote_failures_are_retried_and_persistent_ones_stop_resumably(llama_dir, tmp_path, monkeypatch):
    from lmprobe.base.retry import RetryPolicy

    class RemoteError(Exception):
        pass

    # the injected fault is transient because the retry policy names it; retries do not wait
    monkeypatch.setattr(backend_nnsight, "default_retry",
                        lambda: RetryPolicy(retry_on_exceptions=(RemoteError,), max_retries=3, base_wait=0.0))
    real = backend_nnsight.NnsightBackend.run_once
    calls = {"n": 0}

    def flaky(self, *a, **k):
        calls["n"] += 1
        if calls["n"] in (2, 3):  # the second batch fails twice, then goes through
            raise RemoteError("503 from NDIF")
        return real(self, *a, **k)

    monkeypatch.setattr(backend_nnsight.NnsightBackend, "run_once", flaky)
    ref = lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "ref", **KW)
    ds = lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "a", backend="nnsight", **KW)
    assert calls["n"] == 3 + 2  # three batches, two of the tries failed
    _compare(ref, ds)

    def down_after_first(self, *a, **k):
        calls["n"] += 1
        if calls["n"] > 1:
            raise RemoteError("NDIF is down")
        return real(self, *a, **k)

    calls["n"] = 0
    monkeypatch.setattr(backend_nnsight.NnsightBackend, "run_once", down_after_first)
    with pytest.raises(backend_nnsight.NnsightError, match="run the same command again to resume"):
        lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "b", backend="nnsight", checkpoint_interval=1e9, **KW)
    done = []
    monkeypatch.setattr(backend_nnsight.NnsightBackend, "run_once",
                        lambda self, ids, *a, **k: (done.append(len(ids)), real(self, ids, *a, **k))[1])
    ds = lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "b", backend="nnsight", **KW)
    assert sum(done) == len(PROMPTS) - 3  # the first batch was kept
    _compare(ref, ds)


def test_a_bug_in_a_batch_is_not_retried(llama_dir, tmp_path, monkeypatch):
    calls = {"n": 0}

    def buggy(self, *a, **k):
        calls["n"] += 1
        raise TypeError("unsupported operand")

    monkeypatch.setattr(backend_nnsight.NnsightBackend, "run_once", buggy)
    with pytest.raises(TypeError, match="unsupported operand"):
        lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "c", backend="nnsight", **KW)
    assert calls["n"] == 1
