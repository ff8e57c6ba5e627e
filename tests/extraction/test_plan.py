"""The job's plan (lmprobe/extraction/plan.py, ``lmprobe extract --dry-run``): pure arithmetic tested at the real
numbers of the SAE builders' jobs (W1-W3 of docs/publishing.md: 10^9-10^10 tokens, 64-128 GPUs), and checked against small
real jobs (the plan must be honest to within 10%)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.paths import ROOT

import lmprobe
from lmprobe.errors import InvalidArgumentError
from lmprobe.extraction.plan import Cluster, GiB, Shape, make_plan, place_model
from lmprobe.format.spec import INDEX_PATH

GB = 10**9
HUB = "hf://datasets/me/acts"
CTX = 8192  # Llama 3's window
ENGLISH = 1.4  # text bytes a token in the index: ~4.2 characters a token, zstd's ~3x on prose


def shape(tokens, layers, hidden, *, model_bytes, **kw):
    kw.setdefault("text_bytes_per_token", ENGLISH)
    return Shape("full_sequence", rows=-(-tokens // CTX), tokens=tokens, site_row_bytes=(hidden * 2,) * layers,
                 exact=False, model_bytes=model_bytes, **kw)


W1 = shape(10**9, 3, 4096, model_bytes=16 * GB)
W2 = shape(10**10, 1, 4096, model_bytes=16 * GB)
W3 = shape(2 * 10**9, 1, 8192, model_bytes=141 * GB)
NODES8 = Cluster(64, 8, 80 * GB)
NODES16 = Cluster(128, 8, 80 * GB)


def test_w1_is_planned_on_its_plain_command_with_a_short_tail():
    """8B, 10^9 tokens, 3 layers, bf16, 8 x 8 GPUs straight to the Hub: 1 GiB shards, ~23,200 files, nested folders
    under 10,000 entries, each node stages a few shards per rank (not the 22 TiB dataset), and the dataset is complete
    within 15 minutes of the last shard written (one committer, up to 1,000 files a commit)."""
    p = make_plan(W1, destination=HUB, cluster=NODES8)
    assert p.refused is None
    assert p.shard_bytes == GiB and p.layout == "nested"
    assert 23_000 <= p.files <= 23_400
    assert p.largest_folder_entries <= 10_000
    assert p.largest_file_bytes == max(p.index_files[0], GiB)  # the index, here
    assert p.ranks == 64 and p.gpus_per_rank == 1
    assert 20 * 2**40 < p.dataset_bytes < 25 * 2**40
    assert p.staging_bytes_per_node < 200 * GiB  # the check asks a node for this, not for the dataset
    assert p.commits < 60  # where a committer per rank, 50 files a commit, made 465
    assert p.tail_seconds <= 15 * 60, p.describe()
    assert p.as_json()["index_files"][0] < 20 * GB


def test_w2_grows_its_shards_to_fit_the_hubs_folders_and_names_the_size_when_asked_for_less():
    """10^10 tokens, 1 layer: 1 GiB shards would put 76,000 files in one folder; without --shard-size the plan takes
    8 GiB; asking for 1 GiB is refused with the size that works."""
    p = make_plan(W2, destination=HUB, cluster=NODES8)
    assert p.refused is None, p.refused
    assert p.shard_bytes == 8 * GiB
    assert p.largest_folder_entries <= 10_000
    assert p.largest_file_bytes < 20 * GB
    assert p.index_files[0] < 20 * GB  # without --token-ids
    refused = make_plan(W2, destination=HUB, cluster=NODES8, shard_bytes=GiB).refused
    assert refused and "--shard-size 8GiB" in refused and "entries in one folder" in refused
    # a local folder takes it: a warning, not a refusal
    local = make_plan(W2, destination="/data/w2", cluster=NODES8, shard_bytes=GiB)
    assert local.refused is None and any("--shard-size 8GiB" in w for w in local.warnings)


def test_w2_with_token_ids_says_the_index_is_past_what_the_hub_advises():
    p = make_plan(shape(10**10, 1, 4096, model_bytes=16 * GB, token_ids=True, id_bytes_per_token=3.0),
                  destination=HUB, cluster=NODES8)
    assert p.refused is None and p.index_files[0] > 20 * GB
    assert any("--token-ids" in w and "20 GB" in w for w in p.warnings)
    huge = make_plan(shape(10**10, 1, 4096, model_bytes=16 * GB, token_ids=True, perplexity=True),
                     destination=HUB, cluster=NODES8)
    assert huge.refused and "the index would be" in huge.refused and "--token-ids" in huge.refused


def test_w3_spreads_the_70b_model_over_four_gpus_a_rank():
    p = make_plan(W3, destination=HUB, cluster=NODES16)
    assert p.refused is None, p.refused
    assert (p.ranks, p.gpus_per_rank) == (32, 4)
    assert "--device-map auto" in p.placement and "--nproc_per_node 2" in p.placement
    assert p.largest_folder_entries <= 10_000


@pytest.mark.parametrize(("model_gb", "gpu_gb", "expected"), [(16, 80, 1), (60, 80, 1), (70, 80, 2), (141, 80, 4),
                                                                 (141, 141, 2), (500, 80, 8)])
def test_placement_takes_the_fewest_gpus_of_a_node_that_hold_the_model(model_gb, gpu_gb, expected):
    ranks, per_rank, _, refused = place_model(model_gb * GB, Cluster(16, 8, gpu_gb * GB))
    assert refused is None and per_rank == expected and ranks == 16 // expected


def test_a_model_larger_than_a_node_is_refused_with_numbers():
    ranks, _, _, refused = place_model(800 * GB, Cluster(16, 8, 80 * GB))
    assert ranks == 0 and "800.0 GB" not in refused and "8 GPU" in refused and "--gpu-memory" in refused


def test_a_job_past_any_shard_size_says_to_split_it():
    p = make_plan(shape(10**12, 1, 4096, model_bytes=0), destination=HUB, cluster=NODES8)
    assert p.refused and "split the job" in p.refused


def test_the_tail_waits_for_the_hours_window_when_the_job_committed_much():
    """A job that spent its hour's commits before the tail waits for the window; the plan says so."""
    many = shape(10**9, 3, 4096, model_bytes=0)
    fast = make_plan(many, destination=HUB, cluster=NODES8, shard_bytes=GiB)
    slow = make_plan(many, destination=HUB, cluster=NODES8, shard_bytes=GiB, commits_per_hour=30)
    assert slow.tail_seconds > 3600 > fast.tail_seconds


