"""lmprobe merge and multi-process extraction with torch.distributed (2 CPU processes, gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from support.datasets import PROMPTS, write_dataset

import lmprobe
from lmprobe.cli import main as cli_main
from lmprobe.format.merge import merge_datasets
from lmprobe.format.validate import validate

INDEX = "index/train-00000-of-00001.parquet"
MANY = [dict(p, text=p["text"] + f" #{i}") for i in range(3) for p in PROMPTS]  # 21 prompts


@pytest.mark.slow  # end-to-end: real processes and model loads
@pytest.mark.parametrize("storage", ["pooled", "full_sequence"])
def test_merge_of_parts_equals_the_whole(tmp_path, rng, storage):
    parts = []
    for k in range(3):
        parts.append(write_dataset(tmp_path / f"p{k}", rng, n=7 + k, layers=(0, 2), dim=4, storage=storage,
                                   shard_size="64B", logits_topk=2, statistics=True))
    out = merge_datasets([tmp_path / f"p{k}" for k in range(3)], tmp_path / "m")
    ds = lmprobe.load(out)
    assert ds.num_prompts == 7 + 8 + 9
    assert validate(out).ok, str(validate(out))
    ends = [src["tok_start"][1:] - 1 for src in parts]
    want = np.concatenate([src["hidden"][2][e] if storage == "full_sequence" else src["hidden"][2]
                           for src, e in zip(parts, ends, strict=True)])
    np.testing.assert_array_equal(ds.hidden(2), want)
    np.testing.assert_array_equal(ds.logits_topk()[0], np.concatenate([s["lv"] for s in parts]))
    if storage == "full_sequence":
        src = parts[2]
        np.testing.assert_array_equal(ds.token_hidden(7 + 8 + 4, 0),
                                      src["hidden"][0][src["tok_start"][4] : src["tok_start"][5]])
        stored = np.concatenate([ds.token_hidden(i, 0) for i in range(ds.num_prompts)])
    else:
        stored = ds.hidden(0)
    stored = stored.astype(np.float64)
    stats = ds.statistics(0)
    assert stats["count"] == len(stored)
    # float32 partials per batch, merged in float64: within 1e-6 of the float64 reference (a mean near
    # zero at the data's scale)
    np.testing.assert_allclose(stats["mean"], stored.mean(0), rtol=1e-6, atol=1e-6 * stored.std(0).max())
    np.testing.assert_allclose(stats["std"], stored.std(0), rtol=1e-6)


@pytest.mark.slow
def test_merge_refuses_mismatched_parts(tmp_path, rng, capsys):
    write_dataset(tmp_path / "a", rng, n=4, layers=(0,), dim=4)
    write_dataset(tmp_path / "b", rng, n=4, layers=(0,), dim=5)
    assert cli_main(["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m")]) == 2
    assert "hidden_layers.dim is 5, part 0 has 4" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
def test_merge_refuses_a_part_given_twice(tmp_path, rng, capsys):
    """A A, a part and its link or copy, or two extractions of the same prompts would hold every prompt twice
    (probe folds then share prompts)."""
    import shutil

    write_dataset(tmp_path / "a", rng, n=4, layers=(0,), dim=4)
    write_dataset(tmp_path / "b", rng, n=4, layers=(0,), dim=4)
    (tmp_path / "link").symlink_to(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    for run in ("x1", "x2"):
        lmprobe.extract("lmprobe-tiny", f, out=tmp_path / run, layers="0", quiet=True)
    cases = [(["a", "a"], "parts 0 and 1 are the same dataset"), (["a", "b", "link"], "parts 0 and 2 are the same"),
             (["b", "copy", "a"], "parts 1 and 2 are the same"), (["x1", "x2"], "parts 0 and 1 were extracted from "
                                                                               "the same prompts")]
    for parts, message in cases:
        assert cli_main(["merge", *[str(tmp_path / p) for p in parts], "--out", str(tmp_path / "m")]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "every prompt twice" in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "m").exists()
    assert cli_main(["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m")]) == 0
    assert lmprobe.load(tmp_path / "m").num_prompts == 8


@pytest.mark.slow
def test_torchrun_two_processes_equal_one(llama_dir, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(p) for p in MANY) + "\n")
    args = ["extract", "--model", str(llama_dir), "--prompts", str(f), "--layers", "0,3", "--storage",
            "full_sequence", "--logits-topk", "3", "--batch-size", "4", "--quiet"]
    single = lmprobe.extract(str(llama_dir), f, out=tmp_path / "one", layers="0,3", storage="full_sequence",
                             logits_topk=3, batch_size=4, quiet=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "lmprobe", *args, "--out", str(tmp_path / "two")], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    two = lmprobe.load(tmp_path / "two")
    assert two.texts == single.texts and two.num_prompts == 21
    for layer in (0, 3):
        np.testing.assert_allclose(two.hidden(layer), single.hidden(layer), atol=1e-5, rtol=0)
        np.testing.assert_allclose(two.token_hidden(20, layer), single.token_hidden(20, layer), atol=1e-5, rtol=0)
        s1, s2 = single.statistics(layer), two.statistics(layer)
        assert s1["count"] == s2["count"]
        np.testing.assert_allclose(s2["mean"], s1["mean"], atol=1e-5)
    np.testing.assert_array_equal(two.logits_topk()[1], single.logits_topk()[1])
    assert validate(tmp_path / "two").ok
    assert not (tmp_path / "two/.lmprobe-parts").exists()


@pytest.mark.slow
def test_parts_made_with_other_batch_sizes_merge_and_keep_their_runs(tmp_path):
    """A batch size changes no stored value beyond float rounding, for a merge as for a resume;
    the merged dataset lists every part's runs, each at the row where its rows now start."""
    texts = [p["text"] for p in PROMPTS]
    a = lmprobe.extract("lmprobe-tiny", texts[:4], out=tmp_path / "a", layers="-1", batch_size=2, quiet=True)
    b = lmprobe.extract("lmprobe-tiny", texts[4:], out=tmp_path / "b", layers="-1", batch_size=3, quiet=True)
    assert cli_main(["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m")]) == 0
    m = lmprobe.load(tmp_path / "m")
    assert m.texts == texts
    np.testing.assert_array_equal(m.hidden(-1), np.concatenate([a.hidden(-1), b.hidden(-1)]))
    assert [(r["first_row"], r["batch_size"]) for r in m.info["runs"]] == [(0, 2), (4, 3)]


