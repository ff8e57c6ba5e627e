"""Writer -> reader round trips, odd sizes, dtypes, and the on-disk layout the document defines."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from support.datasets import write_dataset
from support.paths import ROOT

import lmprobe
from lmprobe.format.validate import validate
from lmprobe.format.values import bfloat16_bits_to_float32, float32_to_bfloat16_bits


def test_pooled_round_trip_with_logits(tmp_path, rng):
    src = write_dataset(tmp_path / "ds", rng, n=23, logits_topk=4)
    ds = lmprobe.load(tmp_path / "ds")
    assert ds.num_prompts == 23 and ds.layers == [0, 2, 5] and ds.dim == 8
    assert ds.storage == "pooled" and ds.dtype == "float32"
    for layer in ds.layers:
        np.testing.assert_array_equal(ds.hidden(layer), src["hidden"][layer])
    np.testing.assert_array_equal(ds.hidden(2, rows=[20, 3, 3, 0]), src["hidden"][2][[20, 3, 3, 0]])
    values, indices = ds.logits_topk()
    np.testing.assert_array_equal(values, src["lv"])
    np.testing.assert_array_equal(indices, src["li"])
    assert indices.dtype == np.int32
    np.testing.assert_array_equal(ds.labels, src["labels"])
    assert ds.index["num_tokens"].tolist() == src["n_tok"].tolist()
    assert ds.index["source"].tolist() == [f"src{i % 2}" for i in range(23)]
    assert ds.texts == src["texts"]
    rep = validate(tmp_path / "ds")
    assert rep.ok and not rep.warnings, str(rep)


def test_full_sequence_round_trip(tmp_path, rng):
    src = write_dataset(tmp_path / "ds", rng, n=17, storage="full_sequence", shard_size=6 * 32, logits_topk=3)
    ds = lmprobe.load(tmp_path / "ds")
    h = ds.info["tensors"]["hidden_layers"]
    lts = h["last_token_shards"]
    assert lts >= 2 and len(h["shards"]) > lts
    ends = src["tok_start"][1:] - 1
    for layer in ds.layers:
        np.testing.assert_array_equal(ds.hidden(layer), src["hidden"][layer][ends])
        for i in range(17):
            s, e = src["tok_start"][i], src["tok_start"][i + 1]
            np.testing.assert_array_equal(ds.token_hidden(i, layer), src["hidden"][layer][s:e])
    df = ds.index
    for _, row in df.iterrows():
        assert len(row["token_shard_ids"]) == row["num_tokens"]
        assert row["token_shard_ids"][-1] == row["shard_index"] < lts
        assert row["token_shard_offsets"][-1] == row["row_offset"] == row["token_offset"]
        assert all(s >= lts for s in row["token_shard_ids"][:-1])
    # last-token shards hold one token per prompt; sequence shards the rest
    assert all(s["num_tokens"] == s["num_prompts"] for s in h["shards"][:lts])
    assert sum(s["num_tokens"] for s in h["shards"][lts:]) == int(src["n_tok"].sum()) - 17
    assert validate(tmp_path / "ds").ok


def test_shards_cut_by_byte_budget_with_the_same_boundaries_in_every_layer(tmp_path, rng):
    write_dataset(tmp_path / "ds", rng, n=23, dim=8, shard_size="160B")  # 160 B = 5 rows of 8 float32
    ds = lmprobe.load(tmp_path / "ds")
    shards = ds.info["tensors"]["hidden_layers"]["shards"]
    assert [s["num_prompts"] for s in shards] == [5, 5, 5, 5, 3]
    for s, d in enumerate(shards):
        for layer in ds.layers:
            path = tmp_path / "ds" / f"tensors/hidden_layer{layer:03d}_shard{s:03d}.safetensors"
            assert d["files"][str(layer)]["bytes"] == path.stat().st_size
            with safe_open(str(path), "np") as f:
                assert f.get_slice(f"hidden.layer_{layer}").get_shape() == [d["num_prompts"], 8]
    df = ds.index
    assert df["shard_index"].tolist() == [i // 5 for i in range(23)]
    assert df["row_offset"].tolist() == [i % 5 for i in range(23)]


@pytest.mark.parametrize("storage", ["pooled", "full_sequence"])
def test_count_that_is_an_exact_multiple_of_the_shard_size(tmp_path, rng, storage):
    write_dataset(tmp_path / "ds", rng, n=20, dim=8, shard_size="160B", storage=storage, max_tokens=1)
    ds = lmprobe.load(tmp_path / "ds")
    h = ds.info["tensors"]["hidden_layers"]
    assert [s["num_prompts"] for s in h["shards"]] == [5, 5, 5, 5]  # no empty trailing shard
    assert validate(tmp_path / "ds").ok


def test_one_prompt(tmp_path, rng):
    src = write_dataset(tmp_path / "ds", rng, n=1, storage="full_sequence", logits_topk=2)
    ds = lmprobe.load(tmp_path / "ds")
    assert ds.num_prompts == 1
    np.testing.assert_array_equal(ds.token_hidden(0, 5), src["hidden"][5])
    assert validate(tmp_path / "ds").ok


def test_one_token_prompts_full_sequence(tmp_path, rng):
    src = write_dataset(tmp_path / "ds", rng, n=9, storage="full_sequence", max_tokens=1)
    ds = lmprobe.load(tmp_path / "ds")
    h = ds.info["tensors"]["hidden_layers"]
    assert len(h["shards"]) == h["last_token_shards"]  # nothing besides last tokens to store
    for i in range(9):
        np.testing.assert_array_equal(ds.token_hidden(i, 0), src["hidden"][0][i : i + 1])
    assert validate(tmp_path / "ds").ok


def test_prompt_larger_than_the_budget_gets_its_own_shard(tmp_path, rng):
    src = write_dataset(tmp_path / "ds", rng, n=6, storage="full_sequence", shard_size="64B", min_tokens=4,
                        max_tokens=9, dim=8)
    ds = lmprobe.load(tmp_path / "ds")
    for i in range(6):
        s, e = src["tok_start"][i], src["tok_start"][i + 1]
        np.testing.assert_array_equal(ds.token_hidden(i, 2), src["hidden"][2][s:e])
    assert validate(tmp_path / "ds").ok


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 30), budget_rows=st.integers(1, 12), batch=st.integers(1, 9), max_tokens=st.integers(1, 7),
       storage=st.sampled_from(["pooled", "full_sequence"]))
# found on the first writer: a one-token prompt after a prompt larger than the shard budget crashed it
@example(n=3, budget_rows=1, batch=1, max_tokens=3, storage="full_sequence")
def test_addressing_properties(tmp_path_factory, n, budget_rows, batch, max_tokens, storage):
    rng = np.random.default_rng(n * 1000 + budget_rows)
    out = tmp_path_factory.mktemp("prop") / "ds"
    src = write_dataset(out, rng, n=n, layers=(1,), dim=4, shard_size=budget_rows * 16, batch=batch,
                        max_tokens=max_tokens, storage=storage, logits_topk=2, checkpoint_interval=0)
    ds = lmprobe.load(out)
    h = ds.info["tensors"]["hidden_layers"]
    # every shard within budget unless a single prompt alone is larger
    for s in range(len(h["shards"])):
        rows = h["shards"][s].get("num_tokens", h["shards"][s]["num_prompts"])
        assert rows >= 1
        assert rows <= budget_rows or h["shards"][s]["num_prompts"] == 1
    ends = src["tok_start"][1:] - 1
    want_last = src["hidden"][1][ends] if storage == "full_sequence" else src["hidden"][1]
    np.testing.assert_array_equal(ds.hidden(1), want_last)
    if storage == "full_sequence":
        i = n // 2
        np.testing.assert_array_equal(ds.token_hidden(i, 1), src["hidden"][1][src["tok_start"][i] : src["tok_start"][i + 1]])
    np.testing.assert_array_equal(ds.logits_topk()[1], src["li"])
    rep = validate(out)
    assert rep.ok, str(rep)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_dtypes_are_recorded_truthfully(tmp_path, rng, dtype):
    src = write_dataset(tmp_path / "ds", rng, n=10, dtype=dtype)
    ds = lmprobe.load(tmp_path / "ds")
    assert ds.dtype == dtype
    h = ds.info["tensors"]["hidden_layers"]
    assert h["row_bytes"] == 8 * 2
    with safe_open(str(tmp_path / "ds/tensors/hidden_layer000_shard000.safetensors"), "pt") as f:
        t = f.get_tensor("hidden.layer_0")
    import torch

    assert t.dtype == {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    want = src["hidden"][0]
    if dtype == "float16":
        np.testing.assert_array_equal(ds.hidden(0), want.astype(np.float16))
    else:
        np.testing.assert_array_equal(ds.hidden(0), torch.from_numpy(want).to(torch.bfloat16).float().numpy())
        assert ds.hidden(0, as_torch=True).dtype == torch.bfloat16
    assert validate(tmp_path / "ds").ok


def test_bfloat16_rounding_matches_torch(rng):
    import torch

    x = np.concatenate([rng.normal(size=1000).astype(np.float32) * 1e3, [0.0, -0.0, np.inf, -np.inf, 1e-40]]).astype(np.float32)
    ours = bfloat16_bits_to_float32(float32_to_bfloat16_bits(x))
    theirs = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(ours, theirs)
    assert np.isnan(bfloat16_bits_to_float32(float32_to_bfloat16_bits(np.array([np.nan], np.float32))))[0]


def test_torch_input_and_output(tmp_path):
    import torch

    from lmprobe.format.writer import DatasetWriter

    x = torch.randn(3, 4)
    with DatasetWriter(tmp_path / "ds", layers=[0], dim=4, model_name="m") as w:
        w.add_batch(texts=["a", "b", "c"], num_tokens=[1, 1, 1], hidden={0: x})
    t = lmprobe.load(tmp_path / "ds").hidden(0, as_torch=True)
    assert isinstance(t, torch.Tensor)
    torch.testing.assert_close(t, x, rtol=0, atol=0)


def test_index_schema_and_metadata(tmp_path, rng):
    from lmprobe.format.writer import DatasetWriter

    with DatasetWriter(tmp_path / "ds", layers=[3, 1], dim=2, model_name="org/m", model_revision="abc123",
                       storage="full_sequence", logits_topk=2, label_type="string", perplexity=True, token_ids=True,
                       token_strings=True, token_perplexity=True, columns={"zeta": "float64", "alpha": "bool"}) as w:
        w.add_batch(texts=["hi there", "x"], num_tokens=[2, 1], labels=["pos", None],
                    hidden={3: np.zeros((3, 2)), 1: np.ones((3, 2))},
                    logits_values=[[2.0, 1.0], [3.0, 0.5]], logits_indices=[[5, 6], [7, 8]],
                    perplexity_mean=[3.0, 1.0], perplexity_min=[2.0, 1.0], perplexity_max=[4.0, 1.0],
                    token_ids=[[10, 11], [12]], token_strings=[["hi", " there"], ["x"]], token_perplexity=[[3.0], []],
                    columns={"zeta": [0.5, None], "alpha": [True, False]})
    table = pq.read_table(tmp_path / "ds/index/train-00000-of-00001.parquet")
    assert table.schema.names == [
        "text", "label", "num_tokens", "shard_index", "row_offset", "token_offset", "token_shard_ids",
        "token_shard_offsets", "shard_index_logits", "row_offset_logits", "perplexity_mean", "perplexity_min",
        "perplexity_max", "token_ids", "token_perplexity", "token_strings", "zeta", "alpha",
    ]
    import pyarrow as pa

    types = {f.name: f.type for f in table.schema}
    assert types["label"] == pa.string() and types["num_tokens"] == pa.int32() and types["shard_index"] == pa.int32()
    assert types["token_offset"] == pa.int64() and types["token_shard_ids"] == pa.list_(pa.int64())
    assert types["perplexity_mean"] == pa.float64() and types["token_strings"] == pa.list_(pa.string())
    meta = {k.decode(): json.loads(v) for k, v in table.schema.metadata.items()}
    assert set(meta) >= {"lmprobe:format_version", "lmprobe:model", "lmprobe:num_prompts", "lmprobe:prompt_ordering",
                         "lmprobe:tensors", "lmprobe:provenance"}
    assert meta["lmprobe:format_version"] == "2.0"
    assert meta["lmprobe:model"] == {"name": "org/m", "revision": "abc123"}
    assert meta["lmprobe:prompt_ordering"] == "input"
    prov = meta["lmprobe:provenance"]
    import platform

    import torch
    import transformers

    assert prov["torch_version"] == torch.__version__ and prov["transformers_version"] == transformers.__version__
    assert prov["python_version"] == platform.python_version() and prov["lmprobe_version"] == lmprobe.__version__
    lg = meta["lmprobe:tensors"]["logits_topk"]
    assert lg["row_bytes"] == 2 * (4 + 4) and lg["keys"] == {"values": "topk_values", "indices": "topk_indices"}
    with safe_open(str(tmp_path / "ds" / lg["shards"][0]["file"]), "np") as f:
        assert f.get_tensor("topk_values").dtype == np.float32 and f.get_tensor("topk_indices").dtype == np.int32
    assert meta["lmprobe:tensors"]["hidden_layers"]["layers"] == [3, 1]
    assert validate(tmp_path / "ds").ok


def test_nothing_but_the_dataset_is_left_behind(tmp_path, rng):
    write_dataset(tmp_path / "ds", rng, n=12, storage="full_sequence", logits_topk=2)
    names = sorted(p.relative_to(tmp_path / "ds").as_posix() for p in (tmp_path / "ds").rglob("*") if p.is_file())
    assert "README.md" in names and "index/train-00000-of-00001.parquet" in names
    assert all(n.startswith("tensors/") or n in ("README.md", "index/train-00000-of-00001.parquet") for n in names)
    assert not any(n.endswith((".tmp", ".t1")) for n in names)


def test_reads_are_one_pass_per_shard(tmp_path, rng, monkeypatch):
    write_dataset(tmp_path / "ds", rng, n=23, shard_size="160B")
    from lmprobe.format import gather

    calls = []
    real = gather.read_rows_into
    monkeypatch.setattr(gather, "read_rows_into", lambda *a, **k: (calls.append(a[0]), real(*a, **k))[1])
    ds = lmprobe.load(tmp_path / "ds")
    ds.hidden(0)
    assert len(calls) == 5  # five shards, one read each, for 23 rows
    calls.clear()
    ds.hidden(0, rows=[22, 0, 1, 21])
    assert len(calls) == 2


def test_opening_leaves_per_token_columns_on_disk_and_reads_them_by_row_group(tmp_path, rng, monkeypatch):
    """Corpus scale: the index is cut into row groups by tokens, and a prompt's tokens come from its group alone."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lmprobe.format import index as index_mod

    monkeypatch.setattr(index_mod, "ROW_GROUP_TOKENS", 64)  # many small groups
    src = write_dataset(tmp_path / "ds", rng, n=40, layers=(0,), dim=3, storage="full_sequence", min_tokens=2,
                        max_tokens=12, token_ids=True, batch=5, checkpoint_interval=0)
    path = tmp_path / "ds/index/train-00000-of-00001.parquet"
    md = pq.ParquetFile(path).metadata
    assert md.num_row_groups > 5
    for g in range(md.num_row_groups):
        rows = md.row_group(g).num_rows
        lengths = pq.ParquetFile(path).read_row_group(g, columns=["num_tokens"]).column("num_tokens").to_numpy()
        assert rows == 1 or 3 * lengths.sum() <= 64  # ids, offsets and token_ids: 3 entries per token
    read_columns = []
    real_read = pq.ParquetFile.read
    monkeypatch.setattr(pq.ParquetFile, "read", lambda self, columns=None, **kw: (
        read_columns.append(columns), real_read(self, columns=columns, **kw))[1])
    ds = lmprobe.load(tmp_path / "ds")
    assert not read_columns  # opening reads the footer only (a merge opens every part)
    assert ds.labels is not None  # the per-prompt columns, on first use
    assert read_columns and all(c is not None and "token_shard_ids" not in c for c in read_columns)
    full = pq.read_table(path)
    for rows in ([7], [39, 2, 15, 2], list(rng.permutation(40)[:17])):
        got = ds.token_columns(["token_ids", "token_shard_offsets"], rows)
        for name in got:
            assert got[name].to_pylist() == full.column(name).take(pa.array(rows)).to_pylist()
    for i in (0, 13, 39):
        np.testing.assert_array_equal(ds.token_hidden(i, 0), src["hidden"][0][src["tok_start"][i]:src["tok_start"][i + 1]])