def test_an_unknown_size_is_planned_without_numbers_and_says_how_to_size_it():
    p = make_plan(Shape("full_sequence", 0, 0, (8192,), known=False), destination=HUB, cluster=None)
    assert not p.known and p.refused is None and "--max-tokens" in p.describe()


# ---------------------------------------------------------------------------------------------- small real jobs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(0)
    words = np.array("the of and to in is was for on that with as by at from river city music science".split())
    path = tmp_path_factory.mktemp("corpus") / "long.jsonl"
    with open(path, "w") as f:
        for _ in range(40):
            f.write(json.dumps({"text": " ".join(rng.choice(words, size=int(rng.integers(800, 2000))))}) + "\n")
    return path


def _real(out: Path) -> dict:
    files = [p for p in out.rglob("*") if p.is_file() and ".lmprobe" not in p.name]
    folders = {}
    for p in files:
        folders[p.parent] = folders.get(p.parent, 0) + 1
    return {"files": len(files), "largest_folder_entries": max(folders.values()),
            "largest_file_bytes": max(p.stat().st_size for p in files), "index": (out / INDEX_PATH).stat().st_size}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("token_ids", [False, True])
def test_the_plan_is_honest_about_a_small_real_job(corpus, tmp_path, dtype, token_ids):
    """The plan of a corpus extraction, then the extraction itself: files, folders, the largest file and the index's
    size agree within 10%."""
    kw = dict(max_tokens=40_000, context_len=128, storage="full_sequence", layers="0,2", shard_size="128KB",
              dtype=dtype, token_ids=token_ids, quiet=True)
    plan = lmprobe.plan("lmprobe-tiny", str(corpus), out=str(tmp_path / "out"), **kw)
    lmprobe.extract("lmprobe-tiny", str(corpus), out=str(tmp_path / "out"), **kw)
    real = _real(tmp_path / "out")
    assert plan.files == pytest.approx(real["files"], rel=0.1)
    assert plan.largest_folder_entries == pytest.approx(real["largest_folder_entries"], rel=0.1)
    assert plan.largest_file_bytes == pytest.approx(real["largest_file_bytes"], rel=0.15)
    assert plan.index_files[0] == pytest.approx(real["index"], rel=0.1)
    assert plan.staging_bytes_per_node == pytest.approx(sum(p.stat().st_size for p in (tmp_path / "out").rglob("*")
                                                            if p.is_file()), rel=0.1)