@pytest.mark.parametrize("where", ["same", "parent", "inside"])
def test_merge_refuses_an_output_that_overlaps_an_input(tmp_path, rng, capsys, where):
    a, b = tmp_path / "a", tmp_path / "parts" / "b"
    write_dataset(a, rng, n=4)
    write_dataset(b, rng, n=4)
    before = {p: p.read_bytes() for p in b.rglob("*") if p.is_file()}
    out = {"same": b, "parent": tmp_path / "parts", "inside": b / "merged"}[where]
    assert cli_main(["merge", str(a), str(b), "--out", str(out), "--overwrite"]) == 2
    assert "input" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in b.rglob("*") if p.is_file()} == before


KILL_DURING_MERGE = r"""
import os, sys
import lmprobe.format.merge as merge
real, n = merge._link, [0]
def link(src, dst):
    n[0] += 1
    if n[0] == int(sys.argv[3]):
        os.kill(os.getpid(), 9)
    real(src, dst)
merge._link = link
from lmprobe.cli import main
sys.exit(main(["merge", *sys.argv[1].split(","), "--out", sys.argv[2]]))
"""


@pytest.mark.parametrize("kill_at", [2, 5, 9])
def test_the_same_merge_command_finishes_a_killed_merge(tmp_path, rng, capsys, kill_at):
    import subprocess
    import sys

    parts = []
    for k in range(2):
        write_dataset(tmp_path / f"p{k}", rng, n=12, layers=(0, 1), dim=4, storage="full_sequence",
                      shard_size="256B", logits_topk=2)
        parts.append(str(tmp_path / f"p{k}"))
    out = tmp_path / "m"
    killed = subprocess.run([sys.executable, "-c", KILL_DURING_MERGE, ",".join(parts), str(out), str(kill_at)])
    assert killed.returncode == -9
    assert any(out.iterdir()) and not (out / INDEX).exists()
    assert cli_main(["merge", *parts, "--out", str(out)]) == 0
    assert cli_main(["merge", *parts, "--out", str(tmp_path / "whole")]) == 0
    got, want = lmprobe.load(out), lmprobe.load(tmp_path / "whole")
    assert lmprobe.validate(out).ok
    for layer in (0, 1):
        for i in range(24):
            np.testing.assert_array_equal(got.token_hidden(i, layer), want.token_hidden(i, layer))
    np.testing.assert_array_equal(got.logits_topk()[0], want.logits_topk()[0])
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == sorted(
        p.name for p in (tmp_path / "whole").rglob("*") if p.is_file())
    # another merge into the interrupted folder is refused: it would mix two merges' files
    killed = subprocess.run([sys.executable, "-c", KILL_DURING_MERGE, ",".join(parts), str(tmp_path / "k"), "2"])
    capsys.readouterr()
    assert cli_main(["merge", parts[0], "--out", str(tmp_path / "k")]) == 2
    assert "interrupted merge of other inputs" in capsys.readouterr().err
