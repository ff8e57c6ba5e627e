"""Where the weights go (lmprobe/extraction/placement.py): ``--device-map auto`` spreads a model with accelerate over
the GPUs, the CPU and disk, and stores the same vectors as the model in memory."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from support.datasets import PROMPTS
from support.paths import SUPPORT

import lmprobe
from lmprobe.cli import main as cli_main
from lmprobe.errors import ExtractionError, InvalidArgumentError, ModelError
from lmprobe.extraction import loop as loop_mod
from lmprobe.extraction import model as model_mod
from lmprobe.extraction.placement import Placement, parse_max_memory, plan_placement, rank_gpus

GiB = 2**30


# ---------------------------------------------------------------- the arithmetic


def test_max_memory_is_read_as_accelerate_takes_it():
    assert parse_max_memory("0=70GiB,1=70GiB,cpu=200GiB,disk=1TB") == {0: 70 * GiB, 1: 70 * GiB, "cpu": 200 * GiB,
                                                                       "disk": 10**12}
    assert parse_max_memory(" CPU = 1KB ") == {"cpu": 1000}


@pytest.mark.parametrize(("text", "says"), [
    ("", "names no device"),
    ("cpu", "is not DEVICE=SIZE"),
    ("0=70GiB,,cpu=1GB", "is not DEVICE=SIZE"),
    ("gpu0=70GiB", "unknown device 'gpu0'"),
    ("cuda:0=70GiB", "unknown device 'cuda:0'"),
    ("0=70GiB,0=60GiB", "names '0' twice"),
    ("cpu=lots", "device 'cpu': cannot read 'lots' as a size"),
    ("cpu=-1GB", "device 'cpu'"),
])
def test_a_bad_max_memory_is_one_line_naming_the_fix(text, says):
    with pytest.raises(InvalidArgumentError, match="--max-memory") as exc:
        parse_max_memory(text)
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_a_rank_spreads_over_its_share_of_the_node():
    assert rank_gpus(0, 1, 8) == range(8)  # one rank per node: every GPU of it
    assert [rank_gpus(r, 2, 8) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [rank_gpus(r, 8, 8) for r in range(8)] == [range(r, r + 1) for r in range(8)]
    assert [rank_gpus(r, 3, 8) for r in range(3)] == [range(0, 2), range(2, 4), range(4, 6)]
    assert rank_gpus(0, 4, 0) == range(0)  # no GPU: the CPU and disk
    with pytest.raises(InvalidArgumentError, match="--nproc_per_node 2 or fewer"):
        rank_gpus(0, 4, 2)


def test_a_rank_numbers_max_memory_from_its_first_gpu():
    # 2 ranks on an 8-GPU node: rank 1's "0" is the node's GPU 4
    p = plan_placement("cuda", device_map="auto", max_memory="0=70GiB,3=10GiB,cpu=200GiB", n_gpus=8, local_rank=1,
                       local_world=2)
    assert p.max_memory == {4: 70 * GiB, 7: 10 * GiB, "cpu": 200 * GiB} and p.gpus == (4, 5, 6, 7)
    with pytest.raises(InvalidArgumentError, match="names GPU 4, but this rank .* 4 GPU"):
        plan_placement("cuda", device_map="auto", max_memory="4=1GB", n_gpus=8, local_rank=1, local_world=2)
    # no --max-memory: the rank's own GPUs only, as much as each has free
    free = {i: (i + 1) * GiB for i in range(8)} | {"cpu": 100 * GiB}
    p = plan_placement("cuda", device_map="auto", max_memory=None, n_gpus=8, local_rank=1, local_world=4, free=free)
    assert p.max_memory == {2: 3 * GiB, 3: 4 * GiB, "cpu": 100 * GiB}
    # one process: accelerate's own choice over every visible GPU
    p = plan_placement("cuda", device_map="auto", max_memory=None, n_gpus=8)
    assert p.max_memory is None and p.gpus == tuple(range(8)) and p.spread


def test_placement_errors_name_the_fix():
    with pytest.raises(InvalidArgumentError, match="names GPU 0, and this process runs on cpu with no GPU"):
        plan_placement("cpu", device_map="auto", max_memory="0=1GB,cpu=1GB", n_gpus=0)
    with pytest.raises(InvalidArgumentError, match="--device cuda:1 puts the whole model on one GPU.*--device auto"):
        plan_placement("cuda:1", device_map="auto", max_memory=None, n_gpus=2)
    with pytest.raises(InvalidArgumentError, match="this process sees 2 GPU"):
        plan_placement("cuda", device_map="auto", max_memory="2=1GB", n_gpus=2)
    # --device cpu keeps the model off the GPUs
    p = plan_placement("cpu", device_map="auto", max_memory=None, n_gpus=0, free={0: GiB, "cpu": 4 * GiB})
    assert p.max_memory == {"cpu": 4 * GiB}
    assert plan_placement("cuda:0", device_map=None, max_memory=None, n_gpus=1) == Placement("cuda:0")


# ---------------------------------------------------------------- the errors, before the weights load


def _no_weights(monkeypatch):
    monkeypatch.setattr(model_mod, "load_model", lambda *a, **k: pytest.fail("weights loaded before the error"))
    monkeypatch.setattr(loop_mod, "load_model", lambda *a, **k: pytest.fail("weights loaded before the error"))


def test_accelerate_missing_says_how_to_install_it(llama_dir, tmp_path, monkeypatch, capsys):
    _no_weights(monkeypatch)
    monkeypatch.setitem(sys.modules, "accelerate", None)  # `import accelerate` raises ImportError
    with pytest.raises(ModelError, match=r"pip install 'lmprobe\[accelerate\]'"):
        lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "a", device_map="auto", quiet=True)
    f = tmp_path / "p.txt"
    f.write_text("hello\n")
    assert cli_main(["extract", "--model", str(llama_dir), "--prompts", str(f), "--out", str(tmp_path / "b"),
                     "--device-map", "auto"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("lmprobe extract: error: --device-map auto spreads the model with accelerate, which is not "
                           "installed: pip install 'lmprobe[accelerate]'"), err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_cli_refuses_a_bad_max_memory_in_one_line(llama_dir, tmp_path, monkeypatch, capsys):
    _no_weights(monkeypatch)
    f = tmp_path / "p.txt"
    f.write_text("hello\n")
    base = ["extract", "--model", str(llama_dir), "--prompts", str(f), "--out", str(tmp_path / "o")]
    assert cli_main([*base, "--device-map", "auto", "--max-memory", "0:70GiB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmprobe extract: error: --max-memory '0:70GiB': '0:70GiB' is not DEVICE=SIZE")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert cli_main([*base, "--max-memory", "cpu=1GB"]) == 2  # without --device-map: refused by the config
    assert "pass --device-map auto too" in capsys.readouterr().err
    assert cli_main([*base, "--device-map", "auto", "--device", "cpu", "--max-memory", "0=1GB"]) == 2
    err = capsys.readouterr().err
    assert "names GPU 0, and this process runs on cpu" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ExtractionError, match="--max-memory"):
        lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "o", max_memory="cpu=1GB")


# ---------------------------------------------------------------- the same vectors, spread over the CPU and disk


def _forcing_disk(model_dir) -> str:
    """A max_memory whose CPU holds about two thirds of the model's weights: the rest goes to disk."""
    weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    return f"cpu={int(weights * 0.66)},disk=1GB"