def test_negative_layers_count_back_from_the_last_as_in_extract(tmp_path, rng):
    """One layer grammar in Python and on the command line (-1 is the last layer)."""
    from lmprobe.errors import LayerNotFoundError

    src = write_dataset(tmp_path / "ds", rng, n=9, layers=(0, 2, 5), dim=4, storage="full_sequence", statistics=True)
    ds = lmprobe.load(tmp_path / "ds")
    np.testing.assert_array_equal(ds.hidden(-1), ds.hidden(5))
    np.testing.assert_array_equal(ds.token_hidden(3, -1), src["hidden"][5][src["tok_start"][3]:src["tok_start"][4]])
    np.testing.assert_array_equal(ds.hidden(-4, rows=[1]), ds.hidden(2, rows=[1]))  # 6 layers: -4 is layer 2
    assert ds.statistics(-1)["count"] == ds.statistics(5)["count"]
    with pytest.raises(LayerNotFoundError, match=r"layer -2 \(layer 4\) is not stored in this dataset; stored layers: "
                                                 r"\[0, 2, 5\]"):
        ds.hidden(-2)
    with pytest.raises(LayerNotFoundError, match=r"layer -7 does not exist: .*-1\.\.-6"):
        ds.hidden(-7)


def test_a_writer_takes_a_spec_and_its_fields_once(tmp_path, rng):
    """What a dataset holds is one DatasetSpec: given to the writer, it writes the very bytes the same fields given
    as keywords write; giving both is a TypeError, a bad field the same one-line error either way, and no field
    is also a keyword of the writer (each setting is written once)."""
    import dataclasses
    import inspect

    from lmprobe.errors import InvalidArgumentError
    from lmprobe.format import DatasetSpec, DatasetWriter

    fields = dict(layers=[0, 2], dim=4, model_name="test/model", storage="full_sequence", dtype="bfloat16",
                  shard_size="96B", logits_topk=2, label_type="int", columns={"source": "string"}, token_ids=True,
                  perplexity=True, prompt_ordering="input", statistics=True, hookpoints=["resid_post", "mlp_in"],
                  metadata={"note": "a spec"}, provenance={"created_at": "2024-01-01T00:00:00+00:00"})
    n_tok = np.array([3, 1, 4, 2])
    acts = {hp: {layer: rng.normal(size=(int(n_tok.sum()), 4)).astype(np.float32) for layer in (0, 2)}
            for hp in ("resid_post", "mlp_in")}
    logits = -np.sort(-rng.normal(size=(4, 2)).astype(np.float32), axis=1)

    def write(out, writer):
        with writer as w:
            w.add_batch(texts=["a b c", "d", "e f g h", "i j"], num_tokens=n_tok, hidden=acts, labels=[0, 1, 0, 1],
                        columns={"source": ["x"] * 4}, logits_values=logits, logits_indices=[[1, 2]] * 4,
                        token_ids=[list(range(int(t))) for t in n_tok], perplexity_mean=[1.0] * 4,
                        perplexity_min=[1.0] * 4, perplexity_max=[1.0] * 4)
        return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}

    by_keywords = write(tmp_path / "kw", DatasetWriter(tmp_path / "kw", **fields))
    by_spec = write(tmp_path / "spec", DatasetWriter(tmp_path / "spec", DatasetSpec(**fields), overwrite=True))
    assert len([f for f in by_spec if f.startswith("tensors/")]) > 4  # several shards, logits and statistics
    assert by_spec == by_keywords
    ds = lmprobe.load(tmp_path / "spec")
    assert ds.hookpoints == ["resid_post", "mlp_in"] and ds.info["note"] == "a spec"

    with pytest.raises(TypeError, match="not both"):
        DatasetWriter(tmp_path / "both", DatasetSpec(**fields), layers=[1])
    for make in (lambda: DatasetSpec(layers=[0], dim=0, model_name="m"),
                 lambda: DatasetWriter(tmp_path / "bad", layers=[0], dim=0, model_name="m")):
        with pytest.raises(InvalidArgumentError, match=r"^dim must be a positive integer, got 0$"):
            make()
    with pytest.raises(InvalidArgumentError, match="cannot read 'lots' as a size"):
        DatasetWriter(tmp_path / "bad", layers=[0], dim=4, model_name="m", shard_size="lots")
    assert not (tmp_path / "bad").exists() and not (tmp_path / "both").exists()

    spec_fields = {f.name for f in dataclasses.fields(DatasetSpec)}
    assert not spec_fields & set(inspect.signature(DatasetWriter).parameters)
    source = inspect.getsource(DatasetSpec)
    for name in spec_fields:  # a docstring under each field
        assert source.split(f"\n    {name}:", 1)[1].split("\n", 2)[1].strip().startswith('"""'), name