def test_the_plan_counts_the_rows_a_corpus_of_short_documents_makes(tmp_path):
    """Documents shorter than a window each make a row of their own: the plan counts the rows its sample of the
    corpus says, so that files (one a row here) and the index agree with the real job within 10%."""
    rng = np.random.default_rng(1)
    words = np.array("the of and to in is was for on that with as by at from river city music science".split())
    src = tmp_path / "short.jsonl"
    with open(src, "w") as f:
        for _ in range(600):
            f.write(json.dumps({"text": " ".join(rng.choice(words, size=int(rng.integers(15, 90))))}) + "\n")
    kw = dict(max_tokens=12_000, context_len=128, storage="full_sequence", layers="1", shard_size="32KB", quiet=True)
    plan = lmprobe.plan("lmprobe-tiny", str(src), out=str(tmp_path / "out"), **kw)
    lmprobe.extract("lmprobe-tiny", str(src), out=str(tmp_path / "out"), **kw)
    real = _real(tmp_path / "out")
    assert plan.files == pytest.approx(real["files"], rel=0.1)
    assert plan.index_files[0] == pytest.approx(real["index"], rel=0.1)


def test_every_rank_plans_from_rank_0s_sample(tmp_path):
    """Ranks hold different prompts (prompt i is rank i % world's): the lengths the plan packs sequence shards from
    are rank 0's on every rank, so that every rank plans the same files, shard size and layout."""
    from support.ranks import Ranks

    from lmprobe.extraction.config import ExtractionConfig
    from lmprobe.extraction.preparation import plan_job, prepare
    from lmprobe.extraction.torchrun import Ranks as JobRanks

    prompts = [("the river city " * 8).strip() if i % 2 == 0 else "music" for i in range(40)]  # rank 0: long
    cfg = ExtractionConfig(model="lmprobe-tiny", prompts=prompts, out=str(tmp_path / "out"), storage="full_sequence",
                           layers="1", shard_size="64KB", quiet=True)
    plan_job(prepare(cfg))  # one process first: transformers' lazy imports are not safe from two threads at once
    plans, errors = Ranks(2).run(lambda rank, gather: plan_job(prepare(cfg, JobRanks(rank, 2, gather))).as_json())
    assert errors == [None, None]
    assert plans[0] == plans[1]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_plan_is_honest_about_what_a_hub_job_stages(hub, corpus, tmp_path, monkeypatch, dtype):
    """A job straight to the Hub whose uplink is slower than its model (the case the space check must cover) stages,
    at its peak, what the plan says a node needs, within 10%: the shards being filled, those a checkpoint hands
    over, those uploading, and the index parts, checkpoint copy and records that grow with the part."""
    import threading
    import uuid

    from support.nodes import disk_use

    cache = tmp_path / "cache"
    monkeypatch.setenv("LMPROBE_CACHE", str(cache))
    out = f"hf://datasets/user/staged-{uuid.uuid4().hex[:8]}"
    kw = dict(max_tokens=20_000, context_len=128, storage="full_sequence", layers="0,2", shard_size="128KB",
              dtype=dtype, quiet=True)
    plan = lmprobe.plan("lmprobe-tiny", str(corpus), out=out, **kw)
    assert plan.staging_bytes_per_node < plan.dataset_bytes / 5  # a few shards and records, not the dataset
    peak, stop = [0], threading.Event()

    def poll():
        while not stop.is_set():
            peak[0] = max(peak[0], disk_use(cache))
            stop.wait(0.01)

    poller = threading.Thread(target=poll, daemon=True)
    # the shards take ~20 s to go up, the model ~2 s to make them (10 times as fast, also on a loaded machine)
    hub.throttle_uploads(plan.dataset_bytes / 20)
    poller.start()
    try:
        lmprobe.extract("lmprobe-tiny", str(corpus), out=out, **kw)
    finally:
        hub.throttle_uploads(None)
        stop.set()
        poller.join()
    assert peak[0] == pytest.approx(plan.staging_bytes_per_node, rel=0.1), plan.describe()