@pytest.fixture
def spread_models(monkeypatch):
    """The models ``load_model`` returns, to look at where accelerate put their modules."""
    loaded = []
    real = model_mod.load_model

    def spy(*a, **k):
        out = real(*a, **k)
        loaded.append(out[0])
        return out

    monkeypatch.setattr(model_mod, "load_model", spy)
    monkeypatch.setattr(loop_mod, "load_model", spy)
    return loaded


@pytest.mark.parametrize("storage", ["pooled", "full_sequence"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_model_offloaded_to_disk_stores_what_the_model_in_memory_does(llama_dir, tmp_path, spread_models, storage,
                                                                        dtype):
    kw = dict(layers="all", storage=storage, dtype=dtype, logits_topk=5, perplexity=True, batch_size=3,
              device="cpu", quiet=True)
    ref = lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "ref", **kw)
    assert spread_models and not hasattr(spread_models[-1], "hf_device_map")
    ds = lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "spread", device_map="auto",
                         max_memory=_forcing_disk(llama_dir), **kw)
    where = spread_models[-1].hf_device_map
    assert "disk" in where.values() and "cpu" in where.values(), where  # really spread over the CPU and disk
    run = ds.info["runs"][0]
    assert run["device"] == "cpu" and run["device_map"] == "auto" and run["max_memory"]["disk"] == 10**9
    # placement is not part of the extraction: the fingerprint is the in-memory run's
    assert ds.info["extraction"]["settings"] == ref.info["extraction"]["settings"]
    assert ds.num_prompts == ref.num_prompts == len(PROMPTS)
    for layer in ref.layers:
        a, b = ref.hidden(layer), ds.hidden(layer)
        assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ds.logits_topk()[0], ref.logits_topk()[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(ds.logits_topk()[1], ref.logits_topk()[1])
    a, b = ref.index, ds.index
    np.testing.assert_allclose(b["perplexity_mean"], a["perplexity_mean"], rtol=1e-6)
    for x, y in zip(a["token_perplexity"], b["token_perplexity"], strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-6)
    assert ds.info["statistics"] is not None


def test_a_spread_model_is_examined_like_the_model_in_memory(llama_dir):
    """When no miniature runs, the loaded model is examined: spread over the CPU and disk, it reads the same."""
    from transformers import AutoTokenizer

    from lmprobe.extraction.examine import examine
    from lmprobe.extraction.model import read_model_spec
    from lmprobe.extraction.placement import placement_of

    spec = read_model_spec(str(llama_dir))
    pad = AutoTokenizer.from_pretrained(llama_dir).pad_token_id
    found = []
    for placement in (Placement("cpu"), placement_of("cpu", device_map="auto", max_memory=_forcing_disk(llama_dir))):
        model, _ = model_mod.load_model(spec, placement=placement, quiet=True)
        assert placement.spread == ("disk" in getattr(model, "hf_device_map", {}).values())
        arch = examine(model, pad_token_id=pad, padding_side="left", checked_on="loaded model")
        found.append((arch.block_path, arch.inputs, [str(arch.reading(hp, 1)) for hp in ("resid_pre", "mlp_out")]))
    assert found[0] == found[1]


def test_cli_device_map_auto_end_to_end(llama_dir, tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    out = tmp_path / "ds"
    assert cli_main(["extract", "--model", str(llama_dir), "--prompts", str(f), "--out", str(out), "--layers", "0,-1",
                     "--storage", "full_sequence", "--device", "cpu", "--device-map", "auto", "--max-memory",
                     _forcing_disk(llama_dir)]) == 0
    captured = capsys.readouterr()
    assert f"wrote {len(PROMPTS)} prompts x 2 layers" in captured.out
    assert "model spread by accelerate:" in captured.err and "disk:" in captured.err
    ds = lmprobe.load(out)
    assert ds.info["runs"][0]["device_map"] == "auto"
    ref = lmprobe.extract(str(llama_dir), PROMPTS, out=tmp_path / "ref", layers="0,-1", storage="full_sequence",
                          device="cpu", quiet=True)
    for layer in ref.layers:
        np.testing.assert_allclose(ds.hidden(layer), ref.hidden(layer), rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # end-to-end: torchrun, two processes (gloo)
def test_torchrun_ranks_each_spread_their_model_and_divide_the_prompts(llama_dir, tmp_path):
    import os
    import subprocess

    many = [dict(p, text=p["text"] + f" #{i}") for i in range(3) for p in PROMPTS]
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(p) for p in many) + "\n")
    single = lmprobe.extract(str(llama_dir), f, out=tmp_path / "one", layers="0,3", storage="full_sequence",
                             logits_topk=3, batch_size=4, device="cpu", quiet=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "lmprobe", "extract", "--model", str(llama_dir), "--prompts", str(f), "--layers", "0,3",
                        "--storage", "full_sequence", "--logits-topk", "3", "--batch-size", "4", "--device", "cpu",
                        "--device-map", "auto", "--max-memory", _forcing_disk(llama_dir), "--out",
                        str(tmp_path / "two")], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("model spread by accelerate:") == 2 and "disk:" in r.stderr  # on each rank
    two = lmprobe.load(tmp_path / "two")
    assert two.texts == single.texts and two.num_prompts == len(many)
    for layer in (0, 3):
        np.testing.assert_allclose(two.hidden(layer), single.hidden(layer), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(two.logits_topk()[1], single.logits_topk()[1])
    runs = two.info["runs"]
    assert sorted(run["part"] for run in runs) == [0, 1] and all(run["device_map"] == "auto" for run in runs), runs


@pytest.mark.slow  # a subprocess killed like kill -9
def test_a_run_killed_in_memory_resumes_spread_over_the_cpu_and_disk(llama_dir, tmp_path):
    """Placement is not part of the extraction: an output begun with the model in memory finishes with the model
    spread (after an out-of-memory error, say), and each run is recorded with its placement."""
    import subprocess

    many = [dict(p, text=p["text"] + f" #{i}") for i in range(3) for p in PROMPTS]
    kw = dict(layers="0,2", storage="full_sequence", batch_size=3, shard_size="3KB", logits_topk=3, perplexity=True,
              device="cpu", quiet=True)
    ref = lmprobe.extract(str(llama_dir), many, out=tmp_path / "ref", **kw)
    out = tmp_path / "ds"
    crash = SUPPORT / "_crash_extract.py"
    r = subprocess.run([sys.executable, str(crash), json.dumps([many, str(llama_dir), str(out), 3, kw])],
                       capture_output=True, text=True)
    assert r.returncode == 9, r.stderr
    done = json.loads((out / ".lmprobe-staging" / "state.json").read_text())["num_prompts"]
    assert 0 < done < len(many)
    ds = lmprobe.extract(str(llama_dir), many, out=out, device_map="auto", max_memory=_forcing_disk(llama_dir), **kw)
    assert ds.texts == ref.texts
    for layer in (0, 2):
        np.testing.assert_allclose(ds.hidden(layer), ref.hidden(layer), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ds.index["perplexity_mean"], ref.index["perplexity_mean"], rtol=1e-6)
    runs = ds.info["runs"]
    assert [(r["first_row"], r.get("device_map")) for r in runs] == [(0, None), (done, "auto")], runs
