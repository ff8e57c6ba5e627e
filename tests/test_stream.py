"""The streaming training reader: every stored vector once per pass, shuffled, seeded, from disk or the Hub."""

from __future__ import annotations

import uuid

import numpy as np
from conftest import write_dataset

import lmprobe
from lmprobe.stream import ShardStream


def _all_vectors(src, layer):
    return src["hidden"][layer]


def test_every_vector_once_shuffled_and_seeded(tmp_path, rng):
    src = write_dataset(tmp_path / "ds", rng, n=40, layers=(0, 2), dim=4, storage="full_sequence", shard_size="256B")
    stream = ShardStream(tmp_path / "ds", 2, 16, seed=5, pool_shards=2, prefetch=1)
    batches = list(stream)
    got = np.concatenate(batches)
    want = _all_vectors(src, 2)
    assert len(stream) == len(want) == len(got)
    assert all(len(b) == 16 for b in batches[:-1])
    np.testing.assert_array_equal(np.sort(got, axis=0), np.sort(want, axis=0))
    assert not np.array_equal(got, want)
    np.testing.assert_array_equal(np.concatenate(list(ShardStream(tmp_path / "ds", 2, 16, seed=5, pool_shards=2))),
                                  got)
    other = np.concatenate(list(ShardStream(tmp_path / "ds", 2, 16, seed=6, pool_shards=2)))
    assert not np.array_equal(other, got)


def test_torch_workers_split_the_shards(tmp_path, rng):
    import torch

    src = write_dataset(tmp_path / "ds", rng, n=30, layers=(1,), dim=3, storage="full_sequence", shard_size="128B")
    stream = ShardStream(tmp_path / "ds", 1, 8, seed=0)
    loader = torch.utils.data.DataLoader(stream.torch_dataset(), batch_size=None, num_workers=2)
    got = torch.cat(list(loader)).numpy()
    np.testing.assert_array_equal(np.sort(got, axis=0), np.sort(src["hidden"][1], axis=0))


def test_stream_from_the_hub(hub, tmp_path, rng, fresh_hf_cache):
    src = write_dataset(tmp_path / "ds", rng, n=20, layers=(0,), dim=4, storage="full_sequence", shard_size="256B")
    repo = f"tester/stream-{uuid.uuid4().hex[:8]}"
    lmprobe.push_to_hub(tmp_path / "ds", repo, quiet=True)
    got = np.concatenate(list(ShardStream(f"hf://datasets/{repo}", 0, 7, seed=1)))
    np.testing.assert_array_equal(np.sort(got, axis=0), np.sort(src["hidden"][0], axis=0))


def test_pooled_dataset_streams_last_tokens(tmp_path, rng):
    src = write_dataset(tmp_path / "ds", rng, n=25, layers=(0,), dim=4, dtype="bfloat16", shard_size="64B")
    got = np.concatenate(list(ShardStream(tmp_path / "ds", 0, 10, shuffle=False)))
    np.testing.assert_array_equal(got, lmprobe.load(tmp_path / "ds").hidden(0))
    assert len(src["texts"]) == len(got)