#: a Dataset's public members: the user's (docs/python-api.md) and the internal API lmprobe's other modules use
#: (docs/architecture.md); the shard reading engine's own (check_entry, read_hidden_rows, ...) are on ``ds.shards``
DATASET_MEMBERS = {
    # the user's
    "info", "index", "table", "layers", "dim", "dtype", "storage", "num_prompts", "model", "hookpoints", "labels",
    "texts", "hidden", "token_hidden", "logits_topk", "prompt", "token_lengths", "statistics",
    # the internal API
    "files", "source", "meta", "schema", "index_path", "identity", "prompt_table", "column_names", "token_columns",
    "iter_index", "row_indices", "check_layer", "hidden_desc", "column", "layers_here", "default_layers",
    "logits_here", "local_tokenizer", "shards",
}


def test_a_dataset_shows_its_documented_members_only(tmp_path, rng):
    """Autocompletion on a Dataset lists what the docs describe, not the engine that reads its shards."""
    import re

    write_dataset(tmp_path / "ds", rng, n=5, storage="full_sequence")
    ds = lmprobe.load(tmp_path / "ds")
    # less what every object has: nnsight, once imported (an earlier test in the session), mounts .save on all
    assert {n for n in dir(ds) if not n.startswith("_")} - set(dir(object())) == DATASET_MEMBERS
    docs = ROOT / "docs"
    text = (docs / "python-api.md").read_text() + (docs / "architecture.md").read_text()
    assert [n for n in sorted(DATASET_MEMBERS) if not re.search(rf"`(\.|Dataset\.)?{n}\b", text)] == []
    for name in ("check_entry", "hidden_header_entry", "check_tensor", "tensor", "hidden_shard", "fetch",
                 "check_addresses", "check_token_counts", "token_addresses", "read_hidden_rows"):
        assert not hasattr(ds, name) and callable(getattr(ds.shards, name)), name
    ids, offs, lengths = ds.shards.token_addresses([1, 3])
    np.testing.assert_array_equal(ds.shards.read_hidden_rows(2, ids, offs),
                                  np.concatenate([ds.token_hidden(1, 2), ds.token_hidden(3, 2)]))
