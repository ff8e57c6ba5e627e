"""Shard file layout at scale: names that sort in shard order and folders the Hub takes, and sequence
shards that leave the machine as they close.

A dataset of under 1,000 shards per layer keeps today's names (``tensors/hidden_layer003_shard012.safetensors``,
what lmprobe 0.10.3 reads); a larger one is ``nested``: a folder per hookpoint and layer, 5-digit shard numbers
(docs/format.md, "Shard file layout").
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
from support.datasets import write_dataset

import lmprobe
from lmprobe.errors import InvalidArgumentError
from lmprobe.format.spec import INDEX_PATH
from lmprobe.format.staging import PROVISIONAL_DIR
from lmprobe.format.writer import DatasetWriter


def _files(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.safetensors"))


def test_a_nested_dataset_keeps_each_layer_in_a_folder_with_names_in_shard_order(tmp_path, rng):
    n, dim = 40, 8
    lengths = rng.integers(1, 6, size=n)
    total = int(lengths.sum())
    acts = {(hp, layer): rng.normal(size=(total, dim)).astype(np.float32) for hp in ("resid_post", "mlp_out")
            for layer in (0, 2)}
    starts = np.concatenate([[0], np.cumsum(lengths)])
    with DatasetWriter(tmp_path / "ds", layers=[0, 2], dim=dim, model_name="m", storage="full_sequence",
                       shard_size=3 * dim * 4, logits_topk=3, layout="nested", hookpoints=("resid_post", "mlp_out"),
                       statistics=True) as w:
        for s in range(0, n, 8):
            w.add_batch(texts=[f"p{i}" for i in range(s, s + 8)], num_tokens=lengths[s:s + 8],
                        hidden={k: v[starts[s]:starts[s + 8]] for k, v in acts.items()},
                        logits_values=-np.sort(-rng.normal(size=(8, 3)).astype(np.float32), axis=1),
                        logits_indices=rng.integers(0, 100, size=(8, 3)))
    src = {"hidden": {layer: acts[("resid_post", layer)] for layer in (0, 2)}}
    ds = lmprobe.load(tmp_path / "ds")
    n_shards = len(ds.meta.hidden.shards)
    assert n_shards > 12  # enough that 3-digit names would be needed, and sorting matters
    files = _files(tmp_path / "ds")
    for folder in ("hidden", "mlp_out"):  # resid_post (hidden_layers) and the other hookpoint
        for layer in (0, 2):
            mine = [f for f in files if f.startswith(f"tensors/{folder}/layer{layer:03d}/")]
            assert mine == [f"tensors/{folder}/layer{layer:03d}/shard{s:05d}.safetensors" for s in range(n_shards)]
    logits = [f for f in files if f.startswith("tensors/logits_topk/")]
    assert logits == sorted(logits) and len(logits) == len(ds.meta.logits.shards)
    assert not [f for f in files if f.count("/") == 1 and not f.startswith("tensors/statistics")]  # nothing flat
    for layer in (0, 2):
        np.testing.assert_array_equal(np.concatenate([ds.token_hidden(i, layer) for i in range(40)]),
                                      src["hidden"][layer])
        np.testing.assert_array_equal(np.concatenate([ds.token_hidden(i, layer, hookpoint="mlp_out") for i in range(40)]),
                                      acts[("mlp_out", layer)])
    assert lmprobe.validate(tmp_path / "ds").ok
    # a third party follows the format document: file_pattern and the index, nothing else
    table = pq.read_table(tmp_path / "ds" / INDEX_PATH)
    meta = json.loads(table.schema.metadata[b"lmprobe:tensors"])
    row = table.slice(7, 1).to_pylist()[0]
    from safetensors.numpy import load_file

    h = meta["hidden_layers"]
    got = [load_file(str(tmp_path / "ds" / h["file_pattern"].format(layer=2, shard=s)))[h["key_pattern"].format(layer=2)][o]
           for s, o in zip(row["token_shard_ids"], row["token_shard_offsets"], strict=True)]
    np.testing.assert_array_equal(np.stack(got), ds.token_hidden(7, 2))


def test_today_s_names_stay_for_a_flat_dataset(tmp_path, rng):
    write_dataset(tmp_path / "ds", rng, n=9, layers=(1,), dim=4, shard_size=4 * 16)
    assert all(f.startswith("tensors/hidden_layer001_shard") for f in _files(tmp_path / "ds"))


def test_a_shard_larger_than_the_hub_takes_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(InvalidArgumentError, match="16 GiB"):
        DatasetWriter(tmp_path / "ds", layers=[0], dim=4, model_name="m", shard_size="17GiB")
    assert not (tmp_path / "ds").exists()
    with pytest.raises(lmprobe.LmprobeError, match=r"--shard-size 20GiB is more than a shard may hold.*16GiB or less"):
        lmprobe.ExtractionConfig(model="lmprobe-tiny", prompts=["a"], out=str(tmp_path / "x"), shard_size="20GiB")


def test_sequence_shards_leave_as_they_close_and_are_renamed_where_they_went(tmp_path, rng):
    """An output that uploads shards and deletes them here: sequence shards go under provisional names while the
    model computes (their numbers follow the last-token shards', known at the end), then one rename each."""
    remote = tmp_path / "remote"
    events: list[tuple] = []

    def complete(rel):  # an upload that deletes the local copy
        (remote / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(tmp_path / "ds" / rel, remote / rel)
        events.append(("up", rel))

    def renamed(old, new):
        (remote / new).parent.mkdir(parents=True, exist_ok=True)
        (remote / old).rename(remote / new)
        events.append(("mv", old, new))

    n, dim = 30, 8
    lengths = rng.integers(2, 9, size=n)
    hidden = rng.normal(size=(int(lengths.sum()), dim)).astype(np.float32)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    w = DatasetWriter(tmp_path / "ds", layers=[0], dim=dim, model_name="m", storage="full_sequence",
                      shard_size=5 * dim * 4, on_file_complete=complete, on_file_renamed=renamed,
                      checkpoint_interval=0)
    for s in range(0, n, 3):
        w.add_batch(texts=[f"p{i}" for i in range(s, s + 3)], num_tokens=lengths[s:s + 3],
                    hidden={0: hidden[starts[s]:starts[s + 3]]})
        w.checkpoint()
    early = [e for e in events if e[0] == "up" and e[1].startswith(PROVISIONAL_DIR)]
    assert len(early) >= 5  # sequence shards left while the writer was still writing
    staged = list((tmp_path / "ds" / ".lmprobe-staging").glob("seq-*.safetensors"))
    assert len(staged) <= 2  # what stays here is bounded: the open shard, and one closed since the checkpoint
    w.close()
    moves = [e for e in events if e[0] == "mv"]
    assert {old for _, old, _ in moves} == {rel for _, rel in early}
    shutil.copytree(remote, tmp_path / "ds", dirs_exist_ok=True)
    assert not list((tmp_path / "ds" / PROVISIONAL_DIR).glob("*"))
    ds = lmprobe.load(tmp_path / "ds")
    np.testing.assert_array_equal(np.concatenate([ds.token_hidden(i, 0) for i in range(n)]), hidden)
    assert lmprobe.validate(tmp_path / "ds").ok