def test_the_plan_of_prompts_counts_their_tokens(tmp_path):
    prompts = ROOT / "examples" / "prompts.jsonl"
    plan = lmprobe.plan("lmprobe-tiny", str(prompts), out=str(tmp_path / "o"), storage="full_sequence")
    ds = lmprobe.extract("lmprobe-tiny", str(prompts), out=str(tmp_path / "o"), storage="full_sequence", quiet=True)
    assert plan.site_bytes[0] == (int(ds.column("num_tokens").sum()) + ds.num_prompts) * ds.dim * 4
    assert plan.files == _real(tmp_path / "o")["files"]


def test_a_plan_loads_no_weights_and_a_refused_real_run_stops_before_them(monkeypatch, corpus):
    from lmprobe.extraction import loop, preparation

    loads = []
    for module in (preparation, loop):
        monkeypatch.setattr(module, "load_model", lambda *a, **k: loads.append(1))
    big = dict(max_tokens=10**12, context_len=128, storage="full_sequence", layers="0", shard_size="1GiB",
               world_size=64)
    plan = lmprobe.plan("lmprobe-tiny", str(corpus), out=HUB, **big)
    assert plan.refused and "entries in one folder" in plan.refused
    with pytest.raises(InvalidArgumentError, match="entries in one folder"):
        lmprobe.extract("lmprobe-tiny", str(corpus), out=HUB, quiet=True, **big)
    assert not loads


def test_dry_run_prints_the_plan_as_text_and_json(corpus, tmp_path):
    base = [sys.executable, "-m", "lmprobe", "extract", "--model", "lmprobe-tiny", "--prompts", str(corpus),
            "--out", HUB, "--max-tokens", "1G", "--context-len", "128", "--storage", "full_sequence",
            "--dtype", "bfloat16", "--world-size", "64"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    text = subprocess.run([*base, "--dry-run"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    for words in ("shard size", "largest folder", "index:", "staging disk per node", "model:", "commits:",
                  "until the dataset is complete", "Hub storage"):
        assert words in text.stdout
    js = subprocess.run([*base, "--dry-run", "json"], capture_output=True, text=True, env=env, cwd=tmp_path)
    plan = json.loads(js.stdout)
    for key in ("files", "largest_folder_entries", "largest_file_bytes", "index_files", "staging_bytes_per_node",
                "commits", "tail_seconds", "ranks", "gpus_per_rank", "refused"):
        assert key in plan
    assert plan["ranks"] == 64 and plan["refused"] is None and not (tmp_path / "out").exists()
    refused = subprocess.run([*base[:-1], "64", "--max-tokens", "1000G", "--shard-size", "1GiB", "--dry-run", "json"],
                             capture_output=True, text=True, env=env, cwd=tmp_path)
    assert refused.returncode == 1 and "--shard-size" not in refused.stderr
    assert "split the job" in json.loads(refused.stdout)["refused"] or \
        "--shard-size" in json.loads(refused.stdout)["refused"]


def test_the_space_check_of_a_remote_output_counts_what_the_node_stages(monkeypatch, corpus, hub, tmp_path):
    """With 1 GiB free, a 10^8-token extraction into a local folder is refused; the same one straight to the Hub
    starts, since its node stages a few shards, not the dataset."""
    from lmprobe.errors import OutOfSpaceError
    from lmprobe.extraction import runner

    monkeypatch.setenv("LMPROBE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(runner.shutil, "disk_usage", lambda path: shutil_usage(free=GiB))
    kw = dict(max_tokens=10**8, context_len=128, storage="full_sequence", layers="0", shard_size="16MB", quiet=True)
    with pytest.raises(OutOfSpaceError, match="free"):
        lmprobe.extract("lmprobe-tiny", str(corpus), out=str(tmp_path / "local-out"), **kw)

    class Started(Exception):
        pass

    def started(*a, **k):
        raise Started

    monkeypatch.setattr(runner, "run_corpus", started)
    with pytest.raises(Started):
        lmprobe.extract("lmprobe-tiny", str(corpus), out="hf://datasets/user/space-check", **kw)
    plan = lmprobe.plan("lmprobe-tiny", str(corpus), out="hf://datasets/user/space-check", **kw)
    assert plan.staging_bytes_per_node < GiB < plan.dataset_bytes


def shutil_usage(*, free: int):
    import shutil

    return shutil._ntuple_diskusage(100 * GiB, 100 * GiB - free, free)

